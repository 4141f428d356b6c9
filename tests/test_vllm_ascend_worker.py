"""delta-sync on vLLM-Ascend's real ``NPUWorker`` (source release 0.23.0.post1), driven end to end.

The worker module is the released file, loaded from the sdist that ``launchers/setup.sh`` fetched
(``launchers/fetch_releases.py``, pinned by sha256); torch_npu and the other vLLM-Ascend modules it
imports are stubbed, as ``tests/ascend_worker_probe.py`` says. ``NPUWorker`` derives from vLLM's
``WorkerBase``, not from the GPU ``Worker``, and defines its own transfer lifecycle, which runs a
layerwise reload (parameters swapped out) around a transfer. The worker probe runs on the vLLM
that vLLM-Ascend 0.23.0.post1 runs on, vLLM 0.23 (``.venv-vllm023``); the plugin's gating of
worker classes runs in both vLLM environments.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from launchers.fetch_releases import WORKER, fetch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.receiver


def test_real_npu_worker_syncs_seed_and_deltas_through_signed_calls():
    import vllm

    if not vllm.__version__.startswith("0.23"):  # suite time: the release and its vLLM, not this one
        pytest.skip(f"vLLM-Ascend 0.23.0.post1's NPUWorker runs on vLLM 0.23 (.venv-vllm023 runs this); "
                    f"this is vLLM {vllm.__version__}")
    archive = fetch()  # present after setup; fetched (and checked) otherwise
    proc = subprocess.run([sys.executable, "-m", "tests.ascend_worker_probe", str(archive), WORKER, "plugin_first"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DELTA_SYNC_CLAIM_S": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print("vLLM", got["vllm"])
    assert got["bases"] == ["vllm.v1.worker.worker_base.WorkerBase"]
    assert not got["derives_from_gpu_worker"]
    assert got["methods"] == {"delta_sync_call": True, "delta_sync_status": True}
    # NPUWorker's own lifecycle, reached by vLLM's unsigned HTTP routes: refused before it runs
    assert set(got["own_lifecycle"]) >= {"start_weight_update", "update_weights", "finish_weight_update"}
    assert got["native_calls"] == dict.fromkeys(
        ["start_weight_update", "update_weights", "finish_weight_update", "init_weight_transfer_engine"],
        "AuthError")
    assert got["reloads_after_native_calls"] == []
    assert not got["receiver_before_signed_calls"]  # created by the first signed call, not before
    # a seed and two deltas through signed calls: digests and every element equal the trainer's
    assert got["updates"] == [["seed", 0, False], ["delta", 1, True], ["delta", 2, True]]  # a seed is checked in flight
    assert got["verified"] and got["weights_equal"] and got["model_is_the_workers"]
    assert got["views"] > 0 and got["fallback"] == []
    assert got["reloads_after_signed_calls"] == []  # no layerwise reload, ever
    status = got["status"]
    assert {k: status[k] for k in ("version", "needs_seed", "partial")} == {"version": 2, "needs_seed": False,
                                                                          "partial": False}
    assert status["engine"]  # the identity every signed call named


def test_worker_classes_imported_before_the_plugin_are_gated_too():
    """vLLM loads general plugins before it resolves ``worker_cls``, so ``__init_subclass__`` gates
    NPUWorker (above); a worker class imported earlier is found by walking WorkerBase's subclasses."""
    from vllm.v1.worker.worker_base import WorkerBase

    from delta_sync.auth import AuthError
    from patches import vllm_plugin

    class EarlyWorker(WorkerBase):
        pass

    def start_weight_update(self):
        return "ran"

    EarlyWorker.start_weight_update = start_weight_update  # as if defined before any hook could see it
    vllm_plugin._gate_subclasses(WorkerBase)
    assert EarlyWorker.start_weight_update._delta_sync_gate
    off = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={}))
    assert EarlyWorker.start_weight_update(off) == "ran"  # delta-sync not switched on: not gated
    on = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"delta_sync": True}))
    with pytest.raises(AuthError, match="start_weight_update: unsigned weight-transfer call refused"):
        EarlyWorker.start_weight_update(on)
