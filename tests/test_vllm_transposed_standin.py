"""A real vLLM engine (CPU, TP=1, in process) whose MoE experts sit in vLLM-Ascend's post-load
layout: ``DELTA_SYNC_CPU_MOE_TRANSPOSED_STANDIN=1`` transposes ``w13``/``w2`` into new storage after
loading (a stand-in for the NPU engine's layout, named so) and runs the experts on it. Seeds and
deltas reach those weights through the same views and routes as on an NPU (strided runs), and the
live engine equals a fresh one loaded from an independent export, token for token and logprob for
logprob."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from delta_sync.checkpoints import build  # noqa: E402
from delta_sync.sync import WeightSync  # noqa: E402
from patches.engine_options import CPU_MOE_TRANSPOSED_ENV  # noqa: E402

from .engine_helpers import PROMPTS, close_llm, evolve, export, fresh_engine, load_state, max_logprob_error  # noqa: E402
from .engine_runner import engine_kwargs, greedy  # noqa: E402

pytestmark = pytest.mark.receiver  # both vLLM generations: their MoE experts are patched apart


def test_transposed_standin_engine_seed_and_deltas_equal_fresh_engine(monkeypatch, tmp_path):
    from vllm import LLM

    monkeypatch.setenv(CPU_MOE_TRANSPOSED_ENV, "1")  # the live engine and the fresh one alike
    path = build("moe")
    llm = LLM(model=str(path), **engine_kwargs())
    try:
        worker = llm.llm_engine.model_executor.driver_worker.worker
        moe = [m for m in worker.model_runner.model.modules() if "w13_weight" in m._parameters]
        assert moe
        for m in moe:  # transposed into new storage, as vLLM-Ascend leaves them
            w13, w2 = m.w13_weight, m.w2_weight
            assert w13.is_contiguous() and w2.is_contiguous()
            assert w13.shape[1] == w2.shape[2] and w13.shape[2] == 2 * w2.shape[1], (w13.shape, w2.shape)
        state = load_state(path)
        sync = WeightSync([llm], mode="delta", verify_every=1)
        seed = sync.update(state.items())
        assert seed.kind == "seed" and seed.verified
        receiver = worker._delta_sync_receiver
        assert receiver.last_timings["placed_ranges"] == 0  # (no range lands in transposed storage whole)
        for v in range(1, 4):
            evolve(state, v)
            rep = sync.update(state.items())
            assert rep.kind == "delta" and rep.verified and 0 < rep.changed_fraction < 1
        routes = receiver.routes
        experts = [i for i, n in enumerate(routes.catalog.names) if ".experts." in n]
        # every expert tensor routed by id (host kernel rows or torch ops), the strided ones as such
        assert experts and bool((routes.how[experts] >= 1).all()) and bool(routes.strided[experts].any())
        assert not receiver.fallback
        live = greedy(llm, PROMPTS)
        fresh = fresh_engine(export(state, path, tmp_path / "patched"))
        assert [r["token_ids"] for r in live] == [r["token_ids"] for r in fresh]
        assert live == fresh, f"max logprob error {max_logprob_error(live, fresh)}"
        sync.close()
    finally:
        close_llm(llm)
