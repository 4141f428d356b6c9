"""Send and receive one update (all buckets of a version) over a :class:`Channel`.

Both ends are pipelined and bounded to two buckets in flight:

* the sender packs bucket k+1 while a sender thread broadcasts bucket k (a packed bucket waits for
  one of two slots, so a slow link never piles buckets up in memory);
* the receiver's thread receives bucket k+1 while the caller validates and applies bucket k (it
  starts receiving k+2 only once k was handed back).

A seed or full update (*bulk*) is applied bucket by bucket as it arrives (:func:`receive_stream`);
a delta is assembled whole, validated, then applied at finish (:func:`receive_update`). The
sender ends a version with a bucket carrying ``last=True``; an aborted update ends with a bucket of
kind ``abort`` whose header carries the reason: receivers discard what they staged (a bulk update
that was partly applied leaves the receiver needing a seed).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from .bucket import Arena, Bucket, BucketPacker, DEFAULT_BUCKET_BYTES, TensorAssembler, entry_patches
from .catalog import Catalog, CatalogBuilder, DenseTable, TableSlice
from .channel import Channel
from .errors import DeltaSyncError, PatchValidationError
from .patch import Patch, PatchBatch, Whole, WholeRun, first_true

log = logging.getLogger(__name__)

#: buckets alive at once on either side of a bulk update (one on the wire, one being packed/applied)
BUCKETS_IN_FLIGHT = 2
BULK_KINDS = ("seed", "full")


class UpdateAborted(DeltaSyncError):
    """The sender aborted the update it had started; receivers discard it."""


@dataclass
class SendStats:
    buckets: int = 0
    tensors: int = 0
    elements: int = 0
    payload_bytes: int = 0
    #: the packer's own work (the time its source took to yield the patches is ``source_s``)
    pack_s: float = 0.0
    #: waiting on the patches' source while packing pulled them (a delta's diff, an export)
    source_s: float = 0.0
    send_s: float = 0.0
    #: the packer's pass over dense ranges: copy into the bucket, digest, Inf/NaN check (fused)
    digest_s: float = 0.0
    #: most buckets alive at once on the sender (packed and not yet sent)
    peak_buckets: int = 0


@dataclass
class ReceivedUpdate:
    version: int
    kind: str
    patches: list[Patch] = field(default_factory=list)
    #: a delta's tables, for a receiver that asked for them (``tables=True``); else in ``patches``
    tables: list[TableSlice] = field(default_factory=list)
    buckets: int = 0
    payload_bytes: int = 0
    #: most buckets alive at once on the receiver (received and not yet handed back)
    peak_buckets: int = 0
    #: time spent checking buckets (checksums, bounds, every dense range's digest and finiteness)
    check_s: float = 0.0


class _Slots:
    """At most ``limit`` buckets alive at once, each in its own reusable :class:`Arena`: ``take``
    blocks until one is free, ``give`` returns it. Counts the peak."""

    def __init__(self, limit: int, device: torch.device | str = "cpu", arenas: list[Arena] | None = None):
        self._free: queue.Queue = queue.Queue()
        #: the arenas outlive this update (a host channel's): a delta's buckets may use them too
        self.kept = arenas is not None
        arenas = arenas if arenas is not None else []
        while len(arenas) < limit:
            arenas.append(Arena(device))
        for arena in arenas[:limit]:
            self._free.put(arena)
        self._lock = threading.Lock()
        self._taken: list[Arena] = []
        self.live = self.peak = 0

    def take(self) -> Arena:
        """A free arena. One that something outside this update still holds a view of (a delta's
        staged bucket never applied) is given new memory the first time: the holder keeps its own."""
        arena = self._free.get()
        if not any(a is arena for a in self._taken):
            self._taken.append(arena)
            if arena.in_use():
                arena.buf = None
        with self._lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        return arena

    def give(self, arena: Arena) -> None:
        with self._lock:
            self.live -= 1
        self._free.put(arena)


class BucketSender:
    """Sends the buckets of one version on a thread while the caller packs the next one.

    ``send(patches)`` may be called several times (its buckets keep their sequence numbers);
    ``close()`` ends the version, ``abort(reason)`` cancels it. Any failure of the thread is
    raised by the next call."""

    def __init__(self, channel: Channel, version: int, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum: bool = True, kept: str | None = None, before_first: Callable[[], None] | None = None):
        self.channel = channel
        self._before_first = before_first  # called once, on the caller's thread, before bucket 0 leaves
        self.packer = BucketPacker(version, kind, bucket_bytes, checksum, kept=kept, keys=channel.digest_key)
        if kind in BULK_KINDS:  # it numbers the tensors anew: the old catalogue goes now, the new one if it all went
            # (the receivers' too: whole tensors of it go by id, where every receiver reads dense tables)
            self.packer.dense = channel.catalog if getattr(channel, "dense_tables", True) else None
            channel.catalog = None
            self.packer.record = CatalogBuilder()
        else:
            self.packer.catalog = channel.catalog
        self.stats = SendStats()
        self._names: set[str] = set()
        self._slots = _Slots(BUCKETS_IN_FLIGHT, channel.device, channel.arenas())
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="delta_sync-send", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            bucket, arena = item
            try:
                if self._error is None:
                    t0 = time.perf_counter()
                    self.channel.send_bucket(bucket)
                    self.stats.send_s += time.perf_counter() - t0
            except BaseException as e:  # noqa: BLE001 - the caller raises it at its next call
                self._error = e
            finally:
                if arena is not None:  # a prepacked bucket holds no slot
                    self._slots.give(arena)

    def _put(self, bucket: Bucket, arena: Arena | None) -> None:
        self._raise()
        if self._before_first is not None:
            first, self._before_first = self._before_first, None
            first()
        self.stats.buckets += 1
        self.stats.payload_bytes += bucket.payload_bytes
        self._queue.put((bucket, arena))

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def send(self, patches: Iterable[Patch]) -> None:
        """Pack and send ``patches`` (lazily consumed) without ending the version."""
        self._pack(patches, close=False)

    def prepack(self, patches: Iterable[Patch]) -> list[Bucket]:
        """Pack every bucket of ``patches`` now and hand them back unsent, for :meth:`send_packed`.
        Only for a packer in keep mode: its buckets are memory handed over for good (a one-rank
        trainer's snapshot), so holding them all costs nothing the snapshot does not."""
        if self.packer.keep is None:
            raise ValueError("prepack holds every bucket at once: only for a packer in keep mode")
        t0 = time.perf_counter()
        try:
            return list(self.packer.pack(self._count(patches), close=False))
        finally:
            self.stats.pack_s += time.perf_counter() - t0

    def send_packed(self, buckets: list[Bucket]) -> None:
        """Send buckets :meth:`prepack` made, without ending the version."""
        for bucket in buckets:
            self._put(bucket, None)

    def _pack(self, patches: Iterable[Patch], close: bool) -> None:
        it = iter(self.packer.pack(self._count(patches), close=close))
        while True:
            arena = self._slots.take()  # room for one more bucket before packing it
            self.packer.arena = arena
            t0 = time.perf_counter()
            try:
                bucket = next(it)
            except StopIteration:
                self._slots.give(arena)
                return
            except BaseException:
                self._slots.give(arena)
                raise
            finally:
                self.stats.pack_s += time.perf_counter() - t0
            self._put(bucket, arena)

    def _count(self, patches: Iterable[Patch | PatchBatch | Whole]) -> Iterator[Patch | PatchBatch | Whole]:
        # (per tensor of a seed's ~19k: inline) the time spent getting each item is the source's: the
        # packer's clock runs meanwhile, and _finish takes this back out of pack_s
        stats, names, clock = self.stats, self._names, time.perf_counter
        t0 = clock()
        for p in patches:
            stats.source_s += clock() - t0
            stats.elements += p.count
            if isinstance(p, (PatchBatch, WholeRun)):
                names.update(p.names)
            elif p.count or p.dense:
                names.add(p.name)
            yield p
            t0 = clock()
        stats.source_s += clock() - t0

    def close(self, patches: Iterable[Patch] = ()) -> SendStats:
        """Send ``patches`` and the last bucket; wait until everything is on the wire."""
        self._pack(patches, close=True)
        return self._finish()

    def abort(self, reason: str) -> None:
        """End the version with an abort bucket (receivers discard it); waits for the wire."""
        self._queue.put((_abort_bucket(self.packer.version, reason), self._slots.take()))
        self._finish(aborted=True)

    def _finish(self, aborted: bool = False) -> SendStats:
        self._queue.put(None)
        self._thread.join()
        self._raise()
        if self.packer.record is not None and not aborted:
            self.channel.catalog = self.packer.record  # numbered when a delta first needs it
        self.stats.tensors = len(self._names)
        self.stats.pack_s = max(0.0, self.stats.pack_s - self.stats.source_s)
        self.stats.digest_s = self.packer.digest_s
        self.stats.peak_buckets = self._slots.peak
        return self.stats

    def shutdown(self) -> None:
        """Stop the thread without sending anything more (after a failure)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def send_update(channel: Channel, version: int, kind: str, patches: Iterable[Patch],
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, checksum: bool = True, check: bool = True) -> SendStats:
    """Send a whole version (every bucket, then the last); pipelined, two buckets in flight.
    ``check=False`` skips the sender's own patch checks (tests that play a buggy sender)."""
    sender = BucketSender(channel, version, kind, bucket_bytes, checksum)
    sender.packer.check = check
    try:
        return sender.close(patches)
    finally:
        sender.shutdown()


def _abort_bucket(version: int, reason: str) -> Bucket:
    header = {"version": version, "seq": -1, "last": True, "kind": "abort", "reason": reason,
              "entries": [], "index_count": 0, "value_counts": {}, "checksum": None}
    return Bucket(header, torch.empty(0, dtype=torch.int32), {})


def _prefetch(channel: Channel, slots: _Slots, streamed: bool = True,
              place: Callable[[dict], dict[int, torch.Tensor]] | None = None) -> Iterator[Bucket]:
    """Buckets of one version, each received on a thread while the previous one is in use.

    Bulk buckets of a ``streamed`` version are received into the slots' reusable arenas (their
    consumer copies the values out before asking for the next bucket), their ``seg`` entries into
    the destinations ``place(header)`` names (on this thread, so ``place`` must not race the
    consumer). A delta's buckets are assembled whole before they are applied: each one goes into a
    kept arena (a host channel's, between updates) that nothing holds a view of any more, else into
    buffers of its own. So a host receiver's delta lands in memory the last update faulted in
    already: a fresh buffer's first touch, racing the trainer's own allocations, made the first
    delta after a seed 3-5x slower than the next ones (0.33B, 2 ranks: its two broadcasts 0.15-0.19 s
    against 0.01 s)."""
    q: queue.Queue = queue.Queue()

    def arena_for(h: dict, arena: Arena) -> Arena | None:
        if h.get("kind") in BULK_KINDS:
            return arena if streamed else None
        return arena if slots.kept and arena.in_use() is False else None

    def run():
        try:
            while True:
                arena = slots.take()
                b = channel.recv_bucket(lambda h: arena_for(h, arena),
                                        lambda h: place(h) if streamed and place is not None
                                        and h.get("kind") in BULK_KINDS else {})
                q.put((b, arena))
                if b.header.get("last") or b.header.get("kind") == "abort":
                    return
        except BaseException as e:  # noqa: BLE001 - raised in the consumer
            q.put(e)

    th = threading.Thread(target=run, name="delta_sync-recv", daemon=True)
    th.start()  # a consumer that stops early leaves it in recv: that channel is dropped then
    while True:
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        bucket, arena = item
        yield bucket
        slots.give(arena)  # the consumer is done with it
        if bucket.header.get("last") or bucket.header.get("kind") == "abort":
            return


def receive_stream(channel: Channel, kept: str | None = None, check_bulk: bool = True, streamed: bool = True,
                   place: Callable[[dict], dict[int, torch.Tensor]] | None = None, dense: bool = False
                   ) -> Iterator[tuple[dict, list[tuple[dict, Patch]]]]:
    """``(header, [(entry, patch), ...])`` per bucket of one version, checked (checksum, per-entry
    digests, bounds, tiling) before it is yielded; the next bucket is received meanwhile. Without
    ``check_bulk`` the dense entries of seed/full buckets are yielded with their digests unchecked
    (the consumer checks them, see :func:`receive_update`). Without ``streamed``, bulk buckets get
    buffers of their own, as delta buckets do (the consumer keeps them all). ``place``: see
    :meth:`Channel.recv_bucket` (streamed bulk buckets only). ``dense``: a bulk bucket's dense table
    (:class:`~delta_sync.catalog.DenseTable`) is handed over as it is, in ``header["_dense"]``; without
    it, its tensors come as entries after the bucket's others.

    A bad bucket raises after the rest of the version was drained, so the channel stays in step
    with the sender. Raises :class:`UpdateAborted` for an aborted update."""
    slots = _Slots(BUCKETS_IN_FLIGHT, channel.device, channel.arenas())
    first_error: Exception | None = None
    version = None
    expect_seq = 0
    catalog = record = once = None
    stream = _prefetch(channel, slots, streamed, place)
    try:
        for bucket in stream:
            h = bucket.header
            if h["kind"] == "abort":
                channel.received_abort = h["version"]  # (the stream ended in step with the sender)
                raise UpdateAborted(f"sender aborted version {h['version']}: {h.get('reason')}", kept=kept)
            if version is None:
                version = h["version"]
                catalog = getattr(channel, "catalog", None)  # a bulk update's dense tables name the one before
                if h["kind"] in BULK_KINDS:  # it numbers the tensors anew (see delta_sync.catalog)
                    channel.catalog, record, once = None, CatalogBuilder(), _BulkOnce(catalog)
            if first_error is None:
                try:
                    if h["seq"] != expect_seq or h["version"] != version:
                        raise DeltaSyncError(f"bucket out of order: got v{h['version']} seq {h['seq']}, "
                                             f"expected v{version} seq {expect_seq}", kept=kept)
                    t0 = time.perf_counter()
                    entries = entry_patches(bucket, kept, check_dense=check_bulk or h["kind"] not in BULK_KINDS,
                                            catalog=catalog)
                    if once is not None:
                        once.see(h["entries"], bucket.dense, kept)
                    if bucket.dense is not None and not dense:
                        entries += bucket.dense.patches()
                    h["_check_s"] = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - keep draining so the channel stays in step
                    first_error = e
                else:
                    if record is not None:
                        record.see_entries(h["entries"], bucket.dense)
                    h["_table"] = bucket.table
                    h["_dense"] = bucket.dense if dense else None
                    h["_payload_bytes"] = bucket.payload_bytes
                    h["_peak_buckets"] = slots.peak
                    yield h, entries
            expect_seq += 1
    finally:
        stream.close()
    channel.received_whole = version  # (the loop ends at the version's last bucket: an abort raises)
    if first_error is not None:
        raise first_error
    if record is not None:
        channel.catalog = record  # numbered when a delta first needs it


class _BulkOnce:
    """Each tensor of a bulk update once: its dense tables' ids increase across its buckets, and no
    tensor is both in a dense table and among the JSON entries (``catalog``: the one the tables
    name; the entries of tensors it lacks cannot be in a table)."""

    def __init__(self, catalog: Catalog | None):
        self.catalog, self.last = catalog, -1  # the last id of the dense tables so far
        self.named: set[int] = set()  # catalogued tensors among the JSON entries so far
        self.tabled: set[int] = set()  # those in the dense tables so far

    def see(self, entries: list[dict], dense: DenseTable | None, kept: str | None) -> None:
        if self.catalog is None:
            return
        ids = self.catalog.ids
        named = {ids[e["name"]] for e in entries if e.get("name") in ids}
        tabled = set(dense.ids.tolist()) if dense is not None else set()
        if dense is not None and int(dense.ids[0]) <= self.last:
            self._twice(int(dense.ids[0]), f"{dense.where}: in a dense table after another one", kept)
        both = sorted(((self.named | named) & tabled) | (named & self.tabled))
        if both:
            self._twice(both[0], "in a dense table and as an entry of its own", kept)
        if dense is not None:
            self.last = int(dense.ids[-1])
        self.named |= named
        self.tabled |= tabled

    def _twice(self, i: int, how: str, kept: str | None) -> None:
        raise PatchValidationError(self.catalog.names[i], f"sent twice in one update ({how})", kept=kept)


def acknowledge(channel: Channel, error: BaseException | None) -> BaseException | None:
    """The end of a delta received in the background (an engine worker's, a memory receiver's):
    where the channel acknowledges (:attr:`Channel.acknowledges`) and the version's stream ended
    whole (its last bucket came, whatever the checks then found), every rank learns whether it was
    staged (a collective with the sender, which waits for it before its commit). After an abort or
    a broken channel there is nothing to acknowledge: the sender sends none either. A receive that
    failed before the version's last bucket (a bucket refused unread, a header whose MAC does not
    hold) leaves this end out of step with a sender that goes on sending and then waits for the
    acknowledgement: the channel is closed, so the sender's next collective fails at once instead of
    after the channel's timeout (the next update joins a new channel). Returns the receive's error;
    a failed acknowledgement is one where it had none."""
    if not channel.acknowledges:
        return error
    if channel.received_whole is None:
        if error is not None and channel.received_abort is None and channel.pg is not None:
            log.warning("delta-sync channel rank %d: a delta's receive failed before its last bucket (%s: %s); "
                        "closing the channel so that the sender fails at once", channel.rank,
                        type(error).__name__, error)
            channel.close()
        return error
    channel.received_whole = None
    try:
        channel.acknowledge(error is not None)
    except Exception as e:  # noqa: BLE001 - the receive's error, raised where the sender waits for it
        return error or e
    return error


def receive_update(channel: Channel, kept: str | None = None,
                   bulk_sink: Callable[[list[tuple[dict, Patch]]], None] | None = None,
                   sink_checks: bool = False,
                   dense_sink: Callable[[DenseTable], None] | None = None,
                   place: Callable[[dict], dict[int, torch.Tensor]] | None = None,
                   tables: bool = False, stage: torch.device | None = None,
                   stage_table: Callable[[TableSlice], TableSlice] | None = None) -> ReceivedUpdate:
    """Receive one version.

    A delta (or any version without ``bulk_sink``) is assembled into one patch per tensor: the
    transactional path, nothing is applied here. A seed or full update with ``bulk_sink`` hands
    each bucket's checked entries to ``bulk_sink([(entry, patch), ...])`` as it arrives (the next
    bucket is received meanwhile) and returns no patches; if the sink raises, the rest of the version is
    drained unapplied and the sink's error is raised at the end. With ``sink_checks`` the sink gets
    dense entries unchecked and must run :func:`~delta_sync.bucket.check_dense_entry` on each, e.g.
    over the digest of the pass that applies it (the engine's case: a failed bulk update needs a
    seed anyway, so checking after the write loses nothing and saves a pass over the bytes).

    ``dense_sink`` (with ``bulk_sink``): takes each bulk bucket's dense table
    (:class:`~delta_sync.catalog.DenseTable`) after ``bulk_sink`` took its entries, to write its whole
    tensors by id (with ``sink_checks`` it checks their digests too,
    :func:`~delta_sync.bucket.check_dense_table`); without it they come as entries.

    ``place(header)`` (with ``bulk_sink``): where the bulk bucket's ``seg`` entries are received,
    by entry position, e.g. the parameter slices they belong in. Their patches then hold those
    tensors, already written: the sink only checks them. Such a receiver is written by a bulk
    update from its first bucket on (and drained buckets still land), so it needs a seed after any
    failure, as a sink that writes does.

    ``tables``: a delta's tables (:mod:`delta_sync.catalog`) are handed over as they are, in
    ``tables`` (checked to name no tensor twice), not as patches: for a receiver that routes them by
    id.

    ``stage``: where a delta's buckets are kept once checked (e.g. the host, for a receiver on a
    device: the device then holds the two buckets in flight, not the whole delta); ``stage_table``:
    how a checked table is staged there instead of :meth:`TableSlice.staged` (e.g. with what the
    receiver works out from it on the device first, :func:`patches.loader_views.stage_routed`)."""
    asm = TensorAssembler(kept)
    update: ReceivedUpdate | None = None
    sink_error: Exception | None = None
    # without a sink a seed is assembled whole like a delta: its buckets must not share arenas
    for h, entries in receive_stream(channel, kept, check_bulk=not (sink_checks and bulk_sink is not None),
                                     streamed=bulk_sink is not None, place=place if bulk_sink else None,
                                     dense=bulk_sink is not None and dense_sink is not None):
        if update is None:
            update = ReceivedUpdate(int(h["version"]), h["kind"])
        elif h["kind"] != update.kind and sink_error is None:  # drained below, raised at the end
            sink_error = DeltaSyncError(f"bucket {h['seq']} of v{update.version} is a {h['kind']!r} bucket "
                                        f"in a {update.kind!r} update", kept=kept)
        update.buckets += 1
        update.payload_bytes += h["_payload_bytes"]
        update.check_s += h["_check_s"]
        update.peak_buckets = max(update.peak_buckets, h["_peak_buckets"])
        if bulk_sink is not None and update.kind in BULK_KINDS:
            if sink_error is None:
                try:
                    bulk_sink(entries)
                    if h["_dense"] is not None:
                        dense_sink(h["_dense"])
                except Exception as err:  # noqa: BLE001 - keep draining: the channel stays in step with the sender
                    sink_error = err
        elif sink_error is None:
            try:
                _keep(update, asm, h["_table"], entries, tables, stage, kept, stage_table)
            except Exception as err:  # noqa: BLE001 - keep draining: the channel stays in step with the sender
                sink_error = err
    if update is None:
        raise DeltaSyncError("the update ended before its first bucket", kept=kept)
    if sink_error is not None:
        raise sink_error
    update.patches = asm.patches()
    if update.tables and update.patches:
        _apart(update.tables, update.patches, kept)
    return update


def _keep(update: ReceivedUpdate, asm: TensorAssembler, table: TableSlice | None, entries: list, tables: bool,
          stage: torch.device | None, kept: str | None,
          stage_table: Callable[[TableSlice], TableSlice] | None = None) -> None:
    """A checked bucket of a version assembled whole: its table kept as it is (``tables``) or as
    patches, its JSON entries as patches; in ``stage`` memory where one is given."""
    if table is not None and tables:
        _follows(update.tables, table, kept)
        update.tables.append(table if stage is None else
                             stage_table(table) if stage_table is not None else table.staged(stage))
    elif table is not None:
        asm.add_entries(table.patches())
    asm.add_entries(entries if stage is None else [(e, p.to(stage)) for e, p in entries])


def _follows(before: list[TableSlice], table: TableSlice, kept: str | None) -> None:
    """A bucket's table after the version's others: its ids go on from theirs, a tensor continued
    from the bucket before only at higher indices (each tensor's entries stay in order, once)."""
    if not before:
        return
    last = before[-1]
    a, b = int(last.ids[-1]), int(table.ids[0])
    if b < a or (b == a and int(last.indices[-1]) >= int(table.indices[0])):
        raise DeltaSyncError(f"{table.where}: its table goes back to tensor {b} "
                             f"({table.catalog.names[b]}) after tensor {a}: a tensor twice or out of order", kept=kept)


def _apart(tables: list[TableSlice], patches: list[Patch], kept: str | None) -> None:
    """No tensor both in a table and among the JSON entries."""
    catalog = tables[0].catalog
    ids = sorted({catalog.ids.get(p.name) for p in patches} - {None})
    if not ids:
        return
    both = torch.isin(torch.tensor(ids), torch.cat([t.ids for t in tables]))
    if bool(both.any()):
        name = catalog.names[ids[first_true(both)]]
        raise PatchValidationError(name, "sent twice in one update (in a bucket's table and as an entry of its own)",
                                   kept=kept)
