"""A small but real GRPO-style RL loop: vLLM rollouts -> verifiable reward -> policy gradient on a
Megatron model (Bridge-loaded) -> weight sync every step -> fresh-checkpoint equivalence check.

``python -m launchers.train_rl`` runs the embedded default on this machine: the tiny Qwen3-MoE
checkpoint, two trainer ranks over gloo (DP=2; experts at EP=1), one local vLLM server, delta
sync over ``sparse_gloo``, a few steps, then the equivalence check and its verdict. Choose the
sync with ``--update-weight-mode`` / ``--update-weight-transport`` / ``--update-weight-*``, the
trainer layout with ``--trainer-ranks`` / ``--tp`` / ``--pp`` / ``--ep`` (the rest is DP; experts
at ETP=1) and its devices with ``--trainer-device`` (rank r binds local device r).

Under ``torchrun`` (its ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` / ``MASTER_ADDR`` environment, any
number of nodes) each process is one trainer rank: it binds its device (``LOCAL_RANK``) before the
process group exists, passes it as ``device_id``, and syncs into ``--engine-url`` (required:
engines run on their own hosts); rank 0 writes the artifacts and runs the equivalence check.

Optimizer: Adam (lr 1e-6 by default, as in RL post-training) on fp32 master weights with bf16
model weights, as Megatron's mixed precision does; each step reports the changed fraction
(0.14-0.19% per step on the tiny MoE).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import sys
import threading
import time
from pathlib import Path

import torch

from delta_sync import accelerator
from delta_sync.channel import free_port
from update_weight import add_update_weight_args
from update_weight.args import resolve_update_weight_args

from . import equivalence
from delta_sync.checkpoints import build, save_like
from .ranks import RanksFailed, run_ranks

PROMPTS = ["one two three", "the quick brown fox", "alpha beta gamma", "def add(a, b):"]
COLUMNS = ("step", "mode", "ver", "changed", "changed%", "MiB", "diff_s", "send_s", "finish_s", "pause_s", "reward")


def reward_of(token_ids: list[int]) -> float:
    """Verifiable and deterministic: the fraction of generated tokens with an even id."""
    return sum(1 for t in token_ids if t % 2 == 0) / max(1, len(token_ids))


def group_advantages(rewards: list[float], group: int) -> list[float]:
    out = []
    for g in range(0, len(rewards), group):
        r = torch.tensor(rewards[g:g + group])
        out += ((r - r.mean()) / (r.std(unbiased=False) + 1e-6)).tolist()
    return out


def rollout(base: str, prompt_ids: list[list[int]], group: int, step: int, max_tokens: int) -> list[dict]:
    samples = []
    for i, ids in enumerate(prompt_ids):
        r = equivalence._post(base + "/v1/completions", {
            "model": "m", "prompt": ids, "n": group, "temperature": 1.0, "max_tokens": max_tokens,
            "seed": 1000 * step + i, "logprobs": 0, "return_token_ids": True})
        for c in r["choices"]:
            samples.append({"prompt": ids, "completion": c["token_ids"]})
    return samples


def pack(samples: list[dict], advantages: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and per-position loss weights (advantage on completion-token targets)."""
    length = max(len(s["prompt"]) + len(s["completion"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.long)
    weights = torch.zeros(len(samples), length)
    for k, (s, a) in enumerate(zip(samples, advantages)):
        seq = s["prompt"] + s["completion"]
        ids[k, :len(seq)] = torch.tensor(seq)
        p = len(s["prompt"])
        weights[k, p - 1:len(seq) - 1] = a  # position t predicts token t+1
    return ids, weights


def _row(step, rep, reward) -> str:
    t = rep.timings
    vals = (step, rep.kind, rep.version, rep.changed_elements, f"{100 * rep.changed_fraction:.3f}",
            f"{rep.payload_bytes / 2**20:.2f}", f"{t.get('diff_s', 0):.3f}", f"{t.get('send_s', 0):.3f}",
            f"{t.get('finish_s', 0):.3f}", f"{rep.pause_window_s:.3f}", "-" if reward is None else f"{reward:.3f}")
    return " | ".join(str(v).rjust(len(c)) for v, c in zip(vals, COLUMNS))


def _trainer(rank: int, world: int, master_port: int | None, opts: dict, local_rank: int | None = None) -> list[dict]:
    """One trainer rank: bind the device, then the process group (``master_port=None``: torchrun's
    environment rendezvous), then train and sync."""
    import datetime

    import torch.distributed as dist

    upstream = _quiet_upstream(rank)
    placement = accelerator.bind(opts["device"], local_rank=rank if local_rank is None else local_rank)
    opts = dict(opts, device=str(placement.device))
    init = "env://" if master_port is None else f"tcp://127.0.0.1:{master_port}"
    kwargs = {"device_id": placement.device} if placement.family != "cpu" else {}
    dist.init_process_group(placement.backend, init_method=init, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600), **kwargs)
    print(f"trainer rank {rank}/{world} on {placement.describe()}", file=sys.stderr, flush=True)
    try:
        return _train(rank, world, opts)
    finally:
        upstream()
        dist.destroy_process_group()


#: set to 1 to see the upstream warnings the main job hides (see :func:`_quiet_upstream`)
UPSTREAM_ENV = "DELTA_SYNC_UPSTREAM_WARNINGS"


def _quiet_upstream(rank: int):
    """Hides what installed packages warn about (Megatron's Transformer Engine / Apex fallbacks,
    torch and transformers deprecations, their log warnings) so the job's output is its own: the
    progress bar, the per-step table and the verdict. Returns a function that prints, from rank 0,
    one line saying how many were hidden. ``DELTA_SYNC_UPSTREAM_WARNINGS=1`` shows them all."""
    import collections
    import logging
    import os
    import sysconfig
    import warnings

    if os.environ.get(UPSTREAM_ENV) == "1":
        return lambda: None
    installed = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib")})
    hidden: collections.Counter = collections.Counter()
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(installed):
            hidden[category.__name__] += 1
            return
        show(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    logging.getLogger("megatron").setLevel(logging.ERROR)  # its WARNING logs: fallbacks and deprecations
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # transformers sets its level from this on import

    def summary() -> None:
        if rank == 0 and hidden:
            kinds = ", ".join(f"{n} {k}" for k, n in hidden.most_common())
            print(f"upstream: {sum(hidden.values())} warnings from installed packages hidden ({kinds}; Megatron "
                  f"runs without Transformer Engine / Apex here and falls back to torch); {UPSTREAM_ENV}=1 "
                  f"shows them", file=sys.stderr, flush=True)

    return summary


def torchrun_env() -> tuple[int, int, int] | None:
    """``(rank, world, local_rank)`` when this process was started by torchrun, else None."""
    import os

    # torchrun sets TORCHELASTIC_RUN_ID for its workers; other tools (vLLM among them) set
    # LOCAL_WORLD_SIZE or RANK in their own processes, which a child must not take for torchrun's
    if "TORCHELASTIC_RUN_ID" not in os.environ or "RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _train(rank: int, world: int, opts: dict) -> list[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from update_weight import build_updater
    from update_weight.args import UpdateWeightConfig
    from update_weight.megatron_shard_delta import MegatronShardDelta
    from update_weight.megatron_source import BridgeExportSource

    from .megatron_trainer import MegatronTrainer

    with contextlib.redirect_stdout(io.StringIO()):  # Bridge's load progress and Megatron's parameter count
        trainer = MegatronTrainer.from_hf(opts["model"], tp=opts["tp"], pp=opts["pp"], ep=opts["ep"], lr=opts["lr"],
                                          device=opts["device"], master_device=opts["master_device"])
    # deltas from local shard diffs mapped with Bridge's conversions (checked against the full
    # export at every seed; it falls back to the export by itself), or always through the export
    fast = opts["sync"]["options"]["mode"] == "delta" and not opts["reference_export"]
    source = (MegatronShardDelta if fast else BridgeExportSource)(trainer.bridge, trainer.model)
    if rank == 0 and opts["engine_pid"] is not None:  # the engine started beside the trainers' own start
        equivalence.wait_ready(opts["engine_pid"], opts["engine"], Path(opts["out"]) / "engine.log")
    updater = build_updater(UpdateWeightConfig.from_dict(opts["sync"]), [opts["engine"]] if rank == 0 else [])
    dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    prompt_ids = equivalence.tokenize(opts["engine"], PROMPTS) if rank == 0 else None
    rows, reward = [], None
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=opts["steps"] + 1, desc="rl", file=sys.stderr)
        print(" | ".join(COLUMNS), flush=True)
    for step in range(opts["steps"] + 1):
        rep = updater.update_weights(source)  # step 0: the seed; then one delta per training step
        if rank == 0:
            rows.append(dict(rep.as_dict(), step=step, reward=reward))
            print(_row(step, rep, reward), flush=True)
            bar.update(1)
        if step == opts["steps"]:
            break
        box = [None]
        if rank == 0:
            samples = rollout(opts["engine"], prompt_ids, opts["group"], step, opts["max_tokens"])
            rewards = [reward_of(s["completion"]) for s in samples]
            reward = sum(rewards) / len(rewards)
            box = [pack(samples, group_advantages(rewards, opts["group"]))]
        dist.broadcast_object_list(box, src=0)
        ids, weights = box[0]
        trainer.step(ids[dp_rank::dp], weights[dp_rank::dp])
    updater.close()
    if bar is not None:
        bar.close()
    # (1) an independent export: a complete Bridge conversion, no patches or snapshots involved
    exported = {name: t.clone() for name, t in BridgeExportSource(trainer.bridge, trainer.model)}
    if rank == 0:
        save_like(exported, opts["model"], opts["export"])
    dist.barrier()
    return rows


def _run_trainers(world: int, opts: dict, timeout: float) -> list[dict]:
    try:
        return run_ranks(_trainer, world, opts, timeout=timeout, init_world=False)[0]
    except RanksFailed as e:
        raise SystemExit(f"trainer ranks failed: {e}") from None


def check_layout(ranks: int, tp: int, pp: int, ep: int) -> str | None:
    """Why ``ranks`` trainer processes cannot hold TP x PP (x DP) with EP carved from TP x DP, or None."""
    if min(ranks, tp, pp, ep) < 1:
        return "--trainer-ranks, --tp, --pp and --ep must be >= 1"
    if ranks % (tp * pp):
        return f"--trainer-ranks {ranks} is not a multiple of --tp {tp} x --pp {pp}"
    if (ranks // pp) % ep:
        return (f"--ep {ep} must divide TP x DP = {ranks // pp} (experts at ETP=1 are spread over the "
                f"ranks of one pipeline stage)")
    return None


def _opts(args, model, device: str, engine: str, out: Path, cfg, engine_pid: int | None = None) -> dict:
    """What every trainer rank needs, as one picklable dict (spawned ranks and torchrun alike)."""
    return {"model": str(model), "tp": args.tp, "pp": args.pp, "ep": args.ep, "device": device, "lr": args.lr,
            "master_device": args.master_device, "steps": args.steps, "group": args.group_size,
            "max_tokens": args.max_tokens, "engine": engine, "engine_pid": engine_pid, "out": str(out),
            "export": str(out / "export"),
            "sync": dataclasses.asdict(cfg), "reference_export": args.reference_export}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m launchers.train_rl", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint dir (default: the tiny MoE built locally)")
    ap.add_argument("--tiny", choices=("moe", "dense"), default="moe", help="which built-in tiny checkpoint")
    ap.add_argument("--trainer-ranks", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="trainer tensor parallel size")
    ap.add_argument("--pp", type=int, default=1, help="trainer pipeline parallel size (the rest is DP)")
    ap.add_argument("--ep", type=int, default=1, help="trainer expert parallel size (within TP x DP, ETP=1)")
    ap.add_argument("--trainer-device", choices=("auto", "cpu", "cuda", "npu"), default="cpu",
                    help="device family of the trainer ranks (rank r binds local device r); auto: npu, "
                         "then cuda, then cpu")
    ap.add_argument("--equivalence", choices=("local", "record"), default="local",
                    help="local: after training, compare the synced engine with a fresh one started here on "
                         "the export; record: only record the synced engine's outputs (the caller compares on "
                         "the engine's own cards: launchers.equivalence --phase fresh)")
    ap.add_argument("--master-device", choices=("device", "cpu"), default="device",
                    help="where fp32 master weights and Adam state live: with the model, or in host memory "
                         "(the 30B-A3B NPU layout needs cpu: see launchers/run-qwen3-30B-A3B-npu.sh)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--engine-url", default=None, help="a running engine (VLLM_SERVER_DEV_MODE=1, backend "
                    "delta_sync); default: start one locally")
    ap.add_argument("--reference-export", action="store_true",
                    help="diff every delta on Bridge's full export (the reference path) instead of the "
                         "trainer's local shards")
    ap.add_argument("--out", default="runs/rl", help="artifacts: export/, *.json")
    ap.add_argument("--no-check", action="store_true", help="skip the equivalence check")
    ap.add_argument("--timeout", type=float, default=1800)
    add_update_weight_args(ap)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = resolve_update_weight_args(args)  # contradictions and missing devices fail here, before any work
    launched = torchrun_env()
    if launched is not None:
        return _main_torchrun(args, cfg, *launched)
    layout_error = check_layout(args.trainer_ranks, args.tp, args.pp, args.ep)
    if layout_error:
        raise SystemExit(layout_error)
    device = accelerator.detect_family() if args.trainer_device == "auto" else args.trainer_device
    if not accelerator.family_available(device):
        raise SystemExit(f"--trainer-device {device}: no {device} devices here (use --trainer-device cpu)")
    model = Path(args.model) if args.model else build(args.tiny)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"delta-sync RL: model {model}, trainer ranks {args.trainer_ranks} on {device} (TP={args.tp}, "
          f"PP={args.pp}, EP={args.ep}, DP={args.trainer_ranks // (args.tp * args.pp)}), "
          f"sync {cfg.mode}/{cfg.transport}, {args.steps} steps", flush=True)
    proc = None
    engine = args.engine_url
    if engine is None:
        port = free_port()
        engine = f"http://127.0.0.1:{port}"
        proc = equivalence.start_engine(model, port, out / "engine.log")
        # the trainers build their model while the engine starts; rank 0 waits for it by pid, and this
        # thread reaps the engine the moment it exits, so that wait sees an engine that died
        threading.Thread(target=proc.wait, daemon=True).start()
    try:
        opts = _opts(args, model, device, engine, out, cfg, engine_pid=proc.pid if proc is not None else None)
        t0 = time.perf_counter()
        rows = _run_trainers(args.trainer_ranks, opts, args.timeout)
        (out / "updates.json").write_text(json.dumps(rows, indent=1))
        print(f"trainers: {time.perf_counter() - t0:.1f} s (model build beside the engine's start, training, "
              f"sync)", flush=True)
        stop = (lambda: equivalence.stop_engine(proc)) if proc is not None else None
        return _check(args, engine, out, rows, stop)
    finally:
        if proc is not None and proc.poll() is None:
            equivalence.stop_engine(proc)


def _check(args, engine: str, out: Path, rows: list[dict], stop_synced=None) -> int:
    """The fresh-checkpoint check after training (rank 0), or only its first half (``--equivalence
    record``: the caller stops this engine and runs ``launchers.equivalence --phase fresh`` against a
    fresh engine started on the same cards with the same options)."""
    if args.no_check:
        return 0
    updates = [{k: r[k] for k in ("version", "kind", "changed_elements", "changed_fraction", "payload_bytes")}
               for r in rows]
    if args.equivalence == "record":
        equivalence.record_synced(engine, out, updates=updates)
        print(f"synced engine's outputs recorded in {out}; export in {out / 'export'}", flush=True)
        return 0
    result = equivalence.run_check(engine, out / "export", out, updates=updates, stop_synced=stop_synced)
    print(json.dumps(result, indent=1))
    print(equivalence.verdict(result), flush=True)
    return 0 if result["equal"] else 1


def _main_torchrun(args, cfg, rank: int, world: int, local_rank: int) -> int:
    """One rank of a torchrun job: every rank trains and syncs; rank 0 writes and checks."""
    layout_error = check_layout(world, args.tp, args.pp, args.ep)
    if layout_error:
        raise SystemExit(layout_error.replace("--trainer-ranks", "torchrun's world size"))
    if not args.engine_url:
        raise SystemExit("under torchrun, pass --engine-url (start the engine on its own host or cards)")
    device = accelerator.detect_family() if args.trainer_device == "auto" else args.trainer_device
    model = Path(args.model) if args.model else build(args.tiny)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = _opts(args, model, device, args.engine_url, out, cfg)
    rows = _trainer(rank, world, None, opts, local_rank=local_rank)
    if rank != 0:
        return 0
    (out / "updates.json").write_text(json.dumps(rows, indent=1))
    return _check(args, args.engine_url, out, rows)


if __name__ == "__main__":
    sys.exit(main())
