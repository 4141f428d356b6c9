"""The trainer-side fast path: diff each rank's local Megatron shards, map changes to checkpoint
coordinates with Bridge's own conversion code, never run the full export for a delta.

Bridge's export gathers every TP/EP shard, broadcasts every PP stage and re-lays QKV / gate-up /
experts into Hugging Face tensors on every rank. A delta only needs where each
*changed* element of a local shard lands in the checkpoint. That map is fixed for a given model
layout, so it is learned once, at the seed, by running Bridge's ``megatron_to_hf`` conversions on
*probe* tensors: each element of a local parameter holds its own id (``rank << s | offset``, for a
parameter of at most ``2**s`` elements; int32 where every rank's ids fit, which halves the bytes
Bridge gathers, else int64: no float64 ever enters a collective, which HCCL lacks). Every output
element then names the rank and offset it came from, through
whatever Bridge does (TP gather, QKV per-group interleave, gate/up halves, expert renumbering,
PP broadcast, vocab padding dropped). Where several ranks hold the same element (replicated norms
at TP>1, data-parallel replicas), one of them owns it: a task its holders each converted whole (one
code per rank and tensor says so) goes to the holder that owns the fewest elements so far, so
replicas share the diff; an element of a tensor gathered across ranks goes to the lowest rank
holding it (an ``all_reduce(MIN)`` per element over the host group, for those tensors only). Runs
are found in a few vectorized passes over each converted tensor (no sort of its elements). A task
laid out exactly as an earlier one (on every rank the same mapping and module class, the same names
but for layer and expert numbers, the same local parameter shape: a MoE's experts, repeated layers)
is not probed in a one-pass seed: its map is the earlier task's, which the seed's check below proves
or refuses.

Each rank keeps, per local parameter, the *runs* of owned elements that are contiguous in both
coordinates (``local_start, length, tensor, checkpoint_start``) and a bf16 snapshot of that
parameter. A delta is then: bitwise diff of the local parameters against their snapshots (the
same diff as the reference path), one ``searchsorted`` of every changed offset among the runs of
all of them, kept as one patch batch per dtype (counts per checkpoint tensor, indices, values):
a few operations per rank, whatever the count of parameters or tensors. Memory: one snapshot of
the parameters this rank owns elements of (about model / (TP x PP x EP)), plus the runs (a few
per row).

The map is checked bit for bit against the reference export during the seed that builds it: every
owned element must equal the exported tensor's element at its mapped position, and every exported
element must have exactly one owner. If anything disagrees (a conversion that computes instead of
moving, a dtype cast), the fast path stays off and every delta takes the reference path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import operator
import re
import threading
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from delta_sync import collectives, native
from delta_sync.accelerator import read_back
from delta_sync.collectives import TrainerGroups
from delta_sync.diff import BitwiseDiff, int_view, restore
from delta_sync.errors import DeltaSyncError
from delta_sync.digest import Digest, digest_elements, scan_many
from delta_sync.gather import Ordered
from delta_sync.patch import Patch, PatchBatch

from .megatron_source import BridgeExportSource

log = logging.getLogger(__name__)

_NOBODY = torch.iinfo(torch.int32).max
#: converted tensors whose owners are settled in one exchange of codes (their ids are held meanwhile)
_OWNER_WINDOW = 64
_OWNER_WINDOW_BYTES = 256 << 20
_EMBED = "model.embed_tokens.weight"
#: elements per step of the plan's run search (bounds its temporaries to ~20 MB)
_RUN_CHUNK = 1 << 22
#: mean run length from which digests go run by run (contiguous ranges) instead of element by element
_LONG_RUNS = 1 << 12
#: a parameter of at most this many runs maps a delta's changes run by run (a slice and an add per
#: run) instead of locating every changed element among its runs
_FEW_RUNS = 64


@dataclass
class _Runs:
    """Owned elements of one local parameter, as runs contiguous in both coordinates."""

    param: torch.Tensor  # the live parameter
    local: torch.Tensor  # int64 [R] first local flat offset of each run (increasing)
    length: torch.Tensor  # int64 [R]
    seq: torch.Tensor  # int64 [R] position of the checkpoint tensor in the export order
    target: torch.Tensor  # int64 [R] checkpoint flat index of the run's first element
    #: a parameter of few runs (at most ``_FEW_RUNS``: whole tensors, gate/up halves, q/k/v blocks):
    #: ``[(local, length, target, seq)]`` on the host, for digests run by run with no device read
    few: list[tuple[int, int, int, int]] | None = None


class MegatronShardDelta(BridgeExportSource):
    """A :class:`~delta_sync.sync.ShardedSource` over a Megatron model: the reference Bridge export for
    seeds, shard-local diffs for deltas. Use it where a :class:`BridgeExportSource` is used."""

    def __init__(self, bridge, model: list, group=None, one_pass: bool = True,
                 packed_max_elements: int | None = None):
        super().__init__(bridge, model)
        self.group = group
        #: learn the map in the seed's own export where every rank's parameters allow it (see
        #: :meth:`_plan_in_export`); else in a probe pass before it
        self.one_pass = one_pass
        #: a parameter of at most this many elements converts packed with its ids in a one-pass seed
        self.packed_max_elements = PACKED_MAX_ELEMENTS if packed_max_elements is None else packed_max_elements
        #: the last one-pass seed's tasks: (converted packed, converted then probed, laid out as an
        #: earlier task: converted alone)
        self.one_pass_split: tuple[int, int, int] | None = None
        #: this seed's values come out of the one-pass conversion: checked against every rank's
        #: shards as the map settles, and the seed refused at :meth:`seeded` if any disagrees
        self._one_pass_seed = False
        self._groups: TrainerGroups | None = None  # made at the first plan (a collective)
        self.differ = BitwiseDiff()
        self.total_elements = 0
        self._names: list[str] = []  # export order of the reference stream
        self._shapes: dict[str, tuple] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._plan_names: list[str] = []  # runs' ``seq`` indexes this list
        self._plan_index: dict[str, int] = {}  # name -> its index in _plan_names
        self._params_of: dict[int, list[int]] = {}  # plan index -> local params holding some of it
        self._runs: list[_Runs] | None = None  # None: not planned yet, or the plan failed
        self._tables: list[_RunTable] | None = None  # the runs as a delta maps changes with them
        self._planned = False
        self._problem: str | None = None  # why the fast path is off, on this rank
        self._aliases: dict[str, list[str]] = {}  # tensor -> exported copies (tied lm_head)
        self._ok = False
        self._seed_ok = self._warned = False
        #: the last seed's shard snapshots could not be taken: the next seed keeps WeightSync's plain
        #: snapshot too (it backs the deltas until shard snapshots are taken again)
        self._snap_failed = False
        self._plan_ok = False  # every rank planned without a problem (agreed at the plan)
        self._off = False  # a seed's map check failed on some rank (agreed): never expects to serve
        self._position: dict[str, int] = {}
        self._snap: dict[int, torch.Tensor] = {}
        #: a delta's advanced shard snapshots: run index -> (int32 flat indices, old bits there)
        self._undo: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---- reference stream (seed / full) -------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        stream = None
        if not self._planned:  # collective, before the export: every rank iterates at the same point
            layout = self._one_pass_layout() if self.one_pass else None
            if layout is not None:
                stream = self._plan_in_export(*layout)
            else:
                self._plan()
        names, bad = [], []
        for name, tensor in stream or super().__iter__():
            names.append(name)
            self._shapes[name], self._dtypes[name] = tuple(tensor.shape), tensor.dtype
            # (a one-pass seed's values are checked as its map settles)
            if self._runs is not None and not self._one_pass_seed and not self._matches(name, tensor):
                bad.append(name)
            yield name, tensor
        self._names = names
        self.total_elements = sum(int(torch.Size(s).numel()) for s in self._shapes.values())
        self._aliases = {}
        if self._runs is not None:
            for name in names:
                if name not in self._plan_index and name == "lm_head.weight" and _EMBED in self._plan_index:
                    self._aliases.setdefault(_EMBED, []).append(name)  # Bridge copies it for tied embeddings
            mapped = set(self._plan_names) | {a for al in self._aliases.values() for a in al}
            if mapped != set(names):
                self._problem = f"map and export disagree on names: {sorted(mapped ^ set(names))[:3]}"
            elif bad:
                self._problem = f"map disagrees with the exported values of {bad[:3]}"

    # ---- ShardedSource ----------------------------------------------------------------------------
    def ready(self) -> bool:
        return self._ok

    def seeded(self) -> None:
        ok = self._agree(self._runs is not None and self._problem is None)
        one_pass, self._one_pass_seed = self._one_pass_seed, False
        if one_pass and not ok:
            # the values just streamed came out of the packed conversion, or a task took an earlier
            # task's map, and they disagreed with some rank's shards: they may not be Bridge's export.
            # Refused on every rank alike (agreed); the next seed converts values alone and learns
            # the map in a probe pass.
            self.one_pass, self._planned, self._runs, self._seed_ok = False, False, None, False
            raise DeltaSyncError(
                "seed refused: the shard map learned in the seed's own export disagrees with the trainer's "
                f"shards ({self._problem or 'on another rank'}), so the values sent may not be Bridge's export "
                "(a conversion that computes rather than moves, or one that moves unlike the first task of "
                "its kind, whose map it took?); send a seed again: it exports the values alone and learns "
                "each task's map in a separate probe pass")
        if not ok and not self._warned:
            self._warned = True
            log.warning("delta-sync fast path off, deltas use the reference export: %s",
                        self._problem or "another rank could not map its shards")
        self._position = {n: i for i, n in enumerate(self._names)}
        self._tables = None  # (positions and runs as this seed left them)
        # the shard snapshots are taken at commit: they must hold what the engines hold, and then
        # the copy runs after the engines resumed (the parameters keep their values while update
        # runs), not inside the seed's pause window
        self._seed_ok = ok
        self._off = self._off or not ok  # the map disagreed somewhere: the reference path from now on

    def expects_to_serve(self) -> bool:
        # (a one-pass seed learns its map as it streams: it serves, or the seed is refused)
        return (self._plan_ok or self._one_pass_seed) and not self._off and not self._snap_failed

    def local_patches(self) -> list[Ordered]:
        # every shard snapshot advances in the diff's pass (one batch: a few host-kernel calls for all
        # of them); rollback puts the old bits back
        found = self.differ.absorb_many([(self._snap[k], runs.param.detach()) for k, runs in enumerate(self._runs)])
        self._undo = {k: (idx, old) for k, (idx, _, old) in enumerate(found) if idx.numel()}
        out: list[Ordered] = []
        for table in self._run_tables():
            got = _map_changes(table, [found[k][:2] for k in table.params])
            if got is not None:
                out += self._batches(*got)
        return sorted(out, key=lambda o: o.seq)

    def _run_tables(self) -> list["_RunTable"]:
        """This rank's runs as one table per element width and device (made at the first delta after
        each seed: the export positions come with the seed)."""
        if self._tables is None:
            pos_of = torch.tensor([self._position[n] for n in self._plan_names], dtype=torch.int64)
            groups: dict[tuple, list[int]] = {}
            for k, runs in enumerate(self._runs):
                groups.setdefault((runs.param.element_size(), runs.param.device), []).append(k)
            self._tables = [_run_table(self._runs, ks, pos_of) for ks in groups.values()]
        return self._tables

    def _batches(self, idx: torch.Tensor, bits: torch.Tensor, seqs: list[int], counts: list[int]) -> list[Ordered]:
        """Mapped changes (:func:`_map_changes`) as one :class:`PatchBatch` per dtype, its tensors in
        export order (the gather orders the ranks' batches by it); a tied copy (``lm_head``) as a
        patch of its own that shares its source's buffers."""
        names = [self._names[p] for p in seqs]
        dtypes = [self._dtypes[n] for n in names]
        out = []
        for dt in dict.fromkeys(dtypes):
            if len(dtypes) > 1 and any(d is not dt for d in dtypes):  # (several dtypes of one width: rare)
                ks = [k for k, d in enumerate(dtypes) if d is dt]
                keep = torch.repeat_interleave(torch.tensor([d is dt for d in dtypes], device=idx.device),
                                               torch.tensor(counts, device=idx.device), output_size=idx.numel())
                b = PatchBatch([names[k] for k in ks], [self._shapes[names[k]] for k in ks], dt,
                               [counts[k] for k in ks], idx[keep], bits[keep].view(dt), [seqs[k] for k in ks])
            else:
                b = PatchBatch(names, [self._shapes[n] for n in names], dt, counts, idx, bits.view(dt), seqs)
            out.append(Ordered(b.seqs[0], b))
        if self._aliases:
            at = dict(zip(names, itertools.accumulate(counts, initial=0)))
            for name, aliases in self._aliases.items():
                if name in at:
                    k = names.index(name)
                    i, v = idx.narrow(0, at[name], counts[k]), bits.narrow(0, at[name], counts[k]).view(dtypes[k])
                    out += [Ordered(self._position[a], Patch(a, self._shapes[a], dtypes[k], i, v)) for a in aliases]
        return out

    def commit(self) -> None:
        if self._seed_ok:  # a seed (or full update) just committed: new shard snapshots, taken now
            self._seed_ok, self._snap = False, {}  # the old ones go first: their memory serves the new
            problem = None
            try:
                snap = {k: r.param.detach().clone(memory_format=torch.contiguous_format)
                        for k, r in enumerate(self._runs)}
            except Exception as e:  # noqa: BLE001 - e.g. out of memory: every rank falls back alike
                snap, problem = {}, f"{type(e).__name__}: {e}"
            self._ok = self._agree(problem is None)  # collective: every rank commits
            self._snap = snap if self._ok else {}
            self._snap_failed = not self._ok
            if not self._ok:
                log.warning("delta-sync fast path off, deltas use the reference export: taking the shard "
                            "snapshots failed (%s)", problem or "on another rank")
        # a delta's shard snapshots advanced during its diff
        self._undo = {}

    def rollback(self) -> None:
        for k, (idx, old) in self._undo.items():
            restore(self._snap[k], idx, old)
        self._undo, self._seed_ok = {}, False

    def reset(self) -> None:
        self._undo, self._snap, self._ok, self._seed_ok = {}, {}, False, False

    def local_digests(self, names: set[str] | None = None) -> dict[str, Digest]:
        out: dict[str, Digest] = {}
        wanted = None
        if names is not None:  # only the runs of those tensors are expanded (the drift sweep's window)
            wanted = [s for s, n in enumerate(self._plan_names) if {n, *self._aliases.get(n, [])} & names]
        chosen = set(wanted) if wanted is not None else None
        ranges: list[tuple[int, torch.Tensor, int]] = []  # (plan index, snapshot range, its first target)

        def add(loc: int, tgt: int, ln: int, s: int) -> None:  # digested together below
            ranges.append((s, snap.narrow(0, loc, ln).view(self._dtypes[self._plan_names[s]]), tgt))

        for k, runs in enumerate(self._runs or []):
            snap = int_view(self._snap[k])
            if runs.few is not None:  # few runs: one contiguous digest each, chosen on the host
                for loc, ln, tgt, s in runs.few:
                    if chosen is None or s in chosen:
                        add(loc, tgt, ln, s)
                continue
            run_local, run_target, run_length, run_seq = runs.local, runs.target, runs.length, runs.seq
            if wanted is not None:
                keep = torch.isin(run_seq, torch.tensor(wanted, dtype=run_seq.dtype, device=run_seq.device))
                run_local, run_target, run_length, run_seq = (run_local[keep], run_target[keep],
                                                              run_length[keep], run_seq[keep])
            if _long(run_length):
                # long runs (whole rows or tensors): one contiguous digest per run, at memory speed
                for loc, tgt, ln, s in zip(run_local.tolist(), run_target.tolist(), run_length.tolist(),
                                           run_seq.tolist()):
                    add(loc, tgt, ln, s)
                continue
            local, target = _expand(run_local, run_length), _expand(run_target, run_length)
            seqs = torch.repeat_interleave(run_seq, run_length)
            for s in torch.unique(seqs).tolist():
                name = self._plan_names[s]
                sel = seqs == s
                d = digest_elements(target[sel], snap.take(local[sel]).view(self._dtypes[name]))
                for n in [name, *self._aliases.get(name, [])]:
                    out[n] = out.get(n, Digest()) + d
        # one pass for all ranges: host ones spread over the threads, device ones read back at once
        for (s, _, _), (d, _) in zip(ranges, scan_many([(values, tgt, None) for _, values, tgt in ranges])):
            name = self._plan_names[s]
            for n in [name, *self._aliases.get(name, [])]:
                out[n] = out.get(n, Digest()) + d
        return out

    # ---- the map ----------------------------------------------------------------------------------
    def _rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def _host_group(self):
        if self._groups is None:
            self._groups = TrainerGroups.around(self.group)
        return self._groups.host_group

    def _agree(self, ok: bool) -> bool:
        if not dist.is_initialized():
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        collectives.all_reduce(flag, self._host_group(), op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _plan(self) -> None:
        """Probe Bridge's conversions once (collective) and keep this rank's runs."""
        self._planned = True
        rank, world = self._rank(), self._world()
        planner = _Planner(self, rank)
        for i, task in enumerate(self.tasks()):
            k, shift = planner.param(task.param_weight, world)
            for j, (name, ids) in enumerate((self._convert_probe(task, rank, world) or {}).items()):
                planner.add(name, ids, k, shift, (i, j))
        planner.finish()

    def _one_pass_layout(self) -> tuple[torch.dtype, list[bool]] | None:
        """Where the seed's export can carry the map too: the one dtype of every rank's parameters
        (at most 4 bytes) and, per task, whether its parameter is small enough to convert packed with
        its ids (see :meth:`_plan_in_export`); None where not (several dtypes, a task list that differs
        between ranks, ids of a small parameter beyond int32). Collective: an all-gather and an
        all-reduce of one flag per task."""
        world, tasks = self._world(), self.tasks()
        code, fits = 0, 1
        large = torch.zeros(len(tasks), dtype=torch.int32)
        for i, task in enumerate(tasks):
            w = task.param_weight
            if w is None:
                continue
            code |= 1 << (_ONE_PASS_DTYPES.index(w.dtype) if w.dtype in _ONE_PASS_DTYPES else len(_ONE_PASS_DTYPES))
            if w.numel() > self.packed_max_elements:
                large[i] = 1
            else:
                fits &= _id_layout(w.numel(), world)[1] is torch.int32
        if dist.is_initialized():
            group = self._host_group()
            every = torch.empty(3 * dist.get_world_size(group), dtype=torch.int32)
            collectives.all_gather_into_tensor(every, torch.tensor([code, fits, len(tasks)], dtype=torch.int32), group)
            codes, fit, counts = every.view(-1, 3).t().tolist()
            if len(set(counts)) > 1:  # (the same answer on every rank: each saw every count)
                return None
            collectives.all_reduce(large, group, op=dist.ReduceOp.MAX)  # peers of a task hold one size
            code, fits = functools.reduce(operator.or_, codes), min(fit)
        if not fits or code not in [1 << i for i in range(len(_ONE_PASS_DTYPES))]:
            return None
        return _ONE_PASS_DTYPES[code.bit_length() - 1], [not x for x in large.tolist()]

    def _templates(self, tasks: list) -> list[int | None]:
        """Per task, the first earlier task its conversion lays out exactly as (None if none): on
        every rank the same mapping class, module class, name patterns (layer and expert numbers
        aside) and local parameter (shape, dtype, device; or none held). Such a task moves the same
        elements of its parameter to the same places of its outputs, so its map is the earlier one's
        and its values convert alone: a 30B-A3B's 48 x 128 experts are learned from one layer's
        first. Collective: one all-gather of an int32 per task. What makes the same key on every
        rank and still converts otherwise is caught where each tensor's values are checked against
        its owner's shard, which refuses the seed (the next one then probes every task)."""
        if not tasks:
            return []
        first: dict[tuple, int] = {}
        kinds = torch.tensor([first.setdefault(_layout_key(t), i) for i, t in enumerate(tasks)], dtype=torch.int32)
        if dist.is_initialized():
            group = self._host_group()
            every = torch.empty(dist.get_world_size(group) * len(tasks), dtype=torch.int32)
            collectives.all_gather_into_tensor(every, kinds, group)
            kinds = every.view(-1, len(tasks)).t()
        seen: dict[tuple, int] = {}
        return [None if (t := seen.setdefault(tuple(col), i)) == i else t
                for i, col in enumerate(kinds.reshape(len(tasks), -1).tolist())]

    def _plan_in_export(self, dtype: torch.dtype, packed: list[bool]) -> Iterator[tuple[str, torch.Tensor]]:
        """Bridge's export of the seed, learning the map in the same pass over its tasks. A task whose
        parameter is small (``packed``) goes in as one int64 per element, its probe id (``rank << shift
        | offset``) in the high 32 bits and its value's bits in the low ones, and each converted tensor
        comes out split into the values (yielded, as the export would) and the ids (the map): Bridge's
        per-task collectives, which bound a model of many small tensors, are paid once. A large one
        converts its values, then its probe right after (whose gathers move no bytes): packed, its
        gathers would move 8 bytes per element instead of 2, which bounds a model of large tensors. A
        task laid out as an earlier one (:meth:`_templates`) converts its values alone and takes that
        task's map, output by output.

        A conversion that computes instead of moving would garble a packed task's values and ids: as
        each window of tensors settles its owners, every rank compares the values it owns with its
        own shards, and :meth:`seeded` refuses the seed if any differs (collective, like the export):
        so does a task that converts unlike the earlier task whose map it took."""
        self._planned, self._one_pass_seed = True, True
        rank, world = self._rank(), self._world()
        templates = self._templates(self.tasks())
        shared = {t for t in templates if t is not None}
        first = [p for p, t in zip(packed, templates) if t is None]
        self.one_pass_split = (sum(first), len(first) - sum(first), len(packed) - len(first))
        planner = _Planner(self, rank, shared)
        bridge = self.bridge._model_bridge
        tasks = []
        for i, (task, pack, t) in enumerate(zip(self.tasks(), packed, templates)):
            k, shift = planner.param(task.param_weight, world)

            def probe(weight, module, mapping=task.mapping):
                return self._probe_conversion(mapping, weight, module, rank, world)

            tasks.append(dataclasses.replace(task, mapping=_OnePassMapping(
                task.mapping, rank, k, shift, i, probe if not pack and t is None else None, t)))
        #: hf name -> (ids or None where laid out as an earlier task, k, shift, (template task, position),
        #: its own task)
        split: dict[str, tuple[torch.Tensor | None, int | None, int, tuple[int, int], int]] = {}
        numels: dict[int, list[int | None]] = {}  # a task later tasks are laid out as -> its outputs' sizes
        real_modify = bridge.maybe_modify_converted_hf_weight
        own = vars(bridge).get("maybe_modify_converted_hf_weight")

        def modify(task, converted, hf_state):  # after Bridge's own modification: values and ids apart
            mapping = task.mapping
            k, shift, t = mapping.k, mapping.shift, mapping.template
            out = {}
            try:
                got = real_modify(task, converted, hf_state) or {}
                if t is not None:  # laid out as task t: its ids, position by position
                    sizes = numels.get(t)
                    if sizes is None or len(sizes) != len(got) or any(
                            n is not None and n != v.numel() for n, v in zip(sizes, got.values())):
                        planner.problem = planner.problem or (
                            f"{next(iter(got), task.global_param_name)} converted unlike the earlier task of its "
                            "mapping, names and shapes")
                        return got
                    split.update((name, (None, k, shift, (t, j), mapping.index))
                                 for j, (name, n) in enumerate(zip(got, sizes)) if n is not None)
                    return got
                if mapping.probe is not None:  # values as they are, the ids from the probe converted after them
                    probed = real_modify(task, mapping.ids or {}, {}) or {}
                    out, ids = got, [probed.get(name) for name in got]
                else:
                    out, ids = {}, []
                    for name, both in got.items():
                        out[name], got_ids = _unpack(both, dtype)
                        ids.append(got_ids)
                        if got_ids is None:
                            planner.problem = planner.problem or f"{name} converted to {both.dtype}, not int64"
                split.update((name, (x, k, shift, (mapping.index, j), mapping.index))
                             for j, (name, x) in enumerate(zip(out, ids)) if x is not None)
                if mapping.index in shared:
                    numels[mapping.index] = [None if x is None else x.numel() for x in ids]
            finally:  # mappings cache the (shape, dtype) they broadcast: forget the packed ones
                _clear_caches(mapping.real)
                mapping.ids = None
            return out

        bridge.maybe_modify_converted_hf_weight = modify
        try:  # (AutoBridge.export_hf_weights, on the one model bridge whose modification is wrapped)
            for name, values in bridge.stream_weights_megatron_to_hf(
                    self.model, self.bridge.hf_pretrained, cpu=True, show_progress=False, conversion_tasks=tasks):
                got = split.pop(name, None)
                if got is not None:
                    planner.add(name, got[0], got[1], got[2], got[3], values=values, task=got[4])
                yield name, values
        finally:
            if own is None:
                del bridge.maybe_modify_converted_hf_weight
            else:
                bridge.maybe_modify_converted_hf_weight = own
        planner.finish()

    def _probe_conversion(self, mapping, weight: torch.Tensor | None, module, rank: int, world: int) -> dict | None:
        """``mapping``'s conversion of a probe of ``weight``: each element holds its own id (``rank <<
        shift | offset``); None-valued where this rank holds no parameter of the task."""
        probe, shift = None, 0
        if weight is not None:
            shift, dtype = _id_layout(weight.numel(), world)
            probe = torch.arange(weight.numel(), dtype=dtype).add_(rank << shift).reshape(weight.shape).to(weight.device)
        try:
            with _peer_probes(rank, shift, self.group):
                return mapping.megatron_to_hf(probe, module)
        finally:  # mappings cache the (shape, dtype) they broadcast: forget the probe's
            _clear_caches(mapping)

    def _convert_probe(self, task, rank: int, world: int) -> dict | None:
        """Bridge's conversion of ``task`` applied to a probe of its local parameter, modified as the
        export modifies it."""
        converted = self._probe_conversion(task.mapping, task.param_weight, task.megatron_module, rank, world)
        return self.bridge._model_bridge.maybe_modify_converted_hf_weight(task, converted or {}, {})

    def _keep_plan(self, names: list[str], problem: str | None, params: list[torch.Tensor],
                   pieces: dict[int, list]) -> None:
        """Every rank agrees whether the plan holds (collective); this rank keeps its runs."""
        self._plan_names = names
        self._plan_index = {n: i for i, n in enumerate(names)}
        self._problem = problem
        self._plan_ok = self._agree(problem is None)  # collective: every rank plans at the same point
        self._runs = None if problem else [_build_runs(params[kk], plist) for kk, plist in sorted(pieces.items())]
        self._params_of = {}
        for k, runs in enumerate(self._runs or []):
            for s in torch.unique(runs.seq).tolist():
                self._params_of.setdefault(s, []).append(k)

    def _owned_many(self, converted: list[tuple[torch.Tensor, bool, int]], rank: int
                    ) -> list[torch.Tensor | tuple[int, ...] | None]:
        """Who may own which elements of each converted tensor (``ids``, whether this rank probed the
        task, its id shift): the ranks (of the host group, in order) that converted all of it from
        their own shard, as a tuple, when nobody converted only part of it; else a bool mask of the
        elements this rank owns, each element's owner being the lowest rank that converted it from
        its own shard (its id names that rank); None when some element has no owner at all.

        Usually ranks convert a tensor whole from their own shard (replicated weights, an expert of
        their own) or none of it: one code per rank and tensor settles that, all the tensors' codes in
        one exchange; only a tensor some rank holds partly (a TP all-gather) takes a per-element
        all-reduce."""
        owns = [_own_mask(ids, rank, shift) if probed else bool(ids.numel() == 0)
                for ids, probed, shift in converted]  # True / False: all or none, else a mask
        mine = [2 if own is True else 0 if own is False else (1 if bool(own.any()) else 0) for own in owns]
        if not dist.is_initialized():
            return [(0,) if code == 2 else None for code in mine]
        if not converted:
            return []
        group = self._host_group()
        world = dist.get_world_size(group)
        codes = torch.empty(world * len(mine), dtype=torch.int32)
        collectives.all_gather_into_tensor(codes, torch.tensor(mine, dtype=torch.int32), group)
        out: list[torch.Tensor | tuple[int, ...] | None] = []
        for (ids, _, _), own, col in zip(converted, owns, codes.view(world, -1).t().tolist()):  # every rank's code
            if 1 not in col:
                out.append(tuple(r for r, c in enumerate(col) if c == 2) or None)
                continue
            owner = torch.full(ids.shape, rank if own is True else _NOBODY, dtype=torch.int32)
            if own is not True and own is not False:
                owner[own] = rank
            collectives.all_reduce(owner, group, op=dist.ReduceOp.MIN)
            out.append(None if bool((owner == _NOBODY).any()) else owner == rank)
        return out

    def _matches(self, name: str, tensor: torch.Tensor) -> bool:
        """Seed check: every element this rank owns of ``name`` equals the exported one, bit for bit."""
        source = next((src for src, al in self._aliases.items() if name in al), name)
        s = self._plan_index.get(source)
        if s is None:
            return True  # reported as a name mismatch after the stream
        for k in self._params_of.get(s, []):
            runs = self._runs[k]
            sel = runs.seq == s
            if not _same_bits(runs.param, tensor, runs.local[sel], runs.length[sel], runs.target[sel]):
                return False
        return True


class _Planner:
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
        return len(self.params) - 1, _id_layout(weight.numel(), world)[0]

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
                runs = _owned_runs(ids, mine, base=self.rank << shift) if mine is not False and k is not None else None
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
            if values is not None and not _same_bits(self.params[k], values, local, length, target):
                self.problem = self.problem or f"map disagrees with the exported values of {name}"
        self.window, self.held = [], 0

    def finish(self) -> None:
        self.settle()
        self.source._keep_plan(self.names, self.problem, self.params, self.pieces)


class _OnePassMapping:
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
            return self.real.megatron_to_hf(None if weight is None else _pack(weight, self.rank, self.shift), module)
        values = self.real.megatron_to_hf(weight, module)
        if self.probe is not None:
            _clear_caches(self.real)
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
_ONE_PASS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


#: a layer's or an expert's number in a parameter name (``layers.3.``, ``local_experts.17.``, and
#: Transformer Engine's grouped experts ``linear_fc1.weight17``)
_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|(?<=\.weight)\d+$|(?<=\.bias)\d+$")


def _layout_key(task) -> tuple:
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


def _pack(weight: torch.Tensor, rank: int, shift: int) -> torch.Tensor:
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


def _unpack(packed: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(values of dtype, int32 ids)`` of a converted packed tensor (:func:`_pack`'s words read back);
    ``(something of its shape, None)`` where the conversion did not keep int64 (it computed: the seed is
    refused)."""
    if packed.dtype != torch.int64:
        return packed.to(dtype), None
    flat = packed.reshape(-1)
    width = torch.empty((), dtype=dtype).element_size()
    values = flat.view(int_view(torch.empty(0, dtype=dtype)).dtype).view(-1, 8 // width)[:, 0].contiguous()
    return values.view(dtype).view(packed.shape), flat.view(torch.int32).view(-1, 2)[:, 1].contiguous()


def _same_bits(param: torch.Tensor, exported: torch.Tensor, local: torch.Tensor, length: torch.Tensor,
               target: torch.Tensor) -> bool:
    """Runs ``(local, length, target)``: each run of ``param`` (flat) equals ``exported`` (flat) at its
    target, bit for bit."""
    mine, flat = int_view(param.detach()), int_view(exported.detach()).to(param.device)  # one device per comparison
    local, length, target = (x.to(param.device) for x in (local, length, target))
    if _long(length):  # whole rows or tensors: compare run by run, no index expansion
        return all(native.same_bytes(mine.narrow(0, lo, n), flat.narrow(0, t, n))
                   for lo, t, n in zip(local.tolist(), target.tolist(), length.tolist()))
    return native.same_bytes(mine.take(_expand(local, length)), flat.take(_expand(target, length)))


def _id_layout(numel: int, world: int) -> tuple[int, torch.dtype]:
    """``(shift, dtype)`` of the probe ids of a parameter of ``numel`` elements, ``rank << shift |
    offset``: int32 where the last rank's ids fit, else int64. Peers that convert one task together
    (TP shards, EP experts) hold parameters of one size, so they agree on both."""
    shift = max(1, (numel - 1).bit_length())
    return shift, (torch.int32 if world << shift <= 1 << 31 else torch.int64)


def _own_mask(ids: torch.Tensor, rank: int, shift: int) -> torch.Tensor | bool:
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
    """``torch.distributed.all_gather`` while shard-map probes convert (:func:`_peer_probes`).

    Installed while at least one thread is inside :func:`_peer_probes` and removed after the last
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


def _peer_probes(rank: int, shift: int, trainer_group):
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


def _clear_caches(mapping, seen=None) -> None:
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
            _clear_caches(value, seen)


def _owned_runs(ids: torch.Tensor, mine: torch.Tensor | bool, base: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(local start, length, target start)`` (int64) of the maximal runs of owned elements that
    are consecutive in both coordinates, from ``ids`` (each checkpoint element's flat offset in the
    local parameter plus ``base``, in checkpoint order). Vectorized passes over chunks of
    :data:`_RUN_CHUNK` elements, whose temporaries the allocator reuses (a whole tensor's would be
    fresh pages each time, faulted in on first touch); no sort of the elements."""
    n = ids.numel()
    firsts = []  # elements that start a run, owned or not (a foreign element is its own)
    for a in range(0, n, _RUN_CHUNK):
        b = min(n, a + _RUN_CHUNK)
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


def _build_runs(param: torch.Tensor, plist) -> _Runs:
    """The runs of one parameter's owned elements, in local order, on its device."""
    host = _host_runs(plist)
    return _place(param, *host, few=_few(*host))


def _host_runs(plist) -> tuple[torch.Tensor, ...]:
    """``(local, length, seq, target)`` of one parameter's runs in local order, on the host, from
    ``(run local starts, lengths, plan index, run target starts)`` per converted tensor."""
    local = torch.cat([p[0] for p in plist])
    length = torch.cat([p[1] for p in plist])
    seq = torch.cat([torch.full_like(p[0], p[2]) for p in plist])
    target = torch.cat([p[3] for p in plist])
    order = torch.argsort(local)  # one entry per run: a few per row
    return local[order], length[order], seq[order], target[order]


def _place(param: torch.Tensor, local, length, seq, target, few=None) -> _Runs:
    """The runs on the parameter's device, where the diffs they map are computed (``few``: see
    :attr:`_Runs.few`)."""
    dev = param.device
    return _Runs(param, local.to(dev), length.to(dev), seq.to(dev), target.to(dev), few)


def _few(local, length, seq, target) -> list[tuple[int, int, int, int]] | None:
    """:attr:`_Runs.few` of host runs in local order."""
    if 0 < local.numel() <= _FEW_RUNS:
        return list(zip(local.tolist(), length.tolist(), target.tolist(), seq.tolist()))
    return None


@dataclass
class _RunTable:
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


def _run_table(runs: list[_Runs], params: list[int], pos_of: torch.Tensor) -> _RunTable:
    """:class:`_RunTable` of ``runs[k]`` for ``k`` in ``params`` (one device), ``pos_of``: each plan
    index's export position."""
    dev = runs[params[0]].param.device
    base = list(itertools.accumulate((runs[k].param.numel() for k in params), initial=0))[:-1]
    start, length, target, seq = (torch.cat([getattr(runs[k], f) for k in params])
                                  for f in ("local", "length", "target", "seq"))
    sizes = [runs[k].local.numel() for k in params]
    param = torch.repeat_interleave(torch.arange(len(params), device=dev), torch.tensor(sizes, device=dev),
                                    output_size=sum(sizes))
    return _RunTable(params, torch.tensor(base, dtype=torch.int64, device=dev), param, start, start + length,
                     pos_of.to(dev).take(seq).bitwise_left_shift_(32).add_(target), target - start)


def _map_changes(table: _RunTable, found: list[tuple[torch.Tensor, torch.Tensor]]
                 ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]] | None:
    """The changes ``found[i]`` (int32 local flat offsets, increasing, and their bits) of the
    table's parameter ``i``, in checkpoint coordinates: ``(int32 flat indices, bits, export
    positions, counts)``, each tensor's changes together and increasing, tensors in export order;
    changes outside every run (elements another rank owns, padding) dropped; None where none is left.

    A run's changes are a slice of its parameter's (both increase): the runs' bounds are searched
    among them, the runs that hold some are put in checkpoint order (a sort of runs, not of
    elements, where a parameter's runs do not follow it: fused q/k/v), and each slice moves by its
    run's shift. On the host two kernel calls copy each change once; elsewhere a few torch
    operations over all of them. Four host reads in all, however many parameters and tensors."""
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
    live = n.nonzero().squeeze(1)
    if live.numel() == 0:
        return None
    key, lo, n = table.key.take(live), lo.take(live), n.take(live)
    if live.numel() > 1 and not bool((key[1:] > key[:-1]).all()):
        key, order = torch.sort(key)
        lo, n, live = lo.take(order), n.take(order), live.take(order)
    total = int(n.sum())
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
    seqs, inverse = torch.unique_consecutive(key.bitwise_right_shift(32), return_inverse=True)
    counts = torch.zeros(seqs.numel(), dtype=torch.int64, device=n.device).index_add_(0, inverse, n)
    seqs, counts = read_back([seqs, counts])
    return idx, bits, seqs, counts


def _run_slices(table: _RunTable, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`native.run_slices` in torch operations (a device's tensors), ``at``: every parameter's
    changed offsets laid end to end (:func:`_laid_end_to_end`); ``lo`` indexes ``at``."""
    base = table.base.take(table.param)
    lo = torch.searchsorted(at, table.start + base)
    return lo, torch.searchsorted(at, table.end + base) - lo


def _laid_end_to_end(table: _RunTable, offsets: list[torch.Tensor]) -> torch.Tensor:
    """Every parameter's offsets (int64) after :attr:`_RunTable.base`, in one increasing tensor."""
    sizes = [o.numel() for o in offsets]
    return torch.cat(offsets).to(torch.int64) + torch.repeat_interleave(
        table.base, torch.tensor(sizes, dtype=torch.int64, device=table.start.device), output_size=sum(sizes))


def _gather_runs(table: _RunTable, at: torch.Tensor, bits: torch.Tensor, live: torch.Tensor, lo: torch.Tensor,
                 n: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`native.gather_runs` in torch operations: the changes of runs ``live`` (in that order),
    ``lo`` and ``n`` each one's slice of ``at`` (and of ``bits``, every parameter's laid alike)."""
    elem = _expand(lo, n, total)
    base = table.base.take(table.param.take(live))
    idx = at.take(elem).add_(torch.repeat_interleave(table.shift.take(live) - base, n, output_size=total))
    return idx.to(torch.int32), bits.take(elem)


def _long(length: torch.Tensor) -> bool:
    """Runs long enough on average (whole rows or tensors) to be handled one by one as slices."""
    return bool(length.numel()) and int(length.sum()) >= _LONG_RUNS * length.numel()


def _expand(start: torch.Tensor, length: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Every index of the runs ``[start, start + length)``, in order (``total``: their lengths' sum,
    where the caller knows it: no wait for a device to tell)."""
    if start.numel() == 0:
        return start
    first = torch.repeat_interleave(start - torch.cumsum(length, 0) + length, length, output_size=total)
    return first + torch.arange(first.numel(), device=start.device)
