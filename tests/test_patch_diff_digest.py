"""Single-process checks of the patch format, bitwise diff, snapshot store, digest and buckets."""

import pytest
import torch

from delta_sync import native
from delta_sync.bucket import BucketPacker, TensorAssembler, entry_patches
from delta_sync import diff as diff_module
from delta_sync.diff import BitwiseDiff, int_view, restore
from delta_sync.digest import Digest, DigestKey, digest_elements, digest_range, digest_tensor
from delta_sync.errors import ChecksumMismatch, PatchValidationError
from delta_sync.patch import Patch, PatchBatch, apply_patch
from delta_sync.snapshot import SnapshotStore

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _ref_changed(a, b):
    return (int_view(a) != int_view(b)).nonzero().squeeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 3, 8, 9, 33, 1000, 4099])
@pytest.mark.parametrize("chunk", [8, 64, 1 << 20])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_diff_matches_reference(dtype, n, chunk, offset, use_native):
    g = torch.Generator().manual_seed(n * 7 + chunk)
    a = torch.randn(n + offset, generator=g).to(dtype)
    b = a.clone()
    if n:
        k = torch.randint(0, n + offset, (max(1, n // 4),), generator=g)
        b[k] = b[k] * 2 + 1
    a, b = a[offset:], b[offset:]  # unaligned storage offset takes the element-width path
    p = BitwiseDiff(chunk, use_native=use_native).diff("t", a, b)
    ref = _ref_changed(a, b)
    assert torch.equal(p.indices.to(torch.int64), ref)
    assert torch.equal(int_view(p.values), int_view(b)[ref])
    p.validate()
    c = a.clone()
    apply_patch(c, p)
    assert torch.equal(int_view(c), int_view(b))


def test_native_kernel_builds_here():
    """The CI machine has a C compiler: a silent fallback would hide a broken kernel."""
    assert native.kernel() is not None
    assert native.supports(torch.zeros(8, dtype=torch.bfloat16))
    assert not native.supports(torch.zeros(8, dtype=torch.float64))  # torch-op path


def test_every_vector_flavour_of_the_kernel_gives_the_same_digests_and_diffs(monkeypatch, tmp_path):
    """The kernel is built for the host's vector extensions (AVX-512BW with or without VNNI, AVX2,
    neither); each flavour this host can run, built apart, gives the digests, Inf/NaN counts,
    copies and diffs of the one in use, so the flavours another host picks are tested here too."""
    import delta_sync.digest as dg
    if native.kernel() is None:
        pytest.skip("no C compiler here: the host kernel is not built")
    flavours = [f for f in ([], ["-mavx2"], ["-mavx2", "-mavx512f", "-mavx512bw"], native._cpu_flags())
                if set(f) <= set(native._cpu_flags())]
    flavours = [list(f) for f in dict.fromkeys(map(tuple, flavours))]
    monkeypatch.setenv("DELTA_SYNC_CACHE_DIR", str(tmp_path))
    libs = []
    for flags in flavours:
        monkeypatch.setattr(native, "_cpu_flags", lambda flags=flags: flags)
        libs.append(native.load(native._build()))
    assert len(set(map(str, tmp_path.iterdir()))) == len(flavours)  # each flavour its own build
    got = []
    for lib in libs:
        monkeypatch.setattr(native, "kernel", lambda lib=lib: lib)
        found = []
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(3 * dg.KEY_ROW + 77, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
            x[[5, 2000]] = float("nan")
            out = torch.zeros_like(x)
            found.append((dg.scan_range(x, 999, copy_to=out), int_view(out).tolist()))
            old, new = x.clone(), x.clone()
            new.view(-1)[::7] += 1
            found.append([t.tolist() for t in BitwiseDiff().changed(old, new)])
        got.append(found)
    assert all(f == got[0] for f in got[1:])


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_move_at_equals_torch_index_ops(dtype, pos_dtype):
    """The host kernel's patch writes and undo reads equal index_select/index_copy_ at ``offset +
    pos``, every width and position type, with the read and the write in one visit; a position
    outside the tensor is refused before anything is read or written."""
    g = torch.Generator().manual_seed(3)
    n, offset = 5000, 700
    base = torch.randint(0, 120, (n,), generator=g).to(dtype)
    pos = torch.randperm(n - offset, generator=g)[:1500].sort().values.to(pos_dtype)
    vals = torch.randint(0, 120, (pos.numel(),), generator=g).to(dtype)
    at = pos.to(torch.int64) + offset
    old = torch.empty_like(vals)
    assert native.move_at(base, pos, offset, old=old) and torch.equal(old, base[at])  # read only
    t = base.clone()
    assert native.move_at(t, pos, offset, values=vals)  # write only
    assert torch.equal(t, base.clone().index_copy_(0, at, vals))
    t, both = base.clone(), torch.empty_like(vals)
    assert native.move_at(t, pos, offset, values=vals, old=both)  # read, then write, in one visit
    assert torch.equal(both, base[at]) and torch.equal(t, base.clone().index_copy_(0, at, vals))
    assert native.move_at(t, pos, offset, values=both) and torch.equal(t, base)  # the undo
    for bad in (n - offset, -offset - 1):  # one past either end, last entry: nothing touched
        wrong = torch.cat([pos, torch.tensor([bad], dtype=pos_dtype)])
        mark = torch.full((wrong.numel(),), 7, dtype=dtype)
        with pytest.raises(IndexError, match=f"outside a tensor of {n} elements"):
            native.move_at(t, wrong, offset, values=vals[:1].repeat(wrong.numel()), old=mark)
        assert torch.equal(t, base) and bool((mark == 7).all())
    # a batch with one bad row touches none of its rows, whichever thread would have run them
    other = base.clone()
    with pytest.raises(IndexError, match="no patch of this batch"):
        native.move_rows([(other, pos, offset, vals, None), (t, wrong, offset, mark, None)], spans=[(0, 1), (1, 2)])
    assert torch.equal(other, base) and torch.equal(t, base)
    with pytest.raises(ValueError, match="row 1"):
        native.move_rows([(other, pos, offset, vals, None), (other, pos, offset, vals[:-1], None)])
    assert torch.equal(other, base)
    # what the kernel does not take is left to torch ops, untouched
    assert not native.move_at(base[::2], pos[:10], 0, values=vals[:10])  # strided target
    assert not native.move_at(base, pos, offset, values=vals.to(torch.float64))  # another dtype
    assert not native.move_at(base, pos, offset, values=vals[:-1])  # a count that does not match
    assert torch.equal(t, base)


@pytest.mark.parametrize("refused,kept", [("avx512", ["-mavx2"]),
                                           ("avx512vnni", ["-mavx2", "-mavx512f", "-mavx512bw"])])
def test_a_compiler_that_refuses_the_widest_vectors_still_builds_the_kernel(monkeypatch, tmp_path, caplog, refused,
                                                                             kept):
    """A compiler without AVX-512 support (flags refused) builds the AVX2 kernel instead of leaving
    every scan on the torch-op path, one without VNNI the AVX-512 kernel; the build that failed is
    logged."""
    if "-mavx2" not in native._cpu_flags():
        pytest.skip("the host has no AVX2: the narrower build would not run here")
    cc = tmp_path / "cc"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *{refused}*) echo "unknown flag" >&2; exit 1;; esac\nexec cc "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("DELTA_SYNC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native, "_cpu_flags", lambda: ["-mavx2", "-mavx512f", "-mavx512bw", "-mavx512vnni"])
    native.kernel.cache_clear()
    try:
        lib = native.kernel()
        assert lib is not None and "failed to build" in caplog.text
        assert lib._name == str(native._build(kept))  # the widest build the compiler took
        x = torch.randn(5000).bfloat16()
        assert digest_range(x, 3) == digest_range(x[:1000], 3) + digest_range(x[1000:], 1003)
    finally:
        native.kernel.cache_clear()


@pytest.mark.parametrize("env", [{"DELTA_SYNC_NATIVE_DIFF": "0"}, {"CC": "/nonexistent/cc"}])
def test_native_kernel_falls_back_to_torch_ops(monkeypatch, tmp_path, caplog, env):
    monkeypatch.setenv("DELTA_SYNC_CACHE_DIR", str(tmp_path))  # force a fresh build
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    native.kernel.cache_clear()
    try:
        assert native.kernel() is None and not native.supports(torch.zeros(8, dtype=torch.bfloat16))
        a = torch.zeros(64, dtype=torch.bfloat16)
        b = a.clone()
        b[[3, 40]] = 1
        assert BitwiseDiff().diff("t", a, b).indices.tolist() == [3, 40]
        if "CC" in env:
            assert "using the torch-op diff" in caplog.text
    finally:
        native.kernel.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.0, 0.001, 0.3, 1.0])
def test_native_diff_threads_and_bounded_scratch(monkeypatch, dtype, density):
    """Several threads, and scratch far smaller than the output: same patch as the torch ops."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 64)
    monkeypatch.setattr(native, "SCRATCH_ENTRIES", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(int(density * 1000))
    a = torch.randn(20011, generator=g).to(dtype)
    b = torch.where(torch.rand(a.shape, generator=g) < density, a * 3 + 1, a)
    b.view(-1)[-1] = -b.view(-1)[-1]  # ragged tail word and a changed sign
    got = BitwiseDiff(use_native=True).changed(a, b)
    ref = BitwiseDiff(use_native=False).changed(a, b)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert bool((got[0][1:] > got[0][:-1]).all())


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_diff_sized_by_the_last_one_makes_one_call_per_thread(monkeypatch, threads):
    """The kernel's first call of each thread gets room for its share of what the last batch of as
    many tensors found changed: a delta like the last one comes out of one call per thread (no join
    of chunks), one with more changes in more calls; every batch finds what the torch ops find and
    advances its snapshots the same."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 64)
    monkeypatch.setattr(native, "SCRATCH_ENTRIES", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calls = []
    real = native._outputs
    monkeypatch.setattr(native, "_outputs", lambda room, *a: calls.append(room) or real(room, *a))
    g = torch.Generator().manual_seed(threads)
    snaps = [torch.randn(n, generator=g).bfloat16() for n in (4096, 12, 9000, 4)]
    ref_snaps = [t.clone() for t in snaps]
    differ, ref = BitwiseDiff(use_native=True), BitwiseDiff(use_native=False)
    for step, density in enumerate((0.05, 0.05, 0.2)):
        news = [torch.where(torch.rand(t.shape, generator=g) < density, t * 3 + 1, t) for t in snaps]
        calls.clear()
        got = differ.absorb_many(list(zip(snaps, news)))
        want = ref.absorb_many(list(zip(ref_snaps, news)))
        for (i, v, o), (ri, rv, ro) in zip(got, want):
            assert torch.equal(i, ri) and torch.equal(v, rv) and torch.equal(o, ro)
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(snaps, ref_snaps))
        if step == 1:  # as many changes as the last batch: one call per thread
            assert len(calls) == threads and min(calls) > 64, calls
        if step == 2:  # four times as many: the first calls overflow, later ones follow
            assert len(calls) > threads, calls


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_diff_is_bitwise_not_float(use_native):
    nan, z = float("nan"), 0.0
    a = torch.tensor([nan, z, 1.0, -z, nan, 5.0, 6.0, 7.0, 8.0], dtype=torch.bfloat16)
    b = a.clone()
    b[1] = -z
    b.view(torch.int16)[4] = a.view(torch.int16)[4] ^ 1  # another NaN payload: still NaN, other bits
    assert torch.isnan(b[4])
    p = BitwiseDiff(8, use_native=use_native).diff("t", a, b)
    # same NaN bits: unchanged; +0 -> -0: changed; NaN -> NaN with other payload bits: changed
    assert p.indices.tolist() == [1, 4]


@pytest.mark.parametrize("fallback", [False, True], ids=["memcmp", "torch"])
def test_same_bytes_is_bitwise(monkeypatch, fallback):
    """The seed's map check compares bits: one flipped bit anywhere (the last element, a NaN payload,
    -0 against +0) is a difference, a strided view compares its own elements, and the two ways agree."""
    if fallback:
        monkeypatch.setattr(native, "_memcmp", lambda: None)
    a = torch.randn(1 << 16).to(torch.bfloat16).view(torch.int16)
    assert native.same_bytes(a, a.clone()) and native.same_bytes(a[:0], a[5:5])
    for at in (0, 1, a.numel() - 1):
        b = a.clone()
        b[at] ^= 1
        assert not native.same_bytes(a, b), at
    assert not native.same_bytes(a, a.to(torch.int32)) and not native.same_bytes(a, a[1:])
    zeros = torch.zeros(8, dtype=torch.bfloat16)
    assert not native.same_bytes(zeros.view(torch.int16), (-zeros).view(torch.int16))
    grid = a.view(256, 256)
    assert native.same_bytes(grid[:, 3], grid.t()[3].clone()) and not native.same_bytes(grid[:, 3], grid[:, 4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_advance_moves_the_snapshot_in_the_diff_pass_and_restore_undoes_it(monkeypatch, dtype, offset, use_native):
    """The snapshot holds the new bits after the diff, the patch equals a plain diff's, and the
    old bits it returns put every element back, bit for bit (NaN payloads, -0.0, ragged tail)."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 64)  # several ranges, several kernel calls
    monkeypatch.setattr(native, "SCRATCH_ENTRIES", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    g = torch.Generator().manual_seed(offset)
    base = torch.randn(20011 + offset, generator=g).to(dtype)
    base[offset + 7] = float("nan")
    new = torch.where(torch.rand(base.shape, generator=g) < 0.05, base * 3 + 1, base)[offset:]
    new[-1], new[0] = -new[-1], -0.0 if bool(base[offset] != 0) else 1.0
    int_view(new)[7] ^= 1  # the NaN with another payload
    snap = base[offset:]  # offset 1: unaligned, the element-width path
    before = snap.clone()
    differ = BitwiseDiff(64, use_native=use_native)
    want = differ.diff("t", before, new)
    patch, old_bits = differ.advance("t", snap, new)
    assert torch.equal(patch.indices, want.indices) and torch.equal(int_view(patch.values), int_view(want.values))
    assert torch.equal(int_view(snap), int_view(new))
    assert torch.equal(old_bits, int_view(before)[patch.indices.long()])
    restore(snap, patch.indices, old_bits)
    assert torch.equal(int_view(snap), int_view(before))
    with pytest.raises(ValueError, match="contiguous"):
        differ.advance("t", snap[::2], new[::2])


@pytest.mark.parametrize("use_native", [False, True], ids=["torch", "native"])
def test_a_diff_that_fails_midway_leaves_the_snapshot_as_it_was(monkeypatch, use_native):
    """Ranges advanced before another one failed are put back before the error leaves."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    differ = BitwiseDiff(64, use_native=use_native)
    if use_native:  # the second of two threads fails (after restoring its own range)
        real = native._scan

        def scan(fn, width, old64, new64, first, stop, lanes, absorb):
            if first:
                raise MemoryError("injected")
            return real(fn, width, old64, new64, first, stop, lanes, absorb)
        monkeypatch.setattr(native, "_scan", scan)
    else:  # the ragged tail fails after the whole words (16 chunks) were scanned; with nothing
        # put back on the way out, the snapshot must not have been written at all
        def tail(*args):
            raise MemoryError("injected")
        monkeypatch.setattr(BitwiseDiff, "_tail", staticmethod(tail))
        monkeypatch.setattr(diff_module, "restore", lambda *a: None)
    snap = torch.randn(4098).bfloat16()
    before = snap.clone()
    with pytest.raises(MemoryError, match="injected"):
        differ.absorb(snap, snap * 2)  # one tensor, split by words (advance_many: the test below)
    assert torch.equal(int_view(snap), int_view(before))


def _mixed_tensors(g):
    """Snapshots and new values the batch kernel takes (small, aligned, whole words: 10 of them, in 3
    dtypes) and ones it leaves to the one-by-one path (unaligned, a ragged tail, and on several
    threads one larger than a thread's share of the batch). With MIN_WORDS_PER_THREAD = 2048."""
    olds, news = [], []
    spec = [(torch.bfloat16, 4096, 0, 0.05)] * 6 + [
        (torch.float32, 998, 0, 0.05), (torch.bfloat16, 0, 0, 0.05), (torch.float16, 64, 0, 0.9),
        (torch.bfloat16, 4096, 1, 0.05), (torch.bfloat16, 1023, 0, 0.05), (torch.bfloat16, 1 << 15, 0, 0.01),
        (torch.float32, 4, 0, 0.0)]
    for dtype, n, off, density in spec:
        base = torch.randn(n + off, generator=g).to(dtype)[off:]
        new = base.clone()
        hit = torch.rand(n, generator=g) < density
        new[hit] = new[hit] * 3 + 1
        olds.append(base), news.append(new)
    return olds, news


@pytest.mark.parametrize("threads", [1, 3])
def test_advance_many_equals_one_by_one(monkeypatch, threads):
    """Many tensors diffed together (several kernel calls that stop inside and between tensors,
    several threads): the same patches as diffing each alone, every snapshot advanced, and
    restore puts every bit back."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 2048)
    monkeypatch.setattr(native, "SCRATCH_ENTRIES", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    olds, news = _mixed_tensors(torch.Generator().manual_seed(threads))
    before = [o.clone() for o in olds]
    calls = []
    real = native.changed_batch
    monkeypatch.setattr(native, "changed_batch", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    got = BitwiseDiff().advance_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))])
    # a 16-bit (bf16 + fp16) and a 32-bit batch, split over the threads by words (the big one, 64
    # KiB, cut between them); unaligned and ragged ones one by one
    assert calls == [9, 2]
    ref = BitwiseDiff(use_native=False)
    for i, ((patch, old_bits), b, n, o) in enumerate(zip(got, before, news, olds)):
        want = ref.diff(f"t{i}", b, n)
        assert patch.name == f"t{i}" and torch.equal(patch.indices, want.indices)
        assert torch.equal(int_view(patch.values), int_view(want.values))
        assert torch.equal(old_bits, int_view(b)[patch.indices.long()])
        assert torch.equal(int_view(o), int_view(n))
        restore(o, patch.indices, old_bits)
        assert torch.equal(int_view(o), int_view(b))


class _CountNonzero(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts ``nonzero`` calls: each one waits for the device there (its output size is data)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten.nonzero.default
        return func(*args, **(kwargs or {}))


def test_device_path_diffs_many_tensors_in_one_scan():
    """The torch-op path (what device tensors take) diffs a batch of small tensors in one scan: the
    same patches as one by one, snapshots advanced and restorable, and a few device syncs for the
    whole batch (3 nonzero) instead of ~3 per tensor; ragged and unaligned tensors go one by one,
    one larger than a batch in a scan of its own."""
    g = torch.Generator().manual_seed(11)
    olds, news = _mixed_tensors(g)
    for k in range(40):  # a model's many small tensors; every other one unchanged
        base = torch.randn(256, generator=g).to(torch.bfloat16)
        new = base.clone()
        if k % 2:
            new[torch.rand(256, generator=g) < 0.1] += 1
        olds.append(base), news.append(new)
    before = [o.clone() for o in olds]
    lanes = [8 // o.element_size() for o in olds]
    alone = [i for i, (o, k) in enumerate(zip(olds, lanes)) if o.numel() % k or o.storage_offset() % k]
    assert len(alone) == 2  # the unaligned and the ragged
    with _CountNonzero() as one_by_one:
        for i in alone:
            BitwiseDiff(use_native=False, chunk_words=4096).changed(olds[i], news[i])
    differ = BitwiseDiff(use_native=False, chunk_words=4096, batch_words=4096)
    with _CountNonzero() as batched:
        got = differ.advance_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))])
    # 16-bit tensors: 6 x 1024 + 16 + 40 x 64 words in three scans of <= 4096 words, the 8 192-word
    # one alone, a batch of 4096 words at a time (two scans); one scan for the 32-bit pair; 3
    # nonzero each
    assert batched.calls == 3 * 6 + one_by_one.calls, (batched.calls, one_by_one.calls)
    ref = BitwiseDiff(use_native=False)
    for i, ((patch, old_bits), b, n, o) in enumerate(zip(got, before, news, olds)):
        want = ref.diff(f"t{i}", b, n)
        assert torch.equal(patch.indices, want.indices) and patch.indices.dtype == torch.int32
        assert torch.equal(int_view(patch.values), int_view(want.values))
        assert torch.equal(old_bits, int_view(b)[patch.indices.long()])
        assert torch.equal(int_view(o), int_view(n))
        restore(o, patch.indices, old_bits)
        assert torch.equal(int_view(o), int_view(b))


@pytest.mark.parametrize("case,scans", [("one", 1), ("arena", 1), ("batches", 2)])
def test_device_path_scans_a_tensor_of_many_chunks_with_three_nonzero(case, scans):
    """The torch-op scan packs each chunk's word flags 8 to a byte and runs its ``nonzero`` levels
    once over all chunks: a tensor of 64 chunks (every pattern of 8 changed words among them, each
    lane of a word, NaN payloads, a sign flip) costs 3 nonzero like a tensor of one, finds every
    changed element and advances its snapshot; restore puts every bit back. ``arena``: two
    tensors back to back in one storage (a snapshot arena), scanned as one span (and one read of
    their counts); ``batches``: a tensor twice as large as a batch, scanned a batch at a time."""
    g = torch.Generator().manual_seed(5)
    words = 256 * 8 * 2  # each of the 256 byte patterns, twice
    arena = torch.randn(2 * words * 4, generator=g).bfloat16()
    olds = list(arena.split(words * 4)) if case == "arena" else [arena[:words * 4].clone()]
    news = []
    for o in olds:
        w = o.clone().view(-1, 8, 4)  # (group of 8 words, word, lane)
        for p in range(256):
            for k in range(8):
                if p >> k & 1:
                    for row in (p, 256 + p):
                        w[row, k, (p + k) % 4] = -w[row, k, (p + k) % 4]  # one lane: a sign flip
        w[3, 0, 0] = float("nan")
        news.append(w.view(-1))
    before = [o.clone() for o in olds]
    want = [(int_view(b) != int_view(n)).nonzero().squeeze(1) for b, n in zip(before, news)]  # (no scan)
    differ = BitwiseDiff(use_native=False, chunk_words=64, batch_words=words * 2 if scans == 1 else words // scans)
    with _CountNonzero() as counted:
        got = differ.advance_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))])
    assert counted.calls == 3 * scans, counted.calls
    for (patch, old_bits), idx, b, o, n in zip(got, want, before, olds, news):
        assert torch.equal(patch.indices.long(), idx) and torch.equal(int_view(patch.values), int_view(n)[idx])
        assert patch.indices.numel() == 2 * sum(bin(p).count("1") for p in range(256)) + 1
        assert torch.equal(old_bits, int_view(b)[patch.indices.long()])
        assert torch.equal(int_view(o), int_view(n))
        restore(o, patch.indices, old_bits)
        assert torch.equal(int_view(o), int_view(b))


def test_a_snapshots_kernel_facts_are_forgotten_when_it_is_replaced():
    """What the kernel needs of a snapshot is worked out at its first diff and kept: a seed that
    replaces the snapshot (commit of a full value), a reset and a clear forget it, so a snapshot in
    other memory is looked at again."""
    store = SnapshotStore()
    a, b = torch.randn(64).bfloat16(), torch.randn(6).bfloat16()  # b: 12 bytes, not whole words
    store.prepare_many([("a", a.clone()), ("b", b.clone())])
    store.commit(0)
    store.prepare_many([("a", a + 1), ("b", b + 1)])
    assert {n: f.kernel.width for n, f in store._facts.items()} == {"a": 2, "b": 0}
    store.commit(1)
    store.prepare_many([("a", a)], full=True)
    store.commit(2)
    assert {n: f.kernel.width for n, f in store._facts.items()} == {"b": 0}
    store.reset()
    assert {n: f.kernel.width for n, f in store._facts.items()} == {}
    store.prepare_many([("a", a), ("b", b)])
    store.commit(3)
    store.prepare_many([("a", a + 1), ("b", b)])
    assert {n: f.kernel.width for n, f in store._facts.items()} == {"a": 2, "b": 0}
    store.clear()
    assert {n: f.kernel.width for n, f in store._facts.items()} == {}


def test_kernel_facts_of_many_snapshots_equal_each_ones_own():
    """A store's first delta after a seed works out its snapshots' kernel facts together: the same
    width, words and address as one by one, for word-aligned and misaligned views, sizes that are
    not whole words, 4-byte and 1-byte elements and (one by one then) a strided view."""
    from delta_sync.diff import kernel_facts, kernel_facts_many

    flat = torch.zeros(64, dtype=torch.bfloat16)
    snaps = [flat[:8], flat[4:12], flat[1:9], flat[8:14], torch.zeros(6, dtype=torch.float32),
             torch.zeros(5, dtype=torch.float32), torch.zeros(16, dtype=torch.uint8)]
    got = kernel_facts_many(snaps)
    assert got == list(map(kernel_facts, snaps))
    assert [f.width for f in got] == [2, 2, 0, 0, 4, 0, 0]
    strided = flat.view(8, 8)[:, :4]
    assert kernel_facts_many([*snaps, strided]) == [*got, kernel_facts(strided)]


def _patches(out):
    """``name -> (indices, value bits)`` of a prepare_many's output, batches split per tensor."""
    got = {}
    for p in out:
        if isinstance(p, PatchBatch):
            for name, idx, vals in zip(p.names, p.indices.split(p.counts), p.values.split(p.counts)):
                got[name] = (idx.tolist(), int_view(vals).tolist())
        elif p is not None:
            got[p.name] = (p.indices.tolist() if p.indices is not None else None, int_view(p.values).tolist())
    return got


def _seeded_and_changed(stores, base: dict[str, torch.Tensor], every: int) -> dict[str, torch.Tensor]:
    """Each store seeded with ``base`` and one delta past it (a store learns its snapshots' facts at
    a first diff); ``base`` with every ``every``-th element of each tensor changed."""
    for store in stores:
        store.prepare_many([(n, t.clone()) for n, t in base.items()], full=True)
        store.commit(0)
        store.prepare_many([(n, t.clone()) for n, t in base.items()])
        store.commit(1)
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        t.view(-1)[::every] += 1
    return new


@pytest.mark.parametrize("path", ["host kernel", "torch ops"])
@pytest.mark.parametrize("case", ["usual", "unaligned", "strided", "two-widths", "reshaped", "requires-grad"])
def test_a_delta_of_known_snapshots_checked_as_lists_equals_the_tensor_by_tensor_path(case, path, monkeypatch):
    """A delta whose every tensor is scanned in one width takes the store's list-wise checks
    (``_prepare_known``; on the torch-ops path devices take, ``_prepare_flat``: the scan batches'
    layout kept, the new tensors joined in one call), a parameter that requires grad among them
    (read by address or joined without a graph; a dense patch's copy comes detached); anything else
    (a new tensor not word-aligned or not contiguous, a batch of two widths, on the torch path of two
    dtypes) goes tensor by tensor, and a changed shape is refused naming the tensor. Both give the
    same patches, advance the snapshots alike and roll back alike."""
    g = torch.Generator().manual_seed(11)
    base = {f"t{i}": torch.randn(4 * (i + 1), generator=g).bfloat16() for i in range(6)}
    if case == "two-widths":
        base["f"] = torch.randn(10, generator=g)
    stores = {k: SnapshotStore(differ=BitwiseDiff(use_native=path == "host kernel")) for k in ("lists", "one by one")}
    taken = []
    real = SnapshotStore._prepare_known

    def spy(self, items, *args):
        got = real(self, items, *args) if self is stores["lists"] else None
        taken.append(got is not None)
        return got
    monkeypatch.setattr(SnapshotStore, "_prepare_known", spy)
    new = _seeded_and_changed(stores.values(), base, 3)
    if case == "unaligned":  # same values, starting one element into a buffer
        buf = torch.empty(new["t2"].numel() + 1, dtype=torch.bfloat16)
        new["t2"] = buf[1:].copy_(new["t2"])
    elif case == "strided":
        new["t3"] = torch.empty(new["t3"].numel() * 2, dtype=torch.bfloat16)[::2].copy_(new["t3"])
    elif case == "requires-grad":
        new["t1"] = new["t1"].requires_grad_()
    elif case == "reshaped":
        new["t4"] = new["t4"].view(2, -1)
    taken.clear()
    out = {}
    for label, store in stores.items():
        if case == "reshaped":
            with pytest.raises(PatchValidationError, match="t4.*shape/dtype changed"):
                store.prepare_many(list(new.items()), batched=True)
            continue
        got = store.prepare_many(list(new.items()), batched=True)
        assert not any(p.values.requires_grad for p in got if p is not None), label  # (t1's patch is dense)
        out[label] = _patches(got)
    if case == "reshaped":
        assert taken == [False, False]
        return
    assert taken == [case in ("usual", "requires-grad"), False], taken
    assert out["lists"] == out["one by one"] and len(out["lists"]) == len(base)
    for store in stores.values():
        for n, t in new.items():
            assert torch.equal(int_view(store.snapshot_of(n)), int_view(t.detach())), n
        store.rollback()
        for n, t in base.items():
            assert torch.equal(int_view(store.snapshot_of(n)), int_view(t)), n


@pytest.mark.parametrize("snapshots", ["host", "device-standin"])
def test_a_batched_delta_on_the_torch_path_sends_changed_elements_not_whole_tensors(snapshots, monkeypatch):
    """A delta's batches (what WeightSync always asks for) decide per tensor whether a full patch is
    smaller than its changes, from the snapshots' bytes and element width. On a device the host
    kernel's facts of a snapshot are 0 (it does not scan device memory); decided on those, every
    changed device tensor went whole, a 0.2% delta as large as a seed. Device snapshots are stood
    for here by those facts (what ``kernel_facts_many`` gives for them) on the torch-ops path that
    devices take; the patches must be the host path's: sparse where few elements changed, whole
    where most did."""
    from delta_sync import snapshot as snapshot_module
    from delta_sync.diff import KernelFacts

    if snapshots == "device-standin":
        monkeypatch.setattr(snapshot_module, "kernel_facts_many",
                            lambda snaps: [KernelFacts(0, 0, t.data_ptr()) for t in snaps])
    g = torch.Generator().manual_seed(21)
    state = {f"t{i}": torch.randn(64, 32, generator=g).bfloat16() for i in range(6)}
    state["small"] = torch.randn(8, generator=g).bfloat16()
    got = {}
    for path, differ in (("torch ops", BitwiseDiff(use_native=False)), ("host kernel", BitwiseDiff())):
        store = SnapshotStore(differ=differ)
        store.prepare_many([(n, t.clone()) for n, t in state.items()], full=True)
        store.commit(0)
        new = {n: t.clone() for n, t in state.items()}
        for t in new.values():
            t.view(-1)[::500] += 1  # a few elements of each
        new["small"] += 1  # every element: whole is smaller
        out = [p for p in store.prepare_many(list(new.items()), batched=True) if p is not None]
        whole = sorted(p.name for p in out if isinstance(p, Patch) and p.dense)
        assert whole == ["small"], (path, whole)
        assert sum(sum(p.counts) for p in out if isinstance(p, PatchBatch)) == 6 * 5, path
        got[path] = _patches(out)
    assert got["torch ops"] == got["host kernel"]


def test_a_torch_path_delta_failing_in_a_later_batch_puts_every_snapshot_back(monkeypatch):
    """On the torch path a planned delta scans its batches one after the other (``_prepare_flat``),
    a tensor as large as a batch on its own among them (the plan holds for the rest: no step per
    tensor); one failing after others advanced their snapshots (a device out of memory) must leave
    every snapshot as it was, and the same delta afterwards gives the patches of the host kernel's
    path."""
    g = torch.Generator().manual_seed(31)
    base = {f"t{i}": torch.randn(64, generator=g).bfloat16() for i in range(12)}
    base = {**dict(list(base.items())[:4]), "big": torch.randn(256, generator=g).bfloat16(), **dict(list(base.items())[4:])}
    stores = [SnapshotStore(differ=BitwiseDiff(use_native=False, batch_words=48)), SnapshotStore()]
    new = _seeded_and_changed(stores, base, 7)
    each = []
    real_each = SnapshotStore._prepare_each
    monkeypatch.setattr(SnapshotStore, "_prepare_each", lambda self, *a: each.append(self) or real_each(self, *a))
    calls = []
    real = BitwiseDiff.absorb_flat_known

    def failing(self, batch, news, members):
        calls.append(len(news))
        if len(calls) == 3:
            raise torch.OutOfMemoryError("no device memory for batch 3")
        return real(self, batch, news, members)
    with monkeypatch.context() as mp:
        mp.setattr(BitwiseDiff, "absorb_flat_known", failing)
        with pytest.raises(torch.OutOfMemoryError, match="batch 3"):
            stores[0].prepare_many(list(new.items()), batched=True)
    # (several planned batches and the large tensor advanced first)
    assert len(calls) == 3 and sum(calls) + 1 < len(base) and stores[0] not in each
    assert all(torch.equal(int_view(stores[0].snapshot_of(n)), int_view(t)) for n, t in base.items())
    stores[0].rollback()
    got = [_patches(store.prepare_many(list(new.items()), batched=True)) for store in stores]
    assert got[0] == got[1] and len(got[0]) == len(base) and stores[0] not in each


def test_a_store_on_the_current_device_holds_what_lies_there(monkeypatch):
    """``snapshot_device="cuda"`` means the device current when the store is asked (a trainer may
    pick its device after making the sync), as ``.to("cuda")`` does; a tensor there is the store's,
    though it names its index (compared as given, ``cuda`` differed from every ``cuda:0``, and every
    seed bucket handed to the store was copied again). The device runtime is stood for here."""
    from delta_sync import accelerator

    current = [0]

    class Runtime:
        @staticmethod
        def current_device() -> int:
            return current[0]
    monkeypatch.setattr(accelerator, "device_module", lambda device: Runtime)
    store = SnapshotStore(device="cuda")
    current[0] = 1  # (set_device after the store was made)
    assert store._holds(torch.device("cuda", 1)) and not store._holds(torch.device("cuda", 0))
    assert not store._holds(torch.device("cpu"))
    assert SnapshotStore(device="cuda:0")._holds(torch.device("cuda", 0))
    assert not SnapshotStore(device="cuda:0")._holds(torch.device("cuda", 1))
    assert SnapshotStore()._holds(torch.device("cpu"))


def test_a_device_trainers_weights_cross_to_host_snapshots_as_one_copy(monkeypatch):
    """A trainer whose weights are on a device, its snapshots in host memory (``snapshot_device``'s
    default): a delta's batch is joined on the device and copied to the host once, and the host
    kernel scans that copy (a copy per tensor waited for the device each time). The same patches
    as weights on the host, a tensor sent whole included (a view of the copy, of its own shape),
    the snapshots advanced alike and put back alike; weights on two devices, or a device with no
    room to join them, go tensor by tensor. The weights stand for a device's (``is_cpu`` False),
    the copy is a host copy."""
    from delta_sync import accelerator
    from delta_sync import snapshot as snapshot_module

    g = torch.Generator().manual_seed(41)
    base = {f"t{i}": torch.randn(8, 4 + 4 * i, generator=g).bfloat16() for i in range(9)}
    stores = [SnapshotStore(), SnapshotStore()]
    new = _seeded_and_changed(stores, base, 11)
    new["t3"] += 1  # every element: sent whole
    copies, each = [], []
    real_each, real_to_host = SnapshotStore._prepare_each, accelerator.to_host
    monkeypatch.setattr(SnapshotStore, "_prepare_each", lambda self, *a: each.append(self) or real_each(self, *a))
    monkeypatch.setattr(accelerator, "to_host", lambda t, **k: copies.append(t.numel()) or real_to_host(t, **k))
    host = _patches(stores[0].prepare_lists(list(new), list(new.values()), batched=True))
    with monkeypatch.context() as mp:
        mp.setattr(snapshot_module, "_ON_HOST", lambda t: False)  # (on a device)
        got = stores[1].prepare_lists(list(new), list(new.values()), batched=True)
        whole = [p for p in got if isinstance(p, Patch) and p.dense]
        assert [p.name for p in whole] == ["t3"] and whole[0].shape == (8, 16)
        assert _patches(got) == host and copies == [sum(t.numel() for t in base.values())] and not each
        for store in stores:
            assert all(torch.equal(int_view(store.snapshot_of(n)), int_view(t)) for n, t in new.items())
            store.rollback()
            assert all(torch.equal(int_view(store.snapshot_of(n)), int_view(t)) for n, t in base.items())
        stores[1].rollback()
        monkeypatch.setattr(accelerator, "to_host", lambda t, **k: (_ for _ in ()).throw(
            torch.OutOfMemoryError("no room to join the batch")))  # (a nearly full device)
        assert _patches(stores[1].prepare_lists(list(new), list(new.values()), batched=True)) == host
        assert each == [stores[1]]
        stores[1].rollback()
        monkeypatch.setattr(torch.Tensor, "get_device", lambda t: 1 if t is new["t5"] else 0)  # (two devices)
        assert _patches(stores[1].prepare_lists(list(new), list(new.values()), batched=True)) == host
        assert each == [stores[1]] * 2 and len(copies) == 1


def test_a_delta_plan_is_not_used_after_a_seed_moved_the_snapshots():
    """A store keeps each delta batch's plan (its snapshots' addresses, words, shapes) from one delta
    to the next; a seed gives the same names new snapshot memory, so the next delta of the same
    names and shapes must diff against that, not the memory of the plan: exact patches, the new
    snapshots advanced, the old ones untouched."""
    g = torch.Generator().manual_seed(5)
    state = {f"t{i}": torch.randn(64, generator=g).bfloat16() for i in range(5)}
    store = SnapshotStore()
    store.prepare_many(list(state.items()), full=True)
    store.commit(0)
    for v in (1, 2):  # the first delta learns the snapshots' facts, the second makes the plan
        for t in state.values():
            t.view(-1)[v::7] += 1
        store.prepare_many(list(state.items()), batched=True)
        store.commit(v)
    assert store._plans
    old = {n: store.snapshot_of(n) for n in state}
    kept = {n: t.clone() for n, t in old.items()}
    reseed = {n: torch.randn(64, generator=g).bfloat16() for n in state}
    store.prepare_many(list(reseed.items()), full=True)
    store.commit(3)
    assert all(store.snapshot_of(n).data_ptr() != old[n].data_ptr() for n in state)
    before = reseed
    for v in (4, 5):  # (the first delta learns the new snapshots' facts, the second goes by a plan)
        new = {n: t.clone() for n, t in before.items()}
        for t in new.values():
            t.view(-1)[v::5] += 1
        got = _patches(store.prepare_many(list(new.items()), batched=True))
        for n, t in new.items():
            changed = (int_view(t) != int_view(before[n])).nonzero().squeeze(1)
            assert got[n] == (changed.tolist(), int_view(t)[changed].tolist()), (v, n)
            assert torch.equal(int_view(store.snapshot_of(n)), int_view(t)), (v, n)
            assert torch.equal(int_view(old[n]), int_view(kept[n])), (v, n)  # the old memory is not written
        store.commit(v)
        before = new


def test_a_bucket_whose_ranges_go_by_address_and_as_tensors_digests_each_right():
    """The packer's ranges go to the kernel as rows of addresses where their source is contiguous
    on the host and as tensors elsewhere (a strided source); in one bucket, mixed, each entry's
    header digest is its own range's: the receiver's check of every range passes, and fails on
    the range whose bytes changed."""
    g = torch.Generator().manual_seed(13)
    wide = torch.randn(40, 3, generator=g).bfloat16()
    patches = [Patch.full("a", torch.randn(100, generator=g).bfloat16()),
               Patch("s", (40,), torch.bfloat16, None, wide[:, 1]),  # strided: the tensor path
               Patch.full("c", torch.randn(30, generator=g).float())]
    packer = BucketPacker(1, "seed", 1 << 20)
    packer.keys = lambda nonce: DigestKey.derive(b"m" * 32, nonce)
    (bucket,) = list(packer.pack(patches))
    got = entry_patches(bucket)  # every dense range's digest checked against its header entry
    assert [p.name for _, p in got] == ["a", "s", "c"]
    assert torch.equal(got[1][1].values.view(torch.int16), wide[:, 1].contiguous().view(torch.int16))
    bucket.values["bfloat16"].view(torch.int16)[105] ^= 0x0100  # in "s"
    with pytest.raises(ChecksumMismatch, match="'s' values"):
        entry_patches(bucket)


def test_a_torch_op_batch_where_nothing_changed_advances_nothing():
    """The torch-op diff (what device snapshots take) of a batch of separate snapshots none of
    which changed: empty patches, the snapshots as they were (the batch's multi-tensor advance of
    no tensor raised on every device, failing a delta of unchanged weights)."""
    g = torch.Generator().manual_seed(12)
    olds = [torch.randn(64, generator=g).bfloat16() for _ in range(5)]  # separate storages: no span
    got = BitwiseDiff(use_native=False).advance_many([(f"t{i}", o, o.clone()) for i, o in enumerate(olds)])
    assert [p.count for p, _ in got] == [0] * 5


def test_advance_many_failing_in_one_batch_puts_every_snapshot_back(monkeypatch):
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 2048)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    real = native._scan_many

    def scan(fn, width, olds, facts, lanes, absorb, lo, first, hi, last, expect=0):
        if (lo, first) != (0, 0):  # the second run of the first batch
            raise MemoryError("injected")
        return real(fn, width, olds, facts, lanes, absorb, lo, first, hi, last, expect)
    monkeypatch.setattr(native, "_scan_many", scan)
    olds, news = _mixed_tensors(torch.Generator().manual_seed(5))
    before = [o.clone() for o in olds]
    with pytest.raises(MemoryError, match="injected"):
        BitwiseDiff().advance_many([(f"t{i}", o, n) for i, (o, n) in enumerate(zip(olds, news))])
    for o, b in zip(olds, before):  # the one-by-one ones and the batch's first group too
        assert torch.equal(int_view(o), int_view(b))


def test_diff_rejects_mismatch():
    with pytest.raises(ValueError, match="snapshot"):
        BitwiseDiff().diff("t", torch.zeros(4), torch.zeros(5))


def _bad(**kw):
    base = dict(name="w", shape=(10,), dtype=torch.bfloat16,
                indices=torch.tensor([1, 3, 5], dtype=torch.int32),
                values=torch.ones(3, dtype=torch.bfloat16))
    base.update(kw)
    return Patch(**base)


@pytest.mark.parametrize("patch,match,index", [
    (_bad(indices=torch.tensor([1, 3, 10], dtype=torch.int32)), "out of bounds", 2),
    (_bad(indices=torch.tensor([-1, 3, 5], dtype=torch.int32)), "negative", 0),
    (_bad(indices=torch.tensor([1, 5, 3], dtype=torch.int32)), "not increasing", 2),
    (_bad(indices=torch.tensor([1, 3, 3], dtype=torch.int32)), "duplicate index 3", 2),
    (_bad(values=torch.tensor([1, float("nan"), 1], dtype=torch.bfloat16)), "non-finite", 1),
    (_bad(values=torch.tensor([1, 1, float("inf")], dtype=torch.bfloat16)), "non-finite", 2),
    (_bad(indices=torch.tensor([1, 3, 5], dtype=torch.int64)), "int32", None),
    (_bad(values=torch.ones(3, dtype=torch.float32)), "differs from the declared", None),
    (_bad(values=torch.ones(2, dtype=torch.bfloat16)), "3 indices for 2 values", None),
    (_bad(dtype=torch.int8, values=torch.ones(3, dtype=torch.int8)), "not supported", None),
])
def test_validation_names_tensor_and_first_bad_index(patch, match, index):
    with pytest.raises(PatchValidationError, match=match) as ei:
        patch.validate()
    assert ei.value.name == "w" and ei.value.index == index
    assert "'w'" in str(ei.value)


def test_validation_against_target():
    p = _bad()
    with pytest.raises(PatchValidationError, match="shape"):
        p.validate(expected_shape=(11,))
    with pytest.raises(PatchValidationError, match="dtype"):
        p.validate(expected_dtype=torch.float16)
    p.validate(expected_shape=(10,), expected_dtype=torch.bfloat16)


def test_int32_overflow_is_refused_clearly():
    p = Patch("huge", (2**31,), torch.bfloat16, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.bfloat16))
    with pytest.raises(PatchValidationError, match="do not fit int32"):
        p.validate()


@pytest.mark.parametrize("layout", ["contiguous", "one strided"])
def test_a_batch_rollback_puts_every_old_bit_back_in_one_call(layout):
    """``put_back_many``: members of every size (none changed in some), their positions and old bits
    concatenated, restored bit for bit by one kernel call; a strided member sends the batch one by one
    (same result); a position outside its tensor is refused before anything is written."""
    g = torch.Generator().manual_seed(3)
    olds = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (64, 0, 128, 33, 1, 300) * 50]
    if layout == "one strided":
        olds[7] = torch.randn(66, generator=g).to(torch.bfloat16)[::2]
    before = [o.clone() for o in olds]
    counts, idxs, prevs = [], [], []
    for o in olds:
        pos = torch.randperm(o.numel(), generator=g)[:5].sort().values
        prevs.append(o.view(torch.int16)[pos].clone())
        idxs.append(pos.to(torch.int32))
        counts.append(pos.numel())
        o.view(torch.int16)[pos] = 0x7F00  # what a scan would have advanced them to
    counts, idx, prev = torch.tensor(counts), torch.cat(idxs), torch.cat(prevs)
    native.put_back_many(olds, counts, idx, prev)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(olds, before))
    if layout == "contiguous" and native.kernel() is not None:
        idx[-1] = 300  # one past the last member's end
        with pytest.raises(IndexError, match="outside its snapshot"):
            native.put_back_many(olds, counts, idx, torch.zeros_like(prev))
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(olds, before))


def test_snapshot_stage_commit_rollback():
    s = SnapshotStore()
    w = torch.randn(64, 8).bfloat16()
    p0 = s.prepare("w", w)  # first sight: full
    assert p0.dense
    with pytest.raises(PatchValidationError, match="staged twice"):
        s.prepare("w", w)
    s.commit(0)
    w.view(-1)[[3, 70]] += 1  # the live tensor changes; the snapshot must not alias it
    p1 = s.prepare("w", w)
    assert p1.indices.tolist() == [3, 70]
    s.rollback()  # engine failed: snapshot stays v0, next diff still sees both changes
    assert s.version == 0
    w.view(-1)[5] += 1
    p2 = s.prepare("w", w)
    assert p2.indices.tolist() == [3, 5, 70]
    s.commit(1)
    assert torch.equal(int_view(s.snapshot_of("w")), int_view(w))
    assert s.prepare("w", w).count == 0
    s.rollback()
    v1 = w.clone()
    w.mul_(3)  # nearly every element: dense is smaller than sparse
    assert s.prepare("w", w).dense
    s.rollback()  # the diff advanced the snapshot in place: rollback puts v1 back, bit for bit
    assert torch.equal(int_view(s.snapshot_of("w")), int_view(v1)) and s.prepare("w", w).dense
    with pytest.raises(PatchValidationError, match="shape/dtype changed"):
        s.rollback(), s.prepare("w", torch.zeros(3))


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batched_prepare_says_what_patches_would_and_rolls_back(monkeypatch, threads):
    """``prepare_many(batched=True)``: the kernel's tensors come as one PatchBatch per dtype (bf16
    and fp16 share a kernel batch: two batches from it), at the first changed tensor's position; a
    tensor where dense is smaller comes as a full patch, an unchanged one not at all, the others
    (unaligned, ragged) one by one. Their patches are the unbatched ones, bit for bit, and a
    rollback puts every snapshot back."""
    monkeypatch.setattr(native, "MIN_WORDS_PER_THREAD", 2048)
    monkeypatch.setattr(native, "SCRATCH_ENTRIES", 64)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(7)
    olds, news = _mixed_tensors(g)
    olds.append(torch.randn(256, generator=g).half())  # a sparse fp16 tensor: in the bf16 kernel batch
    news.append(olds[-1].clone())
    news[-1][::16] += 1
    items = [(f"t{i}", n) for i, n in enumerate(news)]
    stores = []
    for batched in (False, True):
        s = SnapshotStore()
        s.prepare_many([(f"t{i}", o.clone()) for i, o in enumerate(olds)], full=True)
        s.commit(0)
        stores.append((s, s.prepare_many(items, batched=batched)))
    (plain, want), (store, got) = stores
    batches = [p for p in got if isinstance(p, PatchBatch)]
    # bf16 t0-t5, t9 and t11 (the large one, cut between threads) and fp16 t13 share one kernel
    # batch and come apart by dtype; fp32 t6 (t9's new value is a clone: aligned); fp16 t8 is denser
    # than a third: its elements are left out of the fp16 batch's buffers
    assert [(b.dtype, b.names) for b in batches] == [
        (torch.bfloat16, ["t0", "t1", "t2", "t3", "t4", "t5", "t9", "t11"]), (torch.float32, ["t6"]),
        (torch.float16, ["t13"])]
    assert got[8].dense and got[7] is None and got[12] is None  # dense smaller; no elements; unchanged
    assert got[10].name == "t10" and not got[10].dense  # the kernel's leftover (a ragged tail), alone
    for b in batches:
        b.validate()
        assert got[int(b.names[0][1:])] is b and all(c > 0 for c in b.counts)
        assert all(got[int(n[1:])] is None for n in b.names[1:])
    assert batches[2].counts == [16] and batches[2].indices.tolist() == list(range(0, 256, 16))
    expanded = {p.name: p for b in batches for p in b.patches()}
    expanded.update({p.name: p for p in got if isinstance(p, Patch)})
    for p in want:
        if p.dense or p.count:
            q = expanded.pop(p.name)
            assert q.dense == p.dense and q.shape == p.shape and q.dtype == p.dtype
            assert p.dense or torch.equal(q.indices, p.indices)
            assert torch.equal(int_view(q.values), int_view(p.values))
    assert not expanded
    store.rollback()
    for i, o in enumerate(olds):
        assert torch.equal(int_view(store.snapshot_of(f"t{i}")), int_view(o)), i
    assert [p.count for p in store.prepare_many(items)] == [p.count for p in want]


def test_the_torch_path_batches_too():
    """The torch-op scan (what device snapshots take) hands its batch on whole as well: one
    PatchBatch per dtype, the reference diff's patches bit for bit, and a rollback puts every
    snapshot back."""
    g = torch.Generator().manual_seed(13)
    olds = [torch.randn(256, generator=g).to(torch.bfloat16 if k % 3 else torch.float16) for k in range(12)]
    news = [o.clone() for o in olds]
    for k, n in enumerate(news):
        n[k::7] += 1
    news[4] = news[4] * 3 + 1  # denser than a third: a full patch, left out of the batch's buffers
    store = SnapshotStore(differ=BitwiseDiff(use_native=False))
    store.prepare_many([(f"t{i}", o.clone()) for i, o in enumerate(olds)], full=True)
    store.commit(0)
    got = store.prepare_many([(f"t{i}", n) for i, n in enumerate(news)], batched=True)
    batches = [p for p in got if isinstance(p, PatchBatch)]
    assert [(b.dtype, len(b.names)) for b in batches] == [(torch.float16, 4), (torch.bfloat16, 7)]
    assert got[4].dense
    ref = BitwiseDiff(use_native=False)
    for p in (q for b in batches for q in b.patches()):
        i = int(p.name[1:])
        want = ref.diff(p.name, olds[i], news[i])
        assert torch.equal(p.indices, want.indices) and torch.equal(int_view(p.values), int_view(want.values))
    store.rollback()
    for i, o in enumerate(olds):
        assert torch.equal(int_view(store.snapshot_of(f"t{i}")), int_view(o)), i


def test_snapshots_seeded_together_lie_in_one_arena_and_are_diffed_as_one_span():
    """A seed's snapshots of one element width are copied back to back into one buffer, so the
    torch-op diff reads them and advances them in place as one span: the same patches and
    snapshots as snapshots seeded one by one (a view and a cat per tensor), a rollback puts every
    bit back, and the diff's operations no longer grow by ~6 per tensor."""
    from delta_sync.diff import _adjacent_runs
    from launchers.device_check import OpCounter

    g = torch.Generator().manual_seed(21)
    olds = [torch.randn(64 * (1 + k % 3), generator=g).to(torch.bfloat16 if k % 4 else torch.float16)
            for k in range(40)]
    olds[7].view(torch.int16)[3] = 0x7FC1  # a NaN with a payload: copied as bits, never as floats
    news = [o.clone() for o in olds]
    for k, n in enumerate(news):
        n[k % 5::9] += 1
    results = []
    for together in (True, False):
        store = SnapshotStore(differ=BitwiseDiff(use_native=False))
        if together:
            store.prepare_many([(f"t{i}", o.clone()) for i, o in enumerate(olds)], full=True)
        else:
            for i, o in enumerate(olds):
                store.prepare(f"t{i}", o.clone(), full=True)
        store.commit(0)
        snaps = [store.snapshot_of(f"t{i}") for i in range(len(olds))]
        runs = _adjacent_runs(snaps)
        assert runs == ([((0, 40), True)] if together else [((0, 40), False)]), runs
        with OpCounter() as ops:
            got = store.prepare_many([(f"t{i}", n) for i, n in enumerate(news)], batched=True)
        patches = {p.name: p for b in got if b is not None for p in (b.patches() if isinstance(b, PatchBatch) else [b])}
        results.append(({k: (p.indices.tolist(), int_view(p.values).tolist()) for k, p in patches.items()},
                        [int_view(t).clone() for t in snaps], ops.ops))
        store.rollback()
        for i, o in enumerate(olds):
            assert torch.equal(int_view(store.snapshot_of(f"t{i}")), int_view(o)), i
    (span_patches, span_snaps, span_ops), (cat_patches, cat_snaps, cat_ops) = results
    assert span_patches == cat_patches and len(span_patches) == 40
    assert all(torch.equal(a, b) for a, b in zip(span_snaps, cat_snaps))
    assert all(torch.equal(a, int_view(n)) for a, n in zip(span_snaps, news))  # advanced to the new bits
    assert span_ops + 4 * 40 <= cat_ops, (span_ops, cat_ops)


def test_adjacent_runs_are_cut_where_tensors_stop_lying_back_to_back():
    from delta_sync.diff import _adjacent_runs

    buf = torch.zeros(64, dtype=torch.bfloat16)
    a, b, c, d = buf[0:8], buf[8:16], buf[24:32], buf[32:40]  # a gap between b and c
    alone = torch.zeros(8, dtype=torch.bfloat16)
    assert _adjacent_runs([a, b, c, d]) == [((0, 2), True), ((2, 4), True)]
    assert _adjacent_runs([alone, a, b, alone, c]) == [((0, 1), False), ((1, 3), True), ((3, 5), False)]
    assert _adjacent_runs([b, a]) == [((0, 2), False)]  # back to back, but out of order
    assert _adjacent_runs([a]) == [((0, 1), False)] and _adjacent_runs([]) == []


def test_a_diff_that_fails_after_the_scan_still_rolls_every_snapshot_back(monkeypatch):
    """The kernel advanced every snapshot before the patches are made: when making one fails (a
    tensor's full copy out of memory), the undo of every one, batched or not, is kept already and
    a rollback puts them all back bit for bit."""
    import delta_sync.snapshot as snapshot_module

    g = torch.Generator().manual_seed(5)
    olds = [torch.randn(64, generator=g).bfloat16() for _ in range(3)] + [torch.randn(65, generator=g).bfloat16()]
    news = [o.clone() for o in olds]
    for n in news[:3]:
        n[::8] += 1  # sparse: batched
    news[3] = torch.randn(66, generator=g).bfloat16()[1:]  # unaligned: diffed alone, every element changed
    store = SnapshotStore()
    store.prepare_many([(f"t{i}", o.clone()) for i, o in enumerate(olds)], full=True)
    store.commit(0)
    real = snapshot_module._own

    def out_of_memory(new, given):
        if new.numel() == 65:
            raise MemoryError("injected")
        return real(new, given)
    monkeypatch.setattr(snapshot_module, "_own", out_of_memory)
    with pytest.raises(MemoryError):
        store.prepare_many([(f"t{i}", n) for i, n in enumerate(news)], batched=True)
    store.rollback()
    for i, o in enumerate(olds):
        assert torch.equal(int_view(store.snapshot_of(f"t{i}")), int_view(o)), i


def test_ownership_balanced_by_bytes_and_deterministic():
    sizes = [("a", 100), ("b", 10), ("c", 10), ("d", 60), ("e", 40)]
    stores = [SnapshotStore(rank=r, world_size=2) for r in range(2)]
    owners = [[s.owner(n, b) for n, b in sizes] for s in stores]
    assert owners[0] == owners[1] == [0, 1, 1, 1, 1]  # loads 100 vs 120
    assert stores[0]._load == [100, 120]


def test_digest_additive_and_sensitive():
    g = torch.Generator().manual_seed(1)
    for dtype in DTYPES:
        t = torch.randn(301, 37, generator=g).to(dtype)
        d = digest_tensor(t)
        flat = t.reshape(-1)
        assert d == digest_range(flat[:1000], 0) + digest_range(flat[1000:], 1000)
        idx = torch.arange(0, flat.numel(), 3)
        rest = torch.ones(flat.numel(), dtype=torch.bool)
        rest[idx] = False
        rest = rest.nonzero().squeeze(1)
        assert digest_elements(idx, flat[idx]) + digest_elements(rest, flat[rest]) == d
        # a sign flip, a swap, a one-row shift: all change the digest
        t2 = t.clone(); t2.view(-1)[17] = -t2.view(-1)[17]
        t3 = t.clone(); t3.view(-1)[[5, 6]] = t.view(-1)[[6, 5]]
        t4 = torch.roll(t, 1, 0)
        for other in (t2, t3, t4):
            assert digest_tensor(other) != d
        assert Digest.parse(d.hex()) == d


def test_keyed_digest_catches_what_a_linear_one_cannot():
    """``+d, -2d, +d`` on three neighbouring words keeps both sums an affine position weight reduces
    to (this digest's earlier form): every lane of it agreed on the forged bytes. Under the tables
    it changes every lane, under the public key and under any derived key; a key derived from
    another nonce or secret gives another digest, the same inputs the same one; pads differ by place."""
    import delta_sync.digest as dg
    g = torch.Generator().manual_seed(11)
    t = (torch.rand(4096, generator=g) * 0.5 + 0.25).bfloat16()
    forged = t.clone()
    forged.view(torch.int16)[1000:1003] += torch.tensor([4096, -8192, 4096], dtype=torch.int16)
    s, f = t.view(torch.int16).to(torch.int64), forged.view(torch.int16).to(torch.int64)
    k = torch.arange(s.numel())
    assert (s - f).abs().max() == 8192
    assert int(s.sum()) == int(f.sum()) and int((k * s).sum()) == int((k * f).sum())  # S0 and S1 agree
    keys = [dg.PUBLIC, dg.DigestKey.derive(b"s" * 32, "n1"), dg.DigestKey.derive(b"s" * 32, "n2"),
            dg.DigestKey.derive(b"t" * 32, "n1")]
    digests = [dg.digest_tensor(t, key) for key in keys]
    for key, d in zip(keys, digests):
        other = dg.digest_tensor(forged, key)
        assert all(a != b for a, b in zip(d, other)), "a lane kept its value on forged bytes"
    assert len(set(digests)) == len(digests)
    assert dg.digest_tensor(t, dg.DigestKey.derive(b"s" * 32, "n1")) == digests[1]
    assert keys[1].pad(0) != keys[1].pad(1) and keys[1].pad(0) != keys[2].pad(0)
    with pytest.raises(ValueError, match="positions reach"):
        dg.scan_range(t, dg.MAX_WORDS)


def test_digest_crosses_chunk_boundary(monkeypatch):
    """The device formula's rows and steps (shrunk here) cut anywhere give the host kernel's digest."""
    import delta_sync.digest as dg
    t = torch.randn(5000).bfloat16()
    t[4321] = float("inf")
    d = dg.digest_tensor(t)
    monkeypatch.setattr(dg, "DEVICE_CHUNK_WORDS", 1024 * 2 + 10)  # steps end inside rows, rows short
    for start in (0, 100, 1023, 2_000_000_000):
        want, bad = dg.scan_range(t, start)
        got = dg.lane_sums(dg._words(t), start, exp_mask=0x7F80).tolist()
        assert Digest(*got[:4]) == want and got[4] == bad == 1
    sums = dg.lane_sums(dg._words(t[100:]), 100).tolist()
    assert Digest(*sums[:4]) + dg.digest_range(t[:100], 0) == d


@pytest.mark.parametrize("bucket_bytes", [64, 100, 1000, 1 << 20])
def test_buckets_roundtrip_split_and_checksum(bucket_bytes):
    g = torch.Generator().manual_seed(bucket_bytes)
    tensors = {f"t{i}": torch.randn(17 * (i + 1), generator=g).to(DTYPES[i % 3]) for i in range(6)}
    patches = []
    for i, (n, t) in enumerate(tensors.items()):
        if i % 3 == 0:
            patches.append(Patch.full(n, t))
        else:
            k = torch.arange(0, t.numel(), 1 + i, dtype=torch.int32)
            patches.append(Patch(n, tuple(t.shape), t.dtype, k, t[k.long()]))
    patches.append(Patch("empty", (5,), torch.bfloat16, torch.zeros(0, dtype=torch.int32),
                         torch.zeros(0, dtype=torch.bfloat16)))
    buckets = list(BucketPacker(3, "delta", bucket_bytes).pack(patches))
    assert buckets[-1].header["last"] and not any(b.header["last"] for b in buckets[:-1])
    assert all(b.payload_bytes <= max(bucket_bytes, 6) for b in buckets)
    asm = TensorAssembler()
    for b in buckets:
        asm.add(b)
    got = {p.name: p for p in asm.patches()}
    assert "empty" not in got  # nothing changed, nothing sent
    for p in patches[:-1]:
        q = got[p.name]
        assert q.dense == p.dense and q.shape == p.shape and q.dtype == p.dtype
        assert torch.equal(int_view(q.values), int_view(p.values))
        if not p.dense:
            assert torch.equal(q.indices, p.indices)
    if len(buckets) > 1:
        b = buckets[0]
        vals = next(iter(b.values.values()))
        vals.view(-1)[0] = vals.view(-1)[0] + 1
        with pytest.raises(ChecksumMismatch, match="bucket 0 of version 3"):
            TensorAssembler().add(b)


def test_a_tensor_whose_first_range_is_missing_is_refused_not_assembled():
    """A dense tensor split over buckets, its first bucket lost: the range that arrived is one
    entry of its tensor (the assembler's one-entry path), and it does not start at 0."""
    t = torch.arange(96, dtype=torch.float32).to(torch.bfloat16)
    buckets = list(BucketPacker(3, "full", 64).pack([Patch.full("w", t)]))  # 32 elements a bucket
    assert len(buckets) > 2
    whole, tail = TensorAssembler(), TensorAssembler()
    for b in buckets:
        whole.add(b)
    assert torch.equal(whole.patches()[0].values.view(torch.int16), t.view(torch.int16))
    tail.add(buckets[1])
    with pytest.raises(PatchValidationError, match="'w': dense range starts at 32, expected 0"):
        tail.patches()


def test_memory_receiver_mismatched_names_missing_and_flipped_tensors():
    from delta_sync.memory_receiver import MemoryReceiver

    r = MemoryReceiver()
    a, b = torch.randn(5).to(torch.bfloat16), torch.randn(3)
    r.tensors = {"a": a.clone(), "b": b.clone()}
    assert r.mismatched([("a", a), ("b", b)]) == []
    r.tensors["a"].view(torch.int16)[2] ^= 1
    assert r.mismatched([("a", a), ("b", b), ("c", b)]) == ["a", "c"]


def test_thread_spans_cut_whole_items_in_order_with_enough_work_each():
    assert native.thread_spans([]) == []
    assert native.thread_spans([10, 10, 10], min_per_thread=1000, threads=4) == [(0, 3)]  # too little work
    assert native.thread_spans([500, 500, 500, 500], min_per_thread=1000, threads=4) == [(0, 2), (2, 4)]
    assert native.thread_spans([5, 5, 5], min_per_thread=1, threads=8) == [(0, 1), (1, 2), (2, 3)]  # one item each at most
    spans = native.thread_spans([7, 1, 300, 2, 2, 90], min_per_thread=1, threads=3)
    assert spans[0][0] == 0 and spans[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_memory_receiver_delta_spread_over_threads_writes_what_one_thread_does():
    """A delta's sparse writes go to several threads, a tensor's patch whole to one: the tensors
    come out as the patches say, the same as on one thread."""
    from delta_sync.memory_receiver import MemoryReceiver
    from delta_sync.transfer import ReceivedUpdate

    g = torch.Generator().manual_seed(3)
    base = {f"t{k}": torch.randn(200_000 + 997 * k, generator=g).to(torch.bfloat16) for k in range(6)}
    patches = []
    for name, t in base.items():
        idx = torch.randperm(t.numel(), generator=g)[: t.numel() // 3].sort().values.to(torch.int32)
        patches.append(Patch(name, tuple(t.shape), t.dtype, idx, torch.randn(idx.numel(), generator=g).to(t.dtype)))
    want = {n: t.clone() for n, t in base.items()}
    for p in patches:
        want[p.name][p.indices.long()] = p.values
    for threads in (1, 3):
        assert len(native.thread_spans([p.count for p in patches], threads=threads)) == threads
        r = MemoryReceiver(threads=threads)
        r.tensors = {n: t.clone() for n, t in base.items()}
        r._staged = ReceivedUpdate(1, "delta", patches)
        r.finish(1)
        assert r.version == 1 and r.mismatched(want.items()) == []


@pytest.mark.parametrize("case,match", [
    ("negative", "index -1 is negative"), ("bounds", "index 40 out of bounds for 40 elements"),
    ("duplicate", "duplicate index 7"), ("order", "indices not increasing: 9 then 8"),
    ("nan", "non-finite value nan at flat index 9"),
    ("wrap", "indices not increasing: 2147483647 then -2147483648")])  # an int32 difference would wrap to +1
@pytest.mark.parametrize("host_kernel", [True, False], ids=["kernel", "torch-ops"])
def test_bucket_checks_sparse_entries_at_once_and_names_the_tensor(case, match, host_kernel, monkeypatch):
    """Both the packer and the receiver check every sparse entry of a bucket in one pass (the host
    kernel's, or a few vectorized torch ops on devices and hosts without a compiler); the error
    names the tensor and the position, whichever entry of the bucket is bad."""
    if not host_kernel:
        monkeypatch.setattr(native, "kernel", lambda: None)

    good = Patch("a", (8, 5), torch.bfloat16, torch.tensor([0, 3, 39], dtype=torch.int32),
                 torch.ones(3, dtype=torch.bfloat16))
    idx, vals = [5, 7, 9], [1.0, 2.0, 3.0]
    if case == "negative":
        idx[0] = -1
    elif case == "bounds":
        idx[2] = 40
    elif case == "duplicate":
        idx[2] = 7
    elif case == "order":
        idx = [5, 9, 8]
    elif case == "wrap":
        idx = [5, 2**31 - 1, -2**31]
    else:
        vals[2] = float("nan")
    bad = Patch("b", (8, 5), torch.bfloat16, torch.tensor(idx, dtype=torch.int32), torch.tensor(vals).to(torch.bfloat16))
    with pytest.raises(PatchValidationError, match=f"'b'.*{match}"):
        list(BucketPacker(1, "delta", 1 << 20).pack([good, bad]))
    bucket = next(BucketPacker(1, "delta", 1 << 20, checksum=False).pack([good, good]))
    bucket.indices[3:] = torch.tensor(idx, dtype=torch.int32)
    bucket.header["entries"][1]["name"] = "b"
    bucket.values["bfloat16"][3:] = torch.tensor(vals).to(torch.bfloat16)
    with pytest.raises(PatchValidationError, match=f"'b'.*{match}"):
        TensorAssembler().add(bucket)


def test_host_kernel_order_and_bounds_check_agrees_with_the_rules():
    """``native.sparse_in_order`` (the one-pass check both sides run first) says True exactly when
    every entry strictly increases within [0, limit): random buffers with each kind of fault, at
    an entry's first, last and middle index, empty entries, and an entry starting below the end of
    the one before (allowed). None where it cannot tell, so the torch ops decide."""
    if not native.supports_words(torch.zeros(2, dtype=torch.int16)):
        pytest.skip("no C compiler here: the host kernel is not built")
    g = torch.Generator().manual_seed(5)

    def rule(idx: list[int], counts: list[int], limits: list[int]) -> bool:
        pos = 0
        for n, lim in zip(counts, limits):
            part = idx[pos:pos + n]
            pos += n
            if any(v < 0 or v >= lim for v in part) or any(b <= a for a, b in zip(part, part[1:])):
                return False
        return True

    for trial in range(300):
        k = int(torch.randint(1, 6, (1,), generator=g))
        limits = [int(x) for x in torch.randint(1, 50, (k,), generator=g)]
        counts = [int(torch.randint(0, lim + 1, (1,), generator=g)) if trial % 7 else 0 for lim in limits]
        idx = []
        for n, lim in zip(counts, limits):
            idx += sorted(torch.randperm(lim, generator=g)[:n].tolist())
        if idx and trial % 3:
            at = int(torch.randint(0, len(idx), (1,), generator=g))
            fault = trial % 5
            idx[at] = [-1, limits[0] + 100, idx[at - 1] if at else -5, 2**31 - 1, -2**31][fault]
        t = torch.tensor(idx, dtype=torch.int32)
        assert native.sparse_in_order(t, counts, limits) == rule(idx, counts, limits), (idx, counts, limits)
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    assert native.sparse_in_order(t.long(), [3], [4]) is None  # not int32
    assert native.sparse_in_order(torch.tensor([1, 0, 2, 0, 3], dtype=torch.int32)[::2], [3], [4]) is None
    assert native.sparse_in_order(t, [2], [4]) is None  # the counts do not tile the buffer


@pytest.mark.parametrize("dots", ["int8_mm", "by_lane"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_host_kernel_equals_the_device_formula(dtype, dots, monkeypatch):
    """The host kernel (per-row table products, AVX-512, AVX2 or scalar, threaded, optionally copying) gives the bits
    of the torch-op lane sums that devices run, with the same non-finite count, at any length,
    offset and split; a copying scan leaves an exact copy. Both device formulas: the int8 matrix
    product (CUDA, and the host here) and the per-lane products (device types without one)."""
    import delta_sync.digest as dg
    if not native.supports_words(torch.zeros(2, dtype=torch.int16)):
        pytest.skip("no C compiler here: the host kernel is not built")
    monkeypatch.setattr(dg, "_NO_INT_MM", set() if dots == "int8_mm" else {"cpu"})
    monkeypatch.setattr(dg, "_dots_by_lane" if dots == "int8_mm" else "_dots_int8",
                        lambda *a: pytest.fail(f"not the {dots} formula"))
    monkeypatch.setattr(dg, "_MIN_WORDS_PER_THREAD", 1 << 12)  # several threads on small inputs too
    g = torch.Generator().manual_seed(3)
    for n in (1, 15, 16, 255, 256, 257, 4097, 65537, 200_003):
        x = (torch.randn(n, generator=g) * 1000).to(dtype)
        if n > 10:
            x[n // 3], x[n // 2] = float("nan"), float("-inf")
        w, mask = dg._words_per_element(x), dg._EXP_MASK[dtype]
        for start in (0, 7, 2_000_000_000):
            ref = dg.lane_sums(dg._words(x), start * w, 4, mask, w).tolist()
            want = [r % p for r, p in zip(ref[:4], dg.PRIMES)]
            got, bad = dg._scan_words(dg._words(x), start * w, 4, mask, w, dg.PUBLIC)
            out = torch.full_like(x, 7)
            got2, bad2 = dg.scan_range(x, start, copy_to=out)
            assert [v % p for v, p in zip(got, dg.PRIMES)] == want and bad == ref[4] == (2 if n > 10 else 0)
            assert list(got2) == want and bad2 == bad
            assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                               x.view(torch.int16 if dtype != torch.float32 else torch.int32))
    # extreme words over many rows and across the position tables' blocks (KEY_ROW**2 words: the
    # kernel sums a block's rows exactly, then reduces): no intermediate sum overflows
    block = dg.KEY_ROW * dg.KEY_ROW
    for fill in (-32768, 32767, None):
        n, start = (3 * 65536 + 17, 5) if fill is not None else (2 * block + 5000, block - 1000)
        words = torch.full((n,), fill, dtype=torch.int16) if fill is not None else \
            torch.randint(-32768, 32768, (n,), generator=g, dtype=torch.int32).to(torch.int16)
        if fill is None:
            words[:block // 2] = -32768  # a block of the most negative words, then random ones
        ref = dg.lane_sums(words, start, 4, 0, 1).tolist()
        got, _ = dg._scan_words(words, start, 4, 0, 1, dg.PUBLIC)
        assert [v % p for v, p in zip(got, dg.PRIMES)] == [r % p for r, p in zip(ref[:4], dg.PRIMES)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nonfinite_count_host_kernel_and_device_formula_agree(dtype, monkeypatch):
    """The packer's and receiver's finiteness check counts Inf/NaN with the digest's exponent test:
    the host kernel and the torch-op path (what devices run) give ``torch.isfinite``'s count."""
    import delta_sync.digest as dg

    g = torch.Generator().manual_seed(5)
    v = torch.randn(70_001, generator=g).to(dtype)
    v[torch.randint(0, v.numel(), (37,), generator=g)] = float("nan")
    v[[3, 70_000]] = float("inf")
    v[11] = float("-inf")
    want = int((~torch.isfinite(v)).sum())
    assert dg.nonfinite_count(v) == want
    monkeypatch.setattr(dg.native, "supports_words", lambda t: False)
    assert dg.nonfinite_count(v) == want and dg.nonfinite_count(v[:0]) == 0


@pytest.mark.parametrize("threads", [1, 3])
def test_scan_many_equals_scan_range_per_range(monkeypatch, threads):
    """Ranges digested together (spread over threads by whole ranges; one larger than a thread's
    share split by words on its own) give each range's own digest, count and copy; a bad range
    raises only after the others are done."""
    import delta_sync.digest as dg
    monkeypatch.setattr(dg, "_MIN_WORDS_PER_THREAD", 1 << 10)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    sizes = [5, 4096, 300, 70_000, 1, 9000, 12_345]  # 70_000: more than a third of the total
    items = []
    for k, n in enumerate(sizes):
        x = torch.randn(n, generator=g).to(torch.bfloat16 if k % 3 else torch.float32)
        if n > 100:
            x[n // 2] = float("nan")
        items.append((x, 11 * k, torch.zeros_like(x) if k % 2 else None))
    items.append((torch.randn(40, 3, generator=g).bfloat16()[:, 1], 7, torch.zeros(40, dtype=torch.bfloat16)))  # strided
    want = [dg.scan_range(v, s) for v, s, _ in items]
    assert dg.scan_many(items) == want and all(w[1] == (1 if v.numel() > 100 else 0) for w, (v, _, _) in zip(want, items))
    # the check alone (what a sender runs digest or not): the same counts and copies, no digests
    assert dg.scan_many(items, lanes=False) == [(dg.Digest(), w[1]) for w in want]
    assert any(w[0] != dg.Digest() for w in want)
    for v, _, out in items:
        if out is not None:
            assert torch.equal(int_view(out), int_view(v))  # bit for bit, NaN included
    bad = list(items) + [(torch.zeros(4, dtype=torch.bfloat16), 0, torch.zeros(3, dtype=torch.bfloat16))]
    for _, _, out in items:
        if out is not None:
            out.zero_()
    with pytest.raises(ValueError, match="copy_to holds 3"):
        dg.scan_many(bad)
    assert all(torch.equal(int_view(out), int_view(v)) for v, _, out in items if out is not None)  # others done


@pytest.mark.parametrize("threads", [1, 3])
def test_rows_from_addresses_digest_and_copy_as_scan_many(monkeypatch, threads):
    """:func:`scan_rows` of :func:`range_row` rows (addresses worked out by the caller, as a seed's
    writes through loader views do) gives each range :func:`scan_many`'s digest, Inf/NaN count and
    copy, under a key, shared out over the threads (rows larger than a thread's share cut in
    pieces, float32's two words apart never); a range past the digest's positions is refused when
    its row is made."""
    import delta_sync.digest as dg
    monkeypatch.setattr(dg, "_MIN_WORDS_PER_THREAD", 1 << 10)  # 70_000 and 9000: cut in pieces at 3 threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(threads)
    key = dg.DigestKey(b"rows-test")
    items, rows = [], []
    for k, n in enumerate([5, 4096, 300, 70_000, 1, 9000]):
        dtype = torch.bfloat16 if k % 3 else torch.float32
        x = torch.randn(n, generator=g).to(dtype)
        if n > 100:
            x[n // 3] = float("nan")
        out = torch.zeros_like(x) if k % 2 else None
        items.append((x, 13 * k, out))
        rows.append(dg.range_row(x.data_ptr(), n, 13 * k, dg.row_spec(dtype), 0 if out is None else out.data_ptr()))
    want = dg.scan_many([(x, s, None) for x, s, _ in items], key=key)
    assert dg.scan_rows(rows, key=key) == want and sum(b for _, b in want) == 4
    assert dg.scan_rows(rows) == dg.scan_many([(x, s, None) for x, s, _ in items])  # the public key
    for x, _, out in items:
        if out is not None:
            assert torch.equal(int_view(out), int_view(x))  # bit for bit, NaN included
    with pytest.raises(ValueError, match="positions reach"):
        dg.range_row(0, 8, dg.MAX_WORDS, dg.row_spec(torch.bfloat16))
    with pytest.raises(TypeError, match="1-byte"):
        dg.row_spec(torch.int8)


def test_a_buckets_digest_texts_made_and_read_together_equal_one_by_one():
    """A bucket's header digests written from a kernel table in one go (the packer's) are
    :meth:`DigestKey.masked` of each, at every position, pad blocks crossed (positions as a list, or
    as a range: a dense table's); read back (the
    engine's compare) they give the masked residues; anything that is not a digest's text is
    refused (None: the engine then checks entry by entry, naming the one that is wrong)."""
    import delta_sync.digest as dg
    key = dg.DigestKey.derive(b"k" * 32, "nonce")
    g = torch.Generator().manual_seed(4)
    n = dg.PAD_BLOCK + 37
    sums = torch.stack([torch.randint(0, p, (n,), generator=g) for p in dg.PRIMES] + [torch.zeros(n, dtype=torch.int64)], 1)
    positions = list(range(3, 3 + n))
    texts = dg.digest_texts(key.masked_table(sums, positions))
    assert texts == [key.masked(dg.Digest.of_residues(tuple(r[:4])), i) for r, i in zip(sums.tolist(), positions)]
    assert torch.equal(dg.parse_texts(texts), key.masked_table(sums, positions))
    assert torch.equal(key.masked_table(sums, range(3, 3 + n)), key.masked_table(sums, positions))  # (a slice)
    scattered = [7, 40 * dg.PAD_BLOCK + 1, 3, dg.CHECKSUM_PADS + 2]  # pad by pad, not whole blocks
    assert dg.digest_texts(key.masked_table(sums[:4], scattered)) == \
        [key.masked(dg.Digest.of_residues(tuple(r[:4])), i) for r, i in zip(sums[:4].tolist(), scattered)]
    assert dg.parse_texts([]).shape == (0, 4)
    for bad in (texts[:1] + [texts[1][:-1]], texts[:1] + ["zz" * 8], [None], texts[:1] + ["00 1" * 4], [12],
                texts[:1] + ["ABCDEF0123456789"]):  # (upper case: Digest.hex writes lower, a text compare refuses it)
        assert dg.parse_texts(bad) is None, bad


def test_verify_digests_written_and_summed_together_equal_one_by_one(monkeypatch):
    """What a verify compares, made in bulk: the texts of many whole tensors (host rows in one
    scan; a strided, a float16 and, without the kernel, every tensor through the torch path) are
    each tensor's :meth:`Digest.hex`; shares' texts add up to the whole's; engine workers' reports
    combine as the digests would (one worker: whole or inconsistent; several: shares summed,
    replicas agreeing, anything else inconsistent)."""
    import delta_sync.digest as dg
    g = torch.Generator().manual_seed(6)
    tensors = [torch.randn(n, generator=g).to(dt) for n, dt in
               [(5, torch.bfloat16), (4096, torch.float32), (0, torch.bfloat16), (300, torch.float16)]]
    tensors.append(torch.randn(40, 30, generator=g).to(torch.bfloat16).t())  # strided: the torch path
    want = [dg.digest_tensor(t).hex() for t in tensors]
    assert dg.tensor_texts(tensors) == want
    with monkeypatch.context() as m:
        m.setattr(native, "kernel", lambda: None)
        assert dg.tensor_texts(tensors) == want
    assert dg.tensor_texts([]) == []
    whole = tensors[1]
    shares = [dg.digest_range(whole[a:b], a).hex() for a, b in [(0, 1000), (1000, 1001), (1001, 4096)]]
    assert dg.add_texts([shares, [want[0]], shares[:1]]) == [want[1], want[0], shares[0]]
    with pytest.raises(ValueError, match="not a digest"):
        dg.add_texts([[shares[0], "zz" * 8]])
    one = {"digests": {"a": [want[0], 5, 5], "b": [shares[0], 1000, 4096]}}
    assert dg.combine_reports([one]) == {"a": want[0], "b": "inconsistent"}
    workers = [{"digests": {"w": [shares[0], 1000, 4096], "r": [want[0], 5, 5], "x": [want[0], 5, 5],
                            "y": [shares[0], 1000, 4096]}},
               {"digests": {"w": [shares[1], 1, 4096], "r": [want[0], 5, 5], "x": [want[3], 5, 5]}},
               {"digests": {"w": [shares[2], 3095, 4096], "r": [want[0], 5, 5]}}]
    assert dg.combine_reports(workers) == {"w": want[1], "r": want[0], "x": "inconsistent", "y": "inconsistent"}
    assert dg.differs("e", workers, {"w": want[1], "r": want[0]}) is None
    assert "2 tensor(s) differ, first 'x' (digest mismatch)" in dg.differs("e", workers, {"x": want[0], "z": want[0]})


def test_device_path_digests_many_ranges_with_one_sync(monkeypatch):
    """The torch-op digest (device tensors) of many ranges: small ones folded together in shared
    rows, large ones alone, cut in chunks; each range gets the host kernel's digest, count and
    copy, and every result crosses to the host in one copy (one device sync, not one per range)."""
    import delta_sync.digest as dg
    g = torch.Generator().manual_seed(5)
    sizes = [5, 4096, 0, 300, 70_000, 1, 9000, 12_345, 257]
    items = []
    for k, n in enumerate(sizes):
        x = (torch.randn(n, generator=g) * 3000).to((torch.bfloat16, torch.float32, torch.float16)[k % 3])
        if n > 100:
            x[n // 2], x[n // 3] = float("nan"), float("-inf")
        items.append((x, 11 * k + (2_000_000_000 if k == 4 else 0), torch.zeros_like(x) if k % 2 else None))
    want = [dg.scan_range(v, st) for v, st, _ in items]  # the host kernel
    monkeypatch.setattr(native, "kernel", lambda: None)  # from here, the torch ops devices run
    monkeypatch.setattr(dg, "DEVICE_SMALL_WORDS", 10_000)  # 70_000 and 12_345 (bf16) alone
    monkeypatch.setattr(dg, "DEVICE_CHUNK_WORDS", 8192)  # several batches of small ranges, several chunks
    dg.scan_many(items)  # (once: the key's weight tables are made at a first use, then kept)
    syncs = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: syncs.append(t.shape) or real(t))
    assert dg.scan_many(items) == want and len(syncs) == 1
    assert [w[1] for w in want] == [0, 2, 0, 2, 2, 0, 2, 2, 2]
    for v, _, out in items:
        if out is not None:
            assert torch.equal(int_view(out), int_view(v))



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_span_digests_equal_each_tensors_own(dtype):
    """Whole tensors lying in one buffer, digested as rows made as columns (FlatWeights' sweep and
    verify), equal each tensor's own digest, keyed or public; off the host kernel's reach: None."""
    from delta_sync.digest import DigestKey, span_digests, tensor_digests

    g = torch.Generator().manual_seed(11)
    buf = torch.randn(4096, generator=g).to(dtype)
    offsets, numels = [0, 100, 1000, 1001, 3000], [100, 900, 1, 2000, 1096]
    views = [buf.narrow(0, o, n) for o, n in zip(offsets, numels)]
    for key in (None, DigestKey.derive(b"k" * 32, "span")):
        got = span_digests(buf, offsets, numels, key)
        assert got is not None and got == tensor_digests(views, key)
    assert span_digests(buf[::2], [0], [10]) is None  # not contiguous: the caller takes views
