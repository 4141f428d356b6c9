"""Send and receive one whole update (all buckets of a version) over a :class:`Channel`.

The sender streams buckets; the last carries ``last=True``. An update can be aborted by a final
bucket of kind ``abort`` whose header carries the reason: receivers discard what they staged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

from .bucket import Bucket, BucketPacker, TensorAssembler, DEFAULT_BUCKET_BYTES
from .channel import Channel
from .errors import DeltaSyncError
from .patch import Patch

import torch


class UpdateAborted(DeltaSyncError):
    """The sender aborted the update it had started; receivers discard it."""


@dataclass
class SendStats:
    buckets: int = 0
    tensors: int = 0
    elements: int = 0
    payload_bytes: int = 0
    pack_s: float = 0.0
    send_s: float = 0.0


@dataclass
class ReceivedUpdate:
    version: int
    kind: str
    patches: list[Patch] = field(default_factory=list)
    buckets: int = 0
    payload_bytes: int = 0


def send_update(channel: Channel, version: int, kind: str, patches: Iterable[Patch],
                bucket_bytes: int = DEFAULT_BUCKET_BYTES, checksum: bool = True) -> SendStats:
    stats = SendStats()
    packer = BucketPacker(version, kind, bucket_bytes, checksum)
    names = set()
    it = iter(packer.pack(_count(patches, stats, names)))
    while True:
        t0 = time.perf_counter()
        try:
            bucket = next(it)
        except StopIteration:
            break
        t1 = time.perf_counter()
        channel.send_bucket(bucket)
        t2 = time.perf_counter()
        stats.pack_s += t1 - t0
        stats.send_s += t2 - t1
        stats.buckets += 1
        stats.payload_bytes += bucket.payload_bytes
    stats.tensors = len(names)
    return stats


def _count(patches: Iterable[Patch], stats: SendStats, names: set):
    for p in patches:
        stats.elements += p.count
        if p.count or p.dense:
            names.add(p.name)
        yield p


def send_abort(channel: Channel, version: int, reason: str) -> None:
    header = {"version": version, "seq": -1, "last": True, "kind": "abort", "reason": reason,
              "entries": [], "index_count": 0, "value_counts": {}, "checksum": None}
    channel.send_bucket(Bucket(header, torch.empty(0, dtype=torch.int32), {}))


def receive_update(channel: Channel, kept: str | None = None) -> ReceivedUpdate:
    """Receive buckets until the last one; returns the assembled per-tensor patches.

    Raises :class:`UpdateAborted` for an aborted update and the typed validation errors of
    :mod:`delta_sync.bucket` for a corrupt one (after draining the rest of the update, so the
    channel stays in step with the sender).
    """
    asm = TensorAssembler(kept)
    first_error: Exception | None = None
    update: ReceivedUpdate | None = None
    expect_seq = 0
    while True:
        bucket = channel.recv_bucket()
        h = bucket.header
        if h["kind"] == "abort":
            raise UpdateAborted(f"sender aborted version {h['version']}: {h.get('reason')}", kept=kept)
        if update is None:
            update = ReceivedUpdate(int(h["version"]), h["kind"])
        update.buckets += 1
        update.payload_bytes += bucket.payload_bytes
        if first_error is None:
            try:
                if h["seq"] != expect_seq or h["version"] != update.version:
                    raise DeltaSyncError(f"bucket out of order: got v{h['version']} seq {h['seq']}, "
                                         f"expected v{update.version} seq {expect_seq}", kept=kept)
                asm.add(bucket)
            except Exception as e:  # keep draining so the channel stays in step
                first_error = e
        expect_seq += 1
        if h["last"]:
            break
    if first_error is not None:
        raise first_error
    update.patches = asm.patches()
    return update
