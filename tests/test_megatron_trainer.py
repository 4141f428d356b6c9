"""Megatron-core (via Megatron-Bridge) trainer side on real gloo ranks, CPU."""

from __future__ import annotations

import contextlib

import pytest
import torch

from delta_sync.checkpoints import build

from launchers.ranks import run_ranks

pytestmark = pytest.mark.slow

BATCH = torch.tensor([[1, 17, 45, 99, 130, 7, 250, 3, 60, 61], [1, 60, 61, 62, 200, 201, 9, 2, 17, 45]])


def _train_and_sync(rank, world, port, path, tp, steps, transport, pp=1, ep=1):
    """Train, and after every step sync through both trainer-side paths: the reference (diff of
    Bridge's full export) and the fast path (shard-local diff mapped with Bridge's conversions), each
    into its own memory receiver."""
    import argparse

    import torch.distributed as dist

    from launchers.megatron_trainer import MegatronTrainer
    from update_weight import add_update_weight_args, build_updater
    from update_weight.megatron_shard_delta import MegatronShardDelta
    from update_weight.megatron_source import BridgeExportSource

    from delta_sync.memory_receiver import MemoryReceiver

    from safetensors.torch import load_file

    trainer = MegatronTrainer.from_hf(path, tp=tp, pp=pp, ep=ep, lr=1e-4)
    sources = {"reference": BridgeExportSource(trainer.bridge, trainer.model),
               # (its one-pass seed packs the parameters of up to 8k elements, converts larger ones
               # then their probes)
               "fast": MegatronShardDelta(trainer.bridge, trainer.model, packed_max_elements=8192),
               # the fast path with no parameter's runs kept as a short host list (what a parameter of
               # many runs has): its digests go run by run or element by element; its map learned in a
               # probe pass before the seed's export, the other's in the export itself (one pass)
               "fast, per element": MegatronShardDelta(trainer.bridge, trainer.model, one_pass=False)}
    # the load itself is exact: before training, the export is the checkpoint (row-parallel
    # weights used to load wrong at TP>1 over gloo, silently)
    ckpt = load_file(f"{path}/model.safetensors")
    load_errors = [n for n, t in sources["reference"]
                   if not torch.equal(t.view(torch.int16), ckpt[n].view(torch.int16))]
    receivers = {k: MemoryReceiver() if rank == 0 else None for k in sources}
    def cli(transport):
        return ["--update-weight-transport", transport, "--update-weight-mode",
                "delta" if transport.startswith("sparse") else "full", "--update-weight-verify-every", "1"]
    args = add_update_weight_args(argparse.ArgumentParser()).parse_args(cli(transport))
    # the per-element path also moves in 64 KiB buckets: several ranks' deltas reach rank 0 in many
    # gather rounds, tensors split over TP ranks merged within theirs
    small = add_update_weight_args(argparse.ArgumentParser()).parse_args(
        [*cli(transport), "--update-weight-buffer-size", "64KiB"])
    updaters = {k: build_updater(small if k == "fast, per element" else args, [receivers[k]] if rank == 0 else [])
                for k in sources}
    kinds = {k: [] for k in sources}
    rounds = []
    for _ in range(steps):
        trainer.step(BATCH)
        for k, source in sources.items():
            rep = updaters[k].update_weights(source)
            kinds[k].append((rep.kind, rep.changed_elements, rep.total_elements))
            if k == "fast, per element" and rep.kind == "delta":
                rounds.append(rep.timings.get("gather_rounds", 1))
            if k == "fast, per element":
                for runs in source._runs or []:
                    runs.few = None
    fast_ready = sources["fast"].ready() and any(r.few is not None for r in sources["fast"]._runs)  # (digests)
    # the one-pass map and the probe pass's: the same runs on every rank
    maps = [(src._plan_names, [[x.tolist() for x in (r.local, r.length, r.seq, r.target)] for r in src._runs])
            for src in (sources["fast"], sources["fast, per element"])]
    same_map = bool(maps[0][1]) and maps[0] == maps[1] and all(sources["fast"].one_pass_split[:2])
    # an independent full export, consumed by every rank, compared on rank 0 bit for bit
    exported = list(BridgeExportSource(trainer.bridge, trainer.model))
    mismatched = {k: receivers[k].mismatched(exported) if rank == 0 else [] for k in sources}
    n_tensors = len(receivers["fast"].tensors) if rank == 0 else None
    for u in updaters.values():
        u.close()
    dist.barrier()
    fast = sources["fast"]
    owned = sorted({fast._plan_names[s] for r in fast._runs for s in r.seq.tolist()})
    return kinds, mismatched, n_tensors, load_errors, fast_ready, rounds, same_map, fast.one_pass_split, owned


@pytest.mark.parametrize("kind,world,tp,pp,ep,tensors", [
    ("moe-wide", 2, 1, 1, 2, 165),  # EP=2: each rank trains 12 of 24 experts
    ("dense", 4, 2, 2, 1, 24),  # TP=2 x PP=2: tied embedding split over the two stages
    ("moe-wide", 4, 2, 2, 2, 165),  # TP=2 x PP=2 x EP=2 (ETP=1): sequence parallel, as mcore requires
], ids=["moe-ep2", "dense-tp2pp2", "moe-tp2pp2ep2"])  # TP=2, PP=2 and MoE DP=2 alone ran here too (cut for time)
def test_trainer_reconstruction_equals_independent_export(kind, world, tp, pp, ep, tensors):
    """Seed + deltas from real training steps rebuild exactly the model, through the reference path
    and through the fast path (same changed elements per update, bit for bit)."""
    path = str(build(kind))
    results = run_ranks(_train_and_sync, world, path, tp, 3, "sparse_gloo", pp, ep, timeout=600)
    kinds, mismatched, n_tensors, load_errors, fast_ready, rounds, *_ = results[0]
    assert all(r[6] for r in results), "the one-pass map differs from the probe pass's (or took one way only)"
    # a MoE's experts are laid out as the first of their kind (layer and expert numbers aside); the
    # dense model's two layers sit on different stages, so each is its own kind
    assert all(bool(r[7][2]) == kind.startswith("moe") for r in results), [r[7] for r in results]
    if (tp, pp, ep) == (1, 1, 2):  # attention is replicated over the two EP ranks: each diffs a share of it
        attention = [{n for n in r[8] if ".self_attn." in n} for r in results]
        assert all(attention) and not attention[0] & attention[1], attention
    assert all(r[3] == [] for r in results)  # every rank loaded exactly
    assert rounds and min(rounds) > 1, rounds  # the small-bucket deltas were gathered in rounds
    assert all(r[4] for r in results), "the fast path did not switch on (see the log), or kept no short run list"
    assert [k for k, _, _ in kinds["reference"]] == ["seed", "delta", "delta"]
    assert all(0 < c < total for _, c, total in kinds["reference"][1:]), kinds
    assert kinds["fast"] == kinds["fast, per element"] == kinds["reference"]
    assert n_tensors == tensors and mismatched == {"reference": [], "fast": [], "fast, per element": []}
    assert all(r[0] == kinds for r in results)  # every rank reports the same updates


def test_layout_keys_leave_out_layer_and_expert_numbers_only():
    """Tasks share a layout key when only their layer or expert numbers differ (sequential or
    grouped experts, a fused mapping's names), never across mapping kinds, modules or shapes."""
    from types import SimpleNamespace

    import torch.nn as nn

    from update_weight.megatron_probes import layout_key

    class Mapping:
        def __init__(self, megatron_param, hf_param):
            self.megatron_param, self.hf_param = megatron_param, hf_param

    class Other(Mapping):
        pass

    def key(megatron, hf, shape=(4, 8), mapping=Mapping, module=nn.Linear):
        return layout_key(SimpleNamespace(mapping=mapping(megatron, hf), megatron_module=module(1, 1),
                                           param_weight=torch.empty(shape)))

    seq = key("decoder.layers.3.mlp.experts.local_experts.17.linear_fc1.weight",
              {"gate": "model.layers.3.mlp.experts.17.gate_proj.weight", "up": "model.layers.3.mlp.experts.17.up_proj.weight"})
    assert seq == key("decoder.layers.40.mlp.experts.local_experts.5.linear_fc1.weight",
                      {"gate": "model.layers.40.mlp.experts.5.gate_proj.weight", "up": "model.layers.40.mlp.experts.5.up_proj.weight"})
    grouped = key("decoder.layers.3.mlp.experts.linear_fc1.weight17", "model.layers.3.mlp.experts.17.down_proj.weight")
    assert grouped == key("decoder.layers.9.mlp.experts.linear_fc1.weight0", "model.layers.9.mlp.experts.0.down_proj.weight")
    plain = key("decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj.weight")
    assert plain != key("decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                        shape=(8, 4))
    assert plain != key("decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                        mapping=Other)
    assert plain != key("decoder.layers.3.self_attention.linear_proj.weight", "model.layers.3.self_attn.o_proj.weight",
                        module=nn.Embedding)
    assert plain != key("decoder.layers.3.mlp.linear_fc2.weight", "model.layers.3.mlp.down_proj.weight")
    assert key("decoder.layers.3.mlp.linear_fc1.weight", "model.layers.3.mlp.gate_up_proj.weight") != key(
        "decoder.layers.3.mlp.linear_fc2.weight", "model.layers.3.mlp.gate_up_proj.weight")


def _one_pass_refused(rank, world, port, path, tp, ep, suffix, change):
    """A seed whose one-pass export meets a changed conversion (of the task named ``...suffix``:
    ``"add"`` adds one, ``"flip"`` reverses its rows, a move), then the seed after it and a delta."""
    import torch.distributed as dist

    from delta_sync.errors import DeltaSyncError
    from delta_sync.memory_receiver import MemoryReceiver
    from launchers.megatron_trainer import MegatronTrainer
    from update_weight import build_updater
    from update_weight.args import UpdateWeightConfig
    from update_weight.megatron_shard_delta import MegatronShardDelta

    trainer = MegatronTrainer.from_hf(path, tp=tp, ep=ep, lr=1e-4)
    source = MegatronShardDelta(trainer.bridge, trainer.model)
    task = next(t for t in source.tasks() if t.global_param_name.endswith(suffix))
    real = task.mapping.megatron_to_hf

    def changed(weight, module):
        return {name: t + 1 if change == "add" else t.flip(0) for name, t in real(weight, module).items()}

    task.mapping.megatron_to_hf = changed
    receiver = MemoryReceiver() if rank == 0 else None
    updater = build_updater(UpdateWeightConfig.of("delta", bucket_bytes=64 << 20), [receiver] if rank == 0 else [])
    try:
        updater.update_weights(source)
        refused = None
    except DeltaSyncError as e:
        refused = str(e)
    engine_version = receiver.version if rank == 0 else None
    kinds, exact = [], []
    for step in range(2):  # the seed (values alone, the map from a probe pass), then a delta
        if step:
            trainer.step(BATCH)
        kinds.append(updater.update_weights(source).kind)
        exported = list(source)  # (collective: every rank exports)
        exact.append(receiver.mismatched(exported) if rank == 0 else [])
        fast = source.ready()
    updater.close()
    dist.barrier()
    return refused, engine_version, kinds, exact, fast


def test_one_pass_seed_with_a_computing_conversion_is_refused_then_the_next_seed_exports_alone():
    """The one-pass seed's values come out of a packed conversion: one that computes (here the final
    norm's mapping adds one) garbles them. Every rank refuses that seed alike, naming the tensor, and
    the engine never commits it; the next seed exports the values alone (the map in a probe pass, which
    then disagrees with the export: the fast path stays off) and every later update is exact."""
    results = run_ranks(_one_pass_refused, 2, str(build("dense")), 2, 1, "final_layernorm.weight", "add", timeout=600)
    for refused, _, kinds, _, fast in results:
        assert refused is not None and "seed refused" in refused, refused
        assert kinds == ["seed", "delta"] and not fast
    refused, engine_version, _, exact, _ = results[0]
    assert "model.norm.weight" in refused and engine_version is None, (refused, engine_version)
    assert exact == [[], []]


def test_one_pass_seed_refuses_a_task_that_moves_unlike_the_first_of_its_kind():
    """A one-pass seed learns the map of a task from the first task of its kind (mapping, names but
    for layer numbers, shapes) and converts its values alone. One whose conversion moves elements
    otherwise (layer 1's attention output, its rows reversed: a move, not a computation) cannot
    pass: its values disagree with the shard at the borrowed map, every rank refuses the seed and the
    engine never commits it; the next seed learns every task's own map in a probe pass, and the fast
    path serves exact deltas from it."""
    results = run_ranks(_one_pass_refused, 2, str(build("moe-wide")), 1, 2,
                        "decoder.layers.1.self_attention.linear_proj.weight", "flip", timeout=600)
    for refused, _, kinds, _, fast in results:
        assert refused is not None and "seed refused" in refused, refused
        assert kinds == ["seed", "delta"] and fast
    refused, engine_version, _, exact, _ = results[0]
    assert "model.layers.1.self_attn.o_proj.weight" in refused and engine_version is None, (refused, engine_version)
    assert exact == [[], []]


def _digests_both_ways(rank, world, port, path, ep):
    """The fast path's shard digests, run by run and element by element, against the export's."""
    import torch.distributed as dist

    import delta_sync.runs as runs_mod
    import update_weight.megatron_shard_delta as fast
    from delta_sync.digest import digest_tensor
    from delta_sync.memory_receiver import MemoryReceiver
    from launchers.megatron_trainer import MegatronTrainer
    from update_weight import build_updater
    from update_weight.args import UpdateWeightConfig
    from update_weight.megatron_source import BridgeExportSource

    trainer = MegatronTrainer.from_hf(path, ep=ep, lr=1e-4)
    source = fast.MegatronShardDelta(trainer.bridge, trainer.model)
    updater = build_updater(UpdateWeightConfig.of("delta", bucket_bytes=64 << 20),
                            [MemoryReceiver()] if rank == 0 else [])
    updater.update_weights(source)
    digests = {}
    few = [runs.few for runs in source._runs]
    assert any(f is not None for f in few)  # parameters of few runs digest those one by one
    for way, threshold, keep_few in (("few", runs_mod.LONG_RUNS, True), ("runs", 1, False), ("elements", 1 << 62, False)):
        runs_mod.LONG_RUNS = threshold
        for runs, f in zip(source._runs, few):
            runs.few = f if keep_few else None
        digests[way] = {n: d.hex() for n, d in source.local_digests().items()}
    exported = {n: digest_tensor(t).hex() for n, t in BridgeExportSource(trainer.bridge, trainer.model)}
    updater.close()
    dist.barrier()
    return digests, exported


def test_shard_digests_run_by_run_equal_element_by_element():
    """The drift sweep digests a parameter of few runs, or of long runs, run by run as contiguous
    ranges (the compiled kernel) and short ones element by element: each gives each EP rank's
    share, and the shares add up to the export's."""
    path = str(build("moe-wide"))
    (d0, exported), (d1, _) = run_ranks(_digests_both_ways, 2, path, 2, timeout=600)
    assert d0["few"] == d0["runs"] == d0["elements"] and d1["few"] == d1["runs"] == d1["elements"]
    from delta_sync.digest import Digest

    total = {n: (Digest.parse(d0["runs"].get(n, Digest().hex())) + Digest.parse(d1["runs"].get(n, Digest().hex()))).hex()
             for n in exported}
    assert total == exported


def _one_step_export(rank, world, port, path, tp, pp, ep, lr, out):
    from safetensors.torch import save_file

    from launchers.megatron_trainer import MegatronTrainer
    from update_weight.megatron_source import BridgeExportSource

    trainer = MegatronTrainer.from_hf(path, tp=tp, pp=pp, ep=ep, lr=lr)
    loss = trainer.step(BATCH)
    exported = {n: t.clone() for n, t in BridgeExportSource(trainer.bridge, trainer.model)}
    if rank == 0:  # through a file: tensors in a result queue die with the process that made them
        save_file(exported, out)
    return loss


# Largest fraction of a tensor's elements whose first Adam step may differ from one rank's. Dense: only
# near-zero grads whose sign flips under TP's bf16 summation order. MoE: a token whose top-k routing
# flips under that order trains other experts (seen: <= 18% of an expert, <= 5% of the rest). A missing
# sequence-parallel reduction of the norm and router grads made 27-33% of those differ.
_STEP_TOLERANCE = {"dense": (0.02, 0.02), "moe": (0.25, 0.10)}  # (experts, everything else)


@pytest.mark.parametrize("kind,tp,pp,ep", [("dense", 2, 2, 1), ("moe", 2, 2, 2)],
                         ids=["dense-tp2pp2", "moe-tp2pp2ep2"])
def test_parallel_step_matches_one_rank(kind, tp, pp, ep, tmp_path):
    """The hand-reduced gradients are right: with a large lr, Adam's first step moves every element
    by ~lr * sign(grad), so a missing or doubled reduction (SP norms, router, tied embedding across
    stages, q/k norms, experts) flips the step of a large part of a tensor."""
    from safetensors.torch import load_file

    path = str(build(kind))
    lr = 3e-2
    ref_loss = run_ranks(_one_step_export, 1, path, 1, 1, 1, lr, str(tmp_path / "ref.safetensors"),
                         timeout=300)[0]
    losses = run_ranks(_one_step_export, tp * pp, path, tp, pp, ep, lr, str(tmp_path / "got.safetensors"),
                       timeout=300)
    losses = [loss for loss in losses if loss == loss]  # NaN off the last stage
    assert losses and all(abs(loss - ref_loss) < 1e-2 * abs(ref_loss) for loss in losses), (losses, ref_loss)
    ref, got = load_file(tmp_path / "ref.safetensors"), load_file(tmp_path / "got.safetensors")
    assert got.keys() == ref.keys()
    start = load_file(f"{path}/model.safetensors")
    bad = {}
    for name, t in ref.items():
        moved = int((t.view(torch.int16) != start[name].view(torch.int16)).sum())
        differ = int((got[name].view(torch.int16) != t.view(torch.int16)).sum())
        limit = _STEP_TOLERANCE[kind][0 if ".experts." in name else 1]
        if differ > max(2, limit * t.numel()):
            bad[name] = (t.numel(), moved, differ)
    assert not bad, f"tensors whose step differs from one rank's (numel, moved, differ): {bad}"


@contextlib.contextmanager
def _nan_in_parameter(trainer, fragment: str):
    """A diverged step on the fast path: a live parameter holds a NaN until the attempt is over."""
    hit = [p for chunk in trainer.model for n, p in chunk.named_parameters() if fragment in n]
    saved = [p.detach().view(-1)[3].clone() for p in hit]
    with torch.no_grad():
        for p in hit:
            p.view(-1)[3] = float("nan")
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(hit, saved):
                p.view(-1)[3] = v


@contextlib.contextmanager
def _diff_fails_on(rank: int, bad_rank: int):
    """The shard diff of a non-sender rank raises (the fast path's counterpart of a failed conversion)
    while mapping its changes to checkpoint coordinates, after every shard snapshot of that rank
    advanced: the rollback must put them back for the next delta."""
    from update_weight import megatron_shard_delta

    from .test_sender_failures import ExportFailure

    if rank != bad_rank:
        yield
        return
    real = megatron_shard_delta.map_changes

    def broken(*args, **kwargs):
        raise ExportFailure(f"shard diff failed on rank {rank}")
    megatron_shard_delta.map_changes = broken
    try:
        yield
    finally:
        megatron_shard_delta.map_changes = real


def _failures_on_megatron(rank, world, port, path, fast):
    import argparse

    from launchers.megatron_trainer import MegatronTrainer
    from update_weight import add_update_weight_args, build_updater
    from update_weight.megatron_shard_delta import MegatronShardDelta
    from update_weight.megatron_source import BridgeExportSource

    from delta_sync.memory_receiver import MemoryReceiver
    from .test_sender_failures import Attempts, poisoned_on, receiver_rejects, sender_dies_mid_send, with_nan

    trainer = MegatronTrainer.from_hf(path, tp=2, pp=2, lr=1e-4)
    source = (MegatronShardDelta if fast else BridgeExportSource)(trainer.bridge, trainer.model)
    receiver = MemoryReceiver() if rank == 0 else None
    args = add_update_weight_args(argparse.ArgumentParser()).parse_args(
        ["--update-weight-transport", "sparse_gloo", "--update-weight-verify-every", "1"])
    updater = build_updater(args, [receiver] if rank == 0 else [])
    updater.sync._engines.timeout_s = 20
    attempt = Attempts(updater.update_weights)
    attempt("seed", source)
    trainer.step(BATCH)
    attempt("delta", source)
    trainer.step(BATCH)  # the next four updates all fail; the fifth carries this step
    if fast:
        with _nan_in_parameter(trainer, "final_layernorm"):
            attempt("nan before send", source)
        with _diff_fails_on(rank, 2):
            attempt("export failure", source, expect="rank 2")
    else:
        attempt("nan before send", with_nan(source, "model.layers.1.mlp.down_proj.weight"))
        # Bridge's export is collective: the failing rank must stay in step (a raise *inside* Bridge's
        # generator on one rank leaves the others in its collectives until the process-group timeout)
        attempt("export failure", poisoned_on(source, rank, 2, 5), expect="rank 2")
    with sender_dies_mid_send(rank, updater.sync):
        attempt("sender mid-send", source)
    with receiver_rejects(receiver):
        attempt("receiver failure", source)
    attempt("delta after failures", source)
    trainer.step(BATCH)
    attempt("delta", source)
    fast_used = fast and source.ready()
    fell_back = None
    if fast:  # a reseed whose shard snapshots (taken at commit) cannot be taken on rank 2
        updater.sync.request_seed()
        with _snapshots_fail_on(source, rank, 2):
            attempt("reseed, shard snapshots fail", source)
        # on every rank alike: the fast path is off, and as the reseed kept no plain snapshot (the
        # source expected to serve), the next update is a seed
        fell_back = [not source.ready(), updater.sync.needs_seed]
        trainer.step(BATCH)
        attempt("seed again: plain and shard snapshots", source)  # exact; its commit takes them again
        fell_back.append(source.ready())
        trainer.step(BATCH)
        attempt("delta on the fast path again", source)
        fell_back.append(source.ready() and not dict(updater.sync.store.snapshots()))  # the plain one let go
        # a reseed whose map check fails on rank 1 (a conversion that computes instead of moving):
        # the engines get the seed, the fast path turns off for good on every rank, and as the seed
        # kept no plain snapshot (the source expected to serve), the next update is a seed that
        # does; the deltas after it take the reference export
        updater.sync.request_seed()
        with _map_disagrees_on(source, rank, 1):
            attempt("reseed, map disagrees", source)
        fell_back += [not source.ready(), updater.sync.needs_seed]
        trainer.step(BATCH)
        attempt("seed through the reference path", source)
        trainer.step(BATCH)
        attempt("delta on the reference export", source)
        fell_back += [not source.ready(), bool(dict(updater.sync.store.snapshots())) or rank != 0]
    exported = list(BridgeExportSource(trainer.bridge, trainer.model))  # independent export, every rank
    mismatched = receiver.mismatched(exported) if rank == 0 else []
    version = updater.sync.version
    updater.close()
    return attempt.log, mismatched, version, fast_used, fell_back


@contextlib.contextmanager
def _map_disagrees_on(source, rank: int, bad_rank: int):
    """``bad_rank``'s seed check finds exported tensors its shard map does not reproduce."""
    if rank != bad_rank:
        yield
        return
    source._matches = lambda name, tensor: False
    try:
        yield
    finally:
        del source._matches  # the class's check again


@contextlib.contextmanager
def _snapshots_fail_on(source, rank: int, bad_rank: int):
    """Taking the shard snapshots at a seed's commit fails on ``bad_rank`` (out of memory, say)."""
    class Unreadable:
        @property
        def param(self):
            raise MemoryError(f"no memory for the shard snapshots on rank {rank}")

    real = source.commit

    def failing_commit():
        runs, source._runs = source._runs, [Unreadable()]
        try:
            real()
        finally:
            source._runs = runs
    if rank == bad_rank:
        source.commit = failing_commit
    try:
        yield
    finally:
        source.commit = real


def _failures_both_paths(rank, world, port, path):
    return [_failures_on_megatron(rank, world, port, path, fast) for fast in (False, True)]  # one spawn


def test_failure_contract_on_four_megatron_ranks():
    """DESIGN.md's failure rows on a TP2xPP2 Megatron trainer, through the reference path and then
    the fast path: validation failure before send, export failure on a non-sender rank, sender
    failure mid-send, receiver failure; no rank hangs, every rank sees the same outcome, and the
    next update is exact against an independent export. On the fast path, a reseed whose shard
    snapshots (taken at commit, after the engines resumed) cannot be taken on one rank turns the
    fast path off on every rank; that reseed kept no plain snapshot either (the source expected to
    serve the deltas), so the next update is a seed: exact, and its commit takes the shard snapshots
    again, after which the plain snapshot is let go and deltas take the fast path. A reseed whose map
    check fails on one rank turns the fast path off for good: again the next update is a seed, and
    the deltas after it go through the reference export, exactly."""
    from .test_sender_failures import check_outcomes

    results = run_ranks(_failures_both_paths, 4, str(build("dense")), timeout=600)
    for i, fast in enumerate((False, True)):
        per_rank = [r[i] for r in results]
        log, mismatched, version, fast_used, fell_back = per_rank[0]
        check_outcomes(per_rank, 2)
        assert len(log) == (14 if fast else 8) and mismatched == [], (fast, log, mismatched)
        assert all(r[2] == version for r in per_rank)
        assert fast_used == fast
        assert all(r[4] == ([True] * 8 if fast else None) for r in per_rank)  # every rank fell back, and recovered
