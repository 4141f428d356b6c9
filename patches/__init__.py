"""Adaptations of third-party code (vLLM, vLLM-Ascend, Megatron-Bridge); nothing else patches them."""

from __future__ import annotations

from .engine_options import ENABLE_ENV, EngineOptions

#: the name delta-sync goes by in vLLM's ``additional_config`` (and formerly as a weight-transfer backend)
BACKEND_NAME = "delta_sync"
__all__ = ["BACKEND_NAME", "ENABLE_ENV", "enabled"]


def enabled(vllm_config) -> bool:
    """Is delta-sync switched on for this engine? The opt-in reads the same on every vLLM release
    the plugin supports: ``additional_config={"delta_sync": true}`` (``--additional-config``), or
    ``DELTA_SYNC_ENGINE=1`` in the engine's environment."""
    if EngineOptions.from_env().enable:
        return True
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and bool(extra.get(BACKEND_NAME))
