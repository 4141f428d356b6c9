"""Loads vLLM-Ascend's real ``NPUWorker`` from its source release and drives it; prints one JSON line.

Run as a subprocess by ``tests/test_vllm_ascend_worker.py``, in each vLLM environment of the suite
(vLLM 0.23, which vLLM-Ascend 0.23.0.post1 builds on, and 0.32): importing the worker module edits
torch._dynamo's global rule tables and the stubs below fill ``sys.modules``, so no test process
keeps either.

What is real: ``vllm_ascend/worker/worker.py`` as released (read from the sdist fetched by
``launchers/fetch_releases.py``), vLLM's ``WorkerBase`` and the rest of vLLM it imports, the
delta-sync plugin and its receiver, and a tiny Qwen3 model loaded by a real in-process vLLM engine on
CPU, whose model runner and config the ``NPUWorker`` is given. What is stubbed (named so): ``torch_npu``
and every other ``vllm_ascend`` module the worker imports (they need an NPU, CANN and compiled
kernels), as modules whose attributes are empty placeholder classes; ``NPUWorker.__init__`` (it binds
an NPU) is skipped and the attributes the plugin reads are set instead.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import sys
import tarfile
import types

import torch

TARGET = "vllm_ascend.worker.worker"
#: vLLM-Ascend's fused MoE (its unquantized method transposes w13/w2 after loading)
FUSED_MOE = "vllm_ascend.ops.fused_moe.fused_moe"


class StubModule(types.ModuleType):
    """A placeholder module: every attribute is an empty class named after it, unless the test
    gave the attribute a value (``AscendSourceFinder(values=...)``)."""

    __path__: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class AscendSourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the named vLLM-Ascend modules from the release archive (``real``: module -> archive
    member) and stubs torch_npu and every other vllm_ascend module; ``values`` sets attributes of
    stubbed modules (module -> {name: value})."""

    def __init__(self, archive: str, real: dict[str, str], values: dict[str, dict] | None = None):
        with tarfile.open(archive) as tar:
            self.sources = {m: (tar.extractfile(member).read().decode(), f"{archive}!{member}")
                            for m, member in real.items()}
        self.values = values or {}

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch_npu", "vllm_ascend"):
            spec = importlib.util.spec_from_loader(name, self, is_package=name not in self.sources)
            if name in self.sources:
                spec.origin = self.sources[name][1]
            return spec
        return None

    def create_module(self, spec):
        if spec.name in self.sources:
            return None
        module = StubModule(spec.name)
        for attr, value in self.values.get(spec.name, {}).items():
            setattr(module, attr, value)
        return module

    def exec_module(self, module):
        if module.__name__ in self.sources:
            source, origin = self.sources[module.__name__]
            module.__file__ = origin
            exec(compile(source, origin, "exec"), module.__dict__)


def load_npu_worker(archive: str, member: str):
    sys.meta_path.insert(0, AscendSourceFinder(archive, {TARGET: member}))
    return importlib.import_module(TARGET).NPUWorker


class NPUWorkerRPC:
    """``collective_rpc`` onto one worker object, as vLLM's uni-process executor does for its one
    worker: what an in-process engine client calls."""

    def __init__(self, worker):
        self.worker = worker

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        return True


def main(archive: str, member: str, plugin_first: bool, kind: str = "dense") -> dict:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    import vllm.model_executor.model_loader.reload as reload
    from vllm import LLM

    from delta_sync.auth import AuthError
    from delta_sync.engines import InProcessEngine
    from delta_sync.sync import WeightSync
    from delta_sync.checkpoints import build
    from patches.vllm_plugin import _GATED, register

    from .engine_helpers import close_llm, evolve, load_state
    from .engine_runner import engine_kwargs

    out: dict = {"vllm": vllm.__version__}
    if plugin_first:  # as vLLM does: general plugins load before the worker class is resolved
        register()
    NPUWorker = load_npu_worker(archive, member)
    if not plugin_first:
        register()
    # what the user sets: delta-sync refuses FRACTAL_NZ weights (patches/vllm_ascend.py), so does NPUWorker
    importlib.import_module("vllm_ascend.envs").VLLM_ASCEND_ENABLE_NZ = False
    from vllm.v1.worker.gpu_worker import Worker
    from vllm.v1.worker.worker_base import WorkerBase

    out["bases"] = [f"{b.__module__}.{b.__qualname__}" for b in NPUWorker.__bases__]
    out["derives_from_workerbase"] = issubclass(NPUWorker, WorkerBase)
    out["derives_from_gpu_worker"] = issubclass(NPUWorker, Worker)
    out["own_lifecycle"] = sorted(n for n in _GATED if n in NPUWorker.__dict__)
    out["methods"] = {m: callable(getattr(NPUWorker, m, None)) for m in ("delta_sync_call", "delta_sync_status")}

    reloads = []  # vLLM's layerwise reload, which NPUWorker's own start/finish run
    reload.initialize_layerwise_reload = lambda *a, **k: reloads.append("initialize")
    reload.finalize_layerwise_reload = lambda *a, **k: reloads.append("finalize")

    path = build(kind)
    llm = LLM(model=str(path), **engine_kwargs())  # delta-sync switched on: checkpoint-layout weights
    loaded = llm.llm_engine.model_executor.driver_worker.worker
    w = NPUWorker.__new__(NPUWorker)  # NPUWorker.__init__ binds an NPU; the plugin reads only these
    w.vllm_config, w.model_config, w.model_runner = loaded.vllm_config, loaded.model_config, loaded.model_runner
    w.device, w.weight_transfer_engine = torch.device("cpu"), None

    refused = {}
    for name, args in (("start_weight_update", ()), ("update_weights", ({},)), ("finish_weight_update", ()),
                       ("init_weight_transfer_engine", ({},))):
        try:
            getattr(w, name)(*args)
            refused[name] = "ran"
        except AuthError:
            refused[name] = "AuthError"
        except Exception as e:  # noqa: BLE001 - reported, the test says what it wanted
            refused[name] = f"{type(e).__name__}: {e}"[:200]
    out["native_calls"] = refused
    out["reloads_after_native_calls"] = list(reloads)
    out["receiver_before_signed_calls"] = "_delta_sync_receiver" in w.__dict__

    # the trainer side as a library user runs it: a seed and two deltas over the in-process channel
    state = load_state(path)
    sync = WeightSync([InProcessEngine(NPUWorkerRPC(w), name="npu-worker")], mode="delta", verify_every=1)
    kinds = []
    for v in range(3):
        if v:
            evolve(state, v)
        report = sync.update(state.items())
        kinds.append([report.kind, report.version, bool(report.checked)])
    out["updates"] = kinds
    sync.verify()  # every weight's digest, read back from the live parameters, equals the trainer's
    out["verified"] = True
    receiver = w.__dict__["_delta_sync_receiver"]
    params = dict(receiver.model.named_parameters())
    out["model_is_the_workers"] = receiver.model is loaded.model_runner.get_model()
    out["views"] = len(receiver.views)
    out["fallback"] = sorted(receiver.fallback)
    out["weights_equal"] = _weights_equal(receiver, params, state)
    out["reloads_after_signed_calls"] = list(reloads)
    out["status"] = w.delta_sync_status()
    sync.close()
    close_llm(llm)
    return out


def _weights_equal(receiver, params, state) -> bool:
    """Every checkpoint tensor, read back element by element through its loader view, equals the
    trainer's bf16 value."""
    from patches.loader_views import read_through

    for name, want in state.items():
        idx, got = read_through(receiver.views[name], params)
        flat = want.to(torch.bfloat16).reshape(-1)
        if idx.numel() != flat.numel() or not torch.equal(got.view(torch.int16), flat[idx].view(torch.int16)):
            return False
    return True


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3] == "plugin_first")))
