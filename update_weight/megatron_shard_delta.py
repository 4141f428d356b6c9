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

This module is the source's lifecycle (seed, delta, commit, rollback, digests); the map is learned
in :mod:`update_weight.megatron_probes` and a delta's changes go through it in
:mod:`delta_sync.runs`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
from typing import Iterator

import torch
import torch.distributed as dist

from delta_sync import collectives
from delta_sync.collectives import TrainerGroups
from delta_sync.diff import BitwiseDiff, int_view, restore
from delta_sync.errors import DeltaSyncError
from delta_sync.digest import Digest, digest_elements, scan_many
from delta_sync.gather import Ordered
from delta_sync.patch import Patch
from delta_sync.runs import Runs, RunTable, build_runs, expand, long_runs, map_changes, patch_batches, run_table

from .megatron_probes import (NOBODY, ONE_PASS_DTYPES, PACKED_MAX_ELEMENTS, OnePassMapping, Planner, clear_caches,
                              id_layout, layout_key, own_mask, peer_probes, same_bits, unpack_probe)
from .megatron_source import BridgeExportSource

log = logging.getLogger(__name__)

_EMBED = "model.embed_tokens.weight"


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
        self._runs: list[Runs] | None = None  # None: not planned yet, or the plan failed
        self._tables: list[RunTable] | None = None  # the runs as a delta maps changes with them
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
            got = map_changes(table, [found[k][:2] for k in table.params])
            if got is not None:
                out += self._batches(*got)
        return sorted(out, key=lambda o: o.seq)

    def _run_tables(self) -> list["RunTable"]:
        """This rank's runs as one table per element width and device (made at the first delta after
        each seed: the export positions come with the seed)."""
        if self._tables is None:
            pos_of = torch.tensor([self._position[n] for n in self._plan_names], dtype=torch.int64)
            groups: dict[tuple, list[int]] = {}
            for k, runs in enumerate(self._runs):
                groups.setdefault((runs.param.element_size(), runs.param.device), []).append(k)
            self._tables = [run_table(self._runs, ks, pos_of) for ks in groups.values()]
        return self._tables

    def _batches(self, idx: torch.Tensor, bits: torch.Tensor, seqs: list[int], counts: list[int]) -> list[Ordered]:
        """Mapped changes (:func:`map_changes`) as one :class:`PatchBatch` per dtype, its tensors in
        export order (the gather orders the ranks' batches by it); a tied copy (``lm_head``) as a
        patch of its own that shares its source's buffers."""
        names = [self._names[p] for p in seqs]
        dtypes = [self._dtypes[n] for n in names]
        out = patch_batches(idx, bits, seqs, counts, names, [self._shapes[n] for n in names], dtypes)
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
            if long_runs(run_length):
                # long runs (whole rows or tensors): one contiguous digest per run, at memory speed
                for loc, tgt, ln, s in zip(run_local.tolist(), run_target.tolist(), run_length.tolist(),
                                           run_seq.tolist()):
                    add(loc, tgt, ln, s)
                continue
            local, target = expand(run_local, run_length), expand(run_target, run_length)
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
        return collectives.all_agree(ok, self._host_group() if dist.is_initialized() else None)

    def _world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _plan(self) -> None:
        """Probe Bridge's conversions once (collective) and keep this rank's runs."""
        self._planned = True
        rank, world = self._rank(), self._world()
        planner = Planner(self, rank)
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
            code |= 1 << (ONE_PASS_DTYPES.index(w.dtype) if w.dtype in ONE_PASS_DTYPES else len(ONE_PASS_DTYPES))
            if w.numel() > self.packed_max_elements:
                large[i] = 1
            else:
                fits &= id_layout(w.numel(), world)[1] is torch.int32
        if dist.is_initialized():
            group = self._host_group()
            every = torch.empty(3 * dist.get_world_size(group), dtype=torch.int32)
            collectives.all_gather_into_tensor(every, torch.tensor([code, fits, len(tasks)], dtype=torch.int32), group)
            codes, fit, counts = every.view(-1, 3).t().tolist()
            if len(set(counts)) > 1:  # (the same answer on every rank: each saw every count)
                return None
            collectives.all_reduce(large, group, op=dist.ReduceOp.MAX)  # peers of a task hold one size
            code, fits = functools.reduce(operator.or_, codes), min(fit)
        if not fits or code not in [1 << i for i in range(len(ONE_PASS_DTYPES))]:
            return None
        return ONE_PASS_DTYPES[code.bit_length() - 1], [not x for x in large.tolist()]

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
        kinds = torch.tensor([first.setdefault(layout_key(t), i) for i, t in enumerate(tasks)], dtype=torch.int32)
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
        planner = Planner(self, rank, shared)
        bridge = self.bridge._model_bridge
        tasks = []
        for i, (task, pack, t) in enumerate(zip(self.tasks(), packed, templates)):
            k, shift = planner.param(task.param_weight, world)

            def probe(weight, module, mapping=task.mapping):
                return self._probe_conversion(mapping, weight, module, rank, world)

            tasks.append(dataclasses.replace(task, mapping=OnePassMapping(
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
                        out[name], got_ids = unpack_probe(both, dtype)
                        ids.append(got_ids)
                        if got_ids is None:
                            planner.problem = planner.problem or f"{name} converted to {both.dtype}, not int64"
                split.update((name, (x, k, shift, (mapping.index, j), mapping.index))
                             for j, (name, x) in enumerate(zip(out, ids)) if x is not None)
                if mapping.index in shared:
                    numels[mapping.index] = [None if x is None else x.numel() for x in ids]
            finally:  # mappings cache the (shape, dtype) they broadcast: forget the packed ones
                clear_caches(mapping.real)
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
            shift, dtype = id_layout(weight.numel(), world)
            probe = torch.arange(weight.numel(), dtype=dtype).add_(rank << shift).reshape(weight.shape).to(weight.device)
        try:
            with peer_probes(rank, shift, self.group):
                return mapping.megatron_to_hf(probe, module)
        finally:  # mappings cache the (shape, dtype) they broadcast: forget the probe's
            clear_caches(mapping)

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
        self._runs = None if problem else [build_runs(params[kk], plist) for kk, plist in sorted(pieces.items())]
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
        owns = [own_mask(ids, rank, shift) if probed else bool(ids.numel() == 0)
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
            owner = torch.full(ids.shape, rank if own is True else NOBODY, dtype=torch.int32)
            if own is not True and own is not False:
                owner[own] = rank
            collectives.all_reduce(owner, group, op=dist.ReduceOp.MIN)
            out.append(None if bool((owner == NOBODY).any()) else owner == rank)
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
            if not same_bits(runs.param, tensor, runs.local[sel], runs.length[sel], runs.target[sel]):
                return False
        return True
