"""vLLM-Ascend layouts on CPU (no NPU, torch_npu or HCCL here).

vLLM-Ascend's FusedMoE loader writes per-expert checkpoint tensors into ``w13 [E, 2I, H]`` /
``w2 [E, H, I]``; its post-load step (``AscendUnquantizedFusedMoEMethod.process_weights_after_loading``)
transposes both into new contiguous storage ``[E, H, 2I]`` / ``[E, I, H]``. That step is the released
source's own (``tests/ascend_moe_probe.py`` runs it from the 0.23.0.post1 sdist, torch_npu stubbed);
the loader is a stand-in named as such, ``StandInAscendFusedMoE.load_weights``.
"""

from types import SimpleNamespace

import pytest
import torch

from delta_sync.errors import LayoutNotSupported
from patches.loader_views import UndoLog, apply_dense, apply_sparse, probe_views
from patches.vllm_ascend import ACL_FORMAT_FRACTAL_NZ, check_ascend_layout, checkpoint_layout

E, I, H = 4, 6, 10  # noqa: E741


class StandInAscendFusedMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden_size, self.intermediate_size_per_partition = H, I
        self.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * I, H), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(torch.zeros(E, H, I), requires_grad=False)

    def load_weights(self, items):
        for name, w in items:
            _, e, proj, _ = name.split(".")
            e = int(e)
            if proj == "gate_proj":
                self.w13_weight.data[e, :I].copy_(w)
            elif proj == "up_proj":
                self.w13_weight.data[e, I:].copy_(w)
            else:
                self.w2_weight.data[e].copy_(w)

    def process_weights_after_loading(self):
        raise NotImplementedError("vLLM-Ascend's own step runs here (tests/ascend_moe_probe.py)")


def _specs():
    out = []
    for e in range(E):
        out += [(f"experts.{e}.gate_proj.weight", (I, H)), (f"experts.{e}.up_proj.weight", (I, H)),
                (f"experts.{e}.down_proj.weight", (H, I))]
    return out


def check_transposed_views(layer_cls) -> dict:
    """Loads random experts into ``layer_cls`` (a ``StandInAscendFusedMoE`` whose post-load step is
    vLLM-Ascend's), records loader views under :func:`checkpoint_layout`, applies sparse patches,
    undoes them and applies dense ones; says what held at each step."""
    def loaded(state):
        m = layer_cls()
        m.load_weights(state.items())
        m.process_weights_after_loading()
        return m

    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in _specs()}
    model = loaded(state)
    out = {"w13": [list(model.w13_weight.shape), model.w13_weight.is_contiguous()],
           "w2": [list(model.w2_weight.shape), model.w2_weight.is_contiguous()]}
    before = {n: p.clone() for n, p in model.named_parameters()}
    specs = [(n, s, torch.float32) for n, s in _specs()]
    # without the adaptation the loader's narrow/copy does not fit the transposed parameter
    _, unsupported = probe_views(model, specs)
    out["unsupported_without_adaptation"] = len(unsupported)
    with checkpoint_layout(model) as swapped:
        out["swapped"] = swapped
        views, unsupported = probe_views(model, specs)
    out["unsupported"] = len(unsupported)
    out["restored_after_probe"] = model.w13_weight.shape == (E, H, 2 * I) and all(
        torch.equal(p, before[n]) for n, p in model.named_parameters())  # probing wrote nothing
    params = dict(model.named_parameters())
    new = {n: t.clone() for n, t in state.items()}
    undo = UndoLog()
    for n, t in new.items():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 7].sort().values
        flat[idx] = torch.randn(idx.numel(), generator=g)
        apply_sparse(views[n], params, idx.to(torch.int32), flat[idx], undo)
    ref = loaded(new)
    out["sparse_equal"] = torch.equal(model.w13_weight, ref.w13_weight) and torch.equal(model.w2_weight, ref.w2_weight)
    undo.restore()
    out["undone"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for n, t in new.items():
        apply_dense(views[n], params, t, None)
    out["dense_equal"] = torch.equal(model.w13_weight, ref.w13_weight) and torch.equal(model.w2_weight, ref.w2_weight)
    return out


@pytest.mark.receiver
def test_vllm_ascends_own_post_load_layout_is_patched_through_transposed_views():
    """vLLM-Ascend 0.23.0.post1's post-load step, run from its release: the views recorded against the
    transposed storage write exactly what a fresh load of the patched experts gives; with fused MC2
    its NZ cast and per-expert copies are refused by name."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from launchers.fetch_releases import fetch

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "tests.ascend_moe_probe", str(fetch())], cwd=root,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if "import_error" in got and not got["vllm"].startswith("0.23."):
        pytest.skip(f"vLLM-Ascend 0.23.0.post1 imports vLLM 0.23's modules (this is vLLM {got['vllm']}: "
                    f"{got['import_error']}); it runs in .venv-vllm023")
    print("vLLM", got["vllm"], got["method"])
    assert got["method"] == "vllm_ascend.ops.fused_moe.fused_moe.AscendUnquantizedFusedMoEMethod"
    assert got["nd"] == {"w13": [[E, H, 2 * I], True], "w2": [[E, I, H], True],
                         "unsupported_without_adaptation": 3 * E,
                         "swapped": ["RealPostLoad.w13_weight", "RealPostLoad.w2_weight"], "unsupported": 0,
                         "restored_after_probe": True, "sparse_equal": True, "undone": True, "dense_equal": True}
    assert "w13_weight is stored as FRACTAL_NZ" in got["refusals"]["mc2=1,eplb=False"]
    assert "w13_weight_list is a second copy of the weights" in got["refusals"]["mc2=1,eplb=True"]


def test_nz_weights_are_refused_with_the_setting():
    model = StandInAscendFusedMoE()
    cfg = SimpleNamespace(additional_config={"weight_nz_mode": 0})
    check_ascend_layout(cfg, model, format_of=lambda t: 2)  # ND everywhere
    with pytest.raises(LayoutNotSupported, match="weight_nz_mode=2"):
        check_ascend_layout(SimpleNamespace(additional_config={"weight_nz_mode": 2}), model, format_of=lambda t: 2)
    nz = model.w2_weight.data_ptr()
    with pytest.raises(LayoutNotSupported, match="w2_weight is stored as FRACTAL_NZ"):
        check_ascend_layout(cfg, model, format_of=lambda t: ACL_FORMAT_FRACTAL_NZ if t.data_ptr() == nz else 2)


def test_worker_methods_reach_a_worker_class_that_is_not_vllms_gpu_worker():
    """vLLM-Ascend's NPUWorker derives from vLLM's WorkerBase, not from the GPU Worker; the plugin's
    collective_rpc methods must exist on it. StandInNPUWorker is a stand-in (torch_npu cannot
    import here): a WorkerBase subclass outside the GPU worker's hierarchy."""
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    from patches.vllm_plugin import register

    register()

    class StandInNPUWorker(WorkerBase):
        pass

    assert not issubclass(StandInNPUWorker, Worker)
    for method in ("delta_sync_call", "delta_sync_status"):
        assert callable(getattr(StandInNPUWorker, method, None)), method
    w = StandInNPUWorker.__new__(StandInNPUWorker)  # delta-sync not switched on: a clear answer, not an error
    assert w.delta_sync_status() == {"version": None, "needs_seed": True, "partial": False}
    with pytest.raises(RuntimeError, match="delta-sync is not switched on for this engine"):
        w.delta_sync_call("{}")
    assert "_delta_sync_receiver" not in w.__dict__


def test_square_experts_are_refused_rather_than_guessed():
    """A layer whose hidden size is twice its expert width has a ``w13`` that reads the same
    transposed or not (a CPU engine's stand-in says which; vLLM-Ascend's layers do not): guessing
    would record views against the wrong layout and write every delta to the wrong elements while
    digests agree, so the layout is refused with the reason. A layer that says so is taken at its
    word."""
    layer = torch.nn.Module()
    layer.hidden_size, layer.intermediate_size_per_partition = 2 * I, I
    layer.w13_weight = torch.nn.Parameter(torch.zeros(E, 2 * I, 2 * I), requires_grad=False)
    model = torch.nn.Sequential(layer)
    with pytest.raises(LayoutNotSupported, match="square .*does not say whether vLLM-Ascend transposed"):
        with checkpoint_layout(model):
            pass
    layer._delta_sync_transposed = True
    with checkpoint_layout(model) as swapped:
        assert swapped == ["Module.w13_weight"] and model[0].w13_weight.stride() == (4 * I * I, 1, 2 * I)
    assert model[0].w13_weight.stride() == (4 * I * I, 2 * I, 1)  # put back
