"""Adaptations of third-party code (vLLM, vLLM-Ascend, Megatron-Bridge); nothing else patches them."""

from __future__ import annotations

import os

#: the name delta-sync goes by in vLLM's ``additional_config`` (and formerly as a weight-transfer backend)
BACKEND_NAME = "delta_sync"
#: environment variable that turns delta-sync on for every vLLM engine started with it (``1``)
ENABLE_ENV = "DELTA_SYNC_ENGINE"


def enabled(vllm_config) -> bool:
    """Is delta-sync switched on for this engine? The opt-in reads the same on every vLLM release
    the plugin supports: ``additional_config={"delta_sync": true}`` (``--additional-config``), or
    ``DELTA_SYNC_ENGINE=1`` in the engine's environment."""
    if os.environ.get(ENABLE_ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    extra = getattr(vllm_config, "additional_config", None)
    return isinstance(extra, dict) and bool(extra.get(BACKEND_NAME))
