"""``python -m delta_sync.bench apply``: loader-view apply vs vLLM's ``load_checkpoint_weight_patches``.

A random checkpoint with Qwen3-0.6B shapes is served by a real CPU engine in checkpoint-layout
mode; the same sparse patches (all tensors, one density at a time) are applied by both paths in
the same run. Last line: JSON with ``apply_over_native`` = views / native time at 0.2% density (the
whole apply with its undo log, what a delta's pause window holds).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from delta_sync.checkpoints import qwen3_shapes

QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, torch_dtype="bfloat16",
                  architectures=["Qwen3ForCausalLM"], model_type="qwen3", bos_token_id=1, eos_token_id=2)


def _checkpoint(root: Path, layers: int) -> Path:
    from safetensors.torch import save_file

    path = root / f"qwen3-0.6b-shapes-l{layers}"
    if (path / "done").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(QWEN3_0_6B, num_hidden_layers=layers)
    g = torch.Generator().manual_seed(0)
    t = qwen3_shapes(layers, hidden=cfg["hidden_size"], inter=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                     heads=cfg["num_attention_heads"], kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"])
    state = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in t.items()}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(cfg))
    import shutil

    from delta_sync.checkpoints import build  # the tiny tokenizer is enough: the bench never decodes text

    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(build("dense") / f, path / f)
    (path / "done").write_text("1")
    return path


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench apply")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--densities", default="0.0001,0.001,0.002,0.01,0.1")
    ap.add_argument("--reps", type=int, default=3, help="best of, each path (as the e2e bench's other ratios)")
    ap.add_argument("--cache", default=str(Path(__file__).resolve().parents[1] / ".cache" / "bench"))
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                          load_checkpoint_weight_patches)

    from patches.loader_views import UndoLog, apply_sparse_many, probe_views

    path = _checkpoint(Path(args.cache), args.layers)
    llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=128,
              kv_cache_memory_bytes=64 << 20, distributed_executor_backend="uni",
              additional_config={"delta_sync": True})
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    state = load_file(str(path / "model.safetensors"))
    views, unsupported = probe_views(model, [(n, tuple(t.shape), t.dtype) for n, t in state.items()])
    if unsupported:
        raise SystemExit(f"no loader view for {sorted(unsupported)[:3]}")
    params = dict(model.named_parameters())
    g = torch.Generator().manual_seed(1)
    rows = []
    for density in [float(x) for x in args.densities.split(",")]:
        patches = []
        for name, t in state.items():
            k = max(1, int(t.numel() * density))
            idx = torch.randperm(t.numel(), generator=g)[:k].sort().values.to(torch.int32)
            vals = (t.view(-1).index_select(0, idx.long()).float() + 0.01).to(t.dtype)
            patches.append((name, t, idx, vals))
        changed = sum(p[2].numel() for p in patches)
        native = [CheckpointWeightPatch(n, tuple(t.shape), t.dtype, v, i) for n, t, i, v in patches]
        ours = [(name, idx, vals) for name, _, idx, vals in patches]
        best_views = best_native = float("inf")
        with torch.no_grad():
            for _ in range(args.reps):
                t0 = time.perf_counter()
                undo = UndoLog()  # the whole apply: every tensor's patch at once, with its undo log
                apply_sparse_many(views, params, ours, undo)
                best_views = min(best_views, time.perf_counter() - t0)
                t0 = time.perf_counter()
                load_checkpoint_weight_patches(model, native)
                best_native = min(best_native, time.perf_counter() - t0)
        rows.append({"density": density, "changed_elements": changed, "views_s": round(best_views, 5),
                     "native_s": round(best_native, 5), "ratio": round(best_views / best_native, 4)})
        print(json.dumps(rows[-1]), flush=True)
    at = {r["density"]: r for r in rows}.get(0.002) or rows[0]
    total = sum(t.numel() for t in state.values())
    return {"bench": "apply", "model": f"Qwen3-0.6B shapes ({args.layers} layers, {total / 1e6:.0f}M params)",
            "rows": rows, "apply_over_native": at["ratio"]}
