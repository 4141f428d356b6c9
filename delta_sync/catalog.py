"""The checkpoint's tensors by number, as both ends of a channel saw them in the last seed.

A 30B-A3B checkpoint has 18,867 tensors; a delta touches most of them with a handful of elements
each. Naming each one in a bucket's JSON header (name, shape, dtype, offsets: ~190 bytes) and
parsing, checking and routing it entry by entry cost more than the elements themselves. So a
seed or full update defines a :class:`Catalog`: its tensors in the order they first travelled,
with their shapes and dtypes. Both ends build it from the buckets themselves (the sender as it
packs them, each receiver as it checks them) and keep it on their :class:`~delta_sync.channel.Channel`
once the version went through whole; a failed or aborted one leaves none.

A delta bucket then names its sparse entries of catalogued tensors in a *table*: the catalogue's
fingerprint, and two ``int32`` arrays, tensor ids (strictly increasing) and element counts (8 bytes
per tensor, base64 in the header, so the header's MAC covers them). Their indices and values
follow those of the bucket's JSON entries (dense ones, names the catalogue lacks) in every buffer,
in table order. A receiver checks a table with a few vectorized operations, and an engine routes it
by id without a Python object per tensor (:class:`TableSlice`). A receiver whose catalogue differs
(another seed, a restarted engine, a new channel) refuses the delta: it needs a seed.

A later seed or full update names the whole tensors it carries in a bucket by the catalogue of the
bulk update before it, in a *dense table* (:class:`DenseTable`): tensor ids (strictly increasing
across the update) and each tensor's keyed digest as four 16-bit residues (12 bytes per tensor, base64
in the header), where JSON would state name, shape, dtype, offsets and a digest text (~190 bytes) for
each. Their values follow those of the bucket's JSON entries in every value buffer, in table order,
whole. A JSON entry of such a bucket says how many table tensors came before it (``after``), so both
ends number the update's own catalogue in the order its tensors travelled. Tensors the catalogue
lacks (or states with another shape or dtype), tensors split over buckets and those sent in a
broadcast of their own stay JSON entries.
"""

from __future__ import annotations

import array
import base64
import collections
import copy as _copy
import hashlib
import math
import operator
import threading

import numpy as np
import torch

from . import accelerator
from .digest import PRIMES, digest_texts
from .errors import NeedsSeed, PatchValidationError
from .patch import DTYPES, Patch

#: dtype names by the code a catalogue stores them as
CODES = tuple(DTYPES)
_CODE = {d: c for c, d in enumerate(CODES)}


class Catalog:
    """Tensors by id: ``names[i]``, ``shapes[i]``, ``dtypes[i]`` (dtype names)."""

    def __init__(self, names: list[str], shapes: list[tuple[int, ...]], dtypes: list[str]):
        self.names, self.shapes, self.dtypes = names, shapes, dtypes
        self.ids = dict(zip(names, range(len(names))))
        self.numel = torch.tensor(list(map(math.prod, shapes)), dtype=torch.int64)
        self.codes = torch.tensor(list(map(_CODE.__getitem__, dtypes)), dtype=torch.int64)
        #: the one dtype code of every tensor, where they share one (a bf16 model's): a table's
        #: per-dtype columns are then its columns (None: several)
        self.one_code: int | None = _CODE[dtypes[0]] if dtypes and dtypes.count(dtypes[0]) == len(dtypes) else None
        # "name|d0,d1|dtype\n" per tensor (what engines and trainers of every version compare)
        h = hashlib.blake2b(digest_size=12)
        for n, s, d in zip(names, shapes, dtypes):
            h.update(f"{n}|{','.join(map(str, s))}|{d}\n".encode())
        self.fingerprint = h.hexdigest()
        #: :meth:`run_ids` answers, by first name and length (a delta's batches name the same
        #: tensors at every step)
        self._runs: dict[tuple[str, int], tuple[list[str], list, str, list[int] | None]] = {}

    def __len__(self) -> int:
        return len(self.names)

    def run_ids(self, names: list[str], shapes: list[tuple[int, ...]], dname: str) -> list[int] | None:
        """The ids of ``names`` where each is catalogued with its shape of ``shapes`` and dtype
        ``dname``, in increasing order; else None. Whole-list operations, and the answer kept for
        the next list of the same names (and the same ``shapes`` list, or equal shapes): a model's
        ~19k tensors then cost no Python step each. The list returned is shared: not to be changed."""
        key = (names[0], len(names)) if names else ("", 0)
        kept = self._runs.get(key)
        if kept is not None and kept[0] == names and kept[2] == dname and (kept[1] is shapes or kept[1] == shapes):
            return kept[3]
        ids = list(map(self.ids.get, names))
        ok = (None not in ids and all(map(operator.lt, ids, ids[1:]))
              and list(map(self.shapes.__getitem__, ids)) == (shapes if isinstance(shapes, list) else list(shapes))
              and (self.dtypes[0] == dname if self.one_code is not None  # (one dtype catalogued: no read each)
                   else list(map(self.dtypes.__getitem__, ids)).count(dname) == len(ids)))
        if len(self._runs) >= 256:
            self._runs.clear()
        self._runs[key] = (list(names), shapes, dname, ids if ok else None)
        return ids if ok else None

    def id_of(self, name: str, shape: tuple[int, ...], dname: str) -> int | None:
        """The id of ``name`` where it is catalogued with this shape and dtype, else None."""
        i = self.ids.get(name)
        return i if i is not None and self.shapes[i] == shape and self.dtypes[i] == dname else None


class CatalogBuilder:
    """Tensors in the order they first appear in a bulk update's buckets: each bucket's entries
    are noted as they come (a list per bucket) and numbered only when :meth:`build` is called, so
    a full-mode channel, which never sends a delta, never hashes a catalogue."""

    def __init__(self):
        self._buckets: list[tuple[list[tuple], "DenseTable | None", list[int]]] = []
        self._built: Catalog | None = None

    def see_entries(self, entries: list[dict], dense: "DenseTable | None" = None) -> None:
        """A checked bucket's entries: their ``name``, ``shape``, ``dtype`` (not the entries, whose
        private fields hold the bucket's digest key), and its dense table's tensors, each JSON entry
        after the ``after`` first of them (:func:`check_after` checked those)."""
        seen = [(e["name"], e["shape"], e["dtype"]) for e in entries]
        self._buckets.append((seen, dense, [e.get("after", 0) for e in entries] if dense is not None else []))
        self._built = None

    def build(self) -> Catalog:
        if self._built is not None:
            return self._built
        same = self._unchanged()
        if same is not None:  # a bulk update of the catalogue's own tensors, in its order: the same catalogue
            self._built = same
            return same
        first: dict[str, tuple] = {}  # each name's first entry (a tensor split over buckets comes again)
        for seen, dense, after in self._buckets:
            for name, shape, dname in _in_order(seen, dense, after):
                if name not in first:
                    first[name] = (shape, dname)
        shapes, dtypes = zip(*first.values()) if first else ((), ())
        self._built = Catalog(list(first), [tuple(map(int, s)) for s in shapes], list(dtypes))
        return self._built

    def _unchanged(self) -> Catalog | None:
        """The catalogue this update's dense tables name, where the update carried its tensors once
        each in its order (by id, or by name: a tensor split over buckets, one sent in a broadcast
        of its own) and nothing else: a later seed of the same model, numbered as before. None
        otherwise (numbered anew). Checked per JSON entry and per run of table ids, not per tensor."""
        base = next((dense.catalog for _, dense, _ in self._buckets if dense is not None), None)
        if base is None or any(dense is not None and dense.catalog is not base for _, dense, _ in self._buckets):
            return None
        expect, prev = 0, None  # the next id in the catalogue's order; the last tensor by name

        def run(ids: torch.Tensor) -> bool:
            nonlocal expect, prev
            if ids.numel() and not torch.equal(ids, torch.arange(expect, expect + ids.numel())):
                return False
            expect += ids.numel()
            prev = None if ids.numel() else prev
            return True

        for seen, dense, after in self._buckets:
            ids = dense.ids if dense is not None else torch.zeros(0, dtype=torch.int64)
            done = 0
            for (name, shape, dname), a in zip(seen, after or [0] * len(seen)):
                if not run(ids[done:max(done, a)]):
                    return None
                done = max(done, a)
                i = base.ids.get(name)
                if i is None or base.shapes[i] != tuple(shape) or base.dtypes[i] != dname:
                    return None
                if name != prev:  # (a tensor's next piece follows it; anything else comes once, in order)
                    if i != expect:
                        return None
                    expect, prev = expect + 1, name
            if not run(ids[done:]):
                return None
        return base if expect == len(base) else None


def _in_order(seen: list[tuple], dense: "DenseTable | None", after: list[int]):
    """A bucket's ``(name, shape, dtype)`` in the order they travelled: each JSON entry after the
    first ``after[k]`` tensors of the dense table."""
    if dense is None:
        yield from seen
        return
    cat, ids = dense.catalog, dense.ids.tolist()
    done = 0
    for entry, a in zip(seen, after):
        for i in ids[done:a]:
            yield cat.names[i], cat.shapes[i], cat.dtypes[i]
        done = max(done, a)
        yield entry
    for i in ids[done:]:
        yield cat.names[i], cat.shapes[i], cat.dtypes[i]


def check_after(entries: list[dict], n: int, where: str, kept: str | None) -> None:
    """The JSON entries of a bucket with a dense table of ``n`` tensors say, in order, how many of
    them came before each (integers from 0 to ``n``, never decreasing)."""
    last = 0
    for e in entries:
        a = e.get("after", 0)
        if type(a) is not int or not last <= a <= n:
            raise PatchValidationError(e.get("name", "<unnamed>"), f"{where}: entry placed after {a!r} of the "
                                       f"{n} dense table tensors (after {last} before it)", kept=kept)
        last = a


#: catalogues this process saw go through a channel whole, by fingerprint, the last few
_KNOWN: "collections.OrderedDict[str, Catalog]" = collections.OrderedDict()
_KNOWN_MAX = 4
_KNOWN_LOCK = threading.Lock()


def remember(numbering: "Catalog | CatalogBuilder | None") -> Catalog | None:
    """Keep a channel's catalogue (:attr:`~delta_sync.channel.Channel.numbering`) for later channels
    of this process: a trainer that connects again (a new session, a channel dropped after a
    failure) finds the engines still numbering by it (they keep theirs, see :func:`known`) and goes on
    sending whole tensors and deltas by id. Returns it, numbered."""
    if numbering is None:
        return None
    catalog = numbering.build() if isinstance(numbering, CatalogBuilder) else numbering
    with _KNOWN_LOCK:
        _KNOWN[catalog.fingerprint] = catalog
        _KNOWN.move_to_end(catalog.fingerprint)
        while len(_KNOWN) > _KNOWN_MAX:
            _KNOWN.popitem(last=False)
    return catalog


def known(fingerprint: str | None) -> Catalog | None:
    """The catalogue with ``fingerprint`` this process remembers, else None."""
    with _KNOWN_LOCK:
        return _KNOWN.get(fingerprint) if fingerprint else None


def _check_numbering(table, catalog: Catalog | None, what: str, where: str, kept: str | None, then: str) -> None:
    """A received bucket's ``what`` (a dict) numbers tensors by ``catalog``, or the receiver cannot
    tell which (:class:`NeedsSeed`, saying ``then``)."""
    if not isinstance(table, dict):
        raise PatchValidationError("<bucket table>", f"{where}: malformed {what}", kept=kept)
    if catalog is None or table.get("catalog") != catalog.fingerprint:
        have = "no catalogue (no whole bulk update went through this channel)" if catalog is None else \
            f"catalogue {catalog.fingerprint}"
        raise NeedsSeed(f"{where}: its {what} numbers tensors by catalogue {table.get('catalog')!r}, this receiver "
                        f"has {have}: {then}", kept=kept)


def _check_ids(ids: torch.Tensor, catalog: Catalog, what: str, where: str, kept: str | None,
               counts: torch.Tensor | None = None) -> int | None:
    """A received table's ids name catalogued tensors, each once, in increasing order; with
    ``counts`` (each entry's elements), every entry holds some. Returns their sum. One read of the
    columns' facts (host columns of the header, where they are not a device's)."""
    facts = [ids.min(), ids.max(), (ids[1:] <= ids[:-1]).any()]
    if counts is not None:
        facts += [(counts <= 0).any(), counts.sum()]
    lo, hi, unordered, *rest = torch.stack([f.to(torch.int64) for f in facts]).tolist()
    if lo < 0 or hi >= len(catalog) or unordered:
        raise PatchValidationError("<bucket table>", f"{where}: {what} ids must increase strictly within the "
                                   f"{len(catalog)} catalogued tensors", kept=kept)
    if counts is None:
        return None
    if rest[0]:
        raise PatchValidationError("<bucket table>", f"{where}: a table entry without elements", kept=kept)
    return rest[1]


def _per_dtype(codes: torch.Tensor, counts: torch.Tensor) -> dict[str, int]:
    """A table's elements per dtype name (its entries' catalogue dtype ``codes``, ``counts`` each)."""
    return {CODES[c]: int(counts[codes == c].sum()) for c in codes.unique().tolist()}


def starts_by_dtype(codes: torch.Tensor, counts: torch.Tensor, code_list: list[int] | None = None) -> torch.Tensor:
    """Where each of a table's entries (dtype ``codes``, ``counts`` elements) starts in its dtype's
    value buffer: after the entries of that dtype before it."""
    out = torch.empty_like(counts)
    for code in codes.unique().tolist() if code_list is None else code_list:
        mask = codes == code
        c = counts[mask]
        out[mask] = torch.cumsum(c, 0) - c
    return out


def encode_table(catalog: Catalog, ids: list[int], counts: list[int]) -> dict:
    """A bucket header's ``table``."""
    return {"catalog": catalog.fingerprint, "ids": _b64(ids), "counts": _b64(counts)}


def encode_dense(catalog: Catalog, ids: list[int], digests: torch.Tensor) -> dict:
    """A bulk bucket header's ``dense`` table: whole tensors ``ids`` and their masked digests
    ((n, lanes) residues, each below 2**15)."""
    raw = digests.to(torch.int16).numpy().astype("<i2").tobytes()
    return {"catalog": catalog.fingerprint, "ids": _b64(ids), "digests": base64.b64encode(raw).decode()}


def _b64(values: list[int]) -> str:
    return base64.b64encode(array.array("i", values).tobytes()).decode()


def _ints(text, what: str, where: str) -> torch.Tensor:
    try:
        raw = base64.b64decode(text, validate=True)
    except (TypeError, ValueError):
        raise PatchValidationError("<bucket table>", f"{where}: table {what} are not base64") from None
    if len(raw) % 4:
        raise PatchValidationError("<bucket table>", f"{where}: table {what} are not int32 ({len(raw)} bytes)")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).to(torch.int64)


class TableSlice:
    """One bucket's table: entry ``k`` is tensor ``ids[k]``'s next ``counts[k]`` changed elements,
    its int32 indices at ``index_starts[k]`` of :attr:`indices` and its values at
    ``value_starts[k]`` of its dtype's buffer in :attr:`values`."""

    def __init__(self, catalog: Catalog, ids: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor,
                 values: dict[str, torch.Tensor], where: str, codes: torch.Tensor | None = None):
        self.catalog, self.ids, self.counts, self.where = catalog, ids, counts, where
        self.indices, self.values = indices, values
        #: what a receiver worked out from this table while it still lay where it arrived, kept with
        #: it: ``(key, work)``, used where the key still holds (e.g. an engine's routed positions)
        self.routed: tuple | None = None
        self.codes = catalog.codes[ids] if codes is None else codes
        self.index_starts = torch.cumsum(counts, 0) - counts
        one = catalog.one_code
        self.code_list = [one] if one is not None else self.codes.unique().tolist()  # the element dtypes present
        # (one dtype: each entry's values start where its indices do)
        self.value_starts = self.index_starts if one is not None else starts_by_dtype(self.codes, counts, self.code_list)

    @classmethod
    def parse(cls, table, catalog: Catalog | None, indices: torch.Tensor, values: dict[str, torch.Tensor],
              where: str, kept: str | None) -> "TableSlice":
        """The table of a received bucket (``indices`` / ``values``: its whole buffers, whose ends
        hold the table's), its ids, counts and extent checked; its indices and values are checked by
        the caller."""
        _check_numbering(table, catalog, "table", where, kept, "the tensors it numbers are not known here")
        ids, counts = _ints(table.get("ids"), "ids", where), _ints(table.get("counts"), "counts", where)
        if ids.numel() != counts.numel() or not ids.numel():
            raise PatchValidationError("<bucket table>", f"{where}: {ids.numel()} ids, {counts.numel()} counts",
                                       kept=kept)
        total = _check_ids(ids, catalog, "table", where, kept, counts)
        codes = catalog.codes[ids]
        one = catalog.one_code  # (every entry of that dtype: the checks' sum is its count)
        per_dtype = {CODES[one]: total} if one is not None else _per_dtype(codes, counts)
        n_idx = sum(per_dtype.values())
        if n_idx > indices.numel() or any(k not in values or n > values[k].numel() for k, n in per_dtype.items()):
            raise PatchValidationError("<bucket table>", f"{where}: the table's {n_idx} elements "
                                       f"{per_dtype} overrun the buffers", kept=kept)
        return cls(catalog, ids, counts, indices[indices.numel() - n_idx:],
                   {k: values[k][values[k].numel() - n:] for k, n in per_dtype.items()}, where, codes)

    def staged(self, device: torch.device) -> "TableSlice":
        """This table with its indices and values copied into ``device`` memory (pinned where
        ``device`` is the host and they are not): where an engine keeps a delta it received on its
        device until finish, so the device holds a bucket in flight, not the whole delta."""
        device = torch.device(device)
        if self.indices.device == device:
            return self

        def copy(t: torch.Tensor) -> torch.Tensor:  # (blocking: the plan reads them on the host next)
            return accelerator.to_host(t) if device.type == "cpu" else t.to(device)

        out = _copy.copy(self)  # (its host columns as they are)
        out.indices, out.values = copy(self.indices), {k: copy(v) for k, v in self.values.items()}
        return out

    @property
    def value_counts(self) -> dict[str, int]:
        return {k: v.numel() for k, v in self.values.items()}

    def entries(self, which: torch.Tensor | None = None) -> list[dict]:
        """The table's entries (or those at positions ``which``) as JSON entries would state them."""
        rows = range(self.ids.numel()) if which is None else which.tolist()
        ids, counts = self.ids.tolist(), self.counts.tolist()
        istart, vstart = self.index_starts.tolist(), self.value_starts.tolist()
        cat = self.catalog
        return [{"name": cat.names[ids[k]], "dtype": cat.dtypes[ids[k]], "shape": list(cat.shapes[ids[k]]),
                 "encoding": "sparse", "count": counts[k], "start": 0, "index_offset": istart[k],
                 "value_offset": vstart[k]} for k in rows]

    def patches(self, which: torch.Tensor | None = None) -> list[tuple[dict, Patch]]:
        """``(entry, patch)`` per table entry (or those at ``which``): each one's slices of the buffers."""
        out = []
        for e in self.entries(which):
            n = e["count"]
            out.append((e, Patch(e["name"], tuple(e["shape"]), DTYPES[e["dtype"]],
                                 self.indices[e["index_offset"]:e["index_offset"] + n],
                                 self.values[e["dtype"]][e["value_offset"]:e["value_offset"] + n])))
        return out


class DenseTable:
    """One bulk bucket's dense table: entry ``k`` is every element of catalogued tensor ``ids[k]``,
    its values at ``value_starts[k]`` of its dtype's slice in :attr:`values` (the end of that value
    buffer), ``digests[k]`` the sender's keyed digest of them, masked with the pad of header
    position ``first + k`` (the JSON entries hold positions ``0 .. first - 1``)."""

    def __init__(self, catalog: Catalog, ids: torch.Tensor, digests: torch.Tensor, values: dict[str, torch.Tensor],
                 first: int, where: str, key):
        self.catalog, self.ids, self.digests, self.values = catalog, ids, digests, values
        self.first, self.where, self.key = first, where, key
        self.codes = catalog.codes[ids]
        self.counts = catalog.numel[ids]
        self.code_list = self.codes.unique().tolist()
        self.value_starts = starts_by_dtype(self.codes, self.counts, self.code_list)

    @classmethod
    def parse(cls, table, catalog: Catalog | None, values: dict[str, torch.Tensor], first: int, where: str,
              kept: str | None, key) -> "DenseTable":
        """The dense table of a received bulk bucket whose JSON entries hold ``first`` header positions
        (``values``: its whole value buffers, whose ends hold the table's): ids, digests and the
        values' extent checked. The digests are checked by whoever reads the values."""
        _check_numbering(table, catalog, "dense table", where, kept,
                         "the sender must send them by name (it does after a failed update)")
        ids = _ints(table.get("ids"), "ids", where)
        try:
            raw = base64.b64decode(table.get("digests"), validate=True)
        except (TypeError, ValueError):
            raise PatchValidationError("<bucket table>", f"{where}: dense table digests are not base64",
                                       kept=kept) from None
        lanes = len(PRIMES)
        if not ids.numel() or len(raw) != 2 * lanes * ids.numel():
            raise PatchValidationError("<bucket table>", f"{where}: {ids.numel()} dense table ids, "
                                       f"{len(raw)} bytes of digests", kept=kept)
        _check_ids(ids, catalog, "dense table", where, kept)
        digests = torch.from_numpy(np.frombuffer(raw, dtype="<i2").astype(np.int64)).view(-1, lanes)
        per_dtype = _per_dtype(catalog.codes[ids], catalog.numel[ids])
        if any(k not in values or n > values[k].numel() for k, n in per_dtype.items()):
            raise PatchValidationError("<bucket table>", f"{where}: the dense table's tensors {per_dtype} "
                                       f"overrun the value buffers", kept=kept)
        return cls(catalog, ids, digests, {k: values[k][values[k].numel() - n:] for k, n in per_dtype.items()},
                   first, where, key)

    @property
    def value_counts(self) -> dict[str, int]:
        return {k: v.numel() for k, v in self.values.items()}

    def patches(self, which: list[int] | None = None) -> list[tuple[dict, Patch]]:
        """``(entry, patch)`` per tensor (or those at positions ``which``), as a JSON dense entry would
        state it (its digest text, key and header position for :func:`delta_sync.bucket.check_dense_entry`),
        the patch a view of its values: for receivers that take bulk buckets entry by entry."""
        cat, texts = self.catalog, digest_texts(self.digests)
        starts, counts, ids = self.value_starts.tolist(), self.counts.tolist(), self.ids.tolist()
        out = []
        for k in range(len(ids)) if which is None else which:
            i = ids[k]
            dname, n = cat.dtypes[i], counts[k]
            e = {"name": cat.names[i], "dtype": dname, "shape": list(cat.shapes[i]), "encoding": "dense", "count": n,
                 "start": 0, "digest": texts[k], "_where": self.where, "_key": self.key, "_at": self.first + k}
            out.append((e, Patch(e["name"], cat.shapes[i], DTYPES[dname], None,
                                 self.values[dname].narrow(0, starts[k], n))))
        return out
