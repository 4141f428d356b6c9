"""The failure contract of DESIGN.md on four real trainer ranks (gloo) and a memory receiver:
after each failure no rank hangs, the snapshot stays at v-1, and the next update is exact.

The injections are shared with the Megatron four-rank scenario (tests/test_megatron_trainer.py)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch.distributed as dist

from delta_sync.errors import EngineError
from delta_sync.sync import WeightSync

from launchers.ranks import run_ranks
from .test_channel import model_at

WORLD = 4


def _exact(receiver, version) -> bool:
    return receiver.mismatched(model_at(version).items()) == []


class ExportFailure(Exception):
    pass


def with_nan(stream, name: str):
    """A diverged step: one exported tensor carries a NaN (found before anything is sent)."""
    for n, t in stream:
        if n == name:
            t = t.clone()
            t.view(-1)[3] = float("nan")
        yield n, t


def failing_on(stream, rank: int, bad_rank: int, at: int):
    """The export raises on ``bad_rank`` after ``at`` tensors (a non-sender rank)."""
    for i, item in enumerate(stream):
        if rank == bad_rank and i == at:
            raise ExportFailure(f"export of tensor {i} failed on rank {rank}")
        yield item


class _Poisoned:
    """An exported tensor whose conversion fails on this rank (raises when the sync reads it)."""

    def __init__(self, message: str):
        self.message = message

    def detach(self):
        raise ExportFailure(self.message)


def poisoned_on(stream, rank: int, bad_rank: int, at: int):
    """Tensor ``at`` fails to convert on ``bad_rank``, while the stream itself goes on: the shape of
    a failure in a collective export (Bridge), where the failing rank must stay in step."""
    for i, (n, t) in enumerate(stream):
        yield n, (_Poisoned(f"conversion of {n} failed on rank {rank}") if rank == bad_rank and i == at else t)


@contextlib.contextmanager
def sender_dies_mid_send(rank: int, sync: WeightSync):
    """On the sender, packing the second bucket raises: one bucket already went out."""
    from delta_sync import transfer

    if rank != 0:
        yield
        return
    real, options = transfer.BucketPacker.pack, sync.options

    def broken_pack(self, patches, **kwargs):
        for i, b in enumerate(real(self, patches, **kwargs)):
            if i == 1:
                raise RuntimeError("sender died while packing bucket 1")
            yield b
    transfer.BucketPacker.pack = broken_pack
    sync.options = dataclasses.replace(options, bucket_bytes=256)  # several buckets
    try:
        yield
    finally:
        transfer.BucketPacker.pack, sync.options = real, options


@contextlib.contextmanager
def receiver_rejects(receiver):
    """The engine stages the update, then rejects it."""
    if receiver is None:
        yield
        return
    real = receiver.update

    def failing_update(info):
        real(info)
        raise EngineError(receiver.name, "receiver rejected the update", kind="update")
    receiver.update = failing_update
    try:
        yield
    finally:
        receiver.update = real


@contextlib.contextmanager
def report_fails(receiver):
    """The engine applies the update, then its digest report (the verification) fails."""
    if receiver is None:
        yield
        return
    real = receiver.report

    def failing_report(digests=False, names=None):
        if digests:
            raise EngineError(receiver.name, "report crashed", kind="report")
        return real(digests, names)
    receiver.report = failing_report
    try:
        yield
    finally:
        receiver.report = real


class Attempts:
    """Runs an update on every rank and logs its outcome; a barrier after each proves nobody hangs."""

    def __init__(self, update):
        self.update, self.log = update, []

    def __call__(self, label, stream, expect=None):
        try:
            self.update(stream)
            outcome = "ok"
        except Exception as e:
            outcome = type(e).__name__
            if expect is not None and expect not in str(e):
                outcome = f"{outcome} without {expect!r}: {e}"
        self.log.append((label, outcome))
        dist.barrier()


FAILURES = ["PatchValidationError", "GatherError", "RuntimeError", "EngineError"]


def check_outcomes(results, n_before: int, failures=FAILURES):
    """Rank 0's log: ok x n_before, the failures, then ok; every rank saw the same outcomes."""
    log = results[0][0]
    outcomes = [y for _, y in log]
    assert outcomes[:n_before] == ["ok"] * n_before, log
    assert outcomes[n_before:n_before + len(failures)] == failures, log
    assert all(y == "ok" for y in outcomes[n_before + len(failures):]), log
    for other in results[1:]:
        assert [y != "ok" for _, y in other[0]] == [y != "ok" for _, y in log]


def _scenario(rank, world, port):
    from delta_sync.memory_receiver import MemoryReceiver

    receiver = MemoryReceiver() if rank == 0 else None
    sync = WeightSync([receiver] if rank == 0 else [], mode="delta", verify_every=1, drift_sweep=0, timeout_s=20)
    attempt = Attempts(lambda stream: sync.update(stream))

    attempt("seed", model_at(0).items())
    attempt("delta", model_at(1).items())
    attempt("nan before send", with_nan(model_at(2).items(), "layers.0.norm"))
    attempt("export failure", failing_on(model_at(2).items(), rank, 2, 3), expect="rank 2")
    attempt("conversion failure", poisoned_on(model_at(2).items(), rank, 2, 3), expect="rank 2")
    with sender_dies_mid_send(rank, sync):
        attempt("sender mid-send", model_at(2).items())
    with receiver_rejects(receiver):
        attempt("receiver failure", model_at(2).items())
    with report_fails(receiver):  # applied, but not verifiable: every rank hears it, the next update seeds
        attempt("report failure in verify", model_at(2).items(), expect="digest report failed")
    # after all of that: the next updates are exact
    attempt("delta after failures", model_at(2).items())
    attempt("delta", model_at(3).items())
    exact = _exact(receiver, 3) if rank == 0 else None
    version = sync.version
    sync.close()
    return attempt.log, exact, version


def test_failures_keep_every_rank_consistent_and_next_update_exact():
    results = run_ranks(_scenario, WORLD, timeout=300)
    log, exact, version = results[0]
    assert [x for x, _ in log] == ["seed", "delta", "nan before send", "export failure", "conversion failure",
                                   "sender mid-send", "receiver failure", "report failure in verify",
                                   "delta after failures", "delta"]
    check_outcomes(results, 2, ["PatchValidationError", "GatherError", "GatherError", "RuntimeError",
                                "EngineError", "DriftDetected"])
    assert exact and version == 4  # v2 was applied before its verification failed
    assert all(other_version == 4 for _, _, other_version in results[1:])
