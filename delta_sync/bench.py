"""Benchmarks that print ratios measured in one run: ``python -m delta_sync.bench {diff,...}``.

``diff``: bitwise diff throughput against ``dst.copy_(src)`` on the same tensors. Bytes counted
the same way for both: copy reads N and writes N, diff reads 2N (snapshot and new), so each
side "moves" 2N bytes per pass. Last line: one JSON object with ``diff_over_copy`` (the path the
library uses here: the host kernel of :mod:`delta_sync.native` when it builds) and
``torch_ops_over_copy`` (the portable torch-op path, what a device snapshot runs).

Other subcommands (``apply``) are contributed by packages that know an engine, through the
``delta_sync.bench`` entry-point group, so this core module never imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import entry_points

import torch

from . import native
from .diff import BitwiseDiff


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_diff(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench diff")
    ap.add_argument("--total-gib", type=float, default=1.0, help="bf16 bytes in all tensors")
    ap.add_argument("--tensor-mib", type=float, default=64.0, help="size of each tensor")
    ap.add_argument("--density", type=float, default=0.002, help="fraction of elements changed")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

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
    total = sum(t.numel() * t.element_size() for t in news)
    differ = BitwiseDiff()
    portable = BitwiseDiff(use_native=False)

    def run_copy():
        for d, s in zip(dsts, news):
            d.copy_(s)

    produced = []

    def diff_with(d: BitwiseDiff):
        def run():
            produced.clear()
            for i, (o, n) in enumerate(zip(olds, news)):
                produced.append(d.diff(f"t{i}", o, n))
        return run

    run_diff, run_portable = diff_with(differ), diff_with(portable)
    run_copy(), run_diff(), run_portable()  # warm up allocations and page faults
    t_copy = t_diff = t_portable = float("inf")
    for _ in range(args.reps):  # interleaved, so all see the same machine state
        t_copy = min(t_copy, _best(run_copy, 1))
        t_portable = min(t_portable, _best(run_portable, 1))
        t_diff = min(t_diff, _best(run_diff, 1))
    found = sum(p.count for p in produced)
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


BUILTIN = {"diff": bench_diff}


def _commands() -> dict:
    cmds = dict(BUILTIN)
    for ep in entry_points(group="delta_sync.bench"):
        cmds.setdefault(ep.name, ep)
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
