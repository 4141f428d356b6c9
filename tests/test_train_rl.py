"""The main job end to end (RL loop + equivalence check) and the equivalence check's teeth."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from delta_sync.channel import free_port
from launchers import equivalence

from .engine_helpers import ROOT


def _run(tmp_path, *argv):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "launchers.train_rl", "--out", str(out), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    return proc, out


@pytest.mark.slow
def test_main_job_is_exact(tmp_path):
    # the NPU script's layout (its transport is sparse_hccl), seed + 2 deltas (the job's default is 3
    # steps). A DP=2 run ran here too, ~100 s more: cut for time, the torchrun test below trains at DP=2
    argv = ["--trainer-ranks", "4", "--tp", "2", "--pp", "2", "--ep", "2", "--steps", "2",
            "--update-weight-mode", "delta", "--update-weight-transport", "sparse_gloo"]
    proc, out = _run(tmp_path, *argv)
    _check_exact(proc, out, argv)
    # its own output only: upstream warnings are counted in one line, not shown
    for noise in ("Warning:", "warnings.warn", "Transformer Engine", "is deprecated", " > number of parameters",
                  "Loading from"):
        assert noise not in proc.stdout + proc.stderr.replace("without Transformer Engine", ""), noise
    assert "step | mode | ver" in proc.stdout
    assert "upstream: " in proc.stderr and "warnings from installed packages hidden" in proc.stderr


def _check_exact(proc, out, argv):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EQUAL:" in proc.stdout
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["equal"] and all(comparison["fields"].values()) and comparison["max_abs_logprob_error"] == 0
    for name in ("baseline.json", "sparse-inference.json", "checkpoint-inference.json"):
        assert (out / name).exists()
    updates = comparison["updates"]
    assert updates[0]["kind"] == "seed"
    later = updates[1:]
    assert len(later) >= 2 and all(u["changed_elements"] > 0 for u in later)
    if "full" in argv:
        assert all(u["kind"] == "full" and u["changed_fraction"] == 1.0 for u in later)
    else:  # sparse per-step changes, as in real RL runs (0.1-3%)
        assert all(u["kind"] == "delta" and 0 < u["changed_fraction"] < 0.05 for u in later), later


@pytest.mark.slow
def test_two_torchrun_nodes_sync_one_engine_exactly(tmp_path, dense_server):
    """Two torchrun agents on this host as two "nodes" (2 ranks each, rendezvous over loopback) train
    the dense model at TP=2 x DP=2 and sync deltas into one engine they did not start. Exactness:
    at every version the engine's digests, read back from every parameter through its loader
    views, equal the trainer's snapshots (``--update-weight-verify-every 1``; a fresh engine
    would cost another server start, and the run above compares against one)."""
    url = dense_server.base
    out = tmp_path / "run"
    argv = ["--tiny", "dense", "--tp", "2", "--steps", "2", "--engine-url", url, "--out", str(out), "--no-check",
            "--update-weight-mode", "delta", "--update-weight-transport", "sparse_gloo",
            "--update-weight-verify-every", "1"]
    master = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "2", "--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port",
                               str(master), "-m", "launchers.train_rl", *argv], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for n in (0, 1)]
    results = [p.communicate(timeout=900) for p in nodes]
    for n, (p, (stdout, stderr)) in enumerate(zip(nodes, results)):
        assert p.returncode == 0, f"node {n}: " + stdout[-2000:] + stderr[-3000:]
    assert "trainer rank 3/4 on cpu via gloo" in results[1][1]  # node 1 held ranks 2 and 3
    rows = json.loads((out / "updates.json").read_text())
    assert [r["kind"] for r in rows] == ["seed", "delta", "delta"]
    assert all(r["verified"] for r in rows) and all(r["changed_elements"] > 0 for r in rows)


def test_only_torchrun_makes_a_process_one_rank(monkeypatch):
    """vLLM's CPU platform sets LOCAL_WORLD_SIZE in its process (an in-process engine in a test):
    a launcher started from there is not a torchrun worker."""
    from launchers.train_rl import torchrun_env

    for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert torchrun_env() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert torchrun_env() == (3, 4, 1)


def test_layout_is_checked_at_start():
    from launchers.train_rl import check_layout

    assert check_layout(4, 2, 2, 2) is None and check_layout(2, 1, 1, 1) is None and check_layout(8, 2, 2, 4) is None
    assert "multiple of --tp 2 x --pp 2" in check_layout(6, 2, 2, 1)
    assert "--ep 4 must divide TP x DP = 2" in check_layout(4, 2, 2, 4)
    assert ">= 1" in check_layout(4, 0, 1, 1)


def _npu_script_train_argv() -> list[str]:
    """The train_rl command line of the production NPU script, shell variables filled in."""
    import shlex

    text = (ROOT / "launchers" / "run-qwen3-30B-A3B-npu.sh").read_text()
    start = text.index("python -m launchers.train_rl")
    lines = []
    for line in text[start:].splitlines():
        lines.append(line.rstrip("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    env = {"MODEL": "/ckpt/Qwen3-30B-A3B", "ENGINE_URL": "http://10.0.0.2:8000", "RENDEZVOUS_HOST": "10.0.0.1",
           "RENDEZVOUS_PORT": "29600", "root": "/repo", "OUT": "/repo/runs/qwen3-30b-a3b"}
    cmd = " ".join(lines)
    for k, v in env.items():
        cmd = cmd.replace("${" + k + "}", v).replace("$" + k, v)
    argv = [a for a in shlex.split(cmd) if a != '"$@"' and a != "$@"]
    assert argv[:3] == ["python", "-m", "launchers.train_rl"]
    return argv[3:]


def test_npu_script_flags_exist_and_fail_here_only_for_want_of_npus():
    """Every flag of launchers/run-qwen3-30B-A3B-npu.sh parses; its layout is valid; on this machine it
    stops at the transport check, before any work, with the message that says what to use."""
    from launchers.train_rl import check_layout, parse_args
    from update_weight.args import resolve_update_weight_args

    args = parse_args(_npu_script_train_argv())
    assert (args.trainer_ranks, args.tp, args.pp, args.ep) == (4, 2, 2, 2)
    assert check_layout(args.trainer_ranks, args.tp, args.pp, args.ep) is None
    assert args.trainer_device == "npu" and args.engine_url == "http://10.0.0.2:8000"
    assert (args.update_weight_mode, args.update_weight_transport) == ("delta", "sparse_hccl")
    assert (args.update_weight_master_addr, args.update_weight_master_port) == ("10.0.0.1", 29600)
    assert args.master_device == "cpu" and args.equivalence == "record"  # host masters; check on the engine's cards
    from launchers.equivalence import main as equivalence_main
    with pytest.raises(SystemExit, match="2"):  # the script's second half: --phase fresh needs --fresh
        equivalence_main(["--phase", "fresh"])
    with pytest.raises(SystemExit, match="sparse_hccl needs NPU devices.*use sparse_gloo"):
        resolve_update_weight_args(args)
    # the engine half: delta-sync switched on for the released vLLM-Ascend, ND weights, one writer
    import re

    text = (ROOT / "launchers" / "run-qwen3-30B-A3B-npu.sh").read_text()
    engine_cfg = json.loads(re.search(r"--additional-config '([^']*)'", text).group(1))
    assert engine_cfg["delta_sync"] is True and engine_cfg["weight_nz_mode"] == 0
    assert not [ln for ln in text.splitlines() if ln.strip().startswith("--weight-transfer-config")]


def test_sparse_hccl_without_npus_fails_at_start(tmp_path):
    proc, _ = _run(tmp_path, "--update-weight-transport", "sparse_hccl")
    assert proc.returncode != 0
    assert "sparse_hccl needs NPU devices" in proc.stderr and "use sparse_gloo" in proc.stderr


def test_compare_refuses_missing_or_non_finite_logprobs():
    a = [{"prompt_token_ids": [1], "token_ids": [5, 6], "logprobs": [-1.0, float("nan")]}]
    b = [{"prompt_token_ids": [1], "token_ids": [5, 6], "logprobs": [-1.0, float("nan")]}]
    assert not equivalence.compare(a, b)["equal"]
    c = [{"prompt_token_ids": [1], "token_ids": [5, 6], "logprobs": None}]
    assert not equivalence.compare(c, c)["equal"]
    ok = [{"prompt_token_ids": [1], "token_ids": [5, 6], "logprobs": [-1.0, -2.0]}]
    assert equivalence.compare(ok, [dict(ok[0])])["equal"]
    off = [{"prompt_token_ids": [1], "token_ids": [5, 7], "logprobs": [-1.0, -2.0]}]
    diff = equivalence.compare(ok, off)
    assert not diff["equal"] and diff["first_difference"]["position"] == 1


def test_a_trainer_waiting_for_an_engine_that_died_fails_at_once(tmp_path):
    """The main job's trainers build their model while the engine starts and rank 0 waits for it by
    pid: an engine that exits meanwhile fails that wait with its log named, not after the timeout."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # reaped, as the main job's watcher thread does
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"pid {dead.pid} is gone.*engine.log"):
        equivalence.wait_ready(dead.pid, f"http://127.0.0.1:{free_port()}", tmp_path / "engine.log", timeout=60)
    assert time.perf_counter() - t0 < 30
