"""A staged delta applied on one worker at ``finish``, all or nothing.

The writes are planned when the delta arrives, while the engine still serves (:func:`plan_delta`:
routes, the host kernel's row table, every position checked), so the pause holds the writes alone.
Every position's old value is read into the undo log in the visit that writes the new one (one
gather and one scatter per loader-view segment, sparse patches batched per parameter); names
without a loader view go through vLLM's own loader, which may write anywhere, so every parameter's
old value is kept first. Any failure restores v-1 from the undo log before it is raised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from delta_sync.errors import DeltaSyncError
from delta_sync.patch import Patch, apply_patch

from . import vllm_compat
from .bulk_apply import WorkerWeights
from .loader_views import LoaderView, SparsePlan, UndoLog, apply_dense, plan_sparse, plan_tables, routes_for


@dataclass
class DeltaPlan:
    """A staged delta's writes, worked out on receipt while the engine still serves
    (:func:`plan_delta`): what :func:`apply_delta` has left to do inside the pause is the writes."""

    version: int
    sparse: SparsePlan
    dense: list[tuple[LoaderView, torch.Tensor]]
    slow: list[Patch]  # names without a loader view: through vLLM's loader
    #: the parameters' storages and layout the plan's addresses belong to
    layout: dict[str, tuple]
    #: the delta's tables (:mod:`delta_sync.catalog`) and their routed entries' plan
    tables: list = None
    routed: SparsePlan | None = None
    plan_s: float = 0.0
    undo: UndoLog | None = None  # the apply's, kept with the plan (freed with it, after the pause)


def plan_delta(r: WorkerWeights, patches: list[Patch], version: int, tables: list | None = None,
               at_start: tuple[dict, dict] | None = None) -> DeltaPlan:
    """Route ``patches`` and the entries of ``tables`` to ``r``'s parameters and check every
    position (nothing is written). ``at_start``: the parameters and their :func:`layout_of` as the
    update's ``start`` read them (~1.5 ms at a 30B-A3B's parameters, saved here, where the trainer
    waits for the plan): the plan holds for that layout, which the apply checks again."""
    t0 = time.perf_counter()
    params, layout = at_start if at_start is not None else (r.param_table.params_of(r.model), None)
    try:
        with torch.no_grad():
            routed, general = _plan_tables(r, tables or [], params, cache=True)
            slow, dense, sparse = [], [], []
            for p in patches + [p for _, p in general]:
                view = r.views.get(p.name)
                if view is None:
                    slow.append(p)
                elif p.dense:
                    dense.append((view, p.values))
                else:
                    sparse.append((p.name, p.indices, p.values))
            sparse_plan = plan_sparse(r.views, params, sparse)
    except Exception as e:
        raise DeltaSyncError(f"delta v{version} does not fit this engine's parameters: {type(e).__name__}: {e}",
                             kept=r.kept() + " (nothing was written)") from e
    plan = DeltaPlan(version, sparse_plan, dense, slow, layout if layout is not None else layout_of(params),
                     tables or [], routed)
    plan.plan_s = time.perf_counter() - t0
    return plan


def _plan_tables(r: WorkerWeights, tables: list, params: dict[str, torch.Tensor], cache: bool):
    """:func:`plan_tables` under ``r``'s routes for the tables' catalogue (kept while the catalogue,
    the parameters and the views stay; ``cache=False``: made for ``params`` and not kept)."""
    if not tables:
        return None, []
    return plan_tables(routes_for(r, tables[0].catalog, params, cache), tables)


def layout_of(params: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """Every parameter's storage address, strides, shape and dtype: what a plan's addresses hold for.
    (vLLM's parameters are a tensor subclass whose ``__torch_function__`` runs in Python for each of
    these reads: ~4 us a read, ~10 ms over a MoE's parameters; read here as plain tensors.)"""
    with torch._C.DisableTorchFunctionSubclass():
        return {n: (p.data_ptr(), tuple(p.stride()), tuple(p.shape), p.dtype) for n, p in params.items()}


class ParamTable:
    """A model's named parameters, read back through the modules that own them: a few dict reads
    per parameter, not a walk of the module tree (a 30B-A3B model has thousands of modules), so the
    pause can check that a plan's parameters are still the model's. Made again wherever vLLM's
    loader may have replaced parameters."""

    def __init__(self, model: torch.nn.Module):
        self._where = []
        #: every (parent, key, child) link of the module tree on the way to a parameter's owner
        self._links: dict[tuple[int, str], tuple[torch.nn.Module, str, torch.nn.Module]] = {}
        for name, _ in model.named_parameters():
            owner, _, key = name.rpartition(".")
            module = model
            for part in owner.split(".") if owner else []:
                child = module._modules[part]
                self._links[(id(module), part)] = (module, part, child)
                module = child
            self._where.append((name, module, key))

    def params(self) -> dict[str, torch.Tensor]:
        return {name: module._parameters[key] for name, module, key in self._where}

    def params_of(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s parameters by name: :meth:`params` where every module on the way to each
        owner is still the one it was (a dict read per link), else the model walked anew (a module
        replaced, a parameter gone or set to None)."""
        try:
            if all(parent._modules.get(key) is child for parent, key, child in self._links.values()):
                out = self.params()
                # (by identity: ``None in`` compares each parameter with ``==``, which vLLM's
                # parameter subclass runs through Python: ~0.3 ms per 100 parameters)
                if not any(p is None for p in out.values()):
                    return out
        except (KeyError, AttributeError):
            pass
        return dict(model.named_parameters())


def apply_delta(r: WorkerWeights, plan: DeltaPlan) -> dict[str, float]:
    """Apply ``plan`` to ``r``'s model in place; on failure restore every written position and
    raise a :class:`DeltaSyncError` that says so. A plan whose parameters moved since it was made
    (a wake from sleep, say) is made again first. Returns the apply's timings."""
    t0 = time.perf_counter()
    undo = plan.undo = UndoLog()
    params = r.param_table.params_of(r.model)  # (a module replaced since the plan: walked anew)
    replanned = layout_of(params) != plan.layout
    try:
        with torch.no_grad():
            sparse, routed = plan.sparse, plan.routed
            if replanned:
                routed, _ = _plan_tables(r, plan.tables, params, cache=False)  # the same entries take the general path
                sparse = plan_sparse(r.views, params, plan.sparse.patches)
            for view, values in plan.dense:
                apply_dense(view, params, values, undo)
            sparse.run(undo)
            if routed is not None:
                routed.run(undo)
            if plan.slow:
                _through_loader(r, plan.slow, params, undo)
    except Exception as e:
        undo.restore()
        r.last_error = f"apply of v{plan.version} failed: {type(e).__name__}: {e}"
        raise DeltaSyncError(r.last_error, kept=r.kept() + " (undo log restored)") from e
    return {"apply_s": time.perf_counter() - t0, "plan_s": plan.plan_s, "replanned": float(replanned),
            "undo_bytes": float(undo.nbytes), "undo_device_bytes": float(undo.device_nbytes)}


def _through_loader(r: WorkerWeights, patches: list[Patch], params, undo: UndoLog) -> None:
    """Patches of names without a loader view, through vLLM's loader (which may write anywhere:
    every parameter's old value goes into the undo log first). The kept whole value of each name
    is patched too; where this vLLM has no patch loader (0.23), that value is what the loader is
    given."""
    for t in params.values():
        if t.numel():
            undo.record_view(t.data)
    loader = vllm_compat.checkpoint_patch_loader()
    held = {}
    for p in patches:
        value = r.fallback_values.get(p.name)
        if value is None and loader is None:
            raise DeltaSyncError(f"{p.name}: this vLLM has no patch loader and no whole value of the tensor "
                                 "was kept (it was not seeded through vLLM's loader on this worker)",
                                 kept=r.kept())
        if value is not None:
            undo.record_view(value)
            apply_patch(value, p)
            held[p.name] = value
    with r.loader_layout():
        if loader is None:
            r.model.load_weights([(p.name, held[p.name].reshape(p.shape)) for p in patches])
            return
        patch_cls, load = loader
        for dense in (True, False):  # vLLM refuses dense and sparse patches in one call
            group = [patch_cls(p.name, p.shape, p.dtype, p.values, p.indices) for p in patches
                     if p.dense == dense]
            if group:
                load(r.model, group)
