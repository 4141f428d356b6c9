"""Trainer rank 0's side of the engines: the channel to their workers and one version's publish.

:class:`Engines` holds the engine clients and the channel their workers joined, and issues every
lifecycle call to all engines at once. :class:`Publish` drives one version through them:

- bulk (seed, full): pause -> start -> send (applied as it arrives) -> finish -> resume;
- delta: start -> send (staged and validated while the engines keep serving: nothing is written
  before finish) -> pause -> finish (apply) -> resume. Its pause window covers only the apply.
  The engines' workers receive it on a thread of their own (``update`` with ``background``: the
  call returns at once, and the engine's steps go on while the delta arrives, is checked and
  planned); every worker says it staged the delta before any engine pauses: on the channel
  (gloo, :meth:`Channel.acknowledge`), else through each engine's ``staged`` call.

Whatever fails, :class:`Outcome` says where the engines were left: resumed on the committed
version, or paused until a seed (a bulk update cut off mid-write, engines on different versions).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .auth import channel_token
from .catalog import known, remember
from .channel import LOCAL, Channel, listen
from .digest import differs
from .engines import EngineClient, InProcessEngine
from .errors import DeltaSyncError
from .transfer import BucketSender, SendStats

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    """What trainer rank 0 tells every rank about one published update."""

    ok: bool
    error: str = ""
    needs_seed: bool = False
    report: dict = field(default_factory=dict)
    #: the drift sweep: tensors compared when the engines started this update, and what differed
    checked: int = 0
    drift: str | None = None
    #: a delta refused before its first bucket: an engine no longer holds its base (it said so when
    #: the update started); a seed repairs it
    lost_base: bool = False


class LostBase(DeltaSyncError):
    """An engine worker does not hold the version a delta builds on (restarted, a failed seed, its
    weights' storage replaced): found when the delta started, before any bucket left."""


def each(engines: list[EngineClient], call: Callable[[EngineClient], object],
         done: list[EngineClient] | None = None) -> None:
    """``call(e)`` for every engine, all at once where there are several (each call is a round trip
    to its server: one after the other, N engines would hold a pause window for N of them). Every
    call returns before this does; ``done`` gets the engines whose call succeeded, in order, and the
    first failure (in engine order) is raised."""
    if len(engines) == 1:
        call(engines[0])
        if done is not None:
            done.append(engines[0])
        return
    with ThreadPoolExecutor(max_workers=len(engines)) as pool:
        futs = [pool.submit(call, e) for e in engines]
    errors = [f.exception() for f in futs]
    if done is not None:
        done.extend(e for e, err in zip(engines, errors) if err is None)
    first = next((err for err in errors if err is not None), None)
    if first is not None:
        raise first


def _resume_fresh(e: EngineClient) -> None:
    """Drop the prefix cache of the old weights, then serve."""
    e.reset_prefix_cache()
    e.resume()


class Engines:
    """The engines one trainer keeps in sync (rank 0 only) and the channel to their workers."""

    def __init__(self, clients: list[EngineClient], *, key: bytes | None, host: str, port: int | None,
                 backend: str | None, timeout_s: float, pause_mode: str):
        self.clients = clients
        self.key, self.host, self.port, self.backend, self.timeout_s = key, host, port, backend, timeout_s
        self.pause_mode = pause_mode
        self.channel: Channel | None = None

    def connect(self) -> None:
        """Every engine worker joins one channel with rank 0 (once; again after :meth:`drop_channel`)."""
        if self.channel is not None:
            return
        reports = [e.report() for e in self.clients]
        workers = [len(r) for r in reports]
        # every worker keeps numbering by the catalogue of its last whole bulk update (a new channel
        # starts from it): where all say the same one and this process knows it, so does this channel
        numbered = {w.get("catalog") for r in reports for w in r}
        # a worker that says nothing of catalogues is of a version before dense tables: name every tensor
        dense = all("catalog" in w for r in reports for w in r)
        world = 1 + sum(workers)
        backend = self.backend or (LOCAL if all(isinstance(e, InProcessEngine) for e in self.clients) else None)
        # the store's port is bound before the engines learn it: nothing else can take it meanwhile
        listener = listen(self.host, self.port or 0) if backend != LOCAL else None
        port = listener.getsockname()[1] if listener is not None else (self.port or 0)
        nonce = secrets.token_hex(16)  # signed clients send this; their workers derive the token from it
        token = channel_token(self.key, nonce) if self.key else secrets.token_hex(16)
        offsets = [1 + sum(workers[:i]) for i in range(len(workers))]
        with ThreadPoolExecutor(max_workers=len(self.clients)) as pool:
            futs = [pool.submit(e.init, {"host": self.host, "port": port, "world_size": world, "token": token,
                                         "channel_nonce": nonce, "rank_offset": off, "backend": backend,
                                         "timeout_s": self.timeout_s})
                    for e, off in zip(self.clients, offsets)]

            def refused() -> None:  # an engine that failed its init never joins: stop waiting for it
                for f in futs:
                    if f.done() and f.exception() is not None:
                        raise f.exception()
            channel = Channel.connect(self.host, port, 0, world, token, backend=backend, timeout_s=self.timeout_s,
                                      listener=listener, waiting=refused)
            try:  # a group some engine never joined is no channel (the local backend does not wait for it)
                for f in futs:
                    f.result()
            except BaseException:
                channel.close()
                raise
        self.channel = channel
        channel.dense_tables = dense
        if len(numbered) == 1 and dense:
            channel.catalog = known(numbered.pop())
        log.info("delta-sync channel: %d engine worker(s) on %s", world - 1, self.channel.backend)

    def drop_channel(self) -> None:
        if self.channel is not None:
            remember(self.channel.numbering)
            self.channel.close()
        self.channel = None

    def lost_base(self, version: int, workers: list[dict] | None = None) -> bool:
        """Does any engine worker lack ``version`` (restart, failed seed, storage swapped under the
        views)? ``workers``: their replies to ``start``, read instead of a ``report`` call where they
        say. An unreachable engine counts as lost."""
        try:
            return any(r.get("needs_seed") or r.get("version") != version
                       for r in (workers if workers is not None else [r for e in self.clients for r in e.report()]))
        except Exception:  # noqa: BLE001 - an engine that cannot say counts as having lost its base
            return True

    def pause(self) -> None:
        each(self.clients, lambda e: e.pause(self.pause_mode))

    def serve(self) -> None:
        each(self.clients, _resume_fresh)

    def start(self, started: list[EngineClient], sweep: tuple[list[str], dict[str, str]] | None = None) -> dict:
        """``start`` on every engine (``started`` collects each one that did); a delta's drift sweep
        (names, the trainer's digests) rides along: the engines' digests of the window, compared
        here. Returns the sweep's result, and under ``workers`` every worker's reply (the version
        it holds; None where an engine's reply did not say)."""
        result: dict = {}
        names, want = sweep if sweep else (None, None)
        got: dict[int, list[dict] | None] = {}

        def start(e: EngineClient) -> None:
            got[id(e)] = e.start(names) if names else e.start()

        each(self.clients, start, started)
        replies = [r for e in self.clients for r in (got[id(e)] or [None])]
        result["workers"] = replies if all(isinstance(r, dict) and "version" in r for r in replies) else None
        if names:
            for e in self.clients:
                reports = got[id(e)] or []
                result["checked"] = len(names)
                result["engine_s"] = max([result.get("engine_s", 0.0)] + [r.get("digest_s", 0.0) for r in reports])
                result["drift"] = result.get("drift") or differs(e.name, reports, want)
        return result

    def end_sessions(self, engines: list[EngineClient], version: int) -> None:
        """End started sessions without applying the version (best effort: an engine that cannot be
        reached ends its own when the trainer's next call or its claim timeout comes)."""
        for e in engines:
            for step in (e.discard, lambda: e.finish(version)):
                try:
                    step()
                except Exception:  # noqa: BLE001 - best effort: a session also ends with the engine's lease
                    pass

    def close(self) -> None:
        """Leave the channel and release the engines (another trainer may claim them at once)."""
        for e in self.clients:
            release = getattr(e, "release", None)
            if callable(release):
                try:
                    release()
                except Exception as err:  # noqa: BLE001 - best effort: an unreachable engine's claim lapses by itself
                    log.warning("delta-sync: releasing %s failed (%s); its claim lapses after the engine's "
                                "DELTA_SYNC_CLAIM_S seconds of silence (default 60)", getattr(e, "name", e), err)
            close = getattr(e, "close", None)
            if callable(close):
                close()  # an HTTP client's idle connections
        self.drop_channel()


class EarlyStart:
    """A delta's ``start`` calls on a thread of rank 0, issued while the trainer ranks diff."""

    def __init__(self, engines: Engines, sweep: tuple[list[str], dict[str, str]] | None):
        self.engines, self.sweep = engines, sweep
        self.started: list[EngineClient] = []
        self._result: dict = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delta_sync-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self.engines.start(self.started, self.sweep)
        except BaseException as e:  # noqa: BLE001 - raised where the publish opens the engines
            self._error = e

    def result(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def wait(self) -> None:
        """Every ``start`` call has returned: ``started`` is final (their errors are the caller's)."""
        self._thread.join()

    def cancel(self, version: int) -> None:
        """The delta failed before publishing: end the sessions that were started."""
        self.wait()
        self.engines.end_sessions(self.started, version)


class Publish:
    """One version through every engine (module doc), driven by trainer rank 0.

    ``committed`` is the version the engines hold before it; ``needs_seed`` whether they need a
    seed already. A delta's ``early`` start (:class:`EarlyStart`) or its ``sweep`` of digests ride
    along with the start calls. ``base_asked``: a delta whose engines were asked for their version
    before it (else their replies to ``start`` say it, or a ``report`` call asks). ``sent``: called
    once every bucket has left, while the engines take the last ones (the trainer's own work)."""

    def __init__(self, engines: Engines, version: int, kind: str, timings: dict, *, bucket_bytes: int,
                 committed: int, needs_seed: bool, kept: str | None = None,
                 sweep: tuple[list[str], dict[str, str]] | None = None, early: EarlyStart | None = None,
                 base_asked: bool = True, sent: Callable[[], None] | None = None):
        self.engines, self.version, self.kind, self.timings = engines, version, kind, timings
        self.bulk = kind != "delta"
        self.bucket_bytes, self.committed, self.needs_seed, self.kept = bucket_bytes, committed, needs_seed, kept
        self.base_asked, self.sent = base_asked, sent
        self.sweep, self.early = sweep, early
        self.t_pause = time.perf_counter()
        self.started: list[EngineClient] = early.started if early is not None else []
        self.finished: list[EngineClient] = []
        self.opened = False  # the engines were paused / started for this update
        self.sweep_result: dict = {}

    @property
    def background(self) -> bool:
        """Do the engines' workers receive this delta on a thread of their own (their ``update``
        calls return at once and the engines keep serving while it arrives; module doc)? Where
        every client can and the channel allows it (:attr:`Channel.receives_in_background`)."""
        channel = self.engines.channel
        return (not self.bulk and channel is not None and channel.receives_in_background
                and all(getattr(e, "receives_in_background", False) for e in self.engines.clients))

    def run(self, send: Callable[[BucketSender], SendStats]) -> tuple[Outcome, BaseException | None]:
        """Publish the buckets ``send`` packs; the outcome, and the error that failed it (or None)."""
        try:
            self.engines.connect()
        except Exception as e:  # noqa: BLE001 - the update's outcome; no engine was touched
            return Outcome(False, f"{type(e).__name__}: {e}", needs_seed=self.needs_seed), e
        try:
            stats = self._send(send)
            self._apply()
        except Exception as err:  # noqa: BLE001 - the sessions started end first; then it is the outcome
            return self._failed(err), err
        report = {"tensors": stats.tensors, "changed_elements": stats.elements, "payload_bytes": stats.payload_bytes,
                  "buckets": stats.buckets, "pause_window_s": round(time.perf_counter() - self.t_pause, 6)}
        if "engine_s" in self.sweep_result:
            self.timings["sweep_engine_s"] = self.sweep_result["engine_s"]
        return Outcome(True, report=report, checked=self.sweep_result.get("checked", 0),
                       drift=self.sweep_result.get("drift")), None

    def _open(self) -> None:
        """Right before the first bucket leaves: a bulk update pauses here, so its pause window
        never covers what precedes its first bucket (a Megatron source's one-time plan, the export
        of the first tensors). A delta's engines may have been started already."""
        self.opened = True
        if self.bulk:
            self.t_pause = time.perf_counter()
            self.engines.pause()
        self.sweep_result.update(self.early.result() if self.early is not None
                                 else self.engines.start(self.started, self.sweep))
        workers = self.sweep_result.pop("workers", None)
        if not self.bulk and (workers is not None or not self.base_asked) \
                and self.engines.lost_base(self.committed, workers):
            raise LostBase(f"an engine does not hold v{self.committed}, which this delta builds on (restarted, "
                           "or its weights were replaced); it needs a seed", kept=self.kept)

    def _send(self, send: Callable[[BucketSender], SendStats]) -> SendStats:
        """Stream the buckets while each engine's ``update`` RPC receives them, concurrently. The
        engines are opened and their RPCs started when the first bucket is packed; an update that
        fails before that never touched them."""
        t1 = time.perf_counter()
        futs = []
        clients = self.engines.clients
        info = {"version": self.version, **({"background": True} if self.background else {})}
        with ThreadPoolExecutor(max_workers=len(clients)) as pool:
            def first_bucket() -> None:
                self._open()
                futs.extend(pool.submit(e.update, info) for e in clients)

            sender = BucketSender(self.engines.channel, self.version, self.kind, self.bucket_bytes, kept=self.kept,
                                  before_first=first_bucket)
            try:
                stats = send(sender)
            except Exception as err:
                self._abort(sender, err, futs)
                raise
            if self.sent is not None and futs:
                self.sent()
            errors = [f.exception() for f in futs]
        self.timings["send_s"] = time.perf_counter() - t1
        self.timings["pack_s"] = stats.pack_s
        if self.bulk:
            # the packer's fused pass: copy into buckets + the digests the engines check every entry
            # against (the copy packing needs anyway; the digest adds no pass of its own)
            self.timings["digest_pack_s"] = stats.digest_s
        self.timings["peak_buckets"] = stats.peak_buckets
        for err in errors:
            if err is not None:
                self.engines.drop_channel()  # the receivers may be out of step with the stream: reconnect
                raise err
        if futs and self._acknowledged():
            self._await_staged_on_channel()
        return stats

    def _acknowledged(self) -> bool:
        """Do the workers say on the channel that they staged this delta (a background receive over
        gloo, :meth:`Channel.acknowledge`)? Else they are waited for by call (``await_staged``, finish)."""
        return self.background and self.engines.channel is not None and self.engines.channel.acknowledges

    def _await_staged_on_channel(self) -> None:
        """Every worker staged the delta (it says so from its receive thread), or one failed: then
        each engine's ``await_staged`` raises its worker's own error. No engine is paused yet, and
        the commit that follows waits for no receive."""
        t0 = time.perf_counter()
        try:
            ok = self.engines.channel.acknowledge(False)
        except Exception:
            self.engines.drop_channel()  # a worker that cannot say it is out of step: reconnect
            raise
        self.timings["staged_s"] = time.perf_counter() - t0
        if not ok:
            each(self.engines.clients, lambda e: e.await_staged())
            raise DeltaSyncError(f"an engine worker did not stage v{self.version} and its engine gave no "
                                 "reason", kept=self.kept)

    def _abort(self, sender: BucketSender, err: BaseException, futs: list) -> None:
        """The sender failed: tell the receivers (if any bucket reached them) and wait for their RPCs."""
        if not futs:
            sender.shutdown()  # nothing reached the engines
            return
        try:
            sender.abort(f"sender failed: {type(err).__name__}: {err}")
        except Exception:  # noqa: BLE001 - an abort that fails drops the channel instead
            sender.shutdown()
            self.engines.drop_channel()  # receivers time out and discard; the next update reconnects
        for f in futs:
            f.exception()

    def _apply(self) -> None:
        """Every engine paused before any applies, all applied before any serves the version."""
        try:
            self._commit()
        except Exception:
            if self.background:  # a receive that failed there may have left its channel out of step: reconnect
                self.engines.drop_channel()
            raise

    def _commit(self) -> None:
        clients = self.engines.clients
        one = clients[0] if not self.bulk and len(clients) == 1 else None
        if one is not None and callable(getattr(one, "commit", None)):
            # one engine: pause -> finish -> resume in one call (HttpEngine.commit)
            self.t_pause = t2 = time.perf_counter()
            one.commit(self.version, self.engines.pause_mode)
            self.finished.append(one)
            self.timings["finish_s"] = time.perf_counter() - t2
            return
        if self.background and not self._acknowledged():  # staged everywhere before any engine pauses
            t2 = time.perf_counter()
            each(clients, lambda e: e.await_staged())
            self.timings["staged_s"] = time.perf_counter() - t2
        if not self.bulk:
            self.t_pause = time.perf_counter()
            self.engines.pause()
        t2 = time.perf_counter()
        each(clients, lambda e: e.finish(self.version), self.finished)
        self.timings["finish_s"] = time.perf_counter() - t2
        self.engines.serve()

    def _failed(self, err: BaseException) -> Outcome:
        """End what was started; resume the engines where they are consistent on the committed version."""
        if self.early is not None:  # a failure found before the first bucket: its starts may still run
            self.early.wait()
        if self.engines.channel is not None:  # receivers may hold another catalogue now: the next seed names all
            self.engines.channel.catalog = None
        clients = self.engines.clients
        lost = isinstance(err, LostBase)
        # Engines left on different versions, or a bulk update they started writing, can only be
        # repaired by a seed; they report it themselves.
        needs_seed = (lost or self.kind == "seed" or 0 < len(self.finished) < len(clients)
                      or self.engines.lost_base(self.committed))
        self.engines.end_sessions([e for e in self.started if e not in self.finished], self.committed)
        if lost:  # nothing left the trainer; a seed repairs it (a restarted engine left the channel: rejoin)
            self.engines.drop_channel()
            log.warning("delta-sync v%d: %s", self.version, err)
            return Outcome(False, f"{type(err).__name__}: {err}", needs_seed=True, lost_base=True)
        if not needs_seed:  # engines are on v-1 and consistent: serve again
            try:
                self.engines.serve()
            except Exception:  # noqa: BLE001 - best effort: an engine's pause lease resumes it
                pass
            what = f"engines resumed on v{self.committed}"
        elif self.opened or self.started:
            what = "engines stay paused until a seed"
        else:  # a seed refused before its first bucket: nothing reached the engines
            what = "engines untouched; the next update is a seed"
        log.error("delta-sync v%d failed (%s); %s", self.version, err, what)
        return Outcome(False, f"{type(err).__name__}: {err}", needs_seed=needs_seed)
