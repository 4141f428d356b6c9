"""Ordered gather of patches from every trainer rank to one rank (the sender).

Protocol, per exchange, over the trainer's groups (:class:`~delta_sync.collectives.TrainerGroups`):

1. **status + sizes** (host group, one ``all_gather`` of 3 int64 per rank): ``[failed,
   payload_bytes, meta_bytes]``. A rank whose local work raised reports ``failed=1``; then every
   rank takes the same branch: the failure messages are exchanged with ``all_gather_object`` and
   every rank raises the same :class:`GatherError`. No rank ever waits in a collective another
   rank skipped.
2. **payloads** (device group, point-to-point, exact lengths): each non-empty rank packs its
   patches into one byte buffer on the trainer's device (JSON meta | int32 indices | values) and
   sends it once; empty ranks send nothing. The destination receives into one reused buffer,
   grown only when needed.

The destination gets the patches in export order (``seq``); a tensor whose changes come from
several ranks (shards of one tensor) is merged into one patch with increasing indices.

:meth:`PatchGather.gather` is one exchange of everything. :meth:`PatchGather.stream` cuts the
export order into *rounds* of about ``bucket_bytes`` of payload over all ranks (every part of one
tensor in the same round) and runs one exchange per round, as the destination's consumer (the
bucket packer) asks for them: the destination then holds its own patches and one round of the
others', not the whole delta of every rank.
"""

from __future__ import annotations

import json
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import collectives
from .collectives import TrainerGroups
from .errors import GatherError, PatchValidationError
from .patch import DTYPES, Patch, dtype_name


#: what a failed gather kept, unless its caller knows more
_KEPT = "trainer snapshot at the last committed version"


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
        items, failure = self._produce(produce)
        return self._exchange(items, failure)

    def stream(self, produce: Callable[[], list[Ordered]] | list[Ordered], bucket_bytes: int) -> "GatherStream":
        """Run ``produce`` on every rank and plan the rounds that gather the patches to ``dst``,
        each of about ``bucket_bytes`` of payload over all ranks (a tensor whose patches are larger
        is a round of its own). Collective; raises :class:`GatherError` on every rank if any rank's
        ``produce`` failed. The rounds run as :class:`GatherStream` is read (``dst``) or finished."""
        items, failure = self._produce(produce)
        rows = self._agree([sum(it.patch.nbytes for it in items), bucket_bytes], failure)
        bucket_bytes = int(rows[self.dst, 2])  # the destination's, should the ranks' settings differ
        items.sort(key=lambda it: it.seq)
        if self.groups.world == 1 or int(rows[:, 1].sum()) <= bucket_bytes:
            return GatherStream(self, items, [None])
        sizes = collectives.all_gather_object([(it.seq, it.patch.nbytes) for it in items], self.groups.host_group)
        return GatherStream(self, items, round_bounds([x for rank in sizes for x in rank], bucket_bytes))

    @staticmethod
    def _produce(produce) -> tuple[list[Ordered], tuple[str, str] | None]:
        try:
            return (produce() if callable(produce) else list(produce)), None
        except Exception as e:  # noqa: BLE001 - becomes the same GatherError on every rank
            return [], (f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))

    def _agree(self, values: list[int], failure: tuple[str, str] | None,
               kept: str | None = _KEPT) -> torch.Tensor:
        """``[failed, *values]`` of every rank as a ``(world, 1 + len(values))`` tensor; the same
        :class:`GatherError` on every rank if any rank brought a failure (``kept``: None where the
        caller knows better, e.g. a round of a delta whose engines had started)."""
        g = self.groups
        status = torch.tensor([1 if failure else 0, *values], dtype=torch.int64)
        rows = torch.empty(g.world * status.numel(), dtype=torch.int64)
        collectives.all_gather_into_tensor(rows, status, g.host_group)
        rows = rows.view(g.world, status.numel())
        if int(rows[:, 0].sum()):
            msgs = collectives.all_gather_object(failure[0] if failure else None, g.host_group)
            err = GatherError({r: m for r, m in enumerate(msgs) if m is not None}, kept=kept)
            if failure and failure[1]:
                err.__notes__ = [failure[1]]  # type: ignore[attr-defined]
            raise err
        return rows

    def _exchange(self, items: list[Ordered], failure: tuple[str, str] | None = None,
                  kept: str | None = _KEPT) -> list[Patch] | None:
        """One exchange of ``items`` (this rank's) to ``dst``: the ordered, merged patches there."""
        g = self.groups
        rank, world = g.rank, g.world
        buf = torch.empty(0, dtype=torch.uint8, device=g.device)
        meta_bytes = 0
        if failure is None and rank != self.dst and items:
            try:
                buf, meta_bytes = _pack(items, g.device)
            except Exception as e:  # noqa: BLE001 - becomes the same GatherError on every rank
                failure = (f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))
        sizes = self._agree([buf.numel(), meta_bytes], failure, kept)
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


def round_bounds(sizes: list[tuple[int, int]], bucket_bytes: int) -> list[int | None]:
    """Rounds of a streamed gather from every rank's ``(seq, payload bytes)``: the exclusive upper
    ``seq`` of each round, ``None`` for the last. A round closes before the tensor that would take
    it past ``bucket_bytes``; the parts of one tensor (``seq``) on several ranks share a round."""
    per_seq: dict[int, int] = {}
    for seq, n in sizes:
        per_seq[seq] = per_seq.get(seq, 0) + n
    bounds: list[int | None] = []
    held = 0
    for seq in sorted(per_seq):
        if held and held + per_seq[seq] > bucket_bytes:
            bounds.append(seq)
            held = 0
        held += per_seq[seq]
    return bounds + [None]


class GatherStream:
    """The rounds of :meth:`PatchGather.stream`. On ``dst``, iterating yields the merged patches in
    export order, one exchange per round; every other rank calls :meth:`finish`, which runs its
    sends. ``dst`` calls :meth:`finish` too once it stops reading (done, or its consumer failed):
    with ``failure`` the next round carries it, so every rank raises the same :class:`GatherError`
    there instead of sending the rest. A :class:`GatherError` ends the stream on every rank at once
    (it came out of the same collective)."""

    def __init__(self, gatherer: PatchGather, items: list[Ordered], bounds: list[int | None]):
        self._g = gatherer
        self._items = deque(items)  # this rank's, by seq
        self._bounds = deque(bounds)
        self.rounds = len(bounds)
        #: most payload bytes one round brought to ``dst`` from the other ranks
        self.peak_round_bytes = 0

    def _round(self, failure: tuple[str, str] | None = None) -> list[Patch] | None:
        bound = self._bounds.popleft()
        mine = []
        while self._items and (bound is None or self._items[0].seq < bound):
            mine.append(self._items.popleft())  # sent (or merged) once: not held past its round
        try:
            got = self._g._exchange(mine, failure, kept=None)  # the caller says what was kept
        except GatherError:
            self._bounds.clear()
            self._items.clear()
            raise
        if got is not None:  # dst: the round's patches less its own are what the others sent
            others = sum(p.nbytes for p in got) - sum(it.patch.nbytes for it in mine)
            self.peak_round_bytes = max(self.peak_round_bytes, others)
        return got

    def __iter__(self) -> Iterator[Patch]:
        while self._bounds:
            yield from self._round() or []

    def finish(self, failure: BaseException | None = None) -> None:
        """Run the rounds not read yet (what arrives on ``dst`` is dropped); with ``failure``, end
        the stream with it on every rank (raises the :class:`GatherError` here too)."""
        if failure is not None and self._bounds:
            self._round((f"{type(failure).__name__}: {failure}", ""))
        while self._bounds:
            self._round()
