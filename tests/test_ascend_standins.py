"""vLLM-Ascend layouts reproduced by stand-in modules on CPU (no NPU, torch_npu or HCCL here).

The stand-in is named as such: it mimics vLLM-Ascend's FusedMoE, whose loader writes per-expert
checkpoint tensors into ``w13 [E, 2I, H]`` / ``w2 [E, H, I]`` and whose post-load step transposes
both into new contiguous storage ``[E, H, 2I]`` / ``[E, I, H]``.
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
        """What vLLM-Ascend does after loading: transpose into new contiguous storage."""
        self.w13_weight = torch.nn.Parameter(self.w13_weight.data.transpose(1, 2).contiguous(), requires_grad=False)
        self.w2_weight = torch.nn.Parameter(self.w2_weight.data.transpose(1, 2).contiguous(), requires_grad=False)


def _specs():
    out = []
    for e in range(E):
        out += [(f"experts.{e}.gate_proj.weight", (I, H)), (f"experts.{e}.up_proj.weight", (I, H)),
                (f"experts.{e}.down_proj.weight", (H, I))]
    return out


def _loaded(state):
    m = StandInAscendFusedMoE()
    m.load_weights(state.items())
    m.process_weights_after_loading()
    return m


def test_transposed_moe_views_write_the_runtime_storage():
    g = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=g) for n, s in _specs()}
    model = _loaded(state)
    before = {n: p.clone() for n, p in model.named_parameters()}
    specs = [(n, s, torch.float32) for n, s in _specs()]
    # without the adaptation the loader's narrow/copy does not fit the transposed parameter
    _, unsupported = probe_views(model, specs)
    assert len(unsupported) == len(specs)
    with checkpoint_layout(model) as swapped:
        assert swapped == ["StandInAscendFusedMoE.w13_weight", "StandInAscendFusedMoE.w2_weight"]
        views, unsupported = probe_views(model, specs)
    assert not unsupported
    assert model.w13_weight.shape == (E, H, 2 * I)  # runtime parameters restored after probing
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # probing wrote nothing
    params = dict(model.named_parameters())
    new = {n: t.clone() for n, t in state.items()}
    undo = UndoLog()
    for n, t in new.items():
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 7].sort().values
        flat[idx] = torch.randn(idx.numel(), generator=g)
        apply_sparse(views[n], params, idx.to(torch.int32), flat[idx], undo)
    ref = _loaded(new)
    assert torch.equal(model.w13_weight, ref.w13_weight) and torch.equal(model.w2_weight, ref.w2_weight)
    undo.restore()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    for n, t in new.items():
        apply_dense(views[n], params, t, None)
    assert torch.equal(model.w13_weight, ref.w13_weight) and torch.equal(model.w2_weight, ref.w2_weight)


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
    w = StandInNPUWorker.__new__(StandInNPUWorker)  # no engine configured: a clear answer, not an error
    assert w.delta_sync_status() == {"version": None, "needs_seed": True, "partial": False}
    with pytest.raises(RuntimeError, match="no delta_sync weight transfer"):
        w.delta_sync_call("{}")
