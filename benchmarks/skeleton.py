"""``python -m delta_sync.bench skeleton``: how a sync's cost grows with the tensor count.

Qwen3-30B-A3B's names and layout at tiny dimensions (:func:`delta_sync.checkpoints.skeleton_shapes`:
393 tensors per layer, 128 experts x 3) at ``--layers`` (default 6, 12, 24, 48: 2.4k to 18.9k
tensors), each through the library's pipeline on this host (:func:`launchers.device_check.
bench_pipeline`: the snapshot's diff, pack, an in-process channel, receive, assemble, apply). Per
stage, a least-squares line of seconds against the tensor count: its slope is the cost of one more
tensor, and the line's value at 18,867 tensors what the real model's tensor count costs on top of
its bytes (the bytes here are tiny: 2.6 MB per layer).

``--torch-path``: the host kernels off, so the torch-op path that device tensors take runs, and
the last delta of each size runs once more under a dispatch-mode counter on both ends: torch
operations per delta, and those that read data back or size their output by it (each one a
device sync on an accelerator), with their slope per tensor.

``--flat``: the sender's weights in :class:`~delta_sync.flat.FlatWeights` (each buffer diffed whole,
its changes mapped through a run table) instead of separate tensors.

Last line: one JSON object; ``launchers/device_check.sh --pipeline qwen3-30b-a3b --layers N`` runs
the same pipeline at the real dimensions on a device.
"""

from __future__ import annotations

import argparse
import os
import time

#: the tensor count of Qwen3-30B-A3B's checkpoint, where the fits are read
FULL_TENSORS = 18_867


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx, slope


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench skeleton")
    ap.add_argument("--layers", default="6,12,24,48")
    ap.add_argument("--density", type=float, default=0.002)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--torch-path", action="store_true", help="host kernels off: the code path devices run")
    ap.add_argument("--flat", action="store_true", help="the sender's weights in FlatWeights (each buffer diffed whole)")
    args = ap.parse_args(argv)
    if args.torch_path:
        os.environ["DELTA_SYNC_NATIVE_DIFF"] = "0"  # before the first kernel() call of this process
    import torch

    from delta_sync.checkpoints import skeleton_shapes
    from launchers.device_check import bench_pipeline

    device = torch.device(args.device)
    torch_ops = args.torch_path or device.type != "cpu"  # device tensors take the torch ops anyway
    rows = []
    for layers in [int(x) for x in args.layers.split(",") if x.strip()]:
        shapes = skeleton_shapes(layers)
        t0 = time.perf_counter()
        got = bench_pipeline(device, torch.Generator().manual_seed(layers), shapes, args.density,
                             count_ops=torch_ops, source="flat" if args.flat else "stream")
        row = {"layers": layers, "tensors": len(shapes), "model_bytes": got["model_bytes"],
               "wall_s": round(time.perf_counter() - t0, 1),
               **{f"{kind}_{k}": v for kind in ("seed", "delta") for k, v in got[kind].items()}}
        if torch_ops:
            for side, c in got["delta_ops"].items():
                row[f"delta_{side}_ops"], row[f"delta_{side}_syncs"] = c["ops"], c["syncs"]
                row[f"delta_{side}_syncing"] = c["syncing"]  # which operations waited, how often
        rows.append(row)
        print(f"[skeleton] {layers} layers, {len(shapes)} tensors: seed {row['seed_total_s']:.3f} s, delta "
              f"{row['delta_total_s']:.3f} s (prepare {row['delta_prepare_s']:.3f}, send {row['delta_send_s']:.3f}, "
              f"receive {row['delta_receive_s']:.3f}, apply {row['delta_apply_s']:.3f})"
              + (f"; syncs: sender {row['delta_sender_syncing']}, receiver {row['delta_receiver_syncing']}"
                 if torch_ops else ""), flush=True)
    xs = [r["tensors"] for r in rows]
    per_tensor, at_full = {}, {}
    keys = [k for k in rows[0] if k.startswith(("seed_", "delta_")) and k.endswith(("_s", "_ops", "_syncs"))]
    for k in keys:
        a, b = fit(xs, [r[k] for r in rows])
        scale = 1e6 if k.endswith("_s") else 1.0  # seconds: microseconds per tensor
        per_tensor[k[:-2] + "_us" if k.endswith("_s") else k] = round(b * scale, 3 if scale == 1 else 1)
        at_full[k] = round(a + b * FULL_TENSORS, 4)
    return {"bench": "skeleton", "path": "torch ops" if torch_ops else "host kernels",
            "source": "FlatWeights" if args.flat else "a stream of tensors",
            "device": str(device), "density": args.density, "runs": rows, "per_tensor": per_tensor,
            f"at_{FULL_TENSORS}_tensors": at_full}
