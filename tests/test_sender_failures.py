"""The failure contract of DESIGN.md on four real trainer ranks (gloo) and a reference receiver:
after each failure no rank hangs, the snapshot stays at v-1, and the next update is exact."""

from __future__ import annotations

import torch
import torch.distributed as dist

from delta_sync.errors import EngineError, GatherError
from delta_sync.sync import WeightSync

from .multiproc import run_ranks
from .test_channel import model_at

WORLD = 4


def _exact(receiver, version) -> bool:
    want = model_at(version)
    return all(torch.equal(receiver.tensors[n].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8))
               for n, t in want.items())


def _scenario(rank, world, port):
    from delta_sync import transfer

    from .reference_receiver import ReferenceReceiver

    receiver = ReferenceReceiver() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", verify_every=1, timeout_s=20)
    log = []

    def attempt(label, version, state=None):
        try:
            sync.update((state or model_at(version)).items())
            log.append((label, "ok"))
        except Exception as e:
            log.append((label, type(e).__name__))
        dist.barrier()  # every rank got here: nobody hangs in a collective

    attempt("seed", 0)
    attempt("delta", 1)
    # 1. validation failure before send: a NaN produced on rank 0's owned tensor
    bad = model_at(2)
    bad["layers.0.norm"].view(-1)[3] = float("nan")
    attempt("nan before send", 2, bad)
    # 2. export failure on a non-sender rank
    class Boom(Exception):
        pass

    def failing_stream(v):
        for i, (n, t) in enumerate(model_at(v).items()):
            if rank == 2 and i == 3:
                raise Boom("export of layers.1.w failed on rank 2")
            yield n, t
    try:
        sync.update(failing_stream(2))
        log.append(("export failure", "ok"))
    except GatherError as e:
        log.append(("export failure", "GatherError" if "rank 2" in str(e) else str(e)))
    dist.barrier()
    # 3. sender failure mid-send: the second bucket cannot be packed
    if rank == 0:
        real = transfer.BucketPacker.pack

        def broken_pack(self, patches):
            for i, b in enumerate(real(self, patches)):
                if i == 1:
                    raise RuntimeError("sender died while packing bucket 1")
                yield b
        transfer.BucketPacker.pack = broken_pack
        sync.bucket_bytes = 256  # several buckets: the failure comes after one was sent
    attempt("sender mid-send", 2)
    if rank == 0:
        transfer.BucketPacker.pack = real
    # 4. receiver failure while staging
    if rank == 0:
        real_update = receiver.update

        def failing_update(info):
            real_update(info)
            raise EngineError(receiver.name, "receiver rejected the update", kind="update")
        receiver.update = failing_update
    attempt("receiver failure", 2)
    if rank == 0:
        receiver.update = real_update
    # after all of that: the next updates are exact
    attempt("delta after failures", 2)
    attempt("delta", 3)
    exact = _exact(receiver, 3) if rank == 0 else None
    version = sync.version
    sync.close()
    return log, exact, version


def test_failures_keep_every_rank_consistent_and_next_update_exact():
    results = run_ranks(_scenario, WORLD, timeout=300)
    log, exact, version = results[0]
    labels = [x for x, _ in log]
    outcomes = [y for _, y in log]
    assert labels == ["seed", "delta", "nan before send", "export failure", "sender mid-send", "receiver failure",
                      "delta after failures", "delta"]
    assert outcomes[0:2] == ["ok", "ok"] and outcomes[6:] == ["ok", "ok"]
    assert outcomes[2:6] == ["PatchValidationError", "GatherError", "RuntimeError", "EngineError"], log
    assert exact and version == 3
    for other_log, _, other_version in results[1:]:
        assert [y != "ok" for _, y in other_log] == [y != "ok" for _, y in log]  # same outcome everywhere
        assert other_version == 3
