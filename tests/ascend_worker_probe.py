"""Loads vLLM-Ascend's real ``NPUWorker`` from its source release and drives it; prints one JSON line.

Run as a subprocess by ``tests/test_vllm_ascend_worker.py``: importing the worker module edits
torch._dynamo's global rule tables and the stubs below fill ``sys.modules``, so no test process
keeps either.

What is real: ``vllm_ascend/worker/worker.py`` as released (read from the sdist fetched by
``launchers/fetch_vllm_ascend.py``), vLLM's ``WorkerBase`` and the rest of vLLM it imports, the
delta-sync plugin and its engine. What is stubbed (named so): ``torch_npu`` and every other
``vllm_ascend`` module the worker imports (they need an NPU, CANN and compiled kernels), as
modules whose attributes are empty placeholder classes.
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


class StubModule(types.ModuleType):
    """A placeholder module: every attribute is an empty class named after it."""

    __path__: list[str] = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class AscendSourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``vllm_ascend.worker.worker`` from the archive and stubs torch_npu / vllm_ascend.*."""

    def __init__(self, source: str, origin: str):
        self.source, self.origin = source, origin

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch_npu", "vllm_ascend"):
            spec = importlib.util.spec_from_loader(name, self, is_package=name != TARGET)
            if name == TARGET:
                spec.origin = self.origin
            return spec
        return None

    def create_module(self, spec):
        return None if spec.name == TARGET else StubModule(spec.name)

    def exec_module(self, module):
        if module.__name__ == TARGET:
            module.__file__ = self.origin
            exec(compile(self.source, self.origin, "exec"), module.__dict__)


def load_npu_worker(archive: str, member: str):
    with tarfile.open(archive) as tar:
        source = tar.extractfile(member).read().decode()
    sys.meta_path.insert(0, AscendSourceFinder(source, f"{archive}!{member}"))
    return importlib.import_module(TARGET).NPUWorker


def main(archive: str, member: str, plugin_first: bool) -> dict:
    import os
    from types import SimpleNamespace

    import vllm.model_executor.model_loader.reload as reload

    from delta_sync.auth import AuthError, Signer, load_secret
    from patches.vllm_plugin import _GATED, register

    out: dict = {}
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

    from patches.vllm_receiver import DeltaSyncWeightTransferEngine

    os.environ["DELTA_SYNC_SECRET"] = "s" * 64
    model = torch.nn.Linear(4, 4)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0),
                          model_config=None)
    engine = DeltaSyncWeightTransferEngine(SimpleNamespace(backend="delta_sync"), cfg, torch.device("cpu"), model)
    w = NPUWorker.__new__(NPUWorker)  # NPUWorker.__init__ needs an NPU; its lifecycle needs only these
    w.weight_transfer_engine, w._weight_update_active, w._is_checkpoint_format = engine, False, True
    w.device, w.model_runner = torch.device("cpu"), SimpleNamespace(model=model)

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

    signer = Signer(load_secret())
    steps = {}
    for method in ("start", "finish"):
        try:
            steps[method] = w.delta_sync_call(json.dumps(signer.sign(method, {})))
            steps[method + "_active_after"] = w._weight_update_active
        except Exception as e:  # noqa: BLE001
            steps[method] = f"{type(e).__name__}: {e}"[:300]
    out["signed_calls"] = steps
    out["reloads_after_signed_calls"] = list(reloads)
    out["status"] = w.delta_sync_status()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3] == "plugin_first")))
