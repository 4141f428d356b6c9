"""Learning the fast path's shard map at a seed (:mod:`update_weight.megatron_shard_delta`).

Each element of a local parameter is given its own id (``rank << shift | offset``) and sent through
Bridge's own ``megatron_to_hf`` conversions; every converted element then names the rank and offset
it came from. :class:`Planner` settles who owns each converted element, window by window (one
exchange of codes for whole tensors, a per-element ``all_reduce(MIN)`` only where a rank holds part
of one), and keeps this rank's runs (:func:`delta_sync.runs.owned_runs`). In a one-pass
seed the ids ride in the export itself (:class:`OnePassMapping`: an id and a value's bits in one
int64, or apart for large tensors), and a task laid out as an earlier one (:func:`layout_key`) takes
that task's map instead of converting a probe; :func:`same_bits` proves every owned element against
the exported values, so a map that is wrong refuses the seed.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from delta_sync import collectives, native
from delta_sync.diff import int_view

from delta_sync.runs import expand, long_runs, owned_runs

if TYPE_CHECKING:
    from .megatron_shard_delta import MegatronShardDelta

#: an element nobody converted from its own shard (the MIN of an owner all-reduce)
NOBODY = torch.iinfo(torch.int32).max
#: converted tensors whose owners are settled in one exchange of codes (their ids are held meanwhile)
_OWNER_WINDOW = 64
_OWNER_WINDOW_BYTES = 256 << 20


class Planner:
    """The shard map as converted tensors' ids arrive (a probe pass, or the seed's one-pass export):
    each window of tensors has its owners settled in one exchange of codes, this rank's runs noted,
    and, where the values came with the ids, the values this rank owns compared with its shards. A
    tensor laid out as an earlier task's output (``layout``: that task and the output's position)
    comes without ids and takes that output's holders and runs, kept for the tasks in ``shared``.

    A task whose outputs several ranks convert whole from their own shards (data-parallel replicas,
    replicated norms) goes to the one that owns the fewest elements so far, the highest rank on a
    tie (rank 0 also gathers, packs and sends): every rank sees every code in the same order, so all
    agree without a word, and each replica group diffs its share of the replicated weights instead
    of its lowest rank diffing all of them. All outputs of one task go to one rank: a rank diffs
    every parameter it owns any element of whole."""

    def __init__(self, source: "MegatronShardDelta", rank: int, shared: set[int] = frozenset()):
        self.source, self.rank, self.shared = source, rank, shared
        self.me = dist.get_rank(source._host_group()) if dist.is_initialized() else 0
        self.params: list[torch.Tensor] = []
        self.pieces: dict[int, list] = {}  # local param k -> [(run starts, lengths, plan index, targets)]
        self.names: list[str] = []
        self.seen: set[str] = set()
        self.problem: str | None = None
        # converted, owner not yet settled: (name, plan index, ids or None, local param k or None, id
        # shift, values, layout, task)
        self.window: list[tuple] = []
        self.held = 0
        #: (task, output position) -> (its owners as _owned_many says, elements, its runs were it this rank's)
        self.layouts: dict[tuple[int, int], tuple] = {}
        self.load: dict[int, int] = {}  # host-group rank -> elements it owns so far
        self.owner_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (task, whole holders) -> the owner

    def param(self, weight: torch.Tensor | None, world: int) -> tuple[int | None, int]:
        """``(k, id shift)`` of a task's local parameter (``(None, 0)`` where this rank holds none)."""
        if weight is None:
            return None, 0
        self.params.append(weight)
        return len(self.params) - 1, id_layout(weight.numel(), world)[0]

    def add(self, name: str, ids: torch.Tensor | None, k: int | None, shift: int, layout: tuple[int, int],
            values: torch.Tensor | None = None, task: int | None = None) -> None:
        """``name`` converted as output ``layout[1]`` of task ``layout[0]`` (or, without ``ids``, laid
        out as that output of that earlier task) by task ``task`` (``layout[0]`` if None)."""
        if name in self.seen:
            self.problem = self.problem or f"{name} converted twice"
            seq = None  # still settled with the others: every rank takes part in the same exchanges
        else:
            self.seen.add(name)
            self.names.append(name)
            seq = len(self.names) - 1
        if ids is not None:
            ids = ids.reshape(-1).to("cpu")
            self.held += ids.numel() * ids.element_size()
        self.window.append((name, seq, ids, k, shift, values, layout, layout[0] if task is None else task))
        self.held += values.numel() * values.element_size() if values is not None else 0
        if len(self.window) >= _OWNER_WINDOW or self.held >= _OWNER_WINDOW_BYTES:
            self.settle()

    def _owner(self, task: int, holders: tuple[int, ...], n: int) -> int:
        owner = self.owner_of.get((task, holders))
        if owner is None:
            owner = self.owner_of[(task, holders)] = min(holders, key=lambda r: (self.load.get(r, 0), -r))
        self.load[owner] = self.load.get(owner, 0) + n
        return owner

    def settle(self) -> None:
        """Owners of the window's tensors, their runs noted: one exchange of codes for all of them
        (those laid out as an earlier output take its codes: the same on every rank)."""
        window = self.window
        owned = iter(self.source._owned_many([(ids, k is not None, shift) for _, _, ids, k, shift, *_ in window
                                              if ids is not None], self.rank))
        for name, seq, ids, k, shift, values, layout, task in window:
            if ids is None:
                verdict, n, runs = self.layouts.get(layout, (None, 0, None))
            else:
                verdict, n = next(owned), ids.numel()
                # a rank owns only what it probed: ids name a task's own parameter
                mine = verdict if isinstance(verdict, torch.Tensor) else isinstance(verdict, tuple) and self.me in verdict
                runs = owned_runs(ids, mine, base=self.rank << shift) if mine is not False and k is not None else None
                if layout[0] in self.shared:
                    self.layouts[layout] = (verdict, n, runs)
            if verdict is None:
                self.problem = self.problem or f"no owner for some elements of {name}"
                continue
            if isinstance(verdict, tuple) and self._owner(task, verdict, n) != self.me:
                continue
            if seq is None or runs is None:
                continue
            local, length, target = runs
            if not length.numel():
                continue  # a parameter keeps a snapshot only if it owns some element
            self.pieces.setdefault(k, []).append((local, length, seq, target))
            if values is not None and not same_bits(self.params[k], values, local, length, target):
                self.problem = self.problem or f"map disagrees with the exported values of {name}"
        self.window, self.held = [], 0

    def finish(self) -> None:
        self.settle()
        self.source._keep_plan(self.names, self.problem, self.params, self.pieces)


class OnePassMapping:
    """A task's mapping in a one-pass seed (:meth:`MegatronShardDelta._plan_in_export`), task ``index``
    of the plan. Laid out as an earlier task (``template``), the values convert alone (the ids are the
    template's); else with ``probe`` the values convert as they are and ``probe`` converts the ids
    right after (kept in :attr:`ids`); else the parameter goes through the real conversion packed with
    its ids (``id << 32 | value bits``, int64). Every other attribute is the real mapping's."""

    def __init__(self, real, rank: int, k: int | None, shift: int, index: int, probe=None,
                 template: int | None = None):
        #: ``k``: the task's local parameter in the plan (None where this rank holds none)
        self.real, self.rank, self.k, self.shift, self.probe = real, rank, k, shift, probe
        self.index, self.template = index, template
        self.ids: dict | None = None

    def megatron_to_hf(self, weight, module):
        if self.probe is None and self.template is None:
            return self.real.megatron_to_hf(None if weight is None else pack_probe(weight, self.rank, self.shift), module)
        values = self.real.megatron_to_hf(weight, module)
        if self.probe is not None:
            clear_caches(self.real)
            self.ids = self.probe(weight, module)
        return values

    def __getattr__(self, name):
        return getattr(self.real, name)


#: a parameter of more elements than this converts its values and its probe ids apart in a one-pass
#: seed: packed, Bridge's gathers of it would move 8 bytes per element instead of 2 (+ the probe's
#: none), and bytes, not the conversion's collectives, bound a tensor this large (on this host's gloo
#: a 0.33B MoE of 0.4-0.8M-element experts seeded in 9.7 s packed against 4.0 s, a 4-layer 30B-A3B
#: skeleton of 2-4k-element experts in 7.8-8.2 s against 13.9-14.1 s with a probe pass)
PACKED_MAX_ELEMENTS = 1 << 18
#: the parameter dtypes whose bits ride beside a probe id in one int64 (one-pass seeds)
ONE_PASS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: a layer's or an expert's number in a parameter name (``layers.3.``, ``local_experts.17.``, and
#: Transformer Engine's grouped experts ``linear_fc1.weight17``)
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|(?<=\.weight)\d+$|(?<=\.bias)\d+$")


def layout_key(task) -> tuple:
    """What a task's conversion layout depends on, on this rank (:meth:`MegatronShardDelta._templates`)."""
    def pattern(names):
        if isinstance(names, dict):
            return tuple(sorted((k, pattern(v)) for k, v in names.items()))
        return _NUMBER.sub("#", str(names))

    mapping, weight, module = task.mapping, task.param_weight, task.megatron_module
    return (type(mapping).__module__, type(mapping).__qualname__,
            None if module is None else type(module).__qualname__,
            pattern(mapping.megatron_param), pattern(mapping.hf_param),
            None if weight is None else (tuple(weight.shape), weight.dtype, weight.device.type))


def pack_probe(weight: torch.Tensor, rank: int, shift: int) -> torch.Tensor:
    """``(rank << shift | offset) << 32 | bits`` of each element of ``weight``, int64, its shape: written
    as the int64's two 32-bit words (little-endian, as every host and accelerator here: the low word
    first), the value's bits zero-extended into the low one."""
    n = weight.numel()
    words = torch.empty(n, 2, dtype=torch.int32, device=weight.device)
    bits = int_view(weight.detach())
    if bits.element_size() == 2:
        halves = words.view(torch.int16)  # (n, 4): the low word's two halves first
        halves[:, 0] = bits
        halves[:, 1] = 0
    else:
        words[:, 0] = bits
    words[:, 1] = torch.arange(rank << shift, (rank << shift) + n, dtype=torch.int32, device=weight.device)
    return words.view(torch.int64).view(weight.shape)


def unpack_probe(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values of dtype, int32 ids)`` of a converted packed tensor (:func:`pack_probe`'s words read back);
    ``(something of its shape, None)`` where the conversion did not keep int64 (it computed: the seed is
    refused)."""
    if packed.dtype != torch.int64:
        return packed.to(dtype), None
    flat = packed.reshape(-1)
    width = torch.empty((), dtype=dtype).element_size()
    values = flat.view(int_view(torch.empty(0, dtype=dtype)).dtype).view(-1, 8 // width)[:, 0].contiguous()
    return values.view(dtype).view(packed.shape), flat.view(torch.int32).view(-1, 2)[:, 1].contiguous()


def same_bits(param: torch.Tensor, exported: torch.Tensor, local: torch.Tensor, length: torch.Tensor,
               target: torch.Tensor) -> bool:
    """Runs ``(local, length, target)``: each run of ``param`` (flat) equals ``exported`` (flat) at its
    target, bit for bit."""
    mine, flat = int_view(param.detach()), int_view(exported.detach()).to(param.device)  # one device per comparison
    local, length, target = (x.to(param.device) for x in (local, length, target))
    if long_runs(length):  # whole rows or tensors: compare run by run, no index expansion
        return all(native.same_bytes(mine.narrow(0, lo, n), flat.narrow(0, t, n))
                   for lo, t, n in zip(local.tolist(), target.tolist(), length.tolist()))
    return native.same_bytes(mine.take(expand(local, length)), flat.take(expand(target, length)))


def id_layout(numel: int, world: int) -> tuple[int, torch.dtype]:
    """``(shift, dtype)`` of the probe ids of a parameter of ``numel`` elements, ``rank << shift |
    offset``: int32 where the last rank's ids fit, else int64. Peers that convert one task together
    (TP shards, EP experts) hold parameters of one size, so they agree on both."""
    shift = max(1, (numel - 1).bit_length())
    return shift, (torch.int32 if world << shift <= 1 << 31 else torch.int64)


def own_mask(ids: torch.Tensor, rank: int, shift: int) -> torch.Tensor | bool:
    """Which of ``ids`` name ``rank``: True or False when all or none do, else a bool mask. One
    reduction (min and max) settles a tensor converted whole from one rank's shard, the usual case,
    with no per-element temporaries (a shift and compare of every id would allocate 9 bytes per
    element)."""
    if ids.numel() == 0:
        return True
    lo, hi = (int(x) >> shift for x in torch.aminmax(ids))
    if lo == hi or rank < lo or rank > hi:
        return lo == rank
    return (ids >> shift) == rank


class _ProbeGathers:
    """``torch.distributed.all_gather`` while shard-map probes convert (:func:`peer_probes`).

    Installed while at least one thread is inside :func:`peer_probes` and removed after the last
    leaves; it answers only the threads inside (each with its own rank and id shift, kept
    thread-local), and hands every other caller (a trainer thread of its own, a data loader) to
    the function it replaced, unchanged."""

    _lock = threading.Lock()
    _users = 0
    _real = None
    _installed = None
    _local = threading.local()

    @classmethod
    @contextlib.contextmanager
    def active(cls, rank: int, shift: int, trainer_group):
        with cls._lock:
            if cls._users == 0:
                cls._real = dist.all_gather
                dist.all_gather = cls._installed = cls.all_gather
            cls._users += 1
        cls._local.probe = (rank, shift, trainer_group)
        try:
            yield
        finally:
            cls._local.probe = None
            with cls._lock:
                cls._users -= 1
                if cls._users == 0:
                    if dist.all_gather is cls._installed:  # (unless someone replaced it meanwhile)
                        dist.all_gather = cls._real
                    cls._real = cls._installed = None

    @classmethod
    def all_gather(cls, tensor_list, tensor, group=None, async_op=False):
        real = cls._real
        probe = getattr(cls._local, "probe", None)
        if probe is None or async_op or tensor.dtype not in (torch.int32, torch.int64) or tensor.numel() == 0:
            return real(tensor_list, tensor, group=group, async_op=async_op)  # alike on every peer
        rank, shift, trainer_group = probe
        lo, hi = (int(x) >> shift for x in torch.aminmax(tensor))
        own = torch.tensor([1 if lo == hi == rank else 0], dtype=torch.int32, device=tensor.device)
        collectives.all_reduce(own, group, op=dist.ReduceOp.MIN)
        if not own.item():
            return real(tensor_list, tensor, group=group, async_op=async_op)
        for i, out in enumerate(tensor_list):
            peer = collectives.global_rank(group, i)
            if trainer_group is not None:
                peer = dist.get_group_rank(trainer_group, peer)
            out.copy_(tensor).add_((peer - rank) << shift)
        return None


def peer_probes(rank: int, shift: int, trainer_group):
    """While one task's probe converts on this thread: an ``all_gather`` (Bridge's TP and EP
    gathers) of a tensor that holds only this rank's own ids (``rank << shift | offset``: the probe,
    or a piece or re-layout of it) moves no bytes. Its peers convert the same task with probes of
    the same size and shift, laid out alike, so peer ``i``'s tensor is this one with peer ``i``'s
    trainer rank in the high bits: computed here. Every rank of the gather's group first says
    whether its tensor is such (one all-reduce of a flag); if any is not (e.g. a TP gather already
    mixed ranks' ids), the real ``all_gather`` runs, on every rank alike. A wrong computation
    cannot go unnoticed: the seed checks the map against the export bit for bit. Other threads'
    gathers are not touched (:class:`_ProbeGathers`)."""
    return _ProbeGathers.active(rank, shift, trainer_group)


def clear_caches(mapping, seen=None) -> None:
    """Empty the broadcast caches of a mapping and of the mappings it delegates to (AutoMapping)."""
    seen = seen if seen is not None else set()
    if id(mapping) in seen:
        return
    seen.add(id(mapping))
    for clear in ("clear_tensor_spec_output_cache", "clear_broadcast_cache"):
        fn = getattr(mapping, clear, None)
        if callable(fn):
            fn()
    for value in vars(mapping).values():
        if hasattr(value, "megatron_to_hf") and hasattr(value, "clear_broadcast_cache"):
            clear_caches(value, seen)
