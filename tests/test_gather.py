"""Ordered gather to rank 0 over real gloo processes: many shapes of input, and failures."""

import pytest
import torch
import torch.distributed as dist

from delta_sync.diff import int_view
from delta_sync.errors import DeltaSyncError, GatherError
from delta_sync.gather import Ordered, PatchGather
from delta_sync.patch import Patch, PatchBatch

from launchers.ranks import run_ranks

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
CASES = 24


def _case_items(case: int, rank: int, world: int) -> list[Ordered]:
    """Deterministic local patches of ``rank`` in ``case``; every rank can recompute any rank's."""
    g = torch.Generator().manual_seed(case * 101 + rank)
    kind = case % 6
    if kind == 0 and rank % 2 == 1:
        return []  # empty ranks
    if kind == 1 and rank != world - 1:
        return []  # only the last rank has anything
    items = []
    ntensors = int(torch.randint(1, 5, (1,), generator=g)) * (rank + 1)  # unequal per rank
    for t in range(ntensors):
        seq = t * world + rank  # interleaved export order
        dtype = DTYPES[(case + t) % 3]
        numel = int(torch.randint(1, 3000, (1,), generator=g))
        if kind == 2 and t % 2 == 0:  # dense
            vals = torch.randn(numel, generator=g).to(dtype)
            items.append(Ordered(seq, Patch.full(f"c{case}.t{seq}", vals)))
            continue
        count = int(torch.randint(0, numel, (1,), generator=g))
        idx = torch.randperm(numel, generator=g)[:count].sort().values.to(torch.int32)
        vals = torch.randn(count, generator=g).to(dtype)
        if kind == 3 and count > 1:  # non-contiguous inputs
            idx = torch.stack([idx, idx]).t().reshape(-1)[::2]
            vals = torch.stack([vals, vals], 1).reshape(-1)[::2]
            assert not vals.is_contiguous()
        items.append(Ordered(seq, Patch(f"c{case}.t{seq}", (numel,), dtype, idx, vals)))
    if kind == 4:  # one tensor split across all ranks: rank r holds indices == r mod world
        numel = 4000
        idx = torch.arange(rank, numel, world, dtype=torch.int32)[: 50 + 10 * rank]
        vals = (idx.float() / 7).to(torch.bfloat16)
        items.append(Ordered(10_000, Patch(f"c{case}.split", (numel,), torch.bfloat16, idx, vals)))
    if kind == 5:  # a diff kernel's batches: each dtype's changed tensors in one, ranks interleaved
        return _as_batches(items)
    return items


def _as_batches(items: list[Ordered]) -> list[Ordered]:
    """The sparse patches of ``items`` as one PatchBatch per dtype (each tensor's seq kept), the
    others as they are."""
    out, groups = [], {}
    for it in items:
        p = it.patch
        if p.dense or not p.count:
            out.append(it)
        else:
            groups.setdefault(p.dtype, []).append(it)
    for dtype, its in groups.items():
        ps = [it.patch for it in its]
        out.append(Ordered(its[0].seq, PatchBatch(
            [p.name for p in ps], [p.shape for p in ps], dtype, [p.count for p in ps],
            torch.cat([p.indices for p in ps]), torch.cat([p.values for p in ps]), [it.seq for it in its])))
    return out


def _expected(case: int, world: int) -> list[Patch]:
    """Independent of the code under test: plain Python sort and merge."""
    by_seq: dict[int, list[Patch]] = {}
    for r in range(world):
        for it in _case_items(case, r, world):
            if isinstance(it.patch, PatchBatch):
                for seq, p in zip(it.patch.seqs, it.patch.patches()):
                    by_seq.setdefault(seq, []).append(p)
            else:
                by_seq.setdefault(it.seq, []).append(it.patch)
    out = []
    for seq in sorted(by_seq):
        parts = by_seq[seq]
        if len(parts) == 1:
            out.append(parts[0])
            continue
        pairs = sorted((int(i), v) for p in parts for i, v in zip(p.indices.tolist(), p.values))
        out.append(Patch(parts[0].name, parts[0].shape, parts[0].dtype,
                         torch.tensor([i for i, _ in pairs], dtype=torch.int32), torch.stack([v for _, v in pairs])))
    return out


def _patches(got) -> list[Patch]:
    """A stream's patches and batches as one patch per tensor."""
    return [q for p in got for q in (p.patches() if isinstance(p, PatchBatch) else [p])]


def _same(a: Patch, b: Patch) -> bool:
    if (a.name, a.shape, a.dtype, a.dense) != (b.name, b.shape, b.dtype, b.dense):
        return False
    if not a.dense and not torch.equal(a.indices, b.indices):
        return False
    return torch.equal(int_view(a.values.contiguous()), int_view(b.values.contiguous()))


def _gather_cases(rank, world, port, kernel=True):
    if not kernel:  # the merge's torch path (device parts take it; here with the host kernel off)
        import delta_sync.gather as gather
        gather._RowsAt.of = classmethod(lambda cls, *a: None)
    gatherer = PatchGather()  # one instance: receive buffers are reused across cases
    kept = []
    for case in range(CASES):
        got = gatherer.gather(lambda: _case_items(case, rank, world))
        if rank != 0:
            assert got is None
            continue
        kept.append((case, got))
    for case, got in kept:  # checked after every case: no patch is a view of the reused receive buffer
        want = _expected(case, world)
        assert [p.name for p in got] == [p.name for p in want], case
        for a, b in zip(got, want):
            assert _same(a, b), (case, a.name)
            a.validate()
    return len(kept)


@pytest.mark.parametrize("world,kernel", [(2, True), (3, True), (4, True), (2, False)])
def test_gather_combinations(world, kernel):
    results = run_ranks(_gather_cases, world, kernel)
    assert results[0] == CASES


def _fail_on(rank, world, port, bad_rank, calls):
    g = PatchGather()
    outcomes = []
    for call in range(calls):
        def produce():
            if rank == bad_rank and call == 1:
                raise RuntimeError(f"export of layer.{call} failed on rank {rank}")
            return _case_items(call, rank, world)
        try:
            got = g.gather(produce)
            outcomes.append("ok" if rank or got is not None else "none")
        except GatherError as e:
            assert list(e.failures) == [bad_rank]
            assert f"rank {bad_rank}: RuntimeError: export of layer.1 failed" in str(e)
            outcomes.append("failed")
    dist.barrier()  # nobody is stuck in a collective
    return outcomes


@pytest.mark.parametrize("bad_rank", [0, 3])
def test_failure_on_one_rank_fails_all_ranks_without_hang(bad_rank):
    results = run_ranks(_fail_on, 4, bad_rank, 3, timeout=90)
    assert all(r == ["ok", "failed", "ok"] for r in results), results


def test_receive_buffer_kept_on_the_host_only():
    """A host gatherer keeps its receive buffer for the next update (no fresh pages); one on a
    device lets it go after each gather, so the largest delta gathered so far does not stay
    resident on the sender's device ("meta" stands in for a device here)."""
    from delta_sync.collectives import TrainerGroups

    host = PatchGather(TrainerGroups(None, None, torch.device("cpu")))
    host._buffer(1 << 10)
    host._release()
    assert host._recv is not None and host._recv.numel() == 1 << 10
    dev = PatchGather(TrainerGroups(None, None, torch.device("meta")))
    assert dev._buffer(1 << 10).device.type == "meta"
    dev._release()
    assert dev._recv is None


def _stream_cases(rank, world, port, bucket_bytes):
    """Every case through the streamed gather in rounds of ``bucket_bytes``: the same patches as one
    exchange, and no round brings more than ``bucket_bytes`` to rank 0 unless one tensor's parts do."""
    gatherer = PatchGather()
    rounds, checked = [], 0
    for case in range(CASES):
        stream = gatherer.stream(lambda: _case_items(case, rank, world), bucket_bytes)
        rounds.append(stream.rounds)
        if rank != 0:
            stream.finish()
            continue
        batches = list(stream)
        got = _patches(batches)
        stream.finish()  # nothing left: a no-op
        want = _expected(case, world)
        assert [p.name for p in got] == [p.name for p in want], case
        for a, b in zip(got, want):
            assert _same(a, b), (case, a.name)
        if case % 6 == 5:  # each rank's batch spans every round: it was split at the rounds' bounds
            assert stream.rounds > 1 and any(isinstance(p, PatchBatch) for p in batches), case
        largest = max((p.nbytes for p in want), default=0)
        assert stream.peak_round_bytes <= max(bucket_bytes, largest), (case, stream.peak_round_bytes)
        checked += 1
    return checked, rounds


@pytest.mark.parametrize("world", [2, 4])
def test_streamed_gather_equals_one_exchange_in_bounded_rounds(world):
    results = run_ranks(_stream_cases, world, 4096)
    assert results[0][0] == CASES
    assert all(r[1] == results[0][1] for r in results)  # every rank ran the same rounds
    assert max(results[0][1]) > 3  # the cases did need several rounds


def test_round_bounds_keep_a_tensors_parts_together():
    from delta_sync.gather import round_bounds

    # seq 5 has parts on two ranks (60 + 60 bytes): one round, even past the limit
    sizes = [(1, 40), (5, 60), (7, 30), (5, 60), (9, 100), (12, 10)]
    assert round_bounds(sizes, 100) == [5, 7, 9, 12, None]
    assert round_bounds(sizes, 1000) == [None]
    assert round_bounds([], 10) == [None]


def _stream_failures(rank, world, port, bad_rank):
    """A rank's pack fails in the second round; then the destination ends a stream with its own
    failure after one round; a part does not decode; the destination has no room for a round's
    receive buffer: each time every rank raises the same GatherError, nobody hangs, and the next
    stream is whole."""
    from delta_sync import gather as gather_mod

    g = PatchGather()
    out = []
    real = gather_mod._pack
    calls = [0]

    def failing_pack(items, device):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError(f"no room for round 2 on rank {rank}")
        return real(items, device)

    def corrupt_pack(part, device):  # a stray name: the destination cannot decode this rank's part
        return torch.cat([real(part, device), torch.tensor(list(b"\0stray"), dtype=torch.uint8)])

    def no_room(n):  # the destination's device has no room for a round's receive buffer
        if n:
            raise torch.OutOfMemoryError(f"cannot allocate {n} bytes")
        return torch.empty(0, dtype=torch.uint8)

    for attempt in ("pack fails", "dst fails", "corrupt", "dst no room", "whole"):
        stream = g.stream(lambda: _case_items(4, rank, world), 2048)
        if attempt == "pack fails" and rank == bad_rank:
            gather_mod._pack = failing_pack
        if attempt == "corrupt" and rank == bad_rank:
            gather_mod._pack = corrupt_pack
        if attempt == "dst no room" and rank == 0:
            g._recv, g._buffer = None, no_room
        try:
            if rank == 0:
                got = []
                try:
                    for p in stream:
                        got.append(p)
                        if attempt == "dst fails" and len(got) == 1:
                            break
                except GatherError:
                    raise
                except DeltaSyncError as e:  # what it could not decode ends the stream like its own failure
                    assert attempt == "corrupt" and f"the patches rank {bad_rank} sent do not decode" in str(e), e
                    stream.finish(e)
                stream.finish(RuntimeError("engine refused the update") if attempt == "dst fails" else None)
                out.append(("ok", len(_patches(got))))
            else:
                stream.finish()
                out.append(("ok", None))
        except GatherError as e:
            out.append(("failed", sorted(e.failures)))
        finally:
            gather_mod._pack = real
            g.__dict__.pop("_buffer", None)
        dist.barrier()  # nobody is stuck in a collective
    return out, stream.rounds


def test_a_failure_in_a_round_ends_the_stream_on_every_rank():
    results = run_ranks(_stream_failures, 3, 1, timeout=90)
    rounds = results[0][1]
    assert rounds > 2
    for out, _ in results:
        assert out[0] == ("failed", [1]) and out[1] == ("failed", [0]) and out[2] == ("failed", [0]), out
        assert out[3] == ("failed", [0]), out  # the destination without room: every rank told, none blocked
        assert out[4][0] == "ok"
    assert results[0][0][4][1] == len(_expected(4, 3))


@pytest.mark.parametrize("cut", [0, 1 << 30, 128])
def test_segments_joined_in_order_whichever_way_they_are_copied(monkeypatch, cut):
    """Rank 0 joins each batch's segments out of the gathered sections: back to back (a view),
    runs of segments that follow each other, out of order, empty ones; cut out run by run
    (``cut`` 0) or gathered through positions (``cut`` huge), the same elements in the same order."""
    import delta_sync.gather as gather
    monkeypatch.setattr(gather, "CUT_RUN_ELEMENTS", cut)
    g = torch.Generator().manual_seed(cut % 97)
    src = torch.randn(5000, generator=g).to(torch.bfloat16)
    layouts = [[(0, 10), (10, 5), (15, 300)],  # back to back: a view
               [(400, 7), (407, 0), (407, 900), (20, 3), (23, 5), (3000, 1)],  # runs, a jump back, an empty one
               [(int(a), int(n)) for a, n in zip(torch.randint(0, 4000, (60,), generator=g),
                                                 torch.randint(0, 900, (60,), generator=g))]]
    for layout in layouts:
        starts = torch.tensor([a for a, _ in layout])
        counts = torch.tensor([n for _, n in layout])
        got = gather._segments(src, starts, counts)
        want = torch.cat([src[a:a + n] for a, n in layout])
        assert torch.equal(int_view(got), int_view(want)), layout


def test_host_merge_reads_by_address_only_parts_whose_rows_add_up(monkeypatch):
    """The host merge copies a batch's runs by address (one kernel call): only where every part's
    rows add up to its buffers. A batch whose counts claim more elements than it holds goes to
    the torch path, which reads nothing outside them."""
    import delta_sync.gather as gather

    made = []
    real = gather._RowsAt.of.__func__
    monkeypatch.setattr(gather._RowsAt, "of", classmethod(lambda cls, *a: made.append(real(cls, *a)) or made[-1]))

    def batch(counts):
        return gather._Part.of([Ordered(0, PatchBatch(["a", "b"], [(10,), (10,)], torch.bfloat16, counts,
                                                      torch.tensor([1, 4, 0, 2, 9], dtype=torch.int32),
                                                      torch.arange(5).to(torch.bfloat16), [0, 1]))],
                               torch.device("cpu"))
    got = gather._merge([batch([2, 3])])
    assert made[-1] is not None and _patches(got)[1].indices.tolist() == [0, 2, 9]
    try:
        gather._merge([batch([2, 40])])
    except (RuntimeError, IndexError):
        pass  # (the torch path may refuse it; it reads nothing outside the buffers either way)
    assert made[-1] is None
