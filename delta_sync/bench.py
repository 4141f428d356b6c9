"""Benchmarks that print ratios measured in one run: ``python -m delta_sync.bench {diff,...}``.

``diff``: bitwise diff throughput (the pass a snapshot store runs, ``BitwiseDiff.advance_many`` over
the batch: it also advances the snapshots) against ``dst.copy_(src)`` on the same tensors. Bytes
counted the same way for both: copy reads N and writes N, diff reads 2N (snapshot and new), so
each side "moves" 2N bytes per pass. Last line: one JSON object with ``diff_over_copy`` (the path the
library uses here: the host kernel of :mod:`delta_sync.native` when it builds) and
``torch_ops_over_copy`` (the portable torch-op path, what a device snapshot runs).

``tensors``: what a delta costs per tensor (many small tensors, in process), and the batched
diff against one tensor at a time; ``--torch-path`` runs it without the host kernels, on the torch
ops that device tensors take.

Other subcommands (``apply``) are contributed by packages that know an engine, through the
``delta_sync.bench`` entry-point group, so this core module never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import EntryPoint, entry_points

import torch

from . import native
from .diff import BitwiseDiff, restore


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _diff_inputs(args) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], int]:
    """Old and new bf16 tensors ``args.density`` apart, copy targets, and how many elements differ."""
    g = torch.Generator().manual_seed(args.seed)
    per = int(args.tensor_mib * (1 << 20)) // 2
    count = max(1, round(args.total_gib * (1 << 30) / (per * 2)))
    olds, news, dsts = [], [], []
    changed = 0
    for _ in range(count):
        old = torch.randn(per, generator=g, dtype=torch.float32).to(torch.bfloat16)
        new = old.clone()
        k = int(per * args.density)
        pos = torch.randint(0, per, (k,), generator=g)
        new[pos] = (new[pos].float() * 1.01 + 1e-3).to(torch.bfloat16)
        changed += int((old.view(torch.int16) != new.view(torch.int16)).sum())
        olds.append(old), news.append(new), dsts.append(torch.empty_like(old))
    return olds, news, dsts, changed


def bench_diff(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench diff")
    ap.add_argument("--total-gib", type=float, default=1.0, help="bf16 bytes in all tensors")
    ap.add_argument("--tensor-mib", type=float, default=64.0, help="size of each tensor")
    ap.add_argument("--density", type=float, default=0.002, help="fraction of elements changed")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    olds, news, dsts, changed = _diff_inputs(args)
    count = len(news)
    total = sum(t.numel() * t.element_size() for t in news)
    differ = BitwiseDiff()
    portable = BitwiseDiff(use_native=False)

    def run_copy():
        for d, s in zip(dsts, news):
            d.copy_(s)

    produced = []

    def diff_with(d: BitwiseDiff):
        """What a snapshot store runs: one ``advance_many`` over the batch, the diff that advances
        each snapshot in its pass (a call per tensor would add a thread join per tensor)."""
        def run():
            produced.clear()
            found = d.advance_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))])
            produced.extend((o, *got) for o, got in zip(olds, found))
        return run

    def put_back():  # untimed: the snapshots go back to the old version for the next pass
        for o, p, old_bits in produced:
            restore(o, p.indices, old_bits)

    run_diff, run_portable = diff_with(differ), diff_with(portable)
    for fn in (run_copy, run_diff, put_back, run_portable, put_back):  # warm up allocations and page faults
        fn()
    t_copy = t_diff = t_portable = float("inf")
    for _ in range(args.reps):  # interleaved, so all see the same machine state
        t_copy = min(t_copy, _best(run_copy, 1))
        t_portable = min(t_portable, _best(run_portable, 1))
        put_back()
        t_diff = min(t_diff, _best(run_diff, 1))
        found = sum(p.count for _, p, _ in produced)
        put_back()
    if found != changed:
        raise SystemExit(f"diff found {found} changed elements, expected {changed}")
    copy_gbps = 2 * total / t_copy / 1e9
    diff_gbps = 2 * total / t_diff / 1e9
    return {"bench": "diff", "dtype": "bfloat16", "tensors": count, "total_bytes": total,
            "density": args.density, "changed_elements": changed, "threads": torch.get_num_threads(),
            "kernel": "native" if native.supports(news[0]) else "torch-ops",
            "diff_s": round(t_diff, 4), "copy_s": round(t_copy, 4),
            "diff_gbps": round(diff_gbps, 2), "copy_gbps": round(copy_gbps, 2),
            "diff_elements_per_s": round(changed / t_diff), "torch_ops_over_copy": round(t_copy / t_portable, 3),
            "diff_over_copy": round(diff_gbps / copy_gbps, 3)}


def bench_tensors(argv: list[str]) -> dict:
    """Per-tensor costs: deltas of many small tensors through :class:`WeightSync` to the in-memory
    receiver (this process), where bytes are few and the work per tensor is what shows. Also the
    snapshot store's diff alone, batched (what a delta runs) and one tensor at a time, same run."""
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench tensors")
    ap.add_argument("--tensors", type=int, default=4000)
    ap.add_argument("--elements", type=int, default=32768, help="bf16 elements per tensor (default 64 KiB)")
    ap.add_argument("--density", type=float, default=0.002)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--torch-path", action="store_true",
                    help="without the host kernels: the torch ops device tensors take, on the host")
    args = ap.parse_args(argv)
    if args.torch_path:
        os.environ["DELTA_SYNC_NATIVE_DIFF"] = "0"  # the kernel's own switch
        native.kernel.cache_clear()
    g = torch.Generator().manual_seed(0)
    state = {f"layers.{i}.w": torch.randn(args.elements, generator=g).to(torch.bfloat16) for i in range(args.tensors)}
    k = max(1, int(args.elements * args.density))

    def step():
        for t in state.values():
            t[torch.randint(0, args.elements, (k,), generator=g)] += 1

    best = _best_delta(state, step, args.reps)
    t_batch, t_one = _diff_batched_and_one_by_one(state, step, args.reps)
    n = args.tensors
    return {"bench": "tensors", "tensors": n, "elements": args.elements, "density": args.density,
            "path": "torch ops" if args.torch_path else "host kernels",
            "delta_s": best.timings["total_s"], "delta_ms_per_tensor": round(1e3 * best.timings["total_s"] / n, 4),
            "stages_s": best.timings, "diff_us_per_tensor": round(1e6 * t_batch / n, 1),
            "diff_one_by_one_us_per_tensor": round(1e6 * t_one / n, 1),
            "batched_over_one_by_one": round(t_batch / t_one, 3)}


def _best_delta(state: dict[str, torch.Tensor], step, reps: int):
    """The fastest of ``reps`` deltas (after a seed) through WeightSync to the in-memory receiver."""
    from .memory_receiver import MemoryReceiver
    from .sync import WeightSync

    sync = WeightSync([MemoryReceiver()], mode="delta", timeout_s=600)
    try:
        sync.update(state.items())
        best = None
        for _ in range(reps):
            step()
            rep = sync.update(state.items())
            if best is None or rep.timings["total_s"] < best.timings["total_s"]:
                best = rep
    finally:
        sync.close()
    return best


def _diff_batched_and_one_by_one(state: dict[str, torch.Tensor], step, reps: int) -> tuple[float, float]:
    """The snapshot store's diff of one step, batched (what a delta runs) and one tensor at a time."""
    from .snapshot import SnapshotStore

    store, items = SnapshotStore(), list(state.items())
    store.prepare_many(items)
    store.commit(0)
    step()

    def batched():
        store.prepare_many(items)
        store.rollback()

    def one_by_one():
        for name, t in items:
            store.prepare(name, t)
        store.rollback()

    t_batch = t_one = float("inf")
    for _ in range(reps):
        t_batch, t_one = min(t_batch, _best(batched, 1)), min(t_one, _best(one_by_one, 1))
    return t_batch, t_one


BUILTIN = {"diff": bench_diff, "tensors": bench_tensors}


#: the ``delta_sync.bench`` entry points that pyproject.toml declares, for a source tree run without
#: installing it (a device machine given the checkout): taken where no installed one has the name
IN_TREE = {"apply": "benchmarks.apply:main", "sync": "benchmarks.sync:main", "e2e": "benchmarks.e2e:main",
           "skeleton": "benchmarks.skeleton:main"}


def _commands() -> dict:
    cmds = dict(BUILTIN)
    for ep in entry_points(group="delta_sync.bench"):
        cmds.setdefault(ep.name, ep)
    for name, target in IN_TREE.items():
        cmds.setdefault(name, EntryPoint(name, target, "delta_sync.bench"))
    return cmds


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = _commands()
    if not argv or argv[0] not in cmds:
        raise SystemExit(f"usage: python -m delta_sync.bench {{{','.join(sorted(cmds))}}} [options]")
    cmd = cmds[argv[0]]
    fn = cmd if callable(cmd) and not hasattr(cmd, "load") else cmd.load()
    result = fn(argv[1:])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
