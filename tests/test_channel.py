"""Trainer ranks -> gather -> sender -> channel -> receivers, over real gloo processes."""

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

from delta_sync.channel import Channel, free_port
from delta_sync.diff import int_view
from delta_sync.digest import digest_tensor
from delta_sync.errors import ChannelError
from delta_sync.gather import Ordered, PatchGather
from delta_sync.patch import Patch, apply_patch
from delta_sync.snapshot import SnapshotStore
from delta_sync.transfer import BucketSender, UpdateAborted, receive_update, send_update
from launchers.ranks import run_ranks

VERSIONS = 22
SPECS = [("model.embed", (300, 16), torch.bfloat16), ("layers.0.q", (64, 48), torch.float16),
         ("layers.0.norm", (48,), torch.float32), ("layers.1.w", (97, 33), torch.bfloat16),
         ("layers.1.b", (5,), torch.bfloat16), ("lm_head", (200, 16), torch.float32)]


def model_at(version: int) -> dict[str, torch.Tensor]:
    """Deterministic evolution: every pattern of change appears, including none and all."""
    g = torch.Generator().manual_seed(1234)
    state = {n: torch.randn(s, generator=g).to(d) for n, s, d in SPECS}
    for v in range(1, version + 1):
        g = torch.Generator().manual_seed(v)
        for i, (n, _, _) in enumerate(SPECS):
            t = state[n].view(-1)
            mode = (v + i) % 5
            if mode == 0:
                continue  # untouched
            if mode == 1:
                t.copy_(torch.randn(t.numel(), generator=g).to(t.dtype))  # fully rewritten
                continue
            frac = [0.0005, 0.01, 0.2][mode - 2]
            k = max(1, int(t.numel() * frac))
            pos = torch.randint(0, t.numel(), (k,), generator=g)
            t[pos] = (t[pos].float() + torch.randn(k, generator=g)).to(t.dtype)
    return state


def _node(rank, world, port, chan_port):
    trainers = 2
    if rank < trainers:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=trainers,
                                timeout=datetime.timedelta(seconds=60))
    chan = None
    if rank == 0 or rank >= trainers:
        crank = 0 if rank == 0 else rank - trainers + 1
        chan = Channel.connect("127.0.0.1", chan_port, crank, world - trainers + 1, "s3cret", timeout_s=60)
    if rank < trainers:
        store = SnapshotStore(rank=rank, world_size=trainers)
        gatherer = PatchGather()
        kinds = []
        for v in range(VERSIONS):
            state = model_at(v)

            def produce():
                out = []
                for seq, (n, _, _) in enumerate(SPECS):
                    t = state[n]
                    if store.owns(n, t.numel() * t.element_size()):
                        out.append(Ordered(seq, store.prepare(n, t)))
                return out
            patches = gatherer.gather(produce)
            kind = "seed" if store.version is None else "delta"
            if rank == 0:
                if v == 7:  # an aborted update: receivers must discard it, trainers roll back
                    BucketSender(chan, v, kind).abort("validation failed on the trainer")
                    store.rollback()
                    dist.barrier()
                    continue
                stats = send_update(chan, v, kind, patches, bucket_bytes=4096)
                kinds.append((kind, stats.elements))
            dist.barrier()
            store.commit(v)
        return kinds
    # receivers
    recon: dict[str, torch.Tensor] = {}
    seen = []
    for v in range(VERSIONS):
        try:
            upd = receive_update(chan)
        except UpdateAborted:
            seen.append("aborted")
            continue
        assert upd.version == v
        for p in upd.patches:
            if p.name not in recon:
                assert p.dense, f"first sight of {p.name} must be a seed"
                recon[p.name] = torch.empty(p.shape, dtype=p.dtype)
            apply_patch(recon[p.name], p)
        seen.append(upd.kind)
    final = model_at(VERSIONS - 1)
    for n, t in final.items():
        assert torch.equal(int_view(recon[n]), int_view(t)), n
        assert digest_tensor(recon[n]) == digest_tensor(t)
    return seen


def test_twenty_versions_reconstruct_bit_for_bit():
    results = run_ranks(_node, 4, free_port(), init_world=False, timeout=180)
    kinds = results[0]
    assert kinds[0][0] == "seed" and all(k == "delta" for k, _ in kinds[1:])
    assert results[2] == results[3] and results[2][7] == "aborted" and results[2].count("delta") == VERSIONS - 2


def _token_node(rank, world, port, chan_port):
    import time
    if rank == 2:  # intruder: wrong token, claims rank 1
        time.sleep(1)  # let the sender host the store
        with pytest.raises(ChannelError, match="rendezvous"):
            Channel.connect("127.0.0.1", chan_port, 1, 2, "wrong", timeout_s=3)
        return "refused"
    chan = Channel.connect("127.0.0.1", chan_port, rank, 2, "right", timeout_s=30)
    t = torch.arange(4, dtype=torch.int64) if rank == 0 else torch.zeros(4, dtype=torch.int64)
    chan.broadcast(t)
    time.sleep(6)  # the sender keeps hosting the store until the intruder gave up
    return t.tolist()


def test_token_keeps_strangers_out():
    results = run_ranks(_token_node, 3, free_port(), init_world=False, timeout=90)
    assert results == [[0, 1, 2, 3], [0, 1, 2, 3], "refused"]


def _dup_node(rank, world, port, chan_port):
    import time
    if rank == 0:
        chan = Channel.connect("127.0.0.1", chan_port, 0, 2, "tok", timeout_s=20)  # noqa: F841 (hosts the store)
        time.sleep(5)  # keep hosting the store while the duplicate tries
        return "sender"
    if rank == 2:
        time.sleep(2)  # arrives second with the same rank
        with pytest.raises(ChannelError, match="already taken"):
            Channel.connect("127.0.0.1", chan_port, 1, 2, "tok", timeout_s=5)
        return "refused"
    Channel.connect("127.0.0.1", chan_port, 1, 2, "tok", timeout_s=20)
    return "joined"


def test_duplicate_rank_is_refused():
    assert run_ranks(_dup_node, 3, free_port(), init_world=False, timeout=90) == ["sender", "joined", "refused"]


# ---- backend "local": every rank in this process (in-process engines) -------------------------------
def _local_ranks(world: int, token: str, fn, timeout_s: float = 20):
    """Runs ``fn(channel)`` on ranks 1..world-1 in threads and returns (rank 0's channel, futures)."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=world - 1)
    futs = [pool.submit(lambda r=r: fn(Channel.connect("127.0.0.1", 0, r, world, token, backend="local",
                                                        timeout_s=timeout_s))) for r in range(1, world)]
    return Channel.connect("127.0.0.1", 0, 0, world, token, backend="local", timeout_s=timeout_s), futs


def test_in_process_channel_carries_updates_bit_for_bit():
    """The channel an in-process engine gets (NCCL/HCCL refuse two ranks on one device): real
    buckets, three versions, two receivers in threads."""
    def receiver(chan):
        recon = {}
        for _ in range(3):
            upd = receive_update(chan)
            for p in upd.patches:
                if p.name not in recon:
                    recon[p.name] = torch.empty(p.shape, dtype=p.dtype)
                apply_patch(recon[p.name], p)
        chan.close()
        return recon

    sender, futs = _local_ranks(3, "tok-local", receiver)
    assert sender.backend == "local"
    store = SnapshotStore(rank=0, world_size=1)
    for v in range(3):
        state = model_at(v)
        kind = "seed" if store.version is None else "delta"
        send_update(sender, v, kind, [store.prepare(n, state[n]) for n, _, _ in SPECS], bucket_bytes=4096)
        store.commit(v)
    final = model_at(2)
    for f in futs:
        recon = f.result(timeout=60)
        assert sorted(recon) == sorted(final)
        for n, t in final.items():
            assert torch.equal(int_view(recon[n]), int_view(t)), n
    sender.close()


def _in_arenas(chan: Channel, t: torch.Tensor) -> bool:
    return any(a.buf is not None and a.buf.data_ptr() <= t.data_ptr() < a.buf.data_ptr() + a.buf.numel()
               for a in chan.arenas())


class _Rebuilt:
    """A receiver's model rebuilt from a seed's ranges as they arrive, then a delta's patches."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def _at(self, p: Patch) -> torch.Tensor:
        if p.name not in self.tensors:
            self.tensors[p.name] = torch.empty(p.shape, dtype=p.dtype)
        return self.tensors[p.name]

    def write(self, entries) -> None:  # a bulk bucket's ranges (``bulk_sink``)
        for e, p in entries:
            self._at(p).view(-1)[int(e["start"]):int(e["start"]) + p.count].copy_(p.values)

    def apply(self, patches) -> None:
        for p in patches:
            apply_patch(self._at(p), p)


def _seed_deltas_seed(token: str, receiver, versions: int) -> dict:
    """Versions ``0 .. versions-1`` of :func:`model_at` in 8 KiB buckets (a seed, deltas, a seed) to
    ``receiver(chan)`` on a thread, which returns ``(its rebuilt tensors, what it saw)``: what it saw,
    once its tensors equal the last version bit for bit."""
    sender, futs = _local_ranks(2, token, receiver)
    store = SnapshotStore(rank=0, world_size=1)
    for v in range(versions):
        state = model_at(v)
        if v == versions - 1:
            store.reset()
        kind = "seed" if store.version is None else "delta"
        send_update(sender, v, kind, [store.prepare(n, state[n]) for n, _, _ in SPECS], bucket_bytes=8192)
        store.commit(v)
    recon, seen = futs[0].result(timeout=60)
    sender.close()
    for n, t in model_at(versions - 1).items():
        assert torch.equal(int_view(recon[n]), int_view(t)), n
    return seen


def test_a_host_receivers_deltas_land_in_the_memory_its_channel_kept():
    """A host channel keeps two buckets' arenas between updates (fresh pages faulted on first touch
    made the first delta after a seed 3-5x slower than the next): a delta's buckets land there
    while nothing holds them, the rest in buffers of their own. A staged delta someone still holds
    when the next update (delta or seed) arrives keeps its values: that update gets new memory."""
    def receiver(chan):
        model, seen = _Rebuilt(), {}
        assert len(chan.arenas()) == 0  # (made by the first update)
        receive_update(chan, bulk_sink=model.write)  # v0: a seed, streamed through the arenas
        held = receive_update(chan)  # v1, held past its update
        before = [p.values.clone() for p in held.patches]
        seen["v1_in_arenas"] = [_in_arenas(chan, p.values) for p in held.patches]
        seen["v1_buckets"] = held.buckets
        model.apply(held.patches)
        upd = receive_update(chan)  # v2 arrives while v1 is held
        seen["v1_kept_by_v2"] = all(torch.equal(int_view(p.values), int_view(b)) for p, b in zip(held.patches, before))
        seen["v2_in_arenas"] = any(_in_arenas(chan, p.values) for p in upd.patches)
        model.apply(upd.patches)
        held = upd = None
        held = receive_update(chan)  # v3: nothing held, into the arenas again
        seen["v3_in_arenas"] = any(_in_arenas(chan, p.values) for p in held.patches)
        before = [p.values.clone() for p in held.patches]
        model.apply(held.patches)
        receive_update(chan, bulk_sink=model.write)  # v4: a seed, while v3 is held
        seen["v3_kept_by_seed"] = all(torch.equal(int_view(p.values), int_view(b))
                                      for p, b in zip(held.patches, before))
        seen["arenas"] = len(chan.arenas())
        chan.close()
        return model.tensors, seen

    seen = _seed_deltas_seed("tok-arenas", receiver, 5)
    assert seen["v1_buckets"] > 2 and any(seen["v1_in_arenas"]) and not all(seen["v1_in_arenas"])
    assert seen["v1_kept_by_v2"] and seen["v2_in_arenas"]
    assert seen["v3_in_arenas"] and seen["v3_kept_by_seed"] and seen["arenas"] == 2


def test_without_torchs_use_count_deltas_get_buffers_of_their_own_and_seeds_keep_the_arenas(monkeypatch):
    """Whether a view of an arena is still held comes from a private torch call; where it is
    missing no delta is received into an arena (nobody can tell it is free), and bulk updates keep
    reusing the same two arenas as they did before deltas could use them."""
    monkeypatch.delattr(torch._C, "_storage_Use_Count")

    def receiver(chan):
        model, seen = _Rebuilt(), {"delta_in_arenas": False}
        receive_update(chan, bulk_sink=model.write)
        bufs = [a.buf for a in chan.arenas()]
        for _ in range(2):
            upd = receive_update(chan)
            seen["delta_in_arenas"] |= any(_in_arenas(chan, p.values) for p in upd.patches)
            model.apply(upd.patches)
        receive_update(chan, bulk_sink=model.write)
        seen["same_arenas"] = all(a.buf is b for a, b in zip(chan.arenas(), bufs))
        chan.close()
        return model.tensors, seen

    seen = _seed_deltas_seed("tok-no-count", receiver, 4)
    assert not seen["delta_in_arenas"] and seen["same_arenas"]


def _forge(words: torch.Tensor, at: int, d: int = 4096) -> None:
    """Add ``+d, -2d, +d`` to three neighbouring 16-bit words: every lane of a digest whose weight
    is affine in the position (and both of its sums) stays put."""
    words[at:at + 3] += torch.tensor([d, -2 * d, d], dtype=torch.int16)


@pytest.mark.parametrize("kind", ["seed", "seed-by-id", "delta"])
def test_payload_bytes_forged_in_flight_are_refused(kind):
    """An on-path party that rewrites value bytes of a bucket (not its MACed header) is caught: a
    seed's dense ranges by their keyed digests (a later seed's small tensors, named by id in a
    dense table, too), a delta's by its keyed checksum. Nothing of the forged version is applied,
    and the next, untouched version still arrives."""
    from delta_sync.errors import ChecksumMismatch

    def receiver(chan):
        seen = []
        for _ in range(3):
            try:
                seen.append(("ok", receive_update(chan)))
            except ChecksumMismatch as e:
                seen.append(("refused", str(e)))
        chan.close()
        return seen

    sender, futs = _local_ranks(2, f"tok-forge-{kind}", receiver)
    g = torch.Generator().manual_seed(7)
    base = (torch.rand(32 if kind == "seed-by-id" else 64, 32, generator=g) * 0.5 + 0.25).bfloat16()
    changed = base.clone()
    changed.view(-1)[::5] += 1
    real = sender.broadcast_all
    forged = []

    def tamper(tensors, src=0):
        out = []
        for t in tensors:
            if not forged and t.dtype == torch.bfloat16 and t.numel() >= 8:
                t = t.clone()
                _forge(t.view(torch.int16), 2)
                forged.append(t.numel())
            out.append(t)
        real(out, src)
    from delta_sync.patch import Patch

    def dense(t):
        return Patch("w", tuple(t.shape), t.dtype, None, t.reshape(-1))
    send_update(sender, 0, "seed", [dense(base)])
    sender.broadcast_all = tamper
    sent = []
    send_bucket = sender.send_bucket
    sender.send_bucket = lambda b: sent.append(b.header) or send_bucket(b)
    if kind != "delta":
        send_update(sender, 1, "seed", [dense(changed)])
        assert ("dense" in sent[0]) == (kind == "seed-by-id")
    else:
        idx = (changed != base).view(-1).nonzero().squeeze(1).to(torch.int32)
        send_update(sender, 1, "delta", [Patch("w", tuple(base.shape), base.dtype, idx, changed.view(-1)[idx.long()])])
    assert forged, "nothing was forged: the test would prove nothing"
    sender.broadcast_all = real
    sender.catalog = None  # as a trainer forgets it after a failed update: the next seed goes by name
    send_update(sender, 2, "seed", [dense(changed)])
    seen = futs[0].result(timeout=60)
    assert seen[0][0] == "ok" and seen[0][1].kind == "seed" and seen[2][0] == "ok"
    assert torch.equal(seen[2][1].patches[0].values.view(changed.shape), changed)
    assert seen[1][0] == "refused", f"a forged {kind} was accepted"
    assert ("checksum" if kind == "delta" else "digest") in seen[1][1]
    sender.close()


def test_in_process_broadcasts_are_in_flight_together():
    """The source issues a bucket's broadcasts without waiting for each copy (as gloo and NCCL do):
    all of them are out before any receiver runs; each one waits until every rank copied it."""
    import threading

    from delta_sync.channel import LocalGroup

    src = LocalGroup.join("in-flight-test", 0, 3, 10)
    tensors = [torch.arange(n, dtype=torch.float32) for n in (3, 70_000, 5)]
    works = [src.broadcast([t], type("Opts", (), {"rootRank": 0})) for t in tensors]  # returns at once
    assert not any(src.group.copied.get(w.gen) for w in works)
    got = {}

    def receive(rank):
        member = LocalGroup.join("in-flight-test", rank, 3, 10)
        got[rank] = [torch.zeros_like(t) for t in tensors]
        for out in got[rank]:
            member.broadcast([out], type("Opts", (), {"rootRank": 0})).wait()
        member.shutdown()
    threads = [threading.Thread(target=receive, args=(r,)) for r in (1, 2)]
    for th in threads:
        th.start()
    for w in works:
        w.wait()
    for th in threads:
        th.join(30)
    assert all(torch.equal(a, b) for r in (1, 2) for a, b in zip(got[r], tensors))
    assert not src.group.payloads  # every buffer given back
    src.shutdown()


def test_in_process_channel_fails_fast_when_a_rank_leaves_or_is_taken():
    import time

    def leaves(chan):
        chan.close()  # as a receiver that failed: the sender's broadcast must not wait for it
        return "left"

    sender, futs = _local_ranks(2, "tok-leave", leaves, timeout_s=60)
    assert futs[0].result(timeout=30) == "left"
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=r"rank\(s\) \[1\] closed their end"):
        sender.broadcast(torch.arange(4))
    assert time.monotonic() - t0 < 10
    sender.close()
    one = Channel.connect("127.0.0.1", 0, 1, 2, "tok-dup", backend="local")
    with pytest.raises(ChannelError, match="already taken"):
        Channel.connect("127.0.0.1", 0, 1, 2, "tok-dup", backend="local")
    one.close()


def test_in_process_channel_takes_tensors_on_any_device():
    """Each rank copies into its own tensor, so an engine on the trainer's GPU is fine; gloo and
    nccl groups still refuse the wrong device (fake "cuda" tensors, no GPU here)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from delta_sync import collectives
    from delta_sync.channel import LocalGroup

    member = LocalGroup.join("any-device-test", 0, 1, 5)
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = torch.empty(4, device="cuda")
        collectives.check("broadcast", member, on_gpu, torch.empty(4))
        with pytest.raises(collectives.DeviceMismatch):
            collectives.check("broadcast", collectives._Named("gloo"), on_gpu)
        with pytest.raises(collectives.DeviceMismatch, match="float64"):
            collectives.check("broadcast", member, torch.empty(2, dtype=torch.float64))
    member.shutdown()


def test_the_store_port_listens_before_any_engine_is_told_it(monkeypatch):
    """WeightSync binds the channel store's port before the engines' ``init`` learns it: there is no
    window in which a port picked, released and announced could be taken by another process (the
    engine's first connect is refused then). The trainer's own join is held back here, so the
    engine always probes inside that window. A channel that does not come up closes its socket."""
    import socket
    import time

    from delta_sync import WeightSync
    from delta_sync.channel import listen
    from delta_sync.memory_receiver import MemoryReceiver

    class Probing(MemoryReceiver):
        def init(self, info):
            with socket.create_connection((info["host"], info["port"]), timeout=5):
                pass  # refused unless the trainer's store socket listens already
            super().init(info)

    connect = Channel.connect.__func__

    def late_trainer(cls, host, port, rank, *args, **kwargs):
        if rank == 0:
            time.sleep(0.5)  # the engine's init probes meanwhile
        return connect(cls, host, port, rank, *args, **kwargs)
    monkeypatch.setattr(Channel, "connect", classmethod(late_trainer))
    rx = Probing()
    sync = WeightSync([rx], timeout_s=10)  # old behaviour: refused, then the rendezvous waits this out
    state = {"w": torch.randn(16, 16).to(torch.bfloat16)}
    assert sync.update(state.items()).kind == "seed" and torch.equal(rx.tensors["w"], state["w"])
    sync.close()
    monkeypatch.undo()
    sock = listen("127.0.0.1")
    with pytest.raises(ChannelError, match="empty channel token"):
        Channel.connect("127.0.0.1", sock.getsockname()[1], 0, 2, "", listener=sock)
    assert sock.fileno() == -1


def test_a_rank_that_never_comes_is_named_after_one_timeout():
    """Rank 0 waits for the other ranks' claims in the store for ``timeout_s`` once (not once for
    the claims and again for the process group's rendezvous), then names who never came."""
    import time

    t0 = time.monotonic()
    with pytest.raises(ChannelError, match=r"rendezvous of 3 ranks timed out after 2 s: rank\(s\) \[1, 2\] never came"):
        Channel.connect("127.0.0.1", free_port(), 0, 3, "tok-alone", timeout_s=2)
    assert time.monotonic() - t0 < 3.5


class _HangingDeviceGroupFake:
    """Stands in for an NCCL/HCCL process group with a dead peer (no such backend runs here): a
    broadcast never completes until the group is aborted, then it raises, as NCCL's does. It
    reports gloo's name only so the collectives' device check takes host tensors."""

    def __init__(self):
        self.aborted = threading.Event()

    def name(self) -> str:
        return "gloo"

    def broadcast(self, tensors, opts):
        group = self

        class Work:
            def wait(self):
                if not group.aborted.wait(120):
                    raise AssertionError("never aborted")
                raise RuntimeError("NCCL communicator was aborted")
        return Work()

    def abort(self):
        self.aborted.set()


def _blocked_broadcast(chan):
    """Run ``chan.broadcast`` on a thread; returns (thread, box with its error and duration)."""
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            chan.broadcast(torch.zeros(8))
        except Exception as e:
            box["error"] = e
        box["s"] = time.monotonic() - t0
    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


def test_a_sender_killed_mid_broadcast_unblocks_a_device_receiver():
    """An engine worker blocked in an NCCL/HCCL broadcast whose sender was SIGKILLed: the liveness
    watch sees the sender's store stop answering, aborts the group, and the broadcast raises a
    ChannelError naming the sender within seconds, not at the group's 300 s timeout."""
    import subprocess
    import sys

    from torch.distributed import PrefixStore, TCPStore

    from delta_sync.channel import PeerWatch

    port = free_port()
    host = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from torch.distributed import TCPStore; "
        f"s = TCPStore('127.0.0.1', {port}, None, True, wait_for_workers=False, use_libuv=True); "
        "print('up', flush=True); time.sleep(600)")], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout.readline().strip() == "up"
        ns = PrefixStore("ns", TCPStore("127.0.0.1", port, None, False, use_libuv=True,
                                        timeout=datetime.timedelta(seconds=30)))
        pg = _HangingDeviceGroupFake()
        watch = PeerWatch(ns, 1, 2, pg, bound_s=30, beat_s=0.2)
        chan = Channel(pg, 1, 2, torch.device("cpu"), "nccl", key=b"k", watch=watch)
        th, box = _blocked_broadcast(chan)
        time.sleep(1.0)
        assert th.is_alive() and watch.dead is None  # beats land while the sender lives
        host.kill()
        th.join(20)
        assert not th.is_alive() and pg.aborted.is_set()
        assert isinstance(box["error"], ChannelError) and "sender died" in str(box["error"]), box
        assert box["s"] < 15
        chan.close()
    finally:
        host.kill()
        host.wait()


def test_a_silent_device_receiver_unblocks_the_sender():
    """The sender blocked in a broadcast to an engine worker that stopped (its beats end): after
    the bound the watch aborts the group and the broadcast raises naming that rank."""
    from torch.distributed import PrefixStore, TCPStore

    from delta_sync.channel import PeerWatch

    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, wait_for_workers=False, use_libuv=True)
    client = TCPStore("127.0.0.1", port, None, False, use_libuv=True)
    receiver = PeerWatch(PrefixStore("ns", client), 1, 2, _HangingDeviceGroupFake(), bound_s=1.0, beat_s=0.1)
    pg = _HangingDeviceGroupFake()
    watch = PeerWatch(PrefixStore("ns", server), 0, 2, pg, bound_s=1.0, beat_s=0.1)
    chan = Channel(pg, 0, 2, torch.device("cpu"), "nccl", key=b"k", watch=watch)
    th, box = _blocked_broadcast(chan)
    time.sleep(2.0)
    assert th.is_alive() and watch.dead is None  # a beating receiver is alive past the bound
    receiver.stop()  # the worker dies: no more beats
    th.join(10)
    assert not th.is_alive() and pg.aborted.is_set()
    assert "rank 1 sent no liveness beat" in str(box["error"])
    chan.close()
