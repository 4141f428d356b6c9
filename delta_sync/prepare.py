"""The prepare phase of an update, on every trainer rank: read the named tensors once.

- :class:`TensorStream` turns the caller's ``(name, tensor)`` stream into checkpoint names and
  tensors (DTensors materialised, dtype checked), keeping its place in the stream and its bytes.
- :class:`DeltaDiff` diffs the tensors this rank owns against its snapshots, a batch at a time, and
  yields their patches (or takes a sharded source's own patches).
- :class:`BulkRead` reads a seed's or full update's stream for the packer, stages this rank's
  snapshot shares, and has the ranks agree that nobody failed before the last bucket leaves.

Failures of single tensors are kept until the stream has been read to its end: Bridge's export and
FSDP's ``full_tensor`` are collective, and the other ranks are still in them.
"""

from __future__ import annotations

import operator
import time
from itertools import islice
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from .errors import GatherError, PatchValidationError
from .gather import Ordered
from .patch import INT32_MAX, Patch, PatchBatch, Whole, WholeRun, check_indexable
from .snapshot import SnapshotStore
from .transfer import BucketSender, SendStats

#: A delta's owned tensors are diffed in batches of at most this many tensors or bytes: the host
#: kernel scans a batch of small tensors in a few calls instead of paying its per-call costs per
#: tensor, and each batch waits for its slowest thread (small batches cost a large diff ~15%;
#: a batch's own costs, ~0.5 ms, are paid ~2 times at 30B-A3B's ~19k tensors, not ~9).
#: A batch is read after the later tensors of it were produced, so a stream that reuses one
#: buffer for every tensor must yield copies; a stream of fresh tensors (an export) has at most
#: this many bytes of them alive, not yet diffed (and the last list read: at the stream's mean
#: tensor size so far, see ``DeltaDiff._room``).
DIFF_BATCH_TENSORS = 8192
DIFF_BATCH_BYTES = 256 << 20
#: A bulk update reads its stream a list of about this many bytes (at most this many tensors) at a
#: time, handed to the packer whole: so many more of an export's fresh tensors are alive at once.
BULK_READ_AHEAD_BYTES = 64 << 20
BULK_READ_AHEAD_TENSORS = 2048


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_DTYPE, _GRAD, _NBYTES = (operator.attrgetter(a) for a in ("dtype", "requires_grad", "nbytes"))


class Chunk(NamedTuple):
    """Consecutive items of a stream, all plain tensors checked as a whole (:meth:`TensorStream.chunks`):
    stream positions ``seq``, ``seq + 1``, ..., their checkpoint names and tensors, their bytes."""

    seq: int
    names: list[str]
    tensors: list[torch.Tensor]
    nbytes: int

    def items(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """``(seq, name, tensor)`` of each, as :meth:`TensorStream.__iter__` gives them."""
        return zip(range(self.seq, self.seq + len(self.names)), self.names, self.tensors)


def _materialize(t: torch.Tensor) -> torch.Tensor:
    """Full tensor of a DTensor (FSDP2: a collective, one tensor at a time), else the tensor."""
    if type(t) in _PLAIN:  # (a failed attribute lookup per tensor costs more than this test)
        return t
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


def expects_to_serve(source) -> bool:
    """The source's ``ShardedSource.expects_to_serve()``, False where it has none."""
    expects = getattr(source, "expects_to_serve", None)
    return bool(expects()) if callable(expects) else False


class TensorStream:
    """``(seq, checkpoint name, tensor or the exception converting it)`` of an update's stream.

    ``seen`` collects each name's bytes (a name given twice is an error), ``elements`` counts them.
    A rank whose own conversion failed keeps consuming (and materialising DTensors)."""

    def __init__(self, named_tensors: Iterable, name_map: Callable[[str], str | None], dtype: torch.dtype | None,
                 kept: str, seen: dict[str, int] | None = None):
        self.named_tensors, self.name_map, self.dtype, self.kept = named_tensors, name_map, dtype, kept
        self.seen: dict[str, int] = {} if seen is None else seen
        self.elements = 0
        self.nbytes = 0  # of the tensors in ``seen``

    def __iter__(self) -> Iterator[tuple[int, str, torch.Tensor | Exception]]:
        return self._items(enumerate(self.named_tensors))

    def mean_nbytes(self, default: int) -> int:
        """Bytes of the mean tensor read so far (``default`` before the first; at least 1): what a
        consumer sizes its next :meth:`chunks` list by."""
        return max(1, self.nbytes // len(self.seen) if self.seen else default)

    def chunks(self, room: Callable[[], int], *, detached: bool = True, sizes: dict[str, int] | None = None
               ) -> Iterator[Chunk | list[tuple[int, str, torch.Tensor | Exception]]]:
        """The stream a list at a time, each of at most ``room()`` items (asked before each list is
        read: the consumer bounds what it holds). A list of plain tensors of the wanted dtype under
        names not seen before comes as a :class:`Chunk`, checked with whole-list operations (a
        model's ~19k tensors then cost no Python step each); any other as the items of
        :meth:`__iter__` (the same results, in the same order).

        Each of these costs a read of every tensor object (~0.2-0.3 us each at ~19k tensors), so a
        consumer that needs less says so: ``detached=False``, a chunk's tensors may still require
        grad (the consumer reads them by address and detaches what it keeps); ``sizes``, each name's
        bytes where it knows them (a delta: the seed's, which the diff checks each tensor's shape and
        dtype against), counted instead of each tensor's own."""
        it, seq = iter(self.named_tensors), 0
        while True:
            pairs = list(islice(it, max(1, room())))
            if not pairs:
                return
            chunk = self._plain(pairs, seq, detached, sizes)
            yield chunk if chunk is not None else list(self._items(enumerate(pairs, seq)))
            seq += len(pairs)

    def _plain(self, pairs: list, seq: int, detached: bool = True, known: dict[str, int] | None = None
               ) -> Chunk | None:
        """``pairs`` as a :class:`Chunk` where every one is a plain tensor of the wanted dtype under a
        name mapped, new and given once (counted in ``seen`` and ``elements``); else None, nothing
        counted. ``detached``, ``known``: see :meth:`chunks`."""
        tensors = list(map(_SECOND, pairs))
        if not set(map(type, tensors)) <= _PLAIN_TYPES:
            return None
        want = self.dtype
        if want is not None and list(map(_DTYPE, tensors)).count(want) != len(tensors):
            return None
        many = getattr(self.name_map, "many", None)
        names = many(list(map(_FIRST, pairs))) if many is not None else list(map(self.name_map, map(_FIRST, pairs)))
        unique = set(names)
        if None in unique or len(unique) != len(names) or not self.seen.keys().isdisjoint(unique):
            return None
        if detached and any(map(_GRAD, tensors)):
            tensors = [t.detach() if t.requires_grad else t for t in tensors]
        if want is not None and known is not None and known.keys() >= unique:
            sizes = list(map(known.__getitem__, names))
        else:
            sizes = list(map(_NBYTES, tensors))
        self.seen.update(zip(names, sizes))
        total = sum(sizes)
        self.elements += total // want.itemsize if want is not None else sum(map(torch.Tensor.numel, tensors))
        self.nbytes += total
        return Chunk(seq, names, tensors, total)

    def _items(self, pairs: Iterable[tuple[int, tuple]]) -> Iterator[tuple[int, str, torch.Tensor | Exception]]:
        name_map, seen, want = self.name_map, self.seen, self.dtype
        for seq, (mname, tensor) in pairs:
            name = name_map(mname)
            if name is None:
                continue
            # (per tensor of a model's ~19k: a plain tensor of the wanted dtype, named once, inline)
            if type(tensor) in _PLAIN and (want is None or tensor.dtype is want) and name not in seen:
                t = tensor.detach() if tensor.requires_grad else tensor
                self.elements += t.numel()
                seen[name] = nbytes = t.nbytes
                self.nbytes += nbytes
                yield seq, name, t
                continue
            try:
                t = self._convert(name, mname, tensor)
            except Exception as e:  # noqa: BLE001 - yielded in order, raised after the stream
                yield seq, name, e
                continue
            yield seq, name, t

    def _convert(self, name: str, mname: str, tensor: torch.Tensor) -> torch.Tensor:
        t = _materialize(tensor.detach() if tensor.requires_grad else tensor)
        if self.dtype is not None and t.dtype != self.dtype:
            if t.dtype.is_floating_point != self.dtype.is_floating_point:  # a cast would invent values
                raise PatchValidationError(
                    name, f"is {t.dtype}, not a {'floating' if self.dtype.is_floating_point else 'integer'} "
                    f"tensor like the {self.dtype} weights: converting it would write other values; "
                    "pass the weight itself", kept=self.kept)
            t = t.to(self.dtype)
        if name in self.seen:
            raise PatchValidationError(name, f"given twice in one update (the second time as {mname!r})",
                                       kept=self.kept)
        n = t.numel()
        self.elements += n
        self.seen[name] = nbytes = n * t.element_size()
        self.nbytes += nbytes
        return t


class DeltaDiff:
    """This rank's patches of a delta, one diff batch at a time (bounded by ``DIFF_BATCH_*``).

    Iterating it reads the whole stream; ``timings["diff_s"]`` is the time spent here, not in the
    consumer between batches. Once the stream is read to its end it raises the first failure of
    any tensor, or a seeded tensor the stream left out."""

    def __init__(self, tensors: TensorStream, store: SnapshotStore, catalog: dict[str, int], sharded,
                 timings: dict, fast: bool):
        self.tensors, self.store, self.catalog, self.sharded, self.timings = tensors, store, catalog, sharded, timings
        #: the source diffs its own shards (the caller asked its ``ready()``, once per update)
        self.fast = fast
        self.kept = tensors.kept
        self.failure: BaseException | None = None
        # owned, not yet diffed: stream positions, checkpoint names, tensors
        self.seqs: list[int] = []
        self.names: list[str] = []
        self.news: list[torch.Tensor] = []
        self.held = 0  # bytes in the batch
        #: the kernel's batches come whole (:class:`~delta_sync.patch.PatchBatch`; with several
        #: ranks, each tensor's stream position in ``seqs``), for a packer or a gather; else one
        #: patch per tensor
        self.batched = False
        timings["diff_s"] = 0.0

    @property
    def elements(self) -> int:
        return self.sharded.total_elements if self.fast else self.tensors.elements

    def __iter__(self) -> Iterator[list[Ordered]]:
        t0 = time.perf_counter()
        if self.fast:
            out = self.sharded.local_patches()
            self.timings["diff_s"] += time.perf_counter() - t0
            yield out
            return
        catalog, alone = self.catalog, self.store.world_size == 1
        # (the diff reads the tensors by address, detaching what it keeps, and checks each one's shape
        # and dtype against its snapshot: the seed's bytes of each name are its bytes)
        for got in self.tensors.chunks(self._room, detached=False, sizes=self.catalog):
            if type(got) is Chunk and alone and self.failure is None and all(map(catalog.__contains__, got.names)):
                ready = self._add(got)  # (one rank's usual case: a list of tensors, no step per tensor)
            else:
                ready = []
                for seq, name, t in (got.items() if type(got) is Chunk else got):
                    ready += self._take(seq, name, t)
            if ready:
                self.timings["diff_s"] += time.perf_counter() - t0
                yield ready
                t0 = time.perf_counter()
        ready = self._last_batch()
        self.timings["diff_s"] += time.perf_counter() - t0
        if self.failure is not None:
            raise self.failure
        if ready:
            yield ready

    def _room(self) -> int:
        """Tensors to read next: what the batch has room for, by count and, at the stream's mean
        tensor so far, by bytes (at least one)."""
        mean = self.tensors.mean_nbytes(DIFF_BATCH_BYTES)
        return max(1, min(DIFF_BATCH_TENSORS - len(self.names), (DIFF_BATCH_BYTES - self.held) // mean))

    def _full(self) -> bool:
        return len(self.names) >= DIFF_BATCH_TENSORS or self.held >= DIFF_BATCH_BYTES

    def _add(self, chunk: Chunk) -> list[Ordered]:
        """A chunk of tensors this rank owns (all of them, in the seed) into the batch; the batch's
        patches once it is full."""
        self.seqs.extend(range(chunk.seq, chunk.seq + len(chunk.names)))
        self.names += chunk.names
        self.news += chunk.tensors
        self.held += chunk.nbytes
        return self._diff_batch() if self._full() else []

    def _take(self, seq: int, name: str, t: torch.Tensor | Exception) -> list[Ordered]:
        """Add one tensor to the batch if this rank owns it; the batch's patches once it is full."""
        if self.failure is not None:
            return []
        try:
            if isinstance(t, Exception):
                raise t
            if name not in self.catalog:
                raise PatchValidationError(name, "is not in the seed this delta builds on (a changed model "
                                           "needs a new seed)", kept=self.kept)
            nbytes = self.tensors.seen[name]  # (counted by the stream)
            if self.store.owns(name, nbytes):
                self.seqs.append(seq)
                self.names.append(name)
                self.news.append(t)
                self.held += nbytes
                if self._full():
                    return self._diff_batch()
        except Exception as e:  # noqa: BLE001 - raised once the stream is read to its end
            self.failure = e
        return []

    def _diff_batch(self) -> list[Ordered]:
        try:
            return self._diffed()
        except Exception as e:  # noqa: BLE001 - raised once the stream is read to its end
            self.failure = e
            return []

    def _diffed(self) -> list[Ordered]:
        seqs, names = self.seqs, self.names
        patches = self.store.prepare_lists(names, self.news, batched=self.batched, streamed=self.tensors.dtype or True)
        out = [Ordered(seq, p) for seq, p in zip(seqs, patches) if p is not None]
        if self.batched and self.store.world_size > 1 and any(isinstance(o.patch, PatchBatch) for o in out):
            seq_of = dict(zip(names, seqs))  # (the ranks' gather orders a batch's tensors by it)
            for o in out:
                if isinstance(o.patch, PatchBatch):
                    o.patch.seqs = [seq_of[n] for n in o.patch.names]
        self.seqs, self.names, self.news = [], [], []
        self.held = 0
        return out

    def _last_batch(self) -> list[Ordered]:
        """The stream ended: diff what is left, check nothing seeded was left out, let a sharded
        source settle (collective on every rank, even one that failed)."""
        ready: list[Ordered] = []
        if self.failure is None and self.names:
            try:
                ready = self._diff_batch()
            except Exception as e:  # noqa: BLE001 - raised once the stream is read to its end
                self.failure = e
        seen = self.tensors.seen  # (without a failure, every name seen is in the catalogue: _take checks)
        missing = [n for n in self.catalog if n not in seen] if len(seen) < len(self.catalog) else []
        if self.failure is None and missing:
            self.failure = PatchValidationError(
                missing[0], f"left out of this delta with {len(missing) - 1} other seeded tensor(s): every "
                "update must name every seeded tensor, or the engines would keep stale values", kept=self.kept)
        if self.sharded is not None:
            try:
                self.sharded.seeded()
            except Exception as e:  # noqa: BLE001 - raised by every rank alike, after the stream
                self.failure = self.failure or e
        return ready

    def checked(self, patches: list[Patch | PatchBatch]) -> list[Patch | PatchBatch]:
        """Indices and values are checked per bucket by the packer (one vectorized pass, before the
        bucket leaves); here only what a bucket check cannot see."""
        t0 = time.perf_counter()
        for p in patches:
            p.validate(contents=False, kept=self.kept)
        self.timings["validate_s"] = self.timings.get("validate_s", 0.0) + time.perf_counter() - t0
        return patches


class BulkRead:
    """A seed's or full update's stream, read once by every rank (rank 0 packs it as it comes).

    Owners stage snapshots (delta mode only: a full-mode trainer never diffs). With one rank the
    packer's buckets become its snapshot (packed before the engines pause; a sharded source that
    then serves the deltas lets them go at commit). Several ranks stage their shares once the
    stream is read (rank 0 once the engines resumed, the others while it publishes), so the pause
    window holds only the send and the apply, never a snapshot copy."""

    def __init__(self, tensors: TensorStream, kind: str, *, store: SnapshotStore, sharded, rank: int,
                 world: int, snapshots: bool, agree: Callable[[BaseException | None], None], timings: dict):
        self.tensors, self.kind, self.store, self.sharded, self.rank = tensors, kind, store, sharded, rank
        self.agree, self.timings = agree, timings
        self.keep = snapshots and world == 1  # the packed buckets are the snapshot
        self.defer = snapshots and not self.keep  # each rank stages its share once the stream is read
        self.later: list[tuple[str, torch.Tensor]] = []  # this rank's shares, staged after the stream
        self.failures: list[BaseException] = []
        self.agreed = False  # the ranks agreed that the stream was read without failure
        self.sending = False  # rank 0's packer started
        #: a sharded source that expects to serve the deltas: no rank holds or stages its exported
        #: shares (asked once the stream started: the source plans first; the same on every rank)
        self.source_snapshots: bool | None = None
        self._items = tensors.chunks(self._room)

    def _room(self) -> int:
        """Tensors to read next: ``BULK_READ_AHEAD_BYTES`` at the stream's mean tensor so far."""
        return max(1, min(BULK_READ_AHEAD_TENSORS, BULK_READ_AHEAD_BYTES // self.tensors.mean_nbytes(BULK_READ_AHEAD_BYTES)))

    def patches(self) -> Iterator[Whole | WholeRun]:
        """The stream as whole tensors to pack (rank 0); ``prepare_s``: reading it and staging snapshots."""
        clock, timings = time.perf_counter, self.timings
        timings["prepare_s"] = 0.0
        defer, rank0 = self.defer, self.rank == 0
        t0 = clock()
        for got in self._items:
            if self.source_snapshots is None:
                self.source_snapshots = defer and expects_to_serve(self.sharded)
            if type(got) is Chunk and not defer and not (rank0 and max(map(torch.Tensor.numel, got.tensors)) > INT32_MAX):
                timings["prepare_s"] += clock() - t0
                if rank0:  # (a list of plain tensors: the packer takes it whole)
                    yield WholeRun(got.names, got.tensors)
                t0 = clock()
                continue
            for _, name, t in (got.items() if type(got) is Chunk else got):
                try:
                    if isinstance(t, Exception):
                        raise t
                    if defer and not self.source_snapshots and self.store.owns(name, t.numel() * t.element_size()):
                        self.later.append((name, t))
                    if rank0 and t.numel() > INT32_MAX:
                        check_indexable(name, t.numel())
                except Exception as e:  # noqa: BLE001 - raised once the stream has drained
                    self.failures.append(e)
                    timings["prepare_s"] += clock() - t0
                    return
                timings["prepare_s"] += clock() - t0
                if rank0:
                    yield Whole(name, t)
                t0 = clock()
        if self.source_snapshots is None:
            self.source_snapshots = defer and expects_to_serve(self.sharded)
        timings["prepare_s"] += clock() - t0

    def read_all(self) -> None:
        """A rank that packs nothing reads the stream and drains it."""
        for _ in self.patches():
            pass
        self.drain()

    def drain(self) -> None:
        """Consume what is left (collective streams), let a sharded source settle, agree on failures."""
        t0 = time.perf_counter()
        for _ in self._items:
            pass
        if not self.tensors.seen and not self.failures:
            self.failures.append(PatchValidationError("<update>", f"a {self.kind} with no tensors (an empty or "
                                                      "exhausted stream?)", kept=self.tensors.kept))
        if self.sharded is not None:
            try:
                self.sharded.seeded()  # collective on every rank, even one that failed
            except Exception as e:  # noqa: BLE001 - the source refuses what it streamed (every rank alike)
                self.failures.append(e)
        self.timings["drain_s"] = time.perf_counter() - t0
        self.agree(self.failures[0] if self.failures else None)
        self.agreed = True

    def stage_later(self, publish_ok: bool) -> str | None:
        """Stage this rank's share (unless the update failed already, or the sharded source takes
        its own snapshots), then every rank agrees (collective). The ranks' failures, or None."""
        t0 = time.perf_counter()
        mine = None
        try:
            if publish_ok and not self.source_snapshots:
                self.store.prepare_many(self.later, full=True)
        except Exception as e:  # noqa: BLE001 - agreed across ranks, then raised
            mine = e
        self.later.clear()
        self.timings["stage_after_s"] = time.perf_counter() - t0
        try:
            self.agree(mine)
        except GatherError as e:
            return "; ".join(f"rank {r}: {m}" for r, m in sorted(e.failures.items()))
        return None

    def send(self, sender: BucketSender) -> SendStats:
        """Rank 0: pack and send the stream; agree with the other ranks before the last bucket."""
        self.sending = True
        packed = []
        try:
            if self.keep:  # pack the whole seed before the engines pause: its buckets are the snapshot
                sender.packer.keep = self.store.adopt
                packed = sender.prepack(self.patches())
            else:
                sender.send(self.patches())
        except Exception as e:  # noqa: BLE001 - a bad tensor found while packing (NaN, too large)
            self.failures.append(e)
        self.drain()
        sender.send_packed(packed)
        return sender.close()
