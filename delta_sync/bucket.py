"""Packed bucket wire format.

A bucket is a small JSON header plus one ``int32`` index buffer and one value buffer per dtype::

    header = {version, seq, last, kind, entries: [{name, dtype, shape, encoding, count, start,
              index_offset, value_offset}], index_count, value_counts: {dtype: n}, checksum}

``encoding`` is ``sparse`` (``count`` indices + values) or ``dense`` (``count`` values for flat
elements ``start .. start+count-1``). A tensor larger than the room left in a bucket is split
into several entries, across buckets, by index range; the receiver concatenates them. The
checksum covers every payload byte. Buckets are bounded by ``max_bytes`` (default 512 MiB) of
payload, so a 30B seed streams through fixed memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch

from .digest import checksum_bytes
from .errors import ChecksumMismatch, PatchValidationError
from .patch import DTYPES, Patch, dtype_name

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class Bucket:
    header: dict
    indices: torch.Tensor  # int32
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # dtype name -> 1-D values

    @property
    def payload_bytes(self) -> int:
        return self.indices.numel() * 4 + sum(v.numel() * v.element_size() for v in self.values.values())

    def payload_checksum(self) -> str:
        parts = [self.indices.reshape(-1).view(torch.uint8)]
        parts += [self.values[k].reshape(-1).view(torch.uint8) for k in sorted(self.values)]
        return checksum_bytes(*parts)

    def header_bytes(self) -> bytes:
        return json.dumps(self.header, separators=(",", ":")).encode()


class BucketPacker:
    """Packs patches (in export order) into bounded buckets for one version."""

    def __init__(self, version: int, kind: str, max_bytes: int = DEFAULT_BUCKET_BYTES,
                 checksum: bool = True):
        if max_bytes < 64:
            raise ValueError(f"bucket size {max_bytes} B is too small")
        self.version, self.kind, self.max_bytes, self.checksum = version, kind, max_bytes, checksum
        self.seq = 0

    def pack(self, patches: Iterable[Patch]) -> Iterator[Bucket]:
        """Yield buckets; the last one has ``header['last'] = True`` (possibly with no entries)."""
        entries: list[dict] = []
        idx_parts: list[torch.Tensor] = []
        val_parts: dict[str, list[torch.Tensor]] = {}
        counts = {"idx": 0, "bytes": 0, "vals": {}}

        def flush(last: bool) -> Bucket:
            idx = torch.cat(idx_parts) if idx_parts else torch.empty(0, dtype=torch.int32)
            vals = {k: torch.cat(v) for k, v in val_parts.items()}
            header = {"version": self.version, "seq": self.seq, "last": last, "kind": self.kind,
                      "entries": list(entries), "index_count": int(idx.numel()),
                      "value_counts": {k: int(v.numel()) for k, v in vals.items()}}
            b = Bucket(header, idx, vals)
            header["checksum"] = b.payload_checksum() if self.checksum else None
            self.seq += 1
            entries.clear(), idx_parts.clear(), val_parts.clear()
            counts.update(idx=0, bytes=0, vals={})
            return b

        for p in patches:
            dname = dtype_name(p.dtype, tensor=p.name)
            esize = p.values.element_size()
            per = esize if p.dense else esize + 4
            total = p.count
            if total == 0 and not p.dense:
                continue  # nothing changed: no entry at all
            done = 0
            while True:
                room = (self.max_bytes - counts["bytes"]) // per
                if room <= 0 and done < total:
                    yield flush(False)
                    continue
                take = min(room, total - done)
                vo = counts["vals"].get(dname, 0)
                entries.append({"name": p.name, "dtype": dname, "shape": list(p.shape),
                                "encoding": "dense" if p.dense else "sparse", "count": take,
                                "start": done if p.dense else 0, "index_offset": counts["idx"],
                                "value_offset": vo})
                if not p.dense:
                    idx_parts.append(p.indices[done:done + take])
                    counts["idx"] += take
                val_parts.setdefault(dname, []).append(p.values[done:done + take])
                counts["vals"][dname] = vo + take
                counts["bytes"] += take * per
                done += take
                if done >= total:
                    break
        yield flush(True)


def parse_header(raw: bytes) -> dict:
    try:
        h = json.loads(raw)
        for key in ("version", "seq", "last", "kind", "entries", "index_count", "value_counts"):
            h[key]
        return h
    except (ValueError, KeyError, TypeError) as e:
        raise PatchValidationError("<bucket header>", f"malformed header: {e}") from None


def entry_patches(bucket: Bucket, kept: str | None = None) -> list[tuple[dict, Patch]]:
    """Split a received bucket into per-entry patches after checking its checksum and bounds.

    Dense entries become ``Patch`` objects with ``indices=None`` and values for the entry's
    ``[start, start+count)`` range (the caller joins ranges of one tensor).
    """
    h = bucket.header
    if h.get("checksum") is not None:
        got = bucket.payload_checksum()
        if got != h["checksum"]:
            raise ChecksumMismatch(f"bucket {h['seq']} of version {h['version']}: payload checksum "
                                   f"{got} != header {h['checksum']}", kept=kept)
    out = []
    for e in h["entries"]:
        name = e.get("name", "<unnamed>")
        if e.get("dtype") not in DTYPES:
            raise PatchValidationError(name, f"unknown dtype {e.get('dtype')!r}", kept=kept)
        if e.get("encoding") not in ("sparse", "dense"):
            raise PatchValidationError(name, f"unknown encoding {e.get('encoding')!r}", kept=kept)
        vals_all = bucket.values.get(e["dtype"])
        n, vo = int(e["count"]), int(e["value_offset"])
        if n < 0 or vals_all is None or vo < 0 or vo + n > vals_all.numel():
            raise PatchValidationError(name, f"entry points outside the {e['dtype']} value buffer", kept=kept)
        vals = vals_all[vo:vo + n]
        shape = tuple(int(s) for s in e["shape"])
        if e["encoding"] == "sparse":
            io = int(e["index_offset"])
            if io < 0 or io + n > bucket.indices.numel():
                raise PatchValidationError(name, "entry points outside the index buffer", kept=kept)
            p = Patch(name, shape, DTYPES[e["dtype"]], bucket.indices[io:io + n], vals)
        else:
            p = Patch(name, shape, DTYPES[e["dtype"]], None, vals)
        out.append((e, p))
    return out


class TensorAssembler:
    """Joins the entries of one version back into one patch per tensor, in arrival order."""

    def __init__(self, kept: str | None = None):
        self.kept = kept
        self._parts: dict[str, list[tuple[dict, Patch]]] = {}

    def add(self, bucket: Bucket) -> None:
        for e, p in entry_patches(bucket, self.kept):
            self._parts.setdefault(p.name, []).append((e, p))

    def patches(self) -> list[Patch]:
        out = []
        for name, parts in self._parts.items():
            first = parts[0][1]
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
                idx = torch.cat([p.indices for _, p in parts]) if len(parts) > 1 else first.indices
                vals = torch.cat([p.values for _, p in parts]) if len(parts) > 1 else first.values
                out.append(Patch(name, first.shape, first.dtype, idx, vals))
        return out
