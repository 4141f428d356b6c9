"""vLLM general plugin (entry point ``vllm.general_plugins``): loaded in every vLLM process.

Registers delta-sync's weight-transfer engine under backend name ``delta_sync``, installs the
CPU checkpoint-layout mode, and adds two small worker methods for ``collective_rpc``:
``delta_sync_report`` (version, needs_seed, timings, digests) and ``delta_sync_discard``. They are
added to ``WorkerBase``, the base of every platform's worker (vLLM's GPU/CPU ``Worker`` and
vLLM-Ascend's ``NPUWorker`` alike), so they do not depend on which worker class a platform picks.

vLLM quirk corrected here: ``Worker.finish_weight_update`` leaves the update session marked
active when the engine's finish raises, so every later ``start_weight_update`` fails with
"already active". delta-sync's finish raises after restoring v-1, so the session must end.
"""

from __future__ import annotations

import functools
import json


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from . import BACKEND_NAME

    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, "patches.vllm_receiver",
                                                    "DeltaSyncWeightTransferEngine")
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from . import vllm_cpu_layout

        vllm_cpu_layout.install()
    _patch_worker()


def _patch_worker() -> None:
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    if getattr(WorkerBase, "_delta_sync_patched", False):
        return
    WorkerBase._delta_sync_patched = True
    original_finish = Worker.finish_weight_update

    @functools.wraps(original_finish)
    def finish_weight_update(self):
        try:
            return original_finish(self)
        except BaseException:
            self._weight_update_active = False
            engine = getattr(self, "weight_transfer_engine", None)
            if engine is not None:
                engine.reset_weight_update_target()
            raise

    def delta_sync_report(self, request: str = "{}") -> dict:
        """``collective_rpc("delta_sync_report", args=('{"digests": true}',))`` (JSON string args, so the
        HTTP ``/collective_rpc`` route can call it too)."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None or not hasattr(engine, "report"):
            return {"version": None, "needs_seed": True, "error": "delta_sync engine not configured"}
        opts = json.loads(request) if isinstance(request, str) else dict(request)
        return engine.report(digests=bool(opts.get("digests")), names=opts.get("names"))

    Worker.finish_weight_update = finish_weight_update
    WorkerBase.delta_sync_report = delta_sync_report
    WorkerBase.delta_sync_discard = _discard


def _discard(self, request: str = "{}") -> dict:
    """Drop whatever the engine staged (the sender gave up on this version on another engine)."""
    engine = getattr(self, "weight_transfer_engine", None)
    if engine is not None:
        engine._staged = None
    return {"discarded": True}
