"""Run greedy inference on a fresh vLLM engine in its own process and print JSON (test oracle).

``python -m tests.engine_runner MODEL_DIR PROMPTS_JSON [--tp N] [--stock]``: without ``--stock``
the engine is started exactly like the live engines of the tests (checkpoint-layout mode).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

MAX_TOKENS = 8


def engine_kwargs(tp: int = 1, stock: bool = False) -> dict:
    kw = dict(dtype="bfloat16", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=64 << 20,
              seed=0, enable_prefix_caching=True, tensor_parallel_size=tp,
              distributed_executor_backend="uni" if tp == 1 else "mp")
    if not stock:
        kw["additional_config"] = {"delta_sync": True}
    return kw


def greedy(llm, prompts: list[str]) -> list[dict]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({"prompt_token_ids": list(o.prompt_token_ids), "token_ids": list(c.token_ids),
                    "logprobs": [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]})
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--stock", action="store_true")
    args = ap.parse_args()
    if args.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    llm = LLM(model=args.model, **engine_kwargs(args.tp, args.stock))
    print("RESULT " + json.dumps(greedy(llm, json.loads(args.prompts))), flush=True)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
