"""Checkpoint loader views: where each checkpoint element lives in the engine's parameters.

vLLM's loaders fuse and shard checkpoint tensors (q/k/v -> ``qkv_proj``, gate/up ->
``gate_up_proj``, experts -> ``w13``/``w2``, TP slices, padded vocab) and end in
``param_slice.copy_(checkpoint_slice)``. Running the loader once per checkpoint name with a
*probe* tensor under a dispatch mode and recording that final copy (without performing it) gives,
per name, a list of :class:`Segment`: an affine map from checkpoint flat indices to offsets in a
parameter's storage.

Applying a patch is then O(changed elements): decompose each flat index along the source
strides of a segment, keep those that fall inside it, and ``index_copy_`` into the parameter at
the matching destination offsets. A loader whose write is not one plain strided ``copy_`` from the
probe (a computed source, ``index_copy_``/``fill_``/out= writes), or whose segments would hold a
checkpoint element twice, yields no view; such names fall back to vLLM's
``load_checkpoint_weight_patches`` (counted in the engine's report, logged).
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from delta_sync import accelerator, native
from delta_sync.digest import (PRIMES, Digest, digest_range, element_sums, range_row, row_spec, rows_supported,
                               scan_many, scan_rows_table, sum_rows)


@dataclass(frozen=True)
class Segment:
    """``param_flat[dst_offset + sum(c_k * dst_stride_k)] = ckpt_flat[src_offset + sum(c_k * src_stride_k)]``
    for every multi-index ``c`` within ``shape``. Strides and offsets are in elements."""

    param: str
    shape: tuple[int, ...]
    src_offset: int
    src_stride: tuple[int, ...]
    dst_offset: int
    dst_stride: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def contiguous(self) -> bool:
        """Both sides are one row-major run: checkpoint ``[src_offset, +numel)`` -> parameter
        ``[dst_offset, +numel)`` (every segment at TP=1, row-sliced ones at TP>1)."""
        return self.src_run and all(self.dst_stride[i] == self.src_stride[i] for i, n in enumerate(self.shape)
                                    if n > 1)

    @functools.cached_property
    def src_run(self) -> bool:
        """The checkpoint side is one row-major run ``[src_offset, +numel)``, whatever the
        parameter's strides (a whole expert of vLLM-Ascend's transposed layout)."""
        row_major, step = [], 1
        for n in reversed(self.shape):
            row_major.append(step)
            step *= n
        row_major = tuple(reversed(row_major))
        return all(self.src_stride[i] == row_major[i] for i, n in enumerate(self.shape) if n > 1)

    def _dims_by_src_stride(self):
        return sorted((i for i in range(len(self.shape)) if self.shape[i] > 1),
                      key=lambda i: -self.src_stride[i])

    def map(self, flat_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(selector, dst_offsets)``: which of ``flat_idx`` (int64) land in this segment, and where."""
        r = flat_idx - self.src_offset
        ok = r >= 0
        dst = torch.full_like(flat_idx, self.dst_offset)
        for i in self._dims_by_src_stride():
            s = self.src_stride[i]
            c = torch.div(r, s, rounding_mode="floor")
            ok &= (c >= 0) & (c < self.shape[i])
            r = r - c * s
            dst += c * self.dst_stride[i]
        ok &= r == 0
        sel = ok.nonzero().squeeze(1)
        return sel, dst.index_select(0, sel)

    def src_view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.shape, self.src_stride, flat.storage_offset() + self.src_offset)

    def dst_view(self, param_flat: torch.Tensor) -> torch.Tensor:
        return param_flat.as_strided(self.shape, self.dst_stride, param_flat.storage_offset() + self.dst_offset)


@dataclass
class LoaderView:
    """Every place checkpoint tensor ``name`` (of ``shape``) is written on this worker."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: list[Segment] = field(default_factory=list)

    @functools.cached_property
    def runs(self) -> tuple[tuple[str, int, int, int], ...] | None:
        """``(parameter, src_offset, numel, dst_offset)`` of each segment where every one is a
        contiguous run on both sides and together they hold the whole tensor (TP=1, the loader's
        own layout): a bulk range's copies then follow from integers (:func:`dense_range_copies`,
        the seed's rows in :mod:`patches.bulk_apply`); None for any other view. (A view's segments
        are fixed once probed.)"""
        segs = self.segments
        if not segs or not all(seg.contiguous for seg in segs) or sum(seg.numel for seg in segs) != math.prod(self.shape):
            return None
        return tuple((seg.param, seg.src_offset, seg.numel, seg.dst_offset) for seg in segs)


def param_storages(model: torch.nn.Module) -> dict[int, tuple[str, torch.Tensor]]:
    """Storage data_ptr -> (parameter name, parameter) for every parameter (tied ones once)."""
    out: dict[int, tuple[str, torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.numel() == 0:
            continue
        out.setdefault(p.untyped_storage().data_ptr(), (name, p))
    return out


class _ProbeMode(TorchDispatchMode):
    """Sees every op the loader runs for one probe call (this thread only, while it is active):
    records each ``copy_`` from a probe into a parameter as a :class:`Segment` of that probe's
    name (a dtype difference is the caller's to refuse: it knows whether a conversion is
    acceptable), refuses every other write into a parameter (``__setitem__`` from a computed
    value, ``index_copy_``, ``fill_``, ``zero_``, out= variants, ...), and performs none of them:
    probing writes nothing. ``probes`` maps each probe's storage to its checkpoint name."""

    def __init__(self, storages: dict[int, tuple[str, torch.Tensor]], probes: dict[int, tuple[str, torch.Tensor]]):
        super().__init__()
        self.storages, self.probes = storages, probes
        self.segments: dict[str, list[Segment]] = {name: [] for name, _ in probes.values()}
        self.error: str | None = None

    def _refuse(self, why: str) -> None:
        self.error = self.error or why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = [t for t in _mutated(func, args, kwargs)
               if t.numel() and t.untyped_storage().data_ptr() in self.storages]
        if not hit:
            return func(*args, **kwargs)
        dst = hit[0]
        owner = self.storages[dst.untyped_storage().data_ptr()]
        if func is not torch.ops.aten.copy_.default:
            self._refuse(f"the loader writes {owner[0]} with {func.__name__}, not one strided copy_ "
                         "of the checkpoint tensor")
            return args[0] if args and isinstance(args[0], torch.Tensor) else dst
        src = args[1]
        probe = self.probes.get(src.untyped_storage().data_ptr()) if isinstance(src, torch.Tensor) else None
        if probe is None:
            self._refuse("the loader writes a tensor computed from the checkpoint tensor")
        elif tuple(dst.shape) != tuple(src.shape):
            self._refuse(f"final copy changes the shape ({tuple(src.shape)} -> {tuple(dst.shape)})")
        elif any(st == 0 for st in src.stride()) and src.numel() > 1:
            self._refuse("the loader broadcasts the checkpoint tensor")
        else:
            pname, param = owner
            name, tensor = probe
            self.segments[name].append(Segment(
                pname, tuple(dst.shape), src.storage_offset() - tensor.storage_offset(), tuple(src.stride()),
                dst.storage_offset() - param.data.storage_offset(), tuple(dst.stride())))
        return dst


def _mutated(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an aten op writes (arguments its schema marks as written: in-place self, out=)."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def coverage_problem(view: LoaderView, whole: bool) -> str | None:
    """Why ``view`` does not hold each checkpoint element of its tensor at most once (exactly once
    when this worker holds the ``whole`` tensor), or None. Exact: a bitmap of the elements held,
    built only when two segments' index ranges overlap."""
    numel = math.prod(view.shape)
    spans = []
    for seg in view.segments:
        lo = seg.src_offset + sum((n - 1) * st for n, st in zip(seg.shape, seg.src_stride) if st < 0)
        hi = seg.src_offset + sum((n - 1) * st for n, st in zip(seg.shape, seg.src_stride) if st > 0)
        if seg.numel and (lo < 0 or hi >= numel):
            return f"a segment reads checkpoint elements [{lo}, {hi}] of {numel}"
        spans.append((lo, hi, seg))
    held = sum(seg.numel for seg in view.segments)
    if held > numel:
        return f"its segments write {held} elements of a {numel}-element tensor"
    if whole and held not in (numel, 0):  # 0: the loader discards the tensor (e.g. a tied lm_head)
        return f"its segments cover {held} of {numel} elements"
    spans.sort(key=lambda x: x[0])
    if any(a[1] >= b[0] for a, b in zip(spans, spans[1:]) if a[2].numel and b[2].numel):
        seen = torch.zeros(numel, dtype=torch.int8)
        for seg in view.segments:
            seg.src_view(seen).add_(1)
        if int(seen.max()) > 1:
            return f"checkpoint element {int((seen > 1).nonzero()[0])} is written by two segments"
    return None


def probe_views(model: torch.nn.Module, names_shapes: list[tuple[str, tuple[int, ...], torch.dtype]],
                load_fn=None, whole: bool = True) -> tuple[dict[str, LoaderView], dict[str, str]]:
    """Record loader views for each checkpoint name by running the model's own loader on probes.

    The loader runs under a dispatch mode scoped to this call and thread (no process-wide patch);
    nothing is written to the parameters. A view must hold each checkpoint element at most once
    (exactly once when ``whole``: this worker is not a TP/EP shard). Returns ``(views,
    unsupported)`` where ``unsupported`` maps a name to the reason it has no view.

    All names go through one loader call (its per-call cost, e.g. vLLM walking the module tree,
    is paid once per batch, not once per tensor: at 30B's tensor count that is minutes). A
    refusal in a batch cannot always be pinned on one name, so such a batch is probed again one
    name at a time, which names the culprit and keeps the views of the others.
    """
    load_fn = load_fn or (lambda items: model.load_weights(items))
    storages = param_storages(model)
    views: dict[str, LoaderView] = {}
    unsupported: dict[str, str] = {}
    batches = [names_shapes] if len(names_shapes) > 1 else []
    batches += [[one] for one in names_shapes]  # only reached for a batch that was refused
    for batch in batches:
        if all(name in views or name in unsupported for name, _, _ in batch):
            continue
        probes = {}
        for name, shape, dtype in batch:
            probe = torch.empty(shape, dtype=dtype)
            probes[probe.untyped_storage().data_ptr()] = (name, probe)
        mode = _ProbeMode(storages, probes)
        try:
            with mode:
                load_fn([(name, probe) for name, probe in probes.values()])
        except Exception as e:  # noqa: BLE001 - a loader that does math on the source, etc.
            mode._refuse(f"{type(e).__name__}: {e}")
        if mode.error is not None and len(batch) > 1:
            continue  # one name at a time, below
        for name, shape, dtype in batch:
            view = LoaderView(name, tuple(shape), dtype, mode.segments[name])
            why = mode.error or coverage_problem(view, whole)
            if why is not None:
                unsupported[name] = why
            else:
                views[name] = view
    return views, unsupported


class RowsUndo:
    """The old values of a kernel row table's positions (:func:`plan_sparse`), in one buffer read in
    the visit that writes the new ones; restored by one kernel run. Rows of a plan write disjoint
    positions (views never hold an element twice), so the order they are put back in is free. It
    keeps the rows, whose buffers its tables address, alive."""

    def __init__(self, table: torch.Tensor, rows: list, room: torch.Tensor, nbytes: int):
        self.table, self.rows, self.room, self.nbytes = table, rows, room, nbytes

    @classmethod
    def room_for(cls, table: torch.Tensor, rows: list) -> "RowsUndo":
        """Point ``table``'s rows at room for their old values (8-byte aligned, each of its target's
        dtype) and make the table that writes them back."""
        sizes = table[:, 2] * (table[:, 7] & 0xFF)  # positions x element bytes
        room = (sizes + 7) // 8 * 8
        buf = torch.empty(int(room.sum()), dtype=torch.uint8)
        table[:, 6] = (torch.cumsum(room, 0) - room) + buf.data_ptr()
        back = table.clone()
        back[:, 5], back[:, 6] = table[:, 6], 0  # values: the old ones; nothing read
        pos_bytes = table[:, 2] * (table[:, 7] >> 8)
        return cls(back, rows, buf, int((sizes + pos_bytes).sum()))

    def restore(self) -> None:
        native.run_rows(self.table)


@dataclass
class UndoLog:
    """Old values at every position an apply wrote, restorable in reverse order: ``(target,
    positions, offset, old values)`` entries, or a :class:`RowsUndo` for a kernel run's rows. For a
    device target written from a delta staged on the host, positions and old values are host
    memory (copied back to the device on restore).

    Positions are a 1-D target's element ``offset + pos[i]`` (``pos`` int32 or int64: a whole-run
    patch keeps its own int32 indices and the parameter offset of its tensor)."""

    #: (target, positions or None for the whole target, offset, old values), or a RowsUndo
    entries: list = field(default_factory=list)

    def change(self, target: torch.Tensor, pos: torch.Tensor | None, values: torch.Tensor, offset: int = 0) -> None:
        """Record the old values at ``offset + pos`` of ``target`` (None: all of it), then write
        ``values`` there (one visit per position on a host)."""
        if pos is not None and native.movable(target, pos, values):  # one visit per position
            old = torch.empty(pos.numel(), dtype=target.dtype)
            native.move_rows([(target, pos, offset, values, old)], [(0, 1)])
            self.entries.append((target, pos, offset, old))
            return
        if pos is None:
            self.record_view(target)
        else:
            self.record_positions(target, pos, offset)
        _put(target, pos, offset, values)

    def record_positions(self, flat: torch.Tensor, pos: torch.Tensor, offset: int = 0) -> None:
        self.entries.append((flat, pos, offset, _take(flat, pos, offset)))

    def record_view(self, view: torch.Tensor) -> None:
        self.entries.append((view, None, 0, view.clone()))

    def restore(self) -> None:
        for entry in reversed(self.entries):
            if isinstance(entry, RowsUndo):
                entry.restore()
            else:
                _put(*entry)
        self.entries.clear()

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes if isinstance(e, RowsUndo) else
                   e[3].numel() * e[3].element_size() + (0 if e[1] is None else e[1].numel() * e[1].element_size())
                   for e in self.entries)

    @property
    def device_nbytes(self) -> int:
        """Of :attr:`nbytes`, what is held in a device's memory (a delta staged on the host keeps its
        undo there too)."""
        return sum(t.numel() * t.element_size() for e in self.entries if not isinstance(e, RowsUndo)
                   for t in (e[1], e[3]) if t is not None and t.device.type != "cpu")


#: elements below which host writes of an apply stay on the calling thread
SPREAD_MIN_ELEMENTS = native.SPREAD_MIN_ELEMENTS


def _spans(sizes: list[int], device: torch.device | None) -> list[tuple[int, int]]:
    """``range(len(sizes))`` cut into contiguous ``(lo, hi)`` parts, one per thread, for host work
    of at least :data:`SPREAD_MIN_ELEMENTS` a thread (:func:`delta_sync.native.thread_spans`)."""
    if device is None or device.type != "cpu":
        return [(0, len(sizes))] if sizes else []
    return native.thread_spans(sizes, SPREAD_MIN_ELEMENTS)


def _row_spans(counts: list[int], sizes: list[int], device: torch.device | None) -> list[tuple[int, int]]:
    """:func:`_spans` of groups of ``counts`` rows (``sizes`` elements each) as ranges of rows."""
    first = [0, *itertools.accumulate(counts)]
    return [(first[lo], first[hi]) for lo, hi in _spans(sizes, device)]


def run_threaded(sizes: list[int], run, device: torch.device | None) -> None:
    """``run(lo, hi)`` over the :func:`_spans` of ``sizes``, one thread each. Every part finishes
    before an error is raised."""
    spans = _spans(sizes, device)
    if len(spans) < 2:
        if spans:
            run(*spans[0])
        return
    _, error = native.run_spread([functools.partial(run, lo, hi) for lo, hi in spans])
    if error is not None:
        raise error


def _positions(pos: torch.Tensor, offset: int) -> torch.Tensor:
    return pos.to(torch.int64) + offset if offset else pos.to(torch.int64)


def write_staged(flat: torch.Tensor, dst: torch.Tensor, values: torch.Tensor, undo: UndoLog | None,
                 offset: int = 0) -> int:
    """:func:`write_positions` of a pair staged in host memory: positions and values copied to the
    parameter's device now, the old values back into host memory (the undo entry keeps the host
    positions), so the device holds one pair's positions, values and old values at a time,
    whatever the delta's size."""
    pos = _positions(dst.to(flat.device, non_blocking=True), offset)
    if undo is not None:
        undo.entries.append((flat, dst, offset, accelerator.to_host(flat.index_select(0, pos), non_blocking=True)))
    flat.index_copy_(0, pos, values.to(device=flat.device, dtype=flat.dtype, non_blocking=True))
    return dst.numel()


def _put(target: torch.Tensor, pos: torch.Tensor | None, offset: int, values: torch.Tensor) -> None:
    """``target[offset + pos] = values`` along dim 0, or all of ``target`` when ``pos`` is None
    (positions and values kept in host memory for a device ``target`` are copied there)."""
    if pos is None:
        target.copy_(values)
    elif not native.move_at(target, pos, offset, values=values):
        target.index_copy_(0, _positions(pos.to(target.device), offset), values.to(target.device))


def _take(target: torch.Tensor, pos: torch.Tensor, offset: int) -> torch.Tensor:
    """``target[offset + pos]`` along dim 0, as a new tensor."""
    out = torch.empty(pos.numel(), dtype=target.dtype, device=target.device)
    return out if native.move_at(target, pos, offset, old=out) else target.index_select(0, _positions(pos, offset))


def flat_param(param: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``param`` as a 1-D tensor starting at the parameter's first element."""
    data = param.data
    n = data.untyped_storage().nbytes() // data.element_size() - data.storage_offset()
    return data.as_strided((n,), (1,), data.storage_offset())


def apply_sparse(view: LoaderView, params: dict[str, torch.Tensor], indices: torch.Tensor,
                 values: torch.Tensor, undo: UndoLog | None) -> int:
    """Write ``values`` at checkpoint flat ``indices`` (increasing) through ``view``; returns elements written.

    A contiguous segment takes its indices as one slice found by binary search (a handful of
    torch ops per tensor, whatever the density); other segments decompose every index.
    """
    idx = indices.to(torch.int64)
    written = 0
    for seg in view.segments:
        if seg.contiguous:
            bounds = torch.tensor([seg.src_offset, seg.src_offset + seg.numel], device=idx.device)
            lo, hi = torch.searchsorted(idx, bounds).tolist()
            if lo == hi:
                continue
            dst = idx[lo:hi] + (seg.dst_offset - seg.src_offset)
            vals = values[lo:hi]
        else:
            sel, dst = seg.map(idx)
            if sel.numel() == 0:
                continue
            vals = values.index_select(0, sel)
        written += write_positions(flat_param(params[seg.param]), dst, vals, undo)
    return written


def whole_run(view: LoaderView) -> Segment | None:
    """The view's one segment when it holds the whole checkpoint tensor as one row-major run (every
    tensor at TP=1, fused ones included), else None: then checkpoint index i is parameter element
    ``dst_offset + i``."""
    if len(view.segments) != 1:
        return None
    seg = view.segments[0]
    return seg if seg.contiguous and seg.src_offset == 0 and seg.numel == math.prod(view.shape) else None


def strided_run(view: LoaderView) -> tuple[Segment, int, int, int] | None:
    """``(segment, C, row stride, column stride)`` when the view's one segment holds the whole
    checkpoint tensor, read row-major, at most two of its dimensions longer than 1, written with any
    strides (a transposed expert on vLLM-Ascend: ``w13 [E, H, 2I]``); else None. Then checkpoint
    index ``i`` is parameter element ``dst_offset + (i // C) * row + (i % C) * column``; a
    contiguous run is the case ``C = row``, ``column = 1``."""
    if (seg := whole_run(view)) is not None:
        return seg, seg.numel, seg.numel, 1
    if len(view.segments) != 1:
        return None
    seg = view.segments[0]
    # the segment's dimensions in the order the checkpoint tensor is read, outer first (a probe
    # records the copy in the parameter's orientation: a transposed source has permuted strides)
    dims = sorted((d for d, n in enumerate(seg.shape) if n > 1), key=lambda d: -seg.src_stride[d])
    if seg.src_offset or seg.numel != math.prod(view.shape) or len(dims) > 2:
        return None
    if not dims:
        return seg, 1, 1, 1
    inner = dims[-1]
    if seg.src_stride[inner] != 1 or (len(dims) == 2 and seg.src_stride[dims[0]] != seg.shape[inner]):
        return None
    return (seg, seg.shape[inner], seg.dst_stride[dims[0]] if len(dims) == 2 else seg.shape[inner],
            seg.dst_stride[inner])


def apply_sparse_many(views: dict[str, LoaderView], params: dict[str, torch.Tensor],
                      patches: list[tuple[str, torch.Tensor, torch.Tensor]], undo: UndoLog | None) -> int:
    """:func:`apply_sparse` for ``(name, indices, values)`` of many tensors: :func:`plan_sparse`,
    then its run. Returns elements written."""
    return plan_sparse(views, params, patches, undo is not None).run(undo)


def plan_sparse(views: dict[str, LoaderView], params: dict[str, torch.Tensor],
                patches: list[tuple[str, torch.Tensor, torch.Tensor]], keep_old: bool = True) -> "SparsePlan":
    """The writes of :func:`apply_sparse_many`, worked out without writing: those held whole as one
    run are grouped by parameter. On a host with the kernel (:func:`delta_sync.native.move_rows`)
    each tensor's int32 indices are read at its offset in the parameter, the kernel's row table is
    built and every position checked here, and the run reads the undo values and writes all tensors
    in one foreign call per thread, each position visited once; elsewhere each parameter's positions
    and values are joined here, and the run takes one undo gather and one ``index_copy_`` per
    parameter (a fused qkv: one for q, k and v), not a handful of ops and a host sync per tensor.
    The others go through :func:`apply_sparse` in the run. So an engine plans a delta while it still
    serves, and its pause holds the writes alone. ``keep_old``: the run will be given an undo log."""
    plan = SparsePlan(views, params, patches)
    groups: dict[str, list[tuple[torch.Tensor, int, torch.Tensor]]] = {}
    for name, idx, vals in patches:
        view = views[name]
        seg = whole_run(view)
        if seg is None:
            plan.others.append((view, idx, vals))
        elif idx.numel():
            groups.setdefault(seg.param, []).append((idx, seg.dst_offset, vals))
    per_param = list(groups.items())
    plan.sizes = [sum(i.numel() for i, _, _ in parts) for _, parts in per_param]
    flats = [flat_param(params[pname]) for pname, _ in per_param]
    device = flats[0].device if flats else None
    rows = [(flat, idx, off, vals if vals.dtype == flat.dtype else vals.to(flat.dtype))
            for flat, (_, parts) in zip(flats, per_param) for idx, off, vals in parts]
    if native.movable_rows([(*row, None) for row in rows]):
        # host kernel: each tensor's int32 indices at its parameter offset, a few foreign calls for all
        plan.rows = rows
        plan.table = native.row_table([(*row, None) for row in rows], checked=True)
        native.check_rows(plan.rows, plan.table)
        plan.spans = _row_spans([len(parts) for _, parts in per_param], plan.sizes, device)
        if keep_old:
            plan.undo = RowsUndo.room_for(plan.table, rows)
        return plan
    for flat, (_, parts) in zip(flats, per_param):
        dst = torch.cat([i for i, _, _ in parts]) if len(parts) > 1 else parts[0][0]
        dst = dst.to(torch.int64)
        if any(off for _, off, _ in parts):
            offsets = torch.tensor([off for _, off, _ in parts], dtype=torch.int64, device=dst.device)
            counts = torch.tensor([i.numel() for i, _, _ in parts], dtype=torch.int64, device=dst.device)
            dst += torch.repeat_interleave(offsets, counts, output_size=dst.numel())
        vals = torch.cat([v for _, _, v in parts]) if len(parts) > 1 else parts[0][2]
        plan.joined.append((flat, dst, vals.to(flat.dtype)))
    plan.device = device
    return plan


_INT32_POS = torch.empty(0, dtype=torch.int32)


class TableRoutes:
    """Where each tensor of a catalogue (:mod:`delta_sync.catalog`) is written on this worker, per
    id: ``how`` is 1 (one whole run of a parameter the host kernel writes: ``cols`` = parameter
    address, offset, size, element kinds), 2 (the whole tensor in one parameter that torch ops
    write, contiguous or strided (:func:`strided_run`), on a device, on a host without the kernel,
    or transposed: ``where`` = parameter number in :attr:`flats`, offset, C, row and column
    strides), -1 (held nowhere here: an expert of another worker) or 0 (anything else: its patch
    takes the general path). Built once per catalogue and parameter layout; a delta's table is
    then routed by id, with no Python object per tensor (:func:`plan_tables`)."""

    def __init__(self, catalog, views: dict[str, LoaderView], params: dict[str, torch.Tensor]):
        from delta_sync.patch import DTYPES

        self.catalog = catalog
        how, cols, where = [], [], []
        flats: dict[str, torch.Tensor] = {}  # per parameter: its flat storage
        kernel: dict[str, bool] = {}  # per parameter: does the host kernel write it
        number: dict[str, int] = {}  # the parameters torch ops write, numbered
        for name, dname in zip(catalog.names, catalog.dtypes):
            view, h, c, w = views.get(name), 0, (0, 0, 0, 0), (-1, 0, 1, 1, 1)
            if view is not None and not view.segments:
                h = -1
            elif view is not None and (run := strided_run(view)) is not None:
                seg = run[0]
                if seg.param not in flats:
                    flats[seg.param] = flat = flat_param(params[seg.param])
                    kernel[seg.param] = native.can_move(flat, _INT32_POS)
                flat, (width, row, column) = flats[seg.param], run[1:]
                if flat.dtype == DTYPES[dname]:
                    if kernel[seg.param] and row == width and column == 1:  # one run: the kernel's rows
                        h, c = 1, (flat.data_ptr(), seg.dst_offset, flat.numel(), flat.element_size() | 4 << 8)
                    else:
                        h, w = 2, (number.setdefault(seg.param, len(number)), seg.dst_offset, width, row, column)
            how.append(h)
            cols.append(c)
            where.append(w)
        self.how = torch.tensor(how, dtype=torch.int8)
        self.cols = torch.tensor(cols, dtype=torch.int64).reshape(-1, 4)
        #: per id, for ``how == 2``: parameter number, offset, C, row and column strides
        self.where = torch.tensor(where, dtype=torch.int64).reshape(-1, 5)
        #: per id: written with strides other than one row-major run
        self.strided = (self.where[:, 4] != 1) | (self.where[:, 3] != self.where[:, 2])
        self.any_strided = bool(self.strided.any())
        #: the parameters of ``how == 2``, by number
        self.flats = [flats[p] for p in number]
        #: per parameter: the flat storage that ``cols``' addresses and ``flats`` are of (kept alive)
        self.targets = flats
        self.kinds = set(how)  # which ways any id is routed


def routes_for(r, catalog, params: dict[str, torch.Tensor] | None = None,
               cache: bool = True) -> TableRoutes:
    """:class:`TableRoutes` for ``catalog`` of ``r`` (a :class:`~patches.bulk_apply.WorkerWeights`),
    kept while the catalogue, the parameters and the views stay; ``cache=False``: made for
    ``params`` and not kept."""
    key = (catalog.fingerprint, id(r.param_table), len(r.views), len(r.fallback))
    routes = r.routes if cache and r.routes is not None and r.routes_key == key else None
    if routes is None:
        routes = TableRoutes(catalog, r.views, r.param_table.params() if params is None else params)
        if cache:
            r.routes, r.routes_key = routes, key
    return routes


def plan_tables(routes: TableRoutes, tables: list, keep_old: bool = True) -> tuple["SparsePlan | None", list]:
    """A delta's tables as one plan, with no Python object per entry: entries the host kernel writes
    become rows of its table, built with a handful of vectorized operations per bucket (addresses
    from ``routes``, the entry's indices and values where they lie in the received buffers), every
    position checked, rows ordered by parameter for the threads; entries that torch ops write (a
    device's parameters, :func:`_table_positions`) become one (positions, values) pair per
    parameter and table; entries held nowhere here are left out untouched. Returns the plan (None
    when nothing is routed) and ``(entry, patch)`` of the entries that take the general path
    (:func:`plan_sparse`): tensors ``routes`` does not route, and host-kernel rows whose buffers
    are not on the host."""
    from delta_sync.catalog import CODES
    from delta_sync.patch import DTYPES

    esize = torch.tensor([DTYPES[k].itemsize for k in CODES], dtype=torch.int64)
    parts, general, joined, staged = [], [], [], []
    for t in tables:
        how = routes.how[t.ids]
        if 1 in routes.kinds and (t.indices.device.type != "cpu" or not native.supports_words(t.indices)):
            how[how == 1] = 0  # the kernel's rows read host buffers
        kinds = set(how.unique().tolist())
        if 2 in kinds:
            pre = t.routed  # worked out on the device at receipt (:func:`stage_routed`) under these routes
            if pre is not None and pre[0] is routes:
                staged += [pre[1]] if pre[1] is not None else []
            else:
                joined += _table_positions(routes, t, how == 2 if len(kinds) > 1 else None)
        if 0 in kinds:
            general += t.patches((how == 0).nonzero().flatten())
        if 1 not in kinds:
            continue
        go = how == 1
        ids, codes = t.ids[go], t.codes[go]
        base = torch.zeros(len(CODES), dtype=torch.int64)
        for k, v in t.values.items():
            base[CODES.index(k)] = v.data_ptr()
        c = routes.cols[ids]
        parts.append(torch.stack([c[:, 0], t.indices.data_ptr() + 4 * t.index_starts[go], t.counts[go], c[:, 1],
                                  c[:, 2], base[codes] + esize[codes] * t.value_starts[go], torch.zeros_like(ids),
                                  c[:, 3]], 1))
    if not parts and not joined and not staged:
        return None, general
    plan = SparsePlan({}, {}, [], rows=tables, joined=joined, staged=staged,
                      device=joined[0][0].device if joined else None)
    if parts:
        table = torch.cat(parts)
        table = table[torch.argsort(table[:, 0], stable=True)]  # each parameter's rows together
        native.check_rows(None, table)
        _, per_param = torch.unique_consecutive(table[:, 0], return_counts=True)
        ends = torch.cumsum(per_param, 0)
        upto = torch.cumsum(table[:, 2], 0)[ends - 1]
        plan.sizes = torch.diff(upto, prepend=upto.new_zeros(1)).tolist()
        plan.table = table
        plan.spans = _row_spans(per_param.tolist(), plan.sizes, torch.device("cpu"))
        if keep_old:
            plan.undo = RowsUndo.room_for(table, tables)
    return plan, general


#: elements of a table whose positions :func:`stage_routed` works out on the device at once
STAGE_CHUNK_ELEMENTS = 1 << 24


def stage_routed(routes: TableRoutes, t, host: torch.device):
    """Table ``t``, received and checked on a device, kept in ``host`` memory until the pause
    (:meth:`TableSlice.staged`), its entries that torch ops write on a device (``routes.how == 2``)
    first worked out into ``(flat, positions, values)`` pairs where they lie (:func:`_table_positions`,
    in chunks of the entries that start within :data:`STAGE_CHUNK_ELEMENTS` elements of each other:
    a chunk holds that many plus at most one tensor's changed elements) and the pairs copied into pinned host
    memory, int32 positions where the parameter has fewer than 2**31 elements: :func:`plan_tables`
    then takes them as they are (under the same ``routes``), so the host never computes a position
    (~28 ns per element on the host, where the device takes microseconds per bucket). Host memory
    per routed element: 6 B of pairs (10 with int64 positions) beside the table's 6 B. Device memory:
    the bucket, plus ~44 B per element of one chunk while it is worked out (a device out of memory
    there fails this call: the engine then stages the table without its pairs)."""
    staged = t.staged(host)
    if t.indices.device.type != "cpu" and 2 in routes.kinds:
        staged.routed = (routes, routed_pairs(routes, t))
    return staged


def routed_pairs(routes: TableRoutes, t) -> "StagedPairs | None":
    """:func:`stage_routed`'s pairs: ``(flat, positions, values)`` of table ``t``'s entries that
    torch ops write, worked out where ``t`` lies, held in host memory (pinned where it can be) in
    one positions buffer and one values buffer per dtype (None: no such entry)."""
    go = routes.how[t.ids] == 2
    if not bool(go.any()):
        return None
    counts = torch.where(go, t.counts, 0)
    part = (torch.cumsum(counts, 0) - counts) // STAGE_CHUNK_ELEMENTS  # each entry's chunk, by its first element
    pairs = []
    for k in part[go].unique().tolist():
        pairs += _table_positions(routes, t, go & (part == k))
    wide = any(flat.numel() >= 1 << 31 for flat, _, _ in pairs)
    pos = accelerator.host_buffer((sum(d.numel() for _, d, _ in pairs),), torch.int64 if wide else torch.int32)
    room: dict[torch.dtype, int] = {}
    for _, _, v in pairs:
        room[v.dtype] = room.get(v.dtype, 0) + v.numel()
    values = {dt: accelerator.host_buffer((n,), dt) for dt, n in room.items()}
    out, at, vat = [], 0, dict.fromkeys(values, 0)
    for flat, dst, v in pairs:
        n, dt = dst.numel(), v.dtype
        hd, hv = pos[at:at + n], values[dt][vat[dt]:vat[dt] + n]
        hd.copy_(dst if wide else dst.to(torch.int32), non_blocking=True)
        hv.copy_(v, non_blocking=True)
        at, vat[dt] = at + n, vat[dt] + n
        out.append((flat, hd, hv))
    for device in {d.device for _, d, _ in pairs}:  # (where the pairs lay: the table's device, or a parameter's)
        accelerator.synchronize(device)  # the copies landed before the host hands them on
    return StagedPairs(pos, values, out)


@dataclass
class StagedPairs:
    """One table's routed writes in host memory (:func:`routed_pairs`): every pair's positions in
    :attr:`pos`, its values in :attr:`values` of their dtype, pair ``k`` = ``(flat, its positions,
    its values)`` as views of them, in that order. :meth:`write` moves the table to the device in
    a copy per buffer, not per pair."""

    pos: torch.Tensor
    values: dict[torch.dtype, torch.Tensor]
    pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return self.pos.numel() * self.pos.element_size() + sum(v.numel() * v.element_size()
                                                                for v in self.values.values())

    def write(self, undo: UndoLog | None) -> int:
        """Write every pair into its parameter, the old values into ``undo`` (host memory, the
        positions the pairs' own): the table's positions and values copied to the parameters'
        device at once (int64 there), one gather of the old values and one ``index_copy_`` per
        pair, the old values copied back at once. Device memory: this table's pairs and their
        old values (~16 B per element: at most about a bucket), freed when it returns; where the
        device has no room for them, pair by pair (:func:`write_staged`). If anything fails after
        the first write, every pair read so far is in ``undo`` (old values on the device) when it
        raises."""
        dev = self.pairs[0][0].device
        if any(flat.device != dev for flat, _, _ in self.pairs):  # (an engine worker's are on one device)
            return self._pair_by_pair(undo)
        sizes = [d.numel() for _, d, _ in self.pairs]
        dts = [v.dtype for _, _, v in self.pairs]
        per_dtype = {dt: [n for n, d in zip(sizes, dts) if d == dt] for dt in self.values}
        try:  # (nothing written yet: out of room, the pairs go one at a time)
            pos = self.pos.to(dev, non_blocking=True).to(torch.int64).split(sizes)
            vals = {dt: v.to(dev, non_blocking=True).split(per_dtype[dt]) for dt, v in self.values.items()}
            olds = {dt: torch.empty(v.numel(), dtype=dt, device=dev) for dt, v in self.values.items()} \
                if undo is not None else {}
        except torch.OutOfMemoryError:
            return self._pair_by_pair(undo)
        old_parts = {dt: o.split(per_dtype[dt]) for dt, o in olds.items()}
        at = dict.fromkeys(self.values, 0)
        taken = []  # (pair, its old values) read before its write
        try:
            for k, (flat, _, _) in enumerate(self.pairs):
                dt = dts[k]
                j = at[dt]
                at[dt] += 1
                if undo is not None:
                    torch.index_select(flat, 0, pos[k], out=old_parts[dt][j])
                    taken.append((k, old_parts[dt][j]))
                _write_pair(flat, pos[k], vals[dt][j])
            if undo is None:
                return sum(sizes)
            host = {dt: accelerator.to_host(o, non_blocking=True).split(per_dtype[dt]) for dt, o in olds.items()}
        except BaseException:
            if undo is not None:  # what was read back is restorable, written or not
                undo.entries += [(self.pairs[k][0], pos[k], 0, old) for k, old in taken]
            raise
        at = dict.fromkeys(self.values, 0)
        for k, (flat, dst, _) in enumerate(self.pairs):
            undo.entries.append((flat, dst, 0, host[dts[k]][at[dts[k]]]))
            at[dts[k]] += 1
        return sum(sizes)

    def _pair_by_pair(self, undo: UndoLog | None) -> int:
        return sum(write_staged(flat, dst, vals, undo) for flat, dst, vals in self.pairs)


def _write_pair(flat: torch.Tensor, pos: torch.Tensor, values: torch.Tensor) -> None:
    flat.index_copy_(0, pos, values)


def _table_positions(routes: TableRoutes, t, go: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``(flat, int64 positions, values)`` per parameter of the entries ``go`` (None: all) of table
    ``t`` that torch ops write (``routes.how == 2``), on the buffers' device, in a fixed number of
    ops per element dtype of the table: the entries ordered by parameter on the host (a stable sort
    of their columns), each element's entry by ``repeat_interleave``, its index and value gathered
    from the received buffers in that order and mapped into its parameter (its offset, and for
    strided entries its row and column strides), a split per parameter. The run then takes one
    gather (undo) and one ``index_copy_`` per pair. The receiver checked every index against its
    tensor's size (:func:`delta_sync.bucket.check_table`), and the route holds the whole tensor
    inside its parameter. Temporaries: ~28 B per element of one dtype of the table (~44 B where
    entries are strided), freed before the next; kept: its 8 B position and its value."""
    from delta_sync.catalog import CODES

    dev = t.indices.device
    # per entry, host: index start, value start, count, dtype code, then its route (routes.where)
    cols = torch.cat([torch.stack([t.index_starts, t.value_starts, t.counts, t.codes], 1), routes.where[t.ids]], 1)
    if go is not None:
        cols = cols[go]
    cols = cols[torch.argsort(cols[:, 4], stable=True)]  # each parameter's entries together
    codes = t.code_list if go is None else cols[:, 3].unique().tolist()
    out = []
    for code in codes:
        e = cols if len(codes) == 1 else cols[cols[:, 3] == code]
        c = e[:, 2]
        n = int(c.sum())
        before = torch.cumsum(c, 0) - c  # each entry's first element among these n
        starts = (e[:, :2] - before.unsqueeze(1)).t().to(dev)  # (2, entries): index, value buffer starts
        entry = torch.repeat_interleave(torch.arange(c.numel(), device=dev), c.to(dev), output_size=n)
        at = torch.arange(n, device=dev)
        pos = t.indices.index_select(0, starts[0].index_select(0, entry) + at).to(torch.int64)
        vals = t.values[CODES[code]].index_select(0, starts[1].index_select(0, entry) + at)
        del at
        route = e[:, 5:].t().to(dev)  # (4, entries): offset, C, row stride, column stride
        if routes.any_strided:  # (i // C) * row + (i % C) * column, exact for row-major runs too
            width, row, column = route[1:].index_select(1, entry).unbind(0)
            pos = torch.div(pos, width, rounding_mode="floor") * row + torch.remainder(pos, width) * column
            del width, row, column
        pos += route[0].index_select(0, entry)
        params, per = torch.unique_consecutive(e[:, 4], return_counts=True)
        upto = [0, *torch.cumsum(c, 0)[torch.cumsum(per, 0) - 1].tolist()]  # elements up to each parameter's end
        sizes = [b - a for a, b in zip(upto, upto[1:])]
        for p, dst, v in zip(params.tolist(), pos.split(sizes), vals.split(sizes)):
            flat = routes.flats[p]
            if dev.type == "cpu":  # staged in host memory: the write moves it, one pair at a time
                if flat.device.type != "cpu":  # (pinned: the pause's copies run at the link's speed)
                    dst, v = accelerator.to_host(dst), accelerator.to_host(v)
                out.append((flat, dst, v))
            else:  # (a parameter on another device than the buffers: its pair moves there now)
                out.append((flat, dst.to(flat.device), v.to(flat.device)))
    return out


@dataclass
class SparsePlan:
    """:func:`plan_sparse`'s work for :meth:`run`. The parameters must not move in between (an engine
    plans again where they did)."""

    views: dict
    params: dict[str, torch.Tensor]
    patches: list  # what was planned: (name, indices, values)
    #: tensors not held whole as one run: (view, indices, values), through :func:`apply_sparse`
    others: list = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)  # elements written per parameter
    #: host kernel: its rows ``(flat, pos, offset, values)``, their table (checked) and spans, and
    #: the room the run reads the old values into (None: planned without it)
    rows: list = field(default_factory=list)
    table: torch.Tensor | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    undo: "RowsUndo | None" = None
    #: elsewhere: per parameter ``(flat, int64 positions, values)``
    joined: list = field(default_factory=list)
    #: per table staged in host memory: its pairs, written a table at a time (:class:`StagedPairs`)
    staged: list = field(default_factory=list)
    device: torch.device | None = None

    def run(self, undo: UndoLog | None) -> int:
        """Write the planned values, the old ones into ``undo`` first; returns elements written."""
        written = sum(apply_sparse(view, self.params, idx, vals, undo) for view, idx, vals in self.others)
        if self.table is not None:
            if undo is not None and self.undo is None:
                raise ValueError("this plan was made without room for the old values; plan it with keep_old")
            native.run_rows(self.table, self.spans)
            if undo is not None:
                undo.entries.append(self.undo)
            written += sum(self.sizes)
        if self.joined:
            def run(lo: int, hi: int) -> None:  # pairs lo:hi (one thread's share; disjoint positions)
                for flat, dst, vals in self.joined[lo:hi]:
                    write_positions(flat, dst, vals, undo)

            sizes = [dst.numel() for _, dst, _ in self.joined]
            run_threaded(sizes, run, device=self.device)
            written += sum(sizes)
        for pairs in self.staged:
            written += pairs.write(undo)
        return written


def write_positions(flat: torch.Tensor, dst: torch.Tensor, values: torch.Tensor, undo: UndoLog | None,
                    offset: int = 0) -> int:
    """``flat[offset + dst] = values`` (int32 or int64 positions), the old values kept in ``undo`` first.

    Positions and values in host memory for a parameter on a device (a delta staged on the host)
    take :func:`write_staged`."""
    if dst.device != flat.device and flat.device.type != "cpu":
        return write_staged(flat, dst, values, undo, offset)
    values = values.to(flat.dtype)
    if undo is None:
        _put(flat, dst, offset, values)
    else:
        undo.change(flat, dst, values, offset)
    return dst.numel()


def apply_dense(view: LoaderView, params: dict[str, torch.Tensor], values: torch.Tensor,
                undo: UndoLog | None) -> int:
    """Copy a whole checkpoint tensor through ``view`` (strided copies, no loader)."""
    src = values.reshape(-1)
    written = 0
    for seg in view.segments:
        dst = seg.dst_view(flat_param(params[seg.param]))
        if undo is None:
            dst.copy_(seg.src_view(src))
        else:
            undo.change(dst, None, seg.src_view(src))
        written += seg.numel
    return written


#: checkpoint elements mapped per step when a range meets a strided (non-contiguous) segment
RANGE_CHUNK = 1 << 20


def apply_dense_range(view: LoaderView, params: dict[str, torch.Tensor], values: torch.Tensor, start: int) -> int:
    """Write checkpoint flat elements ``[start, start + len(values))`` through ``view`` (no undo:
    the bulk path of a seed or full update, whose failure ends in ``needs_seed``).

    Contiguous segments take one slice copy; strided ones (TP column shards) a whole-tensor
    strided copy when the range is the whole tensor, else index mapping in bounded chunks."""
    src = values.reshape(-1)
    stop = start + src.numel()
    whole = start == 0 and stop == math.prod(view.shape)
    written = 0
    for seg in view.segments:
        flat = flat_param(params[seg.param])
        if whole:
            seg.dst_view(flat).copy_(seg.src_view(src))
            written += seg.numel
        elif seg.contiguous:
            hit = _run_slices(seg, flat, src, start)
            if hit is not None:
                hit[0].copy_(hit[1])
                written += hit[1].numel()
        else:
            for c in range(start, stop, RANGE_CHUNK):
                idx = torch.arange(c, min(c + RANGE_CHUNK, stop), device=src.device)
                sel, dst = seg.map(idx)
                if sel.numel():
                    flat.index_copy_(0, dst, src.index_select(0, sel + (c - start)).to(flat.dtype))
                    written += sel.numel()
    return written


def dense_range_copies(view: LoaderView, params: dict[str, torch.Tensor], values: torch.Tensor, start: int
                       ) -> list[tuple[torch.Tensor, torch.Tensor, int]] | None:
    """What :func:`apply_dense_range` copies through a view that holds the whole tensor in
    contiguous segments (TP=1): ``(parameter slice, slice of values, its first checkpoint index)``
    per segment the range meets, for a caller that makes the copies fused with the digest and
    Inf/NaN count (:func:`delta_sync.digest.scan_many` with ``copy_to``, a bucket's ranges in one
    call) and compares after the write. None for any other view (strided or partial segments): the
    caller checks the values first, then writes."""
    if view.runs is None:
        return None
    src = values.reshape(-1)
    hits = (_run_slices(seg, flat_param(params[seg.param]), src, start) for seg in view.segments)
    return [hit for hit in hits if hit is not None]


def param_extent(param: torch.Tensor) -> tuple[int, int]:
    """``(address of the parameter's first element, elements from there to its storage's end)``:
    :func:`flat_param`'s extent, as integers."""
    data = param.data
    return data.data_ptr(), data.untyped_storage().nbytes() // data.element_size() - data.storage_offset()


def dense_range_rows(runs: tuple[tuple[str, int, int, int], ...], target, values: torch.Tensor, start: int,
                     spec: tuple[int, int, int]) -> list[tuple[int, ...]] | None:
    """:func:`dense_range_copies` through a view's :attr:`LoaderView.runs`, as rows of the digest
    kernel (:func:`delta_sync.digest.range_row`: copy, digest and Inf/NaN count in one pass)
    worked out with integers, no tensor view per range and segment (a 30B-A3B seed has ~19k
    ranges). ``target(param)``: :func:`param_extent` of a host parameter of ``values``' dtype
    (the caller checked it), None for one elsewhere; ``spec``: :func:`~delta_sync.digest.row_spec`
    of that dtype. None where rows cannot be made (values or a parameter off the host): the
    caller takes the tensor path. A run that would write outside its parameter's storage raises."""
    if not (values.is_cpu and values.is_contiguous()):
        return None
    size, src, stop = spec[0], values.data_ptr(), start + values.numel()
    rows = []
    for param, src_offset, numel, dst_offset in runs:
        lo, hi = max(start, src_offset), min(stop, src_offset + numel)
        if lo >= hi:
            continue
        extent = target(param)
        if extent is None:
            return None
        rows.append(range_row(src + (lo - start) * size, hi - lo, lo, spec,
                              _run_address(extent, param, dst_offset + lo - src_offset, hi - lo, size)))
    return rows


def _run_address(extent: tuple[int, int], param: str, first: int, count: int, size: int, where: str = "") -> int:
    """The address of element ``first`` of parameter ``param`` (:func:`param_extent` ``extent``,
    ``size`` bytes an element), refusing a run of ``count`` elements from there that leaves its storage."""
    address, room = extent
    if first < 0 or first + count > room:
        raise ValueError(f"{where}elements [{first}, {first + count}) of parameter {param!r} are outside its "
                         f"storage ({room} elements)")
    return address + first * size


def dense_range_target(view: LoaderView, params: dict[str, torch.Tensor], start: int, count: int
                       ) -> torch.Tensor | None:
    """The parameter slice that checkpoint elements ``[start, start + count)`` are written to, when
    they lie in one contiguous segment of a view that holds the whole tensor (a bulk range can
    then be received there directly); else None."""
    if sum(seg.numel for seg in view.segments) != math.prod(view.shape):
        return None
    for seg in view.segments:
        if seg.contiguous and seg.src_offset <= start and start + count <= seg.src_offset + seg.numel:
            flat = flat_param(params[seg.param])
            return flat.narrow(0, seg.dst_offset + start - seg.src_offset, count)
    return None


def _run_slices(seg: Segment, flat: torch.Tensor, src: torch.Tensor, start: int
                ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Where checkpoint elements ``[start, start + len(src))`` meet a contiguous segment:
    ``(parameter slice, the matching slice of src, its first checkpoint index)``, or None."""
    lo, hi = max(start, seg.src_offset), min(start + src.numel(), seg.src_offset + seg.numel)
    if lo >= hi:
        return None
    return flat.narrow(0, seg.dst_offset + lo - seg.src_offset, hi - lo), src.narrow(0, lo - start, hi - lo), lo


#: :func:`view_digests`: the most bytes of strided segments copied into runs before they are digested
RUN_COPY_BYTES = 256 << 20


def view_digests(views: list[LoaderView], params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Digest lanes, (views, lanes) int64 on the host, and held element counts of
    :func:`digest_view` for each of ``views``: the contiguous segments of host parameters as rows
    of the digest kernel read in one scan (a drift sweep or a verify names thousands of tensors:
    no host round trip, tensor view or digest object per tensor); other views whose segments each
    read one run of the checkpoint (device parameters; transposed experts) as ranges of
    :func:`~delta_sync.digest.scan_many`; any other view through :func:`view_sums`, their lanes
    read back together (one wait, not one per tensor)."""
    rows, owner, others = [], [], []
    extents: dict[str, tuple[int, int] | None] = {}
    as_rows = rows_supported()
    for k, view in enumerate(views):
        made = _view_rows(view, params, extents) if as_rows else None
        if made is None:
            others.append(k)
            continue
        rows += made
        owner += [k] * len(made)
    table = sum_rows(scan_rows_table(rows), owner, len(views))[:, :len(PRIMES)] if rows else \
        torch.zeros(len(views), len(PRIMES), dtype=torch.int64)
    # segments whose checkpoint side is one run (contiguous ones; vLLM-Ascend's transposed experts):
    # as ranges of scan_many (small ones folded together, large ones in bounded chunks, one read
    # per device and call), not element by element (an int64 position per element and ~20
    # launches per tensor: 2.5 GB on the device for a 30B model's embedding). A strided one is
    # copied into a run first, at most RUN_COPY_BYTES of copies alive at once.
    ranges, of_range, copied, rest = [], [], [], []  # (of_range: each range's view)
    for k in others:
        segments = views[k].segments
        if segments and all(seg.src_run for seg in segments):
            for seg in segments:
                ranges.append((seg.dst_view(flat_param(params[seg.param])), seg.src_offset, None))
                copied.append(0 if seg.contiguous else seg.numel * ranges[-1][0].element_size())
            of_range += [k] * len(segments)
        else:
            rest.append(k)
    got = []
    for lo, hi in native.capped_groups(copied, RUN_COPY_BYTES):
        got += scan_many([(v.reshape(-1) if not n else v.contiguous().reshape(-1), start, dst)
                          for (v, start, dst), n in zip(ranges[lo:hi], copied[lo:hi])])
    if got:  # (each view's ranges added up, as the rows are)
        rows = torch.tensor([[*digest, 0] for digest, _ in got], dtype=torch.int64)
        table = (table + sum_rows(rows, of_range, len(views))[:, :len(PRIMES)]) % _PRIMES
    sums = [view_sums(views[k], params)[0] for k in rest]  # (on the parameters' device)
    for dev in dict.fromkeys(s.device for s in sums):  # read back once per device, not once per tensor
        at = [i for i, s in enumerate(sums) if s.device == dev]
        for i, row in zip(at, torch.stack([sums[i] for i in at]).cpu()):
            table[rest[i]] = row
    return table, [sum(seg.numel for seg in view.segments) for view in views]


def _view_rows(view: LoaderView, params: dict[str, torch.Tensor], extents: dict) -> list[tuple[int, ...]] | None:
    """Rows of :func:`delta_sync.digest.range_row` reading each segment of ``view`` from its
    parameter, where every segment is contiguous and its parameter on the host; else None."""
    if not view.segments or not all(seg.contiguous for seg in view.segments):
        return None
    rows = []
    for seg in view.segments:
        param = params[seg.param]
        if seg.param not in extents:
            extents[seg.param] = param_extent(param) if param.is_cpu and param.element_size() > 1 else None
        extent = extents[seg.param]
        if extent is None:
            return None
        spec = row_spec(param.dtype)
        rows.append(range_row(_run_address(extent, seg.param, seg.dst_offset, seg.numel, spec[0], f"{view.name!r}: "),
                              seg.numel, seg.src_offset, spec))
    return rows


def digest_view(view: LoaderView, params: dict[str, torch.Tensor]) -> tuple[Digest, int]:
    """Digest of the checkpoint elements this worker holds for ``view``, read from the parameters,
    and how many there are (one host round trip per tensor)."""
    sums, count = view_sums(view, params)
    return Digest(*sums.tolist()), count


def view_sums(view: LoaderView, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Digest lanes of :func:`digest_view` as a tensor on the parameters' device.

    Host parameters: contiguous segments and rows contiguous on both sides take the compiled
    range kernel (memory speed). Elsewhere, and for any other layout, every element is mapped on
    the parameters' device (:func:`read_through`); one device per computation throughout."""
    total, count = None, 0
    for seg in view.segments:
        dst = seg.dst_view(flat_param(params[seg.param]))
        if dst.device.type == "cpu" and seg.contiguous:
            part = torch.tensor(digest_range(dst.reshape(-1), seg.src_offset), dtype=torch.int64)
        elif dst.device.type == "cpu" and seg.src_stride[-1:] == (1,) and dst.stride()[-1:] == (1,) and seg.numel:
            part = Digest()
            for row, start in zip(dst.reshape(-1, seg.shape[-1]), _row_starts(seg)):
                part = part + digest_range(row, start)
            part = torch.tensor(part, dtype=torch.int64)
        elif dst.device.type == "cpu" and seg.src_run:  # strided here, one run in the checkpoint: a copy
            part = torch.tensor(digest_range(dst.contiguous().reshape(-1), seg.src_offset), dtype=torch.int64)
        else:
            idx, vals = read_through(LoaderView(view.name, view.shape, view.dtype, [seg]), params)
            part = element_sums(idx, vals)
        total = part if total is None else (total + part) % _PRIMES.to(part.device)
        count += seg.numel
    if total is None:
        total = torch.zeros(len(_PRIMES), dtype=torch.int64)
    return total, count


_PRIMES = torch.tensor(PRIMES, dtype=torch.int64)


def _row_starts(seg: Segment) -> list[int]:
    """Checkpoint flat index of the first element of every row (last dim) of ``seg``, in order."""
    starts = [seg.src_offset]
    for n, stride in zip(seg.shape[:-1], seg.src_stride[:-1]):
        starts = [s + i * stride for s in starts for i in range(n)]
    return starts


def read_through(view: LoaderView, params: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(flat checkpoint indices, values)`` this worker holds for ``view``, both on the parameters'
    device (for digests)."""
    idx_parts, val_parts = [], []
    for seg in view.segments:
        flat = flat_param(params[seg.param])
        vals = seg.dst_view(flat).reshape(-1)
        idx = torch.full(seg.shape, seg.src_offset, dtype=torch.int64, device=flat.device)
        for d, (n, s) in enumerate(zip(seg.shape, seg.src_stride)):
            shape = [1] * len(seg.shape)
            shape[d] = n
            idx += (torch.arange(n, device=flat.device) * s).reshape(shape)
        idx_parts.append(idx.reshape(-1))
        val_parts.append(vals)
    if not idx_parts:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=view.dtype)
    return torch.cat(idx_parts), torch.cat(val_parts)
