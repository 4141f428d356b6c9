"""Runs vLLM-Ascend 0.23.0.post1's real post-load step for unquantized MoE weights and reports what
delta-sync makes of its result; prints one JSON line.

Run as a subprocess by ``tests/test_ascend_standins.py`` (the stubs below fill ``sys.modules``).
What is real: ``vllm_ascend/ops/fused_moe/fused_moe.py`` as released (read from the sdist that
``launchers/fetch_releases.py`` fetched), its ``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``
(the transposition of ``w13``/``w2`` into new storage, the NZ cast and the per-expert copies it makes
with fused MC2), vLLM's base classes it calls, and delta-sync's loader views and layout checks.
What is stubbed (named so): ``torch_npu`` (``npu_format_cast`` records which storages it made NZ)
and every other ``vllm_ascend`` module, with the settings the method reads (``get_ascend_config``)
given values; ``torch.npu`` (the module annotates with ``torch.npu.Event``). The layer's loader is
``StandInAscendFusedMoE.load_weights`` (vLLM's FusedMoE weight loader writes the same checkpoint
layout; it needs a whole engine to construct).
"""

from __future__ import annotations

import importlib
import json
import sys
from types import SimpleNamespace

import torch

from .ascend_worker_probe import FUSED_MOE, AscendSourceFinder, StubModule
from .test_ascend_standins import StandInAscendFusedMoE, check_transposed_views

MEMBER = "vllm_ascend-0.23.0.post1/vllm_ascend/ops/fused_moe/fused_moe.py"
NZ = 29  # ACL_FORMAT_FRACTAL_NZ


def main(archive: str) -> dict:
    import vllm

    settings = {"enable_fused_mc2": 0, "dynamic_eplb": False}
    nz_storages: set[int] = set()

    def npu_format_cast(t, fmt):
        if fmt == NZ:
            nz_storages.add(t.data_ptr())
        return t

    def get_ascend_config():
        return SimpleNamespace(enable_fused_mc2=settings["enable_fused_mc2"],
                               eplb_config=SimpleNamespace(dynamic_eplb=settings["dynamic_eplb"]))

    torch.npu = StubModule("torch.npu")
    sys.meta_path.insert(0, AscendSourceFinder(archive, {FUSED_MOE: MEMBER}, values={
        "torch_npu": {"npu_format_cast": npu_format_cast},
        "vllm_ascend.ascend_config": {"get_ascend_config": get_ascend_config},
        # maybe_trans_nz: NZ only where weight_nz_mode asks for it; delta-sync runs with weight_nz_mode=0
        "vllm_ascend.utils": {"ACL_FORMAT_FRACTAL_NZ": NZ, "vllm_version_is": lambda v: vllm.__version__ == v,
                              "maybe_trans_nz": lambda weight: weight},
    }))
    try:
        method_cls = importlib.import_module(FUSED_MOE).AscendUnquantizedFusedMoEMethod
    except ImportError as e:  # the release is written against vLLM 0.23's modules
        return {"vllm": vllm.__version__, "import_error": f"{type(e).__name__}: {e}"}
    method = method_cls.__new__(method_cls)  # its __init__ needs a FusedMoEConfig; the step reads none of it
    method.dynamic_eplb = False

    class RealPostLoad(StandInAscendFusedMoE):
        def process_weights_after_loading(self):
            method.process_weights_after_loading(self)

    out = {"vllm": vllm.__version__, "method": f"{method_cls.__module__}.{method_cls.__qualname__}",
           "nd": check_transposed_views(RealPostLoad)}

    from delta_sync.errors import LayoutNotSupported
    from patches.vllm_ascend import check_ascend_layout
    from patches.vllm_receiver import check_layout_supported

    refusals = {}
    for mc2, eplb in ((1, False), (1, True)):
        settings.update(enable_fused_mc2=mc2, dynamic_eplb=eplb)
        method.dynamic_eplb = eplb
        layer = RealPostLoad()
        layer.process_weights_after_loading()
        cfg = SimpleNamespace(additional_config={"weight_nz_mode": 0},
                              model_config=SimpleNamespace(quantization=None),
                              parallel_config=SimpleNamespace(pipeline_parallel_size=1, enable_eplb=False))
        try:
            check_layout_supported(cfg, layer, torch.device("cpu"))
            check_ascend_layout(cfg, layer, format_of=lambda t: NZ if t.data_ptr() in nz_storages else 2)
            refusals[f"mc2={mc2},eplb={eplb}"] = None
        except LayoutNotSupported as e:
            refusals[f"mc2={mc2},eplb={eplb}"] = str(e)
    out["refusals"] = refusals
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
