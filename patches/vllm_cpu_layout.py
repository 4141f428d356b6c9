"""CPU checkpoint-layout mode: keep vLLM's CPU weights in checkpoint layout.

After loading, vLLM's CPU backend hands linear weights to oneDNN / sgl kernels (the parameter
becomes an empty ``(0,)`` tensor) and repacks MoE ``w13``/``w2`` into a blocked layout. Neither
can be patched in place. This mode is the CPU counterpart of Ascend's ND mode: linear layers run
plain ``F.linear`` on the unpacked weight and MoE experts run an unpacked grouped computation on
``w13 [E, 2I, H]`` / ``w2 [E, H, I]``.

It is active for an engine with delta-sync switched on (:func:`patches.enabled`), or when
``DELTA_SYNC_CPU_CHECKPOINT_LAYOUT=1`` (to load a reference engine in the same mode).

``DELTA_SYNC_CPU_MOE_TRANSPOSED_STANDIN=1`` adds a stand-in for vLLM-Ascend's MoE layout: after
loading, ``w13``/``w2`` are transposed into new storage (``[E, H, 2I]`` / ``[E, I, H]``), as
vLLM-Ascend's post-load step leaves them, and the experts run on that layout; the receiver then
addresses them as it does on an NPU (:func:`patches.vllm_ascend.checkpoint_layout`). Where the
MoE experts live differs by vLLM generation; :mod:`patches.vllm_compat` says which is present.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import enabled, vllm_compat
from .engine_options import EngineOptions

_installed = False


def active() -> bool:
    if EngineOptions.from_env().cpu_layout:
        return True
    try:
        from vllm.config import get_current_vllm_config

        cfg = get_current_vllm_config()
    except Exception:  # noqa: BLE001 - outside vLLM's config scope nothing is loading
        return False
    return enabled(cfg)


def transposed_standin() -> bool:
    return EngineOptions.from_env().cpu_moe_transposed


def transpose_experts(layer: torch.nn.Module) -> None:
    """``w13``/``w2`` of ``layer`` into transposed new storage, as vLLM-Ascend's post-load step
    leaves them (the stand-in; its loader attributes kept). Once: a layer transposed already stays."""
    if getattr(layer, "_delta_sync_transposed", False):
        return
    for name in ("w13_weight", "w2_weight"):
        p = layer._parameters[name]
        t = torch.nn.Parameter(p.data.transpose(1, 2).contiguous(), requires_grad=False)
        for attr, value in vars(p).items():
            setattr(t, attr, value)
        layer._parameters[name] = t
    layer._delta_sync_transposed = True


def _unpacked_moe(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map=None,
                  apply_router_weight_on_input=False, transposed=False):
    """Reference grouped MoE on checkpoint-layout weights: silu(x W_gate^T) * (x W_up^T) W_down^T
    (``transposed``: ``w1 [E, H, 2I]`` / ``w2 [E, I, H]``, the stand-in of vLLM-Ascend's layout)."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    inter = w1.shape[2 if transposed else 1] // 2
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
        gu = x @ w1[local] if transposed else F.linear(x, w1[local])
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = (h @ w2[local] if transposed else F.linear(h, w2[local])).to(torch.float32)
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

    experts = vllm_compat.cpu_moe_experts()
    if experts is None:
        return
    kind, cls = experts
    if kind == "modular":
        _install_modular_experts(cls)
    else:
        _install_fused_experts(cls, layer_utils)


def _check_silu(activation) -> None:
    if str(getattr(activation, "value", activation)).lower() != "silu":
        raise NotImplementedError(f"checkpoint-layout MoE supports silu only, got {activation}")


def _install_modular_experts(cls) -> None:
    """vLLM >= 0.25: ``CPUUnquantizedExperts`` repacks in ``process_weights_after_loading``."""
    original_process = cls.process_weights_after_loading
    original_apply = cls.apply

    def process_weights_after_loading(self, layer):
        if not active():
            return original_process(self, layer)
        self._use_zentorch = False
        self._delta_sync_unpacked = True
        self._delta_sync_transposed = transposed_standin()
        if self._delta_sync_transposed:
            transpose_experts(layer)

    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
              expert_map, *args, **kwargs):
        if not getattr(self, "_delta_sync_unpacked", False):
            return original_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                                  global_num_experts, expert_map, *args, **kwargs)
        _check_silu(activation)
        apply_on_input = kwargs.get("apply_router_weight_on_input", args[-1] if args else False)
        _unpacked_moe(output, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, apply_on_input,
                      transposed=getattr(self, "_delta_sync_transposed", False))

    cls.process_weights_after_loading = process_weights_after_loading
    cls.apply = apply


def _install_fused_experts(cls, layer_utils) -> None:
    """vLLM 0.23: ``CPUFusedMOE``'s constructor prepacks the experts or splits them into oneDNN
    handles, and the AMX path (``check_cpu_sgl_kernel``) repacks ``w13``/``w2`` in place before it."""
    original_init = cls.__init__
    original_sgl = layer_utils.check_cpu_sgl_kernel

    def __init__(self, layer):
        if not active():
            return original_init(self, layer)
        self.isa = "none"
        self._delta_sync_unpacked = True
        self.forward_method = _unpacked_forward
        if transposed_standin():
            transpose_experts(layer)

    def check_cpu_sgl_kernel(*args, **kwargs):
        return False if active() else original_sgl(*args, **kwargs)

    cls.__init__ = __init__
    layer_utils.check_cpu_sgl_kernel = check_cpu_sgl_kernel


def _unpacked_forward(layer, x, topk_weights, topk_ids, activation, global_num_experts=-1,
                      apply_router_weight_on_input=False):
    _check_silu(activation)
    if apply_router_weight_on_input:  # as vLLM 0.23's own forward does (top-1 routing)
        x = x * topk_weights.to(x.dtype)
    out = torch.empty_like(x)
    _unpacked_moe(out, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                  getattr(layer, "expert_map", None), apply_router_weight_on_input,
                  transposed=getattr(layer, "_delta_sync_transposed", False))
    return out
