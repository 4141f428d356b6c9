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
"""

from __future__ import annotations

import base64
import copy as _copy
import hashlib
import math

import torch

from . import accelerator
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
        # "name|d0,d1|dtype\n" per tensor (what engines and trainers of every version compare)
        h = hashlib.blake2b(digest_size=12)
        for n, s, d in zip(names, shapes, dtypes):
            h.update(f"{n}|{','.join(map(str, s))}|{d}\n".encode())
        self.fingerprint = h.hexdigest()

    def __len__(self) -> int:
        return len(self.names)

    def id_of(self, name: str, shape: tuple[int, ...], dname: str) -> int | None:
        """The id of ``name`` where it is catalogued with this shape and dtype, else None."""
        i = self.ids.get(name)
        return i if i is not None and self.shapes[i] == shape and self.dtypes[i] == dname else None


class CatalogBuilder:
    """Tensors in the order they first appear in a bulk update's buckets: each bucket's entries
    are noted as they come (a list per bucket) and numbered only when :meth:`build` is called, so
    a full-mode channel, which never sends a delta, never hashes a catalogue."""

    def __init__(self):
        self._buckets: list[list[tuple]] = []

    def see_entries(self, entries: list[dict]) -> None:
        """A checked bucket's entries: their ``name``, ``shape``, ``dtype`` (not the entries, whose
        private fields hold the bucket's digest key)."""
        self._buckets.append([(e["name"], e["shape"], e["dtype"]) for e in entries])

    def build(self) -> Catalog:
        first: dict[str, tuple] = {}  # each name's first entry (a tensor split over buckets comes again)
        for entries in self._buckets:
            for name, shape, dname in entries:
                if name not in first:
                    first[name] = (shape, dname)
        shapes, dtypes = zip(*first.values()) if first else ((), ())
        return Catalog(list(first), [tuple(map(int, s)) for s in shapes], list(dtypes))


def encode_table(catalog: Catalog, ids: list[int], counts: list[int]) -> dict:
    """A bucket header's ``table``."""
    return {"catalog": catalog.fingerprint, "ids": _b64(ids), "counts": _b64(counts)}


def _b64(values: list[int]) -> str:
    return base64.b64encode(torch.tensor(values, dtype=torch.int32).numpy().tobytes()).decode()


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
        self.value_starts = torch.empty_like(counts)
        self.code_list = self.codes.unique().tolist()  # the element dtypes present, as catalogue codes
        for code in self.code_list:
            mask = self.codes == code
            c = counts[mask]
            self.value_starts[mask] = torch.cumsum(c, 0) - c

    @classmethod
    def parse(cls, table, catalog: Catalog | None, indices: torch.Tensor, values: dict[str, torch.Tensor],
              where: str, kept: str | None) -> "TableSlice":
        """The table of a received bucket (``indices`` / ``values``: its whole buffers, whose ends
        hold the table's), its ids, counts and extent checked; its indices and values are checked by
        the caller."""
        if not isinstance(table, dict):
            raise PatchValidationError("<bucket table>", f"{where}: malformed table", kept=kept)
        if catalog is None or table.get("catalog") != catalog.fingerprint:
            have = "no catalogue (no seed went through this channel)" if catalog is None else \
                f"catalogue {catalog.fingerprint}"
            raise NeedsSeed(f"{where} names tensors by catalogue {table.get('catalog')!r}, this receiver has "
                            f"{have}: the tensors it numbers are not known here", kept=kept)
        ids, counts = _ints(table.get("ids"), "ids", where), _ints(table.get("counts"), "counts", where)
        if ids.numel() != counts.numel() or not ids.numel():
            raise PatchValidationError("<bucket table>", f"{where}: {ids.numel()} ids, {counts.numel()} counts",
                                       kept=kept)
        if int(ids.min()) < 0 or int(ids.max()) >= len(catalog) or bool((ids[1:] <= ids[:-1]).any()):
            raise PatchValidationError("<bucket table>", f"{where}: table ids must increase strictly within "
                                       f"the {len(catalog)} catalogued tensors", kept=kept)
        if bool((counts <= 0).any()):
            raise PatchValidationError("<bucket table>", f"{where}: a table entry without elements", kept=kept)
        n_idx = int(counts.sum())
        codes = catalog.codes[ids]
        per_dtype = {CODES[c]: int(counts[codes == c].sum()) for c in codes.unique().tolist()}
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
