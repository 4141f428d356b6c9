"""The receiver behind vLLM's HTTP server with engine TP=2 (gloo), driven over HTTP only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from delta_sync.engines import HttpEngine
from delta_sync.sync import WeightSync

from .checkpoints import build
from .engine_helpers import PROMPTS, ROOT, evolve, export, load_state, max_logprob_error
from .engine_runner import MAX_TOKENS
from .multiproc import free_port

pytestmark = pytest.mark.slow


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _complete(base: str, prompt_ids: list[list[int]]) -> list[dict]:
    out = []
    for ids in prompt_ids:
        r = _post(base + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
                                             "logprobs": 0, "return_token_ids": True})
        c = r["choices"][0]
        out.append({"token_ids": c["token_ids"], "logprobs": c["logprobs"]["token_logprobs"]})
    return out


def _start_server(path, log_name: str):
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name", "m",
           "--port", str(port), "--host", "127.0.0.1", "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--tensor-parallel-size", "2",
           "--distributed-executor-backend", "mp", "--seed", "0", "--enable-prefix-caching",
           "--weight-transfer-config", json.dumps({"backend": "delta_sync"})]
    log = open(ROOT / ".cache" / log_name, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 420
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited rc={proc.returncode}; see .cache/{log_name}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return proc, base
        except Exception:
            time.sleep(2)
    proc.kill()
    raise AssertionError(f"server did not come up in 420 s; see .cache/{log_name}")


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_http_tp2_seed_and_deltas_equal_fresh_engine(kind, tmp_path):
    """Live server (TP=2) after seed + 5 deltas == a fresh server (TP=2) on an independent export."""
    path = build(kind)
    proc, base = _start_server(path, "http-live.log")
    try:
        engine = HttpEngine(base)
        assert len(engine.report()) == 2  # two TP workers answer collective_rpc
        tok_ids = [r["prompt_token_ids"] for r in _prompt_ids(base)]
        _complete(base, tok_ids)  # prompts in the prefix cache before any update
        state = load_state(path)
        sync = WeightSync([engine], mode="delta", pause_mode="wait", verify_every=1)
        sync.update(state.items())
        for v in range(1, 6):
            evolve(state, v)
            rep = sync.update(state.items())
            assert rep.kind == "delta" and rep.verified and rep.changed_elements > 0
        reports = engine.report()
        assert [r["version"] for r in reports] == [5, 5] and {r["rank"] for r in reports} == {1, 2}
        live = _complete(base, tok_ids)
        sync.close()
    finally:
        _stop(proc)
    proc, base = _start_server(export(state, path, tmp_path / "patched"), "http-fresh.log")
    try:
        fresh = _complete(base, tok_ids)
    finally:
        _stop(proc)
    assert [r["token_ids"] for r in live] == [r["token_ids"] for r in fresh]
    assert max_logprob_error(live, fresh) == 0.0


def _prompt_ids(base: str) -> list[dict]:
    out = []
    for p in PROMPTS:
        r = _post(base + "/tokenize", {"model": "m", "prompt": p})
        out.append({"prompt_token_ids": r["tokens"]})
    return out


def test_two_engines_share_one_channel():
    """Data parallel: an HTTP server (TP=2, workers at channel ranks 1-2) and an in-process engine
    (rank 3) receive every bucket of the same broadcast; both match the trainer's digests."""
    from vllm import LLM

    from .engine_runner import engine_kwargs, greedy

    path = build("dense")
    proc, base = _start_server(path, "http-dp.log")
    llm = None
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm = LLM(model=str(path), **engine_kwargs())
        http = HttpEngine(base)
        state = load_state(path)
        sync = WeightSync([http, llm], mode="delta", verify_every=1)
        sync.update(state.items())
        for v in range(1, 3):
            evolve(state, v)
            rep = sync.update(state.items())
            assert rep.verified and rep.changed_elements > 0
        ranks = sorted(r["rank"] for r in http.report()) + [r["rank"] for r in sync.engines[1].report()]
        assert ranks == [1, 2, 3]
        assert {r["version"] for r in http.report() + sync.engines[1].report()} == {2}
        assert greedy(llm, PROMPTS)  # still serving
        sync.close()
    finally:
        _stop(proc)
        if llm is not None:
            import gc

            from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

            del llm
            gc.collect()
            destroy_model_parallel()
            destroy_distributed_environment()
