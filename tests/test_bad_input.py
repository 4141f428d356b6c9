"""Bad input at the public API, on one trainer process and the in-memory receiver: each kind is
refused with a typed error naming what was wrong and what was kept, nothing reaches the receiver,
and the next good update is exact. (Wire-level kinds: tests/test_patch_diff_digest.py,
tests/test_auth.py, tests/test_vllm_receiver.py::test_bad_updates_rejected_and_outputs_unchanged;
docs/bad-input.md lists them all.)"""

import threading
import time

import pytest
import torch

from delta_sync.errors import DeltaSyncError, PatchValidationError
from delta_sync.memory_receiver import MemoryReceiver
from delta_sync import prepare as prepare_module
from delta_sync.sync import WeightSync


def _state():
    g = torch.Generator().manual_seed(3)
    return {f"layers.{i}.w": torch.randn(16, 8, generator=g).to(torch.bfloat16) for i in range(4)}


def _bad_stream(kind: str, state: dict):
    items = list(state.items())
    if kind == "duplicate name":
        return items + [items[1]]
    if kind == "left out":
        return items[:2] + items[3:]
    if kind == "new name":
        return items + [("layers.9.w", torch.ones(3, dtype=torch.bfloat16))]
    if kind == "dtype kind":
        return [(n, t.float() if i == 2 else t) for i, (n, t) in enumerate(items)]
    if kind == "shape":
        return [(n, t.reshape(8, 16) if i == 2 else t) for i, (n, t) in enumerate(items)]
    if kind == "non-finite":
        bad = items[2][1].clone()
        bad.view(-1)[5] = float("nan")
        return items[:2] + [(items[2][0], bad)] + items[3:]
    if kind == "too large for int32":  # a view of 2**31 elements: no memory behind it
        return items + [("huge", torch.zeros(1, dtype=torch.bfloat16).expand(1 << 31))]
    if kind == "unsupported dtype":
        return items + [("ints", torch.ones(4, dtype=torch.int8))]
    raise AssertionError(kind)


@pytest.mark.parametrize("kind,match", [
    ("duplicate name", "given twice"), ("left out", "left out of this delta"),
    ("new name", "not in the seed"), ("dtype kind", "shape/dtype changed"), ("shape", "shape/dtype changed"),
    ("non-finite", "non-finite")])
@pytest.mark.parametrize("batch", [1, None], ids=["diffed-one-by-one", "diffed-in-one-batch"])
def test_bad_delta_is_refused_before_anything_is_sent(kind, match, batch, monkeypatch):
    """One by one, the tensors ahead of the bad one were diffed and their snapshots advanced before
    the error: the rollback must put them back for the next delta to carry their changes."""
    if batch is not None:
        monkeypatch.setattr(prepare_module, "DIFF_BATCH_TENSORS", batch)
    state = _state()
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], timeout_s=60)
    try:
        sync.update(state.items())
        for t in state.values():
            t.view(-1)[::5] += 1
        with pytest.raises(DeltaSyncError, match=match) as e:
            sync.update(_bad_stream(kind, state))
        assert "kept" in str(e.value)
        assert receiver.version == 0 and sync.version == 0  # nothing reached the receiver
        rep = sync.update(state.items())
        assert rep.kind == "delta" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


@pytest.mark.parametrize("kind,match", [("empty", "no tensors"), ("duplicate name", "given twice"),
                                        ("too large for int32", "int32"), ("unsupported dtype", "not supported"),
                                        ("non-finite", "non-finite")])
def test_bad_seed_is_refused_and_the_next_update_seeds(kind, match, caplog):
    """A seed streams: what came before the bad tensor may already be applied, so the receiver is
    left without a version (needs_seed, DESIGN's row for a failed seed) and the next update seeds.
    A one-rank delta trainer (this one) packs its whole seed before the engines pause: nothing of
    a bad one is sent at all."""
    state = _state()
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], timeout_s=60)
    try:
        with pytest.raises(PatchValidationError, match=match) as e:
            sync.update([] if kind == "empty" else _bad_stream(kind, state))
        assert "kept" in str(e.value)
        assert receiver.version is None and sync.needs_seed
        assert receiver.tensors == {}  # found before the first bucket left: nothing was sent
        assert "engines untouched" in caplog.text  # and the log does not claim they were paused
        assert sync.update(state.items()).kind == "seed" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def test_an_integer_tensor_for_float_weights_is_refused_not_cast():
    """``WeightSync(dtype=bf16)`` converts float tensors of another width; an integer tensor given
    for a float weight (a user's mistake: token ids, a step counter) would be cast and written as
    weights. It is refused, naming the tensor, and nothing is sent."""
    state = _state()
    receiver = MemoryReceiver()
    sync = WeightSync([receiver], dtype=torch.bfloat16, timeout_s=60)
    try:
        bad = dict(state, **{"layers.2.w": torch.ones(16, 8, dtype=torch.int64)})
        with pytest.raises(PatchValidationError, match="'layers.2.w': is torch.int64, not a floating tensor like "
                                                       "the torch.bfloat16 weights"):
            sync.update(bad.items())
        assert receiver.tensors == {}
        assert sync.update(state.items()).kind == "seed" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


def _bucket():
    """One good bucket holding a sparse and a dense entry."""
    from delta_sync.bucket import BucketPacker
    from delta_sync.patch import Patch

    sparse = Patch("s", (4, 8), torch.bfloat16, torch.tensor([1, 9, 30], dtype=torch.int32),
                   torch.ones(3, dtype=torch.bfloat16))
    dense = Patch.full("d", torch.arange(12, dtype=torch.float32).to(torch.bfloat16).reshape(3, 4))
    return next(BucketPacker(5, "delta", 1 << 20).pack([sparse, dense]))


def _break(field: str, bucket) -> None:
    """Break ``field`` of ``bucket``'s first entry or of its last, a dense one."""
    sparse, dense = bucket.header["entries"][0], bucket.header["entries"][-1]
    if field == "unknown dtype":
        sparse["dtype"] = "complex32"
    elif field == "unknown encoding":
        dense["encoding"] = "rle"
    elif field == "value offset outside the buffer":
        dense["value_offset"] = 10_000
    elif field == "entries that do not tile the buffer":
        dense["value_offset"] += 1
        dense["count"] -= 1
    elif field == "dense range outside its tensor":
        dense["start"] = 5
    elif field == "dense entry without a digest":
        dense["digest"] = None
    elif field == "count that disagrees with the buffers":
        sparse["count"] = 2
    elif field == "values that do not match the digest":
        bucket.values["bfloat16"][-1] += 1
    elif field == "negative shape":
        dense["shape"] = [-d for d in dense["shape"]]
    else:
        raise AssertionError(field)


@pytest.mark.parametrize("field,match", [
    ("unknown dtype", "unknown dtype"), ("unknown encoding", "unknown encoding"),
    ("value offset outside the buffer", "outside the bfloat16 value buffer"),
    ("entries that do not tile the buffer", "tile the value buffer"),
    ("dense range outside its tensor", r"dense range \[5, 17\) outside 12"),
    ("dense entry without a digest", "without a digest"),
    ("count that disagrees with the buffers", "must tile the value buffer"),
    ("values that do not match the digest", "digest")])
def test_receiver_refuses_malformed_bucket_entries(field, match):
    """What a buggy or hostile sender could put in a bucket header (checked by every receiver before
    it stages or applies anything; the header's checksum is off so each field check is reached)."""
    from delta_sync.bucket import entry_patches

    bucket = _bucket()
    bucket.header["checksum"] = None
    entry_patches(bucket)  # the unbroken bucket is fine
    _break(field, bucket)
    with pytest.raises(DeltaSyncError, match=match):
        entry_patches(bucket, kept="engine on v4")


def _dense_bucket():
    """One good seed bucket of dense entries only, of two dtypes, under a channel's key (the last
    one as :func:`_bucket`'s dense entry)."""
    from delta_sync.bucket import BucketPacker
    from delta_sync.digest import DigestKey
    from delta_sync.patch import Patch

    g = torch.Generator().manual_seed(3)
    packer = BucketPacker(5, "seed", 1 << 20)
    packer.keys = lambda nonce: DigestKey.derive(b"k" * 32, nonce)
    return next(packer.pack([Patch.full(n, torch.randn(s, generator=g).to(dt)) for n, s, dt in
                             [("b", (5,), torch.float32), ("c", (2, 2), torch.bfloat16), ("a", (3, 4), torch.bfloat16)]]))


@pytest.mark.parametrize("field,match", [
    (None, None), ("unknown dtype", "unknown dtype"), ("unknown encoding", "unknown encoding"),
    ("value offset outside the buffer", "outside the bfloat16 value buffer"),
    ("entries that do not tile the buffer", "tile the value buffer"),
    ("dense range outside its tensor", r"dense range \[5, 17\) outside 12"),
    ("dense entry without a digest", "without a digest"), ("negative shape", "invalid shape"),
    ("values that do not match the digest", "digest")])
def test_a_dense_bucket_read_as_lists_equals_entry_by_entry_and_refuses_alike(monkeypatch, field, match):
    """A seed's bucket of dense entries is read as whole lists (no round of checks per entry);
    it gives what reading entry by entry gives, and a malformed field makes it read entry by
    entry, which refuses naming what is wrong."""
    from delta_sync.bucket import _Tiling, entry_patches

    def read(bucket):
        return [(e["_at"], p.name, p.shape, p.dtype, p.values.view(torch.uint8).tolist())
                for e, p in entry_patches(bucket, check_dense=False)]

    bucket = _dense_bucket()
    bucket.header["checksum"] = None
    if field is None:
        assert _Tiling(bucket, None).dense_patches() is not None
        got = read(bucket)
        monkeypatch.setattr(_Tiling, "dense_patches", lambda self: None)
        assert got == read(_dense_bucket()) and [g[1] for g in got] == ["b", "c", "a"]
        return
    _break(field, bucket)
    if field != "values that do not match the digest":  # (values are the digest check's, after the read)
        assert _Tiling(bucket, None).dense_patches() is None
    with pytest.raises(DeltaSyncError, match=match):
        entry_patches(bucket, kept="engine on v4")


@pytest.mark.parametrize("raw", [b"{not json", b'{"version": 1, "seq": 0}', b'{"version": 1, "se', b"[]"])
def test_receiver_refuses_malformed_or_truncated_headers(raw):
    from delta_sync.bucket import parse_header

    with pytest.raises(PatchValidationError, match="malformed header"):
        parse_header(raw)


class _SlowToStart(MemoryReceiver):
    """A receiver whose ``start`` (a delta's, issued on a thread while the trainer diffs) returns
    late, and which knows whether an update session is open on it."""

    def __init__(self):
        super().__init__()
        self.session_open = False
        self.returned = threading.Event()  # a start call has returned

    def start(self, digest_names=None):
        self.returned.clear()
        time.sleep(0.5)  # the diff below fails within milliseconds
        self.session_open = True
        try:
            return super().start(digest_names)
        finally:
            self.returned.set()

    def discard(self) -> None:
        self.session_open = False
        super().discard()

    def finish(self, version: int) -> None:
        self.session_open = False
        super().finish(version)


@pytest.mark.parametrize("kind", ["left out", "non-finite"])
def test_a_delta_refused_while_its_start_is_in_flight_ends_that_session(kind):
    """The engines' ``start`` runs beside the diff. A diff refused before the first bucket must wait
    for that call and end the session it opened; else the engine stays mid-update (vLLM's worker
    keeps its update session) once the trainer has already said the update failed."""
    state = _state()
    receiver = _SlowToStart()
    sync = WeightSync([receiver], timeout_s=60)
    try:
        sync.update(state.items())
        assert not receiver.session_open
        with pytest.raises(PatchValidationError):
            sync.update(_bad_stream(kind, state))
        assert receiver.returned.wait(10)  # (at once where the update waited for its start call)
        assert not receiver.session_open and receiver.version == 0
        for t in state.values():
            t.view(-1)[::3] += 1
        rep = sync.update(state.items())
        assert rep.kind == "delta" and receiver.mismatched(state.items()) == []
    finally:
        sync.close()


@pytest.mark.parametrize("settings, named", [
    ({"bucket_bytes": 10}, r"bucket_bytes \(--update-weight-buffer-size\) = 10 must be at least 64"),
    ({"mode": "sparse"}, r"mode \(--update-weight-mode\) = 'sparse' must be one of delta, full"),
    ({"verify_every": -1}, r"verify_every \(--update-weight-verify-every\) = -1"),
    ({"port": 70000}, r"port \(--update-weight-master-port\) = 70000"),
    ({"pause_mode": "later"}, r"pause_mode = 'later' must be one of wait, abort, keep"),
    ({"timeout_s": 0}, "timeout_s = 0 must be a positive number"),
    ({"drift_sweep": -1}, "drift_sweep = -1 must be an integer >= 0"),
])
def test_a_bad_setting_is_refused_when_the_sync_is_built(settings, named):
    """One options object checks every setting once, at construction, naming the launcher flag
    that sets it, before any engine is contacted (a receiver that was never reached stays unused)."""
    from delta_sync.options import SyncOptions

    receiver = MemoryReceiver()
    with pytest.raises(ValueError, match=named):
        WeightSync([receiver], **settings)
    assert receiver.channel is None and receiver.version is None
    with pytest.raises(TypeError, match="not both"):
        WeightSync([receiver], SyncOptions(), mode="full")
    with pytest.raises(TypeError, match="bucket_size"):  # a misspelt setting is named too
        WeightSync([receiver], bucket_size=1 << 20)


@pytest.mark.parametrize("value,named", [("soon", "DELTA_SYNC_PEER_TIMEOUT_S='soon' is not a number of seconds"),
                                         ("0", "DELTA_SYNC_PEER_TIMEOUT_S='0' must be > 0 seconds")])
def test_a_bad_peer_timeout_is_named_when_the_channel_loads(value, named):
    """The channel's peer timeout is read on both ends (trainer and engine workers) when the
    channel module loads: a bad value stops the process there, naming the variable (it was a bare
    float() error, and 0 would have called every peer dead at once)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "DELTA_SYNC_PEER_TIMEOUT_S": value}
    out = subprocess.run([sys.executable, "-c", "import delta_sync.channel"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and named in out.stderr
    env["DELTA_SYNC_PEER_TIMEOUT_S"] = "2.5"
    out = subprocess.run([sys.executable, "-c", "import delta_sync.channel as c; print(c.PEER_TIMEOUT_S)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "2.5"
