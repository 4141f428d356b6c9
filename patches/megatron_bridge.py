"""Megatron-Bridge 0.3.0 + megatron-core 0.16.1 on this stack (transformers 5, no Transformer
Engine, CPU). One explicit call, :func:`install`, applies every adaptation; each names the upstream
behaviour it corrects. Nothing in ``delta_sync`` or ``update_weight`` knows about them.

1. ``import megatron.bridge`` reaches modules that hard-import ``transformer_engine.pytorch``
   (peft LoRA layers) and ``triton`` (inference kernels). They are imported once with stand-in
   modules present, the stand-ins are removed again, and every ``HAVE_TE`` / ``HAVE_TRITON`` flag
   those imports set is reset: TE stays absent everywhere else (a permanent fake package would flip
   Megatron's TE code paths on). Megatron-core modules that probe TE are imported *before* the
   window, so their flags are computed honestly.
2. transformers 5 moved ``rope_theta`` into ``config.rope_parameters``; Bridge reads
   ``hf_config.rope_theta`` (:func:`hf_config_compat`).
3. CPU: megatron-core places tensors with ``torch.cuda.current_device()`` and references an
   undefined ``te_general_gemm`` in the MoE router (:func:`install_cpu`).
4. SequentialMLP expert names crash Bridge's export (:func:`fix_sequential_expert_export`).
5. Row-parallel weights load wrong at TP>1 over gloo: non-contiguous scatter chunks (:func:`fix_tp_scatter`).
6. SequentialMLP experts keep local numbers at EP>1: every EP rank loads the same experts
   (:func:`fix_sequential_expert_numbering`).

:func:`apply_all` applies every one of them.
"""

from __future__ import annotations

import importlib
import sys
import types

from delta_sync import accelerator

_installed = False
#: megatron-core modules that probe TE/triton: imported before the stand-in window
_IMPORTED_BEFORE_STAND_INS = (
    "megatron.core", "megatron.core.parallel_state", "megatron.core.extensions.transformer_engine",
    "megatron.core.fp8_utils", "megatron.core.fp4_utils", "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.transformer.attention",
    "megatron.core.transformer.multi_latent_attention",
    "megatron.core.models.gpt.heterogeneous.heterogeneous_layer_specs",
    "megatron.core.transformer.heterogeneous.linear_replacements", "megatron.core.post_training.modelopt.layers",
    "megatron.core.models.multimodal.llava_model",
    "megatron.core.models.gpt.experimental_attention_variant_module_specs",
)
_STAND_INS = ("transformer_engine", "transformer_engine.pytorch", "triton", "triton.language")
_FLAGS = ("HAVE_TE", "HAVE_TRITON")


class _Absent:
    """Any attribute of an absent optional package: usable as a base class, decorator or annotation."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name):
        return _Absent()

    def __getitem__(self, key):
        return self

    def __mro_entries__(self, bases):
        return (object,)


class _StandIn(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent()


def _stand_in(name: str) -> types.ModuleType:
    m = _StandIn(name)
    m.__path__ = []
    m.__version__ = "0.0.0"  # so is_te_min_version(...) is False during the window
    return m


def install() -> None:
    """Make ``from megatron.bridge import AutoBridge`` work without TE or triton (idempotent)."""
    global _installed
    if _installed:
        return
    for name in _IMPORTED_BEFORE_STAND_INS:
        importlib.import_module(name)
    if any(n in sys.modules for n in _STAND_INS if not isinstance(sys.modules.get(n), _StandIn)):
        importlib.import_module("megatron.bridge")  # the real packages are installed: nothing to adapt
        _installed = True
        return
    before = set(sys.modules)
    sys.modules.update({n: _stand_in(n) for n in _STAND_INS})
    try:
        importlib.import_module("megatron.bridge")
    finally:
        for n in _STAND_INS:
            sys.modules.pop(n, None)
    for name in set(sys.modules) - before:
        namespace = getattr(sys.modules.get(name), "__dict__", {})  # no getattr: lazy modules would import
        for flag in _FLAGS:
            if namespace.get(flag) is True:
                namespace[flag] = False
    _installed = True


def _wrap_once(owner, attr: str, wrap) -> None:
    """``owner.attr = wrap(original)``, once: a second call (or a second ``apply_all``) is a no-op."""
    original = getattr(owner, attr)
    if getattr(original, "_delta_sync_fixed", False):
        return
    fixed = wrap(original)
    fixed._delta_sync_fixed = True
    setattr(owner, attr, fixed)


def hf_config_compat(hf_config) -> None:
    """transformers 5 keeps ``rope_theta`` under ``rope_parameters``; Bridge 0.3.0 reads the attribute."""
    if getattr(hf_config, "rope_theta", None) is None:
        params = getattr(hf_config, "rope_parameters", None) or {}
        if "rope_theta" in params:
            hf_config.rope_theta = params["rope_theta"]


# ---- CPU training -------------------------------------------------------------------------------
class _CudaOnCpu:
    """``torch.cuda`` as seen by a CPU-only process: ``current_device()`` is the CPU."""

    def __init__(self, real):
        self._real = real

    def current_device(self):
        return "cpu"

    def __getattr__(self, name):
        return getattr(self._real, name)


class _TorchOnCpu(types.ModuleType):
    """``torch`` with ``torch.cuda.current_device()`` answering "cpu"; everything else is torch."""

    def __init__(self, real):
        super().__init__("torch")
        self._real = real
        self.cuda = _CudaOnCpu(real.cuda)

    def __getattr__(self, name):
        return getattr(self._real, name)


def install_cpu() -> None:
    """megatron-core 0.16.1 calls ``torch.cuda.current_device()`` to place tensors (RoPE, the MoE router,
    the global memory buffer of attention, ...) even when initialised on CPU. Every loaded
    ``megatron.*`` module whose source does so sees a ``torch`` whose current device is the CPU; no
    other module, and not torch itself, changes. Idempotent: call it again after building a model
    so modules imported since are covered."""
    import inspect

    import torch

    install()
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    # mcore 0.16.1 imports te_general_gemm only when TE is present but tests it unconditionally
    moe_utils.__dict__.setdefault("te_general_gemm", None)
    if accelerator.accelerated():  # NPUs too: the shims are for machines without any accelerator
        return
    proxy = _TorchOnCpu(torch)
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.") or module is None or module.__dict__.get("torch") is not torch:
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if "cuda.current_device()" in source:
            module.torch = proxy


# ---- SequentialMLP expert names ------------------------------------------------------------------
def fix_sequential_expert_export() -> None:
    """Bridge 0.3.0 reads the expert number of an exported MoE weight from a grouped-GEMM name
    (``...linear_fc1.weight7``); without TE, experts are a SequentialMLP (``...local_experts.7.
    linear_fc1.weight``) and ``int('')`` crashes the export (fixed upstream in 0.6.x). The number is
    handed over in the grouped form for the duration of the call."""
    import re

    install()
    from megatron.bridge.models.conversion import param_mapping

    cls = param_mapping.MegatronParamMapping

    def wrap(original):
        pattern = re.compile(r"local_experts\.(\d+)\.")

        def gather_from_ep_ranks(self, *args, **kwargs):
            name = self.megatron_param
            m = pattern.search(name)
            if m is None:
                return original(self, *args, **kwargs)
            suffix = ".weight" if ".weight" in name else ".bias"
            self.megatron_param = pattern.sub("", name, count=1).split(suffix)[0] + suffix + m.group(1)
            try:
                return original(self, *args, **kwargs)
            finally:
                self.megatron_param = name

        return gather_from_ep_ranks

    _wrap_once(cls, "gather_from_ep_ranks", wrap)


# ---- TP scatter over gloo ------------------------------------------------------------------------
def fix_tp_scatter() -> None:
    """Bridge 0.3.0 scatters column chunks of row-parallel weights (``o_proj``, ``down_proj``) as
    non-contiguous views; gloo sends the underlying storage and the receiving ranks silently load
    wrong values (no error). Chunks are made contiguous before the scatter."""
    install()
    from megatron.bridge.models.conversion import param_mapping

    cls = param_mapping.MegatronParamMapping

    def wrap(original):
        def scatter_to_tp_ranks(self, splits, *args, **kwargs):
            if splits:
                splits = [s.contiguous() for s in splits]
            return original(self, splits, *args, **kwargs)

        return scatter_to_tp_ranks

    _wrap_once(cls, "scatter_to_tp_ranks", wrap)


def apply_all() -> None:
    """Every adaptation in this module, in one explicit call (idempotent)."""
    install()
    install_cpu()
    fix_sequential_expert_export()
    fix_sequential_expert_numbering()
    fix_tp_scatter()
    cpu_tied_embeddings()
    sequence_parallel_torch_norm()


# ---- SequentialMLP experts at EP>1 --------------------------------------------------------------
def fix_sequential_expert_numbering() -> None:
    """Bridge 0.3.0 renumbers experts from local to global only in grouped-GEMM names; SequentialMLP
    names (``mlp.experts.local_experts.N.``) kept their local N, so every EP rank loaded (and
    exported) experts 0..E/ep-1. The local number is made global here too (fixed upstream in 0.6.x)."""
    import re

    install()
    from megatron.bridge.models.conversion import model_bridge
    from megatron.core import parallel_state

    def wrap(original):
        pattern = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)\.")

        def _megatron_local_name_to_global(models, config, param_name, vp_stage=None):
            name = original(models, config, param_name, vp_stage)
            ep = parallel_state.get_expert_model_parallel_world_size()
            m = pattern.search(name)
            if m is None or ep == 1 or ".adapter." in name:
                return name
            per_rank = config.num_moe_experts // ep
            global_number = per_rank * parallel_state.get_expert_model_parallel_rank() + int(m.group(2))
            return name[:m.start()] + f"{m.group(1)}{global_number}." + name[m.end():]

        return _megatron_local_name_to_global

    _wrap_once(model_bridge, "_megatron_local_name_to_global", wrap)

    # The export pairs expert tensors across EP ranks by position in each rank's sorted task list
    # (one all_gather per task). Bridge's sort key reads the expert number of grouped-GEMM names
    # only; SequentialMLP names sorted as strings, so with >= 10 experts per rank the ranks walked
    # their experts in different orders (rank 0: 0, 1, 10, ..., rank 1: 16, 17, 18, ...) and the
    # export labelled other ranks' experts wrongly (seen: 14 of 16 remote experts per layer at
    # 32 experts, EP=2). The SequentialMLP number is made part of the key too.
    expert = re.compile(r"\.local_experts\.(\d+)\.")

    def wrap_key(original):
        def extract_sort_key(param_name: str):
            numbers, name = original(param_name)
            m = expert.search(param_name)
            if m is not None and numbers[1] == -1:
                numbers = [numbers[0], int(m.group(1))]
            return numbers, name

        return extract_sort_key

    _wrap_once(model_bridge, "extract_sort_key", wrap_key)


# ---- tied embeddings at PP>1 on CPU -------------------------------------------------------------
def cpu_tied_embeddings() -> None:
    """With tied embeddings and PP>1, the last stage holds a copy of the word embeddings that
    ``LanguageModule.setup_embeddings_and_output_layer`` initialises by an all-reduce over the
    embedding group, after ``weight.data = weight.data.cuda()``: on a machine without CUDA that
    call raises. Without CUDA, ``Tensor.cuda`` leaves the tensor where it is for the duration of
    that method only (the all-reduce then runs on the CPU backend)."""
    import torch

    install()
    from megatron.core.models.common.language_module.language_module import LanguageModule

    def wrap(original):
        def setup_embeddings_and_output_layer(self, *args, **kwargs):
            if accelerator.accelerated():
                return original(self, *args, **kwargs)
            cuda = torch.Tensor.cuda
            torch.Tensor.cuda = lambda t, *a, **k: t
            try:
                return original(self, *args, **kwargs)
            finally:
                torch.Tensor.cuda = cuda

        return setup_embeddings_and_output_layer

    _wrap_once(LanguageModule, "setup_embeddings_and_output_layer", wrap)


# ---- sequence parallelism without TE / apex norms -----------------------------------------------
def sequence_parallel_torch_norm() -> None:
    """mcore 0.16.1 requires sequence parallelism for MoE at TP>1 in training, but its torch norm
    (the only one without TE or apex) refuses ``sequence_parallel``. A per-token norm needs nothing
    from other sequence shards; what SP changes is that each TP rank sees only its tokens, so the
    norm's weight gradient is partial. TE's and apex's norms mark their parameters
    ``sequence_parallel`` and Megatron sums those gradients over TP (finalize_model_grads): the torch
    norm is built the same way here, with the same mark. Trainers that reduce gradients by hand
    must honour it (``launchers.megatron_trainer`` does)."""
    import copy

    install()
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm

    def wrap(original):
        def __new__(klass, config, *args, **kwargs):
            if not config.sequence_parallel:
                return original(klass, config, *args, **kwargs)
            local = copy.copy(config)
            local.sequence_parallel = False
            norm = original(klass, local, *args, **kwargs)
            for p in norm.parameters():
                p.sequence_parallel = True
            return norm

        return __new__

    _wrap_once(cls, "__new__", wrap)
