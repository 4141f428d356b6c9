"""Every setting of a delta-sync engine, read from its environment in one place and checked there.

An engine is configured where vLLM is: ``--additional-config '{"delta_sync": true}'`` turns it on
(:func:`patches.enabled`), and these variables of the engine's environment tune it. The plugin
reads them when vLLM loads it, so a bad value stops the engine at start with the variable named,
not at the trainer's first call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from delta_sync.options import env_seconds

#: environment variable that turns delta-sync on for every vLLM engine started with it (``1``)
ENABLE_ENV = "DELTA_SYNC_ENGINE"
#: seconds of silence after which a trainer's claim on the engine lapses (0: no claims)
CLAIM_ENV = "DELTA_SYNC_CLAIM_S"
#: seconds a paused engine waits for the trainer's next call before it resumes by itself (0: never)
LEASE_ENV = "DELTA_SYNC_PAUSE_LEASE_S"
#: comma-separated further worker methods an operator allows through ``/collective_rpc``
RPC_ALLOW_ENV = "DELTA_SYNC_RPC_ALLOW"
#: seconds vLLM's shared-memory queue readers keep spinning after a read (vLLM: 1 s)
SPIN_ENV = "DELTA_SYNC_VLLM_SPIN_S"
#: ``1``: the CPU engine keeps its weights in checkpoint layout even outside a delta-sync config
CPU_LAYOUT_ENV = "DELTA_SYNC_CPU_CHECKPOINT_LAYOUT"
#: ``1``: a stand-in for vLLM-Ascend's MoE layout on a CPU engine (tests, benchmarks): in
#: checkpoint-layout mode, ``w13``/``w2`` are transposed into new storage after loading, as
#: vLLM-Ascend's post-load step leaves them, and the experts run on that layout
CPU_MOE_TRANSPOSED_ENV = "DELTA_SYNC_CPU_MOE_TRANSPOSED_STANDIN"
#: where a device engine keeps a received delta until finish: ``host`` (pinned host memory, the
#: default: the device holds two buckets while receiving, one bucket's writes at a time in the
#: pause) or ``device`` (all of it on the device: no copies, memory grows with the delta)
STAGE_ENV = "DELTA_SYNC_DELTA_STAGING"
STAGES = ("host", "device")

DEFAULT_CLAIM_S = 60.0
DEFAULT_LEASE_S = 60.0
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class EngineOptions:
    """The engine's delta-sync settings (each field's variable is named above)."""

    enable: bool = False  # DELTA_SYNC_ENGINE
    claim_s: float = DEFAULT_CLAIM_S  # DELTA_SYNC_CLAIM_S
    lease_s: float = DEFAULT_LEASE_S  # DELTA_SYNC_PAUSE_LEASE_S
    rpc_allow: frozenset[str] = frozenset()  # DELTA_SYNC_RPC_ALLOW
    spin_s: float | None = None  # DELTA_SYNC_VLLM_SPIN_S (None: vLLM's own)
    cpu_layout: bool = False  # DELTA_SYNC_CPU_CHECKPOINT_LAYOUT
    stage: str = "host"  # DELTA_SYNC_DELTA_STAGING
    cpu_moe_transposed: bool = False  # DELTA_SYNC_CPU_MOE_TRANSPOSED_STANDIN

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "EngineOptions":
        """The settings in ``env`` (default: this process's environment); a bad value raises a
        ValueError naming its variable."""
        env = os.environ if env is None else env
        allow = frozenset(m.strip() for m in env.get(RPC_ALLOW_ENV, "").split(",") if m.strip())
        bad = [m for m in allow if not m.isidentifier()]
        if bad:
            raise ValueError(f"{RPC_ALLOW_ENV} names {bad[0]!r}, which is no worker method name "
                             "(a comma-separated list of method names)")
        stage = env.get(STAGE_ENV, "").strip().lower() or "host"
        if stage not in STAGES:
            raise ValueError(f"{STAGE_ENV}={env.get(STAGE_ENV)!r}: where a delta is staged is one of {', '.join(STAGES)}")
        return cls(enable=env.get(ENABLE_ENV, "").strip().lower() in _TRUE,
                   claim_s=env_seconds(env, CLAIM_ENV, DEFAULT_CLAIM_S),
                   lease_s=env_seconds(env, LEASE_ENV, DEFAULT_LEASE_S),
                   rpc_allow=allow,
                   spin_s=env_seconds(env, SPIN_ENV, None),
                   cpu_layout=env.get(CPU_LAYOUT_ENV, "").strip() == "1",
                   stage=stage,
                   cpu_moe_transposed=env.get(CPU_MOE_TRANSPOSED_ENV, "").strip() == "1")
