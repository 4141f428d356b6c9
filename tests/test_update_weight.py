"""Launcher flags -> updater, and both updaters (full baseline, delta) into a real engine."""

from __future__ import annotations

import argparse
import os

import pytest

from update_weight import WeightUpdater, add_update_weight_args, build_updater
from update_weight.args import resolve_update_weight_args

from launchers.ranks import run_ranks

from .engine_helpers import close_llm, evolve, load_state


def _args(*argv):
    return add_update_weight_args(argparse.ArgumentParser()).parse_args(list(argv))


def test_defaults_follow_this_machine():
    cfg = resolve_update_weight_args(_args())
    assert (cfg.mode, cfg.transport, cfg.backend, cfg.options.bucket_bytes) == ("delta", "sparse_gloo", "gloo", 512 << 20)
    cfg = resolve_update_weight_args(_args("--update-weight-mode", "full", "--update-weight-buffer-size", "64MiB"))
    assert (cfg.transport, cfg.options.bucket_bytes) == ("gloo", 64 << 20)


@pytest.mark.parametrize("argv,message", [
    (["--update-weight-mode", "delta", "--update-weight-transport", "gloo"], "use --update-weight-transport sparse_gloo"),
    (["--update-weight-mode", "full", "--update-weight-transport", "sparse_gloo"], "use --update-weight-transport gloo"),
    (["--update-weight-transport", "sparse_hccl"], "needs NPU devices.*use sparse_gloo"),
    (["--update-weight-mode", "full", "--update-weight-transport", "nccl"], "needs CUDA devices.*use gloo"),
    (["--update-weight-verify-every", "-1"], ">= 0"),
    (["--update-weight-buffer-size", "32"], "bucket_bytes .--update-weight-buffer-size. = 32 must be at least 64"),
    (["--update-weight-master-port", "70000"], "port .--update-weight-master-port. = 70000"),
])
def test_contradictions_fail_at_start_with_what_to_use(argv, message):
    with pytest.raises(SystemExit, match=message):
        resolve_update_weight_args(_args(*argv))


def test_bad_buffer_size_is_an_argument_error():
    with pytest.raises(SystemExit):
        _args("--update-weight-buffer-size", "lots")


@pytest.fixture(scope="module")
def llm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from delta_sync.checkpoints import build

    from .engine_runner import engine_kwargs

    engine = LLM(model=str(build("dense")), **engine_kwargs())
    yield engine
    close_llm(engine)


@pytest.mark.parametrize("mode,transport", [("full", "gloo"), ("delta", "sparse_gloo")])
def test_updaters_keep_the_engine_exact(llm, mode, transport):
    from delta_sync.checkpoints import build

    path = build("dense")
    updater = build_updater(_args("--update-weight-mode", mode, "--update-weight-transport", transport,
                                  "--update-weight-verify-every", "1", "--update-weight-buffer-size", "256KiB"), [llm])
    assert type(updater) is WeightUpdater and (updater.sync.mode, updater.sync.options.backend) == (mode, "gloo")
    state = load_state(path)
    total = sum(t.numel() for t in state.values())
    reports = [updater.update_weights(state.items())]
    for v in range(1, 4):
        evolve(state, v)
        reports.append(updater.update_weights(state.items()))
    updater.close()
    assert all(r.verified for r in reports)  # engine digests == trainer digests every version
    assert reports[0].kind == "seed" and reports[0].buckets > 1  # 256 KiB buckets split the seed
    later = reports[1:]
    if mode == "full":
        assert all(r.kind == "full" and r.changed_elements == total for r in later)
    else:
        assert all(r.kind == "delta" and 0 < r.changed_elements < total for r in later)
        assert all(r.payload_bytes < reports[0].payload_bytes for r in later)
    stages = {"prepare_s", "send_s", "pack_s", "finish_s", "total_s"} | ({"diff_s"} if mode == "delta" else set())
    assert all(stages <= set(r.timings) for r in later)


@pytest.mark.parametrize("chunk", [4, 5, 1 << 22], ids=["chunk-4", "chunk-5", "one-chunk"])
def test_owned_runs_are_maximal(chunk, monkeypatch):
    """The fast path's plan: runs of owned elements consecutive in both coordinates, found without
    sorting the elements, chunk by chunk (runs go on across chunks); a foreign element or a jump in
    local offsets ends a run."""
    import torch

    from delta_sync import runs as runs_mod
    from delta_sync.runs import expand, owned_runs

    monkeypatch.setattr(runs_mod, "RUN_CHUNK", chunk)
    # checkpoint order: local 2..7, foreign, 8..13, 30, 31 (int32, as small parameters' probes are)
    local = torch.tensor([2, 3, 4, 5, 6, 7, -1, 8, 9, 10, 11, 12, 13, 30, 31], dtype=torch.int32)
    mine = local >= 0
    begin, length, target = owned_runs(local + (3 << 20), mine, base=3 << 20)  # rank 3's ids
    assert begin.tolist() == [2, 8, 30] and length.tolist() == [6, 6, 2] and target.tolist() == [0, 7, 13]
    assert begin.dtype == length.dtype == target.dtype == torch.int64
    # every owned element is covered once, at its own checkpoint position
    assert torch.equal(expand(begin, length), local[mine].long())
    assert torch.equal(expand(target, length), mine.nonzero().squeeze(1))
    begin, length, target = owned_runs(torch.arange(5, 15), True)  # all mine: one run
    assert begin.tolist() == [5] and length.tolist() == [10] and target.tolist() == [0]


def _mapped_one_by_one(runs_list, found, position):
    """What the run table must give: every changed offset of every parameter looked up among its
    own runs, element by element, as ``{export position: (checkpoint indices, bits)}`` in checkpoint
    order."""
    import torch

    out = {}
    for runs, (idx, bits) in zip(runs_list, found):
        for o, b in zip(idx.tolist(), bits.tolist()):
            for loc, ln, s, tgt in zip(runs.local.tolist(), runs.length.tolist(), runs.seq.tolist(),
                                       runs.target.tolist()):
                if loc <= o < loc + ln:
                    out.setdefault(position[s], []).append((tgt + o - loc, b))
    return {p: (torch.tensor([t for t, _ in sorted(v)]), torch.tensor([b for _, b in sorted(v)]))
            for p, v in sorted(out.items())}


@pytest.mark.parametrize("way", ["host-kernel", "torch-ops"])
def test_a_delta_maps_every_parameters_changes_in_one_pass(way, monkeypatch):
    """A rank's changed offsets of all its parameters go through one table of runs: the checkpoint
    indices and bits per tensor, tensors in export order, each one's indices increasing, are what
    looking every offset up among its own parameter's runs gives; offsets outside every run
    (another rank's elements) are dropped; fused q/k/v-like runs whose checkpoint order differs
    from the local one are put in order (their runs are sorted, not their elements). A device's
    torch operations give what the host's two kernel calls do, with one host read (counted as
    `bench skeleton --torch-path` counts, however many parameters; the table's order made before)."""
    import torch

    from delta_sync import runs as runs_mod
    from delta_sync.runs import FEW_RUNS, few_runs, map_changes, place_runs, run_table

    if way == "torch-ops":
        monkeypatch.setattr(runs_mod.native, "kernel", lambda: None)
    else:
        assert runs_mod.native.kernel() is not None

    g = torch.Generator().manual_seed(0)
    # fused q/k/v-like blocks with gaps (elements owned elsewhere), runs in local order; then a
    # whole tensor; then a parameter whose rows land reversed in its checkpoint tensor
    specs = [(torch.tensor([0, 100, 250, 300, 520]), torch.tensor([100, 50, 50, 200, 80]),
              torch.tensor([7, 8, 7, 9, 8]), torch.tensor([0, 500, 100, 40, 550]), 600),
             (torch.tensor([0]), torch.tensor([64]), torch.tensor([2]), torch.tensor([0]), 64),
             (torch.tensor([0, 10, 20]), torch.tensor([10, 10, 10]), torch.tensor([3, 3, 3]),
              torch.tensor([20, 10, 0]), 30)]
    runs_list = [place_runs(torch.zeros(n, dtype=torch.bfloat16), local, length, seq, target,
                        few=few_runs(local, length, seq, target)) for local, length, seq, target, n in specs]
    assert runs_list[0].few[1] == (100, 50, 500, 8)
    position = {2: 0, 3: 4, 7: 1, 8: 3, 9: 2}  # plan index -> export position
    pos_of = torch.tensor([position.get(i, 0) for i in range(10)])
    table = run_table(runs_list, [0, 1, 2], pos_of)
    found = []
    for _, _, _, _, n in specs:
        idx = torch.randperm(n, generator=g)[:n // 3].sort().values.to(torch.int32)
        found.append((idx, torch.randint(-2**15, 2**15, (idx.numel(),), generator=g, dtype=torch.int16)))
    from launchers.device_check import OpCounter

    map_changes(table, found)  # (the table's order made)
    OpCounter.device(*(t for pair in found for t in pair), table.base, table.param, table.start, table.end,
                     table.key, table.shift, *(t for t in table.in_order()[:2] if t is not None))
    with OpCounter() as ops:
        idx, bits, seqs, counts = map_changes(table, found)
    if way == "torch-ops":
        assert ops.syncs == 1, ops.counts()
    want = _mapped_one_by_one(runs_list, found, position)
    assert seqs == list(want) and counts == [t.numel() for t, _ in want.values()]
    assert idx.dtype == torch.int32
    assert torch.equal(idx.long(), torch.cat([t for t, _ in want.values()]))
    assert torch.equal(bits, torch.cat([b for _, b in want.values()]).to(torch.int16))
    empty = [(i[:0], b[:0]) for i, b in found]
    assert map_changes(table, empty) is None
    outside = [(torch.tensor([160, 170], dtype=torch.int32), torch.ones(2, dtype=torch.int16)), empty[1], empty[2]]
    assert map_changes(table, outside) is None  # offsets 150..249 belong to no run here
    many = torch.arange(FEW_RUNS + 1) * 2  # more runs than that: digested element by element
    ones = torch.ones_like(many)
    assert few_runs(many, ones, ones, many) is None


def test_mapped_changes_go_out_as_one_batch_per_dtype_and_tied_copies_share_them():
    """A rank's mapped changes leave as one PatchBatch per dtype (tensors in export order, as the
    gather needs), split where tensors of one width differ in dtype; the tied ``lm_head`` copy of
    the embedding goes as a patch of its own at its own position, sharing the embedding's
    buffers."""
    import torch

    from update_weight.megatron_shard_delta import MegatronShardDelta

    src = MegatronShardDelta.__new__(MegatronShardDelta)
    src._names = ["model.embed_tokens.weight", "a.weight", "b.weight", "lm_head.weight", "c.weight"]
    src._position = {n: i for i, n in enumerate(src._names)}
    src._shapes = {n: (4, 4) for n in src._names}
    src._dtypes = {n: torch.bfloat16 for n in src._names}
    src._dtypes["b.weight"] = torch.float16  # one width, another dtype
    src._aliases = {"model.embed_tokens.weight": ["lm_head.weight"]}
    idx = torch.tensor([1, 5, 0, 2, 3, 7, 9, 15], dtype=torch.int32)
    bits = torch.arange(8, dtype=torch.int16)
    out = src._batches(idx, bits, [0, 1, 2, 4], [2, 1, 2, 3])  # embed, a, b, c
    assert sorted(o.seq for o in out) == [0, 2, 3]  # each batch at its first tensor's position
    batches = {o.patch.dtype: o for o in out if hasattr(o.patch, "names")}
    bf16, f16 = batches[torch.bfloat16].patch, batches[torch.float16].patch
    assert bf16.names == ["model.embed_tokens.weight", "a.weight", "c.weight"] and bf16.seqs == [0, 1, 4]
    assert bf16.counts == [2, 1, 3] and bf16.indices.tolist() == [1, 5, 0, 7, 9, 15]
    assert bf16.values.view(torch.int16).tolist() == [0, 1, 2, 5, 6, 7]
    assert f16.names == ["b.weight"] and f16.seqs == [2] and f16.indices.tolist() == [2, 3]
    assert f16.values.dtype == torch.float16 and f16.values.view(torch.int16).tolist() == [3, 4]
    tied = [o for o in out if not hasattr(o.patch, "names")]
    assert len(tied) == 1 and tied[0].seq == 3 and tied[0].patch.name == "lm_head.weight"
    assert tied[0].patch.indices.tolist() == [1, 5] and tied[0].patch.values.view(torch.int16).tolist() == [0, 1]
    assert tied[0].patch.indices.data_ptr() == idx.data_ptr()  # the embedding's buffers, no copy


def test_probe_ids_are_int32_where_every_rank_fits_and_name_their_rank():
    """A probe id is ``rank << shift | offset``: int32 while the last rank's ids fit (half of what
    Bridge gathers), int64 beyond; ownership is read from ids with one min/max where a tensor came
    whole from one rank, and per element only where ranks mix (a TP gather)."""
    import torch

    from update_weight.megatron_probes import id_layout, own_mask

    assert id_layout(1 << 20, 8) == (20, torch.int32)
    assert id_layout((1 << 28) + 1, 8) == (29, torch.int64)  # 8 << 29 > 2**31
    assert id_layout(1, 1) == (1, torch.int32)
    shift, dtype = id_layout(6, 4)
    ids = [torch.arange(6, dtype=dtype).add_(r << shift) for r in range(4)]
    assert own_mask(ids[2], 2, shift) is True and own_mask(ids[2], 1, shift) is False
    gathered = torch.cat([ids[0], ids[3]])  # rank 0's shard then rank 3's
    assert not own_mask(gathered, 1, shift).any()  # between the two: a min/max cannot tell, the mask can
    assert own_mask(gathered, 3, shift).tolist() == [False] * 6 + [True] * 6
    assert own_mask(torch.empty(0, dtype=dtype), 0, shift) is True


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_one_pass_packing_carries_every_bit_and_id_through_data_movement(dtype):
    """A one-pass seed converts each parameter as ``id << 32 | value bits`` (int64): any re-layout
    Bridge does (transpose, cat, split) moves both halves together, and unpacking gives back the exact
    bits (NaN payloads, -0.0, negative values: no sign leaking into the id) and the id of each element's
    source; an output that did not stay int64 (a conversion that computes) gives no ids."""
    import torch

    from update_weight.megatron_probes import id_layout, pack_probe, unpack_probe

    dt = getattr(torch, dtype)
    w = torch.randn(6, 10).to(dt)
    bits = w.view(torch.int16 if w.element_size() == 2 else torch.int32)
    bits[0, :4] = torch.tensor([-1, -2, -(1 << (8 * w.element_size() - 1)), 0x7FC1], dtype=bits.dtype)  # NaNs, -0.0
    rank, (shift, _) = 3, id_layout(w.numel(), 4)
    packed = pack_probe(w, rank, shift)
    assert packed.dtype == torch.int64 and packed.shape == w.shape
    moved = torch.cat([packed.t(), packed.t()[:2]])  # what a conversion does: re-lay, copy, cut
    values, ids = unpack_probe(moved, dt)
    expected = torch.cat([w.t(), w.t()[:2]])
    assert values.dtype == dt and values.shape == expected.shape
    assert torch.equal(values.view(bits.dtype), expected.contiguous().view(bits.dtype))
    local = torch.arange(w.numel()).view(w.shape).add(rank << shift)
    assert ids.dtype == torch.int32 and torch.equal(ids.view(expected.shape).long(), torch.cat([local.t(), local.t()[:2]]))
    assert unpack_probe(moved.double(), dt)[1] is None  # (computed: no map from it)


@pytest.mark.parametrize("long_runs", [True, False], ids=["rows-compared-as-slices", "elements-expanded"])
def test_fast_path_seed_check_catches_one_differing_element(long_runs):
    """The fast path's map is checked against every seed's export (``_matches``): equal owned elements
    pass, one differing bit fails, whether its runs are compared slice by slice or element by element."""
    import torch

    from delta_sync.runs import LONG_RUNS, Runs
    from update_weight.megatron_shard_delta import MegatronShardDelta

    rows, cols = 4, (LONG_RUNS if long_runs else 8)
    param = torch.randn(rows, cols).to(torch.bfloat16)
    exported = torch.zeros(rows + 1, cols, dtype=torch.bfloat16)  # checkpoint rows 1..4 hold the param's rows 3..0
    for r in range(rows):
        exported[rows - r] = param[r]
    runs = Runs(param, local=torch.arange(rows) * cols, length=torch.full((rows,), cols),
                 seq=torch.zeros(rows, dtype=torch.int64), target=(rows - torch.arange(rows)) * cols)
    src = MegatronShardDelta.__new__(MegatronShardDelta)
    src._aliases, src._plan_index, src._params_of, src._runs = {}, {"w": 0}, {0: [0]}, [runs]
    assert src._matches("w", exported)
    bad = exported.clone()
    bad.view(torch.int16)[2, cols - 1] ^= 1  # one bit of one owned element
    assert not src._matches("w", bad)
    bad = exported.clone()
    bad[0] += 1  # a row this rank does not own
    assert src._matches("w", bad)


def _probe_gathers(rank, world, port):
    import torch
    import torch.distributed as dist

    from update_weight.megatron_probes import peer_probes

    shift = 10
    probe = torch.arange(12, dtype=torch.int32).add_(rank << shift).reshape(3, 4).t().contiguous()  # re-laid
    mixed = probe - (1 << shift) if rank == 1 else probe  # rank 1's holds rank 0's ids: not its own
    real, moved = dist.all_gather, []

    def counted(*args, **kwargs):
        moved.append(1)
        return real(*args, **kwargs)
    out = {}
    for label, t in (("own", probe), ("mixed", mixed)):
        want = [torch.empty_like(t) for _ in range(world)]
        real(want, t)
        dist.all_gather = counted  # what peer_probes falls back to
        try:
            with peer_probes(rank, shift, None):
                got = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(got, t)
        finally:
            dist.all_gather = real
        out[label] = (all(torch.equal(a, b) for a, b in zip(got, want)), len(moved))
    return out


def test_probe_gathers_are_computed_not_moved():
    """While the shard map is learned, Bridge's TP/EP all-gathers of probe ids move no bytes: each
    peer's tensor is this rank's with the peer's rank in the high bits. Where one rank's tensor is
    not its own ids alone, every rank runs the real gather. The results equal the real gather's."""
    results = run_ranks(_probe_gathers, 2, timeout=120)
    for r in results:
        assert r["own"] == (True, 0)  # computed: no gather moved the probe
        assert r["mixed"] == (True, 1)  # one rank's tensor is not its own: the real gather, on both


def test_probe_gathers_leave_other_threads_alone():
    """The probe interception answers only the thread whose probe converts: another thread's
    all_gather meanwhile (of int32 ids, the kind it would intercept) reaches the function it
    replaced, and once the last probe is done torch.distributed.all_gather is that function again."""
    import threading

    import torch
    import torch.distributed as dist

    from update_weight.megatron_probes import peer_probes

    real, seen = dist.all_gather, []

    def recorder(tensor_list, tensor, group=None, async_op=False):
        seen.append((threading.current_thread().name, tensor.clone()))
        for out in tensor_list:
            out.copy_(tensor)

    dist.all_gather = recorder
    try:
        with peer_probes(0, 10, None):
            assert dist.all_gather is not recorder  # the probe's gathers are intercepted on this thread
            ids = torch.arange(4, dtype=torch.int32)  # rank 0's own ids: a probe would compute it
            got = [torch.empty_like(ids) for _ in range(2)]
            t = threading.Thread(target=lambda: dist.all_gather(got, ids), name="trainer-side")
            t.start()
            t.join()
        assert [name for name, _ in seen] == ["trainer-side"] and torch.equal(got[1], ids)
        assert dist.all_gather is recorder
    finally:
        dist.all_gather = real


def test_the_run_slice_kernel_matches_a_search_per_run():
    """native.run_slices goes on from where a parameter's previous run ended (runs in local order)
    and searches from the start where a run comes before the last one's end or another parameter
    begins: the same (lo, n) as searching every run's bounds among all of its parameter's changes,
    for runs in order, out of order, empty, and parameters with no changes."""
    import torch

    from delta_sync import native

    g = torch.Generator().manual_seed(3)
    changes = [torch.randperm(5000, generator=g)[:k].sort().values.to(torch.int32) for k in (700, 0, 3, 2500)]
    param, start, end = [], [], []
    for p, n in enumerate((5000, 5000, 5000, 5000)):
        cuts = torch.randperm(n - 1, generator=g)[:40].add(1).sort().values.tolist()
        runs = list(zip([0, *cuts], [*cuts, n]))
        if p == 3:  # out of local order (a table of another source's layout)
            runs = runs[::-1][:20] + runs[:20]
        for a, b in runs:
            param.append(p), start.append(a), end.append(b if p != 2 else a)  # parameter 2: empty runs
    args = [torch.tensor(v, dtype=torch.int64) for v in (param, start, end)]
    lo, n = native.run_slices(*args, torch.tensor([c.data_ptr() for c in changes], dtype=torch.int64),
                              torch.tensor([c.numel() for c in changes], dtype=torch.int64))
    want_lo = [int(torch.searchsorted(changes[p], torch.tensor(a, dtype=torch.int32))) for p, a in zip(param, start)]
    want_hi = [int(torch.searchsorted(changes[p], torch.tensor(b, dtype=torch.int32))) for p, b in zip(param, end)]
    assert lo.tolist() == want_lo and n.tolist() == [h - l for h, l in zip(want_hi, want_lo)]
