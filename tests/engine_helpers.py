"""Shared pieces of the engine tests: checkpoint evolution, fresh-engine oracle, patched export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from delta_sync.channel import free_port
from delta_sync.checkpoints import save_like as export  # noqa: F401 (re-exported for the tests)
from launchers.equivalence import greedy as complete  # noqa: F401 (re-exported for the tests)
from launchers.equivalence import start_engine, stop_engine as stop_server, tokenize, wait_ready  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["the quick brown fox", "one two three four",
           # a long prompt that sits in the prefix cache across updates
           "weights change a little every step of reinforcement learning, and the engine must serve "
           "exactly the trained weights. " * 3]


def load_state(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_file(str(path / "model.safetensors")).items()}


def evolve(state: dict[str, torch.Tensor], version: int) -> None:
    """Mixed densities: tensors untouched, fully rewritten, and sparse at several densities."""
    g = torch.Generator().manual_seed(1000 + version)
    for i, (name, t) in enumerate(sorted(state.items())):
        flat = t.view(-1)
        mode = (i + version) % 6
        if mode == 0:
            continue
        if mode == 1 and version % 2 == 1:
            flat.copy_((torch.randn(flat.numel(), generator=g) * 0.2).to(flat.dtype))
            continue
        frac = [0.0001, 0.002, 0.01, 0.05, 0.3][mode - 1]
        k = max(1, int(flat.numel() * frac))
        # unique positions: with repeats, which write wins is up to the (threaded) kernel, so two
        # processes evolving the same state could disagree
        pos = torch.unique(torch.randint(0, flat.numel(), (k,), generator=g))
        flat[pos] = (flat[pos].float() + 0.05 * torch.randn(pos.numel(), generator=g)).to(flat.dtype)


def fresh_engine(model: Path, prompts=PROMPTS, tp: int = 1, stock: bool = False) -> list[dict]:
    cmd = [sys.executable, "-m", "tests.engine_runner", str(model), json.dumps(prompts), "--tp", str(tp)]
    if stock:
        cmd.append("--stock")
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind"))
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"fresh engine failed (rc {out.returncode}):\n{out.stderr[-4000:]}")


def close_llm(llm) -> None:
    """Shut an in-process engine down, with vLLM's process-global parallel state, so that the next
    engine in this process can start. Its engine core is shut down here, not by the finalizer vLLM
    attaches to its client: that one runs whenever the client is collected, and where something
    still held it (a fixture's frame, a reference cycle) it ran during a later engine's life and
    tore down that engine's parallel groups ("pipeline model parallel group is not initialized")."""
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()  # once: it detaches vLLM's finalizer
    del llm, core
    gc.collect()
    destroy_model_parallel()
    destroy_distributed_environment()


def max_logprob_error(a: list[dict], b: list[dict]) -> float:
    """Max |logprob difference| over the positions where both generated the same tokens so far."""
    worst = 0.0
    for ra, rb in zip(a, b):
        for ta, tb, x, y in zip(ra["token_ids"], rb["token_ids"], ra["logprobs"], rb["logprobs"]):
            worst = max(worst, abs(x - y))
            if ta != tb:
                break
    return worst


# ---- vLLM's OpenAI server as a test engine (the launcher's own helpers) ----------------------


def start_server(path, log_name: str, tp: int = 2):
    port = free_port()
    proc = start_engine(path, port, ROOT / ".cache" / log_name, tp=tp)
    base = f"http://127.0.0.1:{port}"
    wait_ready(proc, base, ROOT / ".cache" / log_name)
    return proc, base


def prompt_ids(base: str) -> list[list[int]]:
    return tokenize(base, PROMPTS)


def engine_differs_from(base: str, state: dict[str, torch.Tensor]) -> list[str]:
    """Names the engine at ``base`` holds with other bits than ``state`` (its digests, read back from
    the parameters through the loader views), plus names it does not report at all."""
    from delta_sync.digest import digest_tensor
    from delta_sync.engines import HttpEngine
    from delta_sync.digest import combine_reports

    got = combine_reports(HttpEngine(base).report(digests=True))
    missing = [n for n in got if n not in state and n != "lm_head.weight"]  # tied: saved once
    return missing + [n for n, t in state.items() if n in got and got[n] != digest_tensor(t).hex()] + (
        [] if got else ["<no digests reported>"])


class Server:
    """A vLLM HTTP engine on this host for tests (``start_engine``'s options), restartable on the
    same port: ``start(model)`` after a kill is the same engine address with fresh weights."""

    def __init__(self, kind: str, log: str, lease_s: float | None = None):
        from delta_sync.checkpoints import build

        (ROOT / ".cache").mkdir(exist_ok=True)
        self.path, self.log, self.port, self.lease_s = build(kind), ROOT / ".cache" / log, free_port(), lease_s
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc, self.tp = None, 1

    def start(self, model=None, tp: int | None = None) -> "Server":
        self.tp = tp or self.tp
        env = {"DELTA_SYNC_PAUSE_LEASE_S": str(self.lease_s)} if self.lease_s is not None else None
        self.proc = start_engine(model or self.path, self.port, self.log, tp=self.tp, env=env)
        wait_ready(self.proc, self.base, self.log)
        return self

    def ensure(self) -> "Server":
        """Running and healthy, restarted on the original checkpoint if not."""
        import urllib.request

        if self.proc is not None and self.proc.poll() is None:
            try:
                urllib.request.urlopen(self.base + "/health", timeout=5)
                return self
            except Exception:
                self.stop()
        return self.start()

    def stop(self) -> None:
        if self.proc is not None:
            stop_server(self.proc)
            self.proc = None
