"""Weights kept in flat buffers, diffed whole: a delta's trainer cost per byte, not per tensor.

Megatron's DDP keeps a model's parameters in a few contiguous buffers, and so do FSDP's flat
parameters; a custom trainer can do the same with :class:`FlatWeights`: one buffer per device and
dtype, every weight a view of it (:meth:`FlatWeights.adopt` moves a module's parameters in; their
optimizer keeps them). Passed to :meth:`~delta_sync.sync.WeightSync.update` in place of a stream it
is a :class:`~delta_sync.sync.ShardedSource`:

- seeds and full updates stream its views by name, as any stream;
- deltas diff each buffer against its snapshot (one copy per buffer, taken when a seed commits) in
  one scan, and map the changed positions to checkpoint tensors through a table of runs, one per
  tensor (:mod:`delta_sync.runs`): a constant number of operations per buffer whatever the
  tensor count, where a stream of ~19k tensors costs a Python step and a dozen checks each;
- the only per-tensor work of a delta is one check that every weight still lies where it was put
  (an address per tensor, read through C): a weight whose storage was replaced (``param.data = x``)
  is no longer in the buffer, so the deltas go through the stream, tensor by tensor, until the
  next seed, exactly but at the stream's speed (logged once).

With several trainer ranks (replicas: each holds every weight) each rank diffs and snapshots a
contiguous share of each buffer, whole tensors only: the shares are disjoint, the gather merges them.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import operator
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from . import collectives, native
from .diff import BitwiseDiff, restore
from .digest import Digest, span_digests, tensor_digests
from .gather import Ordered
from .patch import check_indexable, dtype_name
from .runs import Runs, map_changes, patch_batches, run_table

log = logging.getLogger(__name__)

#: each weight starts on a boundary of this many bytes in its buffer (what an allocator gives a
#: tensor of its own: vectorized kernels of the trainer read it as fast)
ALIGN_BYTES = 64
#: elements of one buffer at most (a tensor larger than that has one of its own): a delta's
#: indices are a buffer's int32 flat offsets, and a device diffs a buffer a batch at a time
MAX_BUFFER_ELEMENTS = 1 << 30

_SHAPE = operator.attrgetter("shape")


class _Buffer:
    """One flat buffer: its tensors (in stream order), their offsets, this rank's share of it."""

    def __init__(self, data: torch.Tensor, members: list[int], offsets: list[int], numels: list[int]):
        self.data, self.members, self.offsets, self.numels = data, members, offsets, numels
        self.lo = self.hi = 0  # this rank's elements [lo, hi) and its tensors [first, last)
        self.first = self.last = 0

    def share(self, rank: int, world: int) -> None:
        """This rank's contiguous share, cut at tensor boundaries near equal bytes."""
        ends = [o + n for o, n in zip(self.offsets, self.numels)]
        total = ends[-1] if ends else 0
        cuts = [0]
        for r in range(1, world):
            want = total * r // world
            k = bisect.bisect_left(ends, want)  # the tensor the cut falls in: the rank that holds more of it
            cuts.append(max(cuts[-1], k if k == len(ends) or ends[k] - want > want - self.offsets[k] else k + 1))
        cuts.append(len(ends))
        self.first, self.last = cuts[rank], cuts[rank + 1]
        self.lo = self.offsets[self.first] if self.first < self.last else 0
        self.hi = ends[self.last - 1] if self.first < self.last else 0
        # (the words the diff reads: whole 64-bit words around the share)
        per = 8 // self.data.element_size()
        self.lo, self.hi = self.lo // per * per, min(-(-self.hi // per) * per, self.data.numel())

    def span(self) -> torch.Tensor:
        return self.data.narrow(0, self.lo, self.hi - self.lo)


class FlatWeights:
    """Named weights in one flat buffer per device and dtype (module doc).

    ``FlatWeights(named)`` copies each ``(checkpoint name, tensor)`` in (floating tensors of the
    dtypes a patch carries); :attr:`tensors` maps each name to its view: train those. ``group``:
    the trainer ranks that share the update (default: the world, where one is initialized)."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], *, group=None):
        items = list(named)
        if not items:
            raise ValueError("FlatWeights of no tensors")
        seen: set[str] = set()
        for name, t in items:
            if name in seen:
                raise ValueError(f"FlatWeights: {name!r} given twice")
            seen.add(name)
            dtype_name(t.dtype, tensor=name)  # (a dtype a patch carries, or a clear refusal)
            check_indexable(name, t.numel())
        self.group = group
        self.names = [n for n, _ in items]
        self.shapes = [tuple(t.shape) for _, t in items]
        self.dtypes = [t.dtype for _, t in items]
        self.total_elements = sum(t.numel() for _, t in items)
        self._buffers: list[_Buffer] = []
        views: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for k, (_, t) in enumerate(items):
            groups.setdefault((t.device, t.dtype), []).append(k)
        for (device, dtype), alike in groups.items():
            align = max(1, ALIGN_BYTES // dtype.itemsize)
            sizes = [-(-items[k][1].numel() // align) * align for k in alike]
            for lo, hi in native.capped_groups(sizes, MAX_BUFFER_ELEMENTS):  # (offsets in int32, with room)
                members = alike[lo:hi]
                offsets = list(itertools.accumulate(sizes[lo:hi - 1], initial=0))
                data = torch.zeros(max(sum(sizes[lo:hi]), align), dtype=dtype, device=device)
                numels = [items[k][1].numel() for k in members]
                for k, off, n in zip(members, offsets, numels):
                    views[k] = data.narrow(0, off, n).view(items[k][1].shape).copy_(items[k][1].detach())
                self._buffers.append(_Buffer(data, members, offsets, numels))
        #: checkpoint name -> its view in a buffer
        self.tensors: dict[str, torch.Tensor] = dict(zip(self.names, views))
        #: what the trainer updates in place: the views, or the parameters they back (:meth:`adopt`)
        self._live: list[torch.Tensor] = list(views)
        self._ptrs = [v.data_ptr() for v in views]
        self._moved_warned = False
        self.differ = BitwiseDiff()
        self._snaps: list[torch.Tensor] | None = None  # each buffer's share, at the committed version
        self._seed_ok = False
        self._snap_failed = False  # taking the snapshots failed once: the store keeps them from then on
        self._undo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._tables = None  # run tables, made at the first delta
        self._groups = None  # the trainer's host group, where there are several ranks
        #: checkpoint name -> (buffer, its tensor's position there)
        self._where = {self.names[k]: (j, i) for j, b in enumerate(self._buffers) for i, k in enumerate(b.members)}

    @classmethod
    def adopt(cls, module: torch.nn.Module, *, name_map: Callable[[str], str | None] | None = None,
              group=None) -> "FlatWeights":
        """Move ``module``'s parameters into flat buffers: each parameter keeps its object (an
        optimizer built on it stays valid) and its values, its storage becomes a view of a buffer.
        Checkpoint names through ``name_map`` (default: :func:`~delta_sync.sync.default_name_map`;
        a parameter it maps to None is left where it is)."""
        if name_map is None:
            from .sync import default_name_map

            name_map = default_name_map
        params = [(name_map(n), p) for n, p in module.named_parameters()]
        params = [(n, p) for n, p in params if n is not None]
        flat = cls([(n, p.detach()) for n, p in params], group=group)
        with torch.no_grad():
            for (n, p) in params:
                p.data = flat.tensors[n]
        flat._live = [p for _, p in params]
        flat._ptrs = [p.data_ptr() for p in flat._live]
        return flat

    # ---- the stream (seeds, full updates, and deltas once a weight moved) ------------------------
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return zip(self.names, self._live)

    def __len__(self) -> int:
        return len(self.names)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self)

    # ---- ShardedSource ---------------------------------------------------------------------------
    def expects_to_serve(self) -> bool:
        # (once its snapshots could not be taken, WeightSync's store keeps them: no seed after seed)
        return not self._snap_failed and self._in_place(shapes=True)

    def ready(self) -> bool:
        return self._snaps is not None and self._in_place()

    def _in_place(self, shapes: bool = False) -> bool:
        """Does every weight still lie where it was put (the same answer on every rank)? Its address,
        at every question (~1 ms at ~19k tensors: a trainer may move a weight between any two
        updates); ``shapes``: its shape too (~3 ms more, at a seed: a weight reshaped in place, at
        its address, is not looked for between seeds)."""
        ok = list(map(torch.Tensor.data_ptr, self._live)) == self._ptrs
        return self._agreed(ok and (not shapes or list(map(_SHAPE, self._live)) == self.shapes))

    def _all(self, ok: bool) -> bool:
        """``ok`` on every rank (collective where there are several)."""
        return collectives.all_agree(ok, self._host_group()) if self._world() > 1 else ok

    def _agreed(self, ok: bool) -> bool:
        ok = self._all(ok)
        if not ok and not self._moved_warned:  # (logged once: every delta from here goes by the stream)
            self._moved_warned = True
            log.warning("delta-sync: a weight of FlatWeights no longer lies in its buffer (its storage was "
                        "replaced); deltas read the weights tensor by tensor until a new FlatWeights is made")
        return ok

    def seeded(self) -> None:
        self._seed_ok = self._in_place(shapes=True)

    def commit(self) -> None:
        if self._seed_ok:  # a seed just committed: snapshots of this rank's shares, taken now
            self._seed_ok, self._snaps, self._tables = False, None, None  # (the old ones' memory serves the new)
            rank, world = self._rank(), self._world()
            for b in self._buffers:
                b.share(rank, world)
            problem = None
            try:
                snaps = [b.span().clone() for b in self._buffers]
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: every rank falls back alike
                snaps, problem = None, f"{type(e).__name__}: {e}"
            self._snap_failed = not self._all(problem is None)
            if not self._snap_failed:
                self._snaps = snaps
            else:  # the stream serves the deltas; WeightSync sends a seed first (it staged no snapshot)
                log.warning("delta-sync: FlatWeights could not take its snapshots (%s); the next update reads "
                            "the weights tensor by tensor and tries again when it commits", problem or "on another rank")
        self._undo = {}

    def rollback(self) -> None:
        for k, (idx, old) in self._undo.items():
            restore(self._snaps[k], idx, old)
        self._undo, self._seed_ok = {}, False

    def reset(self) -> None:
        self._undo, self._snaps, self._seed_ok, self._tables = {}, None, False, None

    def local_patches(self) -> list[Ordered]:
        found = self.differ.absorb_many([(snap, b.span()) for snap, b in zip(self._snaps, self._buffers)])
        self._undo = {k: (idx, old) for k, (idx, _, old) in enumerate(found) if idx.numel()}
        out: list[Ordered] = []
        for table, ks in self._run_tables():
            got = map_changes(table, [found[k][:2] for k in ks])
            if got is not None:
                names, shapes = (list(map(lst.__getitem__, got[2])) for lst in (self.names, self.shapes))
                dtypes = {self._buffers[k].data.dtype for k in ks}  # (a buffer holds one dtype)
                out += patch_batches(*got, names, shapes, dtypes.pop() if len(dtypes) == 1
                                     else list(map(self.dtypes.__getitem__, got[2])))
        return sorted(out, key=lambda o: o.seq)

    def _run_tables(self) -> list:
        """One run per tensor of this rank's shares, as one table per element width and device."""
        if self._tables is None:
            runs, groups = [], {}
            for k, b in enumerate(self._buffers):
                mine = range(b.first, b.last)
                local = torch.tensor([b.offsets[i] - b.lo for i in mine], dtype=torch.int64)
                dev = b.data.device
                ints = [[b.numels[i] for i in mine], [b.members[i] for i in mine]]
                length, seq = (torch.tensor(v, dtype=torch.int64, device=dev) for v in ints)
                runs.append(Runs(b.span(), local.to(dev), length, seq, torch.zeros(len(mine), dtype=torch.int64,
                                                                                   device=dev)))
                groups.setdefault((b.data.element_size(), dev), []).append(k)
            pos_of = torch.arange(len(self.names), dtype=torch.int64)
            self._tables = [(run_table(runs, ks, pos_of), ks) for ks in groups.values()]
        return self._tables

    def local_digests(self, names: set[str] | None = None) -> dict[str, Digest]:
        """Digests of the committed values of this rank's tensors (whole: shares are whole tensors),
        as rows of one kernel scan where the snapshots are host memory (a sweep's window is hundreds
        of tensors)."""
        if self._snaps is None:
            return {}
        per_buffer: dict[int, tuple[list[str], list[int], list[int]]] = {}  # names, share offsets, sizes
        for name in (self.names if names is None else names):
            where = self._where.get(name)
            if where is None:
                continue
            j, i = where
            b = self._buffers[j]
            if b.first <= i < b.last:
                got = per_buffer.setdefault(j, ([], [], []))
                got[0].append(name)
                got[1].append(b.offsets[i] - b.lo)
                got[2].append(b.numels[i])
        out: dict[str, Digest] = {}
        for j, (chosen, offsets, numels) in per_buffer.items():
            snap = self._snaps[j]
            digests = span_digests(snap, offsets, numels)
            if digests is None:  # (off the host, or without the kernel: a view each)
                digests = tensor_digests([snap.narrow(0, o, n) for o, n in zip(offsets, numels)])
            out.update(zip(chosen, digests))
        return out

    # ---- ranks -----------------------------------------------------------------------------------
    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _host_group(self):
        if self._groups is None:  # (made once: every rank makes it at the same call)
            self._groups = collectives.TrainerGroups.around(self.group)
        return self._groups.host_group

    def nbytes(self) -> int:
        """Bytes of the buffers (what a snapshot of all of them takes)."""
        return sum(b.data.numel() * b.data.element_size() for b in self._buffers)
