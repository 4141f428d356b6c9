"""The core library stays engine-agnostic, picks backends in one place, and its bench runs."""

import json
import os
import subprocess
import sys

import pytest
import torch

from delta_sync import accelerator
from delta_sync.errors import DeviceNotAvailable


def test_core_imports_neither_vllm_nor_megatron():
    code = ("import sys, delta_sync, delta_sync.bench, delta_sync.channel, delta_sync.gather, "
            "delta_sync.transfer, delta_sync.snapshot\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'megatron', 'patches', 'update_weight')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_backend_per_family():
    assert [accelerator.backend_for(f) for f in ("npu", "cuda", "cpu")] == ["hccl", "nccl", "gloo"]
    assert accelerator.family_for_backend("hccl") == "npu"
    with pytest.raises(ValueError, match="unknown collective backend 'mpi'"):
        accelerator.family_for_backend("mpi")


def test_npu_without_torch_npu_names_it():
    try:
        import torch_npu  # noqa: F401
        pytest.skip("torch_npu present")
    except ImportError:
        pass
    with pytest.raises(DeviceNotAvailable, match="torch_npu is not installed"):
        accelerator.require_family("npu")
    with pytest.raises(DeviceNotAvailable, match="torch_npu"):
        accelerator.bind("npu")


def test_cpu_binding_and_sync():
    p = accelerator.bind("cpu")
    assert p.device == torch.device("cpu") and p.backend == "gloo"
    accelerator.synchronize("cpu")  # torch.accelerator.synchronize would raise here


def test_diff_bench_prints_json_last_line():
    out = subprocess.run([sys.executable, "-m", "delta_sync.bench", "diff", "--total-gib", "0.02",
                          "--tensor-mib", "4", "--reps", "1"], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "diff" and result["changed_elements"] > 0
    assert result["diff_over_copy"] > 0 and result["torch_ops_over_copy"] > 0
    assert result["kernel"] == "native"


@pytest.mark.parametrize("path", ["host kernels", "torch ops"])
def test_tensors_bench_prints_json_last_line(path):
    out = subprocess.run([sys.executable, "-m", "delta_sync.bench", "tensors", "--tensors", "40", "--elements", "4096",
                          "--density", "0.01", "--reps", "1", *(["--torch-path"] if path == "torch ops" else [])],
                         check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "tensors" and result["tensors"] == 40 and result["delta_ms_per_tensor"] > 0
    assert result["stages_s"]["diff_s"] > 0 and result["batched_over_one_by_one"] > 0 and result["path"] == path


def test_e2e_bench_counts_busy_cores():
    """The e2e bench's core accounting: a thread spinning for 0.3 s on this host keeps at least
    one of its cores busy meanwhile (busy >= 1 / cores, up to noise; other processes only add),
    and the shares are those of the ticks between two readings. (An idle wait is not compared:
    host-wide, any other process may fill it.)"""
    import time

    from benchmarks.e2e import cpu_share, cpu_times

    cores = os.cpu_count() or 1
    c0, t0 = cpu_times(), time.perf_counter()
    while time.perf_counter() - t0 < 0.3:
        pass
    spun = cpu_share(c0, cpu_times())
    assert 0.8 / cores <= spun["busy"] <= 1.0 and 0.0 <= spun["stolen"] <= 1.0
    # (busy, stolen, total) ticks: 30 of 200 busy and 10 stolen between the readings
    assert cpu_share((100, 5, 1000), (130, 15, 1200)) == {"busy": 0.15, "stolen": 0.05}
    assert cpu_share((7, 0, 50), (7, 0, 50)) == {"busy": 0.0, "stolen": 0.0}  # no tick in between


def test_e2e_bench_counts_a_deltas_stall_from_its_receive_call_and_its_pause():
    """``delta_stall_s``: the headline delta's worker receive call (vLLM's engine core waits in it,
    no step runs) plus its pause window, of the best run; None where the worker said no time."""
    from benchmarks.e2e import _pass_summary

    def row(label, kind, total, pause, call=None, density=None):
        return {"label": label, "kind": kind, "density": density, "total_s": total, "pause_window_s": pause,
                "changed_fraction": density or 1.0, "timings": {}, "cpu": {"busy": 0.5},
                "engine_timings": {} if call is None else {"update_call_s": call}}
    rows = [row("seed", "seed", 1.0, 0.9), row("delta 0.002", "delta", 0.12, 0.010, 0.021, 0.002),
            row("delta 0.002 #2", "delta", 0.10, 0.008, 0.019, 0.002),
            row("flat delta 0.002", "delta", 0.07, 0.007)]
    s = _pass_summary(rows, wire_s=0.5)
    assert s["delta_stall_s"] == 0.027 and s["delta_s"] == {"0.002": 0.10}
    assert s["flat_delta_stall_s"] is None


def test_skeleton_bench_fits_the_cost_per_tensor_and_counts_ops():
    """``bench skeleton`` on 1 and 2 layers of the Qwen3-30B-A3B skeleton (393 and 786 tensors),
    torch-op path: the pipeline is exact (or it raises), each delta's ops are counted on both ends
    and grow with the tensor count, and the fit projects the full model's 18,867 tensors."""
    out = subprocess.run([sys.executable, "-m", "delta_sync.bench", "skeleton", "--layers", "1,2", "--torch-path"],
                         check=True, capture_output=True, text=True, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    runs = result["runs"]
    assert result["bench"] == "skeleton" and result["path"] == "torch ops" and [r["tensors"] for r in runs] == [396, 789]
    assert runs[1]["delta_sender_ops"] > runs[0]["delta_sender_ops"] > 0 and runs[0]["delta_receiver_ops"] > 0
    assert result["per_tensor"]["delta_sender_ops"] > 0 and "delta_total_s" in result["at_18867_tensors"]


def test_bench_commands_run_from_a_source_tree_not_installed(monkeypatch):
    """A device machine is given the checkout, not an installed package: ``python -m delta_sync.bench
    skeleton`` must find the in-tree benchmarks without entry points, the same ones pyproject declares."""
    import tomllib
    from pathlib import Path

    from delta_sync import bench

    declared = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert bench.IN_TREE == declared["project"]["entry-points"]["delta_sync.bench"]
    monkeypatch.setattr(bench, "entry_points", lambda group: [])
    cmds = bench._commands()
    from benchmarks import skeleton
    assert cmds["skeleton"].load() is skeleton.main and set(bench.IN_TREE) < set(cmds)
