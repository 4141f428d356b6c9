"""Ordered gather of patches from every trainer rank to one rank (the sender).

Protocol, per exchange, over the trainer's groups (:class:`~delta_sync.collectives.TrainerGroups`):

1. **status + sizes** (host group, one ``all_gather`` of 3 int64 per rank): ``[failed,
   payload_bytes, tensors]``. A rank whose local work raised reports ``failed=1``; then every
   rank takes the same branch: the failure messages are exchanged with ``all_gather_object`` and
   every rank raises the same :class:`GatherError`. No rank ever waits in a collective another
   rank skipped.
2. **payloads** (device group, point-to-point, exact lengths): each non-empty rank sends its
   patches once as one byte buffer on the trainer's device, a few sections rather than an object
   per tensor (:class:`_Part`: a binary row per tensor, shapes, names, the int32 indices and the
   values of each dtype one after another); empty ranks send nothing. The destination receives
   every rank into one reused buffer, grown only when needed.

The destination gets the patches in export order (``seq``): the rows of every rank are sorted
together, and each run of sparse tensors of one dtype that one rank holds comes out as one
:class:`~delta_sync.patch.PatchBatch`, however the ranks interleave (on the host one kernel call
copies its runs out of the ranks' buffers as they lie, on a device two gathers take them out of
the ranks' sections joined); a tensor whose changes come from several ranks (shards of one tensor)
is merged into one patch with increasing indices. Ranks may hand in batches (a diff kernel's, with
each tensor's ``seq``) or patches.

:meth:`PatchGather.gather` is one exchange of everything. :meth:`PatchGather.stream` cuts the
export order into *rounds* of about ``bucket_bytes`` of payload over all ranks (every part of one
tensor in the same round) and runs one exchange per round, as the destination's consumer (the
bucket packer) asks for them: the destination then holds its own patches and one round of the
others', not the whole delta of every rank.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from . import collectives, native
from .collectives import TrainerGroups
from .errors import DeltaSyncError, GatherError, PatchValidationError
from .patch import Patch, PatchBatch


#: what a failed gather kept, unless its caller knows more
_KEPT = "trainer snapshot at the last committed version"


@dataclass
class Ordered:
    """A patch with its position in the export order."""

    seq: int
    patch: Patch


#: value sections of a rank's buffer, widest first (each section stays aligned for its dtype)
_SECTIONS = (torch.float32, torch.bfloat16, torch.float16)
_CODE = {dt: c for c, dt in enumerate(_SECTIONS)}
_ROW = 4  # int64 per tensor: seq, count, dtype code | dense << 8, ndim
_SEP = "\0"


@dataclass
class _Part:
    """One rank's patches of an exchange as a few buffers, not an object per tensor: a row per
    tensor (``seq``, changed count, dtype code and dense flag, ndim), the shapes, the names, the
    sparse tensors' int32 indices one after another, and the values of each dtype one after
    another, all in row order. On the wire: ``rows | dims | indices | float32 | bfloat16 | float16
    values | names`` in one byte buffer."""

    rows: torch.Tensor  # int64 (n, _ROW), on the host
    names: list[str]
    shapes: list[tuple[int, ...]]
    indices: torch.Tensor  # int32
    values: dict[int, torch.Tensor]  # dtype code -> values of that dtype (every code)
    #: its buffers are the patches' own memory (this rank's), not views of a receive buffer
    owned: bool = True

    @property
    def n(self) -> int:
        return len(self.names)

    @classmethod
    def of(cls, items: list[Ordered], device: torch.device) -> "_Part":
        seqs, counts, codes, names, shapes = [], [], [], [], []
        indices: list[torch.Tensor] = []
        values: dict[int, list[torch.Tensor]] = {}
        for it in items:
            p = it.patch
            code = _CODE.get(p.dtype)
            if code is None:
                raise PatchValidationError(_name_of(p), f"dtype {p.dtype} cannot be gathered "
                                           f"(supported: {', '.join(map(str, _SECTIONS))})")
            if isinstance(p, PatchBatch):
                if p.seqs is None or len(p.seqs) != len(p.names):
                    raise PatchValidationError(_name_of(p), "a batch gathered without each tensor's stream position")
                seqs += p.seqs
                counts += p.counts
                codes += [code] * len(p.names)
                names += p.names
                shapes += p.shapes
            else:
                seqs.append(it.seq)
                counts.append(p.count)
                codes.append(code | (256 if p.dense else 0))
                names.append(p.name)
                shapes.append(tuple(p.shape))
            if not p.dense:
                indices.append(p.indices.reshape(-1).to(device))
            values.setdefault(code, []).append(p.values.reshape(-1).to(device))
        rows = torch.tensor([seqs, counts, codes, [len(s) for s in shapes]], dtype=torch.int64).t().contiguous() \
            if names else torch.empty(0, _ROW, dtype=torch.int64)
        return cls(rows.view(-1, _ROW), names, shapes, _cat(indices, torch.int32, device),
                   {c: _cat(values.get(c, []), dt, device) for c, dt in enumerate(_SECTIONS)})

    def to_bytes(self, device: torch.device) -> torch.Tensor:
        """The part as one byte buffer on ``device`` (see the class doc)."""
        if not self.n:
            return torch.empty(0, dtype=torch.uint8, device=device)
        dims = torch.tensor([d for s in self.shapes for d in s], dtype=torch.int64)
        names = torch.frombuffer(bytearray(_SEP.join(self.names).encode()), dtype=torch.uint8)
        pieces = [self.rows.view(-1), dims, self.indices] + [self.values[c] for c in range(len(_SECTIONS))] + [names]
        return torch.cat([t.contiguous().view(torch.uint8).to(device) for t in pieces])

    @classmethod
    def from_bytes(cls, buf: torch.Tensor, n: int, rank: int) -> "_Part":
        """The part a rank sent (``n`` tensors): views of ``buf``, row data read to the host."""
        def bad(why: str) -> DeltaSyncError:  # (not a GatherError: only dst sees it, the next round tells the rest)
            return DeltaSyncError(f"the patches rank {rank} sent do not decode: {why}")

        off = n * _ROW * 8
        if off > buf.numel():
            raise bad(f"{buf.numel()} bytes for {n} rows")
        rows = buf[:off].view(torch.int64).view(n, _ROW).cpu()
        ndims = rows[:, 3]
        counts, codes, dense = rows[:, 1], rows[:, 2] & 255, rows[:, 2] >> 8
        if bool((counts < 0).any() or (codes >= len(_SECTIONS)).any() or (ndims < 0).any()):
            raise bad("a negative count or ndim, or an unknown dtype code")
        nd = int(ndims.sum())
        dims = buf[off:off + nd * 8].view(torch.int64).tolist()
        off += nd * 8
        it = iter(dims)
        shapes = [tuple(itertools.islice(it, k)) for k in ndims.tolist()]
        n_idx = int(counts[dense == 0].sum())
        indices = buf[off:off + n_idx * 4].view(torch.int32)
        off += n_idx * 4
        values = {}
        for c, dt in enumerate(_SECTIONS):
            size = int(counts[codes == c].sum()) * dt.itemsize
            values[c] = buf[off:off + size].view(dt)
            off += size
        if off > buf.numel():
            raise bad(f"{buf.numel()} bytes for rows that need {off} before the names")
        names = bytes(buf[off:].cpu().numpy()).decode().split(_SEP)
        if len(names) != n or len(shapes) != n:
            raise bad(f"{len(names)} names for {n} rows")
        return cls(rows, names, shapes, indices, values, owned=False)


def _pack(part: _Part, device: torch.device) -> torch.Tensor:
    """A rank's part as the bytes it sends (a seam for tests that fail it)."""
    return part.to_bytes(device)


def _sizes(items: list[Ordered]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stream positions and payload bytes of every tensor of ``items`` (int64, a batch's at once)."""
    seqs, nbytes = [], []
    for it in items:
        p = it.patch
        if isinstance(p, PatchBatch):
            seqs += p.seqs
            width = 4 + p.values.element_size()
            nbytes += [c * width for c in p.counts]
        else:
            seqs.append(it.seq)
            nbytes.append(p.nbytes)
    return torch.tensor(seqs, dtype=torch.int64), torch.tensor(nbytes, dtype=torch.int64)


def _name_of(p: Patch | PatchBatch) -> str:
    return p.names[0] if isinstance(p, PatchBatch) else p.name


def _cat(ts: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not ts:
        return torch.empty(0, dtype=dtype, device=device)
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _exclusive(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _section(held: list[tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """One section over the parts (``(tensor, owned)`` each), in memory of its own: a receive
    buffer is reused by the next exchange."""
    if len(held) == 1:
        t, owned = held[0]
        return t.contiguous() if owned else t.clone(memory_format=torch.contiguous_format)
    return torch.cat([t for t, _ in held])


#: runs of at least this many elements on average are cut out and joined, a copy each; shorter
#: ones are gathered through positions worked out per element (a MoE's few-element tensors)
CUT_RUN_ELEMENTS = 128


def _segments(src: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``src``'s segments ``[starts[k], starts[k] + counts[k])`` one after another: a view where
    they lie back to back already, else segments that follow each other in ``src`` taken as one
    run, and the runs joined (one copy each where they are long, one gather where short)."""
    total = int(counts.sum())
    first = int(starts[0])
    if bool((starts == first + _exclusive(counts)).all()):
        return src.narrow(0, first, total)
    new_run = torch.ones(len(counts), dtype=torch.bool)
    new_run[1:] = starts[1:] != starts[:-1] + counts[:-1]
    at = new_run.nonzero().squeeze(1)
    run_starts = starts[at]
    run_counts = torch.diff(_exclusive(counts)[at], append=torch.tensor([total]))
    if total >= CUT_RUN_ELEMENTS * len(at):
        return torch.cat([src.narrow(0, a, n) for a, n in zip(run_starts.tolist(), run_counts.tolist())])
    pos = torch.repeat_interleave(run_starts - _exclusive(run_counts), run_counts, output_size=total) + \
        torch.arange(total)
    return src[pos.to(src.device)]


def _merge(parts: list[_Part]) -> list[Patch | PatchBatch]:
    """The patches of every rank's part in stream order: runs of sparse tensors of one dtype held
    by one rank each as one :class:`PatchBatch` (whichever rank sent them: copied out of the parts'
    buffers by :class:`_RowsAt` on the host, else cut out of the parts' sections joined), a dense
    tensor as a patch, the parts of a tensor several ranks hold merged into one patch. Copies out
    of received buffers (they are reused); this rank's own may stay as views."""
    parts = [p for p in parts if p.n]
    if not parts:
        return []
    rows = torch.cat([p.rows for p in parts])
    names = [n for p in parts for n in p.names]
    shapes = [s for p in parts for s in p.shapes]
    seq, count, code, dense = rows[:, 0], rows[:, 1], rows[:, 2] & 255, (rows[:, 2] >> 8).bool()
    # every section is its parts' sections one after another, each in row order: a row's start
    # in a section is the exclusive sum of the counts of the section's rows before it
    idx_start = _exclusive(torch.where(dense, 0, count))
    val_start = torch.zeros_like(count)
    for c in range(len(_SECTIONS)):
        mine = code == c
        val_start[mine] = _exclusive(count[mine])
    rows_at = _RowsAt.of(parts, count, dense, code, idx_start, val_start)

    @functools.cache
    def sections() -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The parts' sections joined in memory of their own (made once, where a patch needs them)."""
        return (_section([(p.indices, p.owned) for p in parts]),
                {c: _section([(p.values[c], p.owned) for p in parts]) for c in range(len(_SECTIONS))})

    order = torch.argsort(seq, stable=True)
    s = seq[order]
    shared = torch.zeros(len(order), dtype=torch.bool)  # a tensor in more than one part
    if len(order) > 1:
        same = s[1:] == s[:-1]
        shared[1:] |= same
        shared[:-1] |= same
    alone = ~(shared | dense[order] | (count[order] == 0))  # (a batch holds changed tensors only)
    cut = torch.ones(len(order), dtype=torch.bool)
    if len(order) > 1:  # a batch runs while its tensors are sparse, held by one rank, of one dtype
        cut[1:] = ~(alone[1:] & alone[:-1] & (code[order][1:] == code[order][:-1]))
    bounds = cut.nonzero().squeeze(1).tolist() + [len(order)]
    order_l, alone_l = order.tolist(), alone.tolist()
    out: list[Patch | PatchBatch] = []
    k = 0
    while k < len(order_l):
        end = bounds[bisect.bisect_right(bounds, k)]
        ks = order[k:end]
        first = order_l[k]
        c = int(code[first])
        if alone_l[k]:
            counts = count[ks]
            if rows_at is not None:
                got = rows_at.gather(ks, counts, c)
            else:
                indices, values = sections()
                got = _segments(indices, idx_start[ks], counts), _segments(values[c], val_start[ks], counts)
            out.append(PatchBatch([names[i] for i in order_l[k:end]], [shapes[i] for i in order_l[k:end]],
                                  _SECTIONS[c], counts.tolist(), got[0], got[1], s[k:end].tolist()))
            k = end
            continue
        j = k + 1
        while j < len(order_l) and int(s[j]) == int(s[k]):
            j += 1  # every part of this tensor
        indices, values = sections()
        got = [_patch_of(i, names, shapes, count, code, dense, indices, idx_start, values, val_start)
               for i in order_l[k:j]]
        for p in got[1:]:
            if p.name != got[0].name:
                raise PatchValidationError(got[0].name, f"stream position {int(s[k])} is {p.name!r} on another "
                                           "rank: the ranks' streams disagree")
        out.append(merge_shards(got))
        k = j
    return out


@dataclass
class _RowsAt:
    """Where each row's indices and values lie in its own part's buffers (host parts, the host
    kernel present), so that a batch is taken from the parts as they are: one kernel call copying
    its runs (:func:`delta_sync.native.gather_runs`), or views where its rows lie back to back in
    this rank's own memory, without joining the parts' sections first."""

    parts: list[_Part]
    part: torch.Tensor  # int64 per row: its part
    idx_local: torch.Tensor  # int64 per row: its first index's position in its part's indices
    val_local: torch.Tensor  # int64 per row: its first value's position in its part's values of its dtype
    idx_ptr: torch.Tensor  # int64 per part: its indices' address
    val_ptr: dict[int, torch.Tensor]  # dtype code -> int64 per part: its values' address

    @classmethod
    def of(cls, parts: list[_Part], count: torch.Tensor, dense: torch.Tensor, code: torch.Tensor,
           idx_start: torch.Tensor, val_start: torch.Tensor) -> "_RowsAt | None":
        """None where the kernel cannot take the parts (not host memory, no kernel) or where a part's
        rows do not add up to its buffers (the kernel reads by address: the torch path then decides)."""
        bufs = [p.indices for p in parts] + [v for p in parts for v in p.values.values()]
        if native.kernel() is None or not all(b.device.type == "cpu" and b.is_contiguous() for b in bufs):
            return None
        part = torch.repeat_interleave(torch.arange(len(parts)), torch.tensor([p.n for p in parts]))

        def per_part(n: torch.Tensor) -> list[int]:
            return torch.zeros(len(parts), dtype=torch.int64).index_add_(0, part, n).tolist()
        # a row's start in its part: its start in the joined section less the earlier parts' elements
        sizes = [p.indices.numel() for p in parts]
        if per_part(torch.where(dense, 0, count)) != sizes:
            return None
        idx_before = _exclusive(torch.tensor(sizes, dtype=torch.int64))
        val_local = val_start.clone()
        for c in range(len(_SECTIONS)):
            mine = code == c
            sizes = [p.values[c].numel() for p in parts]
            if per_part(torch.where(mine, count, 0)) != sizes:
                return None
            val_local[mine] -= _exclusive(torch.tensor(sizes, dtype=torch.int64))[part[mine]]
        return cls(parts, part, idx_start - idx_before[part], val_local,
                   torch.tensor([p.indices.data_ptr() for p in parts], dtype=torch.int64),
                   {c: torch.tensor([p.values[c].data_ptr() for p in parts], dtype=torch.int64)
                    for c in range(len(_SECTIONS))})

    def gather(self, ks: torch.Tensor, counts: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The indices and values of rows ``ks`` (a batch: sparse, of dtype code ``c``), one after
        another: views where they lie back to back in this rank's own part, else copied out."""
        part, idx, val = self.part[ks], self.idx_local[ks], self.val_local[ks]
        total, dt = int(counts.sum()), _SECTIONS[c]
        first = self.parts[int(part[0])]
        if first.owned and bool((part == part[0]).all()) and bool((idx[1:] == idx[:-1] + counts[:-1]).all()) \
                and bool((val[1:] == val[:-1] + counts[:-1]).all()):
            return first.indices.narrow(0, int(idx[0]), total), first.values[c].narrow(0, int(val[0]), total)
        table = torch.stack([self.idx_ptr[part] + 4 * idx, self.val_ptr[c][part] + dt.itemsize * val, counts,
                             torch.zeros_like(counts)], dim=1).contiguous()
        return native.gather_runs(table, dt.itemsize, total, dt)


def _patch_of(i, names, shapes, count, code, dense, indices, idx_start, values, val_start) -> Patch:
    n, c = int(count[i]), int(code[i])
    v = values[c].narrow(0, int(val_start[i]), n)
    idx = None if bool(dense[i]) else indices.narrow(0, int(idx_start[i]), n)
    return Patch(names[i], shapes[i], _SECTIONS[c], idx, v)


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

        Returns the ordered, merged patches on ``dst`` (one per tensor) and ``None`` elsewhere;
        raises :class:`GatherError` on every rank if any rank failed.
        """
        items, failure = self._produce(produce)
        got = self._exchange(items, failure)  # (the merge orders every rank's rows)
        if got is None:
            return None
        return [q for p in got for q in (p.patches() if isinstance(p, PatchBatch) else [p])]

    def stream(self, produce: Callable[[], list[Ordered]] | list[Ordered], bucket_bytes: int) -> "GatherStream":
        """Run ``produce`` on every rank and plan the rounds that gather the patches to ``dst``,
        each of about ``bucket_bytes`` of payload over all ranks (a tensor whose patches are larger
        is a round of its own). Collective; raises :class:`GatherError` on every rank if any rank's
        ``produce`` failed. The rounds run as :class:`GatherStream` is read (``dst``) or finished."""
        items, failure = self._produce(produce)
        items.sort(key=lambda it: it.seq)
        sizes = (torch.empty(0, dtype=torch.int64),) * 2
        if failure is None:
            try:
                sizes = _sizes(items)
            except Exception as e:  # noqa: BLE001 - becomes the same GatherError on every rank
                items, failure = [], (f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))
        ends = int(sizes[0].max()) + 1 if sizes[0].numel() else 0
        rows = self._agree([int(sizes[1].sum()), bucket_bytes, ends], failure)
        bucket_bytes = int(rows[self.dst, 2])  # the destination's, should the ranks' settings differ
        if self.groups.world == 1 or int(rows[:, 1].sum()) <= bucket_bytes:
            return GatherStream(self, items, [None])
        # every tensor's bytes over all ranks, by stream position: one sum over the ranks
        per_seq = torch.zeros(int(rows[:, 3].max()), dtype=torch.int64)
        per_seq.index_add_(0, sizes[0], sizes[1])
        collectives.all_reduce(per_seq, self.groups.host_group)
        held = per_seq.nonzero().squeeze(1)
        return GatherStream(self, items, round_bounds(list(zip(held.tolist(), per_seq[held].tolist())), bucket_bytes))

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
                  kept: str | None = _KEPT) -> list[Patch | PatchBatch] | None:
        """One exchange of ``items`` (this rank's) to ``dst``: the ordered, merged patches and
        batches there."""
        g = self.groups
        rank, world = g.rank, g.world
        buf = torch.empty(0, dtype=torch.uint8, device=g.device)
        part = None
        if failure is None and items:
            try:
                part = _Part.of(items, g.device)
                if rank != self.dst:
                    buf = _pack(part, g.device)
            except Exception as e:  # noqa: BLE001 - becomes the same GatherError on every rank
                failure = (f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))
        sizes = self._agree([buf.numel(), part.n if part is not None and rank != self.dst else 0], failure, kept)
        if bool((sizes[:, 1] > 0).any()):
            # the destination's receive buffer before anyone sends: a destination without room
            # (a device out of memory) ends the round on every rank, not with senders blocked
            # until the group's timeout
            room = None
            if rank == self.dst:
                try:
                    self._buffer(int(((sizes[:, 1] + 7) // 8 * 8).sum()))
                except Exception as e:  # noqa: BLE001 - becomes the same GatherError on every rank
                    room = (f"no room to receive the round's {int(sizes[:, 1].sum())} bytes: "
                            f"{type(e).__name__}: {e}", traceback.format_exc(limit=4))
            self._agree([], room, kept)
        if rank != self.dst:
            if buf.numel():
                collectives.send(buf, self.dst, g.device_group)
            return None
        parts = [part] if part is not None else []
        try:
            # one receive buffer for the round, a slice per rank: every part is read before it is reused
            # (each slice 8-byte aligned: a part's rows are int64)
            rb, off = self._buffer(int(((sizes[:, 1] + 7) // 8 * 8).sum())), 0
            got = []
            for r in range(world):
                n = int(sizes[r, 1])
                if r == self.dst or n == 0:
                    continue
                collectives.recv(rb[off:off + n], r, g.device_group)
                got.append((r, rb[off:off + n]))
                off += (n + 7) // 8 * 8
            # decoded once every rank's send was received: a part that does not decode leaves no
            # rank's send unmatched (the next round tells the others)
            parts += [_Part.from_bytes(b, int(sizes[r, 2]), r) for r, b in got]
            return _merge(parts)  # copies out of the buffer
        finally:
            self._release()

    def _release(self) -> None:
        if self._recv is not None and self._recv.device.type != "cpu":
            self._recv = None


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
    """The rounds of :meth:`PatchGather.stream`. On ``dst``, iterating yields the merged patches and
    batches in export order, one exchange per round; every other rank calls :meth:`finish`, which runs its
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

    def _round(self, failure: tuple[str, str] | None = None) -> list[Patch | PatchBatch] | None:
        bound = self._bounds.popleft()
        mine, rest = [], []
        while self._items and (bound is None or self._items[0].seq < bound):
            it = self._items.popleft()  # sent (or merged) once: not held past its round
            p = it.patch
            if bound is not None and isinstance(p, PatchBatch) and p.seqs[-1] >= bound:
                k = bisect.bisect_left(p.seqs, bound)  # the batch's tensors past the round wait
                mine.append(Ordered(it.seq, p.take(0, k)))
                rest.append(Ordered(p.seqs[k], p.take(k, len(p.seqs))))
            else:
                mine.append(it)
        if rest:
            self._items = deque(sorted([*rest, *self._items], key=lambda o: o.seq))
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

    def __iter__(self) -> Iterator[Patch | PatchBatch]:
        while self._bounds:
            yield from self._round() or []

    def finish(self, failure: BaseException | None = None) -> None:
        """Run the rounds not read yet (what arrives on ``dst`` is dropped); with ``failure``, end
        the stream with it on every rank (raises the :class:`GatherError` here too)."""
        if failure is not None and self._bounds:
            self._round((f"{type(failure).__name__}: {failure}", ""))
        while self._bounds:
            self._round()
