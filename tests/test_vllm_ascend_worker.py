"""delta-sync's worker methods on vLLM-Ascend's real ``NPUWorker`` (source release 0.23.0.post1).

The worker module is the released file, loaded from the sdist that ``launchers/setup.sh`` fetched
(``launchers/fetch_vllm_ascend.py``, pinned by sha256); torch_npu and the other vLLM-Ascend
modules it imports are stubbed, as ``tests/ascend_worker_probe.py`` says. ``NPUWorker`` derives from
vLLM's ``WorkerBase``, not from the GPU ``Worker``, and defines its own transfer lifecycle, which
runs a layerwise reload (parameters swapped out) around a transfer and never calls the engine's
start/finish.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launchers.fetch_vllm_ascend import WORKER, fetch

ROOT = Path(__file__).resolve().parents[1]


def test_real_npu_worker_serves_delta_sync_and_refuses_unsigned_lifecycle_calls():
    archive = fetch()  # present after setup; fetched (and checked) otherwise
    proc = subprocess.run([sys.executable, "-m", "tests.ascend_worker_probe", str(archive), WORKER, "plugin_first"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DELTA_SYNC_CLAIM_S": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bases"] == ["vllm.v1.worker.worker_base.WorkerBase"]
    assert not got["derives_from_gpu_worker"]
    assert got["methods"] == {"delta_sync_call": True, "delta_sync_status": True}
    # NPUWorker's own lifecycle, reached by vLLM's unsigned HTTP routes: refused before it runs
    assert set(got["own_lifecycle"]) >= {"start_weight_update", "update_weights", "finish_weight_update"}
    assert got["native_calls"] == dict.fromkeys(
        ["start_weight_update", "update_weights", "finish_weight_update", "init_weight_transfer_engine"],
        "AuthError")
    assert got["reloads_after_native_calls"] == []
    # signed calls drive the delta-sync engine and the worker's session flag, no layerwise reload
    assert got["signed_calls"] == {"start": None, "start_active_after": True,
                                   "finish": None, "finish_active_after": False}
    assert got["reloads_after_signed_calls"] == []
    assert got["status"] == {"version": None, "needs_seed": True, "partial": False}


def test_worker_classes_imported_before_the_plugin_are_gated_too():
    """vLLM loads general plugins before it resolves ``worker_cls``, so ``__init_subclass__`` gates
    NPUWorker (above); a worker class imported earlier is found by walking WorkerBase's subclasses."""
    from vllm.v1.worker.worker_base import WorkerBase

    from patches import vllm_plugin

    class EarlyWorker(WorkerBase):
        pass

    def start_weight_update(self):
        return "ran"

    EarlyWorker.start_weight_update = start_weight_update  # as if defined before any hook could see it
    vllm_plugin._gate_subclasses(WorkerBase)
    assert EarlyWorker.start_weight_update._delta_sync_gate
    assert EarlyWorker.start_weight_update(SimpleNamespace()) == "ran"  # no delta-sync engine: not gated

    class Refusing:
        def require_authorized(self, what):
            raise PermissionError(what)

    with pytest.raises(PermissionError, match="start_weight_update"):
        EarlyWorker.start_weight_update(SimpleNamespace(weight_transfer_engine=Refusing()))


def test_engine_built_through_the_older_weight_transfer_api_says_so():
    """vLLM 0.23 (what vLLM-Ascend 0.23.0.post1 builds on) creates engines as
    ``create_engine(config, parallel_config, model)``; delta-sync needs the newer API."""
    from delta_sync.errors import DeltaSyncError
    from patches.vllm_receiver import DeltaSyncWeightTransferEngine

    with pytest.raises(DeltaSyncError, match="version matrix") as e:
        DeltaSyncWeightTransferEngine(SimpleNamespace(backend="delta_sync"),
                                      SimpleNamespace(tensor_parallel_size=1), torch.nn.Linear(2, 2))
    assert "kept: the engine as loaded" in str(e.value)
