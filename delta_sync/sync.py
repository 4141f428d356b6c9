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

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from . import collectives
from .auth import channel_token, load_secret
from .bucket import DEFAULT_BUCKET_BYTES
from .channel import LOCAL, Channel, listen
from .collectives import TrainerGroups
from .digest import Digest, digest_tensor
from .engines import EngineClient, InProcessEngine, as_engine
from .errors import DeltaSyncError, GatherError, PatchValidationError, UpdateInFlight, with_kept
from .gather import Ordered, PatchGather
from .gc_hold import gc_held
from .patch import Patch, check_indexable
from .snapshot import SnapshotStore
from .transfer import BucketSender, SendStats

log = logging.getLogger(__name__)

#: A delta's owned tensors are diffed in batches of at most this many tensors or bytes: the host
#: kernel scans a batch of small tensors in a few calls instead of paying its per-call costs per
#: tensor, and each batch waits for its slowest thread (64 MiB batches cost a 1.19 GB diff ~15%).
#: A batch is read after the later tensors of it were produced, so a stream that reuses one
#: buffer for every tensor must yield copies; a stream of fresh tensors (an export) has at most
#: this many bytes of them alive, not yet diffed.
DIFF_BATCH_TENSORS = 512
DIFF_BATCH_BYTES = 256 << 20


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
        inside the engines' pause): settle whether its shard snapshots can be taken."""

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


def _expects_to_serve(source: ShardedSource | None) -> bool:
    """The source's :class:`ShardedSource` ``expects_to_serve()``, False where it has none."""
    expects = getattr(source, "expects_to_serve", None)
    return bool(expects()) if callable(expects) else False


def default_name_map(name: str) -> str | None:
    """Module names of a Hugging Face model are its checkpoint names (``_orig_mod.`` / ``module.`` stripped)."""
    for prefix in ("_orig_mod.", "module."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """Full tensor of a DTensor (FSDP2: a collective, one tensor at a time), else the tensor."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


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


class WeightSync:
    """Keeps engines equal to the trainer, one :meth:`update` per training step (see module doc).

    An update runs in three phases: *prepare* (every rank reads the named tensors; owners diff or
    stage their snapshots), *publish* (rank 0 drives the engines through pause -> start -> send ->
    finish -> resume) and *settle* (every rank learns rank 0's :class:`Outcome` and commits, rolls
    back, or resets its snapshots). Seeds and full updates stream: prepare and publish overlap,
    rank 0 packs buckets straight from the stream while the engines apply the previous bucket,
    and no process holds more than two buckets of payload. A delta streams too (its payload is
    the changed elements): one rank packs while it diffs; with several, each rank diffs its share
    and rank 0 gathers them round by round, about a bucket at a time, while it packs and sends.
    """

    def __init__(self, engines: Iterable, *, mode: str = "delta", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 verify_every: int = 0, drift_sweep: int = 40, snapshot_device: str | torch.device = "cpu",
                 pause_mode: str = "wait",
                 name_map: Callable[[str], str | None] = default_name_map, group=None,
                 host: str | None = None, port: int | None = None, backend: str | None = None,
                 timeout_s: float = 300.0, dtype: torch.dtype | None = None, secret: str | None = None):
        if mode not in ("delta", "full"):
            raise ValueError(f"mode must be 'delta' or 'full', got {mode!r}")
        if pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(f"pause_mode must be 'wait', 'abort' or 'keep', got {pause_mode!r}")
        if drift_sweep < 0 or verify_every < 0:
            raise ValueError(f"drift_sweep and verify_every must be >= 0, got {drift_sweep} and {verify_every}")
        self.mode, self.bucket_bytes, self.verify_every = mode, bucket_bytes, verify_every
        #: every tensor's digest is compared with the engines' at least once per this many deltas
        #: (each delta checks a rotating window of ~1/drift_sweep of the bytes; the default costs
        #: ~3% of a 0.2% delta in bench e2e, 40 deltas bound the time to notice); 0 turns it off
        self.drift_sweep = drift_sweep
        self._catalog: dict[str, int] = {}  # checkpoint name -> bytes, stream order (same on every rank)
        self._sweep_at = 0
        #: rank 0: the next sweep window and the trainer's digests of it at the committed version;
        #: the engines report theirs when they start the next delta (no call of its own)
        self._sweep: tuple[list[str], dict[str, str]] | None = None
        self.pause_mode, self.name_map, self.group, self.dtype = pause_mode, name_map, group, dtype
        #: device group (payloads) and host group (metadata) of the trainer; None without a world
        self.groups = TrainerGroups.around(group) if dist.is_initialized() else None
        self.rank = self.groups.rank if self.groups else 0
        self.world = self.groups.world if self.groups else 1
        #: the engines' secret (default ``$DELTA_SYNC_SECRET``): signs every call, keys the channel
        self._key = load_secret(secret, required=False) if self.rank == 0 else None
        self.engines: list[EngineClient] = ([as_engine(e, secret=secret) for e in engines]
                                            if self.rank == 0 else [])
        self.store = SnapshotStore(self.rank, self.world, snapshot_device)
        self.gatherer = PatchGather(self.groups) if self.world > 1 else None
        self.host = host or "127.0.0.1"
        self.port, self.backend, self.timeout_s = port, backend, timeout_s
        self.channel: Channel | None = None
        self.version = -1
        self.needs_seed = True
        self.sharded: ShardedSource | None = None  # the source whose shard snapshots back the deltas
        #: this seed stages no plain snapshot (see ShardedSource.expects_to_serve); None: not asked yet
        self._store_skipped: bool | None = False
        self._busy = threading.Lock()  # one update at a time

    # ---- channel ---------------------------------------------------------------------------------
    def _connect(self) -> None:
        if self.channel is not None:
            return
        workers = [len(e.report()) for e in self.engines]
        world = 1 + sum(workers)
        backend = self.backend or (LOCAL if all(isinstance(e, InProcessEngine) for e in self.engines) else None)
        # the store's port is bound before the engines learn it: nothing else can take it meanwhile
        listener = listen(self.host, self.port or 0) if backend != LOCAL else None
        port = listener.getsockname()[1] if listener is not None else (self.port or 0)
        nonce = secrets.token_hex(16)  # signed clients send this; their workers derive the token from it
        token = channel_token(self._key, nonce) if self._key else secrets.token_hex(16)
        offsets = [1 + sum(workers[:i]) for i in range(len(workers))]
        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            futs = [pool.submit(e.init, {"host": self.host, "port": port, "world_size": world, "token": token,
                                         "channel_nonce": nonce, "rank_offset": off, "backend": backend,
                                         "timeout_s": self.timeout_s})
                    for e, off in zip(self.engines, offsets)]

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
        log.info("delta-sync channel: %d engine worker(s) on %s", world - 1, self.channel.backend)

    def _engines_lost_base(self) -> bool:
        """Rank 0: does any engine worker lack the version the trainer committed (restart, failed seed,
        storage swapped under the views)? An unreachable engine counts as lost."""
        try:
            return any(r.get("needs_seed") or r.get("version") != self.version
                       for e in self.engines for r in e.report())
        except Exception:  # noqa: BLE001 - an engine that cannot say counts as having lost its base
            return True

    def _drop_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
        self.channel = None

    # ---- one update ------------------------------------------------------------------------------
    def update(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> UpdateReport:
        """Sync one version. Every trainer rank calls this with the same names in the same order.

        The tensors must keep their values while ``update`` runs (a delta reads them in batches, see
        :data:`DIFF_BATCH_BYTES`): yield views of the live weights, or fresh tensors."""
        if not self._busy.acquire(blocking=False):
            raise UpdateInFlight(f"update v{self.version + 1} is still running on this WeightSync (called from "
                                 "two threads?); updates of one sync are sequential",
                                 kept=f"the running update goes on; trainer snapshot at v{self.version}")
        try:
            with gc_held():
                return self._update(named_tensors)
        finally:
            self._busy.release()

    def _update(self, named_tensors) -> UpdateReport:
        t_start = time.perf_counter()
        self._store_skipped = False
        if not self.needs_seed and self._from_rank0(self.rank == 0 and self._engines_lost_base()):
            self.needs_seed = True  # an engine restarted or lost its base: only a seed can repair it
            self._drop_channel()  # a restarted engine also left the channel: rejoin everyone
        sharded = named_tensors if isinstance(named_tensors, ShardedSource) else None
        if sharded is not self.sharded:
            # One snapshot owner: a sharded source keeps its own shard snapshots, and while it serves
            # the deltas the plain snapshot store is not updated. After a switch neither knows what
            # the engines hold, so the next version is a seed (logged: it costs a full transfer).
            if not self.needs_seed:
                log.warning("delta-sync: the update source changed (%s -> %s); sending a seed",
                            type(self.sharded).__name__, type(sharded).__name__)
            self._reset()
            self.sharded = sharded
        version = self.version + 1
        kind = "seed" if self.needs_seed else ("full" if self.mode == "full" else "delta")
        if kind == "seed":
            self._reset()  # the snapshot kept so far (at v-1) lends its memory to the seed's copy
        timings: dict[str, float] = {}
        if kind == "delta":
            outcome, error, elements = self._delta(version, named_tensors, timings)
        else:
            outcome, error, elements = self._bulk(version, kind, named_tensors, timings)
        outcome = self._from_rank0(outcome)
        if not outcome.ok:
            # the snapshot stays at the committed version either way; engines that lost it get a seed
            self._rollback()
            self.needs_seed = self.needs_seed or outcome.needs_seed
            kept = (f"engines need a seed, the next update sends one; trainer snapshot at v{self.version}"
                    if self.needs_seed else f"engines and trainer snapshot at v{self.version}")
            if error is not None:
                raise with_kept(error, kept)
            raise DeltaSyncError(f"update v{version} failed on trainer rank 0: {outcome.error}", kept=kept)
        self.store.commit(version)
        if sharded is not None:
            sharded.commit()  # a seed's shard snapshots are taken here (collective)
        self.version, self.needs_seed = version, False
        if sharded is not None and sharded.ready():
            self.store.clear()  # the shard snapshots back the deltas: a plain one would only go stale
        elif kind != "delta" and self._store_skipped:
            # the source expected to serve the deltas, so this seed staged no plain snapshot, and
            # then it could not (map, shard snapshots): nothing on the trainer holds v any more
            self.needs_seed = True
            log.warning("delta-sync: the sharded source cannot serve the deltas after v%d (see above); the "
                        "next update is a seed (through the reference export)", version)
        rep = UpdateReport(version, kind, **outcome.report)
        rep.verified = kind != "delta"  # every bulk entry's digest was checked by the engines
        rep.checked = outcome.checked
        if outcome.drift:  # the engines' previous version differed from the trainer's: re-seed next
            rep.drift = (f"drift found when the engines started v{version}: {outcome.drift}; the next update "
                         "is a full seed")
            log.error("delta-sync: %s", rep.drift)
            self._reset()
        elif kind == "delta" and self.verify_every and version % self.verify_every == 0:
            t0 = time.perf_counter()
            rep.checked = len(self.verify())
            rep.verified = True
            timings["verify_s"] = time.perf_counter() - t0
        if not self.needs_seed and self.mode == "delta" and self.drift_sweep and self._catalog:
            t0 = time.perf_counter()
            window = self._sweep_window()
            want = self._trainer_digests(window)  # collective: the owners' shares
            self._sweep = (window, want) if self.rank == 0 else None
            timings["sweep_s"] = time.perf_counter() - t0
        rep.total_elements = elements
        rep.timings.update({k: round(v, 6) for k, v in timings.items()})
        rep.timings["total_s"] = round(time.perf_counter() - t_start, 6)
        return rep

    def _tensors(self, named_tensors, elements: list[int], seen: dict[str, int]
                 ) -> Iterator[tuple[int, str, torch.Tensor | Exception]]:
        """``(seq, checkpoint name, tensor or the exception converting it)`` of the stream, to its end;
        ``seen`` collects each name's bytes (a name given twice is an error).

        A rank whose own conversion failed keeps consuming (and materialising DTensors): Bridge's
        export and FSDP's full_tensor are collective, and the other ranks are still in them."""
        for seq, (mname, tensor) in enumerate(named_tensors):
            name = self.name_map(mname)
            if name is None:
                continue
            try:
                t = _materialize(tensor.detach())
                if self.dtype is not None and t.dtype != self.dtype:
                    if t.dtype.is_floating_point != self.dtype.is_floating_point:  # a cast would invent values
                        raise PatchValidationError(
                            name, f"is {t.dtype}, not a {'floating' if self.dtype.is_floating_point else 'integer'} "
                            f"tensor like the {self.dtype} weights: converting it would write other values; "
                            "pass the weight itself", kept=f"engines and trainer snapshot at v{self.version}")
                    t = t.to(self.dtype)
                if name in seen:
                    raise PatchValidationError(name, f"given twice in one update (the second time as {mname!r})",
                                               kept=f"engines and trainer snapshot at v{self.version}")
                elements[0] += t.numel()
                seen[name] = t.numel() * t.element_size()
            except Exception as e:  # noqa: BLE001 - yielded in order, raised after the stream
                yield seq, name, e
                continue
            yield seq, name, t

    # ---- delta: diff, gather, validate, publish ---------------------------------------------------
    def _delta(self, version: int, named_tensors, timings: dict) -> tuple[Outcome | None, BaseException | None, int]:  # noqa: C901 - still to be split into phases
        sharded = self.sharded
        fast = sharded is not None and sharded.ready()
        elements = [0]
        kept = f"engines and trainer snapshot at v{self.version}"
        timings["diff_s"] = 0.0

        def diffed() -> Iterator[list[Ordered]]:  # noqa: C901 - still to be split into phases
            """This rank's patches, a diff batch at a time (bounded by DIFF_BATCH_*); ``diff_s``: the
            time spent here, not in the consumer between batches. Raises, once the stream is read to
            its end, the first failure of any tensor."""
            t0 = time.perf_counter()
            if fast:
                out = sharded.local_patches()
                elements[0] = sharded.total_elements
                timings["diff_s"] += time.perf_counter() - t0
                yield out
                return
            failure, seen = None, {}
            batch: list[tuple[int, str, torch.Tensor]] = []  # owned, not yet diffed (bounded)
            held = 0

            def diff_batch() -> list[Ordered]:
                nonlocal held
                patches = self.store.prepare_many([(name, t) for _, name, t in batch])
                out = [Ordered(seq, p) for (seq, _, _), p in zip(batch, patches)]
                batch.clear()
                held = 0
                return out

            for seq, name, t in self._tensors(named_tensors, elements, seen):
                if failure is not None:
                    continue
                ready: list[Ordered] = []
                try:
                    if isinstance(t, Exception):
                        raise t
                    if name not in self._catalog:
                        raise PatchValidationError(name, "is not in the seed this delta builds on (a changed "
                                                   "model needs a new seed)", kept=kept)
                    nbytes = t.numel() * t.element_size()
                    if self.store.owns(name, nbytes):
                        batch.append((seq, name, t))
                        held += nbytes
                        if len(batch) >= DIFF_BATCH_TENSORS or held >= DIFF_BATCH_BYTES:
                            ready = diff_batch()
                except Exception as e:  # noqa: BLE001 - raised once the stream is read to its end
                    failure = e
                if ready:
                    timings["diff_s"] += time.perf_counter() - t0
                    yield ready
                    t0 = time.perf_counter()
            ready = []
            if failure is None and batch:
                try:
                    ready = diff_batch()
                except Exception as e:  # noqa: BLE001 - raised once the stream is read to its end
                    failure = e
            missing = [n for n in self._catalog if n not in seen]
            if failure is None and missing:
                failure = PatchValidationError(missing[0], f"left out of this delta with {len(missing) - 1} "
                                               "other seeded tensor(s): every update must name every seeded "
                                               "tensor, or the engines would keep stale values", kept=kept)
            if sharded is not None:
                sharded.seeded()  # collective on every rank, even one that failed above
            timings["diff_s"] += time.perf_counter() - t0
            if failure is not None:
                raise failure
            if ready:
                yield ready

        def checked(patches: list[Patch]) -> list[Patch]:
            """Indices and values are checked per bucket by the packer (one vectorized pass, before
            the bucket leaves); here only what a bucket check cannot see."""
            t0 = time.perf_counter()
            for p in patches:
                p.validate(contents=False, kept=kept)
            timings["validate_s"] = timings.get("validate_s", 0.0) + time.perf_counter() - t0
            return patches

        # rank 0 starts the engines' update (and their half of the drift sweep) while the ranks diff;
        # the engines keep serving, and an update that fails before publishing ends those sessions
        early = _EarlyStart(self) if self.rank == 0 and self.channel is not None and self.engines else None
        try:
            if self.gatherer is None:
                # one rank: the packer pulls patches from the diff as it fills buckets, and each full
                # bucket leaves while the next one is diffed (the trainer never holds a large delta
                # whole); the engines stage every bucket and apply nothing before finish, as for a
                # gathered delta, so a failure found later aborts the buckets sent so far
                def stream(sender: BucketSender) -> SendStats:
                    return sender.close(p for ready in diffed() for p in checked([o.patch for o in ready]))

                published, early = early, None
                outcome, error = self._publish(version, "delta", timings, stream, kept=kept, early=published)
                timings["prepare_s"] = timings["diff_s"]
                if "send_s" in timings:  # what the send added to the diff it overlapped
                    timings["send_s"] = max(0.0, timings["send_s"] - timings["diff_s"])
                return outcome, error, elements[0]
            # several ranks: each diffs its share, then rank 0 gathers the patches round by round
            # (about a bucket of them over all ranks each) as its packer asks for them, so it never
            # holds the other ranks' whole deltas; the engines stage every bucket, as above
            t0 = time.perf_counter()
            try:
                stream = self.gatherer.stream(lambda: [o for ready in diffed() for o in ready], self.bucket_bytes)
            except GatherError:
                self._rollback()  # every rank raises the same error
                raise
            except Exception as e:  # noqa: BLE001 - the update's outcome, the same on every rank
                return Outcome(False, f"{type(e).__name__}: {e}"), e, elements[0]
            timings["prepare_s"] = time.perf_counter() - t0
            if self.rank != 0:
                try:
                    stream.finish()  # this rank's sends; a failure on any rank ends them on all
                except GatherError as e:
                    return None, e, elements[0]
                return None, None, elements[0]
            published, early = early, None  # from here on, _publish ends the sessions it started
            outcome, error = self._publish(version, "delta", timings,
                                           lambda sender: sender.close(q for p in stream for q in checked([p])),
                                           kept=kept, early=published)
            try:  # the rounds not read (the publish failed first) end with its failure on every rank
                stream.finish(None if outcome.ok else (error or DeltaSyncError(outcome.error)))
            except GatherError:
                pass  # rank 0's own failure, raised with the outcome below
            # rounds, and the most bytes of the other ranks' patches rank 0 held at once
            timings["gather_rounds"], timings["gather_peak_bytes"] = stream.rounds, stream.peak_round_bytes
            return outcome, error, elements[0]
        finally:
            if early is not None:
                early.cancel()

    # ---- seed / full: one streaming pass ----------------------------------------------------------
    def _bulk(self, version: int, kind: str, named_tensors, timings: dict  # noqa: C901 - still to be split into phases
              ) -> tuple[Outcome | None, BaseException | None, int]:
        """Every rank reads the stream once; rank 0 packs and sends every tensor as it comes. Before
        the last bucket, the ranks agree that nobody failed; a failure aborts the update instead.
        Owners stage snapshots (delta mode only: a full-mode trainer never diffs): one rank packs
        into its snapshot before the engines pause; several stage their shares outside the pause
        window and then agree that each did."""
        snapshots = self.mode == "delta"
        # one rank owns every tensor: the packer's buckets become its snapshot (one copy, no spare
        # buckets; a sharded source that then serves the deltas lets them go at commit)
        keep = snapshots and self.world == 1
        # several ranks stage their shares once the stream is read (the tensors keep their values
        # while update runs): rank 0 once the engines resumed, the others while it publishes. The
        # seed's pause window then holds only the send and the apply, never a snapshot copy.
        later: list[tuple[str, torch.Tensor]] = []
        elements = [0]
        self._catalog, self._sweep_at = {}, 0  # the names this seed carries
        failure: list[BaseException] = []
        agreed: list[bool] = []  # the ranks agreed that the stream was read without failure
        stream = self._tensors(named_tensors, elements, self._catalog)
        kept = f"engines and trainer snapshot at v{self.version}"
        # a sharded source that expects to serve the deltas: no rank holds or stages its exported
        # shares (asked once the stream started: the source plans first; the same on every rank)
        self._store_skipped = None

        def full_patches() -> Iterator[Patch]:
            """The stream as full patches (rank 0); ``prepare_s``: reading it and staging snapshots."""
            timings["prepare_s"] = 0.0
            while True:
                t0 = time.perf_counter()
                item = next(stream, None)
                if self._store_skipped is None:
                    self._store_skipped = snapshots and not keep and _expects_to_serve(self.sharded)
                if item is None:
                    return
                _, name, t = item
                try:
                    if isinstance(t, Exception):
                        raise t
                    if (snapshots and not keep and not self._store_skipped
                            and self.store.owns(name, t.numel() * t.element_size())):
                        later.append((name, t))
                    if self.rank == 0:
                        check_indexable(name, t.numel())
                except Exception as e:  # noqa: BLE001 - raised once the stream has drained
                    failure.append(e)
                    return
                finally:
                    timings["prepare_s"] += time.perf_counter() - t0
                if self.rank == 0:
                    yield Patch.full(name, t)

        def finish_stream() -> None:
            """Consume what is left (collective streams), stage shard snapshots, agree on failures."""
            t0 = time.perf_counter()
            for _ in stream:
                pass
            if not self._catalog and not failure:
                failure.append(PatchValidationError("<update>", f"a {kind} with no tensors (an empty or exhausted "
                                                    "stream?)", kept=kept))
            if self.sharded is not None:
                self.sharded.seeded()  # collective on every rank, even one that failed
            timings["drain_s"] = time.perf_counter() - t0
            self._agree(failure[0] if failure else None)
            agreed.append(True)

        def stage_later(publish_ok: bool) -> str | None:
            """Stage this rank's share (unless the update failed already, or a sharded source expects
            its own snapshots to back the deltas), then every rank agrees (collective). The first
            rank's failure, or None."""
            t0 = time.perf_counter()
            mine = None
            try:
                if publish_ok and not self._store_skipped:
                    self.store.prepare_many(later, full=True)
            except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
                mine = e
            later.clear()
            timings["stage_after_s"] = time.perf_counter() - t0
            try:
                self._agree(mine)
            except GatherError as e:
                return "; ".join(f"rank {r}: {m}" for r, m in sorted(e.failures.items()))
            return None

        defer = snapshots and not keep  # several ranks: each stages its share once the stream is read
        if self.rank != 0:
            for _ in full_patches():
                pass
            try:
                finish_stream()
            except GatherError:
                self._reset()
                raise
            if defer:
                stage_later(True)  # rank 0's outcome says whether it failed (for every rank alike)
            return None, None, elements[0]

        def send(sender: BucketSender) -> SendStats:
            sending.append(True)
            packed = []
            try:
                if keep:  # pack the whole seed before the engines pause: its buckets are the snapshot
                    sender.packer.keep = self.store.adopt
                    packed = sender.prepack(full_patches())
                else:
                    sender.send(full_patches())
            except Exception as e:  # noqa: BLE001 - a bad tensor found while packing (NaN, too large)
                failure.append(e)
            finish_stream()
            sender.send_packed(packed)
            return sender.close()

        sending: list[bool] = []
        outcome, error = self._publish(version, kind, timings, send, bulk=True, kept=kept)
        if not sending and self.gatherer is not None:
            # refused before its first bucket (no channel to the engines): the other ranks read the
            # stream and wait to agree on it; rank 0 takes part with this failure, so every rank
            # raises it now (not at the collective timeout, with the trainer's groups broken)
            failure.insert(0, error if error is not None else DeltaSyncError(outcome.error))
            try:
                for _ in full_patches():
                    pass
                finish_stream()
            except GatherError as e:
                error = e
        if isinstance(error, GatherError):
            self._reset()
            raise error
        if defer and agreed:
            failed = stage_later(outcome.ok)
            if failed is not None and outcome.ok:  # the engines hold v, a snapshot cannot: only a seed repairs it
                error = DeltaSyncError(f"the engines applied v{version}, but staging the trainer snapshot of it "
                                       f"failed on {failed}")
                outcome = Outcome(False, str(error), needs_seed=True)
        later.clear()
        return outcome, error, elements[0]

    # ---- publish (rank 0) ------------------------------------------------------------------------
    def _publish(self, version: int, kind: str, timings: dict, send: Callable[[BucketSender], SendStats],
                 bulk: bool = False, kept: str | None = None, early: _EarlyStart | None = None
                 ) -> tuple[Outcome, BaseException | None]:
        """Bulk: pause -> start -> send (applied as it arrives) -> finish -> resume.

        Delta: start -> send (staged and validated while the engine keeps serving: nothing is
        written before finish) -> pause -> finish (apply) -> resume. The pause window of a delta
        covers only its apply."""
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001 - the update's outcome; no engine was touched
            return Outcome(False, f"{type(e).__name__}: {e}", needs_seed=self.needs_seed), e
        t_pause = [time.perf_counter()]
        started: list[EngineClient] = early.started if early is not None else []
        finished: list[EngineClient] = []
        opened: list[bool] = []  # the engines were paused / started for this update
        sweep: dict = {}

        def open_engines() -> None:
            """Right before the first bucket leaves: a bulk update pauses here, so its pause window
            never covers what precedes its first bucket (a Megatron source's one-time plan, the
            export of the first tensors). A delta's engines may have been started already."""
            opened.append(True)
            if bulk:
                t_pause[0] = time.perf_counter()
                _each(self.engines, lambda e: e.pause(self.pause_mode))
            sweep.update(early.result() if early is not None else self._start_engines(kind, started))

        try:
            stats = self._send(version, kind, timings, send, kept, open_engines)
            one = self.engines[0] if not bulk and len(self.engines) == 1 else None
            if one is not None and callable(getattr(one, "commit", None)):
                # one engine: pause -> finish -> resume in one call (HttpEngine.commit)
                t_pause[0] = t2 = time.perf_counter()
                one.commit(version, self.pause_mode)
                finished.append(one)
                timings["finish_s"] = time.perf_counter() - t2
            else:  # every engine paused before any applies, all applied before any serves v
                if not bulk:
                    t_pause[0] = time.perf_counter()
                    _each(self.engines, lambda e: e.pause(self.pause_mode))
                t2 = time.perf_counter()
                _each(self.engines, lambda e: e.finish(version), finished)
                timings["finish_s"] = time.perf_counter() - t2
                _each(self.engines, _serve)
        except Exception as err:  # noqa: BLE001 - the sessions started end first; then it is the outcome
            if early is not None:  # a failure found before the first bucket: its starts may still run
                early.wait()
            # Engines left on different versions, or a bulk update they started writing, can only
            # be repaired by a seed; they report it themselves.
            needs_seed = kind == "seed" or 0 < len(finished) < len(self.engines) or self._engines_lost_base()
            self._end_sessions([e for e in started if e not in finished])
            if not needs_seed:  # engines are on v-1 and consistent: serve again
                try:
                    _each(self.engines, _serve)
                except Exception:  # noqa: BLE001 - best effort: an engine's pause lease resumes it
                    pass  # best effort: an engine's pause lease resumes it
            if not needs_seed:
                what = f"engines resumed on v{self.version}"
            elif opened or started:
                what = "engines stay paused until a seed"
            else:  # a seed refused before its first bucket: nothing reached the engines
                what = "engines untouched; the next update is a seed"
            log.error("delta-sync v%d failed (%s); %s", version, err, what)
            return Outcome(False, f"{type(err).__name__}: {err}", needs_seed=needs_seed), err
        report = {"tensors": stats.tensors, "changed_elements": stats.elements, "payload_bytes": stats.payload_bytes,
                  "buckets": stats.buckets, "pause_window_s": round(time.perf_counter() - t_pause[0], 6)}
        if "engine_s" in sweep:
            timings["sweep_engine_s"] = sweep["engine_s"]
        return Outcome(True, report=report, checked=sweep.get("checked", 0), drift=sweep.get("drift")), None

    def _start_engines(self, kind: str, started: list[EngineClient]) -> dict:
        """``start`` on every engine (``started`` collects each one that did); a delta's drift sweep
        rides along: the engines' digests of the window, compared here. Returns the sweep's result."""
        sweep: dict = {}
        names, want = self._sweep if (kind == "delta" and self._sweep) else (None, None)
        got: dict[int, list[dict] | None] = {}

        def start(e: EngineClient) -> None:
            got[id(e)] = e.start(names) if names else e.start()

        _each(self.engines, start, started)
        if names:
            for e in self.engines:
                reports = got[id(e)] or []
                sweep["checked"] = len(names)
                sweep["engine_s"] = max([sweep.get("engine_s", 0.0)] + [r.get("digest_s", 0.0) for r in reports])
                sweep["drift"] = sweep.get("drift") or _differs(e.name, reports, want)
        return sweep

    def _end_sessions(self, engines: list[EngineClient]) -> None:
        """End started sessions without applying the version (best effort: an engine that cannot be
        reached ends its own when the trainer's next call or its claim timeout comes)."""
        for e in engines:
            for step in (e.discard, lambda: e.finish(self.version)):
                try:
                    step()
                except Exception:  # noqa: BLE001 - best effort: a session also ends with the engine's lease
                    pass

    def _send(self, version: int, kind: str, timings: dict, send: Callable[[BucketSender], SendStats],
              kept: str | None, open_engines: Callable[[], None]):
        """Stream the buckets while each engine's ``update`` RPC receives them, concurrently. The
        engines are opened (``open_engines``) and their RPCs started when the first bucket is
        packed; an update that fails before that never touched them."""
        t1 = time.perf_counter()
        futs = []
        with ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            def first_bucket() -> None:
                open_engines()
                futs.extend(pool.submit(e.update, {"version": version}) for e in self.engines)

            sender = BucketSender(self.channel, version, kind, self.bucket_bytes, kept=kept,
                                  before_first=first_bucket)
            try:
                stats = send(sender)
            except Exception as err:
                if not futs:
                    sender.shutdown()  # nothing reached the engines
                    raise
                try:
                    sender.abort(f"sender failed: {type(err).__name__}: {err}")
                except Exception:  # noqa: BLE001 - an abort that fails drops the channel instead
                    sender.shutdown()
                    self._drop_channel()  # receivers time out and discard; the next update reconnects
                for f in futs:
                    f.exception()
                raise
            errors = [f.exception() for f in futs]
        timings["send_s"] = time.perf_counter() - t1
        timings["pack_s"] = stats.pack_s
        if kind != "delta":
            # the packer's fused pass: copy into buckets + the digests the engines check every entry
            # against (the copy packing needs anyway; the digest adds no pass of its own)
            timings["digest_pack_s"] = stats.digest_s
        timings["peak_buckets"] = stats.peak_buckets
        for err in errors:
            if err is not None:
                self._drop_channel()  # the receivers may be out of step with the stream: reconnect next time
                raise err
        return stats

    def _rollback(self) -> None:
        self.store.rollback()
        if self.sharded is not None:
            self.sharded.rollback()

    def _reset(self) -> None:
        """Forget every snapshot: the next update is a full seed."""
        self._sweep = None
        self.store.reset()
        if self.sharded is not None:
            self.sharded.reset()
        self.needs_seed = True

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
    def _sweep_window(self) -> list[str]:
        """The next names of the drift sweep: at least 1/drift_sweep of the model's bytes, walking
        the catalog round-robin, so any drift_sweep consecutive windows cover every tensor. Every
        rank computes the same window (same catalog, same cursor)."""
        names = list(self._catalog)
        budget = sum(self._catalog.values()) / self.drift_sweep
        out, acc = [], 0
        while acc < budget and len(out) < len(names):
            name = names[self._sweep_at % len(names)]
            self._sweep_at += 1
            out.append(name)
            acc += self._catalog[name]
        return out

    def _trainer_digests(self, names: list[str] | None = None) -> dict[str, str]:
        """Digest of every committed tensor (or of ``names``), summed over the owners' shares
        (collective when world > 1)."""
        only = set(names) if names is not None else None
        if self.sharded is not None and self.sharded.ready():  # shard snapshots back the deltas
            mine = {name: d.hex() for name, d in self.sharded.local_digests(only).items()}
        else:
            mine = {name: digest_tensor(snap).hex() for name, snap in self.store.snapshots()
                    if only is None or name in only}
        parts = collectives.all_gather_object(mine, self.groups.host_group) if self.world > 1 else [mine]
        sums: dict[str, Digest] = {}
        for part in parts:  # an owner's whole tensor, or shares that add up
            for k, v in part.items():
                sums[k] = sums.get(k, Digest()) + Digest.parse(v)
        return {k: d.hex() for k, d in sums.items() if only is None or k in only}

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
        want = self._trainer_digests(names)
        problem = None
        if self.rank == 0:
            try:
                for e in self.engines:
                    problem = _differs(e.name, e.report(digests=True, names=names), want)
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
        for e in self.engines:
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
        self._drop_channel()


def _each(engines: list[EngineClient], call: Callable[[EngineClient], object],
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


def _serve(e: EngineClient) -> None:
    e.reset_prefix_cache()
    e.resume()


class _EarlyStart:
    """A delta's ``start`` calls on a thread of rank 0, issued while the trainer ranks diff."""

    def __init__(self, sync: WeightSync):
        self.sync = sync
        self.started: list[EngineClient] = []
        self._sweep: dict = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delta_sync-start", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._sweep = self.sync._start_engines("delta", self.started)
        except BaseException as e:  # noqa: BLE001 - raised where the publish opens the engines
            self._error = e

    def result(self) -> dict:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._sweep

    def wait(self) -> None:
        """Every ``start`` call has returned: ``started`` is final (their errors are the caller's)."""
        self._thread.join()

    def cancel(self) -> None:
        """The delta failed before publishing: end the sessions that were started."""
        self.wait()
        self.sync._end_sessions(self.started)


class DriftDetected(DeltaSyncError):
    """Engine digests differ from the trainer snapshot."""


def _differs(engine: str, reports: list[dict], want: dict[str, str]) -> str | None:
    """What differs between an engine's workers' digest reports and the trainer's ``want``, or None."""
    got = combine_reports(reports)
    bad = [n for n in want if got.get(n) != want[n]]
    if not bad:
        return None
    what = "missing" if bad[0] not in got else "digest mismatch"
    return f"engine {engine}: {len(bad)} tensor(s) differ, first {bad[0]!r} ({what})"


def combine_reports(reports: list[dict]) -> dict[str, str]:
    """One digest per tensor from every engine worker's report: TP shards add up, replicas must agree."""
    per: dict[str, list] = {}
    for r in reports:
        for name, (h, count, numel) in (r.get("digests") or {}).items():
            per.setdefault(name, []).append((h, count, numel))
    out = {}
    for name, parts in per.items():
        numel = parts[0][2]
        if sum(c for _, c, _ in parts) == numel:
            total = Digest()
            for h, _, _ in parts:
                total = total + Digest.parse(h)
            out[name] = total.hex()
        elif all(c == numel for _, c, _ in parts) and len({h for h, _, _ in parts}) == 1:
            out[name] = parts[0][0]
        else:
            out[name] = "inconsistent"
    return out
