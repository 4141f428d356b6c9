"""Ordered gather of patches from every trainer rank to one rank (the sender).

Protocol, per call, over the trainer's groups (:class:`~delta_sync.collectives.TrainerGroups`):

1. **status + sizes** (host group, one ``all_gather`` of 3 int64 per rank): ``[failed,
   payload_bytes, meta_bytes]``. A rank whose local work raised reports ``failed=1``; then every
   rank takes the same branch: the failure messages are exchanged with ``all_gather_object`` and
   every rank raises the same :class:`GatherError`. No rank ever waits in a collective another
   rank skipped.
2. **payloads** (device group, point-to-point, exact lengths): each non-empty rank packs its
   patches into one byte buffer on the trainer's device (JSON meta | int32 indices | values) and
   sends it once; empty ranks send nothing. The destination receives into one reused buffer,
   grown only when needed.

The destination returns the patches in export order (``seq``); a tensor whose changes come from
several ranks (shards of one tensor) is merged into one patch with increasing indices.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from . import collectives
from .collectives import TrainerGroups
from .errors import GatherError, PatchValidationError
from .patch import DTYPES, Patch, dtype_name


@dataclass
class Ordered:
    """A patch with its position in the export order."""

    seq: int
    patch: Patch


def _pack(items: list[Ordered], device: torch.device) -> tuple[torch.Tensor, int]:
    meta, chunks, off = [], [], 0
    for it in items:
        p = it.patch
        entry = {"seq": it.seq, "name": p.name, "shape": list(p.shape), "dtype": dtype_name(p.dtype, tensor=p.name),
                 "count": p.count, "dense": p.dense}
        if not p.dense:
            b = p.indices.contiguous().view(torch.uint8)
            chunks.append(b)
            off += b.numel()
        v = p.values.contiguous().view(torch.uint8)
        chunks.append(v)
        off += v.numel()
        meta.append(entry)
    meta_b = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    buf = torch.cat([meta_b.to(device)] + [c.reshape(-1).to(device) for c in chunks]) if items else \
        torch.empty(0, dtype=torch.uint8, device=device)
    return buf, meta_b.numel()


def _unpack(buf: torch.Tensor, meta_bytes: int) -> list[Ordered]:
    meta = json.loads(bytes(buf[:meta_bytes].cpu().numpy()))
    out, off = [], meta_bytes
    for e in meta:
        dtype = DTYPES[e["dtype"]]
        esize = torch.empty(0, dtype=dtype).element_size()
        idx = None
        if not e["dense"]:
            n = e["count"] * 4
            idx = buf[off:off + n].clone().view(torch.int32)
            off += n
        n = e["count"] * esize
        vals = buf[off:off + n].clone().view(dtype)
        off += n
        out.append(Ordered(e["seq"], Patch(e["name"], tuple(e["shape"]), dtype, idx, vals)))
    return out


def merge_shards(parts: list[Patch]) -> Patch:
    """One patch from disjoint per-rank patches of the same tensor (indices re-sorted)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(p.dense for p in parts):
        raise PatchValidationError(first.name, f"dense patch from {len(parts)} ranks; a dense tensor has one owner")
    for p in parts[1:]:
        if p.shape != first.shape or p.dtype != first.dtype:
            raise PatchValidationError(first.name, f"shards disagree on shape/dtype: {first.shape}/{first.dtype} "
                                       f"vs {p.shape}/{p.dtype}")
    idx = torch.cat([p.indices for p in parts])
    vals = torch.cat([p.values for p in parts])
    order = torch.argsort(idx, stable=True)
    return Patch(first.name, first.shape, first.dtype, idx[order], vals[order])


class PatchGather:
    """Reusable gatherer. On the host it keeps its receive buffer across updates (freed host memory
    comes back as fresh pages that fault on first touch); on a device it lets it go after each
    gather, as the channel's bucket arenas do: the caching allocator reuses the block, and the
    largest delta ever gathered must not stay resident on rank 0's device between updates."""

    def __init__(self, groups: TrainerGroups | None = None, dst: int = 0):
        self.groups = groups or TrainerGroups.around(None)
        self.dst = dst
        self._recv: torch.Tensor | None = None

    def _buffer(self, n: int) -> torch.Tensor:
        if self._recv is None or self._recv.numel() < n:
            self._recv = torch.empty(n, dtype=torch.uint8, device=self.groups.device)
        return self._recv[:n]

    def gather(self, produce: Callable[[], list[Ordered]] | list[Ordered]) -> list[Patch] | None:
        """Run ``produce`` (or take a ready list) and gather every rank's patches to ``dst``.

        Returns the ordered, merged patches on ``dst`` and ``None`` elsewhere; raises
        :class:`GatherError` on every rank if any rank failed.
        """
        g = self.groups
        rank, world = g.rank, g.world
        error = None
        items: list[Ordered] = []
        buf = torch.empty(0, dtype=torch.uint8, device=g.device)
        meta_bytes = 0
        try:
            items = produce() if callable(produce) else list(produce)
            if rank != self.dst and items:
                buf, meta_bytes = _pack(items, g.device)
        except Exception as e:  # becomes the same GatherError on every rank
            error = f"{type(e).__name__}: {e}"
            tb = traceback.format_exc(limit=4)
        status = torch.tensor([1 if error else 0, buf.numel(), meta_bytes], dtype=torch.int64)
        sizes = torch.empty(world * 3, dtype=torch.int64)
        collectives.all_gather_into_tensor(sizes, status, g.host_group)
        sizes = sizes.view(world, 3)
        if int(sizes[:, 0].sum()):
            msgs = collectives.all_gather_object(error, g.host_group)
            failures = {r: m for r, m in enumerate(msgs) if m is not None}
            err = GatherError(failures, kept="trainer snapshot at the last committed version")
            if error:
                err.__notes__ = [tb]  # type: ignore[attr-defined]
            raise err
        if rank != self.dst:
            if buf.numel():
                collectives.send(buf, self.dst, g.device_group)
            return None
        received = [Ordered(it.seq, it.patch.to(g.device)) for it in items]  # one device for the merge
        try:
            for r in range(world):
                n, mb = int(sizes[r, 1]), int(sizes[r, 2])
                if r == self.dst or n == 0:
                    continue
                rb = self._buffer(n)
                collectives.recv(rb, r, g.device_group)
                received.extend(_unpack(rb, mb))  # copies out of the buffer
        finally:
            self._release()
        return order_and_merge(received)

    def _release(self) -> None:
        if self._recv is not None and self._recv.device.type != "cpu":
            self._recv = None


def order_and_merge(items: list[Ordered]) -> list[Patch]:
    by_seq: dict[int, list[Patch]] = {}
    for it in items:
        by_seq.setdefault(it.seq, []).append(it.patch)
    return [merge_shards(by_seq[s]) for s in sorted(by_seq)]
