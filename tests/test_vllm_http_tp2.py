"""The receiver behind vLLM's HTTP server with engine TP=2 (gloo), driven over HTTP only. One live
TP=2 server (the tiny MoE: its attention has the dense model's fused, TP-sliced q/k/v and o, plus
gate/up-fused experts) serves both tests; the dense model at TP=2 ran here too and was cut for time."""

from __future__ import annotations

import os

import pytest

from delta_sync.engines import HttpEngine
from delta_sync.sync import WeightSync

from .engine_helpers import (PROMPTS, Server, close_llm, complete, evolve, export, load_state, max_logprob_error,
                             prompt_ids, start_server, stop_server)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2_server():
    srv = Server("moe", "http-live.log")
    yield srv.start(tp=2)
    srv.stop()


def test_http_tp2_seed_and_deltas_equal_fresh_engine(tp2_server, tmp_path):
    """Live server (TP=2) after seed + 5 deltas == a fresh server (TP=2) on an independent export."""
    path, base = tp2_server.path, tp2_server.base
    engine = HttpEngine(base)
    assert len(engine.report()) == 2  # two TP workers answer collective_rpc
    tok_ids = prompt_ids(base)
    complete(base, tok_ids)  # prompts in the prefix cache before any update
    state = load_state(path)
    sync = WeightSync([engine], mode="delta", pause_mode="wait", verify_every=1)
    sync.update(state.items())
    for v in range(1, 6):
        evolve(state, v)
        rep = sync.update(state.items())
        assert rep.kind == "delta" and rep.verified and rep.changed_elements > 0
    reports = engine.report()
    assert [r["version"] for r in reports] == [5, 5] and {r["rank"] for r in reports} == {1, 2}
    live = complete(base, tok_ids)
    sync.close()
    proc, fresh_base = start_server(export(state, path, tmp_path / "patched"), "http-fresh.log")
    try:
        fresh = complete(fresh_base, tok_ids)
    finally:
        stop_server(proc)
    assert [r["token_ids"] for r in live] == [r["token_ids"] for r in fresh]
    assert max_logprob_error(live, fresh) == 0.0


def test_two_engines_share_one_channel(tp2_server):
    """Data parallel: an HTTP server (TP=2, workers at channel ranks 1-2) and an in-process engine
    (rank 3) receive every bucket of the same broadcast; both match the trainer's digests."""
    from vllm import LLM

    from .engine_runner import engine_kwargs, greedy

    path, base = tp2_server.path, tp2_server.base
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
        # the two engines share the secret; a call captured on one is refused by the other (its MAC
        # binds the engine it was signed for), and nothing is written
        captured = []
        invoke = http._invoke
        http._invoke = lambda what, request, *a: (captured.append(request), invoke(what, request, *a))[1]
        http.discard()
        http._invoke = invoke
        with pytest.raises(Exception, match=f"was signed for engine {http.identity()}, this is engine "
                                            f"{sync.engines[1].identity()}"):
            llm.collective_rpc("delta_sync_call", args=(captured[0],))
        assert http.identity() != sync.engines[1].identity()
        assert {r["version"] for r in http.report() + sync.engines[1].report()} == {2}
        sync.close()
    finally:
        if llm is not None:
            close_llm(llm)
