"""Spawn real trainer ranks on this host (gloo on CPU), with a hard deadline: tests and benchmarks.

``run_ranks(fn, world, *args)`` starts ``world`` processes running ``fn(rank, world, port, *args)``
and returns each rank's return value; an exception in any rank raises :class:`RanksFailed` with
that rank's traceback, and a rank that is still alive at the deadline raises it as a hang.
"""

from __future__ import annotations

import os
import time
import traceback

import torch.multiprocessing as mp

from delta_sync.channel import free_port


class RanksFailed(AssertionError):
    """A spawned rank raised, died without a result, or hung (an AssertionError, so tests read it as one)."""


def _entry(fn, rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, "ok", fn(rank, world, port, *args)))
    except BaseException as e:  # noqa: BLE001 - report, never hang the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_ranks(fn, world: int, *args, timeout: float = 120.0, init_world: bool = True):
    """Run ``fn`` on ``world`` spawned ranks; with ``init_world`` the default gloo group is set up."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    target = _with_world if init_world else fn
    procs = [ctx.Process(target=_entry, args=(target, r, world, port, (fn, *args) if init_world else args, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    import queue as q

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, status, value = queue.get(timeout=1.0)
            except q.Empty:
                alive = [i for i, p in enumerate(procs) if p.is_alive()]
                if not alive:  # every rank exited; one died without reporting (crash, kill)
                    codes = {i: p.exitcode for i, p in enumerate(procs)}
                    raise RanksFailed(f"ranks exited without a result, exit codes {codes}") from None
                if time.monotonic() > deadline:
                    raise RanksFailed(f"ranks {alive} still running after {timeout}s: hang") from None
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise RanksFailed("\n".join(f"rank {r} failed: {m}" for r, m in sorted(errors.items())))
    return [results[r] for r in range(world)]


def _with_world(rank, world, port, fn, *args):
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        return fn(rank, world, port, *args)
    finally:
        dist.destroy_process_group()
