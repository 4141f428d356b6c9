"""``python -m delta_sync.bench e2e``: the whole sync, trainer process to serving engine, against the wire.

One run, one checkpoint (a random one with Qwen3-0.6B shapes, ``--layers`` deep, or ``--model DIR``),
everything measured on this machine in the same run:

* **wire**: a raw ``broadcast`` of the model's bytes between two processes over gloo on 127.0.0.1,
  in chunks of the bucket size (best of 3): the floor every bulk sync is compared with;
* **vLLM load**: vLLM's own ``model.load_weights`` of the full state from memory, in an in-process
  ``vllm.LLM`` in its own process (best of 2);
* **our sync**: one vLLM HTTP engine (checkpoint-layout mode) driven by ``WeightSync`` from a
  trainer of 1 rank, then of 2 ranks: a seed, a full update, a second seed (the delta sync's own),
  deltas at ``--densities`` (that fraction of every tensor's elements moved by ~1%) and the delta
  of one AdamW step (lr ``--lr``) on fp32 masters of the state; digests checked against the
  engine after the last delta (``verify``), then a few greedy tokens through the HTTP API;
* **memory**: a sampler thread reads ``VmRSS`` every ~20 ms for the engine's process tree and for
  every trainer rank; per update: the engine tree's growth over its value just before the update,
  and each rank's peak, its growth over its value before the update and over its RSS before the
  first update;
* **cores**: the share of this host's cores busy (any process) and stolen (by other guests of the
  machine) during each update and during the best wire run, from ``/proc/stat``: where both cores
  are busy, an update is CPU-bound here, whatever the wire could carry;
* ``apply_over_native`` (``bench apply`` at 0.2%) and ``diff_over_copy`` (``bench diff`` on 0.5 GiB),
  each in its own process;
* **Megatron fast path** (``--megatron``, on by default): Megatron ranks (2, EP=2, Adam lr 1e-6)
  on a Qwen3-MoE (``--megatron-model``, default ``moe-e2e``: 0.33B parameters), after one untimed
  export-only seed into both receivers (``cold_export_s``: an engine's parameters exist before any
  seed), seed and then sync
  ``MegatronShardDelta`` deltas into an in-memory receiver, checked bit for bit against an
  independent export; then one seed of Bridge's plain export through a full-mode updater (the
  bulk path without the shard map); with the wire floor of that model's bytes (its best try,
  before or after the ranks ran).

Artifacts in ``--out``: ``e2e.json`` (everything), ``rss.json`` (the raw samples), ``e2e.png``
(update time vs density against the wire / seed / full / vLLM-load lines; peak memory per side),
``engine.log``. The seed (each time from a fresh full-mode trainer session: channel, claim, every
byte; only the engine's first also probes its loader views), the full update and the headline
delta (0.2%) run ``REPEATS`` times each and the best run is set against the wire, which is the best
of its own tries too: some before anything else runs, as many again after the trainer passes with
the engine still up (this host's wire speed drifts by a third between minutes; every try is in the
JSON, ``wire.times_s`` and ``wire.after_s``, as is every run, the first seed's as ``first_seed_s``).
Last line: one JSON object with the ratios (``seed_over_wire``: a full-mode
trainer's first update; ``reseed_over_wire``: a delta-mode trainer's seed, which also builds its
snapshot; ``full_over_wire``, ``delta_over_wire``, ``delta_pause_over_wire``, ``verify_over_seed``,
``sweep_over_delta``, ``engine_seed_peak_over_bucket``, ``trainer_seed_peak_over_model``,
``apply_over_native``, ``diff_over_copy``; ``flat_*``: the same trainer with its weights moved into
:class:`~delta_sync.flat.FlatWeights` after the stream's deltas, a seed, the headline deltas and an
Adam step from it; ``*_over_vllm_load``: against vLLM's own load; ``delta_stall_s``: how long vLLM
ran no step for the headline delta, its worker's receive call and the pause) and the times behind
them.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import signal
import statistics
import threading
import time
import traceback
from pathlib import Path

import torch

from launchers.device_check import settle_allocator

ROOT = Path(__file__).resolve().parents[1]
DENSITIES = "0.0001,0.001,0.002,0.01,0.1"
HEADLINE_DENSITY = 0.002
#: full updates, and deltas at the headline density, each run this many times: the best one is
#: set against the wire, itself the best of ``--wire-reps`` (this shared host is noisy)
REPEATS = 3
PROMPTS = ["the quick brown fox", "one two three four"]
MIB = 1 << 20
SAMPLE_S = 0.02  # RSS sampling interval


def _say(msg: str) -> None:
    print(f"[e2e] {msg}", flush=True)


# ---- checkpoint files ------------------------------------------------------------------------------


def _safetensors(path: Path) -> list[Path]:
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{path}: no *.safetensors file")
    return files


_FLOATS = ("F64", "F32", "F16", "BF16")  # safetensors dtypes the bench moves as bf16


def _checkpoint_size(files: list[Path]) -> dict:
    """Bytes (floating tensors counted as bf16, what the sync sends), elements and tensors of the
    checkpoint, from the safetensors headers (nothing loaded)."""
    nbytes = elements = tensors = 0
    for f in files:
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            n = math.prod(meta["shape"])
            nbytes += 2 * n if meta["dtype"] in _FLOATS else end - start
            elements += n
            tensors += 1
    return {"bytes": nbytes, "elements": elements, "tensors": tensors}


def _load_state(files: list[Path]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in this process's own memory, floating ones as bf16.

    ``load_file`` returns tensors backed by a mapping of the file: their pages enter RSS only when
    first read, which would count the model itself as growth of the first update. Copies don't."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in files:
        mapped = load_file(str(f))
        for name in list(mapped):
            t = mapped.pop(name)
            state[name] = t.to(torch.bfloat16, copy=True) if t.is_floating_point() else t.clone()
        del mapped
    return state


def _bucket_for(nbytes: int) -> int:
    return max(MIB, min(nbytes // 8, 512 * MIB))


# ---- RSS of process trees --------------------------------------------------------------------------


def _rss(pid: int, field: str = "VmRSS:") -> int | None:
    """Resident bytes of ``pid`` (``field``: another kB line of its status, e.g. ``VmHWM:``)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return 0  # a zombie has no VmRSS line


def _own_peak_reset() -> None:
    """Start this process's peak RSS (``VmHWM``) over from its current RSS (Linux ``clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _own_peak() -> int:
    """This process's peak RSS since the last :func:`_own_peak_reset` (bytes; 0 where unknown)."""
    return _rss(os.getpid(), "VmHWM:") or 0


def _children(pid: int) -> list[int]:
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo.extend(_children(p))
    return seen


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants now."""
    return sum(_rss(p) or 0 for p in _tree(pid))


def _kill_pids(pids: list[int]) -> None:
    """SIGKILL the given processes (ids we started, or descendants of those) that are still alive."""
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def cpu_times() -> tuple[int, int, int]:
    """This host's CPU time so far, in ticks over all its cores: (busy, stolen, total). Busy is
    user + nice + system + irq + softirq; stolen is time the hypervisor gave to other guests."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq
    return busy, steal, busy + steal + idle + iowait


def cpu_share(before: tuple[int, int, int], after: tuple[int, int, int]) -> dict:
    """Shares of the host's cores between two :func:`cpu_times`: busy (any process of this host:
    trainer, engine, the wire's two ends) and stolen (by other guests of the machine)."""
    busy, steal, total = (b - a for a, b in zip(before, after))
    total = max(total, 1)
    return {"busy": round(busy / total, 3), "stolen": round(steal / total, 3)}


class RssSampler(threading.Thread):
    """Every ``interval`` s: the summed RSS of the engine's process tree and the RSS of every other
    descendant of this process (trainer ranks, helper processes). Timestamps are ``time.monotonic()``,
    which is system wide on Linux, so windows recorded by other processes line up."""

    def __init__(self, interval: float = SAMPLE_S, refresh: float = 0.5):
        super().__init__(daemon=True, name="rss-sampler")
        self.interval, self.refresh = interval, refresh
        self.engine_pid: int | None = None
        self.times: list[float] = []
        self.engine: list[int | None] = []
        self.procs: list[dict[int, int]] = []
        self._stop_evt = threading.Event()
        self._lock = threading.Lock()

    def set_engine(self, pid: int | None) -> None:
        self.engine_pid = pid

    def stop(self) -> None:
        self._stop_evt.set()
        if self.is_alive():
            self.join(5)

    def run(self) -> None:
        me = os.getpid()
        engine_tree: list[int] = []
        others: list[int] = []
        next_refresh = 0.0
        while not self._stop_evt.is_set():
            t = time.monotonic()
            if t >= next_refresh:  # walking /proc/*/task/*/children is the costly part: not every sample
                epid = self.engine_pid
                engine_tree = _tree(epid) if epid is not None else []
                others = [p for p in _tree(me) if p != me and p not in engine_tree]
                next_refresh = t + self.refresh
            if engine_tree:
                vals = [_rss(p) for p in engine_tree]
                engine = sum(v for v in vals if v) if any(v is not None for v in vals) else None
            else:
                engine = None
            procs = {}
            for p in others:
                v = _rss(p)
                if v is not None:
                    procs[p] = v
            with self._lock:
                self.times.append(t)
                self.engine.append(engine)
                self.procs.append(procs)
            self._stop_evt.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def _series(self, key) -> tuple[list[float], list[int]]:
        with self._lock:
            if key == "engine":
                pairs = [(t, v) for t, v in zip(self.times, self.engine) if v is not None]
            else:
                pairs = [(t, d[key]) for t, d in zip(self.times, self.procs) if key in d]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def window(self, key, t0: float, t1: float) -> dict | None:
        """RSS of ``key`` ("engine" or a pid) just before ``t0`` and its peak within [t0, t1]."""
        ts, vs = self._series(key)
        if not ts:
            return None
        i = bisect.bisect_right(ts, t0) - 1  # last sample at or before t0
        j = bisect.bisect_right(ts, t1)
        inside = vs[i + 1:j]
        before = vs[i] if i >= 0 else (inside[0] if inside else None)
        if before is None:
            return None
        peak = max([before, *inside])
        return {"before": before, "peak": peak, "growth": peak - before, "samples": len(inside)}

    def dump(self) -> dict:
        with self._lock:
            pids = sorted({p for d in self.procs for p in d})
            return {"interval_s": self.interval, "t": [round(t, 4) for t in self.times], "engine": list(self.engine),
                    "procs": {str(p): [d.get(p) for d in self.procs] for p in pids}}


# ---- a function in its own process ---------------------------------------------------------------


def _child(fn, args, env, queue) -> None:
    os.environ.update(env)
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        queue.put(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _spawned(fn, *args, timeout: float, env: dict | None = None):
    """``fn(*args)`` in a fresh spawned process (default thread settings, like an engine); its return value."""
    import queue as q

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, env or {}, queue))
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                status, value = queue.get(timeout=1.0)
                break
            except q.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"{fn.__name__}: process exited with code {proc.exitcode} and no result")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{fn.__name__}: still running after {timeout:.0f} s")
    finally:
        descendants = _tree(proc.pid) if proc.pid else []
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=10)
        _kill_pids([p for p in descendants if p != proc.pid])
    if status != "ok":
        raise RuntimeError(f"{fn.__name__} failed: {value}")
    return value


def _init_gloo(rank: int, world: int, port: int, timeout_s: float) -> None:
    """The trainer world over gloo, with a collective timeout long enough for a slow seed on rank 0."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


# ---- the wire ------------------------------------------------------------------------------------


def _wire_rank(rank, world, port, files, bucket, reps, timeout_s):
    """Rank 0 broadcasts the checkpoint's bytes to rank 1 in ``bucket``-sized chunks (best of ``reps``)."""
    import torch.distributed as dist

    _init_gloo(rank, world, port, timeout_s)
    try:
        total = _checkpoint_size(files)["bytes"]
        sizes = [min(bucket, total - off) for off in range(0, total, bucket)]
        if rank == 0:  # the model's bytes, laid out in chunks before the clock starts
            chunks = [torch.empty(s, dtype=torch.uint8) for s in sizes]
            ci = off = 0
            for t in _load_state(files).values():
                src = t.contiguous().view(-1).view(torch.uint8)
                pos = 0
                while pos < src.numel():
                    n = min(src.numel() - pos, sizes[ci] - off)
                    chunks[ci][off:off + n].copy_(src[pos:pos + n])
                    pos, off = pos + n, off + n
                    if off == sizes[ci]:
                        ci, off = ci + 1, 0
        else:  # receive buffers touched once, so no page fault lands in the timing
            chunks = [torch.zeros(s, dtype=torch.uint8) for s in sizes]
        times, cpu = [], []
        for _ in range(reps):
            dist.barrier()
            t0, c0 = time.perf_counter(), cpu_times()
            for c in chunks:
                dist.broadcast(c, src=0)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            cpu.append(cpu_share(c0, cpu_times()))
        # the receiver got the model's bytes: compare a checksum of every chunk
        sums = torch.stack([c[::4099].sum(dtype=torch.int64) for c in chunks])
        ref = sums.clone()
        dist.broadcast(ref, src=0)
        if not torch.equal(ref, sums):
            raise RuntimeError("wire: received bytes differ from the sent ones")
        return {"bytes": total, "chunks": len(chunks), "bucket_bytes": bucket, "times_s": times, "cpu": cpu}
    finally:
        dist.destroy_process_group()


def _wire_again(wire: dict, files, bucket, reps: int, timeout: float, when: str) -> None:
    """More tries of the wire into ``wire`` (``after_s``), its ``seconds`` the best of all (this
    host's wire drifts between minutes: the ratios are set against its best, before or after)."""
    again = _wire(files, bucket, reps, timeout)
    wire["after_s"] = again["times_s"]
    if again["seconds"] < wire["seconds"]:
        wire.update(seconds=again["seconds"], gbps=again["gbps"], cpu_best=again["cpu_best"])
    _say(f"wire again, {when}: times {again['times_s']}; the wire is now {wire['seconds']:.3f} s")


def _wire(files, bucket, reps, timeout):
    from launchers.ranks import run_ranks

    res = run_ranks(_wire_rank, 2, files, bucket, reps, timeout, timeout=timeout, init_world=False)
    times = [max(a, b) for a, b in zip(res[0]["times_s"], res[1]["times_s"])]
    best = min(times)
    return dict(res[0], times_s=[round(t, 4) for t in times], seconds=round(best, 4),
                gbps=round(res[0]["bytes"] / best / 1e9, 3), cpu_best=res[0]["cpu"][times.index(best)])


# ---- vLLM's own load, bench apply, bench diff (each in its own process) -----------------------------


def _vllm_load(path, reps, kv_bytes, max_len):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # as the HTTP engine (start_engine)
    from vllm import LLM

    llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=max_len,
              kv_cache_memory_bytes=kv_bytes, distributed_executor_backend="uni", seed=0,
              additional_config={"delta_sync": True})
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    state = _load_state(_safetensors(Path(path)))
    from patches.engine_options import EngineOptions
    from patches.vllm_ascend import loader_layout

    times = []
    # (the transposed stand-in's experts take vLLM's loader through checkpoint-layout views, as a
    # reload on vLLM-Ascend must)
    with torch.no_grad(), loader_layout(model, EngineOptions.from_env().cpu_moe_transposed):
        for _ in range(reps):
            t0 = time.perf_counter()
            model.load_weights(state.items())
            times.append(time.perf_counter() - t0)
    return {"times_s": [round(t, 4) for t in times], "seconds": round(min(times), 4),
            "threads": torch.get_num_threads()}


def _apply_bench(cache, layers, model_dir):
    from benchmarks import apply as bench_apply

    if model_dir is not None:  # bench apply builds its own checkpoint: point it at --model instead
        bench_apply._checkpoint = lambda root, n: Path(model_dir)
    return bench_apply.main(["--layers", str(layers), "--densities", str(HEADLINE_DENSITY), "--cache", str(cache)])


def _diff_bench(total_gib):
    from delta_sync.bench import bench_diff

    return bench_diff(["--total-gib", str(total_gib)])


# ---- the trainer ranks ---------------------------------------------------------------------------


def _perturb(state: dict[str, torch.Tensor], density: float, g: torch.Generator) -> None:
    """Move ``density`` of each tensor's elements (random positions) by ~1%, every one bitwise different."""
    for t in state.values():
        if t.dtype != torch.bfloat16:
            continue
        flat = t.view(-1)
        k = max(1, round(flat.numel() * density))
        pos = torch.randint(0, flat.numel(), (k,), generator=g).unique()
        old = flat[pos]
        new = (old.float() * 1.01 + 1e-3).to(t.dtype)
        bits, old_bits = new.view(torch.int16), old.view(torch.int16)
        same = bits == old_bits
        if bool(same.any()):  # x * 1.01 + 1e-3 rounds back to x near x = -0.1: flip the last mantissa bit
            bits[same] = old_bits[same] ^ 1
        flat[pos] = new
    settle_allocator()  # (this step's freed small blocks merged now, not in the update timed next)


def _adam_step(state: dict[str, torch.Tensor], lr: float, g: torch.Generator, chunk: int = 1 << 24) -> None:
    """One AdamW step on fp32 master copies of the state with random gradients, cast back to bf16.

    AdamW is elementwise, so stepping chunk by chunk is the same step with bounded memory."""
    for t in state.values():
        if t.dtype != torch.bfloat16:
            continue
        for part in t.view(-1).split(chunk):
            p = torch.nn.Parameter(part.float())
            p.grad = torch.randn(p.shape, generator=g)
            try:
                opt = torch.optim.AdamW([p], lr=lr, fused=True)  # fused kernel: ~2.5x faster on CPU
            except (RuntimeError, ValueError):
                opt = torch.optim.AdamW([p], lr=lr)
            opt.step()
            part.copy_(p.detach().to(t.dtype))
    settle_allocator()


def _digest_marginal(state: dict[str, torch.Tensor], reps: int = 2) -> dict:
    """What verification adds to a seed, per side, same run (best of ``reps``).

    The sender must read every range before it leaves anyway: its Inf/NaN check refuses a
    diverged tensor before any of it reaches an engine. The digest rides in that pass, so the
    sender's share is what the digest adds to it: for a range that travels on its own (at least
    ``DIRECT_MIN_BYTES``, sent from the trainer's tensor) the checking scan with lanes over the
    one without; for a packed range the fused copy + check + digest over the fused copy + check.
    The engine reads ranges received in place for nothing but verification: its share is the
    whole scan of those, and for packed ranges the fused pass over a plain copy (it copies them
    into the parameters anyway). The engine's bucket checks beyond that are its own ``check_s``."""
    from delta_sync import bucket
    from delta_sync.digest import scan_many, scan_range

    tensors = [t.reshape(-1) for t in state.values() if t.dtype == torch.bfloat16]
    alone = [t for t in tensors if t.numel() * t.element_size() >= bucket.DIRECT_MIN_BYTES]
    packed = [t for t in tensors if t.numel() * t.element_size() < bucket.DIRECT_MIN_BYTES]
    buf = torch.empty(max((t.numel() for t in packed), default=1), dtype=torch.bfloat16)
    buf.fill_(0)
    times = {"copy": [], "fused": [], "fused_check": [], "scan": [], "check": []}
    for _ in range(reps):
        for how in times:
            t0 = time.perf_counter()
            if how in ("scan", "check"):  # as the packer and the engine digest them: a bucket's ranges together
                scan_many([(t, 0, None) for t in alone], lanes=how == "scan")
            else:
                for t in packed:
                    if how == "copy":
                        buf[:t.numel()].copy_(t)
                    else:
                        scan_range(t, 0, copy_to=buf[:t.numel()], lanes=how == "fused")
            times[how].append(time.perf_counter() - t0)
    best = {how: min(v) for how, v in times.items()}
    sender = max(0.0, best["scan"] - best["check"]) + max(0.0, best["fused"] - best["fused_check"])
    receiver = best["scan"] + max(0.0, best["fused"] - best["copy"])
    return {"copy_s": round(best["copy"], 4), "fused_s": round(best["fused"], 4),
            "fused_check_s": round(best["fused_check"], 4), "scan_alone_s": round(best["scan"], 4),
            "check_alone_s": round(best["check"], 4),
            "alone_bytes": sum(t.numel() * t.element_size() for t in alone),
            "sender_s": round(sender, 4), "engine_s": round(receiver, 4), "marginal_s": round(sender + receiver, 4)}


def _diff_alone(sync, state: dict[str, torch.Tensor], g: torch.Generator, reps: int = 3) -> float:
    """The diff of a headline-density step as a one-rank delta runs it (its stream read in lists,
    the snapshot store's kernel batches), same process and memory as the sync's but with nothing
    around it (best of ``reps``; rolled back, so the snapshot stays as synced)."""
    from delta_sync.gc_hold import gc_held  # as the sync holds it
    from delta_sync.prepare import DeltaDiff, TensorStream

    _perturb(state, HEADLINE_DENSITY, g)
    best = float("inf")
    for _ in range(reps):
        with gc_held():
            t0 = time.perf_counter()
            diff = DeltaDiff(TensorStream(state.items(), sync.name_map, sync.dtype, "bench"), sync.store,
                             sync._catalog, None, {}, fast=False)
            diff.batched = True
            for _ready in diff:
                pass
            best = min(best, time.perf_counter() - t0)
            sync.store.rollback()
    return round(best, 4)


def _flat_pass(run, state: dict[str, torch.Tensor], g: torch.Generator, lr: float) -> None:
    """``flat ...`` rows: the trainer's weights moved into :class:`~delta_sync.flat.FlatWeights`
    (as a trainer whose weights live in flat buffers keeps them: Megatron's DDP, FSDP's flat
    parameters), a delta-mode sync's seed, the headline deltas and an Adam step from them."""
    from delta_sync import FlatWeights, WeightSync

    engines = run.engines
    flat = FlatWeights(list(state.items()))
    state.clear()  # (its memory goes: the buffers hold the weights now)
    state.update(flat.tensors)
    sync = WeightSync(engines, mode="delta", dtype=torch.bfloat16, bucket_bytes=run.bucket, group=None)
    try:
        run(sync, "flat reseed", source=flat)
        for k in range(1, REPEATS + 1):
            _perturb(flat.tensors, HEADLINE_DENSITY, g)
            run(sync, f"flat delta {HEADLINE_DENSITY:g}" + (f" #{k}" if k > 1 else ""), source=flat, repeat=k > 1)
        _adam_step(flat.tensors, lr, g)
        run(sync, "flat adam", source=flat)
        sync.verify()
    finally:
        sync.close()


def _trainer_rank(rank, world, port, files, url, bucket, densities, lr, timeout_s):
    """Every rank: the same full state through ``WeightSync.update`` (rank 0 drives the engine)."""
    import gc

    import torch.distributed as dist

    from delta_sync import WeightSync

    _init_gloo(rank, world, port, timeout_s)
    # run_ranks pins spawned ranks to one thread; a trainer owns its share of the host's cores
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tag = f"[{world} rank{'s' if world > 1 else ''}]"
    try:
        state = _load_state(files)
        engines = [url] if rank == 0 else []
        rows = []
        digest_cost = _digest_marginal(state) if rank == 0 else None

        def run(sync, label, density=None, repeat=False, source=None):
            # settle: memory freed just now (the mapped checkpoint, perturbation temporaries) leaves RSS
            # before the sampler's last sample ahead of t0, which is the update's baseline
            time.sleep(5 * SAMPLE_S)
            dist.barrier()
            t0, c0 = time.monotonic(), cpu_times()
            rep = sync.update(state.items() if source is None else source)
            t1, c1 = time.monotonic(), cpu_times()
            row = {"label": label, "kind": rep.kind, "density": density, "version": rep.version,
                   "total_s": rep.timings.get("total_s", t1 - t0), "timings": dict(rep.timings),
                   "pause_window_s": rep.pause_window_s, "payload_bytes": rep.payload_bytes,
                   "changed_fraction": rep.changed_fraction, "changed_elements": rep.changed_elements,
                   "total_elements": rep.total_elements, "buckets": rep.buckets, "verified": rep.verified,
                   "t0": t0, "t1": t1, "repeat": repeat, "cpu": cpu_share(c0, c1)}
            if rank == 0:  # the workers' own timings of this update (check_s: their digest checks)
                workers = [w.get("timings") or {} for e in sync.engines for w in e.report()]
                row["engine_check_s"] = max((w.get("check_s", 0.0) for w in workers), default=0.0)
                row["engine_timings"] = workers[0] if workers else {}  # e.g. apply_s / undo_bytes of a delta
            rows.append(row)
            if rank == 0:
                print(f"[e2e] {tag} {label} ({rep.kind}): {row['total_s']:.3f} s, pause {rep.pause_window_s:.3f} s, "
                      f"cores busy {row['cpu']['busy']:.0%} (stolen {row['cpu']['stolen']:.0%}), "
                      f"changed {100 * rep.changed_fraction:.4f}%, payload {rep.payload_bytes / 1e6:.2f} MB, "
                      f"stages {rep.timings}", flush=True)

        # seeds and full updates through full-mode syncs: each one's first update is a seed from a fresh
        # trainer session (its channel, its claim, every byte), the first one's next updates full ones
        for k in range(1, REPEATS + 1):
            full_sync = WeightSync(engines, mode="full", dtype=torch.bfloat16, bucket_bytes=bucket, group=None)
            try:
                run(full_sync, "seed" if k == 1 else f"seed #{k}", repeat=k > 1)
                if k == 1:
                    for j in range(1, REPEATS + 1):
                        run(full_sync, "full" if j == 1 else f"full #{j}", repeat=j > 1)
            finally:
                full_sync.close()
            del full_sync
            gc.collect()
        # the delta sync: its own seed, then deltas
        sync = WeightSync(engines, mode="delta", dtype=torch.bfloat16, bucket_bytes=bucket, group=None)
        try:
            run(sync, "reseed")
            g = torch.Generator().manual_seed(1234)  # the same perturbation on every rank
            for d in densities:
                _perturb(state, d, g)
                run(sync, f"delta {d:g}", d)
            for k in range(2, REPEATS + 1 if HEADLINE_DENSITY in densities else 0):
                _perturb(state, HEADLINE_DENSITY, g)
                run(sync, f"delta {HEADLINE_DENSITY:g} #{k}", HEADLINE_DENSITY, repeat=True)
            _adam_step(state, lr, g)
            run(sync, "adam")
            t0 = time.perf_counter()
            sync.verify()  # engine digests == trainer snapshot (raises on a mismatch, on every rank)
            verify_s = time.perf_counter() - t0
            diff_alone_s = _diff_alone(sync, state, g) if world == 1 else None
        finally:
            sync.close()
        # the same trainer with its weights in flat buffers: deltas diff whole buffers
        run.engines, run.bucket = engines, bucket
        _flat_pass(run, state, g, lr)
        return {"pid": os.getpid(), "rows": rows, "verify_s": round(verify_s, 4), "verified": True,
                "digest_marginal": digest_cost, "diff_alone_s": diff_alone_s}
    finally:
        dist.destroy_process_group()


def _trainer(world, files, url, bucket, densities, lr, timeout):
    from launchers.ranks import run_ranks

    return run_ranks(_trainer_rank, world, files, url, bucket, densities, lr, timeout, timeout=timeout,
                     init_world=False)


# ---- Megatron fast path --------------------------------------------------------------------------


def _megatron_rank(rank, world, port, path, ep, steps, lr, seq, bucket, timeout_s, tp=1, pp=1):
    import torch.distributed as dist

    _init_gloo(rank, world, port, timeout_s)
    try:
        from megatron.core import parallel_state

        from delta_sync.memory_receiver import MemoryReceiver
        from launchers.megatron_trainer import MegatronTrainer
        from update_weight import build_updater
        from update_weight.args import UpdateWeightConfig
        from update_weight.megatron_shard_delta import MegatronShardDelta
        from update_weight.megatron_source import BridgeExportSource

        t0 = time.perf_counter()
        trainer = MegatronTrainer.from_hf(path, tp=tp, pp=pp, ep=ep, lr=lr)
        load_s = time.perf_counter() - t0
        rows = []

        def rx_bytes():
            return sum(t.numel() * t.element_size() for rx in (receiver, full_rx) if rx is not None
                       for t in rx.tensors.values())

        def sync(updater, source, label):
            dist.barrier()
            start, rx0 = _rss(os.getpid()) or 0, rx_bytes()
            _own_peak_reset()
            rep = updater.update_weights(source)
            # growth at the peak while it ran (on rank 0 with the in-process receiver's copy), and
            # what stays once it returned (host memory: snapshots, the map, allocator caches),
            # without that copy
            peak = _own_peak() - start
            held = (_rss(os.getpid()) or 0) - start - (rx_bytes() - rx0)
            rows.append({"label": label, "kind": rep.kind, "total_s": rep.timings.get("total_s"), "held_bytes": held,
                         "peak_bytes": peak,
                         "timings": dict(rep.timings), "pause_window_s": rep.pause_window_s,
                         "payload_bytes": rep.payload_bytes, "changed_fraction": rep.changed_fraction,
                         "changed_elements": rep.changed_elements, "total_elements": rep.total_elements})
            if rank == 0:
                r = rows[-1]
                print(f"[e2e] [megatron] {label} ({rep.kind}): {r['total_s']:.3f} s, pause "
                      f"{rep.pause_window_s:.3f} s, changed {100 * rep.changed_fraction:.4f}%, payload "
                      f"{rep.payload_bytes / 1e6:.2f} MB, rank 0 peak {peak / 1e6:+.0f} MB, holds {held / 1e6:+.0f} MB after, "
                      f"stages {rep.timings}", flush=True)

        # the engine stand-ins live in rank 0 (one thread, like every rank here): they apply on the
        # host's cores, as an engine's worker does on its own while the trainer ranks wait. One for
        # the fast path, one for the export-only seed below; both take one untimed export-only seed
        # first, since an engine's parameters exist before any seed: a receiver's first seed would
        # also fault its 656 MB in on rank 0 while rank 1 waits in Bridge's collectives (on this
        # host, as slow as 0.3 s a GB), and the process its first export's calls
        receiver = MemoryReceiver(threads=os.cpu_count()) if rank == 0 else None
        full_rx = MemoryReceiver() if rank == 0 else None
        warm = build_updater(UpdateWeightConfig.of("full", bucket_bytes=bucket), [receiver, full_rx] if rank == 0 else [])
        try:
            dist.barrier()
            cold_export_s = warm.update_weights(BridgeExportSource(trainer.bridge, trainer.model)).timings["total_s"]
        finally:
            warm.close()
        # the fast path: its seed learns the shard map, then every delta is shard-local
        source = MegatronShardDelta(trainer.bridge, trainer.model)
        updater = build_updater(UpdateWeightConfig.of("delta", bucket_bytes=bucket),
                                [receiver] if rank == 0 else [])
        try:
            sync(updater, source, "seed")
            vocab = trainer.bridge.hf_pretrained.config.vocab_size
            g = torch.Generator().manual_seed(0)
            dp_rank = parallel_state.get_data_parallel_rank()
            dp = parallel_state.get_data_parallel_world_size()
            for step in range(steps):
                ids = torch.randint(3, vocab, (2 * dp, seq), generator=g)
                trainer.step(ids[dp_rank::dp])
                sync(updater, source, f"step {step}")
            exported = list(BridgeExportSource(trainer.bridge, trainer.model))  # independent export, every rank
            bad = receiver.mismatched(exported) if rank == 0 else []
            del exported
            fast_on = source.ready()
        finally:
            updater.close()
        # the plain bulk path for comparison: Bridge's export streamed by a full-mode updater
        full = build_updater(UpdateWeightConfig.of("full", bucket_bytes=bucket), [full_rx] if rank == 0 else [])
        try:
            sync(full, BridgeExportSource(trainer.bridge, trainer.model), "export seed")
            if rank == 0:
                bad += [f"export seed: {n}" for n in full_rx.mismatched(receiver.tensors.items())]
        finally:
            full.close()
        return {"rows": rows, "mismatched": bad, "fast_path": fast_on, "load_s": round(load_s, 2),
                "cold_export_s": round(cold_export_s, 3),
                "seed_held_bytes": rows[0]["held_bytes"], "seed_peak_bytes": rows[0]["peak_bytes"]}
    finally:
        dist.destroy_process_group()


def _megatron(kind, ranks, ep, steps, lr, seq, reps, timeout, tp=1, pp=1):
    from delta_sync.checkpoints import build
    from launchers.ranks import run_ranks

    path = build(kind)
    files = _safetensors(path)
    size = _checkpoint_size(files)
    bucket = _bucket_for(size["bytes"])
    _say(f"megatron: {kind} ({size['elements'] / 1e6:.0f}M params, {size['bytes'] / 1e9:.3f} GB), {ranks} ranks "
         f"TP={tp} PP={pp} EP={ep}, bucket {bucket / MIB:.0f} MiB")
    wire = _wire(files, bucket, reps, timeout)
    _say(f"megatron wire: {wire['seconds']:.3f} s ({wire['gbps']} GB/s, {wire['chunks']} chunks)")
    res = run_ranks(_megatron_rank, ranks, str(path), ep, steps, lr, seq, bucket, timeout, tp, pp, timeout=timeout,
                    init_world=False)
    _wire_again(wire, files, bucket, reps, timeout, "after the ranks")
    rows, bad, fast = res[0]["rows"], res[0]["mismatched"], [r["fast_path"] for r in res]
    if bad or not all(fast):
        raise RuntimeError(f"megatron: receiver differs from an independent export ({bad[:3]}) "
                           f"or fast path off ({fast})")
    seed = rows[0]
    deltas = [r for r in rows if r["label"].startswith("step ")]
    export = next((r for r in rows if r["label"] == "export seed"), None)
    delta_s = statistics.median(r["total_s"] for r in deltas) if deltas else None
    out = {"model": kind, "params": size["elements"], "bytes": size["bytes"], "ranks": ranks, "tp": tp, "pp": pp, "ep": ep,
           "lr": lr, "steps": steps, "bucket_bytes": bucket, "wire": wire, "load_s": res[0]["load_s"],
           "rows": rows, "seed_s": seed["total_s"], "delta_s": delta_s, "cold_export_s": res[0]["cold_export_s"],
           "export_seed_s": export and export["total_s"],
           # the seeds' time reading their streams (Bridge's export; the fast path's also learns its map),
           # both into receivers that hold the model already (the warm-up seed filled them)
           "seed_read_over_export_read": _ratio(seed["timings"].get("prepare_s"),
                                                export and export["timings"].get("prepare_s")),
           "changed_fraction": statistics.median(r["changed_fraction"] for r in deltas) if deltas else None,
           "delta_payload_bytes": deltas[-1]["payload_bytes"] if deltas else None,
           "seed_over_wire": _ratio(seed["total_s"], wire["seconds"]),
           "export_seed_over_wire": _ratio(export and export["total_s"], wire["seconds"]),
           "delta_over_wire": _ratio(delta_s, wire["seconds"]),
           # per rank: memory still held after the seed (shard snapshots, map) over the model's bytes
           "seed_held_over_model": [_ratio(r["seed_held_bytes"], size["bytes"]) for r in res],
           # per rank: growth at the seed's peak over the model's bytes (rank 0: with the receiver's copy)
           "seed_peak_over_model": [_ratio(r["seed_peak_bytes"], size["bytes"]) for r in res], "exact": True}
    _say(f"megatron: seed {out['seed_s']:.3f} s ({out['seed_over_wire']} x wire; export-only seed "
         f"{out['export_seed_s']} s; reading the stream {out['seed_read_over_export_read']} x the export's, both "
         f"after an untimed export-only seed into both receivers of {out['cold_export_s']} s), delta "
         f"{delta_s if delta_s is None else round(delta_s, 3)} s ({out['delta_over_wire']} x wire), changed "
         f"{out['changed_fraction']}, receiver == export bit for bit")
    return out


# ---- summary, plot -------------------------------------------------------------------------------


def _ratio(a, b, digits: int = 4):
    if a is None or b is None or not b:
        return None
    return round(a / b, digits)


def _memory(rows0: list[dict], results: list[dict], sampler: RssSampler, model_bytes: int, bucket: int) -> None:
    """Attach RSS windows to rank 0's rows: the engine tree, and every rank (its own windows)."""
    firsts = {}
    for res in results:
        first = res["rows"][0]
        firsts[res["pid"]] = sampler.window(res["pid"], first["t0"], first["t0"])
    for i, row in enumerate(rows0):
        eng = sampler.window("engine", row["t0"], row["t1"])
        row["engine_rss"] = eng
        row["engine_growth_over_bucket"] = _ratio(eng["growth"], bucket) if eng else None
        ranks = []
        for res in results:
            r = res["rows"][i]
            w = sampler.window(res["pid"], r["t0"], r["t1"])
            start = (firsts.get(res["pid"]) or {}).get("before")
            if w:
                w.update(peak_over_model=_ratio(w["peak"], model_bytes),
                         growth_over_model=_ratio(w["growth"], model_bytes),
                         growth_from_start_over_model=_ratio(w["peak"] - start, model_bytes) if start else None)
            ranks.append(w)
        row["trainer_rss"] = ranks


def _pass_summary(rows: list[dict], wire_s: float, digest_marginal_s: float = 0.0) -> dict:
    by = {r["label"]: r for r in rows}
    runs: dict[float, list[dict]] = {}  # density -> its deltas (the headline's run REPEATS times)
    for r in rows:
        if r["kind"] == "delta" and r["density"] is not None:
            runs.setdefault(r["density"], []).append(r)
    best = {d: min(rs, key=lambda r: r["total_s"]) for d, rs in runs.items()}
    deltas = list(best.values())
    head = min(deltas, key=lambda r: abs(math.log(r["density"] / HEADLINE_DENSITY))) if deltas else None
    fulls = [r for r in rows if r["kind"] == "full"]
    head_runs = runs.get(head["density"], []) if head else []

    def worst(rs: list[dict], value) -> float | None:
        vals = [v for v in map(value, rs) if v is not None]
        return max(vals) if vals else None
    seeds = [r for r in rows if r["label"] == "seed" or r["label"].startswith("seed #")]
    first_seed = by.get("seed")  # the engine's first: it also probes the loader views
    seed = min(seeds, key=lambda r: r["total_s"]) if seeds else None
    full = min(fulls, key=lambda r: r["total_s"]) if fulls else None
    adam = by.get("adam")
    flat_runs = [r for r in rows if r["label"].startswith("flat delta")]  # FlatWeights (_flat_pass)
    flat = min(flat_runs, key=lambda r: r["total_s"]) if flat_runs else None
    flat_adam = by.get("flat adam")

    def stall(row):
        """How long vLLM ran no step for this delta: its worker's receive call (the engine core
        waits in ``collective_rpc`` while the worker receives, checks and plans) and then the pause
        window (pause, apply, resume). None without the worker's timing."""
        call = ((row or {}).get("engine_timings") or {}).get("update_call_s")
        return None if call is None else round(call + row["pause_window_s"], 6)

    def trainer_growth(row):
        if not row or not row.get("trainer_rss"):
            return None
        vals = [w["growth_over_model"] for w in row["trainer_rss"] if w and w.get("growth_over_model") is not None]
        return max(vals) if vals else None

    return {
        "seed_s": seed and seed["total_s"], "full_s": full and full["total_s"],
        # every run of the repeated updates; the ratios take the best, as the wire's does
        "seed_runs_s": [r["total_s"] for r in seeds], "first_seed_s": first_seed and first_seed["total_s"],
        "full_runs_s": [r["total_s"] for r in fulls],
        "headline_runs_s": [r["total_s"] for r in head_runs],
        "reseed_s": by.get("reseed", {}).get("total_s"),
        # its pause window: the send and the apply only (its snapshot is staged outside it)
        "reseed_pause_s": by.get("reseed", {}).get("pause_window_s"),
        "delta_s": {f"{r['density']:g}": r["total_s"] for r in deltas},
        "delta_pause_s": {f"{r['density']:g}": r["pause_window_s"] for r in deltas},
        "delta_stall_s": stall(head), "flat_delta_stall_s": stall(flat),
        "delta_changed_fraction": {f"{r['density']:g}": r["changed_fraction"] for r in deltas},
        "adam_s": adam and adam["total_s"], "adam_density": adam and adam["changed_fraction"],
        "adam_pause_s": adam and adam["pause_window_s"],
        "headline_density": head and head["density"],
        "seed_over_wire": _ratio(seed and seed["total_s"], wire_s),
        # a delta-mode trainer's seed: it also builds its snapshot (in fresh pages)
        "reseed_over_wire": _ratio(by.get("reseed", {}).get("total_s"), wire_s),
        "full_over_wire": _ratio(full and full["total_s"], wire_s),
        "delta_over_wire": _ratio(head and head["total_s"], wire_s),
        "delta_pause_over_wire": _ratio(head and head["pause_window_s"], wire_s),
        "adam_over_wire": _ratio(adam and adam["total_s"], wire_s),
        # the same trainer, its weights in flat buffers (FlatWeights): the headline deltas and Adam
        "flat_reseed_s": by.get("flat reseed", {}).get("total_s"),
        "flat_delta_s": flat and flat["total_s"], "flat_delta_runs_s": [r["total_s"] for r in flat_runs],
        "flat_delta_pause_s": flat and flat["pause_window_s"], "flat_adam_s": flat_adam and flat_adam["total_s"],
        "flat_delta_over_wire": _ratio(flat and flat["total_s"], wire_s),
        "flat_adam_over_wire": _ratio(flat_adam and flat_adam["total_s"], wire_s),
        # verification's cost, measured beside the sync, same run (see _digest_marginal): what the
        # digest adds to the sender's checking pass, the engine's digest of what it received, and
        # the engine's own bucket checks (check_s)
        "verify_over_seed": _ratio((seed or {}).get("engine_check_s", 0.0) + digest_marginal_s,
                                   seed and seed["total_s"]),
        # the default drift sweep's share of a delta: the trainer's digests of the next window and
        # the engine's, which travel back with the start call (no call of their own)
        "sweep_over_delta": _ratio(sum((head or {}).get("timings", {}).get(k, 0.0) for k in ("sweep_s", "sweep_engine_s")),
                                   head and head["total_s"]),
        # how busy the host's cores were (see cpu_share): CPU-bound updates read near 1
        "seed_cores_busy": seed and seed.get("cpu", {}).get("busy"),
        "full_cores_busy": full and full.get("cpu", {}).get("busy"),
        "delta_cores_busy": head and head.get("cpu", {}).get("busy"),
        "engine_seed_peak_over_bucket": worst(seeds, lambda r: r.get("engine_growth_over_bucket")),
        # memory: the worst of the repeated runs (the first one allocates what the others reuse)
        "engine_full_peak_over_bucket": worst(fulls, lambda r: r.get("engine_growth_over_bucket")),
        "engine_delta_peak_over_bucket": worst(head_runs, lambda r: r.get("engine_growth_over_bucket")),
        # a delta-mode trainer's seed (the "reseed" row) also stages its snapshot: that is the bound
        "trainer_seed_peak_over_model": trainer_growth(by.get("reseed") or first_seed),
        "trainer_fullmode_seed_peak_over_model": trainer_growth(first_seed),
        "trainer_full_peak_over_model": worst(fulls, trainer_growth),
        "trainer_delta_peak_over_model": worst(head_runs, trainer_growth),
    }


def _headline(summary: dict, key: str = "delta_s") -> float | None:
    """The headline density's value of a pass summary's per-density ``key``."""
    head = summary.get("headline_density")
    return None if head is None else (summary.get(key) or {}).get(f"{head:g}")


def _plot(result: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - the JSON is the result; the picture is a convenience
        return f"no plot: {type(e).__name__}: {e}"
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.5))
    refs = [("wire (raw broadcast)", result.get("wire_s"), "k", "-"),
            ("vLLM load_weights", result.get("vllm_load_s"), "tab:purple", "--"),
            ("seed", result.get("seed_s"), "tab:red", "--"), ("full", result.get("full_s"), "tab:orange", "--")]
    for label, y, color, style in refs:
        if y:
            ax.axhline(y, color=color, linestyle=style, linewidth=1.5, label=f"{label}: {y:.2f} s")
    for passname, marker, color in (("one_rank", "o", "tab:blue"), ("two_ranks", "s", "tab:green")):
        p = result.get(passname)
        if not p:
            continue
        rows = [r for r in p["rows"] if r["kind"] == "delta" and r["density"] is not None and not r.get("repeat")]
        n = p["ranks"]
        ranks = f"{n} trainer rank{'s' * (n > 1)}"
        if rows:
            x = [max(r["changed_fraction"], 1e-9) for r in rows]
            ax.plot(x, [r["total_s"] for r in rows], marker + "-", color=color, label=f"delta total, {ranks}")
            ax.plot(x, [max(r["pause_window_s"], 1e-6) for r in rows], marker + ":", color=color, alpha=0.6,
                    label=f"delta pause window, {ranks}")
        adam = next((r for r in p["rows"] if r["label"] == "adam"), None)
        if adam:
            ax.plot([max(adam["changed_fraction"], 1e-9)], [adam["total_s"]], "*", color=color, markersize=15,
                    markeredgecolor="k", label=f"AdamW step, {ranks}: {100 * adam['changed_fraction']:.3f}% changed")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("changed fraction of elements")
    ax.set_ylabel("seconds per update")
    ax.set_title(f"update time vs density ({result['model']})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", framealpha=0.8)

    labels, values, colors = [], [], []
    for passname, shade in (("one_rank", ("tab:blue", "tab:orange")), ("two_ranks", ("lightsteelblue", "navajowhite"))):
        p = result.get(passname) or {}
        head = p.get("summary", {}).get("headline_density")
        picked = [r for r in p.get("rows", []) if not r.get("repeat") and (r["label"] in ("seed", "full", "adam") or
                  (head is not None and r["density"] == head))]
        for side, color in zip(("engine", "trainer"), shade):
            for r in picked:
                if side == "engine":
                    v = (r.get("engine_rss") or {}).get("growth")
                else:  # the largest rank
                    v = max((w["growth"] for w in r.get("trainer_rss") or [] if w), default=None)
                if v is not None:
                    labels.append(f"{side}, {p['ranks']} rank{'s' * (p['ranks'] > 1)}: {r['label']}")
                    values.append(v / 1e9)
                    colors.append(color)
    if values:
        bx.bar(range(len(values)), values, color=colors)
        bx.set_xticks(range(len(values)), labels, fontsize=6, rotation=90)
    bx.axhline(result["bucket_bytes"] / 1e9, color="tab:blue", linestyle="--", label="bucket bytes")
    bx.axhline(result["model_bytes"] / 1e9, color="k", linestyle="--", label="model bytes")
    bx.set_ylabel("peak RSS growth over the value before the update (GB)")
    bx.set_title("peak memory per side (engine = server process tree; trainer = its largest rank)", fontsize=10)
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _measure(args, result: dict, path: Path, files: list[Path], size: dict, bucket: int, densities: list[float],
             worlds: list[int], skip: set[str], sampler: RssSampler, out: Path) -> None:
    """Every phase, in order, into ``result``; the engine and every spawned process are stopped on the way out."""
    from delta_sync.channel import free_port
    from launchers.equivalence import greedy, start_engine, stop_engine, tokenize, wait_ready

    # 1. the wire: a raw broadcast of the model's bytes over gloo, same bucket size
    wire = _wire(files, bucket, args.wire_reps, args.timeout)
    result["wire"] = wire
    result["wire_s"] = wire["seconds"]
    _say(f"wire: {wire['seconds']:.3f} s for {size['bytes'] / 1e9:.3f} GB ({wire['gbps']} GB/s, "
         f"{wire['chunks']} chunks, times {wire['times_s']}; cores busy {wire['cpu_best']['busy']:.0%}, "
         f"stolen {wire['cpu_best']['stolen']:.0%})")
    # 2. vLLM's own full load from memory
    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    if "vllm_load" not in skip:
        load = _spawned(_vllm_load, str(path), args.load_reps, args.kv_cache_bytes, args.max_model_len,
                        timeout=args.timeout, env=env)
        result["vllm_load"] = load
        result["vllm_load_s"] = load["seconds"]
        _say(f"vLLM load_weights from memory: {load['seconds']:.3f} s ({load['threads']} threads, "
             f"times {load['times_s']})")
    # 3. apply vs vLLM's patch loader, diff vs copy
    if "apply" not in skip:
        apply = _spawned(_apply_bench, args.cache, args.layers, args.model, timeout=args.timeout, env=env)
        result["apply"] = apply
        result["apply_over_native"] = apply["apply_over_native"]
        _say(f"apply at {HEADLINE_DENSITY:g}: views / vLLM patch loader = {apply['apply_over_native']}")
    if "diff" not in skip:
        diff = _spawned(_diff_bench, args.diff_gib, timeout=args.timeout)
        result["diff"] = diff
        result["diff_over_copy"] = diff["diff_over_copy"]
        _say(f"diff ({args.diff_gib} GiB): diff_over_copy {diff['diff_over_copy']} ({diff['kernel']}, "
             f"{diff['diff_gbps']} vs copy {diff['copy_gbps']} GB/s)")

    # 4. one HTTP engine; trainer passes of 1 and 2 ranks
    if worlds:
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        log = out / "engine.log"
        t0 = time.perf_counter()
        proc = start_engine(path, port, log, extra=["--max-model-len", str(args.max_model_len),
                                                     "--kv-cache-memory-bytes", str(args.kv_cache_bytes)])
        engine_pids: list[int] = []
        try:
            sampler.set_engine(proc.pid)
            wait_ready(proc, base, log)
            engine_pids = _tree(proc.pid)
            result["engine_start_s"] = round(time.perf_counter() - t0, 2)
            _say(f"engine up at {base} in {result['engine_start_s']} s (pids {engine_pids}), RSS "
                 f"{sum(_rss(p) or 0 for p in engine_pids) / 1e9:.2f} GB")
            prompt_ids = tokenize(base, PROMPTS)
            passes = []
            for world in worlds:
                _say(f"trainer pass: {world} rank(s)")
                res = _trainer(world, files, base, bucket, densities, args.lr, args.timeout)
                engine_pids = sorted(set(engine_pids) | set(_tree(proc.pid)))
                rows = res[0]["rows"]
                _memory(rows, res, sampler, size["bytes"], bucket)
                outputs = greedy(base, prompt_ids)
                if not all(o["token_ids"] for o in outputs):
                    raise RuntimeError(f"engine generated nothing after the {world}-rank pass: {outputs}")
                passes.append((world, rows, res[0]["digest_marginal"]["marginal_s"]))
                result[_pass_key(world)] = {
                    "ranks": world, "pids": [r["pid"] for r in res], "rows": rows,
                    "digest_marginal": res[0]["digest_marginal"], "verify_s": res[0]["verify_s"],
                    "diff_alone_s": res[0]["diff_alone_s"],
                    "verified": all(r["verified"] for r in res), "greedy_token_ids": [o["token_ids"] for o in outputs]}
                for r in rows:
                    eng = r.get("engine_rss") or {}
                    tr = [w for w in r.get("trainer_rss") or [] if w]
                    _say(f"[{world}r] {r['label']:>12}: {r['total_s']:.3f} s "
                         f"({_ratio(r['total_s'], wire['seconds'], 3)} x wire), pause {r['pause_window_s']:.3f} s, "
                         f"engine +{eng.get('growth', 0) / 1e6:.0f} MB "
                         f"({r.get('engine_growth_over_bucket')} x bucket), "
                         "trainer peak " + ", ".join(f"{w['peak'] / 1e9:.2f} GB (+{w['growth'] / 1e6:.0f} MB)"
                                                     for w in tr))
                if res[0]["diff_alone_s"] is not None:
                    _say(f"[{world}r] the diff of a {HEADLINE_DENSITY:g} step alone (no sync around it): "
                         f"{res[0]['diff_alone_s']} s")
                _say(f"[{world}r] verify (engine digests == trainer) ok in {res[0]['verify_s']} s; greedy tokens "
                     f"{[o['token_ids'][:6] for o in outputs]}")
            _wire_again(wire, files, bucket, args.wire_reps, args.timeout, "engine up")  # idle: as during the passes
            result["wire_s"] = wire["seconds"]
            for world, rows, marginal in passes:
                result[_pass_key(world)]["summary"] = _pass_summary(rows, wire["seconds"], marginal)
        finally:
            engine_pids = sorted(set(engine_pids) | set(_tree(proc.pid)))
            sampler.set_engine(None)
            try:
                stop_engine(proc)
            finally:
                _kill_pids([p for p in engine_pids if p != proc.pid])  # an engine core orphaned by the stop

    # 5. Megatron fast path (after the engine stopped: its memory and cores are free)
    if args.megatron:
        result["megatron"] = _megatron(args.megatron_model, args.megatron_ranks, args.megatron_ep,
                                       args.megatron_steps, 1e-6, args.megatron_seq, args.wire_reps, args.timeout,
                                       tp=args.megatron_tp, pp=args.megatron_pp)


def _pass_key(world: int) -> str:
    return {1: "one_rank", 2: "two_ranks"}.get(world, f"ranks_{world}")


# ---- main ----------------------------------------------------------------------------------------


def main(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m delta_sync.bench e2e", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="layers of the random Qwen3-0.6B-shaped checkpoint")
    ap.add_argument("--model", default=None, help="an existing HF checkpoint directory (*.safetensors) instead")
    ap.add_argument("--model-kind", default=None,
                    help="a checkpoint of delta_sync.checkpoints built here instead, e.g. moe-30b-skeleton "
                         "(Qwen3-30B-A3B's 18,867 tensor names and layout at tiny dimensions; -L<n>: n layers)")
    ap.add_argument("--bucket-bytes", type=int, default=None, help="default: model bytes / 8, at most 512 MiB")
    ap.add_argument("--densities", default=DENSITIES)
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW step of the last delta")
    ap.add_argument("--wire-reps", type=int, default=3)
    ap.add_argument("--load-reps", type=int, default=2)
    ap.add_argument("--kv-cache-bytes", type=int, default=256 * MIB, help="the HTTP engine's KV cache")
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--trainer-ranks", default="1,2", help="trainer passes, by world size (the first is the headline)")
    ap.add_argument("--skip", default="", help="comma list of: vllm_load, apply, diff, engine (the HTTP engine "
                                               "and the trainer passes)")
    ap.add_argument("--engine-layout", choices=["contiguous", "transposed-standin"], default="contiguous",
                    help="transposed-standin: the engine's (and vLLM's own load's) MoE experts transposed after "
                         "loading, a CPU stand-in for vLLM-Ascend's layout (DELTA_SYNC_CPU_MOE_TRANSPOSED_STANDIN)")
    ap.add_argument("--diff-gib", type=float, default=0.5)
    ap.add_argument("--megatron", action=argparse.BooleanOptionalAction, default=True,
                    help="Megatron fast-path section (slow)")
    ap.add_argument("--megatron-model", default="moe-e2e", help="a MoE kind of delta_sync.checkpoints")
    ap.add_argument("--megatron-ranks", type=int, default=2)
    ap.add_argument("--megatron-ep", type=int, default=2)
    ap.add_argument("--megatron-tp", type=int, default=1)
    ap.add_argument("--megatron-pp", type=int, default=1)
    ap.add_argument("--megatron-steps", type=int, default=2)
    ap.add_argument("--megatron-seq", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800, help="per phase, seconds")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "bench"))
    ap.add_argument("--out", default=str(ROOT / ".cache" / "bench" / "e2e"))
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    densities = [float(x) for x in args.densities.split(",") if x.strip()]
    worlds = [int(x) for x in args.trainer_ranks.split(",") if x.strip()]
    if "engine" in skip:
        worlds = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.engine_layout == "transposed-standin":  # every engine process of the run inherits it
        from patches.engine_options import CPU_MOE_TRANSPOSED_ENV

        os.environ[CPU_MOE_TRANSPOSED_ENV] = "1"

    from benchmarks.apply import _checkpoint

    if args.model_kind:
        from delta_sync.checkpoints import build

        args.model = str(build(args.model_kind))
    path = Path(args.model) if args.model else _checkpoint(Path(args.cache), args.layers)
    files = _safetensors(path)
    size = _checkpoint_size(files)
    bucket = args.bucket_bytes or _bucket_for(size["bytes"])
    model_name = (f"{path.name}" if args.model else f"Qwen3-0.6B shapes, {args.layers} layers") + \
        f" ({size['elements'] / 1e6:.0f}M params, {size['bytes'] / 1e9:.3f} GB bf16)"
    _say(f"model {model_name}; bucket {bucket / MIB:.1f} MiB; densities {densities}; trainer passes {worlds}")
    result: dict = {"bench": "e2e", "model": model_name, "checkpoint": str(path), "model_bytes": size["bytes"],
                    "params": size["elements"], "tensors": size["tensors"], "bucket_bytes": bucket,
                    "densities": densities, "lr": args.lr, "cpus": os.cpu_count(), "engine_layout": args.engine_layout}
    t_run = time.perf_counter()
    sampler = RssSampler()
    sampler.start()

    def terminated(signum, frame):  # SIGTERM (e.g. `timeout`): unwind, so that the engine and ranks are stopped
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminated) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        _measure(args, result, path, files, size, bucket, densities, worlds, skip, sampler, out)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        sampler.stop()
        (out / "rss.json").write_text(json.dumps(sampler.dump()))
    result["wall_s"] = round(time.perf_counter() - t_run, 1)

    s = (result.get(_pass_key(worlds[0])) or {}).get("summary", {}) if worlds else {}
    two = (result.get("two_ranks") or {}).get("summary", {})
    result.update({k: s.get(k) for k in ("seed_s", "full_s", "reseed_s", "delta_s", "delta_pause_s", "adam_s",
                                         "adam_density")})
    result["vllm_load_over_wire"] = _ratio(result.get("vllm_load_s"), result["wire_s"])
    headline = {
        "bench": "e2e", "model": model_name, "model_bytes": size["bytes"], "bucket_bytes": bucket,
        "engine_layout": args.engine_layout, "wire_s": result["wire_s"], "wire_gbps": result["wire"]["gbps"], "vllm_load_s": result.get("vllm_load_s"),
        "seed_s": s.get("seed_s"), "first_seed_s": s.get("first_seed_s"), "full_s": s.get("full_s"),
        "reseed_s": s.get("reseed_s"), "reseed_pause_s": s.get("reseed_pause_s"), "delta_s": s.get("delta_s"),
        "delta_pause_s": s.get("delta_pause_s"), "delta_stall_s": s.get("delta_stall_s"),
        "flat_delta_stall_s": s.get("flat_delta_stall_s"),
        "adam_density": s.get("adam_density"), "adam_s": s.get("adam_s"),
        "seed_over_wire": s.get("seed_over_wire"), "reseed_over_wire": s.get("reseed_over_wire"),
        "full_over_wire": s.get("full_over_wire"),
        "delta_over_wire": s.get("delta_over_wire"), "delta_pause_over_wire": s.get("delta_pause_over_wire"),
        "adam_over_wire": s.get("adam_over_wire"), "vllm_load_over_wire": result["vllm_load_over_wire"],
        "flat_delta_s": s.get("flat_delta_s"), "flat_delta_pause_s": s.get("flat_delta_pause_s"),
        "flat_adam_s": s.get("flat_adam_s"), "flat_reseed_s": s.get("flat_reseed_s"),
        "flat_delta_over_wire": s.get("flat_delta_over_wire"),
        # against vLLM's own load of the whole model from memory (the scale goals' yardstick)
        **{f"{k}_over_vllm_load": _ratio(v, result.get("vllm_load_s"))
           for k, v in (("seed", s.get("seed_s")), ("full", s.get("full_s")), ("delta", _headline(s)),
                        ("delta_pause", _headline(s, "delta_pause_s")), ("flat_delta", s.get("flat_delta_s")),
                        ("flat_delta_pause", s.get("flat_delta_pause_s")), ("delta_stall", s.get("delta_stall_s")),
                        ("flat_delta_stall", s.get("flat_delta_stall_s")))},
        "verify_over_seed": s.get("verify_over_seed"), "sweep_over_delta": s.get("sweep_over_delta"),
        "engine_seed_peak_over_bucket": s.get("engine_seed_peak_over_bucket"),
        "engine_delta_peak_over_bucket": s.get("engine_delta_peak_over_bucket"),
        "trainer_seed_peak_over_model": s.get("trainer_seed_peak_over_model"),
        "trainer_delta_peak_over_model": s.get("trainer_delta_peak_over_model"),
        "apply_over_native": result.get("apply_over_native"),
        "diff_over_copy": result.get("diff_over_copy"),
        # the host's cores busy during the best wire run and during the headline updates
        "cores_busy": {"wire": result["wire"]["cpu_best"]["busy"], "seed": s.get("seed_cores_busy"),
                       "full": s.get("full_cores_busy"), "delta": s.get("delta_cores_busy")},
        "two_ranks": {k: two.get(k) for k in ("seed_s", "full_s", "reseed_s", "reseed_pause_s", "delta_s",
                                              "adam_s", "adam_density",
                                              "seed_over_wire", "reseed_over_wire", "full_over_wire",
                                              "delta_over_wire",
                                              "delta_pause_over_wire", "trainer_seed_peak_over_model",
                                              "engine_seed_peak_over_bucket")} if two else None,
        "megatron": {k: result["megatron"][k] for k in ("model", "params", "seed_s", "export_seed_s", "delta_s",
                                                        "seed_read_over_export_read",
                                                        "changed_fraction", "seed_over_wire", "delta_over_wire",
                                                        "seed_held_over_model", "seed_peak_over_model")}
        | {"wire_s": result["megatron"]["wire"]["seconds"]} if result.get("megatron") else None,
        "wall_s": result["wall_s"], "out": str(out),
    }
    result["headline"] = headline
    try:
        problem = _plot(result, out / "e2e.png")
    except Exception as e:  # noqa: BLE001 - the JSON is the result; the picture is a convenience
        problem = f"plot failed: {type(e).__name__}: {e}"
    if problem:
        _say(problem)
    result["plot"] = None if problem else str(out / "e2e.png")
    (out / "e2e.json").write_text(json.dumps(result, indent=1))
    _say(f"wrote {out / 'e2e.json'}" + ("" if problem else f" and {out / 'e2e.png'}") + f" ({result['wall_s']} s)")
    return headline
