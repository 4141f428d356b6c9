"""Where a rank's owned elements of flat buffers land in the checkpoint, as runs, and a delta's
changed elements mapped through them: the per-delta work of the sources that diff their own
buffers (:mod:`update_weight.megatron_shard_delta`'s Megatron shards, :mod:`delta_sync.flat`'s
flat weights).

A parameter's owned elements are kept as *runs* contiguous in both coordinates (local flat offset,
length, checkpoint tensor, checkpoint flat index): a few per row of a weight, whatever Bridge's
conversion did to lay them out. The runs of all parameters of one element width and device form
one :class:`RunTable`; :func:`map_changes` locates every changed local offset among them in a few
vectorized passes (or a slice per run where a parameter has few), so a delta costs a constant
number of operations per table, not per tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from delta_sync import native
from delta_sync.gather import Ordered
from delta_sync.patch import PatchBatch, member_elements


#: elements per step of the plan's run search (bounds its temporaries to ~20 MB)
RUN_CHUNK = 1 << 22
#: mean run length from which digests go run by run (contiguous ranges) instead of element by element
LONG_RUNS = 1 << 12
#: a parameter of at most this many runs maps a delta's changes run by run (a slice and an add per
#: run) instead of locating every changed element among its runs
FEW_RUNS = 64


@dataclass
class Runs:
    """Owned elements of one local parameter, as runs contiguous in both coordinates."""

    param: torch.Tensor  # the live parameter
    local: torch.Tensor  # int64 [R] first local flat offset of each run (increasing)
    length: torch.Tensor  # int64 [R]
    seq: torch.Tensor  # int64 [R] position of the checkpoint tensor in the export order
    target: torch.Tensor  # int64 [R] checkpoint flat index of the run's first element
    #: a parameter of few runs (at most ``FEW_RUNS``: whole tensors, gate/up halves, q/k/v blocks):
    #: ``[(local, length, target, seq)]`` on the host, for digests run by run with no device read
    few: list[tuple[int, int, int, int]] | None = None


def owned_runs(ids: torch.Tensor, mine: torch.Tensor | bool, base: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local start, length, target start)`` (int64) of the maximal runs of owned elements that
    are consecutive in both coordinates, from ``ids`` (each checkpoint element's flat offset in the
    local parameter plus ``base``, in checkpoint order). Vectorized passes over chunks of
    :data:`RUN_CHUNK` elements, whose temporaries the allocator reuses (a whole tensor's would be
    fresh pages each time, faulted in on first touch); no sort of the elements."""
    n = ids.numel()
    firsts = []  # elements that start a run, owned or not (a foreign element is its own)
    for a in range(0, n, RUN_CHUNK):
        b = min(n, a + RUN_CHUNK)
        lo = max(a - 1, 0)  # each element is compared with the one before it, across chunks too
        seg = ids[lo:b]
        breaks = seg[1:] != seg[:-1] + 1
        if mine is not True:
            breaks |= ~(mine[lo + 1:b] & mine[lo:b - 1])
        if a == 0:
            firsts.append(torch.zeros(1, dtype=torch.int64))
        firsts.append(breaks.nonzero().squeeze(1).add_(lo + 1))
    first = torch.cat(firsts) if firsts else torch.zeros(0, dtype=torch.int64)
    length = torch.diff(first, append=torch.tensor([n]))
    if mine is not True:
        keep = mine.take(first)
        first, length = first[keep], length[keep]
    return ids.take(first).to(torch.int64).sub_(base), length, first


def build_runs(param: torch.Tensor, plist) -> Runs:
    """The runs of one parameter's owned elements, in local order, on its device."""
    host = host_runs(plist)
    return place_runs(param, *host, few=few_runs(*host))


def host_runs(plist) -> tuple[torch.Tensor, ...]:
    """``(local, length, seq, target)`` of one parameter's runs in local order, on the host, from
    ``(run local starts, lengths, plan index, run target starts)`` per converted tensor."""
    local = torch.cat([p[0] for p in plist])
    length = torch.cat([p[1] for p in plist])
    seq = torch.cat([torch.full_like(p[0], p[2]) for p in plist])
    target = torch.cat([p[3] for p in plist])
    order = torch.argsort(local)  # one entry per run: a few per row
    return local[order], length[order], seq[order], target[order]


def place_runs(param: torch.Tensor, local, length, seq, target, few=None) -> Runs:
    """The runs on the parameter's device, where the diffs they map are computed (``few``: see
    :attr:`Runs.few`)."""
    dev = param.device
    return Runs(param, local.to(dev), length.to(dev), seq.to(dev), target.to(dev), few)


def few_runs(local, length, seq, target) -> list[tuple[int, int, int, int]] | None:
    """:attr:`Runs.few` of host runs in local order."""
    if 0 < local.numel() <= FEW_RUNS:
        return list(zip(local.tolist(), length.tolist(), target.tolist(), seq.tolist()))
    return None


@dataclass
class RunTable:
    """The owned runs of this rank's parameters of one element width and device, as one table: a
    delta's changed elements of all of them map to checkpoint coordinates in a few operations,
    whatever the number of parameters or checkpoint tensors. Run ``r`` covers local flat offsets
    ``[start[r], end[r])`` of parameter ``param[r]`` (runs grouped by parameter, in order)."""

    params: list[int]  # the parameters (positions among the source's runs), in table order
    base: torch.Tensor  # int64 [P]: where each parameter's offsets start when all are laid end to end
    param: torch.Tensor  # int64 [R]: each run's parameter (a position in ``params``)
    start: torch.Tensor  # int64 [R]
    end: torch.Tensor  # int64 [R]
    key: torch.Tensor  # int64 [R]: its checkpoint tensor's export position << 32 | its first checkpoint index
    shift: torch.Tensor  # int64 [R]: checkpoint index - local offset, for each of its elements
    #: for :func:`map_changes`, made at its first delta: the runs in key order (None: they are),
    #: each one's checkpoint tensor among the table's (a rank, on the table's device), and those
    #: tensors' export positions (increasing, on the host)
    _in_order: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor] | None = None

    def in_order(self) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        if self._in_order is None:
            key = self.key.cpu()  # (once per table)
            order = None
            if key.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
                key, order = torch.sort(key)
            seqs, rank = torch.unique_consecutive(key.bitwise_right_shift(32), return_inverse=True)
            self._in_order = (None if order is None else order.to(self.key.device), rank.to(self.key.device), seqs)
        return self._in_order


def run_table(runs: list[Runs], params: list[int], pos_of: torch.Tensor) -> RunTable:
    """:class:`RunTable` of ``runs[k]`` for ``k`` in ``params`` (one device), ``pos_of``: each plan
    index's export position."""
    dev = runs[params[0]].param.device
    base = list(itertools.accumulate((runs[k].param.numel() for k in params), initial=0))[:-1]
    start, length, target, seq = (torch.cat([getattr(runs[k], f) for k in params])
                                  for f in ("local", "length", "target", "seq"))
    sizes = [runs[k].local.numel() for k in params]
    param = torch.repeat_interleave(torch.arange(len(params), device=dev), torch.tensor(sizes, device=dev),
                                    output_size=sum(sizes))
    return RunTable(params, torch.tensor(base, dtype=torch.int64, device=dev), param, start, start + length,
                     pos_of.to(dev).take(seq).bitwise_left_shift_(32).add_(target), target - start)


def map_changes(table: RunTable, found: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None:
    """The changes ``found[i]`` (int32 local flat offsets, increasing, and their bits) of the
    table's parameter ``i``, in checkpoint coordinates: ``(int32 flat indices, bits, export
    positions, counts)``, each tensor's changes together and increasing, tensors in export order;
    changes outside every run (elements another rank owns, padding) dropped; None where none is left.

    A run's changes are a slice of its parameter's (both increase): the runs' bounds are searched
    among them, and every run takes part, those without changes as empty slices, in the table's
    key order (:meth:`RunTable.in_order`, worked out once per table: a sort of runs, not of
    elements, where a parameter's runs do not follow it, fused q/k/v), each slice moved by its
    run's shift. Each checkpoint tensor's count is summed over its runs before anything is
    gathered: on a device that is the one read, and no step waits to learn which runs hold
    changes. The searches and the gather are two kernel calls on the host (each change copied
    once), a few torch operations elsewhere."""
    if not any(f[0].numel() for f in found):
        return None
    host = native.kernel() is not None and table.start.device.type == "cpu" and all(
        i.dtype is torch.int32 and i.is_contiguous() and b.is_contiguous() and b.device.type == "cpu"
        for i, b in found)
    if host:
        idx_at = torch.tensor([i.data_ptr() for i, _ in found], dtype=torch.int64)
        lo, n = native.run_slices(table.param, table.start, table.end, idx_at,
                                  torch.tensor([i.numel() for i, _ in found], dtype=torch.int64))
    else:
        at = _laid_end_to_end(table, [i for i, _ in found])
        lo, n = _run_slices(table, at)
    order, rank, positions = table.in_order()
    if order is not None:
        lo, n = lo.take(order), n.take(order)
    per = torch.zeros(positions.numel(), dtype=torch.int64, device=n.device).index_add_(0, rank, n)
    per = per.cpu()  # the one read (on the host: none)
    changed = per.nonzero().squeeze(1)
    if changed.numel() == 0:
        return None
    counts = per.take(changed)
    total = int(counts.sum())
    live = order if order is not None else torch.arange(n.numel(), device=n.device)
    if host:
        bits0 = found[0][1]
        width = bits0.element_size()
        param = table.param.take(live)
        rows = torch.stack([idx_at.take(param) + lo * 4,
                            torch.tensor([b.data_ptr() for _, b in found], dtype=torch.int64).take(param) + lo * width,
                            n, table.shift.take(live)], 1)
        idx, bits = native.gather_runs(rows.contiguous(), width, total, bits0.dtype)
    else:
        idx, bits = _gather_runs(table, at, torch.cat([b for _, b in found]), live, lo, n, total)
    return idx, bits, positions.take(changed).tolist(), counts.tolist()


def patch_batches(idx: torch.Tensor, bits: torch.Tensor, seqs: list[int], counts: list[int], names: list[str],
                  shapes: list[tuple[int, ...]], dtypes: list[torch.dtype] | torch.dtype) -> list[Ordered]:
    """:func:`map_changes`'s changes as one :class:`PatchBatch` per dtype (a table holds one element
    width; dtypes of one width apart, bf16 and fp16, are rare), its tensors in export order (the
    gather orders the ranks' batches by it); ``names``, ``shapes``, ``dtypes``: of each changed
    tensor, in ``seqs``' order (``dtypes`` one dtype: every tensor's)."""
    if isinstance(dtypes, torch.dtype):
        return [Ordered(seqs[0], PatchBatch(names, shapes, dtypes, counts, idx, bits.view(dtypes), seqs))]
    out = []
    for dt in dict.fromkeys(dtypes):
        if dtypes.count(dt) == len(dtypes):
            b = PatchBatch(names, shapes, dt, counts, idx, bits.view(dt), seqs)
        else:
            ks = [k for k, d in enumerate(dtypes) if d is dt]
            at = member_elements([d is dt for d in dtypes], counts, idx.device)
            b = PatchBatch([names[k] for k in ks], [shapes[k] for k in ks], dt, [counts[k] for k in ks],
                           idx.index_select(0, at), bits.index_select(0, at).view(dt), [seqs[k] for k in ks])
        out.append(Ordered(b.seqs[0], b))
    return out


def _run_slices(table: RunTable, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`native.run_slices` in torch operations (a device's tensors), ``at``: every parameter's
    changed offsets laid end to end (:func:`_laid_end_to_end`); ``lo`` indexes ``at``."""
    base = table.base.take(table.param)
    lo = torch.searchsorted(at, table.start + base)
    return lo, torch.searchsorted(at, table.end + base) - lo


def _laid_end_to_end(table: RunTable, offsets: list[torch.Tensor]) -> torch.Tensor:
    """Every parameter's offsets (int64) after :attr:`RunTable.base`, in one increasing tensor."""
    sizes = [o.numel() for o in offsets]
    return torch.cat(offsets).to(torch.int64) + torch.repeat_interleave(
        table.base, torch.tensor(sizes, dtype=torch.int64, device=table.start.device), output_size=sum(sizes))


def _gather_runs(table: RunTable, at: torch.Tensor, bits: torch.Tensor, live: torch.Tensor, lo: torch.Tensor,
                 n: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`native.gather_runs` in torch operations: the changes of runs ``live`` (in that order),
    ``lo`` and ``n`` each one's slice of ``at`` (and of ``bits``, every parameter's laid alike)."""
    elem = expand(lo, n, total)
    base = table.base.take(table.param.take(live))
    idx = at.take(elem).add_(torch.repeat_interleave(table.shift.take(live) - base, n, output_size=total))
    return idx.to(torch.int32), bits.take(elem)


def long_runs(length: torch.Tensor) -> bool:
    """Runs long enough on average (whole rows or tensors) to be handled one by one as slices."""
    return bool(length.numel()) and int(length.sum()) >= LONG_RUNS * length.numel()


def expand(start: torch.Tensor, length: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Every index of the runs ``[start, start + length)``, in order (``total``: their lengths' sum,
    where the caller knows it: no wait for a device to tell)."""
    if start.numel() == 0:
        return start
    first = torch.repeat_interleave(start - torch.cumsum(length, 0) + length, length, output_size=total)
    return first + torch.arange(first.numel(), device=start.device)
