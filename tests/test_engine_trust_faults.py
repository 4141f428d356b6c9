"""One real vLLM HTTP engine (checkpoint layout, TP1) against strangers, real process deaths and a
soak under live requests. The tests share the engine, in file order, as the same engine would live
through them in production: each leaves it serving exact weights (checked by digests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from delta_sync.auth import Signer
from delta_sync.channel import Channel, free_port
from delta_sync.engines import HttpEngine
from delta_sync.errors import ChannelError, EngineError
from delta_sync.sync import WeightSync
from benchmarks.e2e import tree_rss
from launchers import equivalence
from launchers.equivalence import kill_engine

from .engine_helpers import ROOT, complete, engine_differs_from, evolve, export, load_state, prompt_ids

pytestmark = pytest.mark.slow

LEASE_S = 4.0  # the shared engine's pause lease (tests/conftest.py)


@pytest.fixture
def server(dense_server):
    return dense_server


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _synced_to_v1(base: str, path):
    """A trainer that seeded the engine and sent v1; the engine's greedy outputs at v1."""
    state = load_state(path)
    sync = WeightSync([base])
    sync.update(state.items())
    evolve(state, 1)
    assert sync.update(state.items()).kind == "delta"
    ids = prompt_ids(base)
    return state, sync, ids, complete(base, ids)


@pytest.mark.receiver
def test_strangers_are_refused_and_the_trainer_keeps_its_channel(server):
    base = server.base
    state, sync, ids, before = _synced_to_v1(base, server.path)
    channel = sync.channel
    recorded = []
    trainer_invoke = sync.engines[0]._invoke
    sync.engines[0]._invoke = lambda what, req: (recorded.append(req), trainer_invoke(what, req))[1]
    sync.engines[0].report()
    sync.engines[0]._invoke = trainer_invoke

    stranger = HttpEngine(base, secret="a-stranger-guesses-wrong")
    with pytest.raises(EngineError, match="did not prove one identity with this secret"):
        stranger.identity()  # the engine's answer does not verify under the stranger's secret
    stranger._engine_id = sync.engines[0].identity()  # but the identity itself is no secret
    init = {"host": "127.0.0.1", "port": free_port(), "world_size": 2, "rank_offset": 1,
            "channel_nonce": "n", "timeout_s": 5}
    refusals = {}
    for what, call in [("init", lambda: stranger.init(init)), ("start", stranger.start),
                       ("update", lambda: stranger.update({"version": 9})), ("finish", lambda: stranger.finish(9)),
                       ("discard", stranger.discard), ("report", lambda: stranger.report(digests=True))]:
        with pytest.raises(EngineError) as e:
            call()
        refusals[what] = str(e.value)
    assert all("does not match this engine's secret" in m for m in refusals.values()), refusals
    # vLLM's own routes reach the same lifecycle without a proof: refused before any state changes
    for route, body in [("/init_weight_transfer_engine", {"init_info": init}),
                        ("/start_weight_update", {}), ("/update_weights", {"update_info": {}}),
                        ("/finish_weight_update", {})]:
        status, text = _post(base + route, body)
        assert status >= 400, (route, text)  # refused; that nothing changed is checked below
    status, text = _post(base + "/collective_rpc", {"method": "delta_sync_call", "args": [recorded[0]]})
    assert status >= 400, "a replayed call was accepted"
    status, text = _post(base + "/collective_rpc", {"method": "delta_sync_call",
                                                    "args": [json.dumps({"method": "report", "payload": {}})]})
    assert status >= 400
    forged = Signer(b"x" * 32).sign("discard")
    assert _post(base + "/collective_rpc", {"method": "delta_sync_call", "args": [json.dumps(forged)]})[0] >= 400

    assert complete(base, ids) == before and engine_differs_from(base, state) == []
    evolve(state, 2)
    rep = sync.update(state.items())  # same channel, same session: nothing a stranger did stuck
    assert rep.kind == "delta" and sync.channel is channel
    sync.verify()
    sync.close()


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _paused(base: str) -> bool:
    return bool(_get_json(base + "/is_paused")["is_paused"])


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text


@pytest.mark.receiver
def test_every_route_that_writes_pauses_or_sleeps_is_signed_or_refused(server):
    """A stranger on the engine's network, without the secret: vLLM's worker methods through
    /collective_rpc (reload_weights, sleep, ...), /sleep, /wake_up, /pause, /resume and vLLM's own
    weight-transfer routes are refused by the API server (401 / 403, with what to do), nothing
    behind them runs, and the trainer's next delta is exact."""
    base = server.base
    state, sync, ids, before = _synced_to_v1(base, server.path)
    got = {}
    for method in ("reload_weights", "load_model", "sleep", "wake_up", "update_config", "init_weight_transfer_engine"):
        got[f"rpc {method}"] = _post(base + "/collective_rpc", {"method": method, "args": []})
    for route in ("/sleep", "/wake_up", "/pause", "/resume", "/init_weight_transfer_engine", "/start_weight_update",
                  "/update_weights", "/finish_weight_update", "/update_weight_version"):
        got[route] = _post(base + route, {})
    forged = Signer(b"x" * 32).sign_route("/pause")  # signed, but not with this engine's secret
    req = urllib.request.Request(base + "/pause", data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json", "X-Delta-Sync-Call": forged})
    try:
        urllib.request.urlopen(req, timeout=30)
        got["forged /pause"] = (200, "")
    except urllib.error.HTTPError as e:
        got["forged /pause"] = (e.code, e.read().decode())
    for what, (status, text) in got.items():
        message = _message(text)
        if what.startswith("rpc "):
            assert status == 403 and "refused on a delta-sync engine" in message and "DELTA_SYNC_RPC_ALLOW" in message, \
                (what, status, text)
        elif what in ("/sleep", "/wake_up", "/pause", "/resume"):
            assert status == 401 and "needs the trainer's signature" in message, (what, status, text)
        elif what == "forged /pause":
            assert status == 401 and "does not match this engine's secret" in message, (what, status, text)
        else:
            assert status == 403 and "change only through the trainer's signed delta_sync_call" in message, \
                (what, status, text)
    assert not _paused(base)
    assert complete(base, ids) == before and engine_differs_from(base, state) == []
    assert _post(base + "/collective_rpc", {"method": "delta_sync_status"})[0] == 200  # read-only, open
    evolve(state, 2)
    assert sync.update(state.items()).kind == "delta"  # pause / resume signed by the trainer still work
    sync.verify()
    sync.close()


@pytest.mark.receiver
def test_a_seed_cut_off_mid_write_stays_paused_past_the_lease_and_refuses_a_strangers_resume(server):
    """A trainer SIGKILLed while its seed writes in place: the engine holds half-written weights,
    so it stays paused past the lease, an unsigned /resume is refused (401), and it serves again only
    after the next trainer's seed, exactly."""
    base = server.base
    proc = subprocess.Popen([sys.executable, "-m", "tests.fault_trainer", base, str(server.path), "seed"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -9 and "KILL seed" in out, out[-3000:]
    time.sleep(LEASE_S + 2)
    assert _paused(base)
    status = HttpEngine(base).report()
    assert all(s["partial"] and s["needs_seed"] for s in status), status
    code, text = _post(base + "/resume", {})
    assert code == 401 and "needs the trainer's signature" in _message(text), (code, text)
    assert _paused(base)
    state = load_state(server.path)
    evolve(state, 4)
    sync = WeightSync([base])
    assert sync.update(state.items()).kind == "seed"
    assert not _paused(base) and engine_differs_from(base, state) == []
    assert all(o["token_ids"] for o in complete(base, prompt_ids(base)))
    sync.close()


@pytest.mark.receiver
@pytest.mark.parametrize("where", ["send", "finish"])
def test_trainer_sigkilled_mid_update_engine_serves_previous_version(server, where):
    """``send``: killed while the workers receive a staged delta (the engine still serves);
    ``finish``: killed while the engine is paused with v2 staged. Either way the workers give up
    (the channel's peer is gone), keep v1 bit for bit, and serve: the pause lease resumes a paused
    engine within LEASE_S. A new trainer then takes over (its first update is a seed)."""
    base = server.base
    proc = subprocess.Popen([sys.executable, "-m", "tests.fault_trainer", base, str(server.path), where],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == -9 and f"KILL {where}" in out, out[-3000:]
    t_kill = time.monotonic()
    state = load_state(server.path)
    evolve(state, 1)
    ids = prompt_ids(base)
    outs = complete(base, ids)  # served: by the lease for `finish` (the trainer had paused it)
    served_after = time.monotonic() - t_kill
    assert all(o["token_ids"] for o in outs)
    assert served_after < LEASE_S + 20, served_after
    reports = HttpEngine(base).report()
    assert all(r["version"] == 1 and not r["partial"] for r in reports), reports
    if where == "send":
        assert reports[0]["last_error"], "the worker did not notice the dead sender"
    assert engine_differs_from(base, state) == []  # v1, bit for bit
    sync = WeightSync([base])  # the next trainer
    evolve(state, 3)
    assert sync.update(state.items()).kind == "seed"
    sync.verify()
    sync.close()


@pytest.mark.receiver
def test_the_engine_serves_requests_while_a_delta_arrives(server):
    """A delta's workers receive, check and plan it on a thread of their own: with the sender held
    after the delta's first bucket, a request is answered (by v1) before the rest of the delta
    leaves; the update then lands whole (the engine equals the trainer's v2). With the receive in
    the workers' ``update`` call, the request waited for the whole delta."""
    base = server.base
    state = load_state(server.path)
    sync = WeightSync([base], bucket_bytes=32 << 10)  # a delta of several buckets
    sync.update(state.items())
    evolve(state, 1)
    assert sync.update(state.items()).kind == "delta"
    ids = prompt_ids(base)
    v1 = complete(base, ids)
    held, release = threading.Event(), threading.Event()
    original = Channel.send_bucket

    def hold_after_first(self, bucket):
        original(self, bucket)
        if bucket.header.get("kind") == "delta" and bucket.header["seq"] == 0:
            held.set()
            assert release.wait(120), "the test never released the sender"
    evolve(state, 2)
    out: dict = {}

    def update():
        try:
            out["report"] = sync.update(state.items())
        except BaseException as e:  # noqa: BLE001 - asserted below
            out["error"] = e
    Channel.send_bucket = hold_after_first
    th = threading.Thread(target=update)
    try:
        th.start()
        assert held.wait(60), "the delta's first bucket never left"
        t0 = time.monotonic()
        during = complete(base, ids)
        answered_s = time.monotonic() - t0
        assert th.is_alive() and not release.is_set()  # answered while the delta was still arriving
    finally:
        release.set()
        th.join(120)
        Channel.send_bucket = original
    assert "error" not in out, out.get("error")
    rep = out["report"]
    assert rep.kind == "delta" and rep.buckets >= 2, rep
    assert during == v1, "a request served mid-delta saw other weights than v1"
    assert engine_differs_from(base, state) == []
    print(f"answered in {answered_s:.3f} s while the delta's buckets 1..{rep.buckets - 1} waited")
    sync.close()


@pytest.mark.receiver
def test_an_idle_engines_commit_is_one_engine_core_call_and_a_refused_one_stays_paused(server):
    """An idle engine's delta commits in one engine-core call (pause, finish, resume; the workers'
    finish says ``commit_in_core``); with a request in flight it takes vLLM's pause, finish and
    resume, and the request completes. A commit the workers refuse (a version never staged)
    leaves the engine paused on its version, bit for bit, until the lease resumes it; the
    trainer's next delta is exact."""
    base = server.base
    state, sync, ids, v1 = _synced_to_v1(base, server.path)
    engine = sync.engines[0]
    assert engine.report()[0]["timings"].get("commit_in_core") == 1.0  # v1's commit, on an idle engine
    out: dict = {}

    def long_request():
        out["code"], out["text"] = _post(base + "/v1/completions", {
            "model": "m", "prompt": ids[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0})
    th = threading.Thread(target=long_request)
    commit = engine.commit

    def commit_with_a_request_running(version, mode="wait"):  # the request runs when the commit comes
        th.start()
        deadline = time.monotonic() + 30
        while not _running_requests(base) and th.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        out["running"] = _running_requests(base)
        commit(version, mode)
    engine.commit = commit_with_a_request_running
    try:
        evolve(state, 2)
        assert sync.update(state.items()).kind == "delta"  # (a "wait" pause: the request ends first)
    finally:
        del engine.commit
        th.join(120)
    assert out["running"], "the long request was not running when the commit came"
    assert engine.report()[0]["timings"].get("commit_in_core") == 0.0, \
        "the commit ran in the engine core with a request in flight"
    assert out["code"] == 200 and len(json.loads(out["text"])["choices"][0]["text"]) > 0, out
    assert engine_differs_from(base, state) == []
    with pytest.raises(EngineError, match="finish"):
        engine.commit(99)  # nothing started, nothing staged: the workers refuse it
    assert _paused(base), "a refused commit resumed the engine"
    assert engine.report()[0]["timings"].get("commit_in_core") == 1.0
    assert engine_differs_from(base, state) == []
    deadline = time.monotonic() + LEASE_S + 20
    while _paused(base) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _paused(base), "the lease did not resume an engine whose workers all hold v2"
    evolve(state, 3)
    assert sync.update(state.items()).kind == "delta"
    assert engine_differs_from(base, state) == []
    sync.verify()
    sync.close()


def _running_requests(base: str) -> float:
    """vLLM's ``vllm:num_requests_running`` gauge from ``/metrics``."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.receiver
def test_a_delta_refused_before_its_last_bucket_fails_the_sender_at_once(server):
    """A delta's bucket refused unread by the workers' background receive (its header's MAC does
    not hold: bytes changed in flight) leaves them out of step with a sender that goes on to wait
    for their acknowledgement. The worker closes its channel, so the sender's acknowledgement fails
    at once, not after the channel's timeout; the engine stays on v1, bit for bit, its worker names
    the MAC, and the trainer's next delta, on a new channel, is exact. (Before, the sender waited
    for the channel's timeout, 300 s by default.)"""
    from delta_sync.patch import Patch
    from delta_sync.transfer import send_update

    base = server.base
    state, sync, ids, v1 = _synced_to_v1(base, server.path)
    engine, chan, nxt = sync.engines[0], sync.channel, sync.version + 1
    name = next(n for n, t in state.items() if t.dim() == 2)
    t = state[name]
    forged = Patch(name, tuple(t.shape), t.dtype, torch.tensor([7], dtype=torch.int32),
                   torch.full((1,), 0.5, dtype=t.dtype))
    engine.start()
    engine.update({"version": nxt, "background": True})  # returns at once: the workers receive on a thread
    out: dict = {}

    def send():  # the forged bucket, then the wait for the workers' acknowledgement
        key, chan._key = chan._key, b"not the channel's key"  # (the header's MAC, as a forger computes it)
        try:
            send_update(chan, nxt, "delta", [forged], check=False)
        except Exception as e:  # noqa: BLE001 - asserted below
            out["error"] = e
            return
        finally:
            chan._key = key
        try:
            out["ok"] = chan.acknowledge(False)
        except Exception as e:  # noqa: BLE001 - asserted below
            out["error"] = e
    th = threading.Thread(target=send, daemon=True)
    t0 = time.monotonic()
    th.start()
    th.join(60)
    assert not th.is_alive(), "the sender still waits for the workers of a delta they refused"
    assert isinstance(out.get("error"), ChannelError), out  # (its send, or its wait for the acknowledgement)
    waited = time.monotonic() - t0
    with pytest.raises(EngineError, match="MAC"):
        engine.await_staged()
    engine.discard()
    assert engine_differs_from(base, state) == [] and complete(base, ids) == v1
    sync._engines.drop_channel()  # (what the trainer does when its acknowledgement fails)
    evolve(state, 2)
    assert sync.update(state.items()).kind == "delta"
    assert engine_differs_from(base, state) == []
    sync.verify()
    sync.close()
    print(f"the sender learned of the refused delta in {waited:.2f} s")


def test_soak_200_deltas_under_live_requests_then_engine_killed_and_restarted(server, tmp_path):
    """200 deltas while a client streams requests; then one element is corrupted on the engine
    only, the engine is SIGKILLed mid-update and restarted on an independent export of the soaked
    weights: the trainer keeps its snapshot, the fresh engine equals the soaked one and differs
    from the corrupted one (the fresh-checkpoint check's both verdicts), a call captured before the
    restart is refused after it, and the next update (signed for the new boot) seeds."""
    base = server.base
    state = load_state(server.path)
    sync = WeightSync([base])
    sync.update(state.items())
    ids = prompt_ids(base)
    done, errors, stop = [0], [], threading.Event()

    def client():
        body = {"model": "m", "prompt": ids[0], "max_tokens": 4, "temperature": 0}
        while not stop.is_set():
            status, text = _post(base + "/v1/completions", body)
            if status != 200:
                errors.append((status, text[:300]))
            else:
                done[0] += 1

    names = sorted(state)
    g = torch.Generator().manual_seed(11)
    rss, t0 = {}, time.monotonic()
    th = threading.Thread(target=client, daemon=True)
    th.start()
    try:
        for step in range(1, 201):
            for name in names[step % len(names)::17]:  # a few tensors, 64 elements each
                flat = state[name].view(-1)
                pos = torch.randint(0, flat.numel(), (64,), generator=g)
                flat[pos] = (flat[pos].float() + 0.01).to(flat.dtype)
            rep = sync.update(state.items())
            assert rep.kind == "delta" and rep.drift is None, rep
            if step in (20, 200):
                rss[step] = (tree_rss(server.proc.pid), tree_rss(os.getpid()))
    finally:
        stop.set()
        th.join(60)
    soak_s = time.monotonic() - t0
    engine_growth, trainer_growth = (rss[200][i] / rss[20][i] - 1 for i in (0, 1))
    print(f"soak: 200 deltas in {soak_s:.1f} s with {done[0]} requests served, {len(errors)} failed; "
          f"RSS growth after warm-up: engine {engine_growth:+.2%}, trainer {trainer_growth:+.2%}")
    assert errors == [] and done[0] >= 20
    assert engine_growth <= 0.05 and trainer_growth <= 0.05
    sync.verify()
    captured = []  # a call the trainer really sent, replayed to the engine after its restart below
    invoke = sync.engines[0]._invoke
    sync.engines[0]._invoke = lambda what, request, *a: (captured.append(request), invoke(what, request, *a))[1]
    sync.engines[0].report()
    sync.engines[0]._invoke = invoke
    live = complete(base, ids)
    synced = {k: v.clone() for k, v in state.items()}
    # one element flipped on the engine only (the export below stays true): the fresh-checkpoint
    # comparison must say DIFFERENT, and where
    state["model.norm.weight"].view(-1)[0] = -state["model.norm.weight"].view(-1)[0]
    sync.update(state.items())
    corrupted_live = complete(base, ids)

    # the engine dies mid-update (SIGKILL of its whole process tree after the first bucket left)
    original = Channel.send_bucket

    def send_then_kill(self, bucket):
        original(self, bucket)
        kill_engine(server.proc)
    Channel.send_bucket = send_then_kill
    snapshot_version = sync.version
    try:
        for t in state.values():
            t.view(-1)[:1000] += 1
        with pytest.raises(Exception):
            sync.update(state.items())
    finally:
        Channel.send_bucket = original
    # the trainer reports it, keeps its snapshot at the synced version, and will seed next
    assert sync.version == snapshot_version == sync.store.version and len(sync.store.snapshots()) == len(state)
    assert sync.needs_seed
    state = synced

    # restarted on an independent export of the soaked weights: equal to the soaked engine, and
    # different from the corrupted one, first at the first generated token that differs
    server.start(export(state, server.path, tmp_path / "export"))
    code, text = _post(base + "/collective_rpc", {"method": "delta_sync_call", "args": [captured[0]]})
    assert code == 401 and "was signed for engine" in _message(text), (code, text)  # a new boot, a new identity
    fresh = complete(base, ids)
    assert fresh == live
    bad = equivalence.compare(corrupted_live, fresh)
    assert not bad["equal"] and not bad["fields"]["logprobs"] and bad["first_difference"] is not None
    assert "first difference" in equivalence.verdict(bad)
    evolve(state, 5)
    rep = sync.update(state.items())
    assert rep.kind == "seed"  # the restarted engine has no version: only a seed repairs it
    sync.verify()
    sync.close()

