"""Device discipline, checked on a CPU-only machine.

* Every collective of the sync path goes through ``delta_sync.collectives``, which checks each
  tensor against its group's backend: a host tensor into NCCL/HCCL, a device tensor into gloo, or
  float64 anywhere fails here, not at the first update on an accelerator.
* The pure tensor functions (digests, loader-view apply and read, the fast path's mapping) run on
  fake "cuda" tensors (FakeTensorMode works on this CPU build and raises on host/device mixing).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from delta_sync import accelerator, collectives
from delta_sync.collectives import DeviceMismatch
from delta_sync.errors import DeviceNotAvailable, PatchValidationError

ROOT = Path(__file__).resolve().parents[1]
#: torch.distributed calls that move tensors or objects between ranks
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "send", "recv", "isend", "irecv", "reduce_scatter", "reduce_scatter_tensor",
               "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "allreduce", "allgather"}


class FakeGroup:
    """A process group that only reports its backend: enough for the device check."""

    def __init__(self, backend: str):
        self.backend = backend

    def name(self) -> str:
        return self.backend


def fake_cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype, device="cuda")


@pytest.mark.parametrize("backend", ["nccl", "hccl"])
def test_host_tensor_into_a_device_group_is_refused(backend):
    with pytest.raises(DeviceMismatch, match=f"broadcast on device group \\({backend}\\): host tensor"):
        collectives.check("broadcast", FakeGroup(backend), torch.zeros(3))
    with FakeTensorMode():
        collectives.check("broadcast", FakeGroup(backend), fake_cuda(3))  # a device tensor is fine


def test_device_tensor_into_the_host_group_and_float64_are_refused():
    with FakeTensorMode():
        with pytest.raises(DeviceMismatch, match="host group \\(gloo\\): tensor on cuda"):
            collectives.check("all_gather_into_tensor", FakeGroup("gloo"), torch.zeros(2), fake_cuda(2))
    with pytest.raises(DeviceMismatch, match="float64"):
        collectives.check("all_reduce", FakeGroup("gloo"), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(DeviceMismatch, match="Python objects go over the host group"):
        collectives.all_gather_object({"a": 1}, FakeGroup("nccl"))


def test_mixed_group_routes_each_tensor_by_device():
    mixed = FakeGroup("cpu:gloo,cuda:nccl")
    collectives.check("all_reduce", mixed, torch.zeros(2))
    with FakeTensorMode():
        collectives.check("all_reduce", mixed, fake_cuda(2))
    with pytest.raises(DeviceMismatch, match="no backend for a tensor on meta"):
        collectives.check("all_reduce", mixed, torch.empty(2, device="meta"))


def _direct_collectives(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name in ("dist", "distributed", "pg", "c10d") or name.endswith("pg"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}.{node.func.attr}")
    return found


def test_no_module_of_the_sync_path_calls_collectives_directly():
    files = [p for d in ("delta_sync", "update_weight", "patches") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 20
    direct = [hit for p in files if p.name != "collectives.py" for hit in _direct_collectives(p)]
    assert direct == [], "call delta_sync.collectives instead (it checks devices against the group):\n" + \
        "\n".join(direct)


def test_the_scan_finds_a_direct_call(tmp_path):
    bad = ROOT / "delta_sync" / "_probe_direct_call.py"
    bad.write_text("import torch.distributed as dist\n\ndef f(t):\n    dist.all_reduce(t)\n")
    try:
        assert _direct_collectives(bad) == ["delta_sync/_probe_direct_call.py:4 dist.all_reduce"]
    finally:
        bad.unlink()


# ---- pure tensor functions on fake device tensors ---------------------------------------------
def test_digests_stay_on_the_device():
    from delta_sync.digest import element_sums, lane_sums

    with FakeTensorMode():
        v = fake_cuda(1000)
        sums = lane_sums(v.view(torch.int16), 7, exp_mask=0x7F80)
        assert sums.device.type == "cuda" and sums.shape == (5,)
        idx = torch.arange(1000, device="cuda")
        assert element_sums(idx, v).device.type == "cuda"
        with pytest.raises(Exception, match="[Dd]evice"):  # a host index against device values
            element_sums(torch.arange(1000), v)


def _stand_in_views():
    from patches.loader_views import probe_views

    from .test_loader_views import SPECS, FusedStandIn

    model = FusedStandIn()
    views, _ = probe_views(model, [(n, s, torch.float32) for n, s in SPECS], whole=False)  # "cols" is a TP shard
    return views, {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_loader_views_read_on_the_device():
    """What the engine digests (read_through, view_sums) and its undo log stay on the parameters'
    device. (Fake "cuda" tensors cannot ``copy_`` on this CPU build, so the writes are covered by
    the CPU tests and launchers/device_check.sh.)"""
    from patches.loader_views import UndoLog, read_through, view_sums

    views, shapes = _stand_in_views()
    with FakeTensorMode():
        params = {n: torch.nn.Parameter(torch.empty(s, device="cuda"), requires_grad=False)
                  for n, s in shapes.items()}
        for name in ("q", "cols", "tr"):  # contiguous, column-sliced, transposed segments
            view = views[name]
            idx, vals = read_through(view, params)
            assert idx.device.type == vals.device.type == "cuda"
            sums, _ = view_sums(view, params)
            assert sums.device.type == "cuda"
        undo = UndoLog()
        flat = params["qk"].view(-1)
        undo.record_positions(flat, torch.arange(3, device="cuda"))
        undo.restore()


def test_fast_path_mapping_runs_where_the_shard_lives():
    from delta_sync.runs import few_runs, host_runs, owned_runs, place_runs, run_table

    local = torch.arange(0, 32)
    (b0, n0, t0), (b1, n1, t1) = owned_runs(local[:16], True), owned_runs(local[16:], True)
    host = host_runs([(b0, n0, 0, t0 + 100), (b1, n1, 1, t1 + 16)])  # the probed plan
    with FakeTensorMode(allow_non_fake_inputs=True):
        params = [torch.empty(4, 8, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        runs = [place_runs(p, *host, few=few_runs(*host)) for p in params]
        assert runs[0].local.device.type == "cuda"  # the runs moved to the shard's device
        table = run_table(runs, [0, 1], torch.tensor([3, 5]))  # (export positions from the host)
        assert {t.device.type for t in (table.base, table.start, table.end, table.key, table.shift)} == {"cuda"}


def test_broken_driver_is_an_error_not_a_cpu_run(monkeypatch):
    def broken(family):
        if family == "npu":
            raise RuntimeError("drvGetDevNum failed")
        return family == "cpu"

    monkeypatch.setattr(accelerator, "family_available", broken)
    with pytest.raises(DeviceNotAvailable, match="checking for npu devices failed.*drvGetDevNum"):
        accelerator.detect_family()
    with pytest.raises(DeviceNotAvailable):
        accelerator.accelerated()  # the Megatron CPU shims ask this, so they never apply on NPUs


def test_the_op_counter_counts_what_waits_for_a_device_and_nothing_the_host_does():
    """`bench skeleton --torch-path`'s counter on a CPU: what stands for device data is told by
    where it came from; its nonzero, item and reads by the host (tolist, cpu, numpy, also in a
    library thread named to the counter, which a dispatch mode does not see) count, the same on
    host data (read back, made from lists, or derived from those alone) do not, and ReadBack's one
    read for many tensors counts once."""
    import threading

    from delta_sync.accelerator import ReadBack
    from launchers.device_check import OpCounter

    before = {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu", "numpy")}
    weights = torch.arange(16.0)
    OpCounter.device(weights)
    seen = []
    with OpCounter(("delta_sync-test",)) as ops:
        changed = (weights > 7).nonzero()  # device: 1
        counts = changed.cpu()  # a read: 2; what it gives is the host's
        assert counts.nonzero().numel() and counts.tolist() and int(counts.sum())  # host: none
        host = torch.tensor([1, 0, 2])
        assert host.nonzero().numel() == 2 and int(host.max()) == 2  # host: none
        assert int((weights * 2).sum()) == 240  # device, derived: 3
        assert len(weights.numpy()) == 16  # 4
        reads = ReadBack()
        reads.later([weights[:2], weights.sum().view(1)], seen.append)
        reads.later([], seen.append)
        reads.run()  # one read for both: 5
        th = threading.Thread(target=lambda: weights.tolist(), name="delta_sync-test")  # 6
        th.start()
        th.join()
        # waits that dispatch under other names: a boolean mask (7), CUDA's bincount (8), a
        # repeat_interleave of unknown length (9); with its length given, none
        assert weights[weights > 3].numel() == 12 and torch.bincount(weights.long()).numel() == 16
        assert torch.repeat_interleave(weights.long()).numel() == 120
        assert torch.repeat_interleave(weights.long(), output_size=120).numel() == 120
    assert seen == [[[0.0, 1.0], [120.0]], []]
    assert ops.syncs == 9, ops.counts()
    assert ops.which == {"nonzero": 1, "cpu": 1, "_local_scalar_dense": 1, "numpy": 1, "tolist": 2, "index": 1,
                         "bincount": 1, "repeat_interleave": 1}
    assert all(getattr(torch.Tensor, m) is before[m] for m in before)  # the methods as they were
    with FakeTensorMode(allow_non_fake_inputs=True):  # on a (fake) device: a copy to the host waits, once
        x = torch.ones(4, device="cuda")
        with OpCounter() as ops:
            staged = torch.empty(4).copy_(x * 2)  # (into host memory, as a staged table is)
            host_sum = staged + 1
        assert ops.which == {"copy_": 1}, ops.counts()
        assert not OpCounter.on_device(staged) and not OpCounter.on_device(host_sum)


def test_a_device_tables_checks_wait_for_the_device_once(monkeypatch):
    """A delta bucket's table is checked by torch ops where its buffers are off the host (order,
    bounds, finiteness over its columns): the entries' positions come from the host's lists and
    cross in one copy, so nothing before the verdict's one read waits for the device, however many
    tensors the table holds (boolean masks over device columns waited four times more per table:
    on "meta" buffers, which stand for a device's here, such an operation raises, its output size
    unknown without the data); a bad table is still refused by name."""
    import delta_sync.bucket as bucket_mod
    from delta_sync.accelerator import ReadBack
    from delta_sync.bucket import check_table
    from delta_sync.catalog import TableSlice
    from launchers.device_check import OpCounter
    from tests.test_catalog import _catalog

    monkeypatch.setattr(bucket_mod.native, "sparse_in_order", lambda *a: None)  # what device buffers get
    cat = _catalog([f"w{i}" for i in range(40)])  # of 16 elements each
    ids = torch.arange(1, 40, 2)
    counts = torch.tensor([1 + i % 3 for i in range(len(ids))])
    indices = torch.cat([torch.arange(c, dtype=torch.int32) * 5 for c in counts.tolist()])
    values = {"bfloat16": torch.ones(indices.numel(), dtype=torch.bfloat16)}
    on_device = TableSlice(cat, ids, counts, indices.to("meta"), {k: v.to("meta") for k, v in values.items()},
                           "bucket 0 of v1")
    reads = ReadBack()
    check_table(on_device, reads=reads)  # (its verdict read later, with the bucket's checksum's)
    assert len(reads._tensors) == 2  # (the order and bounds verdict, the values' finiteness)
    table = TableSlice(cat, ids, counts, indices, values, "bucket 0 of v1")
    OpCounter.device(table.indices, *table.values.values())
    with OpCounter() as ops:
        check_table(table)
    assert ops.syncs == 1, ops.counts()
    table.indices[5] = 99  # the last of w5's three: out of bounds for its 16 elements
    with pytest.raises(PatchValidationError, match="'w5'.*index 99 out of bounds"):
        check_table(table)


def test_device_check_script_runs_its_checks_on_the_host():
    """launchers/device_check.py runs on a lent GPU only now and then; on the host it runs here, so
    it cannot rot in between (same checks, device = cpu)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "launchers.device_check", "--device", "cpu", "--bench-gib", "0.125",
                           "--pipeline", "tiny", "--count-ops"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and set(result["checks"]) == {"diff", "snapshot", "digest", "gather", "peer_abort",
                                                      "local_channel", "in_place", "fast_path", "loader_views"}
    assert all(c["ok"] for c in result["checks"].values()) and result["diff_over_copy"] > 0
    pipe = result["pipeline"]  # exact, or it would have failed; the embedding was received in place
    assert pipe["placed_ranges"] >= 3 and {"seed", "full", "delta", "digest_over_copy"} <= set(pipe)
    assert pipe["delta"]["prepare_s"] > 0 and pipe["seed"]["receive_s"] > 0
    ops = pipe["delta_ops"]  # one more delta, counted on both ends
    assert ops["sender"]["ops"] > 0 and ops["receiver"]["ops"] > 0


def test_a_delta_staged_on_the_host_is_written_to_device_parameters_a_pair_at_a_time(monkeypatch):
    """``DELTA_SYNC_DELTA_STAGING=host`` (a device engine's default): each received table's
    (positions, values) pairs are worked out on the device once it is checked and copied with the
    table to host memory (:func:`stage_routed`), the plan takes them as they are, and each pair is
    copied to its parameter's device as it is written, the old values going back to the host. On
    fake "cuda" parameters (contiguous and the Ascend-transposed stand-in): every op finds its
    operands on one device (a mix raises here), and neither the pairs nor the undo log hold device
    memory. (The values are checked on the host: tests/test_loader_views.py; the pairs worked out
    on a real device by launchers/device_check.py's pipeline, exact.)"""
    from delta_sync import native
    from delta_sync.catalog import TableSlice
    from patches.loader_views import TableRoutes, UndoLog, plan_tables, routed_pairs
    from tests.test_loader_views import _routed_experts

    monkeypatch.setattr(native, "kernel", lambda: None)
    for transposed in (False, True):
        _, views, params, _, tables, routes = _routed_experts(12, 8, torch.Generator().manual_seed(12), 700,
                                                             transposed=transposed)
        with FakeTensorMode(allow_non_fake_inputs=True):  # (host metadata stays real: made outside the mode)
            on_device = {n: torch.nn.Parameter(torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="cuda"),
                                               requires_grad=False) for n, p in params[0].items()}
            received = [(fake_cuda(t.indices.numel(), dtype=torch.int32),
                         {k: fake_cuda(v.numel(), dtype=v.dtype) for k, v in t.values.items()}) for t in tables]
        routes = TableRoutes(routes.catalog, views, on_device)
        assert set(routes.kinds) == {-1, 2}  # device parameters take torch ops (-1: another worker's experts)
        received = [TableSlice(t.catalog, t.ids, t.counts, idx, vals, t.where) for t, (idx, vals) in zip(tables, received)]
        with FakeTensorMode(allow_non_fake_inputs=True):  # (pinned host memory: fake here)
            staged = [t.staged(torch.device("cpu")) for t in received]
        assert all(t.indices.device.type == "cpu" and all(v.device.type == "cpu" for v in t.values.values())
                   for t in staged)
        for pre in (False, True):
            # pre: the pairs worked out at receipt (stage_routed; here from the real host copies of the
            # tables, as the device's ops cannot run fake with their host columns real); else the
            # host works them out in the plan (a plan made again after the parameters moved)
            for t, real in zip(staged, tables):
                t.routed = (routes, routed_pairs(routes, real)) if pre else None
            plan, general = plan_tables(routes, staged)
            assert not general and (plan.staged if pre else plan.joined) and not (plan.joined if pre else plan.staged)
            pairs = [q for sp in plan.staged for q in sp.pairs] if pre else plan.joined
            assert all(flat.device.type == "cuda" and dst.device.type == vals.device.type == "cpu"
                       and (dst.dtype == torch.int32) == pre for flat, dst, vals in pairs)
            undo = UndoLog()
            with FakeTensorMode(allow_non_fake_inputs=True):
                assert plan.run(undo) == sum(dst.numel() for _, dst, _ in pairs) > 0
                assert undo.nbytes > 0 and undo.device_nbytes == 0, (undo.nbytes, undo.device_nbytes)
                undo.restore()


def test_a_table_whose_positions_cannot_be_worked_out_on_the_device_is_staged_as_it_is(monkeypatch, caplog):
    """The engine's staging (``DeltaSyncReceiver._stage_table``): a device out of memory while
    working out a bucket's positions does not fail the update; the table goes to host memory
    without them (the plan works them out on the host), and the log says so. A host table is
    kept as it is, with no routes made for it."""
    import types

    from delta_sync.catalog import TableSlice
    from patches import vllm_receiver
    from tests.test_loader_views import _routed_experts

    _, _, _, _, tables, _ = _routed_experts(4, 4, torch.Generator().manual_seed(2), 700)

    def no_room(routes, t, host):
        raise torch.OutOfMemoryError("cannot allocate 640 MiB")

    monkeypatch.setattr(vllm_receiver, "stage_routed", no_room)
    monkeypatch.setattr(vllm_receiver, "routes_for", lambda r, catalog: None)
    receiver = types.SimpleNamespace()
    assert vllm_receiver.DeltaSyncReceiver._stage_table(receiver, tables[0]) is tables[0]  # on the host already
    t = tables[0]
    with FakeTensorMode(allow_non_fake_inputs=True):  # (host columns made outside the mode: they stay real)
        idx, vals = fake_cuda(t.indices.numel(), dtype=torch.int32), {k: fake_cuda(v.numel(), dtype=v.dtype)
                                                                       for k, v in t.values.items()}
    on_device = TableSlice(t.catalog, t.ids, t.counts, idx, vals, t.where)
    with FakeTensorMode(allow_non_fake_inputs=True):
        staged = vllm_receiver.DeltaSyncReceiver._stage_table(receiver, on_device)
    assert staged.indices.device.type == "cpu" and staged.routed is None
    assert "positions not worked out on the device (OutOfMemoryError" in caplog.text


def test_host_buffers_fall_back_to_pageable_memory_where_nothing_can_pin():
    """A runtime without a pinned-memory allocator (this CPU build) still stages on the host."""
    buf = accelerator.host_buffer((3, 4), torch.bfloat16)
    assert buf.shape == (3, 4) and buf.dtype == torch.bfloat16 and buf.device.type == "cpu"
    assert not accelerator._PINNED[0]  # tried once, then pageable without trying again
