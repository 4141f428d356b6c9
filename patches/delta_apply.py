"""A staged delta applied on one worker at ``finish``, all or nothing.

Every position's old value is read into the undo log in the visit that writes the new one (one
gather and one scatter per loader-view segment, sparse patches batched per parameter); names
without a loader view go through vLLM's own loader, which may write anywhere, so every parameter's
old value is kept first. Any failure restores v-1 from the undo log before it is raised.
"""

from __future__ import annotations

import time

import torch

from delta_sync.errors import DeltaSyncError
from delta_sync.patch import Patch, apply_patch

from . import vllm_compat
from .bulk_apply import WorkerWeights
from .loader_views import UndoLog, apply_dense, apply_sparse_many


def apply_delta(r: WorkerWeights, patches: list[Patch], version: int) -> dict[str, float]:
    """Apply ``patches`` to ``r``'s model in place; on failure restore every written position and
    raise a :class:`DeltaSyncError` that says so. Returns the apply's timings."""
    t0 = time.perf_counter()
    undo = UndoLog()
    try:
        with torch.no_grad():
            params = dict(r.model.named_parameters())
            slow, sparse = [], []
            for p in patches:
                view = r.views.get(p.name)
                if view is None:
                    slow.append(p)
                elif p.dense:
                    apply_dense(view, params, p.values, undo)
                else:
                    sparse.append((p.name, p.indices, p.values))
            apply_sparse_many(r.views, params, sparse, undo)
            if slow:
                _through_loader(r, slow, params, undo)
    except Exception as e:
        undo.restore()
        r.last_error = f"apply of v{version} failed: {type(e).__name__}: {e}"
        raise DeltaSyncError(r.last_error, kept=r.kept() + " (undo log restored)") from e
    return {"apply_s": time.perf_counter() - t0, "undo_bytes": float(undo.nbytes)}


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
