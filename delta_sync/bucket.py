"""Packed bucket wire format.

A bucket is a small JSON header plus one ``int32`` index buffer and one value buffer per dtype::

    header = {version, seq, last, kind, entries: [{name, dtype, shape, encoding, count, start,
              index_offset, value_offset}], index_count, value_counts: {dtype: n}, checksum,
              table | dense}

``encoding`` is ``sparse`` (``count`` indices + values) or ``dense`` (``count`` values for flat
elements ``start .. start+count-1``). A tensor larger than the room left in a bucket is split
into several entries, across buckets, by index range; the receiver concatenates them (a delta)
or applies each range as it arrives (a seed or full update). Entries tile the buffers exactly,
up to a table's elements at their ends: a delta's ``table`` or a bulk bucket's ``dense`` table
names catalogued tensors by id instead of an entry each (:mod:`delta_sync.catalog`).

Integrity: a dense entry carries ``digest``, the :mod:`delta_sync.digest` of its values at their
flat positions, computed by the packer in the same pass that checks them for Inf/NaN. The
receiver recomputes it over what arrived (again fused with its finiteness check), so every bulk
byte is checked in flight: a seed is verified end to end without a pass of its own. Buckets with
sparse entries also carry ``checksum`` over every payload byte (indices included). Over a channel
both are keyed: the header carries a fresh ``nonce``, the digest key is derived from it and the
channel key (:meth:`delta_sync.digest.DigestKey.derive`), and each digest in the header is masked
with that key's pad for its place, so bytes changed in flight are caught even by a party that
can compute the public digest, and the header's MAC keeps the nonce and digests as sent. Buckets are bounded by ``bucket_bytes``
(default 512 MiB) of payload, so a 30B seed streams through fixed memory.

Zero copy: a dense entry of at least :data:`DIRECT_MIN_BYTES` whose source is contiguous on the
wire's device is marked ``seg`` and travels in a broadcast of its own, straight from the source
tensor (the packer only digests it; a one-rank seed sends it from the copy its snapshot keeps); the
other entries of a value buffer travel as packed runs. A receiver may name where a ``seg`` entry
lands (an engine: the parameter slice it belongs in), so neither side copies a large tensor through
a bucket (:func:`value_segments`).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

import torch

from . import native
from .accelerator import ReadBack, read_back
from .catalog import CODES, Catalog, CatalogBuilder, DenseTable, TableSlice, check_after, encode_dense, encode_table
from .digest import (MAX_WORDS, PUBLIC, Digest, DigestKey, checksum_later, digest_texts, nonfinite_count,
                     nonfinite_on_device, parse_texts, range_row, row_spec, rows_supported, scan_many, scan_rows_table)
from .errors import ChecksumMismatch, PatchValidationError
from .patch import DTYPE_NAMES, DTYPES, Patch, PatchBatch, Whole, WholeRun, dtype_name, first_true

_ON_HOST = operator.attrgetter("is_cpu")
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")
#: per dtype a bucket carries: its name and its bytes per element
_WIRE_DTYPES = {dt: (name, torch.empty(0, dtype=dt).element_size()) for dt, name in DTYPE_NAMES.items()}

DEFAULT_BUCKET_BYTES = 512 << 20
#: the smallest bucket (bytes of payload): room for an element of any dtype and its index
MIN_BUCKET_BYTES = 64
#: smallest dense entry that travels in a broadcast of its own instead of being packed (bytes):
#: about where a broadcast's fixed cost and the copy that packing saves break even
DIRECT_MIN_BYTES = 1 << 20


@dataclass
class Bucket:
    header: dict
    indices: torch.Tensor  # int32
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # dtype name -> 1-D values
    #: entry position -> the tensor that holds that ``seg`` entry's values instead of its slice of
    #: ``values`` (the sender's source; the receiver's direct destination)
    sources: dict[int, torch.Tensor] = field(default_factory=dict)
    #: the key its digests and checksum are computed under (a channel's buckets: one per nonce)
    key: DigestKey = PUBLIC
    #: its table (:mod:`delta_sync.catalog`), once :func:`entry_patches` parsed and checked it
    table: TableSlice | None = None
    #: a bulk bucket's dense table of whole catalogued tensors, once packed or parsed
    dense: DenseTable | None = None

    def wire_parts(self, dname: str) -> list[torch.Tensor]:
        """What travels for the ``dname`` value buffer, in order: the whole buffer, or its packed
        runs and ``seg`` entries one broadcast each (see :func:`value_segments`)."""
        buf = self.values[dname]
        segs = value_segments(self.header["entries"], dname, buf.numel())
        if all(i is None for i, _, _ in segs):
            return [buf]
        return [self.sources[i] if i is not None and i in self.sources else buf.narrow(0, off, n)
                for i, off, n in segs]

    @property
    def payload_bytes(self) -> int:
        return self.indices.numel() * 4 + sum(v.numel() * v.element_size() for v in self.values.values())

    def payload_checksum(self, reads: ReadBack | None = None) -> Callable[[], str]:
        """The checksum of the payload's bytes: call what this returns (once ``reads`` ran, where
        given: its device sums are read with the bucket's other checks)."""
        parts = [self.indices.reshape(-1).view(torch.uint8)]
        parts += [t.reshape(-1).view(torch.uint8) for k in sorted(self.values) for t in self.wire_parts(k)]
        return checksum_later(*parts, key=self.key, reads=reads)

    def header_bytes(self) -> bytes:
        return json.dumps(self.header, separators=(",", ":")).encode()


class Arena:
    """A reusable byte buffer that one bucket's index and value buffers are carved from.

    Two arenas alternate on each side of a bulk update, so a seed allocates (and page-faults) two
    buckets' worth of memory, not the model's."""

    ALIGN = 64

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.buf: torch.Tensor | None = None

    def in_use(self) -> bool | None:
        """Does anything still hold a view of what was carved last (a delta's staged bucket)? None
        where torch cannot tell (its storage use count is a private call): then no delta is
        received into an arena, and bulk updates reuse them as they always did."""
        if self.buf is None:
            return False
        try:
            # the buffer itself and the storage object made for this call; each live view adds one
            return torch._C._storage_Use_Count(self.buf.untyped_storage()._cdata) > 2
        except (AttributeError, RuntimeError):
            return None

    def carve(self, wants: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
        """One 1-D tensor of ``n`` elements of ``dtype`` per ``(dtype, n)``, aligned, from this arena."""
        offsets, total = [], 0
        for dtype, n in wants:
            offsets.append(total)
            nbytes = n * torch.empty(0, dtype=dtype).element_size()
            total += -(-nbytes // self.ALIGN) * self.ALIGN
        if self.buf is None or self.buf.numel() < total:
            self.buf = None  # free the old one first
            self.buf = torch.empty(max(total, self.ALIGN), dtype=torch.uint8, device=self.device)
        out = []
        for (dtype, n), off in zip(wants, offsets):
            esize = torch.empty(0, dtype=dtype).element_size()
            out.append(self.buf[off:off + n * esize].view(dtype))
        return out


class BucketPacker:
    """Packs patches (in export order) into bounded buckets for one version.

    Dense values are digested and checked for Inf/NaN as they are packed (one pass, see
    :func:`delta_sync.digest.scan_range`); :attr:`digest_s` is the time that took."""

    def __init__(self, version: int, kind: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum: bool = True, kept: str | None = None, check: bool = True,
                 keys: Callable[[str], DigestKey] | None = None):
        if bucket_bytes < MIN_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes {bucket_bytes} is below the smallest bucket, {MIN_BUCKET_BYTES}")
        self.version, self.kind, self.bucket_bytes, self.checksum = version, kind, bucket_bytes, checksum
        self.kept = kept
        self.check = check  # False only to play a buggy sender in tests: receivers check regardless
        #: the digest key of a bucket from its nonce (a channel's :meth:`~delta_sync.channel.Channel.
        #: digest_key`); None: the public key, no nonce (buckets that never cross a channel)
        self.keys = keys
        self.seq = 0
        self.digest_s = 0.0
        #: where the next bucket's buffers are carved (None: fresh allocations)
        self.arena: Arena | None = None
        #: set: every whole dense tensor is packed into fresh bucket memory and handed to ``keep(name,
        #: view)`` once packed (a one-rank trainer's seed: its buckets become its snapshot, one copy
        #: instead of two). Tensors are then never split across buckets, except those larger than a
        #: bucket: each gets memory of its own, sent in bucket-sized pieces.
        self.keep: Callable[[str, torch.Tensor], None] | None = None
        #: dense ranges of at least this many bytes travel from their source (None: always packed)
        self.direct_min_bytes: int | None = DIRECT_MIN_BYTES
        #: a delta's: sparse entries of the tensors it holds go in each bucket's table, by id
        #: (:mod:`delta_sync.catalog`); None: every entry in JSON
        self.catalog: Catalog | None = None
        #: a bulk update's: the catalogue its buckets define, built as they are packed
        self.record: CatalogBuilder | None = None
        #: a bulk update's: the catalogue of the one before it (both ends have it): whole tensors it
        #: holds with their shape and dtype go in each bucket's dense table, by id
        self.dense: Catalog | None = None
        self._table_last = -1  # the last table id of this version (ids increase across its buckets)

    def _direct(self, p: Patch, take: int, device: torch.device) -> bool:
        """Does this dense range travel in a broadcast of its own (``seg``), from its source or,
        in keep mode, from the snapshot's copy of it?"""
        return (self.direct_min_bytes is not None and take * p.values.element_size() >= self.direct_min_bytes
                and (self.keep is not None or (p.values.device == device and p.values.is_contiguous())))

    def _scan_dense(self, ranges: list[tuple[int, dict, Patch, int, int, torch.Tensor | None, int]],
                    key: DigestKey, table: tuple[torch.Tensor, DenseTable, list] | None = None) -> None:
        """Per ``(position, entry, patch, done, take, buffer, at)``: copy the patch's values ``[done,
        done+take)`` into ``buffer[at:at+take]`` (``buffer`` None: only read them) while digesting them
        under ``key`` and checking them for Inf/NaN (one pass over the source, all of a bucket's
        ranges spread over the threads together); the digest, masked with the key's pad for the
        entry's position, goes into the entry. Raises for the first range, in order, that holds
        Inf/NaN. Host ranges go to the kernel as rows of addresses (:func:`range_row`): a seed of
        30B-A3B's ~19k tensors would otherwise pay a slice and a view or two per range. ``table``:
        a dense table's tensors as kernel rows made already, ``(rows, the table, its parts)``: scanned
        with the others, their masked digests set as the table's."""
        t0 = time.perf_counter()
        items, rows, slots = [], [], []  # slots: per range, (True, row) or (False, item) position
        as_rows = rows_supported()
        for _, _, p, done, take, buf, at in ranges:
            v = p.values
            if as_rows and v.is_cpu and (buf is None or buf.is_cpu) and v.is_contiguous():
                spec = row_spec(v.dtype)
                size = spec[0]
                slots.append((True, len(rows)))
                rows.append(range_row(v.data_ptr() + done * size, take, done, spec,
                                      0 if buf is None else buf.data_ptr() + at * size))
                continue
            src, out = v[done:done + take], None if buf is None else buf.narrow(0, at, take)
            slots.append((False, len(items)))
            if out is not None and src.device != out.device:  # the wire's device differs: move, then scan
                out.copy_(src)
                items.append((out, done, None))
            else:
                items.append((src, done, out))
        extra, dense, parts = table if table is not None else (None, None, [])
        # the rows' digests (the table's after the others), masked and written as text together
        sums = scan_rows_table(rows if extra is None else torch.cat([torch.tensor(rows, dtype=torch.int64).view(-1, 6),
                                                                    extra]), key=key)
        texts = digest_texts(key.masked_table(sums[:len(rows)], [r[0] for r, (row, _) in zip(ranges, slots) if row]))
        if extra is not None:  # (a dense table's positions follow each other: its pads are one slice)
            dense.digests = key.masked_table(sums[len(rows):], range(dense.first, dense.first + len(parts)))
        bads = sums[:, -1].tolist()
        from_items = scan_many(items, key=key)
        self.digest_s += time.perf_counter() - t0
        for (i, entry, p, done, take, _, _), (row, k) in zip(ranges, slots):
            if bads[k] if row else from_items[k][1]:
                where = done + first_true(~torch.isfinite(p.values[done:done + take]))
                raise PatchValidationError(p.name, f"non-finite value at flat index {where}", index=where,
                                           kept=self.kept)
            entry["digest"] = texts[k] if row else key.masked(from_items[k][0], i)
        bad = next((k for k, b in enumerate(bads[len(rows):]) if b), None)
        if bad is not None:
            p = parts[bad][1]
            where = first_true(~torch.isfinite(p.values))
            raise PatchValidationError(p.name, f"non-finite value at flat index {where}", index=where, kept=self.kept)

    def pack(self, patches: Iterable[Patch | PatchBatch | Whole | WholeRun], close: bool = True,
             fill: "_Filling | None" = None) -> Iterator[Bucket]:
        """Yield buckets; with ``close`` the last one has ``header['last'] = True`` (possibly with no
        entries); without it the caller packs the rest later (another ``pack`` that closes).
        ``fill``: the bucket being filled, where a caller packs into one it holds (its last bucket
        then stays open to it).

        A bucket's parts are only noted while it fills; at flush they are written into its buffers
        (carved from :attr:`arena` when set), dense ranges digested in the same pass."""
        own = fill is None
        fill = _Filling() if own else fill
        room = self.bucket_bytes
        dense = self.dense
        ids, shapes, dtypes = (dense.ids, dense.shapes, dense.dtypes) if dense is not None else ({}, [], [])
        alone = self.direct_min_bytes if self.direct_min_bytes is not None else 1 << 62
        for p in patches:
            if type(p) is WholeRun:
                yield from self._pack_run(fill, p)
                continue
            whole = type(p) is Whole
            if whole or (type(p) is Patch and p.indices is None):  # (a seed's ~19k tensors at 30B-A3B: inline)
                t = p.tensor if whole else p.values
                kind = _WIRE_DTYPES.get(t.dtype)
                n = t.numel()
                if n and kind is not None and fill.nbytes + n * kind[1] <= room:
                    dname, per = kind
                    tid = ids.get(p.name)  # whole, into the bucket being filled: by id where catalogued
                    if (tid is not None and tid > self._table_last and n * per < alone
                            and shapes[tid] == (t.shape if whole else p.shape) and dtypes[tid] == dname):
                        fill.add_dense(p, tid, dname, per, n)
                        self._table_last = tid
                    else:
                        fill.add(p.patch() if whole else p, dname, per, 0, n)
                    continue
                if whole:
                    p = p.patch()
            if isinstance(p, PatchBatch):
                yield from self._pack_batch(fill, p)
            else:
                yield from self._pack_one(fill, p)
        if own and (close or not fill.empty):
            yield self._flush(fill, close)

    def _pack_run(self, fill: "_Filling", run: WholeRun) -> Iterator[Bucket]:
        """A run of whole tensors into ``fill``: those the catalogue of the last bulk update holds (in its
        order, shape and dtype, each below ``direct_min_bytes``) that fit whole go in its dense
        table a bucket's share at a time (a few list operations, no step per tensor), each one that
        does not fit through :meth:`pack`'s own path (it splits it over buckets, by name); anything
        else in the run goes tensor by tensor that way."""
        names, tensors = run
        dense, kind = self.dense, _WIRE_DTYPES.get(tensors[0].dtype) if tensors else None
        ids = numels = None
        if dense is not None and kind is not None and list(map(_DTYPE, tensors)).count(tensors[0].dtype) == len(tensors):
            dname, per = kind
            ids = dense.run_ids(names, list(map(_SHAPE, tensors)), dname)
            numels = list(map(torch.Tensor.numel, tensors))
            alone = self.direct_min_bytes if self.direct_min_bytes is not None else 1 << 62
            if ids is not None and (ids[0] <= self._table_last or max(numels) * per >= alone or 0 in numels):
                ids = None
        if ids is None:  # (a first seed, a tensor new or reshaped, mixed dtypes: as single tensors)
            yield from self.pack(run.wholes(), close=False, fill=fill)
            return
        ends = list(itertools.accumulate(numels, initial=0))
        k, n = 0, len(names)
        while k < n:
            room = (self.bucket_bytes - fill.nbytes) // per
            j = bisect.bisect_right(ends, ends[k] + room, lo=k + 1) - 1  # tensors k..j-1 fit whole
            if j > k:
                fill.add_dense_run(list(map(Whole, names[k:j], tensors[k:j])), ids[k:j], numels[k:j], dname, per)
                self._table_last = ids[j - 1]
                k = j
            if k < n:  # tensor k does not fit in this bucket's room: split over buckets, as any would be
                yield from self.pack([Whole(names[k], tensors[k])], close=False, fill=fill)
                k += 1

    def _pack_one(self, fill: "_Filling", p: Patch, tid: int | None = None) -> Iterator[Bucket]:
        """``p`` into ``fill``, flushing it as it fills up; ``tid``: its table id, known already."""
        dname = dtype_name(p.dtype, tensor=p.name)
        esize = p.values.element_size()
        per = esize if p.dense else esize + 4  # bytes per element on the wire
        total = p.count
        if total == 0 and not p.dense:
            return  # nothing changed: no entry at all
        if tid is None:
            tid = self._table_id(p, dname)
        if self.keep is not None and p.dense:
            if total * per > self.bucket_bytes:  # its own memory, sent in bucket-sized pieces
                yield from self._pack_own(fill, p, dname, per)
                return
            if not fill.empty and fill.nbytes + total * per > self.bucket_bytes:
                yield self._flush(fill, False)  # whole tensors only: each one stays a view of its bucket
        done = 0
        while True:
            room = (self.bucket_bytes - fill.nbytes) // per
            if room <= 0 and done < total:
                yield self._flush(fill, False)
                continue
            take = min(room, total - done)
            if tid is None:
                fill.add(p, dname, per, done, take)
            else:
                fill.add_table(p, tid, dname, per, done, take)
            done += take
            if done >= total:
                break

    def _pack_batch(self, fill: "_Filling", b: PatchBatch) -> Iterator[Bucket]:
        """A batch's tensors into ``fill``'s tables by ranges: each run of catalogued tensors (in
        the catalogue's order) goes in with a few list operations per bucket, not per tensor; a
        tensor the catalogue lacks, or out of its order, goes as a JSON entry of its own."""
        dname = dtype_name(b.dtype, tensor=b.names[0])
        per = b.values.element_size() + 4
        ids, every = self._table_ids(b, dname)
        counts = b.counts
        bounds = list(itertools.accumulate(counts, initial=0))  # tensor k: elements bounds[k] .. bounds[k + 1]
        k, n = 0, len(counts)
        while k < n:
            if ids[k] is None:
                p = Patch(b.names[k], b.shapes[k], b.dtype, b.indices.narrow(0, bounds[k], counts[k]),
                          b.values.narrow(0, bounds[k], counts[k]))
                yield from self._pack_one(fill, p, None)
                k += 1
                continue
            j = n if every else k + 1
            while j < n and ids[j] is not None:
                j += 1
            # tensors k..j-1 fill buckets from element ``pos`` on; ``ends[m]``: where tensor k+m ends
            ends = bounds[k + 1:j + 1]
            pos, m = bounds[k], 0
            while m < j - k:
                room = (self.bucket_bytes - fill.nbytes) // per
                if room <= 0:
                    yield self._flush(fill, False)
                    continue
                whole = bisect.bisect_right(ends, pos + room, lo=m)  # tensors that end within the room
                if whole > m:
                    run_counts = [ends[m] - pos] + counts[k + m + 1:k + whole]
                    fill.add_table_run(b, ids[k + m:k + whole], run_counts, dname, per, pos, ends[whole - 1] - pos)
                    pos, m = ends[whole - 1], whole
                elif room:  # the next tensor fills the bucket: its first elements here, the rest in the next
                    fill.add_table_run(b, [ids[k + m]], [room], dname, per, pos, room)
                    pos += room
            k = j

    def _table_ids(self, b: PatchBatch, dname: str) -> tuple[list[int | None], bool]:
        """:meth:`_table_id` of each tensor of ``b``, and whether every one has one: as whole lists
        where every tensor is catalogued with its shape and dtype, in increasing ids after the last
        (a delta's usual batch: no Python step per tensor of a model's ~19k), else tensor by tensor."""
        out: list[int | None] = [None] * len(b.names)
        if self.catalog is None:
            return out, False
        cat, last = self.catalog, self._table_last
        ids = cat.run_ids(b.names, b.shapes, dname)
        if ids is not None and ids[0] > last:
            self._table_last = ids[-1]
            return ids, True
        for k, (name, shape) in enumerate(zip(b.names, b.shapes)):
            tid = cat.id_of(name, shape, dname)
            if tid is not None and tid > last:
                out[k] = last = tid
        self._table_last = last
        return out, False

    def _table_id(self, p: Patch, dname: str) -> int | None:
        """``p``'s id when its entries go in the table: a sparse patch of a catalogued tensor, after
        every table entry so far (a stream out of the catalogue's order keeps the rest in JSON)."""
        if self.catalog is None or p.dense:
            return None
        tid = self.catalog.id_of(p.name, tuple(p.shape), dname)
        if tid is None or tid <= self._table_last:
            return None
        self._table_last = tid
        return tid

    def _pack_own(self, fill: "_Filling", p: Patch, dname: str, per: int) -> Iterator[Bucket]:
        """Keep mode, a tensor larger than a bucket: memory of its own (its snapshot), sent in
        bucket-sized pieces, each a bucket of one entry."""
        if not fill.empty:
            yield self._flush(fill, False)
        total = p.count
        own = Arena(p.values.device).carve([(p.dtype, total)])[0]
        step = max(1, self.bucket_bytes // per)
        for done in range(0, total, step):
            take = min(step, total - done)
            fill.add(p, dname, per, done, take)
            b = self._flush(fill, False, into=own.narrow(0, done, take))
            if done + take == total:
                self.keep(p.name, own.view(p.shape))
            yield b

    def _buffers(self, fill: "_Filling", into: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The bucket's index buffer and value buffers. ``into``: the buffer of a bucket that holds
        one piece of one tensor (keep mode)."""
        if into is not None:
            return torch.empty(0, dtype=torch.int32, device=into.device), {fill.entries[0]["dtype"]: into}
        fresh = self.arena is None or self.keep is not None
        arena = Arena(self._device(fill.parts + fill.t_parts)) if fresh else self.arena
        names = sorted(fill.values)
        bufs = arena.carve([(torch.int32, fill.indices)] + [(DTYPES[k], fill.values[k]) for k in names])
        return bufs[0], dict(zip(names, bufs[1:]))

    def _write_dense(self, fill: "_Filling", idx: torch.Tensor, vals: dict[str, torch.Tensor], key: DigestKey,
                     dense: DenseTable | None) -> dict[int, torch.Tensor]:
        """A bulk bucket's parts into its buffers, dense ranges and the dense table's tensors in one
        fused pass (copy, digest, Inf/NaN check), the table's digests set as its own. Returns the
        ``seg`` entries' sources by entry position."""
        sources: dict[int, torch.Tensor] = {}
        ranges = []
        for i, (entry, p, done, take) in enumerate(fill.parts):
            buf, at = vals[entry["dtype"]], entry["value_offset"]
            if p.dense and self._direct(p, take, buf.device):
                # a broadcast of its own, which a receiver may land in place; sent from the source
                # itself (digested, not copied), or from the copy a snapshot keeps
                entry["seg"] = True
                kept_copy = self.keep is not None
                ranges.append((i, entry, p, done, take, buf if kept_copy else None, at))
                sources[i] = buf.narrow(0, at, take) if kept_copy else p.values.narrow(0, done, take)
            elif p.dense:
                ranges.append((i, entry, p, done, take, buf, at))
            else:
                idx.narrow(0, entry["index_offset"], take).copy_(p.indices[done:done + take])
                buf.narrow(0, at, take).copy_(p.values[done:done + take])
        table, made = None, []  # (elsewhere: the table's tensors as entries of their own, read back after)
        if dense is not None:  # the table's tensors, whole, after the JSON entries' values in each buffer
            rows = self._table_rows(dense, fill.t_parts)
            if rows is not None:
                table = (rows, dense, fill.t_parts)
            else:
                for k, ((dname, p, _, take), at) in enumerate(zip(fill.t_parts, dense.value_starts.tolist())):
                    made.append({})
                    ranges.append((dense.first + k, made[-1], p.patch() if type(p) is Whole else p, 0, take,
                                   dense.values[dname], at))
        self._scan_dense(ranges, key, table)
        if made:
            dense.digests = parse_texts([e["digest"] for e in made])
        return sources

    @staticmethod
    def _table_rows(dense: DenseTable, parts: list) -> torch.Tensor | None:
        """The dense table's tensors as kernel rows, made as columns (a 30B-A3B seed's ~19k small
        tensors: no Python step per tensor beyond reading its address), each one's values copied to
        its place in the bucket. None where a tensor or the bucket is off the host or not contiguous,
        or no kernel is built."""
        values = [p.tensor if type(p) is Whole else p.values for _, p, _, _ in parts]
        dst = _host_rows(dense)
        if dst is None or not all(map(_ON_HOST, values)) or not all(map(torch.Tensor.is_contiguous, values)):
            return None
        return table_rows(torch.tensor(list(map(torch.Tensor.data_ptr, values)), dtype=torch.int64), dense.counts,
                          dense.codes, dst)

    @staticmethod
    def _write_sparse(parts: list[tuple[str, Patch, int, int]], idx: torch.Tensor, vals: dict[str, torch.Tensor],
                      idx_at: int = 0, vals_at: dict[str, int] | None = None) -> None:
        """A delta's sparse ``(dtype name, patch, first, count)`` parts into the buffers from
        ``idx_at`` / ``vals_at[dtype]`` on: one cat per buffer, not a copy per tensor."""
        dev, vals_at = idx.device, vals_at or {}
        if not parts:
            return
        torch.cat([_part(p.indices, d, t, dev) for _, p, d, t in parts], out=idx.narrow(0, idx_at, sum(t for *_, t in parts)))
        for k, buf in vals.items():
            at = vals_at.get(k, 0)
            mine = [_part(p.values, d, t, dev) for dn, p, d, t in parts if dn == k]
            if mine:
                torch.cat(mine, out=buf.narrow(0, at, sum(m.numel() for m in mine)))

    def _flush(self, fill: "_Filling", last: bool, into: torch.Tensor | None = None) -> Bucket:
        """The filled bucket, written, digested and checked; ``fill`` starts the next one."""
        idx, vals = self._buffers(fill, into)
        nonce = secrets.token_hex(12) if self.keys is not None else None
        key = self.keys(nonce) if nonce is not None else PUBLIC
        sources: dict[int, torch.Tensor] = {}
        where = f"bucket {self.seq} of v{self.version}"
        table = dense = None
        if fill.dense:  # (its digests: written with its values)
            dense = DenseTable(self.dense, native.host_ints(fill.t_ids), None,
                               {k: vals[k][vals[k].numel() - n:] for k, n in fill.t_vals.items()}, len(fill.entries),
                               where, key)
        if dense is not None or any(p.dense for _, p, _, _ in fill.parts):  # bulk buckets: one fused pass per range
            sources = self._write_dense(fill, idx, vals, key, dense)
        elif fill.parts:
            self._write_sparse([(e["dtype"], p, d, t) for e, p, d, t in fill.parts], idx, vals)
        j_idx = idx.numel() - fill.t_idx  # the JSON entries' indices; the table's follow them
        if fill.t_ids and dense is None:
            j_vals = {k: vals[k].numel() - n for k, n in fill.t_vals.items()}
            self._write_sparse(fill.t_parts, idx, vals, j_idx, j_vals)
            table = TableSlice(self.catalog, native.host_ints(fill.t_ids), native.host_ints(fill.t_counts), idx[j_idx:],
                               {k: vals[k][j_vals[k]:] for k in fill.t_vals}, where)
        header = {"version": self.version, "seq": self.seq, "last": last, "kind": self.kind,
                  "entries": list(fill.entries), "index_count": int(idx.numel()),
                  "value_counts": {k: int(v.numel()) for k, v in vals.items()}}
        if table is not None:
            header["table"] = encode_table(self.catalog, fill.t_ids, fill.t_counts)
        if dense is not None:
            header["dense"] = encode_dense(self.dense, fill.t_ids, dense.digests)
        if self.record is not None:
            self.record.see_entries(header["entries"], dense)
        if nonce is not None:
            header["nonce"] = nonce
        reads = ReadBack()  # on a device: the table's checks and the checksum wait for it once
        if self.check:  # refused before it leaves
            if table is not None:
                check_table(table, self.kept, reads)
            check_sparse_entries(header["entries"], idx[:j_idx], vals, self.kept)
        b = Bucket(header, idx, vals, sources, key, dense=dense)
        checksum = b.payload_checksum(reads) if self.checksum and idx.numel() else None
        reads.run()
        header["checksum"] = checksum() if checksum is not None else None
        if self.keep is not None and into is None:
            self._keep_whole(fill, vals, dense)
        self.seq += 1
        fill.clear()
        return b

    def _keep_whole(self, fill: "_Filling", vals: dict[str, torch.Tensor], dense: DenseTable | None) -> None:
        """Keep mode: hand each whole tensor the bucket packed, as a view of it, to :attr:`keep`."""
        for entry, p, _, take in fill.parts:
            if p.dense and take == p.count:
                self.keep(p.name, vals[entry["dtype"]].narrow(0, entry["value_offset"], take).view(p.shape))
        if dense is not None:
            for (dname, p, _, take), at in zip(fill.t_parts, dense.value_starts.tolist()):
                self.keep(p.name, dense.values[dname].narrow(0, at, take).view(p.shape))

    @staticmethod
    def _device(parts) -> torch.device:
        return parts[0][1].values.device if parts else torch.device("cpu")


class _Filling:
    """The bucket being filled: its JSON entries and the patch range behind each, its table's
    parts (which follow the JSON entries' in every buffer), and its counts."""

    def __init__(self):
        self.entries: list[dict] = []
        self.parts: list[tuple[dict, Patch, int, int]] = []  # (entry, patch, first element, count)
        self.t_ids: list[int] = []
        self.t_counts: list[int] = []
        self.t_parts: list[tuple[str, Patch, int, int]] = []  # (dtype name, patch, first element, count)
        self.dense = False  # the table holds whole tensors (a bulk bucket's dense table), not sparse ones
        self.clear()

    def clear(self) -> None:
        self.entries.clear()
        self.parts.clear()
        self.t_ids.clear()
        self.t_counts.clear()
        self.t_parts.clear()
        self.indices = 0  # int32 indices
        self.nbytes = 0  # payload bytes
        self.values: dict[str, int] = {}  # elements per value dtype
        self.t_idx = 0  # of which the table's
        self.t_vals: dict[str, int] = {}
        self.dense = False

    @property
    def empty(self) -> bool:
        return not self.entries and not self.t_ids

    def add(self, p: Patch, dname: str, per: int, done: int, take: int) -> None:
        """Elements ``[done, done + take)`` of ``p`` (``per`` bytes each on the wire), as a JSON entry."""
        vo = self.values.get(dname, 0) - self.t_vals.get(dname, 0)
        entry = {"name": p.name, "dtype": dname, "shape": list(p.shape),
                 "encoding": "dense" if p.dense else "sparse", "count": take,
                 "start": done if p.dense else 0, "index_offset": self.indices - self.t_idx, "value_offset": vo}
        if self.dense:  # travels after the dense table's tensors so far
            entry["after"] = len(self.t_ids)
        self.entries.append(entry)
        self.parts.append((entry, p, done, take))
        if not p.dense:
            self.indices += take
        self.values[dname] = self.values.get(dname, 0) + take
        self.nbytes += take * per

    def add_dense(self, p: Patch, tid: int, dname: str, per: int, n: int) -> None:
        """All ``n`` elements of dense ``p``, catalogued as ``tid``, into the dense table."""
        self.dense = True
        self.t_ids.append(tid)
        self.t_parts.append((dname, p, 0, n))
        t_vals, values = self.t_vals, self.values
        t_vals[dname] = t_vals.get(dname, 0) + n
        values[dname] = values.get(dname, 0) + n
        self.nbytes += n * per

    def add_dense_run(self, wholes: list[Whole], tids: list[int], numels: list[int], dname: str, per: int) -> None:
        """:meth:`add_dense` of each of ``wholes`` (catalogued as ``tids``, of ``numels`` elements), as lists."""
        self.dense = True
        self.t_ids += tids
        self.t_parts += zip(itertools.repeat(dname), wholes, itertools.repeat(0), numels)
        n = sum(numels)
        self.t_vals[dname] = self.t_vals.get(dname, 0) + n
        self.values[dname] = self.values.get(dname, 0) + n
        self.nbytes += n * per

    def add_table(self, p: Patch, tid: int, dname: str, per: int, done: int, take: int) -> None:
        """Elements ``[done, done + take)`` of sparse ``p``, catalogued as ``tid``, into the table."""
        self.add_table_run(p, [tid], [take], dname, per, done, take)

    def add_table_run(self, p: Patch | PatchBatch, tids: list[int], counts: list[int], dname: str, per: int,
                      done: int, take: int) -> None:
        """Elements ``[done, done + take)`` of ``p``'s buffers, ``counts[k]`` of them of tensor
        ``tids[k]`` in turn, into the table."""
        self.t_ids += tids
        self.t_counts += counts
        self.t_parts.append((dname, p, done, take))
        self.t_idx += take
        self.t_vals[dname] = self.t_vals.get(dname, 0) + take
        self.indices += take
        self.values[dname] = self.values.get(dname, 0) + take
        self.nbytes += take * per


def value_segments(entries: list[dict], dname: str, total: int) -> list[tuple[int | None, int, int]]:
    """How the ``dname`` value buffer of a bucket travels: ``(entry position, offset, count)`` per
    broadcast, the position None for a run of packed entries, an entry's own for a ``seg`` entry.
    Both ends derive it from the header alone, so they stay in step whatever it says: entries that
    do not tile the buffer make it one broadcast of the whole buffer (and :func:`entry_patches`
    refuses the bucket once it has arrived)."""
    whole: list[tuple[int | None, int, int]] = [(None, 0, total)]
    if not any(e.get("seg") is True for e in entries):  # a delta's buckets: no entry travels alone
        return whole
    segs: list[tuple[int | None, int, int]] = []
    pos = 0
    for i, e in enumerate(entries):
        if e.get("dtype") != dname:
            continue
        try:
            off, n = int(e["value_offset"]), int(e["count"])
        except (KeyError, TypeError, ValueError):
            return whole
        if off != pos or n < 0:
            return whole
        pos = off + n
        if e.get("seg") is True:
            segs.append((i, off, n))
        elif segs and segs[-1][0] is None:
            segs[-1] = (None, segs[-1][1], segs[-1][2] + n)
        elif n:
            segs.append((None, off, n))
    if pos < total and segs and segs[-1][0] is None:
        segs[-1] = (None, segs[-1][1], total - segs[-1][1])
    elif pos < total:
        segs.append((None, pos, total - pos))
    return segs if pos <= total else whole


def _part(t: torch.Tensor, start: int, count: int, device: torch.device) -> torch.Tensor:
    """``t[start:start+count]`` on ``device``, without a slice or a ``to`` where none is needed:
    a delta's thousands of small parts each paid for them (bf16 ``to`` the most)."""
    if start or count != t.numel():
        t = t.narrow(0, start, count)
    return t if t.device == device else t.to(device)


def parse_header(raw: bytes) -> dict:
    try:
        h = json.loads(raw)
        for key in ("version", "seq", "last", "kind", "entries", "index_count", "value_counts"):
            h[key]
        return h
    except (ValueError, KeyError, TypeError) as e:
        raise PatchValidationError("<bucket header>", f"malformed header: {e}") from None


def entry_patches(bucket: Bucket, kept: str | None = None, check_dense: bool = True,
                  catalog: Catalog | None = None) -> list[tuple[dict, Patch]]:
    """Split a received bucket into per-entry patches after checking its checksum and bounds.

    Dense entries become ``Patch`` objects with ``indices=None`` and values for the entry's
    ``[start, start+count)`` range (the caller joins ranges of one tensor). Their digests and
    finiteness are checked here, unless ``check_dense`` is False: then the caller must run
    :func:`check_dense_entry` on each (a receiver that digests while it applies). A delta bucket's
    table is parsed against ``catalog`` and checked, and set as ``bucket.table``; a bulk bucket's
    dense table is parsed against ``catalog`` (there: the one of the bulk update before), its digests
    checked with the dense entries', and set as ``bucket.dense``. Neither table's entries are among
    the returned ones (:meth:`TableSlice.patches`, :meth:`DenseTable.patches` make them).
    """
    reads = ReadBack()  # on a device: the checksum and the table's checks wait for it once
    _check_checksum(bucket, kept, reads)
    h = bucket.header
    where = f"bucket {h['seq']} of version {h['version']}"
    if "table" in h:
        if h["kind"] != "delta":
            reads.run()  # (the checksum's verdict first)
            raise PatchValidationError("<bucket table>", f"{where}: a table in a {h['kind']!r} bucket", kept=kept)
        bucket.table = TableSlice.parse(h["table"], catalog, bucket.indices, bucket.values, where, kept)
        check_table(bucket.table, kept, reads)
    reads.run()
    if "dense" in h:
        if h["kind"] == "delta":
            raise PatchValidationError("<bucket table>", f"{where}: a dense table in a delta bucket", kept=kept)
        bucket.dense = DenseTable.parse(h["dense"], catalog, bucket.values, len(h["entries"]), where, kept, bucket.key)
        check_after(h["entries"], bucket.dense.ids.numel(), where, kept)
        if check_dense:
            check_dense_table(bucket.dense, kept)
    tiling = _Tiling(bucket, kept)
    out = tiling.dense_patches()
    if out is None:
        out = [(e, tiling.patch(i, e)) for i, e in enumerate(h["entries"])]
    tiling.check_covered()
    if check_dense:  # the bucket's dense ranges digested together (one device sync), checked in order
        dense = [(e, p) for e, p in out if p.indices is None]
        scans = scan_many([(p.values, int(e["start"]), None) for e, p in dense], key=bucket.key)
        for (e, p), (got, bad) in zip(dense, scans):
            check_dense_entry(e, got, bad, p.values, kept)
    check_sparse_entries(h["entries"], bucket.indices[:tiling.json_indices], bucket.values, kept)
    return out


def check_table(table: TableSlice, kept: str | None = None, reads: ReadBack | None = None) -> None:
    """Order, bounds and finiteness of a table's entries: one pass of the host kernel and one scan
    per value buffer; elsewhere, or to name what is wrong, :func:`check_sparse_entries` over its
    entries stated as JSON entries would be. Buffers off the host are checked by torch ops over the
    table's columns, no entry per tensor, their verdict read with ``reads``' others. With ``reads``,
    a table that fails is refused when it runs (after what was queued before: the checksum's
    verdict); without, at once."""
    limits = table.catalog.numel[table.ids]
    ok = native.sparse_in_order(table.indices, table.counts, limits)
    if ok is None:
        found = _OrderBounds(table.counts.tolist(), limits.tolist(), table.indices)
        flags = [found.wrong] if found.wrong is not None else []
        flags += [nonfinite_on_device(v) for v in table.values.values()]

        def then(values: list[list]) -> None:
            if any(v[0] for v in values):
                _refuse_table(table, kept, None)

        if reads is None:
            then(read_back(flags) if flags else [])
        else:
            reads.later(flags, then)
        return
    if ok and not any(nonfinite_count(v) for v in table.values.values()):
        return
    if reads is None:
        _refuse_table(table, kept, ok)
    else:  # refused in turn with what ``reads`` holds: a bucket's checksum verdict comes first
        reads.later([], lambda _: _refuse_table(table, kept, ok))


def _refuse_table(table: TableSlice, kept: str | None, ok: bool | None) -> None:
    """Raise for a table whose checks failed: its entries checked as JSON entries would be, to name
    what is wrong, else (the kernel and the torch checks disagree) refused all the same."""
    check_sparse_entries(table.entries(), table.indices, table.values, kept)
    if ok is not True:
        raise PatchValidationError("<bucket table>", f"{table.where}: table indices out of order or bounds",
                                   kept=kept)


def check_dense_table(table: DenseTable, kept: str | None = None, dst: torch.Tensor | None = None) -> None:
    """Refuse a dense table whose tensors' values have other digests than the sender's, or hold
    Inf/NaN: one scan of the host kernel for the table, its rows worked out as columns (no Python
    step per tensor); ``dst``: each tensor's host address (int64, in table order), where the same
    pass copies its values (an engine writing a seed: checked after the write, as a sink that checks
    does). Elsewhere (values off the host, no kernel) tensor by tensor; so too to name what failed."""
    rows = _dense_rows(table, dst)
    if rows is None:
        if dst is not None:
            raise ValueError("a dense table's copy by address needs its values on the host and the kernel")
        items = table.patches()
        for (e, p), (got, bad) in zip(items, scan_many([(p.values, 0, None) for _, p in items], key=table.key)):
            check_dense_entry(e, got, bad, p.values, kept)
        return
    sums = scan_rows_table(rows, key=table.key)
    n = table.ids.numel()
    wrong = (table.key.masked_table(sums, range(table.first, table.first + n)) != table.digests).any(1) \
        | (sums[:, -1] != 0)
    if bool(wrong.any()):
        k = first_true(wrong)
        (e, p), = table.patches([k])
        check_dense_entry(e, Digest.of_residues(sums[k, :-1].tolist()), int(sums[k, -1]), p.values, kept)


def _dense_rows(table: DenseTable, dst: torch.Tensor | None) -> torch.Tensor | None:
    """The digest kernel's rows (:func:`~delta_sync.digest.range_row`) of a dense table's tensors as
    they lie in its buffers, in table order, made as columns; None where its values are off the host
    or no kernel is built."""
    src = _host_rows(table)
    return None if src is None else table_rows(src, table.counts, table.codes, dst)


def _host_rows(table: DenseTable) -> torch.Tensor | None:
    """The host address of each tensor's values in a dense table's buffers (its rows' sources on the
    receiver, their destinations on the sender); None where a buffer is off the host or not
    contiguous, or no kernel is built to read them."""
    if not rows_supported() or not all(v.is_cpu and v.is_contiguous() for v in table.values.values()):
        return None
    base = torch.zeros(len(CODES), dtype=torch.int64)
    for dname, v in table.values.items():
        base[CODES.index(dname)] = v.data_ptr()
    return base[table.codes] + table.value_starts * _SPECS[table.codes, 0]


#: per catalogue dtype code (:data:`delta_sync.catalog.CODES`): its :func:`row_spec`
_SPECS = torch.tensor([row_spec(DTYPES[dname]) for dname in CODES], dtype=torch.int64)


def table_rows(src: torch.Tensor, counts: torch.Tensor, codes: torch.Tensor, dst: torch.Tensor | None
               ) -> torch.Tensor | None:
    """Digest kernel rows of whole tensors as columns: ``counts[k]`` elements of catalogue dtype
    ``codes[k]`` at host address ``src[k]`` (checkpoint elements from 0), copied to ``dst[k]`` where
    given; None where one is too long for the digest's positions."""
    spec = _SPECS[codes]
    if counts.numel() and int((counts * spec[:, 1]).max()) > MAX_WORDS:
        return None
    rows = torch.zeros(counts.numel(), 6, dtype=torch.int64)
    rows[:, 0] = src
    rows[:, 1] = counts * spec[:, 0] // 2
    if dst is not None:
        rows[:, 3] = dst
    rows[:, 4], rows[:, 5] = spec[:, 2], spec[:, 1]
    return rows


def _check_checksum(bucket: Bucket, kept: str | None, reads: ReadBack) -> None:
    """The payload's checksum against its header's, when ``reads`` runs (first of what it reads)."""
    h = bucket.header
    if h.get("checksum") is None and bucket.indices.numel() and bucket.key is not PUBLIC:
        raise ChecksumMismatch(f"bucket {h['seq']} of version {h['version']}: sparse payload without its "
                               "checksum", kept=kept)
    if h.get("checksum") is None:
        return
    checksum = bucket.payload_checksum(reads)

    def compare(_) -> None:
        got = checksum()
        if got != h["checksum"]:
            raise ChecksumMismatch(f"bucket {h['seq']} of version {h['version']}: payload checksum "
                                   f"{got} != header {h['checksum']}", kept=kept)

    reads.later([], compare)


class _Tiling:
    """A received bucket's entries, read in order: each one's patch, checked to point inside the
    buffers and to follow the one before it (entries tile the buffers exactly)."""

    def __init__(self, bucket: Bucket, kept: str | None):
        self.bucket, self.kept = bucket, kept
        self.where = f"bucket {bucket.header['seq']} of version {bucket.header['version']}"
        self.used = {k: 0 for k in bucket.values}  # value elements taken so far, per dtype
        self.used_idx = 0  # indices taken so far
        table = bucket.table or bucket.dense  # its parts follow the entries' in every buffer
        self.json_indices = bucket.indices.numel() - (bucket.table.indices.numel() if bucket.table else 0)
        self.json_values = {k: v.numel() - (table.value_counts.get(k, 0) if table else 0) for k, v in bucket.values.items()}
        self.idx_views, self.val_views = _entry_views(bucket.header["entries"], bucket, self.json_indices,
                                                      self.json_values)

    def _refuse(self, name: str, why: str) -> PatchValidationError:
        return PatchValidationError(name, why, kept=self.kept)

    def patch(self, i: int, e: dict) -> Patch:
        name = e.get("name", "<unnamed>")
        if e.get("dtype") not in DTYPES:
            raise self._refuse(name, f"unknown dtype {e.get('dtype')!r}")
        if e.get("encoding") not in ("sparse", "dense"):
            raise self._refuse(name, f"unknown encoding {e.get('encoding')!r}")
        vals = self._values(i, e, name)
        shape = tuple(map(int, e["shape"]))
        if shape and min(shape) < 0:
            raise self._refuse(name, f"invalid shape {shape}")
        if e["encoding"] == "sparse":
            io, n = int(e["index_offset"]), int(e["count"])
            if io != self.used_idx or io + n > self.json_indices:
                raise self._refuse(name, "entry points outside the index buffer")
            self.used_idx += n
            indices = self.idx_views[i] if self.idx_views is not None else self.bucket.indices[io:io + n]
            return Patch(name, shape, DTYPES[e["dtype"]], indices, vals)
        self._check_dense(i, e, name, shape)
        return Patch(name, shape, DTYPES[e["dtype"]], None, vals)

    def dense_patches(self) -> list[tuple[dict, Patch]] | None:
        """:meth:`patch` of every entry of a bucket of dense entries only (a seed's), checked as
        lists: known dtypes, integer counts, offsets and starts, value offsets that tile the
        buffers in order, ranges inside their shapes, a digest each. None, having taken nothing,
        where any of that fails or an entry was received in place: the caller then reads entry by
        entry, which names what is wrong."""
        es, b = self.bucket.header["entries"], self.bucket
        if self.val_views is None or b.sources or self.used_idx or any(self.used.values()):
            return None
        try:
            if any(e["encoding"] != "dense" or type(e["digest"]) is not str for e in es):
                return None
            dts = [e["dtype"] for e in es]
            counts, offsets, starts = ([e[k] for e in es] for k in ("count", "value_offset", "start"))
            shapes = [tuple(e["shape"]) for e in es]
        except (KeyError, TypeError):
            return None
        ints = {type(x) for x in itertools.chain(counts, offsets, starts, *shapes)}
        if not set(dts) <= DTYPES.keys() or not ints <= {int}:
            return None
        tiles: dict[str, int] = {}
        for dt, n, vo in zip(dts, counts, offsets):
            if vo != tiles.get(dt, 0):
                return None
            tiles[dt] = vo + n
        numels = list(map(math.prod, shapes))
        if tiles != {k: n for k, n in self.json_values.items() if n or k in tiles} or \
                any(st < 0 or st + n > m for st, n, m in zip(starts, counts, numels)) or \
                any(min(sh, default=0) < 0 for sh in shapes):
            return None
        key, where = b.key, self.where
        for i, e in enumerate(es):
            e["_where"], e["_key"], e["_at"] = where, key, i
        self.used.update(tiles)
        vals = [self.val_views[i] for i in range(len(es))]
        return list(zip(es, map(Patch, [e.get("name", "<unnamed>") for e in es], shapes, map(DTYPES.get, dts),
                                itertools.repeat(None), vals)))

    def _values(self, i: int, e: dict, name: str) -> torch.Tensor:
        vals_all = self.bucket.values.get(e["dtype"])
        n, vo = int(e["count"]), int(e["value_offset"])
        if n < 0 or vals_all is None or vo < 0 or vo + n > self.json_values[e["dtype"]]:
            raise self._refuse(name, f"entry points outside the {e['dtype']} value buffer")
        if vo != self.used[e["dtype"]]:
            raise self._refuse(name, f"value offset {vo}, expected {self.used[e['dtype']]}: entries must "
                               "tile the value buffer")
        self.used[e["dtype"]] += n
        vals = self.bucket.sources.get(i)  # a seg entry received in place
        if vals is None:
            vals = self.val_views[i] if self.val_views is not None else vals_all[vo:vo + n]
        return vals

    def _check_dense(self, i: int, e: dict, name: str, shape: tuple[int, ...]) -> None:
        start, n = int(e.get("start", -1)), int(e["count"])
        numel = math.prod(shape)
        if start < 0 or start + n > numel:
            raise self._refuse(name, f"dense range [{start}, {start + n}) outside {numel} elements")
        if not isinstance(e.get("digest"), str):
            raise self._refuse(name, "dense entry without a digest")
        e["_where"] = self.where  # for a later check's message
        e["_key"], e["_at"] = self.bucket.key, i  # what a later check digests under, and where

    def check_covered(self) -> None:
        """The entries and the table together cover every index and value."""
        b = self.bucket
        if self.used_idx != self.json_indices or any(self.used[k] != n for k, n in self.json_values.items()):
            raise self._refuse("<bucket>", f"bucket {b.header['seq']}: entries cover {self.used_idx} of "
                               f"{self.json_indices} indices and {self.used} of the value buffers "
                               f"{self.json_values} (past them: the table's)")


def _entry_views(entries: list[dict], bucket: Bucket, n_idx: int, n_vals: dict[str, int]
                 ) -> tuple[dict | None, dict | None]:
    """Every entry's slice of the index buffer and of its value buffer, by entry position, cut
    with one ``split`` per buffer (a MoE delta's ~19k entries: one call, not a slice each), where
    the entries tile the first ``n_idx`` indices and ``n_vals[dtype]`` values (those before a
    table's) in order, as they must; (None, None) where they do not (the caller's checks then name
    what is wrong)."""
    try:
        sparse = [(i, int(e["count"])) for i, e in enumerate(entries) if e.get("encoding") == "sparse"]
        per_dtype: dict[str, list[tuple[int, int]]] = {}
        for i, e in enumerate(entries):
            per_dtype.setdefault(e["dtype"], []).append((i, int(e["count"])))
        if sum(n for _, n in sparse) != n_idx or any(n < 0 for _, n in sparse) or \
                any(k not in bucket.values or sum(n for _, n in v) != n_vals[k] or any(n < 0 for _, n in v)
                    for k, v in per_dtype.items()):
            return None, None
    except (KeyError, TypeError, ValueError, AttributeError):
        return None, None
    idx = dict(zip((i for i, _ in sparse), bucket.indices[:n_idx].split([n for _, n in sparse])))
    vals = {}
    for k, members in per_dtype.items():
        vals.update(zip((i for i, _ in members), bucket.values[k][:n_vals[k]].split([n for _, n in members])))
    return idx, vals


def check_dense_entry(entry: dict, digest, bad: int, values: torch.Tensor, kept: str | None = None) -> None:
    """Refuse a dense entry whose values (as received: ``values``) have another digest than the
    sender's, or hold Inf/NaN; ``digest`` and ``bad`` are what a scan of them under the entry's key
    (``entry["_key"]``, set by :func:`entry_patches`) found."""
    name, start, n = entry.get("name", "<unnamed>"), int(entry["start"]), int(entry["count"])
    got = entry["_key"].masked(digest, entry["_at"]) if "_key" in entry else digest.hex()
    if got != entry["digest"]:
        raise ChecksumMismatch(f"{entry.get('_where', 'a bucket')}: {name!r} values "
                               f"[{start}, {start + n}) digest {got} != header {entry['digest']}", kept=kept)
    if bad:
        where = start + first_true(~torch.isfinite(values))
        raise PatchValidationError(name, f"non-finite value at flat index {where}", index=where, kept=kept)


def check_sparse_entries(entries: list[dict], indices: torch.Tensor, values: dict[str, torch.Tensor],
                         kept: str | None = None) -> None:
    """Bounds, strict order and finiteness of every sparse entry of one bucket, over the bucket's
    buffers at once, not a round of checks per tensor (a 30B MoE has ~19k checkpoint tensors):
    order and bounds in one pass of the host kernel (:func:`native.sparse_in_order`), else, and to
    name what it found wrong, in a handful of vectorized torch ops. Sparse entries tile the index buffer in order (the packer builds them so,
    :func:`entry_patches` checks it first). Both sides run it: the packer before a bucket leaves,
    the receiver before it stages it. Raises :class:`PatchValidationError` naming the tensor, the
    bad flat index and its position in the patch."""
    sparse = [e for e in entries if e["encoding"] == "sparse"]
    if not sparse:
        return
    _check_order_bounds([int(e["count"]) for e in sparse], [math.prod(int(d) for d in e["shape"]) for e in sparse],
                        indices, kept, lambda k: sparse[k]["name"])
    _check_finite(sparse, indices, values, kept)


class _OrderBounds:
    """The torch checks of strict order and bounds of sparse entries of ``count_list`` elements
    each, which tile ``indices`` from its start, entry ``k`` within ``limits[k]`` elements: torch
    ops over the entries' columns, nothing read yet. ``wrong``: a one-element bool tensor on the
    indices' device, True where an entry fails (None: no indices)."""

    def __init__(self, count_list: list[int], limits: list[int], indices: torch.Tensor):
        self.count_list, self.limits, self.idx = count_list, limits, indices  # int32: compared, never subtracted
        dev = indices.device
        # the entries' columns are worked out on the host, from the host lists, and cross in one copy
        # (a boolean mask over device columns is a nonzero: a host sync each, four per table)
        counts = torch.tensor(count_list, dtype=torch.int64)
        self.first = first = torch.cumsum(counts, 0) - counts  # each entry's first position in the index buffer
        self.ok = self.wrong = None
        if not indices.numel():
            return
        self.nonempty = nonempty = counts > 0
        joins = (first - 1)[(first > 0) & nonempty]  # where one entry's indices meet the next's
        heads, lens = first[nonempty], counts[nonempty]
        cols = torch.cat([joins, heads, heads + lens - 1, torch.tensor(limits, dtype=torch.int64)[nonempty]])
        joins, self.heads, tails, numel = cols.to(dev).split([joins.numel()] + [heads.numel()] * 3)
        if indices.numel() > 1:
            self.ok = indices[1:] > indices[:-1]
            self.ok.index_fill_(0, joins, True)  # entries do not continue each other
        # strictly increasing within each entry (checked with it): its first and last index bound all of it
        self.lo, hi = indices.index_select(0, self.heads), indices.index_select(0, tails)
        self.bad = (self.lo < 0) | (hi >= numel)
        self.wrong = (self.bad.any() if self.ok is None else self.bad.any() | ~self.ok.all()).view(1)

    def refuse(self, kept: str | None, name_of) -> None:
        """Raise :class:`PatchValidationError` for the first entry that fails, named ``name_of(k)``."""
        idx, first = self.idx, self.first
        if self.ok is not None and not bool(self.ok.all()):
            pos = first_true(~self.ok) + 1
            k = int(torch.searchsorted(first, torch.tensor([pos]), right=True)) - 1  # (first: on the host)
            a, b = int(idx[pos - 1]), int(idx[pos])
            why = f"duplicate index {b}" if a == b else f"indices not increasing: {a} then {b}"
            raise PatchValidationError(name_of(k), why, index=pos - int(first[k]), kept=kept)
        k = first_true(self.bad)
        entry = [j for j, n in enumerate(self.nonempty.tolist()) if n][k]
        start = int(self.heads[k])
        if int(self.lo[k]) < 0:  # increasing: the entry's first index is its first negative one
            at, why = 0, "is negative"
        else:  # and its out-of-bounds ones are its last: name the first of them
            at = first_true(idx[start:start + self.count_list[entry]] >= self.limits[entry])
            why = f"out of bounds for {self.limits[entry]} elements"
        raise PatchValidationError(name_of(entry), f"index {int(idx[start + at])} {why}", index=at, kept=kept)


def _check_order_bounds(count_list: list[int], limits: list[int], indices: torch.Tensor, kept: str | None,
                        name_of) -> None:
    """Strict order and bounds of sparse entries (see :class:`_OrderBounds`), named ``name_of(k)``."""
    if native.sparse_in_order(indices, count_list, limits):  # one host-kernel pass: nothing to name
        return
    found = _OrderBounds(count_list, limits, indices)
    if found.wrong is not None and bool(found.wrong):  # (one read back for order and bounds)
        found.refuse(kept, name_of)


def _check_finite(sparse: list[dict], indices: torch.Tensor, values: dict[str, torch.Tensor],
                  kept: str | None) -> None:
    """No Inf/NaN among the values of the ``sparse`` entries (the last check of
    :func:`check_sparse_entries`)."""
    for dname in {e["dtype"] for e in sparse}:
        # runs of adjacent sparse entries, one op each (a dense entry between two runs was checked
        # already, and a seg one is not in this buffer at all on the sender)
        runs: list[list[int]] = []
        for e in sparse:
            if e["dtype"] != dname:
                continue
            lo, hi = int(e["value_offset"]), int(e["value_offset"]) + int(e["count"])
            if runs and runs[-1][1] == lo:
                runs[-1][1] = hi
            else:
                runs.append([lo, hi])
        for lo, hi in runs:
            span = values[dname][lo:hi]
            if not nonfinite_count(span):
                continue
            pos = lo + first_true(~torch.isfinite(span))
            e = next(e for e in sparse if e["dtype"] == dname
                     and int(e["value_offset"]) <= pos < int(e["value_offset"]) + int(e["count"]))
            at = pos - int(e["value_offset"])
            flat = int(indices[int(e["index_offset"]) + at])
            raise PatchValidationError(e["name"], f"non-finite value {float(values[dname][pos])} at flat index "
                                       f"{flat}", index=at, kept=kept)


class TensorAssembler:
    """Joins the entries of one version back into one patch per tensor, in arrival order."""

    def __init__(self, kept: str | None = None):
        self.kept = kept
        self._parts: dict[str, list[tuple[dict, Patch]]] = {}

    def add(self, bucket: Bucket, catalog: Catalog | None = None) -> None:
        entries = entry_patches(bucket, self.kept, catalog=catalog)
        self.add_entries((bucket.table.patches() if bucket.table is not None else []) + entries)

    def add_entries(self, entries: list[tuple[dict, Patch]]) -> None:
        for e, p in entries:
            self._parts.setdefault(p.name, []).append((e, p))

    def patches(self) -> list[Patch]:
        out = []
        for name, parts in self._parts.items():
            first = parts[0][1]
            if len(parts) == 1:  # the usual case: the tensor's one entry is its patch
                if first.dense and int(parts[0][0]["start"]) != 0:
                    raise PatchValidationError(name, f"dense range starts at {parts[0][0]['start']}, expected 0",
                                               kept=self.kept)
                out.append(first)
                continue
            if any(p.shape != first.shape or p.dtype != first.dtype or p.dense != first.dense
                   for _, p in parts):
                raise PatchValidationError(name, "entries disagree on shape, dtype or encoding", kept=self.kept)
            if first.dense:
                expect = 0
                for e, p in parts:
                    if int(e["start"]) != expect:
                        raise PatchValidationError(name, f"dense range starts at {e['start']}, expected {expect}",
                                                   kept=self.kept)
                    expect += p.count
                vals = torch.cat([p.values for _, p in parts]) if len(parts) > 1 else first.values
                out.append(Patch(name, first.shape, first.dtype, None, vals))
            else:
                for (_, a), (_, b) in zip(parts, parts[1:]):  # a tensor split across buckets stays in order
                    if a.count and b.count and int(a.indices[-1]) >= int(b.indices[0]):
                        raise PatchValidationError(name, f"indices not increasing across buckets: "
                                                   f"{int(a.indices[-1])} then {int(b.indices[0])}", kept=self.kept)
                idx = torch.cat([p.indices for _, p in parts]) if len(parts) > 1 else first.indices
                vals = torch.cat([p.values for _, p in parts]) if len(parts) > 1 else first.values
                out.append(Patch(name, first.shape, first.dtype, idx, vals))
        return out
