"""A trainer process that dies for real (SIGKILL) at a chosen point of an update: the fault tests'
sender. ``python -m tests.fault_trainer URL MODEL_DIR send|finish|seed``

It seeds the engine with the checkpoint, syncs version 1 (``evolve(state, 1)``) and prints
``SYNCED 1``, then starts a 30%-dense version 2 and kills itself: ``send`` after the second
bucket left (the workers are receiving a staged delta; the engine still serves), ``finish`` with
the engine paused and v2 staged, right before the finish call (where the one-call commit would
pause and finish, it pauses alone, then dies); ``seed``: a new session's seed of version 2, after
its second bucket was written in place (the engine paused, its weights half v1, half v2). The kill is the test's doing, in this script; the
library has no hook for it."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from delta_sync.channel import Channel
from delta_sync.engines import HttpEngine
from delta_sync.sync import WeightSync
from tests.engine_helpers import evolve, load_state


def main() -> None:
    url, model, where = sys.argv[1], sys.argv[2], sys.argv[3]
    state = load_state(Path(model))
    sync = WeightSync([url], bucket_bytes=64 << 10)
    sync.update(state.items())
    evolve(state, 1)
    sync.update(state.items())
    print("SYNCED 1", flush=True)
    if where == "exit":
        os._exit(0)
    g = torch.Generator().manual_seed(7)
    for t in state.values():
        flat = t.view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[: int(0.3 * flat.numel())]
        flat[pos] = (flat[pos].float() + 0.5).to(flat.dtype)
    if where in ("send", "seed"):
        original, sent = Channel.send_bucket, [0]

        def send_bucket(self, bucket):
            original(self, bucket)
            sent[0] += 1
            if sent[0] == 2:
                print(f"KILL {where}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        Channel.send_bucket = send_bucket
        if where == "seed":
            sync.close()
            sync = WeightSync([url], bucket_bytes=64 << 10)  # a new session: its first update is a seed
    else:
        def finish(self, version):
            print("KILL finish", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

        def commit(self, version, mode="wait"):
            self.pause(mode)
            finish(self, version)
        HttpEngine.finish, HttpEngine.commit = finish, commit
    sync.update(state.items())
    print("NOT KILLED", flush=True)


if __name__ == "__main__":
    main()
