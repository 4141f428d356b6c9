"""Fresh-checkpoint equivalence: the live-synced engine vs a fresh engine on an independent export.

Zero tolerance: identical generated token ids and every generated-token logprob; a missing or
non-finite logprob fails. Artifacts written to ``--out``:

* ``baseline.json``            prompts as exact token ids + sampling parameters
* ``sparse-inference.json``    the synced engine's outputs (and whether a repeat was identical)
* ``checkpoint-inference.json`` the fresh engine's outputs
* ``comparison.json``          per-field equality, max |logprob error|, first differing token,
                               changed-element counts of each update

CLI: ``python -m launchers.equivalence --synced URL --checkpoint DIR --out DIR [--prompt ...]``
(starts the fresh engine itself; the synced engine must be running).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from delta_sync import accelerator
from delta_sync.auth import ensure_secret
from delta_sync.channel import free_port
from patches.engine_options import SPIN_ENV

DEFAULT_PROMPTS = ["the quick brown fox", "one two three four", "def add(a, b):",
                   "weights change a little every step of reinforcement learning"]
SAMPLING = {"temperature": 0.0, "max_tokens": 12, "logprobs": 0, "seed": 0}


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def tokenize(base: str, prompts: list[str], model: str = "m") -> list[list[int]]:
    return [_post(base + "/tokenize", {"model": model, "prompt": p})["tokens"] for p in prompts]


def greedy(base: str, prompt_ids: list[list[int]], model: str = "m") -> list[dict]:
    out = []
    for ids in prompt_ids:
        r = _post(base + "/v1/completions", dict(SAMPLING, model=model, prompt=ids, return_token_ids=True))
        c = r["choices"][0]
        out.append({"prompt_token_ids": ids, "token_ids": c.get("token_ids"),
                    "logprobs": (c.get("logprobs") or {}).get("token_logprobs")})
    return out


def compare(synced: list[dict], fresh: list[dict]) -> dict:
    """Per-field equality and the first differing token; missing/non-finite logprobs are failures."""
    fields = {"prompt_token_ids": True, "token_ids": True, "logprobs": True, "logprobs_present_and_finite": True}
    first_diff = None
    worst = 0.0
    for i, (a, b) in enumerate(zip(synced, fresh)):
        for side in (a, b):
            lps = side.get("logprobs")
            if lps is None or len(lps) != len(side.get("token_ids") or []) or \
                    any(x is None or not math.isfinite(x) for x in lps):
                fields["logprobs_present_and_finite"] = False
        fields["prompt_token_ids"] &= a["prompt_token_ids"] == b["prompt_token_ids"]
        fields["token_ids"] &= a["token_ids"] == b["token_ids"]
        fields["logprobs"] &= a["logprobs"] == b["logprobs"]
        for j, (ta, tb) in enumerate(zip(a["token_ids"] or [], b["token_ids"] or [])):
            la, lb = (a["logprobs"] or [None] * (j + 1))[j], (b["logprobs"] or [None] * (j + 1))[j]
            if la is not None and lb is not None:
                worst = max(worst, abs(la - lb))
            if first_diff is None and (ta != tb or la != lb):
                first_diff = {"prompt": i, "position": j, "synced_token": ta, "fresh_token": tb,
                              "synced_logprob": la, "fresh_logprob": lb}
            if ta != tb:
                break
        if first_diff is None and len(a["token_ids"] or []) != len(b["token_ids"] or []):
            first_diff = {"prompt": i, "position": min(len(a["token_ids"]), len(b["token_ids"])),
                          "reason": "different lengths"}
    equal = all(fields.values()) and len(synced) == len(fresh)
    return {"equal": equal, "fields": fields, "max_abs_logprob_error": worst, "first_difference": first_diff}


#: vLLM's shm readers poll (sleeping between checks, see ``patches.vllm_plugin``) this long after a
#: read on CPU hosts instead of spinning 1 s (which cost a 0.2% delta's diff a third of its speed
#: here). 0 stalled the engine ~5 s per update here (a read that found its notification already
#: taken waits for vLLM's 5 s recheck): keep a short window.
CPU_HOST_SPIN_S = "0.05"


def start_engine(model: str | Path, port: int, log: Path, tp: int = 1,
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A vLLM OpenAI server on 127.0.0.1 with the options the synced engine uses (checkpoint layout).

    It gets this process tree's engine secret (generated if unset), so trainers started from here
    sign their calls with it. Its own session: :func:`kill_engine` takes down its workers too."""
    ensure_secret()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_OMP_THREADS_BIND="nobind", **(env or {}))
    if accelerator.detect_family() == "cpu":  # engine and trainer share this host's cores
        env.setdefault(SPIN_ENV, CPU_HOST_SPIN_S)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16", "--enforce-eager",
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
           "--enable-prefix-caching", "--tensor-parallel-size", str(tp),
           "--additional-config", json.dumps({"delta_sync": True})]
    return subprocess.Popen(cmd + (extra or []), env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen | int, base: str, log: Path, timeout: float = 420) -> None:
    """Until ``base`` answers ``/health``. ``proc`` is the server, or its pid from another process
    of this host (a trainer rank waiting for the engine its parent started, which reaps it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        exited = _exit_status(proc)
        if exited is not None:
            raise RuntimeError(f"engine exited ({exited}); see {log}")
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except Exception:  # noqa: BLE001 - not up yet: poll until the deadline
            time.sleep(0.5)
    if isinstance(proc, subprocess.Popen):
        proc.kill()
    raise RuntimeError(f"engine not ready after {timeout:.0f} s; see {log}")


def _exit_status(proc: subprocess.Popen | int) -> str | None:
    if isinstance(proc, subprocess.Popen):
        return None if proc.poll() is None else f"rc={proc.returncode}"
    try:
        os.kill(proc, 0)
        return None
    except ProcessLookupError:
        return f"pid {proc} is gone"


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    kill_engine(proc)  # and whatever the server left behind in its session


def kill_engine(proc: subprocess.Popen) -> None:
    """SIGKILL the server and every process of its session (engine core, workers)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


def run_check(synced_base: str, checkpoint: Path, out: Path, prompts: list[str] | None = None,
              updates: list[dict] | None = None, stop_synced=None) -> dict:
    """Steps (2)-(5): greedy on the synced engine, repeat, (stop it), fresh engine, compare, write artifacts.

    The fresh engine is started here on ``checkpoint`` (this host, CPU options). Where the fresh
    engine must run on the synced engine's own cards with its options (NPUs), run the two halves
    apart: :func:`record_synced`, then stop the synced engine, start the fresh one the same way,
    and :func:`compare_fresh` (``python -m launchers.equivalence --phase synced|fresh``)."""
    record_synced(synced_base, out, prompts, updates)
    if stop_synced is not None:
        stop_synced()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_engine(checkpoint, port, out / "fresh-engine.log")
    try:
        wait_ready(proc, base, out / "fresh-engine.log")
        return compare_fresh(base, out)
    finally:
        stop_engine(proc)


def record_synced(synced_base: str, out: Path, prompts: list[str] | None = None,
                  updates: list[dict] | None = None) -> None:
    """Greedy outputs of the synced engine (twice: they must repeat) and the prompts, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    prompts = prompts or DEFAULT_PROMPTS
    prompt_ids = tokenize(synced_base, prompts)
    (out / "baseline.json").write_text(json.dumps({"prompts": prompts, "prompt_token_ids": prompt_ids,
                                                   "sampling": SAMPLING, "updates": updates or []}, indent=1))
    synced = greedy(synced_base, prompt_ids)
    repeat = greedy(synced_base, prompt_ids)
    (out / "sparse-inference.json").write_text(json.dumps({"outputs": synced, "repeat_identical": synced == repeat},
                                                          indent=1))


def compare_fresh(fresh_base: str, out: Path) -> dict:
    """Greedy outputs of a fresh engine on the same prompts, compared with the recorded synced ones."""
    baseline = json.loads((out / "baseline.json").read_text())
    recorded = json.loads((out / "sparse-inference.json").read_text())
    fresh = greedy(fresh_base, baseline["prompt_token_ids"])
    (out / "checkpoint-inference.json").write_text(json.dumps({"outputs": fresh}, indent=1))
    result = compare(recorded["outputs"], fresh)
    result["fields"]["synced_engine_repeatable"] = recorded["repeat_identical"]
    result["equal"] = result["equal"] and recorded["repeat_identical"]
    result["updates"] = baseline.get("updates", [])
    (out / "comparison.json").write_text(json.dumps(result, indent=1))
    return result


def verdict(result: dict) -> str:
    if result["equal"]:
        return (f"EQUAL: synced engine == fresh engine on the exported checkpoint "
                f"({', '.join(k for k in result['fields'])}; max |logprob error| {result['max_abs_logprob_error']})")
    bad = [k for k, v in result["fields"].items() if not v]
    return f"DIFFERENT: {', '.join(bad)}; first difference {result['first_difference']}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=("all", "synced", "fresh"), default="all",
                    help="all: record the synced engine, start a fresh one here on --checkpoint, compare; "
                         "synced / fresh: the two halves, for a fresh engine started by the caller on the "
                         "synced engine's cards (after stopping it) with the same options")
    ap.add_argument("--synced", help="URL of the live-synced engine (phases all, synced)")
    ap.add_argument("--checkpoint", help="independently exported checkpoint directory (phase all)")
    ap.add_argument("--fresh", help="URL of the fresh engine on the exported checkpoint (phase fresh)")
    ap.add_argument("--out", default="runs/equivalence")
    ap.add_argument("--prompt", action="append", help="repeatable; default: a built-in set")
    args = ap.parse_args(argv)
    need = {"all": ("synced", "checkpoint"), "synced": ("synced",), "fresh": ("fresh",)}[args.phase]
    missing = [f"--{k}" for k in need if not getattr(args, k)]
    if missing:
        ap.error(f"--phase {args.phase} needs {' and '.join(missing)}")
    out = Path(args.out)
    if args.phase == "synced":
        record_synced(args.synced, out, args.prompt)
        print(f"recorded the synced engine's outputs in {out}; stop it, start the fresh engine, run --phase fresh")
        return 0
    result = (compare_fresh(args.fresh, out) if args.phase == "fresh"
              else run_check(args.synced, Path(args.checkpoint), out, args.prompt))
    print(json.dumps(result, indent=1))
    print(verdict(result))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
