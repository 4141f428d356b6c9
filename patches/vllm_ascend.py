"""vLLM-Ascend adaptation: the layouts an NPU engine gives its weights after loading.

* MoE ``w13``/``w2`` are transposed after loading (``[E, 2I/tp, H] -> [E, H, 2I/tp]``, new
  contiguous storage). vLLM's loader still addresses them in checkpoint layout, so views are
  recorded against the *transposed view of the same storage* (:func:`checkpoint_layout`): the
  recorded offsets and strides then land on the runtime storage directly.
* FRACTAL_NZ weights (``weight_nz_mode`` != 0) are tiled: no affine map exists; refused.

Nothing here imports torch_npu at module level; the format query is injectable so stand-in
modules reproduce the Ascend layouts on CPU (tests/test_ascend_standins.py).
"""

from __future__ import annotations

import contextlib

import torch

from delta_sync.errors import LayoutNotSupported

ACL_FORMAT_FRACTAL_NZ = 29
#: parameters vLLM-Ascend keeps transposed after loading: name suffix -> the two dims swapped
TRANSPOSED_AFTER_LOAD = {"w13_weight": (1, 2), "w2_weight": (1, 2)}


def npu_format(t: torch.Tensor) -> int | None:
    try:
        import torch_npu  # type: ignore
    except ImportError:
        return None
    return int(torch_npu.get_npu_format(t))


def check_ascend_layout(vllm_config, model: torch.nn.Module, format_of=npu_format) -> None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    mode = extra.get("weight_nz_mode", 0) if isinstance(extra, dict) else 0
    if mode not in (0, None):
        raise LayoutNotSupported(f"weight_nz_mode={mode}: FRACTAL_NZ weights cannot be patched in place; start "
                                 "vLLM-Ascend with additional_config weight_nz_mode=0 (rl_config.enabled forces it)")
    for name, p in model.named_parameters():
        if p.numel() and format_of(p.data) == ACL_FORMAT_FRACTAL_NZ:
            raise LayoutNotSupported(f"{name} is stored as FRACTAL_NZ; set weight_nz_mode=0 so weights stay ND")


def moe_dims(module: torch.nn.Module) -> tuple[int | None, int | None]:
    """A MoE layer's hidden size and expert width per partition: its own attributes (vLLM-Ascend's
    layer sets them) or its ``moe_config`` (vLLM's FusedMoE keeps them there)."""
    cfg = getattr(module, "moe_config", None)
    hidden = getattr(module, "hidden_size", None) or getattr(cfg, "hidden_dim", None)
    inter = getattr(module, "intermediate_size_per_partition", None) or \
        getattr(cfg, "intermediate_size_per_partition", None)
    return hidden, inter


def _is_transposed(module: torch.nn.Module, suffix: str, p: torch.Tensor) -> bool:
    """True when a MoE weight is in the post-load transposed layout (hidden size in dim 1): as the
    layer says where it says (the CPU stand-in marks its layers), else by shape."""
    marked = getattr(module, "_delta_sync_transposed", None)
    if marked is not None:
        return bool(marked) and p.dim() == 3
    hidden, inter = moe_dims(module)
    if hidden is None or inter is None or p.dim() != 3:
        return False
    rows = 2 * inter if suffix == "w13_weight" else hidden  # the checkpoint layout's dim 1
    cols = hidden if suffix == "w13_weight" else inter
    if rows == cols and tuple(p.shape[1:]) == (rows, cols):  # square experts read the same either way
        raise LayoutNotSupported(
            f"{type(module).__name__}.{suffix} {tuple(p.shape)}: its experts are square (hidden size {hidden}, "
            f"expert width {inter}), so their shape does not say whether vLLM-Ascend transposed them after "
            "loading; delta-sync cannot place writes into them")
    return tuple(p.shape[1:]) == (cols, rows)


def loader_layout(model: torch.nn.Module, transposed: bool):
    """Where vLLM's loader writes ``model``: through :func:`checkpoint_layout` where its MoE weights
    were transposed after loading (vLLM-Ascend, or the CPU stand-in), else the parameters as they are."""
    return checkpoint_layout(model) if transposed else contextlib.nullcontext()


@contextlib.contextmanager
def checkpoint_layout(model: torch.nn.Module):
    """Within the block, transposed MoE weights are seen by the loader in checkpoint layout
    (a transposed *view* of the same storage); outside, the runtime parameters are untouched."""
    swapped = []
    try:
        for mname, module in model.named_modules():
            for suffix, (a, b) in TRANSPOSED_AFTER_LOAD.items():
                p = module._parameters.get(suffix)
                if p is None or not _is_transposed(module, suffix, p):
                    continue
                view = torch.nn.Parameter(p.data.transpose(a, b), requires_grad=False)
                for attr in ("weight_loader",):
                    if hasattr(p, attr):
                        setattr(view, attr, getattr(p, attr))
                module._parameters[suffix] = view
                swapped.append((module, suffix, p))
        yield [f"{type(m).__name__}.{s}" for m, s, _ in swapped]
    finally:
        for module, suffix, p in swapped:
            module._parameters[suffix] = p
