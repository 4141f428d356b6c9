"""Several engines behind one trainer: each control call (start, pause, finish, resume) goes to all
of them at once, still every engine paused before any applies and all applied before any serves.
Counted with a barrier the engines' calls must meet at, not timed: one after the other, the first
call would wait alone until the barrier breaks."""

import threading
import time

import pytest

from delta_sync.errors import EngineError
from delta_sync.memory_receiver import MemoryReceiver
from delta_sync.sync import WeightSync

from .test_streaming import _many_tensors

ENGINES = 3


class _Meeting(MemoryReceiver):
    """A receiver whose control calls wait for the other engines' same call, and log the order."""

    def __init__(self, barrier: threading.Barrier, log: list, refuse_finish: bool = False):
        super().__init__()
        self.barrier, self.log, self.refuse_finish = barrier, log, refuse_finish
        self.finishing = False

    def _meet(self, what: str) -> None:
        self.barrier.wait()
        self.log.append(what)

    def pause(self, mode: str = "wait") -> None:
        self._meet("pause")
        super().pause(mode)

    def start(self, digest_names=None):
        self._meet("start")
        self.finishing = True
        return super().start(digest_names)

    def finish(self, version: int) -> None:
        if self.finishing:  # the update's finish (not the one that ends a failed update's session)
            self.finishing = False
            self._meet("finish")
            if self.refuse_finish:
                raise EngineError(self.name, "refused at finish", kind="finish")
        super().finish(version)

    def resume(self) -> None:
        self._meet("resume")
        super().resume()


def _phases(log: list) -> list[str]:
    """The log's calls with each run of one call (one per engine) folded into one entry."""
    out = []
    for i in range(0, len(log), ENGINES):
        assert len(set(log[i:i + ENGINES])) == 1, log  # no call of another kind in between
        out.append(log[i])
    return out


def test_control_calls_reach_every_engine_at_once():
    barrier, log = threading.Barrier(ENGINES, timeout=20), []
    engines = [_Meeting(barrier, log) for _ in range(ENGINES)]
    state = _many_tensors(12)
    sync = WeightSync(engines, mode="delta", bucket_bytes=32 << 10, timeout_s=60)
    try:
        assert sync.update(state.items()).kind == "seed"
        assert _phases(log) == ["pause", "start", "finish", "resume"]
        log.clear()
        for t in state.values():
            t.view(-1)[::7] = (t.view(-1)[::7].float() + 0.5).to(t.dtype)
        assert sync.update(state.items()).kind == "delta"
        assert _phases(log) == ["start", "pause", "finish", "resume"]
        assert all(r.mismatched(state.items()) == [] for r in engines)
    finally:
        sync.close()


def test_an_engine_refusing_its_finish_while_the_others_apply_ends_in_a_seed():
    """The finishes run at once, so the others apply v while one refuses it: engines on different
    versions, which only a seed repairs (they stay paused); the next update is that seed."""
    barrier, log = threading.Barrier(ENGINES, timeout=20), []
    engines = [_Meeting(barrier, log) for _ in range(ENGINES)]
    state = _many_tensors(12)
    sync = WeightSync(engines, mode="delta", bucket_bytes=32 << 10, timeout_s=60)
    try:
        sync.update(state.items())
        for t in state.values():
            t.view(-1)[::5] = (t.view(-1)[::5].float() - 0.5).to(t.dtype)
        engines[1].refuse_finish = True
        log.clear()
        with pytest.raises(EngineError, match="refused at finish"):
            sync.update(state.items())
        assert _phases(log) == ["start", "pause", "finish"]  # not resumed
        assert sync.needs_seed
        engines[1].refuse_finish = False
        assert sync.update(state.items()).kind == "seed"
        assert all(r.mismatched(state.items()) == [] for r in engines)
    finally:
        sync.close()


@pytest.mark.parametrize("backend", ["local", "gloo"])
def test_an_engine_failing_to_join_the_channel_leaves_no_channel_behind(backend):
    """On the in-process ``local`` backend rank 0 does not wait for the others to join, so an
    engine whose ``init`` failed would leave the trainer a group that engine never joined: the
    next update would wait out the whole timeout on it. On gloo the trainer's rendezvous waited
    out the timeout instead (the failed engine never comes); it now ends with the engine's error,
    and the engine that did join is let go too. Either way the failed connect keeps no channel,
    the next update connects again and is exact on every engine."""

    class RefusesInitOnce(MemoryReceiver):
        refuse = True

        def init(self, info: dict) -> None:
            if self.refuse:
                self.refuse = False
                raise EngineError(self.name, "init refused here", kind="init")
            super().init(info)

    state = _many_tensors(6)
    engines = [MemoryReceiver(), RefusesInitOnce()]
    sync = WeightSync(engines, backend=backend, timeout_s=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="init refused here"):
            sync.update(state.items())
        assert time.monotonic() - t0 < 30, "the trainer waited out the rendezvous timeout"
        assert sync.channel is None
        rep = sync.update(state.items())
        assert rep.kind == "seed" and all(e.mismatched(state.items()) == [] for e in engines)
    finally:
        sync.close()


def test_a_delta_one_engine_fails_to_stage_is_applied_by_none():
    """Engines receive a delta on a thread of their own (their ``update`` returns at once); the
    trainer waits until every one staged it before it pauses any. One that fails to stage it (a
    refusal after its buckets arrived, as a failed check would be) fails the update with no engine
    paused or written: all stay on v1, the trainer needs no seed, and the next delta is exact on all."""

    class RefusesOnce(MemoryReceiver):
        refuse = False

        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def _receive(self, delta_only: bool = False) -> None:
            super()._receive(delta_only)  # every bucket taken: the channel stays in step
            if delta_only and self.refuse:
                self.refuse = False
                self._staged = None
                raise EngineError(self.name, "refused the delta it received", kind="update")

        def pause(self, mode: str = "wait") -> None:
            self.calls.append("pause")

        def finish(self, version: int) -> None:
            self.calls.append("finish")
            super().finish(version)

    engines = [RefusesOnce() for _ in range(ENGINES)]
    state = _many_tensors(12)
    sync = WeightSync(engines, mode="delta", bucket_bytes=32 << 10, timeout_s=60)
    try:
        sync.update(state.items())
        v1 = {n: t.clone() for n, t in state.items()}
        for e in engines:
            e.calls.clear()
        for t in state.values():
            t.view(-1)[::9] = (t.view(-1)[::9].float() + 0.5).to(t.dtype)
        engines[2].refuse = True
        with pytest.raises(EngineError, match="refused the delta it received"):
            sync.update(state.items())
        assert [e.calls.count("pause") for e in engines] == [0] * ENGINES  # nobody paused
        assert all(e.version == 0 and e.mismatched(v1.items()) == [] for e in engines)
        assert not sync.needs_seed and sync.version == 0
        rep = sync.update(state.items())
        assert rep.kind == "delta" and rep.version == 1
        assert all(e.mismatched(state.items()) == [] for e in engines)
    finally:
        sync.close()


def test_a_worker_gone_before_it_acknowledges_leaves_every_engine_on_v1():
    """Over gloo every worker says on the channel that it staged a delta before any engine pauses.
    One that never says so (its channel closed after the delta's last bucket came) fails that
    acknowledgement on the trainer within the channel's timeout: nobody paused or wrote, the
    trainer drops its channel, and the next delta (a new channel) is exact on both engines."""

    class GoneAfterStream(MemoryReceiver):
        gone = False

        def __init__(self):
            super().__init__()
            self.paused = 0

        def _receive_background(self) -> None:
            if not self.gone:
                return super()._receive_background()
            self.gone = False
            try:
                self._receive(delta_only=True)
            finally:
                self.channel.close()  # never acknowledges

        def pause(self, mode: str = "wait") -> None:
            self.paused += 1

    engines = [GoneAfterStream() for _ in range(2)]
    state = _many_tensors(12)
    sync = WeightSync(engines, mode="delta", bucket_bytes=32 << 10, timeout_s=5)
    try:
        sync.update(state.items())
        assert sync.channel.acknowledges  # (gloo)
        v0 = {n: t.clone() for n, t in state.items()}
        for e in engines:
            e.paused = 0  # (the seed's)
        for t in state.values():
            t.view(-1)[::9] = (t.view(-1)[::9].float() + 0.5).to(t.dtype)
        engines[1].gone = True
        t0 = time.monotonic()
        with pytest.raises(Exception, match="acknowledgement failed"):
            sync.update(state.items())
        assert time.monotonic() - t0 < 30
        assert [e.paused for e in engines] == [0, 0]
        assert all(e.version == 0 and e.mismatched(v0.items()) == [] for e in engines)
        assert not sync.needs_seed and sync.channel is None
        assert sync.update(state.items()).kind == "delta"
        assert all(e.mismatched(state.items()) == [] for e in engines)
    finally:
        sync.close()
