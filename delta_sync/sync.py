"""The sender: one object that keeps engines equal to a trainer, one call per training step.

::

    sync = WeightSync(["http://engine-0:8000"], mode="delta")
    for step in range(steps):
        train_step(model)
        report = sync.update(model.named_parameters())   # every trainer rank calls this

Every trainer rank calls :meth:`WeightSync.update` with the same names in the same order. Each
tensor is diffed by its owner rank only (snapshot memory ~ model/world); patches are gathered to
trainer rank 0, which drives every engine through pause -> start -> send -> finish -> resume.
The snapshots are committed only after every engine acknowledged the version; any failure leaves
them at v-1. A failure that leaves an engine without a usable base (a seed or full update cut off
mid-write, an engine restarted) makes the next update a full seed.
"""

from __future__ import annotations

import collections.abc
import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from . import collectives
from .auth import load_secret
from .channel import Channel
from .collectives import TrainerGroups
from .digest import Digest, add_texts, differs, tensor_texts
from .engines import EngineClient, as_engine
from .errors import DeltaSyncError, GatherError, UpdateInFlight, with_kept
from .gather import Ordered, PatchGather
from .gc_hold import gc_held
from .options import SyncOptions
from .prepare import BulkRead, DeltaDiff, TensorStream
from .publish import EarlyStart, Engines, Outcome, Publish
from .snapshot import SnapshotStore
from .transfer import BucketSender, SendStats

log = logging.getLogger(__name__)

@dataclass
class UpdateReport:
    version: int
    kind: str  # "seed" | "delta" | "full"
    tensors: int = 0
    changed_elements: int = 0
    total_elements: int = 0
    payload_bytes: int = 0
    buckets: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    pause_window_s: float = 0.0
    verified: bool = False
    #: tensors whose digests were compared after this update (the drift sweep's window, or all)
    checked: int = 0
    #: drift found after this update (named tensors); the next update is a re-seed that repairs it
    drift: str | None = None

    @property
    def changed_fraction(self) -> float:
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["changed_fraction"] = self.changed_fraction
        return d


@runtime_checkable
class ShardedSource(Protocol):
    """A stream of ``(checkpoint name, full tensor)`` that can also produce its own deltas.

    Iterating it is the reference path (seeds, full updates). Once :meth:`ready`, deltas come from
    :meth:`local_patches` instead: each rank diffs the shards it holds against its own shard
    snapshot and returns the changed entries already in checkpoint coordinates (disjoint across
    ranks; the gather merges them per tensor). ``seq`` of an entry is the tensor's position in the
    reference stream. Every method is called on every trainer rank at the same point (they may be
    collective).

    Optional, ``expects_to_serve() -> bool``, asked during a seed once the stream yielded its first
    tensor (a source plans before that): the same answer on every rank, True where its shard
    snapshots should back the next deltas. Several trainer ranks then neither hold their shares of
    the exported tensors until the stream ends nor stage snapshots of them in WeightSync's store
    (which would only go stale); should the source then not serve (its map disagrees with the
    export, its shard snapshots fail), the next update is a seed. Without it, they stage one (and
    let it go once the source is :meth:`ready`)."""

    #: elements of all checkpoint tensors (the denominator of a report's changed fraction)
    total_elements: int

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def ready(self) -> bool:
        """The fast path can serve the next delta (the same answer on every rank)."""

    def seeded(self) -> None:
        """The reference stream of a seed or full update was just consumed (before its last bucket,
        inside the engines' pause): settle whether its shard snapshots can be taken. It may raise
        (on every rank alike) to refuse what it streamed: the update then fails before the engines
        commit it."""

    def local_patches(self) -> list[Ordered]:
        """This rank's changed entries since the committed version, staged for :meth:`commit`."""

    def commit(self) -> None:
        """Every engine holds the new version: after a seed, take the shard snapshots now (the
        parameters keep their values while ``update`` runs; the engines already resumed)."""

    def rollback(self) -> None: ...

    def reset(self) -> None: ...

    def local_digests(self, names: set[str] | None = None) -> dict[str, Digest]:
        """Digests of this rank's share of each committed tensor (they add up over ranks), or of
        those in ``names`` only."""


def default_name_map(name: str) -> str | None:
    """Module names of a Hugging Face model are its checkpoint names (``_orig_mod.`` / ``module.`` stripped)."""
    if not name.startswith(_WRAPPERS):  # (one test per tensor of a model's ~19k)
        return name
    for prefix in _WRAPPERS:
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


#: prefixes torch.compile and DDP/FSDP wrappers put before a module's names, in the order they nest
_WRAPPERS = ("_orig_mod.", "module.")


def _default_names(names: list[str]) -> list[str | None]:
    """:func:`default_name_map` of each of ``names`` (a list where none is wrapped: itself, found by
    one search of the names joined, ~0.3 ms for a model's ~19k)."""
    joined = "\n" + "\n".join(names)
    if any("\n" + w in joined for w in _WRAPPERS):
        return list(map(default_name_map, names))
    return names


#: a name map may say how it maps a whole list at once (:meth:`~delta_sync.prepare.TensorStream.chunks`)
default_name_map.many = _default_names


class SyncState(enum.Enum):
    """What the engines and the trainer's snapshots hold in common (:class:`WeightSync`'s state)."""

    #: no committed version can back a delta (nothing seeded yet, an engine lost its base, drift
    #: was found, a snapshot could not be staged): the next update is a seed
    NEEDS_SEED = "needs_seed"
    #: every engine and every trainer snapshot holds ``version``: the next update is the mode's
    IN_SYNC = "in_sync"


class WeightSync:
    """Keeps engines equal to the trainer, one :meth:`update` per training step (see module doc).

    An update runs in three phases: *prepare* (every rank reads the named tensors; owners diff or
    stage their snapshots: :mod:`delta_sync.prepare`), *publish* (rank 0 drives the engines through
    pause -> start -> send -> finish -> resume: :mod:`delta_sync.publish`) and *settle* (every rank
    learns rank 0's :class:`Outcome` and commits, rolls back, or resets its snapshots). Seeds and
    full updates stream: prepare and publish overlap, rank 0 packs buckets straight from the stream
    while the engines apply the previous bucket, and no process holds more than two buckets of
    payload. A delta streams too (its payload is the changed elements): one rank packs while it
    diffs; with several, each rank diffs its share and rank 0 gathers them round by round, about a
    bucket at a time, while it packs and sends.

    The version state: ``version`` is the last version every engine and every trainer snapshot
    held, ``state`` (:class:`SyncState`) whether it can back a delta. :meth:`_next_kind` reads it
    (and notices engines that lost their base), :meth:`_settle` commits or fails a version,
    :meth:`_reset` and :meth:`request_seed` send the next update back to a seed.
    """

    def __init__(self, engines: Iterable, options: SyncOptions | None = None, *,
                 name_map: Callable[[str], str | None] = default_name_map, group=None, secret: str | None = None,
                 **settings):
        """``options`` (or its fields as keywords: ``mode="delta"``, ``bucket_bytes=...``; see
        :class:`~delta_sync.options.SyncOptions`) are validated here, before any engine is contacted.
        ``secret`` (default ``$DELTA_SYNC_SECRET``) signs every engine call and keys the channel."""
        if options is not None and settings:
            raise TypeError(f"give SyncOptions or its fields as keywords, not both (got {', '.join(settings)})")
        o = self.options = options if options is not None else SyncOptions(**settings)
        self._catalog: dict[str, int] = {}  # checkpoint name -> bytes, stream order (same on every rank)
        self._sweep_at = 0
        #: rank 0: the next sweep window and the trainer's digests of it at the committed version;
        #: the engines report theirs when they start the next delta (no call of its own)
        self._sweep: tuple[list[str], dict[str, str]] | None = None
        self.name_map, self.group = name_map, group
        #: device group (payloads) and host group (metadata) of the trainer; None without a world
        self.groups = TrainerGroups.around(group) if dist.is_initialized() else None
        self.rank = self.groups.rank if self.groups else 0
        self.world = self.groups.world if self.groups else 1
        key = load_secret(secret, required=False) if self.rank == 0 else None  # loaded once, for every client
        clients = [as_engine(e, secret=key if key is not None else secret) for e in engines] if self.rank == 0 else []
        #: rank 0: the engines and the channel to their workers
        self._engines = Engines(clients, key=key,
                                host=o.host or "127.0.0.1", port=o.port, backend=o.backend, timeout_s=o.timeout_s,
                                pause_mode=o.pause_mode)
        self.store = SnapshotStore(self.rank, self.world, o.snapshot_device)
        self.gatherer = PatchGather(self.groups) if self.world > 1 else None
        self.version = -1
        self.state = SyncState.NEEDS_SEED
        self.sharded: ShardedSource | None = None  # the source whose shard snapshots back the deltas
        #: the last seed staged no plain snapshot: the sharded source was to take its own
        self._seed_left_to_source = False
        self._busy = threading.Lock()  # one update at a time
        self._ready: bool | None = None  # this update's answer of _source_serves
        self._base_asked = True  # this update asked the engines for their version before it began
        #: one rank: the next sweep (window, cursor, trainer digests, seconds) worked out while a delta's
        #: engines staged it (:meth:`_sweep_early`), taken when it commits
        self._ahead: tuple | None = None

    @property
    def needs_seed(self) -> bool:
        return self.state is SyncState.NEEDS_SEED

    def request_seed(self) -> None:
        """Make the next update a full seed (every rank alike), e.g. after changing the model."""
        self.state = SyncState.NEEDS_SEED

    @property
    def engines(self) -> list[EngineClient]:
        return self._engines.clients

    @property
    def channel(self) -> Channel | None:
        return self._engines.channel

    # the settings this sync reads (its SyncOptions; the engines' part went to Engines)
    mode = property(lambda self: self.options.mode)
    bucket_bytes = property(lambda self: self.options.bucket_bytes)
    verify_every = property(lambda self: self.options.verify_every)
    drift_sweep = property(lambda self: self.options.drift_sweep)
    dtype = property(lambda self: self.options.dtype)

    def _kept(self) -> str:
        return f"engines and trainer snapshot at v{self.version}"

    # ---- one update ------------------------------------------------------------------------------
    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> UpdateReport:
        """Sync one version. Every trainer rank calls this with the same names in the same order.

        The tensors must keep their values while ``update`` runs (a delta reads them in batches, see
        :data:`delta_sync.prepare.DIFF_BATCH_BYTES`): yield views of the live weights, or fresh tensors."""
        if not self._busy.acquire(blocking=False):
            raise UpdateInFlight(f"update v{self.version + 1} is still running on this WeightSync (called from "
                                 "two threads?); updates of one sync are sequential",
                                 kept=f"the running update goes on; trainer snapshot at v{self.version}")
        try:
            with gc_held():
                return self._update(named_tensors)
        finally:
            self._ready = None
            self._busy.release()

    def _update(self, named_tensors) -> UpdateReport:
        t_start = time.perf_counter()
        self._ahead = None
        kind = self._next_kind(named_tensors)
        version = self.version + 1
        timings: dict[str, float] = {}
        if kind == "delta":
            outcome, error, elements = self._delta(version, named_tensors, timings)
            outcome = self._from_rank0(outcome)
            if outcome.lost_base and not self._base_asked:  # said at its start: the same source goes as a seed
                # (a source that cannot be read twice was asked before: there the update fails, the next seeds;
                # the reset forgets what the delta staged, Publish dropped the channel the engine left)
                self._reset()
                kind, timings = "seed", {}
        if kind != "delta":
            outcome, error, elements = self._bulk(version, kind, named_tensors, timings)
            outcome = self._from_rank0(outcome)
        self._settle(version, kind, outcome, error)
        rep = UpdateReport(version, kind, **outcome.report)
        rep.verified = kind != "delta"  # every bulk entry's digest was checked by the engines
        rep.checked = outcome.checked
        self._check_after(rep, outcome, timings)
        rep.total_elements = elements
        rep.timings.update({k: round(v, 6) for k, v in timings.items()})
        rep.timings["total_s"] = round(time.perf_counter() - t_start, 6)
        return rep

    def _next_kind(self, named_tensors) -> str:
        """What the next version must be: a seed where nothing can back a delta, else the mode's."""
        self._seed_left_to_source = False
        sharded = named_tensors if isinstance(named_tensors, ShardedSource) else None
        self._base_asked = not self.needs_seed and not (self.mode == "delta" and self._rereadable(named_tensors))
        if self._base_asked and self._from_rank0(self.rank == 0 and self._engines.lost_base(self.version)):
            self.state = SyncState.NEEDS_SEED  # an engine restarted or lost its base: only a seed repairs it
            self._engines.drop_channel()  # a restarted engine also left the channel: rejoin everyone
        if sharded is not None and not self._serves_dtype(sharded):
            sharded = None  # read as the stream it also is, each tensor cast to this sync's dtype
        if sharded is not self.sharded:
            # One snapshot owner: a sharded source keeps its own shard snapshots, and while it serves
            # the deltas the plain snapshot store is not updated. After a switch neither knows what
            # the engines hold, so the next version is a seed (logged: it costs a full transfer).
            if not self.needs_seed:
                log.warning("delta-sync: the update source changed (%s -> %s); sending a seed",
                            type(self.sharded).__name__, type(sharded).__name__)
            self._reset()
            self.sharded = sharded
        if self.needs_seed:
            self._reset()  # the snapshot kept so far (at v-1) lends its memory to the seed's copy
            return "seed"
        return "full" if self.mode == "full" else "delta"

    def _rereadable(self, named_tensors) -> bool:
        """Can a delta's source be read again as a seed, were an engine found without its base when
        the delta starts (then no call asks before it)? A sharded source, or with one rank a list or
        a mapping's items (a generator cannot; with several ranks every one decides alike: sharded
        sources are on every rank)."""
        if isinstance(named_tensors, ShardedSource):
            return True
        return self.world == 1 and isinstance(named_tensors, (collections.abc.Sequence, collections.abc.ItemsView))

    def _source_serves(self) -> bool:
        """Do the sharded source's own snapshots back the deltas (its ``ready()``)? Asked once per
        update (FlatWeights checks every weight's address: ~1 ms at ~19k tensors), and once more
        after a commit where they did not (it may have taken them)."""
        ready = self._ready
        if ready is None:
            ready = self.sharded is not None and self.sharded.ready()
            if self._busy.locked():  # within an update: kept until it ends (a verify() call asks anew)
                self._ready = ready
        return ready

    def _serves_dtype(self, source) -> bool:
        """Can ``source``'s own deltas be this sync's (its floating weights of the dtype sent)? A source
        that says its ``dtypes`` (FlatWeights) and holds others (fp32 master weights for a bf16 engine)
        is read as a stream instead, cast tensor by tensor (logged once)."""
        dtypes = getattr(source, "dtypes", None)
        dtypes = None if dtypes is None else set(dtypes)  # (one per tensor, for FlatWeights: ~19k of a 30B-A3B)
        if self.dtype is None or dtypes is None or all(d == self.dtype or not d.is_floating_point for d in dtypes):
            return True
        if not getattr(source, "_dtype_warned", False):
            source._dtype_warned = True
            log.warning("delta-sync: %s holds %s weights but this sync sends %s: its deltas go tensor by tensor, "
                        "each cast (keep the weights in %s to diff them whole)", type(source).__name__,
                        sorted({str(d) for d in dtypes if d != self.dtype}), self.dtype, self.dtype)
        return False

    def _settle(self, version: int, kind: str, outcome: Outcome, error: BaseException | None) -> None:
        """Every rank: commit ``version`` where rank 0's outcome is good, else roll back and raise."""
        if not outcome.ok:
            # the snapshot stays at the committed version either way; engines that lost it get a seed
            self._rollback()
            if outcome.needs_seed:
                self.state = SyncState.NEEDS_SEED
            kept = (f"engines need a seed, the next update sends one; trainer snapshot at v{self.version}"
                    if self.needs_seed else self._kept())
            if error is not None:
                raise with_kept(error, kept)
            raise DeltaSyncError(f"update v{version} failed on trainer rank 0: {outcome.error}", kept=kept)
        self.store.commit(version)
        if self.sharded is not None:
            self.sharded.commit()  # a seed's shard snapshots are taken here (collective)
            if not self._ready:
                self._ready = None  # (asked anew: a commit that took snapshots makes them serve from now on)
        self.version, self.state = version, SyncState.IN_SYNC
        if self._source_serves():
            self.store.clear()  # the shard snapshots back the deltas: a plain one would only go stale
        elif kind != "delta" and self._seed_left_to_source:
            # the source expected to serve the deltas, so this seed staged no plain snapshot, and
            # then it could not (map, shard snapshots): nothing on the trainer holds v any more
            self.state = SyncState.NEEDS_SEED
            log.warning("delta-sync: the sharded source cannot serve the deltas after v%d (see above); the "
                        "next update is a seed (through the reference export)", version)

    def _check_after(self, rep: UpdateReport, outcome: Outcome, timings: dict) -> None:
        """The integrity checks after a committed version: the drift the engines reported when they
        started it, a full verify when one is due, and the trainer's half of the next sweep window."""
        if outcome.drift:  # the engines' previous version differed from the trainer's: re-seed next
            rep.drift = (f"drift found when the engines started v{rep.version}: {outcome.drift}; the next "
                         "update is a full seed")
            log.error("delta-sync: %s", rep.drift)
            self._reset()
        elif rep.kind == "delta" and self.verify_every and rep.version % self.verify_every == 0:
            t0 = time.perf_counter()
            rep.checked = len(self.verify())
            rep.verified = True
            timings["verify_s"] = time.perf_counter() - t0
        ahead, self._ahead = self._ahead, None
        if self._sweeps():
            t0 = time.perf_counter()
            window, self._sweep_at, want = ahead[:3] if ahead else self._sweep_next()
            self._sweep = (window, want) if self.rank == 0 else None
            timings["sweep_s"] = ahead[3] if ahead else time.perf_counter() - t0

    # ---- delta: diff, gather, validate, publish ---------------------------------------------------
    def _delta(self, version: int, named_tensors, timings: dict) -> tuple[Outcome | None, BaseException | None, int]:
        # rank 0 starts the engines' update (and their half of the drift sweep) while the ranks diff
        # (from before the source's address check on): the engines keep serving, and an update that
        # fails before publishing ends those sessions
        early = EarlyStart(self._engines, self._sweep) if self.rank == 0 and self.channel is not None and self.engines \
            else None
        try:
            diff = DeltaDiff(TensorStream(named_tensors, self.name_map, self.dtype, self._kept()), self.store,
                             self._catalog, self.sharded, timings, fast=self._source_serves())
        except BaseException:
            if early is not None:
                early.cancel(self.version)
            raise
        if self.gatherer is None:
            return self._delta_alone(version, diff, timings, early)
        return self._delta_gathered(version, diff, timings, early)

    def _delta_alone(self, version: int, diff: DeltaDiff, timings: dict, early: EarlyStart | None):
        """One rank: the packer pulls patches from the diff as it fills buckets, and each full bucket
        leaves while the next one is diffed (the trainer never holds a large delta whole); the
        engines stage every bucket and apply nothing before finish, as for a gathered delta, so a
        failure found later aborts the buckets sent so far."""
        def stream(sender: BucketSender) -> SendStats:
            return sender.close(p for ready in diff for p in diff.checked([o.patch for o in ready]))

        diff.batched = True  # this rank packs: the kernel's batches go into the tables whole
        outcome, error = self._publish(version, "delta", timings, stream, early, sent=self._sweep_early)
        timings["prepare_s"] = timings["diff_s"]
        if "send_s" in timings:  # what the send added to the diff it overlapped
            timings["send_s"] = max(0.0, timings["send_s"] - timings["diff_s"])
        return outcome, error, diff.elements

    def _delta_gathered(self, version: int, diff: DeltaDiff, timings: dict, early: EarlyStart | None):
        """Several ranks: each diffs its share, then rank 0 gathers the patches round by round (about
        a bucket of them over all ranks each) as its packer asks for them, so it never holds the
        other ranks' whole deltas; the engines stage every bucket, as with one rank."""
        diff.batched = True  # each rank's kernel batches travel whole (binary rows, no object per tensor)
        try:
            t0 = time.perf_counter()
            try:
                stream = self.gatherer.stream(lambda: [o for ready in diff for o in ready], self.bucket_bytes)
            except GatherError:
                self._rollback()  # every rank raises the same error
                raise
            except Exception as e:  # noqa: BLE001 - the update's outcome, the same on every rank
                return Outcome(False, f"{type(e).__name__}: {e}"), e, diff.elements
            timings["prepare_s"] = time.perf_counter() - t0
            if self.rank != 0:
                try:
                    stream.finish()  # this rank's sends; a failure on any rank ends them on all
                except GatherError as e:
                    return None, e, diff.elements
                return None, None, diff.elements
            published, early = early, None  # from here on, the publish ends the sessions it started
            outcome, error = self._publish(version, "delta", timings,
                                           lambda sender: sender.close(q for p in stream for q in diff.checked([p])),
                                           published)
        finally:
            if early is not None:
                early.cancel(self.version)
        try:  # the rounds not read (the publish failed first) end with its failure on every rank
            stream.finish(None if outcome.ok else (error or DeltaSyncError(outcome.error)))
        except GatherError:
            pass  # rank 0's own failure, raised with the outcome
        # rounds, and the most bytes of the other ranks' patches rank 0 held at once
        timings["gather_rounds"], timings["gather_peak_bytes"] = stream.rounds, stream.peak_round_bytes
        return outcome, error, diff.elements

    # ---- seed / full: one streaming pass ----------------------------------------------------------
    def _bulk(self, version: int, kind: str, named_tensors, timings: dict
              ) -> tuple[Outcome | None, BaseException | None, int]:
        """Every rank reads the stream once (:class:`~delta_sync.prepare.BulkRead`); rank 0 packs and
        sends every tensor as it comes. Before the last bucket, the ranks agree that nobody failed;
        a failure aborts the update instead."""
        self._catalog, self._sweep_at = {}, 0  # the names this seed carries
        read = BulkRead(TensorStream(named_tensors, self.name_map, self.dtype, self._kept(), seen=self._catalog),
                        kind, store=self.store, sharded=self.sharded, rank=self.rank, world=self.world,
                        snapshots=self.mode == "delta", agree=self._agree, timings=timings)
        try:
            if self.rank != 0:
                try:
                    read.read_all()
                except GatherError:
                    self._reset()
                    raise
                if read.defer:
                    read.stage_later(True)  # rank 0's outcome says whether it failed (for every rank alike)
                return None, None, read.tensors.elements
            outcome, error = self._bulk_publish(version, kind, read, timings)
            return outcome, error, read.tensors.elements
        finally:
            read.later.clear()
            self._seed_left_to_source = bool(read.source_snapshots)

    def _bulk_publish(self, version: int, kind: str, read: BulkRead, timings: dict
                      ) -> tuple[Outcome, BaseException | None]:
        """Rank 0 of a bulk update: publish, then stage its own snapshot share once the engines serve."""
        outcome, error = self._publish(version, kind, timings, read.send)
        if not read.sending and self.gatherer is not None:
            # refused before its first bucket (no channel to the engines): the other ranks read the
            # stream and wait to agree on it; rank 0 takes part with this failure, so every rank
            # raises it now (not at the collective timeout, with the trainer's groups broken)
            read.failures.insert(0, error if error is not None else DeltaSyncError(outcome.error))
            try:
                read.read_all()
            except GatherError as e:
                error = e
        if isinstance(error, GatherError):
            self._reset()
            raise error
        if read.defer and read.agreed:
            failed = read.stage_later(outcome.ok)
            if failed is not None and outcome.ok:  # the engines hold v, a snapshot cannot: only a seed repairs it
                error = DeltaSyncError(f"the engines applied v{version}, but staging the trainer snapshot of it "
                                       f"failed on {failed}")
                outcome = Outcome(False, str(error), needs_seed=True)
        return outcome, error

    def _publish(self, version: int, kind: str, timings: dict, send: Callable[[BucketSender], SendStats],
                 early: EarlyStart | None = None, sent: Callable[[], None] | None = None
                 ) -> tuple[Outcome, BaseException | None]:
        """Rank 0: one version through every engine (:class:`~delta_sync.publish.Publish`)."""
        return Publish(self._engines, version, kind, timings, bucket_bytes=self.bucket_bytes,
                       committed=self.version, needs_seed=self.needs_seed, kept=self._kept(),
                       sweep=self._sweep if kind == "delta" else None, early=early,
                       base_asked=self._base_asked, sent=sent).run(send)

    # ---- settle ----------------------------------------------------------------------------------
    def _rollback(self) -> None:
        self.store.rollback()
        if self.sharded is not None:
            self.sharded.rollback()

    def _reset(self) -> None:
        """Forget every snapshot: the next update is a full seed."""
        self._sweep, self._ready = None, None
        self.store.reset()
        if self.sharded is not None:
            self.sharded.reset()
        self.state = SyncState.NEEDS_SEED

    def _agree(self, mine: BaseException | None) -> None:
        """Every trainer rank learns whether any failed: the same GatherError on every rank if one
        did (a collective when world > 1; with one rank, ``mine`` itself is raised)."""
        if self.gatherer is None:
            if mine is not None:
                raise mine
            return

        def status():
            if mine is not None:
                raise mine
            return []
        self.gatherer.gather(status)

    def _from_rank0(self, obj):
        """Trainer rank 0's ``obj`` on every trainer rank (a collective when world > 1)."""
        if self.world == 1:
            return obj
        return collectives.broadcast_object(obj, 0, self.groups.host_group)

    # ---- integrity -------------------------------------------------------------------------------
    def _sweep_window(self) -> tuple[list[str], int]:
        """The next names of the drift sweep: at least 1/drift_sweep of the model's bytes, walking
        the catalog round-robin, so any drift_sweep consecutive windows cover every tensor. Every
        rank computes the same window (same catalog, same cursor). Returns it and the cursor after it."""
        names = list(self._catalog)
        budget = sum(self._catalog.values()) / self.drift_sweep
        out, acc, at = [], 0, self._sweep_at
        while acc < budget and len(out) < len(names):
            name = names[at % len(names)]
            at += 1
            out.append(name)
            acc += self._catalog[name]
        return out, at

    def _sweeps(self) -> bool:
        """Does a drift sweep follow the version now committed (or staged)?"""
        return not self.needs_seed and self.mode == "delta" and bool(self.drift_sweep) and bool(self._catalog)

    def _sweep_next(self) -> tuple[list[str], int, dict[str, str]]:
        """The next sweep window, the cursor after it, and the trainer's digests of it (collective:
        the owners' shares)."""
        window, at = self._sweep_window()
        return window, at, self._trainer_digests(window)

    def _sweep_early(self) -> None:
        """One rank, a delta's buckets all sent: the trainer's half of the next sweep, while the engines
        stage the delta (the snapshots hold the new version already; kept only if it commits)."""
        if self._sweeps():
            t0 = time.perf_counter()
            try:
                window, at, want = self._sweep_next()
            except Exception as e:  # noqa: BLE001 - worked out after the commit instead, where a failure is the update's
                log.debug("delta-sync: the early sweep failed (%s); it runs after the commit", e)
                return
            # a tensor whose snapshot this delta replaces whole (a weight moved out of FlatWeights: the
            # store copies it) has no digest until the commit: then it is worked out after the commit
            if len(want) == len(window):
                self._ahead = (window, at, want, time.perf_counter() - t0)

    def _trainer_digests(self, names: list[str] | None = None) -> dict[str, str]:
        """Digest of every committed tensor (or of ``names``), summed over the owners' shares
        (collective when world > 1)."""
        only = set(names) if names is not None else None
        if self._source_serves():  # shard snapshots back the deltas
            mine = {name: d.hex() for name, d in self.sharded.local_digests(only).items()}
        else:  # the snapshots digested together (a sweep names hundreds of a 30B-A3B's ~19k, verify all)
            chosen = list(self.store.snapshots()) if only is None else \
                [(n, snap) for n in only if (snap := self.store.snapshot_of(n)) is not None]
            mine = dict(zip([n for n, _ in chosen], tensor_texts([t for _, t in chosen])))
        if self.world == 1:
            return mine if only is None else {k: v for k, v in mine.items() if k in only}
        shares: dict[str, list[str]] = {}
        for part in collectives.all_gather_object(mine, self.groups.host_group):  # whole tensors, or shares
            for k, v in part.items():
                shares.setdefault(k, []).append(v)
        names = [k for k in shares if only is None or k in only]
        return dict(zip(names, add_texts([shares[k] for k in names])))

    def verify(self, names: list[str] | None = None) -> dict[str, str]:
        """Compare engines' per-tensor digests with the trainer snapshot (collective): every tensor,
        or only ``names``.

        Each owner digests its snapshot shard; rank 0 compares. A tensor the engine did not digest
        counts as a mismatch. A mismatch is drift: raises :class:`DriftDetected` on every rank and
        the next update is a full seed.
        """
        if self.needs_seed:  # every rank alike: nothing committed to compare against
            raise DeltaSyncError("nothing to verify: the trainer holds no committed snapshot (the next update "
                                 "is a seed)", kept="engines serving their current weights until the seed")
        # rank 0 asks the engines first: they digest their weights while the trainer digests its snapshots
        pool = ThreadPoolExecutor(max_workers=len(self.engines)) if self.rank == 0 and self.engines else None
        reports = [pool.submit(e.report, digests=True, names=names) for e in self.engines] if pool else []
        try:
            want = self._trainer_digests(names)
        finally:
            if pool is not None:
                pool.shutdown(wait=True)  # (a trainer digest that failed still waits for the engines' answers)
        problem = None
        if self.rank == 0:
            try:
                for e, report in zip(self.engines, reports):
                    problem = differs(e.name, report.result(), want)
                    if problem:
                        break
            except Exception as err:  # noqa: BLE001 - every rank must hear about it, not wait in the broadcast below
                problem = f"digest report failed: {type(err).__name__}: {err}"
        problem = self._from_rank0(problem)
        if problem:
            self._reset()
            raise DriftDetected(f"after v{self.version}: {problem}; the next update is a full seed",
                                kept="engines serving their current weights until the re-seed")
        return want

    def close(self) -> None:
        """Leave the channel and release the engines (another trainer may claim them at once)."""
        self._engines.close()


class DriftDetected(DeltaSyncError):
    """Engine digests differ from the trainer snapshot."""
