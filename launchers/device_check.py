"""``python -m launchers.device_check``: the trainer- and receiver-side paths on one accelerator.

For a machine with one GPU (or NPU) and PyTorch, without vLLM or Megatron: every check runs the
library's own code on device tensors and compares it bit for bit with the host path.

* diff: the torch-op bitwise diff of device snapshots == the host kernel's patch;
* snapshot: a snapshot store on the device (seed, delta, commit);
* digest: device lane sums (torch ops) == the host kernel's digest, with the Inf/NaN count;
* gather: a 1-rank trainer world on the device backend (NCCL/HCCL reject host tensors, so every
  metadata tensor must go over the host group made beside it), patches gathered on the device,
  and the channel's many-tensor broadcast (``pg_broadcast_all``) on that group;
* device check: a host tensor into the device group raises ``DeviceMismatch`` before NCCL sees it;
* fast path: owned-element runs placed on the device and changed offsets mapped there;
* in-process channel: a seed and a delta from a sender thread to a receiver thread on the *same*
  device (the one-GPU in-process engine, where NCCL would refuse two ranks on one device);
* in place: a seed and a full update whose large ranges travel in broadcasts of their own from
  the sender's device tensor into the receiver's (small ones packed), exact;
* loader views: a fused / column-sliced / transposed stand-in module on the device, ranges and
  sparse patches applied through the views, read back and digested on the device;
* bench: the device diff against the device's copy bandwidth (``diff_over_copy``);
* pipeline: seed, full updates and 0.2% deltas of Qwen3-0.6B shapes through the library's sender
  and receiver on the device (one in-process channel), per stage, against a device copy of the
  same bytes; ``--profile-dir`` adds a cProfile listing of the last delta.

Prints one JSON line. ``--device cpu`` runs the same checks on the host (the test suite does, so
the script cannot rot between device runs). ``launchers/device_check.sh`` wraps it with a time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import json
import math
import pstats
import sys
import threading
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from delta_sync.checkpoints import qwen3_moe_shapes, qwen3_shapes


def _randn(n: int, g: torch.Generator, device) -> torch.Tensor:
    return torch.randn(n, generator=g).to(torch.bfloat16).to(device)


def settle_allocator() -> None:
    """Have the C allocator sort out the small blocks a bench's stand-in training step just freed,
    now, inside that step. glibc keeps freed small blocks aside (its fast bins) and merges them all
    at the next request for a large block, wherever it comes: after a perturbation of each of
    30B-A3B's 18,867 tensors (~10 small temporaries each) that merge took 75-89 ms on the 2-core
    host, in the first large allocation of the update timed next (a list of names, a table); the
    same call right after took 0.01 ms. The update did not cause that work and vLLM's load, timed
    in a process of its own, never pays it: the bench charges it to the step that made it. A real
    trainer's step leaves such blocks too (a MoE's optimizer step makes thousands of small
    tensors); where it does, its next large allocation, ours or its own, merges them."""
    bytearray(1 << 18)  # (a large request merges the fast bins first; freed at once)


def _perturb(t: torch.Tensor, density: float, g: torch.Generator) -> torch.Tensor:
    new = t.clone()
    pos = torch.randint(0, t.numel(), (max(1, int(t.numel() * density)),), generator=g).to(t.device)
    new.view(-1)[pos] = (new.view(-1)[pos].float() * 1.01 + 1e-3).to(t.dtype)
    return new


def check_diff(device, g) -> dict:
    from delta_sync.diff import BitwiseDiff

    old = _randn(3_000_003, g, device)
    new = _perturb(old, 0.002, g)
    got = BitwiseDiff(use_native=False).diff("w", old, new)
    want = BitwiseDiff().diff("w", old.cpu(), new.cpu())
    assert got.indices.device == old.device
    assert torch.equal(got.indices.cpu(), want.indices) and torch.equal(got.values.cpu().view(torch.int16),
                                                                       want.values.view(torch.int16))
    return {"changed": want.count}


def check_snapshot(device, g) -> dict:
    from delta_sync.snapshot import SnapshotStore

    store = SnapshotStore(device=device)
    t = _randn(100_000, g, device)
    store.prepare("w", t, full=True)
    store.commit(0)
    new = _perturb(t, 0.01, g)
    p = store.prepare("w", new)
    store.commit(1)
    assert not p.dense and p.indices.device == store.snapshot_of("w").device
    assert torch.equal(store.snapshot_of("w").view(torch.int16), new.view(torch.int16))
    return {"changed": p.count}


def check_digest(device, g) -> dict:
    from delta_sync.digest import DigestKey, lane_sums, scan_range

    t = _randn(2_000_001, g, "cpu")
    t[17] = float("nan")
    want, bad = scan_range(t, 5)
    sums = lane_sums(t.to(device).view(torch.int16), 5, exp_mask=0x7F80).tolist()
    assert tuple(sums[:4]) == tuple(want) and sums[4] == bad == 1, (sums, want, bad)
    key = DigestKey.derive(b"device-check", "nonce")  # a bucket's key: the same bits on the device
    keyed, _ = scan_range(t, 5, key=key)
    on_device, _ = scan_range(t.to(device), 5, key=key)
    assert keyed == on_device and keyed != want, (keyed, on_device)
    return {"digest": want.hex(), "keyed": keyed.hex()}


def check_peer_abort(device, g, port: int) -> dict:
    """The device backend's process group (one rank: one device here) carries a broadcast, and
    :func:`collectives.pg_abort` (what the channel's liveness watch calls when a peer dies) finds
    an abort that works: a broadcast after it raises instead of waiting for the group's timeout."""
    from torch.distributed import TCPStore

    from delta_sync import accelerator, collectives

    backend = accelerator.backend_for(device.type)
    store = TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=60))
    pg = accelerator.make_process_group(backend, store, 0, 1, datetime.timedelta(seconds=60), device)
    collectives.pg_broadcast_all(pg, [_randn(1000, g, device)])
    aborted = collectives.pg_abort(pg)
    t0 = time.perf_counter()
    try:
        collectives.pg_broadcast_all(pg, [_randn(1000, g, device)])
        accelerator_sync(device)
        raised = False
    except Exception:  # noqa: BLE001 - any failure is the answer: the broadcast must not complete
        raised = True
    return {"backend": backend, "aborted": aborted, "broadcast_after_abort_raised": raised,
            "raise_s": round(time.perf_counter() - t0, 3)}


def check_gather_and_device_rule(device, g, port: int) -> dict:
    import torch.distributed as dist

    from delta_sync import accelerator, collectives
    from delta_sync.collectives import DeviceMismatch, TrainerGroups
    from delta_sync.gather import Ordered, PatchGather
    from delta_sync.patch import Patch

    backend = accelerator.backend_for(device.type)
    kwargs = {"device_id": device} if device.type != "cpu" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60), **kwargs)
    try:
        groups = TrainerGroups.around(None, device)
        t = _randn(1000, g, device)
        idx = torch.arange(0, 1000, 7, dtype=torch.int32, device=device)
        merged = PatchGather(groups).gather(lambda: [Ordered(0, Patch("w", (1000,), t.dtype, idx, t[idx.long()]))])
        assert merged[0].values.device.type == device.type and merged[0].count == idx.numel()
        parts = [_randn(n, g, device) for n in (5, 70_000)]  # the channel's bulk broadcasts, on this group
        collectives.pg_broadcast_all(groups.device_group or dist.distributed_c10d._get_default_group(), parts)
        refused = False
        if device.type != "cpu":
            try:
                collectives.all_reduce(torch.zeros(1), groups.device_group)
            except DeviceMismatch:
                refused = True
            assert refused, "a host tensor reached the device group"
        return {"backend": backend, "host_group": collectives.backend_of(groups.host_group),
                "host_tensor_refused": refused}
    finally:
        dist.destroy_process_group()


def check_local_channel(device, g) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from delta_sync.channel import Channel
    from delta_sync.patch import Patch, apply_patch
    from delta_sync.transfer import receive_update, send_update

    base = _randn(1 << 20, g, device)
    new = _perturb(base, 0.01, g)
    idx = (base.view(torch.int16) != new.view(torch.int16)).nonzero().view(-1).to(torch.int32)

    def receiver():
        chan = Channel.connect("127.0.0.1", 0, 1, 2, "device-check", backend="local", device=device)
        got = torch.empty_like(base)
        for _ in range(2):  # the seed, then the delta
            apply_patch(got, receive_update(chan).patches[0])
        chan.close()
        return got

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(receiver)
        chan = Channel.connect("127.0.0.1", 0, 0, 2, "device-check", backend="local", device=device)
        send_update(chan, 0, "seed", [Patch("w", tuple(base.shape), base.dtype, None, base.view(-1))])
        send_update(chan, 1, "delta", [Patch("w", tuple(base.shape), base.dtype, idx, new.view(-1)[idx.long()])])
        got = fut.result(timeout=120)
        chan.close()
    assert got.device.type == device.type and torch.equal(got.view(torch.int16), new.view(torch.int16))
    return {"elements": base.numel(), "changed": idx.numel()}


def _channel_pair(device, token: str):
    """Both ends of an in-process (``local``) channel on ``device``: (sender, receiver)."""
    from concurrent.futures import ThreadPoolExecutor

    from delta_sync.channel import Channel

    with ThreadPoolExecutor(1) as pool:
        # a side that fails closes its end and the other one raises at once; a lost one, in 60 s
        rx = pool.submit(Channel.connect, "127.0.0.1", 0, 1, 2, token, backend="local", device=device, timeout_s=60)
        tx = Channel.connect("127.0.0.1", 0, 0, 2, token, backend="local", device=device, timeout_s=60)
        return tx, rx.result(timeout=60)


def _engine_layout(state: dict[str, torch.Tensor]):
    """Receiver tensors for ``state`` laid out as vLLM lays out a MoE's: a layer's every expert gate
    and up in one parameter, every down in another (``w13`` / ``w2``), every other tensor a
    parameter of its own. Returns ``(params, tensors, views)``: the flat parameters, each
    checkpoint tensor as a view of its parameter, and the loader views an engine would probe."""
    from patches.loader_views import LoaderView, Segment

    members: dict[str, list[str]] = {}
    for name in state:
        head, _, rest = name.partition(".mlp.experts.")
        kind = rest.split(".")[1] if rest else ""
        members.setdefault(f"{head}.mlp.experts.{'w2' if kind == 'down_proj' else 'w13'}" if rest else name,
                           []).append(name)
    params, tensors, views = {}, {}, {}
    for pname, names in members.items():
        t0 = state[names[0]]
        flat = params[pname] = torch.zeros(sum(state[n].numel() for n in names), dtype=t0.dtype, device=t0.device)
        at = 0
        for n in names:
            t = state[n]
            tensors[n] = flat.narrow(0, at, t.numel()).view(t.shape)
            views[n] = LoaderView(n, tuple(t.shape), t.dtype, [Segment(pname, (t.numel(),), 0, (1,), at, (1,))])
            at += t.numel()
    return params, tensors, views


def _in_place_receiver(tensors: dict[str, torch.Tensor]):
    """``(place, sink)`` for :func:`receive_update` into ``tensors``: ``seg`` ranges are received
    straight into their slices (what the engine's loader views do with a whole parameter), the
    rest is copied there from the bucket. ``placed`` counts the ranges received in place."""
    placed = []

    def dst(e: dict) -> torch.Tensor:
        return tensors[e["name"]].view(-1)[int(e["start"]):int(e["start"]) + int(e["count"])]

    def place(header: dict) -> dict[int, torch.Tensor]:
        return {i: dst(e) for i, e in enumerate(header["entries"]) if e.get("seg")}

    def sink(entries) -> None:
        for e, p in entries:
            d = dst(e)
            if d.data_ptr() == p.values.data_ptr():
                placed.append(e["name"])
            else:
                d.copy_(p.values)
    return place, sink, placed


def check_in_place(device, g) -> dict:
    """A seed and a full update whose large ranges travel in broadcasts of their own, from the
    sender's device tensor into the receiver's (session 9's zero-copy path), small ones packed."""
    from concurrent.futures import ThreadPoolExecutor

    from delta_sync.patch import Patch
    from delta_sync.transfer import receive_update, send_update

    shapes = {"big": (1024, 1536), "small": (64, 48), "big2": (3, 700_001)}  # 3 MB, 6 KB, 4.2 MB
    versions = [{n: _randn(math.prod(s), g, device).reshape(s) for n, s in shapes.items()} for _ in range(2)]
    got = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    place, sink, placed = _in_place_receiver(got)
    tx, rx = _channel_pair(device, "device-check-in-place")

    def receiver():
        for _ in versions:
            receive_update(rx, bulk_sink=sink, place=place)
        rx.close()

    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(receiver)
        for v, (kind, state) in enumerate(zip(("seed", "full"), versions)):
            send_update(tx, v, kind, [Patch(n, tuple(t.shape), t.dtype, None, t.view(-1)) for n, t in state.items()],
                        bucket_bytes=4 << 20)
        fut.result(timeout=120)
        tx.close()
    assert all(torch.equal(got[n].view(torch.int16), versions[-1][n].view(torch.int16)) for n in shapes)
    assert set(placed) == {"big", "big2"}, placed  # the small tensor stayed packed
    return {"placed_ranges": len(placed)}


def check_fast_path(device, g) -> dict:
    from delta_sync.runs import host_runs, map_changes, owned_runs, place_runs, run_table

    local = torch.arange(0, 4096)
    b0, n0, t0 = owned_runs(local[:1024], True)  # one run, shifted by 7 in the checkpoint
    b1, n1, t1 = owned_runs(local[1024:].flip(0), True)  # reversed: runs of one element
    host = host_runs([(b0, n0, 0, t0 + 7), (b1, n1, 1, t1 + 1024)])
    pos_of = torch.tensor([4, 2])  # the two tensors' export positions
    idx = torch.randint(0, 4096, (300,), generator=g).unique().to(torch.int32)
    bits = torch.randint(-2**15, 2**15, (idx.numel(),), generator=g, dtype=torch.int16)
    runs = [place_runs(torch.empty(64, 64, dtype=torch.bfloat16, device=device), *host)]
    got = map_changes(run_table(runs, [0], pos_of), [(idx.to(device), bits.to(device))])
    want = map_changes(run_table([place_runs(torch.empty(64, 64, dtype=torch.bfloat16), *host)], [0], pos_of),
                       [(idx, bits)])
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]) and got[2:] == want[2:]
    return {"runs": int(runs[0].local.numel()), "tensors": len(got[2])}


class StandIn(torch.nn.Module):
    """Loaders that fuse rows, slice columns (TP rank 1 of 2) and transpose, as vLLM's do."""

    def __init__(self, device):
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.qk = torch.nn.Parameter(torch.zeros(96, 64, **kw), requires_grad=False)
        self.cols = torch.nn.Parameter(torch.zeros(80, 48, **kw), requires_grad=False)
        self.tr = torch.nn.Parameter(torch.zeros(40, 72, **kw), requires_grad=False)

    def load_weights(self, items):
        for name, w in items:
            if name == "q":
                self.qk.data[:64].copy_(w)
            elif name == "k":
                self.qk.data[64:].copy_(w)
            elif name == "cols":
                self.cols.data.copy_(w[:, 48:])
            elif name == "tr":
                self.tr.data.copy_(w.t())


SPECS = {"q": (64, 64), "k": (32, 64), "cols": (80, 96), "tr": (72, 40)}


def check_loader_views(device, g) -> dict:
    from patches.loader_views import UndoLog, apply_dense_range, apply_sparse, digest_view, probe_views

    results = {}
    for dev in (device, torch.device("cpu")):
        model = StandIn(dev)
        views, unsupported = probe_views(model, [(n, s, torch.bfloat16) for n, s in SPECS.items()],
                                         whole=False)  # "cols" is a TP shard
        assert not unsupported, unsupported
        params = dict(model.named_parameters())
        gg = torch.Generator().manual_seed(3)
        state = {n: _randn(int(torch.Size(s).numel()), gg, dev).reshape(s) for n, s in SPECS.items()}
        for n, t in state.items():
            flat = t.reshape(-1)
            half = flat.numel() // 3
            apply_dense_range(views[n], params, flat[:half], 0)  # ranges cut inside a tensor
            apply_dense_range(views[n], params, flat[half:], half)
        undo = UndoLog()
        for n, t in state.items():
            idx = torch.arange(0, t.numel(), 5, device=dev)
            vals = (t.reshape(-1)[idx].float() + 1).to(t.dtype)
            apply_sparse(views[n], params, idx.to(torch.int32), vals, undo)
        results[dev.type] = ({n: digest_view(v, params)[0].hex() for n, v in views.items()},
                             {n: p.detach().cpu().view(torch.int16).clone() for n, p in params.items()})
    dev_digests, dev_params = results[device.type]
    cpu_digests, cpu_params = results["cpu"]
    assert dev_digests == cpu_digests, (dev_digests, cpu_digests)
    assert all(torch.equal(dev_params[n], cpu_params[n]) for n in cpu_params)
    return {"views": len(SPECS)}


def bench_diff(device, g, gib: float) -> dict:
    from delta_sync.diff import BitwiseDiff

    sync = accelerator_sync(device)
    per = 32 << 20  # elements per tensor (64 MiB bf16)
    count = max(1, int(gib * (1 << 30) / (per * 2)))
    olds = [_randn(per, g, device) for _ in range(count)]
    news = [_perturb(o, 0.002, g) for o in olds]
    dsts = [torch.empty_like(o) for o in olds]
    differ = BitwiseDiff(use_native=device.type == "cpu")

    t_copy = _best_of(lambda: [d.copy_(n) for d, n in zip(dsts, news)], sync)
    t_diff = _best_of(lambda: [differ.changed(o, n) for o, n in zip(olds, news)], sync)
    nbytes = 2 * sum(t.numel() * 2 for t in news)  # both sides move 2N bytes per pass
    return {"bench_bytes": nbytes // 2, "copy_gbps": round(nbytes / t_copy / 1e9, 1),
            "diff_gbps": round(nbytes / t_diff / 1e9, 1), "diff_over_copy": round(t_copy / t_diff, 3)}


#: model shapes the pipeline bench can run, by layer count (None: the model's own): the dense 0.6B,
#: Qwen3-30B-A3B (its real per-layer tensors, 128 experts x 3 per layer; a few layers fit one
#: device three times over) and a tiny one for tests
PIPELINES = {"qwen3-0.6b": lambda layers: qwen3_shapes(layers=layers or 28),
             "qwen3-30b-a3b": lambda layers: qwen3_moe_shapes(layers=layers or 48),
             "tiny": lambda layers: qwen3_shapes(layers=layers or 2, hidden=256, inter=768, vocab=4096, heads=4,
                                                 kv_heads=2, head_dim=64)}


def bench_pipeline(device, g, shapes: dict[str, tuple[int, ...]], density: float = 0.002,
                   profile_dir: str | None = None, count_ops: bool = False, stage: str = "host",
                   profile_side: str = "sender", source: str = "stream") -> dict:
    """The library's bulk and delta paths on one device, against a device copy of the same bytes.

    A sender thread and a receiver thread share an in-process channel on the device (one GPU
    cannot hold two NCCL ranks), so the "wire" here is a device-to-device copy, far faster than any
    link: ``*_over_copy`` is the library's own cost per byte, what a link would hide or not.
    seed/full: digest and send every tensor (large ones in place), the receiver checks each
    range's digest; delta: the snapshot store's diff, pack, send, assemble and apply of ``density``
    (``plan_s``: the receiver's routing of the tables, before an engine pauses; ``apply_s``: the pause).
    The receiver's weights are fused as an engine's (:func:`_engine_layout`) and a delta's tables
    routed into them by id, the undo log kept (:func:`patches.loader_views.plan_tables`).
    Every stage's throughput feeds docs/benchmarks.md's scale table. ``count_ops``: one more delta, its
    torch operations counted on both ends (:class:`OpCounter`; not among the timed runs). ``stage``:
    where the receiver keeps a delta until it applies it, as an engine's ``DELTA_SYNC_DELTA_STAGING``
    (``staged_mb``: the device memory that held, from receipt to the apply). ``source``: the sender's
    weights as separate tensors (``stream``: the snapshot store diffs them) or in
    :class:`~delta_sync.flat.FlatWeights` (``flat``: each buffer diffed whole)."""
    from concurrent.futures import ThreadPoolExecutor

    from delta_sync import accelerator
    from delta_sync.digest import scan_many
    from delta_sync.gc_hold import gc_held  # as WeightSync and the engine hold it
    from delta_sync.patch import Patch, apply_patch
    from delta_sync.snapshot import SnapshotStore
    from delta_sync.transfer import receive_update, send_update

    from patches.loader_views import TableRoutes, UndoLog, plan_tables, stage_routed

    sync = accelerator_sync(device)
    state = {n: _randn(math.prod(s), g, device).reshape(s) for n, s in shapes.items()}
    flat = None
    if source == "flat":
        from delta_sync import FlatWeights

        flat = FlatWeights(list(state.items()))
        state = flat.tensors
    params, got, views = _engine_layout(state)  # the receiver's weights, fused as an engine's
    routes: list = []  # the receiver's TableRoutes, made at the first delta (an engine's, per catalogue)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    perturbed = sum(max(1, int(t.numel() * density)) for t in state.values())  # at most, per delta (_perturb)
    place, sink, placed = _in_place_receiver(got)
    tx, rx = _channel_pair(device, "device-check-pipeline")
    store = SnapshotStore(device=device)
    plan = ["seed", "full", "full", "delta", "delta"] + (["delta"] if count_ops else [])
    # (with the threads the library sends and receives buckets in)
    counters = {"sender": OpCounter(("delta_sync-send",)), "receiver": OpCounter(("delta_sync-recv",))}
    if count_ops and device.type == "cpu":  # what device data is, for the counters (see OpCounter)
        OpCounter.device(*state.values(), *got.values(), *params.values())
        _received_on_device(rx)
    counted = len(plan) - 1 if count_ops else -1
    profiled = len(plan) - 1 - count_ops  # the last timed delta
    done: list[dict] = []  # per version, the receiver's stage times
    payloads: list[int] = []  # per version, the bytes the sender's buckets carried
    sending: list[float] = []  # per version, when the sender began to send
    # the last timed delta of one side (``profile_side``: one profiler per process)
    profile = cProfile.Profile() if profile_dir else None

    def routes_of(catalog) -> TableRoutes:
        if not routes:
            routes.append(TableRoutes(catalog, views, params))
        return routes[0]

    def stage_table(t):  # as an engine stages on the host: positions worked out on the device first
        return stage_routed(routes_of(t.catalog), t, torch.device("cpu"))

    def receiver():
        try:
            for v, kind in enumerate(plan):
                t0 = time.perf_counter()
                if kind == "delta":
                    with gc_held(), counters["receiver"] if v == counted else contextlib.nullcontext():
                        held = accelerator.memory_allocated(device)
                        upd = receive_update(rx, tables=True,  # tables as an engine takes them, staged as it stages
                                             stage=torch.device("cpu") if stage == "host" else None,
                                             stage_table=stage_table if stage == "host" else None)
                        held = accelerator.memory_allocated(device) - held
                        t1 = time.perf_counter()
                        general, routed = [], None  # routed as an engine routes them: by id, a write per parameter
                        with profile if profile and profile_side == "receiver" and v == profiled \
                                else contextlib.nullcontext():
                            if upd.tables:  # planned before an engine's pause (while it serves)
                                routed, general = plan_tables(routes_of(upd.tables[0].catalog), upd.tables)
                            sync()
                            t_plan = time.perf_counter()
                            if routed is not None:  # the pause
                                routed.run(UndoLog())
                            for p in [*upd.patches, *(p for _, p in general)]:
                                apply_patch(got[p.name], p)
                            sync()
                else:
                    receive_update(rx, bulk_sink=sink, place=place)
                    t1 = t_plan = time.perf_counter()
                sync()
                # from when the sender started sending (the receiver waited for it before)
                done.append({"end": time.perf_counter(), "receive_s": t1 - max(t0, sending[v]),
                             "apply_s": time.perf_counter() - t_plan,
                             **({"plan_s": t_plan - t1, "staged_mb": held / 2**20} if kind == "delta" else {})})
                upd = routed = general = None  # freed before the next version, as an engine frees them
        finally:
            rx.close()  # a failure here ends the sender's wait at once

    runs: dict[str, list[dict]] = {}
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(receiver)
        try:
            for v, kind in enumerate(plan):
                if kind == "delta":
                    for t in state.values():
                        t.copy_(_perturb(t, density, g))
                    settle_allocator()
                sync()
                with gc_held(), profile if profile and profile_side == "sender" and v == profiled else \
                        counters["sender"] if v == counted else contextlib.nullcontext():
                    t0 = time.perf_counter()
                    if flat is None:
                        patches = [p for p in store.prepare_many(list(state.items()), full=kind != "delta",
                                                                 batched=kind == "delta") if p is not None]
                    elif kind == "delta":
                        patches = [o.patch for o in flat.local_patches()]
                    else:
                        patches = [Patch.full(n, t) for n, t in state.items()]
                    sync()
                    t1 = time.perf_counter()
                    sending.append(t1)
                    payloads.append(send_update(tx, v, kind, patches).payload_bytes)
                    t2 = time.perf_counter()
                    store.commit(v)
                    if flat is not None:
                        if kind != "delta":
                            flat.seeded()  # (its snapshots are taken at the commit)
                        flat.commit()
                    while len(done) <= v:
                        if fut.done():
                            fut.result()
                        time.sleep(1e-4)
                if v == counted:
                    continue  # counted, not timed
                runs.setdefault(kind, []).append({"total_s": done[v]["end"] - t0, "prepare_s": t1 - t0,
                                                  "send_s": t2 - t1,
                                                  **{k: x for k, x in done[v].items() if k != "end"}})
        except BaseException:
            tx.close()  # a failure here ends the receiver's wait at once
            try:
                cause = fut.exception(timeout=60)
            except Exception:  # noqa: BLE001 - a receiver still stuck: the sender's error stands
                cause = None
            if cause is not None:  # the receiver failed first: its error is the one to see
                raise cause
            raise
        tx.close()
        fut.result(timeout=60)
    if profile:
        with open(f"{profile_dir}/pipeline_{profile_side}.txt", "w") as f:
            pstats.Stats(profile, stream=f).sort_stats("cumulative").print_stats(40)
    exact = all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())
    assert exact, "the receiver's tensors differ from the sender's"
    for kind, sent in zip(plan, payloads):  # a delta sends its changes (an int32 index and a value each)
        assert kind != "delta" or sent <= 16 * perturbed + (1 << 20), (
            f"a {density:.2%} delta sent {sent} B for at most {perturbed} changed elements: whole tensors "
            "instead of their changes")

    t_copy = _best_of(lambda: [got[n].copy_(t) for n, t in state.items()], sync)
    t_digest = _best_of(lambda: scan_many([(t.view(-1), 0, None) for t in state.values()]), sync)
    best = {k: min(v, key=lambda r: r["total_s"]) for k, v in runs.items()}  # the best run, with its stages
    return {"model_bytes": nbytes, "tensors": len(state), "copy_s": round(t_copy, 5),
            "digest_s": round(t_digest, 5), "digest_over_copy": round(t_digest / t_copy, 3),
            **{f"{k}_over_copy": round(r["total_s"] / t_copy, 2) for k, r in best.items()},
            **{k: {x: round(y, 5) for x, y in r.items()} for k, r in best.items()},
            "placed_ranges": len(placed), "density": density,
            **({"delta_ops": {k: c.counts() for k, c in counters.items()}} if count_ops else {})}


def _received_on_device(rx) -> None:
    """What ``rx`` receives stands for device data in :class:`OpCounter` (on a device it would be)."""
    one, many = rx.broadcast, rx.broadcast_all

    def broadcast(tensor, src=0):
        got = one(tensor, src)
        OpCounter.device(got)
        return got

    def broadcast_all(tensors, src=0):
        many(tensors, src)
        OpCounter.device(*tensors)

    rx.broadcast, rx.broadcast_all = broadcast, broadcast_all


class OpCounter(TorchDispatchMode):
    """Counts the torch operations run while it is entered (in this thread: dispatch modes are
    per thread), and among them the host syncs: on a device, an operation on device data whose
    result size depends on the data or that reads a value back (``nonzero``, ``item``, ...) waits
    for the device, and so does every read of device data by the host (``tolist``, ``cpu``,
    ``numpy``: not dispatched, counted through the methods while a counter is entered, also in the
    library's threads named in ``threads``, whose operations a dispatch mode does not see).

    Which data is a device's: on a device, what lies on it. On a CPU (``bench skeleton
    --torch-path``) it is told by where it came from: what :meth:`device` was told (the weights, what
    crosses the channel) and what any operation on it made or wrote; the rest (tables the library
    keeps on the host, counts it read back, tensors made from host data) is the host's, and its
    ``nonzero`` or ``tolist`` waits for nothing."""

    SYNCING = frozenset({"nonzero", "_local_scalar_dense", "item", "masked_select", "unique", "_unique2",
                         "unique_consecutive", "equal", "is_nonzero", "argwhere"})
    _on_device: dict[int, weakref.ref] = {}  # id -> tensor: on a CPU, what stands for device data
    _entered: dict[int, "OpCounter"] = {}  # thread -> the counter entered in it
    _named: dict[str, "OpCounter"] = {}  # thread name -> the counter its host reads count in
    _saved: dict[str, object] = {}  # the Tensor methods replaced while any counter is entered
    _own: set[str] = set()  # those of them that are Tensor's own, not inherited
    _lock = threading.Lock()  # (hooks installed and removed once, whichever thread enters first)

    def __init__(self, threads: tuple[str, ...] = ()):
        super().__init__()
        self.threads = threads
        self.ops = self.syncs = 0
        self.which: dict[str, int] = {}  # syncing op (or host read) name -> count

    @classmethod
    def device(cls, *tensors: torch.Tensor) -> None:
        """On a CPU: ``tensors`` (and the tensors they are views of) stand for device data."""
        for t in tensors:
            for x in (t, t._base):
                if x is not None:
                    cls._on_device[id(x)] = weakref.ref(x)

    @classmethod
    def on_device(cls, t: torch.Tensor) -> bool:
        if t.device.type != "cpu":
            return True
        for x in (t, t._base):
            ref = cls._on_device.get(id(x)) if x is not None else None
            if ref is not None and ref() is x:
                return True
        return False

    def __enter__(self):
        with OpCounter._lock:  # (the sender's and the receiver's counters enter from two threads)
            if not OpCounter._entered:
                OpCounter._hook_reads()
            OpCounter._entered[threading.get_ident()] = self
            OpCounter._named.update(dict.fromkeys(self.threads, self))
        return super().__enter__()

    def __exit__(self, *exc):
        with OpCounter._lock:
            self._leave(threading.get_ident())
        return super().__exit__(*exc)

    def _leave(self, thread: int) -> None:
        OpCounter._entered.pop(thread, None)
        for name in self.threads:
            OpCounter._named.pop(name, None)
        if not OpCounter._entered:
            for name, fn in OpCounter._saved.items():
                if name in OpCounter._own:
                    setattr(torch.Tensor, name, fn)
                else:  # (inherited: the class's own entry goes)
                    delattr(torch.Tensor, name)
            OpCounter._saved.clear()
            OpCounter._own.clear()

    def _sync(self, name: str) -> None:
        self.syncs += 1
        self.which[name] = self.which.get(name, 0) + 1

    @staticmethod
    def _syncs_by_data(name: str, args, kwargs: dict) -> bool:
        """Operations whose result size or launch waits on device data without a ``nonzero`` of their
        own in the dispatch: indexing with a boolean mask (a nonzero inside), CUDA's ``bincount``
        (reads its input's min and max back), ``repeat_interleave`` without ``output_size``."""
        if name in ("index", "index_put", "index_put_"):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in indices or ())
        if name == "bincount":
            return True
        return (name == "repeat_interleave" and kwargs.get("output_size") is None
                and (len(args) == 1 or isinstance(args[1], torch.Tensor)))  # (repeats as a tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves

        self.ops += 1
        name = func.overloadpacket.__name__
        given = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        dev = any(map(self.on_device, given))
        if dev and (name in self.SYNCING or self._syncs_by_data(name, args, kwargs or {})):
            self._sync(name)
        out = func(*args, **(kwargs or {}))
        if dev:
            written = [a for a, arg in zip(args, func._schema.arguments) if arg.alias_info is not None
                       and arg.alias_info.is_write]  # in place: what it wrote holds device data now
            made = [t for t in tree_leaves((out, written, (kwargs or {}).get("out")))
                    if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
            if made and any(t.device.type != "cpu" for t in given):  # on a device: a copy to the host
                self._sync(name)  # (what it made is the host's)
            else:  # on a CPU: data derived from what stands for a device's
                self.device(*made)
        return out

    @classmethod
    def _hook_reads(cls) -> None:
        """``Tensor.tolist / numpy / cpu`` of device data counted as a sync in the thread's counter
        (what ``cpu`` returns is then the host's: on a CPU, a copy)."""
        from torch.utils._python_dispatch import _disable_current_modes

        def counted(name):
            def method(t, *a, **k):
                c = cls._entered.get(threading.get_ident()) or cls._named.get(threading.current_thread().name)
                if c is None or not cls.on_device(t):
                    return cls._saved[name](t, *a, **k)
                c._sync(name)
                with _disable_current_modes():
                    got = cls._saved[name](t, *a, **k)
                    return got.clone() if got is t else got  # (on a CPU: the host's own copy)
            return method

        for name in ("tolist", "numpy", "cpu"):
            cls._saved[name] = getattr(torch.Tensor, name)
            if name in vars(torch.Tensor):
                cls._own.add(name)
            setattr(torch.Tensor, name, counted(name))

    def counts(self) -> dict:
        return {"ops": self.ops, "syncs": self.syncs, "syncing": dict(self.which)}


def accelerator_sync(device):
    return (lambda: torch.get_device_module(device).synchronize()) if device.type != "cpu" else (lambda: None)


def _best_of(fn, sync, reps: int = 3) -> float:
    """Best wall time of ``reps`` calls of ``fn`` after one warm-up, each waited for on the device."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m launchers.device_check")
    ap.add_argument("--device", default="cuda", help="cuda, npu or cpu")
    ap.add_argument("--bench-gib", type=float, default=2.0)
    ap.add_argument("--pipeline", choices=[*PIPELINES, "none"], default="qwen3-0.6b",
                    help="model shapes of the seed/full/delta pipeline bench")
    ap.add_argument("--layers", type=int, help="the pipeline model's layer count (default: the model's own)")
    ap.add_argument("--skip-checks", action="store_true", help="benches only")
    ap.add_argument("--profile-dir", help="write a cProfile listing of the pipeline's last delta here")
    ap.add_argument("--profile-side", choices=["sender", "receiver"], default="sender",
                    help="the sender's diff, pack and send, or the receiver's plan and apply")
    ap.add_argument("--count-ops", action="store_true",
                    help="count one more delta's torch operations and host syncs on both ends")
    ap.add_argument("--stage", choices=["host", "device"], default="host",
                    help="where the pipeline's receiver keeps a delta until it applies it")
    ap.add_argument("--density", type=float, default=0.002,
                    help="the pipeline's delta density (0.02: an Adam step's)")
    ap.add_argument("--source", choices=["stream", "flat"], default="stream",
                    help="the pipeline's weights as separate tensors or in FlatWeights")
    args = ap.parse_args(argv)
    from delta_sync import accelerator
    from delta_sync.channel import free_port

    accelerator.require_family(torch.device(args.device).type)
    device = torch.device(args.device)
    if device.type != "cpu":
        accelerator.device_module(device).set_device(0)
        device = torch.device(device.type, 0)
    g = torch.Generator().manual_seed(0)
    out = {"check": "device", "device": str(device), "torch": torch.__version__, "checks": {}}
    steps = [("diff", lambda: check_diff(device, g)), ("snapshot", lambda: check_snapshot(device, g)),
             ("digest", lambda: check_digest(device, g)),
             ("gather", lambda: check_gather_and_device_rule(device, g, free_port())),
             ("peer_abort", lambda: check_peer_abort(device, g, free_port())),
             ("local_channel", lambda: check_local_channel(device, g)),
             ("in_place", lambda: check_in_place(device, g)),
             ("fast_path", lambda: check_fast_path(device, g)), ("loader_views", lambda: check_loader_views(device, g))]
    ok = True
    for name, fn in [] if args.skip_checks else steps:
        print(f"device_check: {name}", file=sys.stderr, flush=True)  # where it was, should it hang
        t0 = time.perf_counter()
        try:
            out["checks"][name] = dict(fn(), ok=True, s=round(time.perf_counter() - t0, 3))
        except Exception as e:  # noqa: BLE001 - report every check, then fail
            ok = False
            out["checks"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    print("device_check: bench", file=sys.stderr, flush=True)
    out.update(bench_diff(device, g, args.bench_gib))
    if args.pipeline != "none":
        try:
            out["pipeline"] = dict(bench_pipeline(device, g, PIPELINES[args.pipeline](args.layers),
                                                  density=args.density, profile_dir=args.profile_dir, profile_side=args.profile_side,
                                                  count_ops=args.count_ops, stage=args.stage, source=args.source),
                                   shapes=args.pipeline, layers=args.layers, stage=args.stage, source=args.source)
        except Exception as e:  # noqa: BLE001 - report every part, then fail
            ok = False
            out["pipeline"] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
    out["ok"] = ok
    return out


if __name__ == "__main__":
    result = main()
    print(json.dumps(result), flush=True)
    sys.exit(0 if result["ok"] else 1)
