"""``python -m delta_sync.bench sync``: one Megatron trainer, three ways to sync each training step.

A 54M-parameter Qwen3-MoE (``moe-bench``: 32 experts, experts ~93% of the weights, N(0, 0.02) as
real initialisations) is trained by real Megatron ranks over gloo (default 2 ranks, EP=2), Adam on
fp32 masters at lr 1e-6. After each step the same weights go out three ways, each through its
own channel into a memory receiver on trainer rank 0 (the engine-side apply is measured by
``bench apply``):

* ``full``: every tensor, Bridge export (the baseline every delta system is compared with);
* ``delta_reference``: bitwise diff of Bridge's full export against owner snapshots;
* ``delta_fast``: shard-local diff mapped to checkpoint coordinates (``MegatronShardDelta``).

Times are whole ``update_weights`` calls (export/diff, gather, pack, send, finish). Every
receiver is checked bit for bit against an independent export at the end. Last line: JSON with
``full_over_fast`` and ``reference_over_fast`` (medians over the steps).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from delta_sync.checkpoints import build

WAYS = ("full", "delta_reference", "delta_fast")


def _ranks(rank, world, port, path, tp, ep, steps, lr, seq):
    import torch.distributed as dist

    from megatron.core import parallel_state

    from update_weight import build_updater
    from update_weight.args import UpdateWeightConfig
    from update_weight.megatron_shard_delta import MegatronShardDelta
    from update_weight.megatron_source import BridgeExportSource

    from launchers.megatron_trainer import MegatronTrainer
    from delta_sync.memory_receiver import MemoryReceiver

    torch.set_num_threads(1)
    trainer = MegatronTrainer.from_hf(path, tp=tp, ep=ep, lr=lr)
    sources = {"full": BridgeExportSource(trainer.bridge, trainer.model),
               "delta_reference": BridgeExportSource(trainer.bridge, trainer.model),
               "delta_fast": MegatronShardDelta(trainer.bridge, trainer.model)}
    receivers = {w: MemoryReceiver() if rank == 0 else None for w in WAYS}
    updaters = {}
    for w in WAYS:
        mode = "full" if w == "full" else "delta"
        cfg = UpdateWeightConfig.of(mode)
        updaters[w] = build_updater(cfg, [receivers[w]] if rank == 0 else [])
    for w in WAYS:
        updaters[w].update_weights(sources[w])  # seeds
    g = torch.Generator().manual_seed(0)
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    rows = []
    for step in range(steps):
        ids = torch.randint(3, 384, (4, seq), generator=g)
        trainer.step(ids[dp_rank::dp])
        row = {"step": step}
        for w in WAYS:
            dist.barrier()
            rep = updaters[w].update_weights(sources[w])
            row[w] = rep.timings["total_s"]
            row[w + "_stages"] = {k: v for k, v in rep.timings.items() if k != "total_s"}
            row["changed_elements"], row["total_elements"] = rep.changed_elements, rep.total_elements
            row[w + "_payload"] = rep.payload_bytes
        rows.append(row)
    exported = list(BridgeExportSource(trainer.bridge, trainer.model))  # independent export, every rank
    bad = {w: receivers[w].mismatched(exported) if rank == 0 else [] for w in WAYS}
    fast_on = sources["delta_fast"].ready()
    for u in updaters.values():
        u.close()
    return rows, bad, fast_on


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench sync")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args(argv)
    from launchers.ranks import run_ranks

    path = str(build("moe-bench"))
    results = run_ranks(_ranks, args.ranks, path, args.tp, args.ep, args.steps, args.lr, args.seq, timeout=1800)
    rows, bad, fast_on = results[0]
    if any(bad.values()) or not all(r[2] for r in results):
        raise SystemExit(f"sync bench: receivers differ from the export {bad} or fast path off")
    for r in rows:
        print(f"step {r['step']}: changed {r['changed_elements']} ({100 * r['changed_elements'] / r['total_elements']:.3f}%)"
              + "".join(f" | {w} {r[w]:.3f} s" for w in WAYS), flush=True)
        for w in WAYS:
            print(f"    {w}: {r[w + '_stages']}", flush=True)
    med = {w: statistics.median(r[w] for r in rows) for w in WAYS}
    return {"bench": "sync", "model": "moe-bench (54M params, 32 experts)", "ranks": args.ranks, "tp": args.tp,
            "ep": args.ep, "steps": args.steps, "lr": args.lr,
            "changed_fraction": round(statistics.median(r["changed_elements"] / r["total_elements"] for r in rows), 5),
            "payload_bytes": {w: rows[-1][w + "_payload"] for w in WAYS},
            **{w + "_s": round(med[w], 4) for w in WAYS},
            "reference_over_fast": round(med["delta_reference"] / med["delta_fast"], 2),
            "full_over_fast": round(med["full"] / med["delta_fast"], 2)}
