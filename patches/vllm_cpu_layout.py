"""CPU checkpoint-layout mode: keep vLLM's CPU weights in checkpoint layout.

After loading, vLLM's CPU backend hands linear weights to oneDNN / sgl kernels (the parameter
becomes an empty ``(0,)`` tensor) and repacks MoE ``w13``/``w2`` into a blocked layout. Neither
can be patched in place. This mode is the CPU counterpart of Ascend's ND mode: linear layers run
plain ``F.linear`` on the unpacked weight and MoE experts run an unpacked grouped computation on
``w13 [E, 2I, H]`` / ``w2 [E, H, I]``.

It is active for an engine whose ``weight_transfer_config.backend`` is delta-sync's, or when
``DELTA_SYNC_CPU_CHECKPOINT_LAYOUT=1`` (to load a reference engine in the same mode).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from . import BACKEND_NAME
_installed = False


def active() -> bool:
    if os.environ.get("DELTA_SYNC_CPU_CHECKPOINT_LAYOUT") == "1":
        return True
    try:
        from vllm.config import get_current_vllm_config

        wt = get_current_vllm_config().weight_transfer_config
    except Exception:
        return False
    return wt is not None and getattr(wt, "backend", None) == BACKEND_NAME


def _unpacked_moe(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map=None,
                  apply_router_weight_on_input=False):
    """Reference grouped MoE on checkpoint-layout weights: silu(x W_gate^T) * (x W_up^T) W_down^T."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    inter = w1.shape[1] // 2
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1).to(torch.float32)
    token_of = torch.arange(topk_ids.shape[0], device=topk_ids.device).repeat_interleave(topk_ids.shape[1])
    for e in torch.unique(flat_ids).tolist():
        local = e if expert_map is None else int(expert_map[e])
        if local < 0:
            continue
        sel = (flat_ids == e).nonzero().squeeze(1)
        tok = token_of.index_select(0, sel)
        x = hidden_states.index_select(0, tok)
        gu = F.linear(x, w1[local])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = F.linear(h, w2[local]).to(torch.float32)
        if not apply_router_weight_on_input:
            y = y * flat_w.index_select(0, sel).unsqueeze(1)
        out.index_add_(0, tok, y)
    output.copy_(out.to(output.dtype))


def install() -> None:
    """Wrap the CPU dispatch points once per process; a no-op where vLLM lacks them."""
    global _installed
    if _installed:
        return
    _installed = True
    from vllm.model_executor.layers import utils as layer_utils

    original_dispatch = layer_utils.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight: bool) -> None:
        if not active():
            return original_dispatch(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)

    layer_utils.dispatch_cpu_unquantized_gemm = dispatch

    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:
        return
    cls = cpu_moe.CPUUnquantizedExperts
    original_process = cls.process_weights_after_loading
    original_apply = cls.apply

    def process_weights_after_loading(self, layer):
        if not active():
            return original_process(self, layer)
        self._use_zentorch = False
        self._delta_sync_unpacked = True

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if not getattr(self, "_delta_sync_unpacked", False):
            return original_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                  global_num_experts, expert_map, *args, **kwargs)
        if str(getattr(activation, "value", activation)).lower() != "silu":
            raise NotImplementedError(f"checkpoint-layout MoE supports silu only, got {activation}")
        apply_on_input = kwargs.get("apply_router_weight_on_input", args[-1] if args else False)
        _unpacked_moe(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, apply_on_input)

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply
