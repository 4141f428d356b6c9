"""Trainer-side snapshot of the last committed version, sharded by ownership.

Each checkpoint tensor is *owned* by exactly one rank, assigned online in export order to the
least-loaded rank by bytes (deterministic: every rank sees the same order and sizes, so every
rank computes the same owner without communication). Only the owner keeps a snapshot of the
tensor and diffs it, so snapshot memory per rank is about model/world.

Invariant: between updates ``self._base`` holds exactly the committed version ``self.version``.
A seed *stages* full copies, folded in by :meth:`commit`. A delta's diff *advances* each snapshot in
the pass that reads it (changed words overwritten while in cache) and stages the old bits at the
patch's indices (memory O(changed)): :meth:`commit` then has nothing left to write, and
:meth:`rollback` scatters the old bits back, so the next diff is still against v-1.
"""

from __future__ import annotations

import functools
import itertools
import operator
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from . import accelerator, native
from .diff import (Absorbed, BitwiseDiff, FlatBatch, KernelFacts, flat_batches, flatten, kernel_facts_many,
                   on_one_device, restore, word_aligned)
from .errors import PatchValidationError
from .patch import DTYPE_NAMES, INT32_MAX, Patch, PatchBatch, check_indexable, dtype_name, member_elements


def dense_is_smaller(count: int, numel: int, element_size: int) -> bool:
    """Dense encoding moves fewer bytes than int32 index + value (density > 1/3 for bf16)."""
    return numel * element_size < count * (4 + element_size)


def _own(new: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``new`` as memory nobody else holds: a copy where it is still the caller's tensor (never one
    that carries the caller's autograd graph: a delta's tensors come as given, see ``_prepare_known``)."""
    if new.requires_grad:
        new = new.detach()
    return new.clone() if new.data_ptr() == given.data_ptr() else new.contiguous()


def _arena_copies(fresh: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor]]:
    """Copies of ``(item, tensor)`` (each a whole number of 8-byte words): those of one device and
    element width back to back in one new buffer (an arena), in order, so that a delta's diff reads
    and advances their snapshots as one span (:func:`delta_sync.diff._adjacent_runs`) instead of a
    view and a copy per tensor."""
    groups: dict[tuple, list[tuple[int, torch.Tensor]]] = {}
    for i, t in fresh:
        groups.setdefault((t.device, t.element_size()), []).append((i, t))
    out = []
    for (device, _), members in groups.items():
        dtype = members[0][1].dtype
        if all(t.dtype is dtype for _, t in members):  # (the usual case: no dtype view per tensor)
            sizes = [t.numel() for _, t in members]
            rooms = torch.empty(sum(sizes), dtype=dtype, device=device).split(sizes)
            out += [(i, room.view(t.shape).copy_(t)) for (i, t), room in zip(members, rooms)]
            continue
        sizes = [t.numel() * t.element_size() for _, t in members]
        rooms = torch.empty(sum(sizes), dtype=torch.uint8, device=device).split(sizes)
        out += [(i, room.view(t.dtype).view(t.shape).copy_(t)) for (i, t), room in zip(members, rooms)]
    return out


@dataclass
class _Staged:
    """What commit or rollback needs of a staged tensor; never a delta's patch (the packer drops
    each bucket's patches once the bucket is packed, so a streamed delta is not held whole)."""
    shape: tuple[int, ...]
    full: torch.Tensor | None = None  # seed / first sight of a tensor: the whole new value
    #: a delta's snapshot already advanced in place: (int32 flat indices, old bits there)
    undo: tuple[torch.Tensor, torch.Tensor] | None = None


_NAME, _TENSOR = operator.itemgetter(0), operator.itemgetter(1)
_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
_ON_HOST = operator.attrgetter("is_cpu")
_KERNEL, _WIDTH, _WORDS, _PTR = (operator.attrgetter(a) for a in ("kernel", "width", "words", "ptr"))
#: delta batch plans a store keeps (a model's ~19k tensors make ~10 batches)
MAX_PLANS = 256


class _Members(NamedTuple):
    """A diff batch's members (one element width, scanned together by the host kernel or by torch
    ops), in member order: checkpoint names, the tensors diffed, the caller's tensors (a full patch
    copies where they are the same memory), their snapshots' shapes, dtypes (``dtype``: the one of
    all, else None) and bytes (int64, on the host), the element width, positions in the output.
    Bytes and width are the snapshots' own, not the host kernel's facts (which are 0 for a device
    snapshot: a dense test on those made every changed device tensor a full patch)."""

    names: list[str]
    news: list[torch.Tensor]
    given: list[torch.Tensor]
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    dtype: torch.dtype | None
    nbytes: torch.Tensor
    width: int
    at: list[int] | range

    @classmethod
    def of(cls, names: list[str], news: list[torch.Tensor], given: list[torch.Tensor], facts: list["_Facts"],
           at: list[int] | range) -> "_Members":
        dtypes = list(map(_DTYPE, facts))
        return cls(names, news, given, list(map(_SHAPE, facts)), dtypes, _one(dtypes),
                   torch.tensor(list(map(_FACT_BYTES, facts)), dtype=torch.int64), dtypes[0].itemsize, at)


def _fit(m: "_Members", news: list[torch.Tensor], streamed: torch.dtype | bool) -> bool:
    """Do a planned batch's new tensors, checked as whole lists, each lie contiguous with its
    snapshot's shape and dtype (``streamed``: the stream's dtype, checked as it was read)?"""
    if list(map(_SHAPE, news)) != m.shapes or not all(map(torch.Tensor.is_contiguous, news)):
        return False
    if streamed is m.dtype and m.dtype is not None:  # (a stream of the snapshots' one dtype: checked)
        return True
    dtypes = list(map(_DTYPE, news))
    return dtypes.count(m.dtype) == len(dtypes) if m.dtype is not None else dtypes == m.dtypes


def _one(dtypes: list[torch.dtype]) -> torch.dtype | None:
    """The dtype all of ``dtypes`` are, else None."""
    return dtypes[0] if dtypes and dtypes.count(dtypes[0]) == len(dtypes) else None


class _Plan(NamedTuple):
    """A delta batch of these names as the host kernel and the patches need its snapshots, worked
    out at its first delta and kept while the snapshots live (their memory never moves; a commit
    that replaces one, a reset or a clear forgets every plan): the next delta of the same names
    checks only the new tensors against it."""

    names: list[str]
    bases: list[torch.Tensor]
    known: list[KernelFacts]
    words: list[int]
    ptrs: list[int]
    members: "_Members"  # (news, given and at filled in per delta)
    starts: list[int]  # each member's first word in the batch joined (a device trainer's weights, _joined)


class _HostViews:
    """A device batch's tensors as views of its copy in host memory (:meth:`SnapshotStore._joined`),
    made only where one is asked for (a patch sent whole): the kernel reads them by address."""

    def __init__(self, host: torch.Tensor, starts: list[int], shapes: list[tuple[int, ...]], lanes: int):
        self.host, self.starts, self.shapes, self.lanes = host, starts, shapes, lanes

    def __len__(self) -> int:
        return len(self.shapes)

    def __getitem__(self, k: int) -> torch.Tensor:
        lo, hi = self.starts[k] * self.lanes, self.starts[k + 1] * self.lanes
        return self.host.narrow(0, lo, hi - lo).view(self.shapes[k])


class _FlatPlan(NamedTuple):
    """A delta batch of these names on the torch path (device snapshots, or no host kernel), kept as
    a :class:`_Plan` is: the snapshots, their device index, all members (their shapes and dtype,
    what the new tensors are checked against), and the scan batches (``lo``, ``hi``, the
    :class:`~delta_sync.diff.FlatBatch` of ``lo:hi`` and its members; None, None for one tensor
    scanned alone, as large as a batch or alone between runs)."""

    names: list[str]
    bases: list[torch.Tensor]
    device: int
    members: "_Members"
    batches: list[tuple[int, int, FlatBatch | None, "_Members | None"]]  # (None: a tensor scanned alone)


class _Facts(NamedTuple):
    """What a delta needs of a snapshot, fixed while it lives: the kernel's facts, its shape, dtype,
    bytes."""

    kernel: KernelFacts
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


_FACT_BYTES = operator.attrgetter("nbytes")


def _facts_of_snapshots(snaps: list[torch.Tensor]) -> list[_Facts]:
    """Each snapshot's :class:`_Facts` (its kernel facts worked out together)."""
    return list(map(_Facts, kernel_facts_many(snaps), map(tuple, map(_SHAPE, snaps)), map(_DTYPE, snaps),
                    map(_FACT_BYTES, snaps)))


#: a tensor of one of the delta's kernel batches: its undo is the batch's (``SnapshotStore._undo``)
_IN_BATCH = _Staged(())


@dataclass
class SnapshotStore:
    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"
    differ: BitwiseDiff = field(default_factory=BitwiseDiff)

    def __post_init__(self):
        self.device = torch.device(self.device)
        self.version: int | None = None
        self._owner: dict[str, int] = {}
        self._load = [0] * self.world_size
        self._base: dict[str, torch.Tensor] = {}
        self._staged: dict[str, _Staged] = {}
        self._spare: dict[str, torch.Tensor] = {}  # a reset snapshot's memory, reused by the next seed
        #: each snapshot's kernel facts, shape and dtype, worked out at its first diff (a snapshot's
        #: memory never moves): a delta reads them here, not from the tensor (~19k tensors at 30B-A3B)
        self._facts: dict[str, _Facts] = {}
        #: by kind, first name and length (see _Plan, _FlatPlan, _kept_plan)
        self._plans: dict[tuple | None, _Plan | _FlatPlan] = {}
        #: a delta's kernel batches: each one's old bits and the snapshots they go back into
        self._undo: list[tuple[Absorbed, list[torch.Tensor]]] = []

    def _holds(self, device: torch.device) -> bool:
        """Is ``device`` the snapshots' device? A store given "cuda" without an index holds the one
        current when asked, as ``.to("cuda")`` does (compared as given, a tensor's cuda:0 differed,
        and every seed bucket handed to the store was copied again)."""
        mine = self.device
        if mine.index is None and mine.type != "cpu" and device.type == mine.type:
            return device.index == accelerator.device_module(mine).current_device()
        return device == mine

    # ---- ownership -------------------------------------------------------------------------
    def owner(self, name: str, nbytes: int) -> int:
        """Owner rank of ``name``; assigned on first sight to the least-loaded rank."""
        if name not in self._owner:
            r = min(range(self.world_size), key=lambda i: (self._load[i], i))
            self._owner[name] = r
            self._load[r] += nbytes
        return self._owner[name]

    def owns(self, name: str, nbytes: int) -> bool:
        return self.world_size == 1 or self.owner(name, nbytes) == self.rank

    # ---- prepare / commit ------------------------------------------------------------------
    def prepare(self, name: str, tensor: torch.Tensor, *, full: bool = False) -> Patch:
        """Stage ``tensor`` as the next value of ``name`` and return what must be sent.

        A full patch when ``full`` is asked, when the tensor has no snapshot yet, or when dense
        is smaller than sparse; otherwise the sparse bitwise diff against the snapshot.
        ``tensor`` may alias a live parameter: the snapshot never keeps a reference to it.
        """
        return self.prepare_many([(name, tensor)], full=full)[0]

    def prepare_many(self, items: list[tuple[str, torch.Tensor]], *, full: bool = False, batched: bool = False
                     ) -> list[Patch | PatchBatch | None]:
        """:meth:`prepare` of ``(name, tensor)`` items, their diffs run together (a model's many small
        tensors share the host kernel's calls). A bad item raises before anything of ``items`` is
        diffed; what was staged before stays staged until :meth:`rollback`.

        With ``batched``, the sparse patches of the tensors the kernel scanned together come as one
        :class:`~delta_sync.patch.PatchBatch` per element width, at the position of its first tensor
        (None at the others', and where nothing changed): no Python object per changed tensor.
        The tensors may require grad: the bits are read, never a graph, and what is kept of them is
        detached."""
        if not full and self._facts:
            known = self._prepare_known(list(map(_NAME, items)), list(map(_TENSOR, items)), batched, False)
            if known is not None:
                return known
        return self._prepare_each(items, full, batched)

    def prepare_lists(self, names: list[str], tensors: list[torch.Tensor], *, batched: bool = False,
                      streamed: torch.dtype | bool = False) -> list[Patch | PatchBatch | None]:
        """:meth:`prepare_many` of a delta's ``names[k]``, ``tensors[k]`` given as two lists (a
        model's ~19k tensors: no pair made per tensor where the checks as lists hold). ``streamed``:
        the tensors come from a :class:`~delta_sync.prepare.TensorStream` (each name once per
        update), of the dtype given here where it is one (that of the stream)."""
        if self._facts:
            known = self._prepare_known(names, tensors, batched, streamed)
            if known is not None:
                return known
        return self._prepare_each(list(zip(names, tensors)), False, batched)

    def _prepare_each(self, items: list[tuple[str, torch.Tensor]], full: bool, batched: bool
                      ) -> list[Patch | PatchBatch | None]:
        """:meth:`prepare_many` with a step per tensor (what the checks as lists did not take)."""
        out: list[Patch | PatchBatch | None] = [None] * len(items)
        diffs: list[tuple[int, torch.Tensor]] = []  # (item, its tensor on the snapshot's device)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (its snapshot, that tensor), for the differ
        facts: list[_Facts] = []  # each snapshot's
        fresh: list[tuple[int, torch.Tensor]] = []  # (item, its tensor): a snapshot copied into an arena
        on_host = self.device.type == "cpu"
        bases, known = self._base, self._facts
        self._unstaged_all([name for name, _ in items])
        for i, (name, tensor) in enumerate(items):
            # (per tensor of a model's ~19k: the checks' calls only where one fails)
            base = bases.get(name)
            new = tensor.detach() if tensor.requires_grad else tensor  # (the bits are read, never a graph)
            if not (new.is_cpu and on_host) and not self._holds(new.device):  # (is_cpu: no device object made)
                new = new.to(self.device, non_blocking=False)
            if base is not None:  # (its snapshot's dtype and size were checked when it was made)
                fact = known.get(name)
                if fact is None:
                    fact = known[name] = _facts_of_snapshots([base])[0]
                if new.shape != fact.shape or new.dtype is not fact.dtype:
                    raise PatchValidationError(
                        name, f"shape/dtype changed from {fact.shape}/{fact.dtype} to "
                        f"{tuple(new.shape)}/{new.dtype}; a changed model needs a new seed",
                        kept=f"snapshot v{self.version}")
                if not full:
                    diffs.append((i, new))
                    pairs.append((base, new))
                    facts.append(fact)
                    continue
            elif tensor.dtype not in DTYPE_NAMES or tensor.numel() > INT32_MAX:
                check_indexable(name, tensor.numel())
                dtype_name(tensor.dtype, tensor=name)
            spare = self._spare.pop(name, None)
            if spare is not None and spare.shape == new.shape and spare.dtype == new.dtype:
                copy = spare.copy_(new)  # a re-seed reuses the memory of the snapshot it replaces
            elif new.data_ptr() == tensor.data_ptr() and new.numel() * new.element_size() % 8 == 0:
                fresh.append((i, new))
                continue
            else:
                copy = _own(new, tensor)
            out[i] = Patch.full(name, copy)
            self._staged[name] = _Staged(out[i].shape, copy)
        for i, copy in _arena_copies(fresh):
            out[i] = Patch.full(items[i][0], copy)
            self._staged[items[i][0]] = _Staged(out[i].shape, copy)
        if diffs:
            self._diff(items, diffs, pairs, facts, batched, out)
        return out

    def _prepare_known(self, names: list[str], news: list[torch.Tensor], batched: bool, streamed: torch.dtype | bool
                       ) -> list | None:
        """:meth:`prepare_many` of a delta whose every tensor the host kernel scans in one width: each
        one's snapshot and its facts known, the new tensor host memory of the snapshot's shape and
        dtype, contiguous, word-aligned (the usual delta of a host trainer). Those checks run over
        whole lists (map of C calls, list compares) against the batch's :class:`_Plan`, not as a
        Python step per tensor; None where one does not hold: the general path then decides (and
        names the tensor). The kernel reads the new tensors by address, so one that requires grad
        needs no detached view here (a dense patch's copy is detached, ``_own``)."""
        if self.device.type != "cpu" or not self.differ.use_native or native.kernel() is None:
            return self._prepare_flat(names, news, batched, streamed)
        plan = self._plan(names)
        if plan is None:
            return None
        m, given = plan.members, news
        if not all(map(_ON_HOST, news)):  # a device trainer's weights against host snapshots
            news = self._joined(plan, news, streamed)
            if news is None:
                return None
            ptrs = list(map(news.host.data_ptr().__add__, map((8).__mul__, plan.starts[:-1])))
        else:
            ptrs = list(map(torch.Tensor.data_ptr, news))
            if functools.reduce(operator.or_, ptrs, 0) & 7 or not _fit(m, news, streamed):
                return None
        if not streamed:  # (a stream names each tensor once per update: its own check)
            self._unstaged_all(names)
        out: list[Patch | PatchBatch | None] = [None] * len(names)
        b = self.differ.absorb_known(plan.bases, news, plan.known, ptrs, facts=(plan.words, plan.ptrs))
        self._take([(b, m._replace(news=news, given=given, at=range(len(names))), plan.bases)], batched, out)
        return out

    def _joined(self, plan: _Plan, news: list[torch.Tensor], streamed: torch.dtype | bool) -> _HostViews | None:
        """``news``, a device trainer's weights of a batch whose snapshots are host memory, brought
        over as one: joined on their device in one call and copied to the host once (a copy per
        tensor waited for the device each time: ~19k waits a delta at 30B-A3B); None where they are
        not all contiguous, on one device, of the snapshots' shapes and their one dtype, or the
        device has no room to join them (a batch is at most ``DIFF_BATCH_BYTES``)."""
        m = plan.members
        if m.dtype is None or not _fit(m, news, streamed) or not on_one_device(news, news[0].get_device()):
            return None
        try:  # (the batch once more in device memory for a moment, and its copy on the host)
            host = accelerator.to_host(flatten(news))
        except torch.OutOfMemoryError:  # a trainer's device nearly full: copied tensor by tensor instead
            return None
        return _HostViews(host, plan.starts, m.shapes, 8 // m.width)

    def _prepare_flat(self, names: list[str], news: list[torch.Tensor], batched: bool, streamed: torch.dtype | bool
                      ) -> list | None:
        """:meth:`_prepare_known` on the torch path (device snapshots, or no host kernel): the new
        tensors checked as whole lists against the batch's :class:`_FlatPlan` (each contiguous, of
        its snapshot's shape and the one dtype, on the snapshots' device, word-aligned), then each of
        the plan's batches scanned with its snapshots' layout known (:meth:`BitwiseDiff.
        absorb_flat_known`): a device's ~19k tensors cost no Python step each (~18 us a tensor on an
        H200 before). None where a check fails: the general path then decides (and names the tensor)."""
        plan = self._flat_plan(names)
        if plan is None:
            return None
        m = plan.members
        if (not _fit(m, news, streamed) or not on_one_device(news, plan.device)
                or functools.reduce(operator.or_, map(torch.Tensor.data_ptr, news), 0) & 7):
            return None
        if not streamed:  # (a stream names each tensor once per update: its own check)
            self._unstaged_all(names)
        taken: list[tuple[Absorbed, _Members, list[torch.Tensor]]] = []
        alone: list[tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []  # (position, its scan)
        try:
            for lo, hi, batch, members in plan.batches:
                part = news[lo:hi]
                if batch is None:  # a tensor as large as a batch: scanned where it lies
                    new = part[0].detach() if part[0].requires_grad else part[0]
                    alone.append((lo, self.differ.absorb(plan.bases[lo], new)))
                    continue
                b = self.differ.absorb_flat_known(batch, part, range(lo, hi))
                taken.append((b, members._replace(news=part, given=part, at=range(lo, hi)), batch.olds))
        except BaseException:  # all or nothing: what advanced goes back
            for b, _, olds in taken:
                b.restore(olds)
            for i, got in alone:
                restore(plan.bases[i], got[0], got[2])
            raise
        for i, got in alone:  # (its undo kept before any patch is made, as _diff does)
            self._staged[names[i]] = _Staged(m.shapes[i], undo=(got[0], got[2]))
        out: list[Patch | PatchBatch | None] = [None] * len(names)
        self._take(taken, batched, out)
        for i, got in alone:
            out[i] = self._sparse_or_full((names[i], news[i]), news[i], got[0], got[1])
        return out

    def _flat_plan(self, names: list[str]) -> "_FlatPlan | None":
        """The :class:`_FlatPlan` of ``names`` (kept, or worked out now); None where one has no
        snapshot, or they are not all of one dtype and device in whole 64-bit words."""
        return self._kept_plan("torch ops", names, self._make_flat_plan)

    def _make_flat_plan(self, names: list[str], facts: list["_Facts"]) -> "_FlatPlan | None":
        bases = list(map(self._base.__getitem__, names))
        members = _Members.of(names, [], [], facts, range(0))
        cut = flat_batches(bases, self.differ.batch_words) if members.dtype is not None else None
        if cut is None:
            return None
        batches = [(lo, hi, batch, _Members.of(names[lo:hi], [], [], facts[lo:hi], range(0)) if batch else None)
                   for lo, hi, batch in cut]
        return _FlatPlan(list(names), bases, bases[0].get_device(), members, batches)

    def _plan(self, names: list[str]) -> _Plan | None:
        """The :class:`_Plan` of ``names`` (kept, or worked out now); None where one of them has no
        snapshot, or they are not all of one width the kernel scans."""
        return self._kept_plan("host kernel", names, self._make_plan)

    def _make_plan(self, names: list[str], facts: list["_Facts"]) -> _Plan | None:
        known = list(map(_KERNEL, facts))
        width = known[0].width
        if not width or list(map(_WIDTH, known)).count(width) != len(known):
            return None
        bases = list(map(self._base.__getitem__, names))
        words = list(map(_WORDS, known))
        return _Plan(list(names), bases, known, words, list(map(_PTR, known)),
                     _Members.of(names, [], [], facts, range(0)), list(itertools.accumulate(words, initial=0)))

    def _kept_plan(self, kind: str, names: list[str], make):
        """The plan of ``kind`` for ``names``: kept from an earlier delta (by first name and length), or
        ``make(names, their snapshots' facts)`` now and kept; None where one of them has no snapshot
        or ``make`` finds none."""
        key = (kind, names[0], len(names)) if names else None
        plan = self._plans.get(key)
        if plan is not None and plan.names == names:  # (equal names are mostly the same objects)
            return plan
        facts = list(map(self._facts.get, names))
        if None in facts:  # (the first delta after a seed: its snapshots' facts, worked out together)
            facts = self._facts_of(names, facts)
        if not facts:
            return None
        plan = make(names, facts)
        if plan is not None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _facts_of(self, names: list[str], facts: list["_Facts | None"]) -> list["_Facts"] | None:
        """``facts`` (of ``names``) with the missing ones worked out from their snapshots together and
        kept; None where one of them has no snapshot (the general path then decides)."""
        missing = [k for k, f in enumerate(facts) if f is None]
        lacking = [names[k] for k in missing]
        if not self._base.keys() >= set(lacking):  # (a set test: ``None in`` a list of tensors calls == on each)
            return None
        bases = list(map(self._base.__getitem__, lacking))
        new = _facts_of_snapshots(bases)
        self._facts.update(zip(lacking, new))
        for k, f in zip(missing, new):
            facts[k] = f
        return facts

    def _diff(self, items: list[tuple[str, torch.Tensor]], diffs: list[tuple[int, torch.Tensor]],
              pairs: list[tuple[torch.Tensor, torch.Tensor]], facts: list["_Facts"], batched: bool, out: list) -> None:
        """The diff of ``items[i]`` for each ``(i, new)`` of ``diffs`` (``pairs``: its snapshot and
        ``new``, each pair's shape, dtype and device checked; ``facts``: each snapshot's): snapshots
        advanced, their undo kept, each one's patch (or its batch's) into ``out[i]``."""
        batches, single = self.differ.absorb_batched(pairs, same=True, known=[f.kernel for f in facts])
        # every snapshot advanced: each one's undo is kept before any patch is made (a failure
        # making one, a copy out of memory, must leave a rollback that puts all of them back)
        alone = any(single)  # (a host store's pairs are all in the kernel's batches)
        if alone:
            for (i, new), got in zip(diffs, single):
                if got is not None:
                    self._staged[items[i][0]] = _Staged(tuple(new.shape), undo=(got[0], got[2]))
        taken = []
        for b in batches:
            at = [diffs[k][0] for k in b.members]
            taken.append((b, _Members.of([items[i][0] for i in at], [diffs[k][1] for k in b.members],
                                         [items[i][1] for i in at], [facts[k] for k in b.members], at),
                          [pairs[k][0] for k in b.members]))
        self._take(taken, batched, out)
        if alone:
            for (i, new), got in zip(diffs, single):
                if got is not None:
                    out[i] = self._sparse_or_full(items[i], new, got[0], got[1])

    def _take(self, batches: list[tuple[Absorbed, "_Members", list[torch.Tensor]]], batched: bool, out: list
              ) -> None:
        """Kernel batches of advanced snapshots ``(batch, its members, their snapshots)``: every
        batch's undo kept (the old bits, not the new ones the patches carry) and its names marked
        staged before any patch is made, then each batch's patches into ``out`` (one
        :class:`PatchBatch` per dtype with ``batched``, else a patch per member)."""
        for b, m, bases in batches:
            self._undo.append((replace(b, new=None), bases))
            self._staged.update(dict.fromkeys(m.names, _IN_BATCH))
        for b, m, _ in batches:
            if batched:
                self._batch(b, m, out)
            else:
                for k, (idx, bits, _) in enumerate(b.parts()):
                    out[m.at[k]] = self._sparse_or_full((m.names[k], m.given[k]), m.news[k], idx, bits)

    @staticmethod
    def _sparse_or_full(item: tuple[str, torch.Tensor], new: torch.Tensor, idx: torch.Tensor, bits: torch.Tensor
                        ) -> Patch:
        """The patch of a diffed tensor: sparse, or its full value where dense is smaller."""
        name, tensor = item
        if dense_is_smaller(idx.numel(), new.numel(), new.element_size()):
            return Patch.full(name, _own(new, tensor))
        return Patch(name, tuple(new.shape), new.dtype, idx, bits.view(new.dtype))

    @staticmethod
    def _batch(b: Absorbed, m: "_Members", out: list) -> None:
        """``b``'s sparse patches as one :class:`PatchBatch` per dtype (a kernel batch holds one
        element width), each at its first changed member's position of ``out``; full patches for
        those where dense is smaller (the batches' buffers then leave them out). The members' shapes,
        dtypes and sizes are their snapshots' (``m``): no call on a tensor per member."""
        counts = b.counts.tolist()
        dense = b.counts * (4 + m.width) > m.nbytes  # dense_is_smaller, for every member at once
        for k in dense.nonzero().squeeze(1).tolist():
            out[m.at[k]] = Patch.full(m.names[k], _own(m.news[k], m.given[k]))
        nonzero = b.counts > 0
        changed = nonzero & ~dense
        for dt in (m.dtype,) if m.dtype is not None else dict.fromkeys(m.dtypes):
            sparse = changed if m.dtype is not None else changed & torch.tensor([d is dt for d in m.dtypes])
            ks = sparse.nonzero().squeeze(1).tolist()
            if not ks:
                continue
            idx, bits = b.indices, b.new
            if bool((sparse != nonzero).any()):  # others share the buffers: this batch's elements alone
                at = member_elements(sparse, b.counts, idx.device)  # (counts live on the host)
                idx, bits = idx.index_select(0, at), bits.index_select(0, at)
            if len(ks) == len(counts):  # (every member changed, sparse: the lists as they are)
                names, shapes, kept = m.names, m.shapes, counts
            else:
                names, shapes, kept = [m.names[k] for k in ks], [m.shapes[k] for k in ks], [counts[k] for k in ks]
            out[m.at[ks[0]]] = PatchBatch(names, shapes, dt, kept, idx, bits.view(dt))

    def adopt(self, name: str, tensor: torch.Tensor) -> None:
        """Stage ``tensor`` itself, not a copy, as the next full value of ``name``: memory the caller
        filled for this and gives up (a seed's bucket, see ``BucketPacker.keep``). A tensor on another
        device than the snapshot's, or not word-aligned for the diff kernel, is copied instead."""
        self._spare.pop(name, None)  # the replaced snapshot's memory goes as the new one arrives
        if not self._holds(tensor.device) or not tensor.is_contiguous() or not word_aligned(tensor):
            self.prepare(name, tensor, full=True)
            return
        self._unstaged(name)
        self._staged[name] = _Staged(tuple(tensor.shape), tensor)

    def _unstaged_all(self, names: list[str]) -> None:
        """:meth:`_unstaged` of every name, and none given twice (one set test, not one a tensor)."""
        if not self._staged.keys().isdisjoint(names) or len(set(names)) < len(names):
            given: set[str] = set()
            for name in names:
                self._unstaged(name, given)
                given.add(name)

    def _unstaged(self, name: str, also: set[str] = frozenset()) -> None:
        """Refuse a name staged already in this update (or among ``also``, a batch being staged)."""
        if name in self._staged or name in also:
            raise PatchValidationError(name, "tensor staged twice in one update")

    def commit(self, version: int) -> None:
        """Fold every staged value into the snapshot: it now holds ``version``."""
        replaced = False
        for name, st in self._staged.items():
            if st.full is not None:  # (a delta's snapshots advanced during its diff already)
                self._base[name] = st.full if st.full.shape == st.shape else st.full.reshape(st.shape)
                self._facts.pop(name, None)
                replaced = True
        if replaced:  # (a plan holds the replaced snapshots' memory)
            self._plans.clear()
        self._staged.clear()
        self._undo.clear()
        self._spare.clear()
        self.version = version

    def rollback(self) -> None:
        """Forget everything staged; the snapshot is back at the committed version."""
        for name, st in self._staged.items():
            if st.undo is not None:
                restore(self._base[name], *st.undo)
        for batch, snapshots in self._undo:
            batch.restore(snapshots)
        self._staged.clear()
        self._undo.clear()

    def reset(self) -> None:
        """Forget the snapshot too (engine needs a seed): the next prepare sends full tensors.

        Its memory is kept until the next commit, for the seed to copy into (no fresh pages)."""
        self._staged.clear()
        self._undo.clear()
        self._spare.update(self._base)
        self._base.clear()
        self._facts.clear()
        self._plans.clear()
        self.version = None

    def clear(self) -> None:
        """Forget the snapshot and let its memory go (another owner, a sharded source's shard
        snapshots, backs the deltas)."""
        self._staged.clear()
        self._undo.clear()
        self._base.clear()
        self._facts.clear()
        self._plans.clear()
        self._spare.clear()
        self.version = None

    def snapshot_of(self, name: str) -> torch.Tensor | None:
        return self._base.get(name)

    def snapshots(self):
        """``(name, tensor)`` of every committed snapshot this rank owns."""
        return self._base.items()
