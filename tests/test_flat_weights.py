"""FlatWeights: weights in flat buffers, deltas diffed whole and mapped through a table of runs.

Real channels and an in-memory receiver (the oracle: it rebuilds every tensor from the seed and
the patches); two-rank cases spawn real processes over gloo."""

import logging
import threading

import pytest
import torch

from delta_sync import FlatWeights, WeightSync
from delta_sync.memory_receiver import MemoryReceiver


def _named(seed: int = 0) -> dict[str, torch.Tensor]:
    """Odd sizes (not whole 64-bit words), three dtypes (two of one width: one run table), 1-D to 3-D."""
    g = torch.Generator().manual_seed(seed)
    out = {f"layers.{i}.w": torch.randn(5 + 3 * i, 7, generator=g).bfloat16() for i in range(6)}
    out["norm.weight"] = torch.randn(13, generator=g).bfloat16()
    out["experts.w"] = torch.randn(3, 4, 9, generator=g).bfloat16()
    out["router.weight"] = torch.randn(11, generator=g)  # float32: a buffer of its own
    out["tail"] = torch.randn(3, generator=g).bfloat16()
    out["scales"] = torch.randn(6, 5, generator=g).half()  # float16: bf16's width, another dtype
    return out


def _step(tensors: dict[str, torch.Tensor], g: torch.Generator, density: float = 0.05) -> None:
    """Change ``density`` of each weight in place, as an optimizer would."""
    with torch.no_grad():
        for t in tensors.values():
            flat = t.view(-1)
            k = max(1, round(flat.numel() * density))
            pos = torch.randint(0, flat.numel(), (k,), generator=g)
            flat[pos] = (flat[pos].float() * 1.5 + 0.25).to(t.dtype)


def _exact(receiver: MemoryReceiver, tensors: dict[str, torch.Tensor]) -> bool:
    return receiver.mismatched(list(tensors.items())) == []


@pytest.mark.parametrize("cap", [None, 200], ids=["one-buffer-per-dtype", "buffers-capped"])
def test_deltas_of_flat_weights_are_diffed_whole_and_exact(monkeypatch, cap):
    """Seed by the stream, then deltas from the buffers' diff: exact after each (odd sizes, two
    dtypes, a delta with nothing changed, one that changes every element), verify() agrees with
    the receiver, and nothing went tensor by tensor. ``buffers-capped``: buffers of at most 200
    elements (a buffer's int32 offsets bound it at 2^30), a larger tensor in one of its own."""
    import delta_sync.flat as flat_module

    if cap is not None:
        monkeypatch.setattr(flat_module, "MAX_BUFFER_ELEMENTS", cap)
    named = _named()
    flat = FlatWeights(named.items())
    if cap is not None:  # bf16: 35+56+77+98+119+140 (+pads) ... in several buffers, each <= cap or alone
        sizes = [b.data.numel() for b in flat._buffers]
        assert len(sizes) > 2 and all(s <= cap or len(b.members) == 1 for s, b in zip(sizes, flat._buffers))
    assert all(torch.equal(flat.tensors[n], t) for n, t in named.items())
    assert flat.tensors["layers.1.w"].data_ptr() != named["layers.1.w"].data_ptr()  # copied in
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    g = torch.Generator().manual_seed(1)
    try:
        assert sync.update(flat).kind == "seed" and _exact(receiver, flat.tensors)
        assert flat.ready()  # its snapshots back the deltas now
        for density in (0.05, 0.0, 0.3, 1.0):
            if density:
                _step(flat.tensors, g, density)
            rep = sync.update(flat)
            assert rep.kind == "delta" and _exact(receiver, flat.tensors), density
            assert (rep.changed_elements == 0) == (density == 0)
        assert not list(sync.store.snapshots())  # no plain copy kept: the buffers' snapshots back the deltas
        assert len(sync.verify()) == len(named)
    finally:
        sync.close()


def test_a_failed_delta_puts_the_snapshots_back():
    """A delta the receiver refuses leaves the engines on v-1 and the buffers' snapshots as they
    were: the next delta carries both steps' changes, exact."""
    flat = FlatWeights(_named().items())
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    g = torch.Generator().manual_seed(2)
    try:
        sync.update(flat)
        _step(flat.tensors, g)
        real = receiver.finish

        def refuse(*args):
            raise RuntimeError("refused by the test")
        receiver.finish = refuse
        with pytest.raises(Exception, match="refused by the test"):
            sync.update(flat)
        receiver.finish = real
        assert not _exact(receiver, flat.tensors)
        _step(flat.tensors, g)
        rep = sync.update(flat)
        assert rep.kind == "delta" and _exact(receiver, flat.tensors)
    finally:
        sync.close()


def test_adopted_module_trains_in_the_buffers_and_syncs_exactly():
    """adopt() moves a module's parameters into the buffers without changing them or their
    objects: an optimizer built before keeps stepping them, and each step's delta is exact."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    flat = FlatWeights.adopt(model)
    assert list(model.parameters()) == params  # the same objects
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.data_ptr() == flat.tensors[n].data_ptr() for n, p in model.named_parameters())
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    try:
        sync.update(flat)
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 9).bfloat16()).float().pow(2).mean().backward()
            opt.step()
            rep = sync.update(flat)
            assert rep.kind == "delta" and rep.changed_elements > 0
            assert receiver.mismatched([(n, p.detach()) for n, p in model.named_parameters()]) == []
    finally:
        sync.close()


def test_a_weight_moved_out_of_its_buffer_is_still_synced_exactly(caplog):
    """A parameter whose storage is replaced (``p.data = x``) is no longer in the buffer the deltas
    diff: FlatWeights says so (logged once) and the deltas read the weights by the stream from then
    on, exact, the moved weight's new values included."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 6).to(torch.bfloat16)
    flat = FlatWeights.adopt(model)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    try:
        sync.update(flat)
        with torch.no_grad():
            model.weight.data = model.weight.detach() + 1  # new storage: the buffer keeps the old values
        with caplog.at_level(logging.WARNING, logger="delta_sync.flat"):
            rep = sync.update(flat)
        assert "no longer lies in its buffer" in caplog.text
        assert rep.kind == "delta" and not flat.ready()
        assert receiver.mismatched([(n, p.detach()) for n, p in model.named_parameters()]) == []
        window, want = sync._sweep  # the next drift sweep's trainer half: every name of its window
        assert window and set(want) == set(window)
        with torch.no_grad():
            model.bias.add_(1)
        assert sync.update(flat).kind == "delta"
        assert receiver.mismatched([(n, p.detach()) for n, p in model.named_parameters()]) == []
    finally:
        sync.close()


@pytest.mark.parametrize("bad,match", [
    ([], "of no tensors"), ([("a", torch.zeros(2)), ("a", torch.zeros(2))], "given twice"),
    ([("a", torch.zeros(2, dtype=torch.int8))], "not supported")])
def test_bad_weights_are_refused_naming_what(bad, match):
    with pytest.raises(Exception, match=match):
        FlatWeights(bad)


def _two_ranks(rank, world, port):
    named = _named(3)
    flat = FlatWeights(named.items())
    receiver = MemoryReceiver() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", timeout_s=60)
    g = torch.Generator().manual_seed(4)  # the same steps on every rank (replicas)
    out = []
    try:
        sync.update(flat)
        shares = [(b.first, b.last) for b in flat._buffers]
        for density in (0.05, 0.5, 0.05, 0.05):
            if len(out) == 2 and rank == 0:
                receiver.version = None  # a restart: the engine lost the base of the next delta
            _step(flat.tensors, g, density)
            rep = sync.update(flat)
            out.append((rep.kind, rank != 0 or _exact(receiver, flat.tensors)))
        digests = sync.verify()
        return {"shares": shares, "steps": out, "verified": len(digests), "mine": sorted(flat.local_digests())}
    finally:
        sync.close()


def test_two_replica_ranks_diff_disjoint_shares_and_stay_exact():
    """Each rank diffs and snapshots a contiguous share of each buffer, whole tensors only; the
    shares cover every tensor once, the gathered deltas are exact and verify() sums the shares. An
    engine that lost its base (its start reply says so) turns that update into a seed on both ranks,
    in the same call; the deltas go on after it."""
    from launchers.ranks import run_ranks

    r0, r1 = run_ranks(_two_ranks, 2, timeout=180)
    assert r0["steps"] == r1["steps"] == [("delta", True), ("delta", True), ("seed", True), ("delta", True)]
    assert r0["verified"] == r1["verified"] == len(_named())
    assert not set(r0["mine"]) & set(r1["mine"]) and len(r0["mine"]) + len(r1["mine"]) == len(_named())
    assert r0["mine"] and r1["mine"]


def test_snapshots_that_cannot_be_taken_leave_the_deltas_to_the_stream(monkeypatch, caplog):
    """Out of memory copying the buffers at a seed's commit: logged, and the next delta goes by the
    stream against WeightSync's own snapshot (a one-rank seed's packed buckets are one), exact; its
    commit takes the buffers' snapshots again, and the deltas after it diff the buffers."""
    from delta_sync import flat as flat_mod

    flat = FlatWeights(_named().items())
    real = flat_mod._Buffer.span

    class NoRoom:
        def clone(self):
            raise torch.OutOfMemoryError("no room for the snapshot (test)")
    monkeypatch.setattr(flat_mod._Buffer, "span", lambda self: NoRoom())
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    g = torch.Generator().manual_seed(5)
    try:
        with caplog.at_level(logging.WARNING, logger="delta_sync.flat"):
            assert sync.update(flat).kind == "seed"
        assert "could not take its snapshots" in caplog.text and not flat.ready()
        monkeypatch.setattr(flat_mod._Buffer, "span", real)
        assert list(sync.store.snapshots())  # the store's copy holds the version
        for _ in range(2):
            _step(flat.tensors, g)
            assert sync.update(flat).kind == "delta" and _exact(receiver, flat.tensors)
            assert flat.ready() and not list(sync.store.snapshots())  # the buffers' snapshots took over
    finally:
        sync.close()


def test_float32_flat_weights_for_a_bfloat16_sync_go_by_the_stream_cast(caplog):
    """fp32 weights in FlatWeights, a sync that sends bf16: diffing the fp32 buffers would send fp32
    bits, so the sync reads them as a stream, each tensor cast (logged once), exact in bf16."""
    named = {n: t.float() for n, t in _named().items()}
    flat = FlatWeights(named.items())
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", dtype=torch.bfloat16, timeout_s=60)
    g = torch.Generator().manual_seed(6)
    try:
        with caplog.at_level(logging.WARNING, logger="delta_sync.sync"):
            assert sync.update(flat).kind == "seed"
        assert "holds ['torch.float32'] weights but this sync sends torch.bfloat16" in caplog.text
        for _ in range(2):
            _step(flat.tensors, g)
            assert sync.update(flat).kind == "delta"
            assert receiver.mismatched([(n, t.bfloat16()) for n, t in flat.tensors.items()]) == []
        assert sync.sharded is None and not flat.ready()
    finally:
        sync.close()


def _patches(out) -> dict[str, tuple[list[int], list[int]]]:
    got = {}
    for o in out:
        b = o.patch
        for name, idx, vals in zip(b.names, b.indices.split(b.counts), b.values.split(b.counts)):
            got[name] = (idx.tolist(), vals.view(torch.int16).tolist())
    return got


def test_the_torch_op_path_a_device_runs_matches_the_kernel_with_no_op_per_tensor(monkeypatch):
    """A device's FlatWeights delta takes the torch-op path (no host kernel): the same patches as the
    kernel's, in the same number of torch operations and host syncs whether the buffers hold 40 or
    400 tensors (counted by dispatch mode, as `bench skeleton --torch-path` counts them)."""
    from delta_sync import native
    from launchers.device_check import OpCounter

    counts = []
    for n in (40, 400):
        g = torch.Generator().manual_seed(n)
        named = {f"t{i}": torch.randn(3 + i % 7, 5, generator=g).bfloat16() for i in range(n)}
        got = {}
        for path in ("kernel", "torch"):
            if path == "torch":
                monkeypatch.setattr(native, "kernel", lambda: None)
            flat = FlatWeights(named.items())
            flat.seeded()
            flat.commit()
            _step(flat.tensors, torch.Generator().manual_seed(7), 0.1)
            flat.local_patches()  # (its run tables made)
            flat.rollback()
            counter = OpCounter()
            OpCounter.device(*flat.tensors.values())  # (its buffers stand for a device's)
            with counter:
                out = flat.local_patches()
            got[path] = _patches(out)
            if path == "torch":
                counts.append(counter.counts())
            flat.rollback()
        monkeypatch.undo()
        assert got["kernel"] == got["torch"] and len(got["torch"]) == n
    assert counts[0] == counts[1], counts  # ops and syncs: none per tensor
    assert counts[0]["syncs"] <= 5, counts  # the diff's four, the mapping's one


def test_the_engines_start_before_the_weights_addresses_are_checked(monkeypatch):
    """A delta's ``start`` calls go out before FlatWeights checks its weights' addresses (one read
    per tensor: ~2-4 ms at 30B-A3B's count), so the call's round trip overlaps the check; a check
    that fails ends the sessions it started, and the next delta is exact."""
    flat = FlatWeights(_named().items())
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    started = threading.Event()
    real_start, real_ready = receiver.start, FlatWeights.ready
    monkeypatch.setattr(receiver, "start", lambda *a, **k: started.set() or real_start(*a, **k))
    g = torch.Generator().manual_seed(5)
    try:
        assert sync.update(flat).kind == "seed"
        started.clear()

        def ready_after_start(self):
            assert started.wait(10), "the address check ran before the engines were started"
            return real_ready(self)

        monkeypatch.setattr(FlatWeights, "ready", ready_after_start)
        _step(flat.tensors, g)
        assert sync.update(flat).kind == "delta" and _exact(receiver, flat.tensors)
        ended, real_discard = [], receiver.discard
        monkeypatch.setattr(receiver, "discard", lambda *a, **k: ended.append(1) or real_discard(*a, **k))
        monkeypatch.setattr(FlatWeights, "ready", lambda self: (_ for _ in ()).throw(RuntimeError("check failed")))
        _step(flat.tensors, g)
        with pytest.raises(RuntimeError, match="check failed"):
            sync.update(flat)
        assert ended == [1]  # the session the start opened, ended
        monkeypatch.setattr(FlatWeights, "ready", real_ready)
        assert sync.update(flat).kind == "delta" and _exact(receiver, flat.tensors)
    finally:
        sync.close()
