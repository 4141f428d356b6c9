"""The bulk path streams: seeds and full updates never hold more than two buckets on either side,
the receiver applies each bucket as it arrives, and a bulk update that fails midway ends in a
seed. Buffers are counted, not timed (this machine is shared)."""

import logging
import threading
import time

import pytest
import torch

from delta_sync.errors import EngineError, PatchValidationError
from delta_sync.memory_receiver import MemoryReceiver
from delta_sync.patch import Patch
from delta_sync.sync import WeightSync
from delta_sync.transfer import BUCKETS_IN_FLIGHT

from .test_channel import model_at


class SlowReceiver(MemoryReceiver):
    """Applies each bulk range slowly, so an unbounded sender would pile buckets up meanwhile;
    remembers how many ranges were applied before the version's last bucket arrived."""

    def __init__(self, delay_s: float = 0.002):
        super().__init__()
        self.delay_s = delay_s
        self.ranges = 0

    def _write_range(self, entry, p):
        time.sleep(self.delay_s)
        self.ranges += 1
        super()._write_range(entry, p)


def _many_tensors(n: int = 48) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {f"layers.{i}.w": torch.randn(64, 40 + i, generator=g).to(torch.bfloat16) for i in range(n)}


@pytest.mark.parametrize("mode", ["delta", "full"])
def test_seed_and_full_hold_at_most_two_buckets_each_side(mode):
    state = _many_tensors()
    receiver = SlowReceiver()
    sync = WeightSync([receiver], mode=mode, bucket_bytes=8 << 10, timeout_s=60)
    try:
        seed = sync.update(state.items())
        assert seed.kind == "seed" and seed.buckets > 40  # ~300 KiB through 8 KiB buckets
        assert seed.verified and seed.timings["digest_pack_s"] > 0  # every entry's digest was checked in flight
        assert seed.timings["peak_buckets"] <= BUCKETS_IN_FLIGHT
        assert 1 <= receiver.peak_buckets <= BUCKETS_IN_FLIGHT
        assert receiver.ranges >= len(state)  # applied range by range, as buckets arrived
        assert receiver.mismatched(state.items()) == []
        for t in state.values():
            t.view(-1)[::7] = (t.view(-1)[::7].float() * 1.5 + 0.25).to(t.dtype)
        rep = sync.update(state.items())
        assert rep.kind == ("full" if mode == "full" else "delta")
        assert receiver.mismatched(state.items()) == []
        if mode == "full":
            assert rep.timings["peak_buckets"] <= BUCKETS_IN_FLIGHT and receiver.peak_buckets <= BUCKETS_IN_FLIGHT
            assert not sync.store.snapshots()  # a full-mode trainer never diffs: no snapshot at all
        else:
            assert len(sync.store.snapshots()) == len(state)
    finally:
        sync.close()


def test_one_rank_seed_packs_each_tensor_once_into_its_snapshot():
    """A one-rank delta trainer's seed buckets become its snapshot (one copy of the model, not a
    snapshot copy plus the buckets'): each snapshot is a view of the bucket it was packed into, a
    tensor larger than a bucket gets memory of its own, one that would sit off the diff kernel's
    word alignment is copied, nothing aliases the trainer's tensors, and deltas stay exact. The
    whole seed is packed before the engines pause (holding its buckets costs nothing the snapshot
    does not), so the pause window covers only the send and the apply."""
    from delta_sync.diff import word_aligned

    class PauseWatch(MemoryReceiver):
        def __init__(self):
            super().__init__()
            self.staged_at_pause: list[int] = []

        def pause(self, mode: str = "wait") -> None:
            self.staged_at_pause.append(len(sync.store._staged))
            super().pause(mode)

    state = _many_tensors()  # 48 tensors of 5-11 KiB
    g = torch.Generator().manual_seed(3)
    state["big"] = torch.randn(200, 100, generator=g).to(torch.bfloat16)  # 40 KB: 2 buckets of 32 KiB
    state["odd"] = torch.randn(3, 5, generator=g).to(torch.bfloat16)  # 30 B: puts the next one off 8-byte words
    state["after_odd"] = torch.randn(16, 16, generator=g).to(torch.bfloat16)
    receiver = PauseWatch()
    sync = WeightSync([receiver], mode="delta", bucket_bytes=32 << 10, timeout_s=60)
    try:
        seed = sync.update(state.items())
        assert seed.buckets > 5 and receiver.staged_at_pause == [len(state)]  # all packed, then paused
        snaps = dict(sync.store.snapshots())
        assert snaps.keys() == state.keys()
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in snaps.values()}
        model_bytes = sum(t.numel() * t.element_size() for t in state.values())
        assert len(storages) < len(snaps) / 2  # several tensors per bucket share its memory
        assert model_bytes <= sum(storages.values()) <= model_bytes + 2 * 512 + 64 * len(storages)
        assert snaps["big"].untyped_storage().nbytes() == 40_000  # its own memory, sent in pieces
        assert all(word_aligned(t.view(-1)) for t in snaps.values())
        assert not storages.keys() & {t.untyped_storage().data_ptr() for t in state.values()}
        assert all(torch.equal(snaps[n].view(torch.int16), t.view(torch.int16)) for n, t in state.items())
        for step in range(2):
            for t in state.values():
                t.view(-1)[step::5] = (t.view(-1)[step::5].float() * 1.5 + 0.25).to(t.dtype)
            rep = sync.update(state.items())
            assert rep.kind == "delta" and receiver.mismatched(state.items()) == []
        assert sync.verify()  # engine digests == the adopted snapshots'
    finally:
        sync.close()


def test_full_update_failing_midway_ends_in_a_seed():
    """A full update writes as it goes (no undo copy): a failure after the first bucket leaves the
    receiver without a valid version, and the trainer's next update is a seed that repairs it."""
    state = model_at(3)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="full", bucket_bytes=2 << 10, timeout_s=60)
    try:
        sync.update(model_at(2).items())
        bad = dict(state)
        name = list(bad)[-1]  # the last tensor: earlier buckets are already applied when it is packed
        bad[name] = bad[name].clone()
        bad[name].view(-1)[5] = float("nan")
        with pytest.raises(PatchValidationError, match=f"{name}.*non-finite value at flat index 5"):
            sync.update(bad.items())
        assert receiver.version is None and sync.needs_seed  # partly written: only a seed can repair
        rep = sync.update(state.items())
        assert rep.kind == "seed" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def _streamed_delta_setup(monkeypatch):
    """Diff batches of two tensors; counts the buckets handed to the wire (on the caller's thread,
    in order with the stream's reads)."""
    import delta_sync.prepare as prepare_mod
    from delta_sync.transfer import BucketSender

    monkeypatch.setattr(prepare_mod, "DIFF_BATCH_TENSORS", 2)
    handed: list[int] = []
    put = BucketSender._put

    def counting(self, bucket, arena):
        handed.append(bucket.header["seq"])
        put(self, bucket, arena)

    monkeypatch.setattr(BucketSender, "_put", counting)
    return handed


def _changed(state: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in state.items():
        t = t.clone()
        t.view(-1)[step::9] = (t.view(-1)[step::9].float() * 1.5 + 0.25).to(t.dtype)
        out[n] = t
    return out


def test_a_one_rank_delta_leaves_in_buckets_while_it_is_diffed(monkeypatch):
    """A one-rank trainer does not gather its delta before sending it: the packer pulls patches
    from the diff, and the buckets filled so far are on their way before the last tensor is even
    read (the trainer holds about a bucket of patches, not the delta); the receiver, which stages
    the whole version and applies it at finish, ends exact."""
    handed = _streamed_delta_setup(monkeypatch)
    state = _many_tensors(12)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", bucket_bytes=1 << 10, timeout_s=60)
    try:
        sync.update(state.items())
        new = _changed(state, 1)
        seen_before_last: list[int] = []

        def stream():
            for i, (n, t) in enumerate(new.items()):
                if i == len(new) - 1:
                    seen_before_last.append(len(handed))
                yield n, t

        handed.clear()
        rep = sync.update(stream())
        assert rep.kind == "delta" and rep.buckets == len(handed) >= 6  # ~9 KiB of patches, 1 KiB buckets
        assert seen_before_last[0] >= 5  # most had left before the last tensor was read
        assert receiver.version == rep.version and receiver.mismatched(new.items()) == []
        assert rep.timings["diff_s"] > 0 and rep.timings["prepare_s"] == rep.timings["diff_s"]
    finally:
        sync.close()


@pytest.mark.parametrize("fault", ["non_finite", "left_out"])
def test_a_one_rank_delta_failing_after_buckets_left_changes_nothing(monkeypatch, fault):
    """The buckets a streamed delta sent before its failure was found are discarded: the receiver
    keeps the previous version bit for bit, the trainer's snapshot rolls back, and the next delta
    (no seed needed) is exact."""
    handed = _streamed_delta_setup(monkeypatch)
    state = _many_tensors(12)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", bucket_bytes=1 << 10, timeout_s=60)
    try:
        seeded = sync.update(state.items()).version
        bad = _changed(state, 1)
        last = list(bad)[-1]
        if fault == "non_finite":
            bad[last].view(-1)[10] = float("nan")  # a changed element of the last batch
            items, match = list(bad.items()), f"{last}.*non-finite"
        else:
            items, match = list(bad.items())[:-1], f"{last}.*left out of this delta"
        handed.clear()
        with pytest.raises(PatchValidationError, match=match) as info:
            sync.update(items)
        assert len(handed) >= 5  # the earlier batches had left (then an abort bucket ended the version)
        assert f"engines and trainer snapshot at v{seeded}" in str(info.value)
        assert receiver.version == seeded and receiver.mismatched(state.items()) == []
        assert sync.version == seeded and not sync.needs_seed
        good = _changed(state, 2)
        rep = sync.update(good.items())
        assert rep.kind == "delta" and rep.version == seeded + 1 and receiver.mismatched(good.items()) == []
    finally:
        sync.close()


def test_receiver_error_midway_through_a_seed_is_reported_and_reseeded():
    state = model_at(1)

    class Failing(MemoryReceiver):
        fail = True

        def _write_range(self, entry, p):
            if self.fail and p.name == "layers.1.w":
                raise RuntimeError("disk full while writing layers.1.w")
            super()._write_range(entry, p)

    receiver = Failing()
    sync = WeightSync([receiver], bucket_bytes=1 << 10, timeout_s=60)
    try:
        with pytest.raises(EngineError, match="disk full while writing layers.1.w"):
            sync.update(state.items())
        assert sync.needs_seed and receiver.version is None
        receiver.fail = False
        assert sync.update(state.items()).kind == "seed"
        assert receiver.mismatched(state.items()) == []
        assert threading.active_count() < 20  # sender/receiver threads end with their version
    finally:
        sync.close()


class ShardedStandIn:
    """A ShardedSource over a plain dict (a stand-in for the Megatron fast path): deltas come from
    its own snapshots, never from WeightSync's snapshot store."""

    def __init__(self, state: dict[str, torch.Tensor]):
        from delta_sync.diff import BitwiseDiff

        self.state, self.differ = state, BitwiseDiff()
        self.total_elements = sum(t.numel() for t in state.values())
        self._snap: dict | None = None
        self._staged: dict = {}

    def __iter__(self):
        return iter(list(self.state.items()))

    def ready(self):
        return self._snap is not None

    def seeded(self):
        self._staged = {n: t.clone() for n, t in self.state.items()}

    def expects_to_serve(self):
        return True

    def local_patches(self):
        from delta_sync.gather import Ordered

        out = []
        for seq, (n, t) in enumerate(self.state.items()):
            p = self.differ.diff(n, self._snap[n], t)
            if p.count:
                out.append(Ordered(seq, p))
        self._staged = {n: t.clone() for n, t in self.state.items()}
        return out

    def commit(self):
        self._snap, self._staged = self._staged, {}

    def rollback(self):
        self._staged = {}

    def reset(self):
        self._snap, self._staged = None, {}

    def local_digests(self, names=None):
        from delta_sync.digest import digest_tensor

        return {n: digest_tensor(t) for n, t in self._snap.items() if names is None or n in names}


def test_switching_the_source_forces_a_seed_and_stays_exact():
    """An element that changes while the sharded source serves deltas and then returns to its old
    value must still reach the engine after a switch to a plain stream."""
    state = {n: t.clone() for n, t in model_at(0).items()}
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], bucket_bytes=4 << 10, timeout_s=60)
    try:
        sync.update(state.items())  # plain stream: seed, plain snapshots at v0
        source = ShardedStandIn(state)
        assert sync.update(source).kind == "seed"  # switch: a seed, the source's snapshots start
        assert not dict(sync.store.snapshots())  # and no plain snapshot beside them
        old = state["layers.1.w"].view(-1)[0].clone()
        state["layers.1.w"].view(-1)[0] = old + 1
        rep = sync.update(source)
        assert rep.kind == "delta" and rep.changed_elements == 1  # fast path, plain store untouched
        state["layers.1.w"].view(-1)[0] = old  # back to the value the plain snapshot still holds
        rep = sync.update(state.items())
        assert rep.kind == "seed"
        assert receiver.mismatched(state.items()) == []
        state["layers.0.q"].view(-1)[:3] += 1
        assert sync.update(state.items()).kind == "delta" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def _shares_memory(part: torch.Tensor, whole: torch.Tensor) -> bool:
    """Is ``part`` a view into ``whole``'s bytes (not a copy of them)?"""
    lo = whole.data_ptr()
    hi = lo + whole.numel() * whole.element_size()
    return lo <= part.data_ptr() and part.data_ptr() + part.numel() * part.element_size() <= hi


@pytest.mark.parametrize("direct", [True, False], ids=["received-in-place", "received-in-arena"])
def test_large_ranges_travel_from_the_source_without_a_copy(monkeypatch, direct):
    """A full-mode seed sends every range of at least DIRECT_MIN_BYTES from the trainer's own tensor
    (digested, never copied into a bucket) and a receiver that names destinations gets it there
    (nothing lands in its bucket arena); small tensors still travel packed. A receiver that names no
    destination receives the same broadcasts into its arena. Exact either way, deltas after it too."""
    from delta_sync import bucket as bucket_mod
    from delta_sync.channel import Channel

    monkeypatch.setattr(bucket_mod, "DIRECT_MIN_BYTES", 16 << 10)
    g = torch.Generator().manual_seed(3)
    state = {"mid": torch.randn(128, 80, generator=g).to(torch.bfloat16),  # 20 KB: one broadcast
             "small.a": torch.randn(8, 8, generator=g).to(torch.bfloat16),  # 128 B: packed
             # 60 KB over three buckets: 3968 B (packed: the room left), 2 x 24 KiB, 6880 B (packed)
             "big": torch.randn(300, 100, generator=g).to(torch.bfloat16),
             "small.b": torch.randn(3, 5, generator=g).to(torch.bfloat16)}
    sent, placed = [], []
    plain_send, plain_recv = Channel.send_bucket, Channel.recv_bucket

    def send(self, b):
        for i, src in b.sources.items():
            e = b.header["entries"][i]
            sent.append((e["name"], _shares_memory(src, state[e["name"]])))
        plain_send(self, b)

    def recv(self, arena_for=None, place=None):
        b = plain_recv(self, arena_for, place)
        placed.extend((b.header["entries"][i]["name"], dst) for i, dst in b.sources.items())
        return b

    monkeypatch.setattr(Channel, "send_bucket", send)
    monkeypatch.setattr(Channel, "recv_bucket", recv)
    receiver = MemoryReceiver(direct=direct)
    sync = WeightSync([receiver], mode="full", bucket_bytes=24 << 10, timeout_s=60)
    try:
        rep = sync.update(state.items())
        assert rep.kind == "seed" and rep.verified and receiver.mismatched(state.items()) == []
        # "mid" whole and two pieces of "big": sent from the trainer's tensors
        assert sorted(sent) == [("big", True), ("big", True), ("mid", True)]
        if direct:  # and written straight into the receiver's tensors
            assert len(placed) == len(sent)
            assert all(_shares_memory(dst, receiver.tensors[name]) for name, dst in placed)
        else:
            assert placed == []
        for t in state.values():
            t.view(-1)[::5] = (t.view(-1)[::5].float() * 1.5 + 0.25).to(t.dtype)
        rep = sync.update(state.items())
        assert rep.kind == "full" and rep.verified and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def test_a_range_damaged_in_flight_is_refused_and_reseeded(monkeypatch):
    """A range received in place is checked against the sender's digest after it landed: a flipped
    bit fails the update, the receiver has no version, and the next update is a seed that repairs it."""
    from delta_sync.channel import Channel

    state = _many_tensors(6)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="full", bucket_bytes=16 << 10, timeout_s=60)
    plain_send = Channel.send_bucket
    damaged = []

    def send(self, b):
        if b.sources and not damaged and b.header["seq"] == 1:  # the second bucket of the update
            i = next(iter(b.sources))
            b.sources[i] = b.sources[i].clone()  # what leaves differs from what was digested
            b.sources[i].view(torch.int16)[7] ^= 0x0100
            damaged.append(b.header["entries"][i]["name"])
        plain_send(self, b)

    try:
        sync.update(state.items())
        monkeypatch.setattr(Channel, "send_bucket", send)
        with pytest.raises(EngineError, match="digest"):
            sync.update(state.items())
        assert damaged and receiver.version is None and sync.needs_seed
        monkeypatch.setattr(Channel, "send_bucket", plain_send)
        rep = sync.update(state.items())
        assert rep.kind == "seed" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def _two_rank_seed(rank, world, port):
    """Each of two ranks owns half the snapshot and stages it once the stream is read: rank 0 (the
    sender) once the engines resumed, rank 1 while rank 0 publishes; at pause and at resume rank 0
    holds nothing of its share staged. A staging failure on either rank after the engines applied
    the seed ends in another seed that every rank agrees on."""
    from delta_sync.errors import DeltaSyncError

    from .test_channel import model_at

    class Watch(MemoryReceiver):
        def __init__(self):
            super().__init__()
            self.staged: list[tuple[str, int]] = []

        def pause(self, mode: str = "wait") -> None:
            self.staged.append(("pause", len(sync.store._staged)))
            super().pause(mode)

        def resume(self) -> None:
            self.staged.append(("resume", len(sync.store._staged)))
            super().resume()

    receiver = Watch() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", bucket_bytes=4 << 10, timeout_s=30)
    out: dict = {"first": [], "needs_seed": []}
    try:
        state = model_at(0)
        mine = sorted(n for n, t in state.items() if sync.store.owns(n, t.numel() * t.element_size()))
        out["owns"] = 0 < len(mine) < len(state)
        real = sync.store.prepare_many

        def failing(items, full=False):
            sync.store.prepare_many = real
            raise MemoryError(f"out of host memory staging the snapshot on rank {rank}")
        for bad in (0, 1):  # the first seed fails staging on rank 0, the second on rank 1
            if rank == bad:
                sync.store.prepare_many = failing
            try:
                sync.update(state.items())
                out["first"].append("ok")
            except DeltaSyncError as e:
                out["first"].append(str(e))
            out["needs_seed"].append(sync.needs_seed)
        rep = sync.update(state.items())
        out["second"] = rep.kind
        out["snapshot"] = sorted(n for n, _ in sync.store.snapshots()) == mine
        for v in (1, 2):
            out[f"v{v}"] = sync.update(model_at(v).items()).kind
        if rank == 0:
            out["watch"] = receiver.staged
            out["exact"] = receiver.mismatched(model_at(2).items()) == []
    finally:
        sync.close()
    return out


def test_a_two_rank_seed_stages_snapshots_outside_the_pause():
    from launchers.ranks import run_ranks

    r0, r1 = run_ranks(_two_rank_seed, 2, timeout=180)
    assert r0["owns"] and r1["owns"]
    for bad, (e0, e1) in enumerate(zip(r0["first"], r1["first"])):
        assert f"out of host memory staging the snapshot on rank {bad}" in e0 and "need a seed" in e0
        assert "engines applied v" in e1  # rank 0's outcome, heard by every rank
    assert r0["needs_seed"] == r1["needs_seed"] == [True, True]
    assert r0["second"] == r1["second"] == "seed" and r0["snapshot"] and r1["snapshot"]
    assert r0["v1"] == r0["v2"] == r1["v2"] == "delta" and r0["exact"]
    # three seeds: nothing of rank 0's share staged while the engines were paused
    assert [w for w in r0["watch"] if w[0] in ("pause", "resume")][:6] == [("pause", 0), ("resume", 0)] * 3


def _seed_with_engine_down(rank, world, port):
    from .test_channel import model_at

    class Down(MemoryReceiver):
        down = True

        def report(self, digests: bool = False, names=None):
            if self.down:
                raise ConnectionError("engine unreachable")
            return super().report(digests, names)

    receiver = Down() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", timeout_s=60)
    out = []
    try:
        t0 = time.monotonic()
        try:
            sync.update(model_at(0).items())
            out.append("ok")
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
        out.append(time.monotonic() - t0)
        out.append(sync.needs_seed)
        if rank == 0:
            receiver.down = False
        out.append(sync.update(model_at(1).items()).kind)
        out.append(receiver.mismatched(model_at(1).items()) == [] if rank == 0 else True)
    finally:
        sync.close()
    return out


def test_a_two_rank_seed_with_its_engine_down_fails_on_every_rank_at_once():
    """Rank 0 cannot reach its engine, so it never sends a bucket; the other rank read the stream
    and waits to agree on it. Every rank raises rank 0's error at once (not at the collective
    timeout, which would leave the trainer's groups broken), and the next update is an exact seed."""
    from launchers.ranks import run_ranks

    for error, seconds, needs_seed, kind, exact in run_ranks(_seed_with_engine_down, 2, timeout=120):
        assert error.startswith("GatherError") and "rank 0: ConnectionError: engine unreachable" in error
        assert seconds < 30 and needs_seed and kind == "seed" and exact


def test_pack_time_is_the_packers_own():
    """``pack_s`` is the packer's own work: the time its source takes to yield the tensors (an
    export, and a one-rank delta's diff, which the packer pulls as it fills buckets) is not in it."""
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], bucket_bytes=4 << 10, timeout_s=60)

    def slow(items, pause: float = 1.0):
        for i, item in enumerate(items):
            if i == 1:
                time.sleep(pause)
            yield item
    try:
        for v in (0, 1):  # a seed (packed whole into the snapshot), then a streamed delta
            rep = sync.update(slow(model_at(v).items()))
            assert rep.timings["total_s"] >= 1.0 and rep.timings["pack_s"] < 0.5, (rep.kind, rep.timings)
        assert receiver.mismatched(model_at(1).items()) == []
    finally:
        sync.close()


def test_verify_without_a_committed_snapshot_refuses():
    """Before a seed (or after a failure that left the trainer nothing committed) there is nothing to
    compare the engines against: verify says so instead of passing over an empty snapshot."""
    from delta_sync.errors import DeltaSyncError

    receiver = MemoryReceiver()
    sync = WeightSync([receiver], bucket_bytes=4 << 10, timeout_s=60)
    try:
        with pytest.raises(DeltaSyncError, match="nothing to verify"):
            sync.verify()
        sync.update(model_at(0).items())
        assert len(sync.verify()) == len(model_at(0))
    finally:
        sync.close()


def _three_rank_deltas(rank, world, port):
    """Deltas of 48 tensors over three ranks in 8 KiB buckets: rank 0 gathers the other ranks'
    patches a round (about a bucket) at a time while it packs; then rank 2 fails packing its second
    round of a delta: every rank raises it, the engine keeps v-1, and the next delta is exact."""
    from delta_sync import gather as gather_mod
    from delta_sync.errors import DeltaSyncError

    state = _many_tensors()
    receiver = MemoryReceiver() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", bucket_bytes=8 << 10, timeout_s=60,
                      drift_sweep=0)
    out = {"kinds": [], "rounds": [], "peaks": [], "largest": 0}
    g = torch.Generator().manual_seed(3)

    def step(frac):
        for t in state.values():  # the same step on every rank (same generator)
            flat = t.view(-1)
            pos = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * frac)),), generator=g)
            flat[pos] = (flat[pos].float() * 1.5 + 0.25).to(t.dtype)

    try:
        out["kinds"].append(sync.update(state.items()).kind)
        for frac in (0.05, 0.3):
            step(frac)
            rep = sync.update(state.items())
            out["kinds"].append(rep.kind)
            out["rounds"].append(rep.timings.get("gather_rounds"))
            out["peaks"].append(rep.timings.get("gather_peak_bytes"))
            out["largest"] = max(out["largest"], max(t.numel() * 6 for t in state.values()))  # int32 + bf16
            if rank == 0:
                out["exact"] = receiver.mismatched(state.items()) == []
        real, calls = gather_mod._pack, [0]

        def failing_pack(items, device):
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError("no room to pack round 2 on rank 2")
            return real(items, device)

        before = {n: t.clone() for n, t in state.items()}
        step(0.3)
        if rank == 2:
            gather_mod._pack = failing_pack
        try:
            sync.update(state.items())
            out["failed"] = None
        except DeltaSyncError as e:
            out["failed"] = str(e)
        finally:
            gather_mod._pack = real
        if rank == 0:
            out["kept"] = receiver.mismatched(before.items()) == [] and receiver.version == sync.version
        out["kinds"].append(sync.update(state.items()).kind)
        if rank == 0:
            out["exact_after"] = receiver.mismatched(state.items()) == []
    finally:
        sync.close()
    return out


def test_a_multi_rank_delta_is_gathered_in_bounded_rounds():
    from launchers.ranks import run_ranks

    r0, r1, r2 = run_ranks(_three_rank_deltas, 3, timeout=180)
    assert r0["kinds"] == r1["kinds"] == ["seed", "delta", "delta", "delta"]
    assert r0["exact"] and r0["kept"] and r0["exact_after"]
    assert all(n > 3 for n in r0["rounds"]), r0["rounds"]  # ~90-260 KiB of patches in 8 KiB rounds
    # rank 0 never held more of the other ranks' patches than a round: a bucket, or one tensor's
    assert all(0 < p <= max(8 << 10, r0["largest"]) for p in r0["peaks"]), r0["peaks"]
    for r in (r0, r1, r2):  # the same error on every rank, saying the engines kept v2
        assert "no room to pack round 2 on rank 2" in r["failed"], r["failed"]
        assert "kept: engines and trainer snapshot at v2" in r["failed"], r["failed"]


@pytest.mark.parametrize("preamble", [64 << 10, 100])
def test_a_bucket_opens_with_one_small_broadcast(monkeypatch, preamble):
    """A bucket's sizes and signed header travel in one fixed broadcast (the header's rest after it
    when longer: here at 100 bytes, every time); a bucket without indices (every bulk one) sends
    none. Seed and delta stay exact either way; the broadcasts per bucket are counted."""
    from delta_sync import channel as channel_mod

    monkeypatch.setattr(channel_mod, "PREAMBLE_BYTES", preamble)
    sent = []
    plain = channel_mod.Channel.broadcast_all

    def counting(self, tensors, src=0):
        if self.rank == src:
            sent.append([t.numel() * t.element_size() for t in tensors])
        return plain(self, tensors, src)

    monkeypatch.setattr(channel_mod.Channel, "broadcast_all", counting)
    state = _many_tensors(8)
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], mode="delta", bucket_bytes=16 << 10, timeout_s=60)
    try:
        seed = sync.update(state.items())
        per_seed = len(sent)
        for t in state.values():
            t.view(-1)[::11] = (t.view(-1)[::11].float() * 1.5 + 0.25).to(t.dtype)
        sent.clear()
        delta = sync.update(state.items())
        assert seed.kind == "seed" and delta.kind == "delta"
        assert receiver.mismatched(state.items()) == []
        opening = [s for s in sent if s == [preamble]]
        assert len(opening) == delta.buckets  # one opening broadcast per delta bucket
        # a delta bucket: the opening, the header's rest where it did not fit, its indices, its values
        assert len(sent) == delta.buckets * (3 if preamble == 64 << 10 else 4)
        # a seed bucket (no indices): the opening, the header's rest where it did not fit, its values
        # (the closing bucket may carry none)
        k = 2 if preamble == 64 << 10 else 3
        assert seed.buckets > 4 and per_seed in (k * seed.buckets - 1, k * seed.buckets), (per_seed, seed.buckets)
    finally:
        sync.close()


def test_a_delta_bucket_that_cannot_be_staged_fails_the_update_and_the_channel_stays_in_step(monkeypatch):
    """Staging a delta's bucket (a device engine copies it to host memory) can fail, e.g. with no
    host memory left: the receiver drains the rest of the version and raises that error at the
    end, so the next version arrives whole on the same channel."""
    import threading

    from delta_sync.catalog import TableSlice
    from delta_sync.snapshot import SnapshotStore
    from delta_sync.transfer import receive_update, send_update
    from launchers.device_check import _channel_pair

    tx, rx = _channel_pair(torch.device("cpu"), "stage-fails")
    g = torch.Generator().manual_seed(3)
    state = {f"layers.{i}.w": torch.randn(2048, generator=g).to(torch.bfloat16) for i in range(12)}
    store, got, calls = SnapshotStore(), [], [0]
    real = TableSlice.staged

    def staged(self, device):
        calls[0] += 1
        if calls[0] == 2:
            raise MemoryError("no host memory left to stage bucket 1")
        return real(self, device)

    monkeypatch.setattr(TableSlice, "staged", staged)

    def receive(n):
        for _ in range(n):
            try:
                got.append(receive_update(rx, tables=True, stage=torch.device("cpu")))
            except Exception as e:  # noqa: BLE001 - what the test looks at
                got.append(e)

    th = threading.Thread(target=receive, args=(3,))
    th.start()
    try:
        for v in range(3):
            if v:
                for t in state.values():
                    t[torch.randint(0, t.numel(), (40,), generator=g)] += 1
            patches = [p for p in store.prepare_many(list(state.items()), batched=v > 0) if p is not None]
            send_update(tx, v, "seed" if v == 0 else "delta", patches, bucket_bytes=512)
            store.commit(v)
        th.join(60)
    finally:
        tx.close()
        rx.close()
    assert not th.is_alive()
    assert isinstance(got[1], MemoryError) and "bucket 1" in str(got[1])
    # deltas of several buckets: version 1's after its second were drained, and version 2 arrived whole
    assert got[2].version == 2 and got[2].kind == "delta" and len(got[2].tables) > 2


@pytest.mark.parametrize("room", [1, 3, 64])
def test_a_stream_read_in_lists_gives_what_it_gives_item_by_item(room):
    """A delta reads its stream a list at a time (``TensorStream.chunks``): plain tensors of the
    wanted dtype under new names are checked as whole lists, any list holding something else goes
    item by item. Either way every item comes out as one by one: names mapped (wrapper prefixes
    stripped, names mapped to None left out), a float32 tensor cast, an integer one refused, a
    second tensor of one name refused, a parameter detached; and the names' bytes and the element
    count are the same."""
    from delta_sync.prepare import Chunk, TensorStream
    from delta_sync.sync import default_name_map

    g = torch.Generator().manual_seed(3)

    def items():
        out = [(f"w{i}", torch.randn(4 + i, generator=g).bfloat16()) for i in range(10)]
        out.insert(2, ("module.wrapped", torch.randn(3, generator=g).bfloat16()))
        out.insert(5, ("as_float", torch.randn(5, generator=g)))
        out.insert(7, ("ints", torch.arange(4)))
        out.insert(9, ("w1", torch.zeros(2, dtype=torch.bfloat16)))  # given twice
        out.append(("param", torch.nn.Parameter(torch.randn(6, generator=g).bfloat16())))
        out += [(f"x{i}", torch.randn(8, generator=g).bfloat16()) for i in range(7)]
        return out

    def name_map(name):
        return None if name == "w3" else default_name_map(name)
    name_map.many = lambda names: [name_map(n) for n in names]

    def seen_of(stream, got):
        return ([(seq, name, str(t) if isinstance(t, Exception) else (t.dtype, t.requires_grad, t.tolist()))
                 for seq, name, t in got], dict(stream.seen), stream.elements, stream.nbytes)

    pairs = items()
    one = TensorStream(pairs, name_map, torch.bfloat16, "v0")
    lists = TensorStream(pairs, name_map, torch.bfloat16, "v0")
    chunks = list(lists.chunks(lambda: room))
    flat = [x for c in chunks for x in (c.items() if isinstance(c, Chunk) else c)]
    assert seen_of(lists, flat) == seen_of(one, list(one))
    assert sum(len(c.names) if isinstance(c, Chunk) else len(c) for c in chunks) == len(pairs) - 1  # w3 left out
    # the lists of plain tensors alone went whole (with room for all, the one list holds the others too)
    assert any(isinstance(c, Chunk) for c in chunks) == (room < len(pairs))
    errors = [str(t) for _, _, t in flat if isinstance(t, Exception)]
    assert len(errors) == 2 and "ints" in errors[0] and "given twice" in errors[1]


class _CountingReports(MemoryReceiver):
    """Counts the ``report`` calls it answers (a delta asks none: each start reply says the version)."""

    def __init__(self):
        super().__init__()
        self.reports = 0

    def report(self, digests: bool = False, names=None):
        self.reports += not digests  # (the drift sweep's digests come with start)
        return super().report(digests, names)


def test_an_engine_without_its_base_says_so_at_start_and_the_update_is_a_seed(caplog):
    """A delta asks the engines for no version before it starts: each worker's start reply says the
    one it holds. One without the delta's base (a restart leaves it none) turns the update into a
    seed of the same source within the same call, exact, and the deltas go on after it; a generator
    source, which cannot be read twice, is asked before, as before."""
    state = _many_tensors(12)
    receiver = _CountingReports()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    g = torch.Generator().manual_seed(3)

    def step():
        for t in state.values():
            t.view(-1)[torch.randint(0, t.numel(), (5,), generator=g)] += 1

    try:
        assert sync.update(list(state.items())).kind == "seed"
        for source in (lambda s: list(s.items()), lambda s: s.items()):
            step()
            receiver.reports = 0
            assert sync.update(source(state)).kind == "delta" and receiver.reports == 0
            assert receiver.mismatched(state.items()) == []
            receiver.version = None  # a restart: no version
            step()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="delta_sync.publish"):
                rep = sync.update(source(state))
            assert "does not hold v" in caplog.text  # the start reply said it
            assert rep.kind == "seed" and rep.version == receiver.version == sync.version
            assert receiver.mismatched(state.items()) == [] and not sync.needs_seed
        receiver.version = None
        step()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="delta_sync.publish"):
            rep = sync.update((n, t) for n, t in state.items())
        assert "does not hold v" not in caplog.text  # asked before the update: a seed from the start
        assert rep.kind == "seed" and receiver.mismatched(state.items()) == []
        step()
        assert sync.update(state.items()).kind == "delta" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


class _RestartsAtStart(MemoryReceiver):
    """Says it holds the base when asked, then restarts before the delta's ``start`` (a race)."""

    def __init__(self):
        super().__init__()
        self.restart_next_start = False

    def start(self, digest_names=None):
        if self.restart_next_start:
            self.restart_next_start, self.version = False, None
        return super().start(digest_names)


def test_an_engine_that_restarts_after_being_asked_fails_a_generators_delta_and_the_next_update_seeds():
    """A generator's delta asks the engines for their version first; one that restarts after that
    still says so when the delta starts: the update fails before its first bucket (nothing read
    twice), the trainer's snapshot stays at the synced version, and the next update is an exact seed."""
    state = _many_tensors(8)
    receiver = _RestartsAtStart()
    sync = WeightSync([receiver], mode="delta", timeout_s=60)
    try:
        sync.update((n, t) for n, t in state.items())
        synced = sync.version
        for t in state.values():
            t.view(-1)[::11] += 1
        receiver.restart_next_start = True
        with pytest.raises(Exception, match="does not hold v"):
            sync.update((n, t) for n, t in state.items())
        assert sync.needs_seed and sync.version == synced
        rep = sync.update((n, t) for n, t in state.items())
        assert rep.kind == "seed" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def test_verify_asks_the_engines_while_the_trainer_digests(monkeypatch):
    """verify's two halves overlap: every engine is asked for its digests (each in its own thread)
    before the trainer has digested its snapshots, so a verify takes the longer half, not their sum;
    a drifted engine is still named, and a trainer digest that fails still fails the call."""
    from delta_sync.sync import DriftDetected

    receivers = [MemoryReceiver(), MemoryReceiver()]
    sync = WeightSync(receivers, bucket_bytes=4 << 10, timeout_s=60)
    asked = threading.Barrier(3, timeout=10)  # both engines and the trainer's digest, at once
    try:
        sync.update(model_at(0).items())
        for rx in receivers:
            real = rx.report
            monkeypatch.setattr(rx, "report", lambda *a, _real=real, **k: asked.wait() is None or _real(*a, **k))
        digests = sync._trainer_digests
        monkeypatch.setattr(sync, "_trainer_digests", lambda names=None: asked.wait() is None or digests(names))
        assert len(sync.verify()) == len(model_at(0))  # (sequential halves: the barrier breaks)
        asked.reset()
        name = next(iter(model_at(0)))
        receivers[1].tensors[name].view(-1)[0] += 1
        with pytest.raises(DriftDetected, match=name.replace(".", r"\.")):
            sync.verify()
        monkeypatch.undo()
        sync.update(model_at(0).items())  # (the drift asked for a seed)

        def fails(names=None):
            raise RuntimeError("trainer digest failed")

        monkeypatch.setattr(sync, "_trainer_digests", fails)
        with pytest.raises(RuntimeError, match="trainer digest failed"):
            sync.verify()
    finally:
        sync.close()


def test_a_delta_of_a_models_live_parameters_reads_each_once_and_stays_exact():
    """The usual custom-trainer stream, ``model.named_parameters()``: parameters that require grad,
    the same objects every step. A delta reads them by address without detached views and counts
    each one's bytes from the seed (the diff checks its shape and dtype): patches carry no autograd
    graph (one tensor changed densely, the others sparsely), the element count is the model's, the
    receiver equals the model bit for bit; a parameter reshaped in place is refused by name, the
    receiver kept on its version, and the next delta is exact again."""
    g = torch.Generator().manual_seed(13)
    model = torch.nn.Module()
    for i in range(40):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(8, 4 + i, generator=g).bfloat16()))
    assert all(p.requires_grad for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="delta", timeout_s=60)
    packed = []
    real = Patch.full

    def full(name, t):  # every dense patch the packer gets, as the store made it
        packed.append(t.requires_grad)
        return real(name, t)
    try:
        sync.update(model.named_parameters())
        for step in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.view(-1)[torch.randint(0, p.numel(), (3,), generator=g)] += 1
                model.w0.add_(1)  # every element: a dense patch
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(Patch, "full", staticmethod(full))
                rep = sync.update(model.named_parameters())
            assert rep.kind == "delta" and rep.total_elements == total, (step, rep)
            assert all(torch.equal(rx.tensors[n].view(torch.int16), p.detach().view(torch.int16))
                       for n, p in model.named_parameters()), step
        assert packed and not any(packed)
        before = {n: t.clone() for n, t in rx.tensors.items()}
        with torch.no_grad():
            model.w5.add_(1)
        model.w5.data = model.w5.data.view(4 * 2, -1).t()  # same elements, another shape
        with pytest.raises(PatchValidationError, match="w5.*shape/dtype changed"):
            sync.update(model.named_parameters())
        assert rx.version == 3 and all(torch.equal(rx.tensors[n], t) for n, t in before.items())
        model.w5.data = model.w5.data.t().reshape(8, -1).contiguous()
        rep = sync.update(model.named_parameters())
        assert rep.kind == "delta" and rx.version == 4 and all(
            torch.equal(rx.tensors[n].view(torch.int16), p.detach().view(torch.int16))
            for n, p in model.named_parameters())
    finally:
        sync.close()


def test_a_device_trainers_deltas_against_host_snapshots_stay_exact(monkeypatch):
    """A trainer whose weights are on a device and whose snapshots are in host memory (the default
    ``snapshot_device``): each delta's batch crosses to the host as one copy and is diffed there; the
    receiver equals the weights bit for bit after deltas with tensors changed sparsely and one sent
    whole (a view of that copy, packed as any full patch), and a failed delta leaves it on its
    version. The weights stand for a device's (``is_cpu`` False to the store), the copy is a host
    copy."""
    from delta_sync import accelerator
    from delta_sync import snapshot as snapshot_module

    g = torch.Generator().manual_seed(17)
    weights = {f"w{i}": torch.randn(16, 8 + 4 * i, generator=g).bfloat16() for i in range(30)}
    rx = MemoryReceiver()
    sync = WeightSync([rx], mode="delta", timeout_s=60)
    copies = []
    real_to_host = accelerator.to_host
    try:
        sync.update(list(weights.items()))
        sync.update(list(weights.items()))  # (the store learns its snapshots' facts at a first diff)
        monkeypatch.setattr(snapshot_module, "_ON_HOST", lambda t: False)  # (on a device)
        monkeypatch.setattr(accelerator, "to_host", lambda t, **k: copies.append(t.numel()) or real_to_host(t, **k))
        for step in range(3):
            for t in weights.values():
                t.view(-1)[torch.randint(0, t.numel(), (5,), generator=g)] += 1
            weights[f"w{step}"] += 1  # every element: sent whole
            rep = sync.update(list(weights.items()))
            assert rep.kind == "delta" and rx.mismatched(list(weights.items())) == [], step
        assert len(copies) == 3 and copies[0] == sum(t.numel() for t in weights.values())
        before = {n: t.clone() for n, t in rx.tensors.items()}
        weights["w7"] += 1
        bad = {**weights, "w9": weights["w9"].view(8, -1)}  # reshaped: refused by name
        with pytest.raises(PatchValidationError, match="w9"):
            sync.update(list(bad.items()))
        assert all(torch.equal(rx.tensors[n], t) for n, t in before.items())
        assert sync.update(list(weights.items())).kind == "delta" and rx.mismatched(list(weights.items())) == []
    finally:
        sync.close()
