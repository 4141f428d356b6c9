"""Position-weighted digest, additive over flat-index ranges.

For the 16-bit words ``k`` of a tensor (a bf16/fp16 element is one word, fp32 two, low word
first) read as signed integers ``s_k``, lane ``l`` of the digest is::

    D_l = sum_k s_k * ((a_l * k + c_l) mod P_l)   mod P_l

in four lanes with distinct primes ``P_l < 2**15`` (about 60 bits together; by the CRT two
positions share every weight only if they are ~2**60 apart, so shifted rows, swapped elements
and wrong shard offsets change the digest; a changed word changes every lane, since no
difference of two 16-bit words is a multiple of all four primes). Because it is a sum over
words, the digest of a tensor is the sum of the digests of any partition of its flat indices:
TP shards, buckets and patches add up to the whole. Since a weight is congruent to ``a_l * k +
c_l``, a lane equals ``a_l * S1 + c_l * S0 mod P_l`` with ``S0 = sum s_k`` and ``S1 = sum k * s_k``:
the host kernel computes just those two sums (two multiply-adds per 16 words).

Every product is ``< 2**31`` and is summed in int64, so int32 multiply + int64 sum reproduce the
same bits on CPU, CUDA and NPU; no float64 and no overflow anywhere (HCCL rejects float64
all_reduce; ``torch.hash_tensor`` has no NPU kernel). Host tensors take the compiled kernel of
:mod:`delta_sync.native` (the same integers, at memory speed, fused with the non-finite scan
that validation needs, so verification costs no pass of its own); other devices take torch ops.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import native
from .accelerator import read_back

#: (P, a, c) per lane.
_LANES = ((32749, 7919, 101), (32719, 20011, 7), (32717, 12347, 3571), (32713, 28657, 1597))
#: each lane's modulus (lane sums from several parts add up modulo these)
PRIMES = tuple(p for p, _, _ in _LANES)
#: elements per step of :func:`element_sums`: bounds its temporaries to a few MiB.
CHUNK = 1 << 18
#: words per row of the device formula: a word's offset in its row times the word stays below
#: ``2**15 * 2**15``, so the products fit int32 (no int64 temporaries).
ROW = 1 << 15
#: words per step of the device formula (64 MiB of int32 temporaries per pass; rows of a step are
#: folded with a handful of small ops, so a model of hundreds of tensors is a few hundred steps).
DEVICE_CHUNK_WORDS = 1 << 24
#: words per thread below which a range is digested on the calling thread.
_MIN_WORDS_PER_THREAD = 1 << 20
#: exponent bits that mark Inf/NaN in the word holding them, per element width.
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F80}
_consts_cache: dict[tuple, "_Consts"] = {}


@functools.cache
def _native_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, a, c) per lane, as int64 arrays for the kernel (built once; the cache makes concurrent
    first calls from the digest's threads safe)."""
    return tuple(torch.tensor([lane[col] for lane in _LANES], dtype=torch.int64) for col in range(3))


def _words(values: torch.Tensor) -> torch.Tensor:
    """The 16-bit words of ``values`` as int16, flattened (a contiguous copy only if needed)."""
    flat = values.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.element_size() == 1:
        raise TypeError(f"digest of 1-byte dtype {flat.dtype} is not defined")
    return flat.view(torch.int16)


def _words_per_element(values: torch.Tensor) -> int:
    return max(1, values.element_size() // 2)


class Digest(tuple):
    """Residues of the four lanes; ``+`` combines digests of disjoint index sets, ``-`` removes one."""

    def __new__(cls, *lanes: int):
        lanes = lanes or (0,) * len(_LANES)
        return super().__new__(cls, tuple(int(x) % p for x, (p, _, _) in zip(lanes, _LANES)))

    def __add__(self, other):  # type: ignore[override]
        return Digest(*(x + y for x, y in zip(self, other)))

    def __sub__(self, other):
        return Digest(*(x - y for x, y in zip(self, other)))

    def hex(self) -> str:
        return "".join(f"{x:04x}" for x in self)

    @classmethod
    def parse(cls, text: str) -> "Digest":
        return cls(*(int(text[i:i + 4], 16) for i in range(0, 4 * len(_LANES), 4)))


def _native_range(words: torch.Tensor, word0: int, lanes: int, exp_mask: int, stride: int,
                  dst: torch.Tensor | None = None) -> tuple[list[int], int]:
    p, a, c = _native_args()
    out = torch.zeros(4, dtype=torch.int64)
    bad = native.kernel().digest_words(words.data_ptr(), words.numel(), word0, lanes, p.data_ptr(), a.data_ptr(),
                                       c.data_ptr(), out.data_ptr(),
                                       ctypes.c_int16(exp_mask - 65536 if exp_mask > 32767 else exp_mask),
                                       stride, stride - 1, None if dst is None else dst.data_ptr())
    return out.tolist()[:lanes], int(bad)


def _scan_words(words: torch.Tensor, word0: int, lanes: int, exp_mask: int, stride: int,
                dst: torch.Tensor | None = None, threads: int | None = None) -> tuple[list[int], int]:
    """Lane sums and non-finite count of int16 ``words`` at word positions ``word0, ...``; with
    ``dst`` (int16, as many words, same device) the words are copied there in the same pass.
    Host words are split over up to ``threads`` threads (None: torch's count)."""
    if _native_ok(words, dst):
        n = words.numel()
        threads = max(1, min(threads or torch.get_num_threads(), n // _MIN_WORDS_PER_THREAD))
        if threads == 1:
            return _native_range(words, word0, lanes, exp_mask, stride, dst)
        step = -(-n // threads)
        step += (-step) % max(stride, 1)  # every part starts on an element boundary
        parts, error = native.run_spread([
            functools.partial(_native_range, words[s:s + step], word0 + s, lanes, exp_mask, stride,
                              None if dst is None else dst[s:s + step]) for s in range(0, n, step)])
        if error is not None:
            raise error
        return [sum(x[0][lane] for x in parts) % _LANES[lane][0] for lane in range(lanes)], sum(x[1] for x in parts)
    if dst is not None:
        dst.copy_(words)
    sums = lane_sums(words, word0, lanes, exp_mask, stride)
    values = sums.tolist()  # the one host sync of a device digest
    return values[:lanes], values[lanes]


def _native_ok(words: torch.Tensor, dst: torch.Tensor | None) -> bool:
    return native.supports_words(words) and (dst is None or (dst.device.type == "cpu" and dst.is_contiguous()))


def lane_sums(words: torch.Tensor, word0: int, lanes: int = len(_LANES), exp_mask: int = 0,
              stride: int = 1) -> torch.Tensor:
    """int64 ``[lane residues..., non-finite count]`` of int16 ``words`` on their own device.

    Torch ops only, no host round trip: what device tensors run (and what the fake-device tests
    check for host/device mixing). A lane is ``a*S1 + c*S0 mod P`` (module docstring). The words
    are cut in rows of :data:`ROW` (:func:`_fold_rows`), a chunk of :data:`DEVICE_CHUNK_WORDS`
    at a time: about fifteen kernel launches per chunk, whatever its size."""
    k = _consts(words.device, lanes)
    s0 = s1 = bad = None
    total = words.numel()
    for e in range(0, total, DEVICE_CHUNK_WORDS):
        n = min(DEVICE_CHUNK_WORDS, total - e)
        part = words.narrow(0, e, n)  # narrow, not [a:b]: indexing syncs with the device
        rows = -(-n // ROW)
        x = part.to(torch.int32)
        if n % ROW:  # a short last row, zero-padded (only a tensor's or a range's end)
            x = torch.cat([x, x.new_zeros(rows * ROW - n)])
        c0, c1 = _fold_rows(k, x.view(rows, ROW), k.row_starts.narrow(0, 0, rows) + (word0 + e))
        s0, s1 = (c0, c1) if s0 is None else (s0 + c0, s1 + c1)
        if exp_mask:
            high = part if stride == 1 else part.view(-1, stride).select(1, stride - 1)
            hits = ((high & exp_mask) == exp_mask).sum()
            bad = hits if bad is None else bad + hits
    if s0 is None:
        s0 = s1 = torch.zeros(lanes, 1, dtype=torch.int64, device=words.device)
    if bad is None:
        bad = torch.zeros((), dtype=torch.int64, device=words.device)
    return torch.cat([((k.a * s1 + k.c * s0) % k.p).squeeze(1), bad.view(1)])


class _Consts:
    """Per device and lane count: the lanes' (P, a, c) as (lanes, 1) columns, the row offsets
    ``0..ROW-1`` (int32) and each row's first word ``r * ROW`` (int64), made once."""

    def __init__(self, device: torch.device, lanes: int):
        def col(k):
            return torch.tensor([lane[k] for lane in _LANES[:lanes]], dtype=torch.int64).view(-1, 1).to(device)
        self.p, self.a, self.c = col(0), col(1), col(2)
        self.j = torch.arange(ROW, dtype=torch.int32, device=device)
        self.row_starts = torch.arange(0, DEVICE_CHUNK_WORDS + ROW, ROW, dtype=torch.int64, device=device)


def _consts(device: torch.device, lanes: int) -> _Consts:
    key = (device, lanes, ROW, DEVICE_CHUNK_WORDS)
    if key not in _consts_cache:
        _consts_cache[key] = _Consts(device, lanes)
    return _consts_cache[key]


def _fold_rows(k: _Consts, x: torch.Tensor, first: torch.Tensor, owner: torch.Tensor | None = None,
               items: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S0, S1) mod P``, (lanes, items) int64, of int32 rows ``x`` (rows, width <= ROW) whose
    first words stand at positions ``first`` (int64, per row) and belong to item ``owner`` (per
    row; None: all to one). Per row ``S0_r = sum s_j`` and ``T_r = sum j*s_j`` (int32 products
    below ``2**30``, int64 sums); then ``S1 = sum_r first_r*S0_r + T_r``, folded modulo each prime."""
    r0 = x.sum(dim=1, dtype=torch.int64)
    t = (x * k.j.narrow(0, 0, x.shape[1])).sum(dim=1, dtype=torch.int64)
    r0p = r0.unsqueeze(0) % k.p  # (lanes, rows), each < 2**15
    c1 = (first.unsqueeze(0) % k.p) * r0p + t.unsqueeze(0) % k.p  # < 2**31: rows sum in int64
    if owner is None:
        return r0p.sum(dim=1, keepdim=True) % k.p, c1.sum(dim=1, keepdim=True) % k.p
    s0 = torch.zeros(r0p.shape[0], items, dtype=torch.int64, device=x.device).index_add_(1, owner, r0p)
    s1 = torch.zeros_like(s0).index_add_(1, owner, c1)
    return s0 % k.p, s1 % k.p


#: words per row when many small ranges are digested together (each padded to whole rows)
SMALL_ROW = 256
#: ranges of at most this many words are digested together on a device (:func:`_lane_sums_many`):
#: 8 MB, so a MoE's expert matrices (Qwen3-30B-A3B: 3 MB each, 18k of them) share launches. On an
#: H200 at 2 MB they went one by one at ~0.28 ms each (digest 28x a device copy of the model).
DEVICE_SMALL_WORDS = 1 << 22


def _lane_sums_many(parts: list[tuple[torch.Tensor, int]], lanes: int, exp_mask: int, stride: int
                    ) -> torch.Tensor:
    """:func:`lane_sums` of many small ``(words, word0)`` ranges on one device, (ranges, lanes+1):
    each range is copied into whole rows of :data:`SMALL_ROW` words of one buffer, and the buffer
    is folded at once. A few launches per range (its copy) and ~20 per batch, instead of ~20 per
    range; the rows' positions and owners cross from the host in one copy."""
    dev = parts[0][0].device
    k = _consts(dev, lanes)
    rows = [-(-w.numel() // SMALL_ROW) for w, _ in parts]
    total = sum(rows)
    buf = torch.zeros(total * SMALL_ROW, dtype=torch.int16, device=dev)
    meta = torch.empty(2, total, dtype=torch.int64)  # host: first word position, owner
    at = 0
    for i, ((w, word0), r) in enumerate(zip(parts, rows)):
        buf.narrow(0, at * SMALL_ROW, w.numel()).copy_(w)
        meta[0, at:at + r] = torch.arange(r, dtype=torch.int64) * SMALL_ROW + word0
        meta[1, at:at + r] = i
        at += r
    first, owner = meta.to(dev).unbind(0)
    words = buf.view(total, SMALL_ROW)
    s0, s1 = _fold_rows(k, words.to(torch.int32), first, owner, len(parts))
    bad = torch.zeros(len(parts), dtype=torch.int64, device=dev)
    if exp_mask:
        high = words if stride == 1 else words.view(total, -1, stride).select(2, stride - 1)
        bad.index_add_(0, owner, ((high & exp_mask) == exp_mask).sum(dim=1))
    return torch.cat([((k.a * s1 + k.c * s0) % k.p).t(), bad.unsqueeze(1)], dim=1)


def scan_range(values: torch.Tensor, start: int = 0, copy_to: torch.Tensor | None = None,
               threads: int | None = None, lanes: bool = True) -> tuple[Digest, int]:
    """Digest of ``values`` standing at flat indices ``start, ...`` and its count of Inf/NaN elements.

    One pass over the bytes: what a receiver (and the packing sender) runs on every bulk value.
    With ``copy_to`` (a contiguous tensor of as many elements and the same element size) the
    values are also copied there in that pass: the packer fills a bucket this way. Host values
    are split over up to ``threads`` threads (None: torch's count). ``lanes=False``: the Inf/NaN
    count alone (an all-zero digest), the validation a sender runs on every range before it
    leaves, digest or not: what the digest's own cost is measured against."""
    w = _words_per_element(values)
    sums, bad = _scan_words(_words(values), start * w, len(_LANES) if lanes else 0, _EXP_MASK.get(values.dtype, 0),
                            w, _copy_target(values, copy_to), threads)
    return Digest(*sums), bad


def _copy_target(values: torch.Tensor, copy_to: torch.Tensor | None) -> torch.Tensor | None:
    """``copy_to`` as int16 words, checked against ``values``."""
    if copy_to is None:
        return None
    if copy_to.numel() != values.numel() or copy_to.element_size() != values.element_size():
        raise ValueError(f"copy_to holds {copy_to.numel()} x {copy_to.element_size()} B, values "
                         f"{values.numel()} x {values.element_size()} B")
    return copy_to.reshape(-1).view(torch.int16)


def scan_many(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], lanes: bool = True
              ) -> list[tuple[Digest, int]]:
    """:func:`scan_range` of many ``(values, start, copy_to)`` ranges, in order (``lanes``: as there).

    Host ranges are spread over the threads by whole ranges, each scanned on one thread, instead of
    each range being split over all of them: a model's hundreds of few-MB tensors would otherwise
    pay a thread handoff per range and thread (here 1.2 GB in 200 tensors: 0.15 s split one by one,
    0.09 s as one array). A range larger than a thread's share still splits by words, on its own.
    Device ranges are digested without a host round trip each (:func:`_scan_device`): one for all.
    Every range is done before an error is raised."""
    threads = max(1, torch.get_num_threads())
    sizes = [v.numel() * v.element_size() for v, _, _ in items]
    host = [_native_ok(v, dst) for v, _, dst in items]
    share = sum(n for n, ok in zip(sizes, host) if ok) // threads
    pooled = [i for i, ok in enumerate(host) if ok and threads > 1 and sizes[i] <= share]
    alone = sorted(set(i for i, ok in enumerate(host) if ok) - set(pooled))
    out: list[tuple[Digest, int] | None] = [None] * len(items)

    def run(indices: list[int], threads_each: int | None) -> None:
        for i in indices:
            out[i] = scan_range(*items[i], threads=threads_each, lanes=lanes)

    groups = [pooled[lo:hi] for lo, hi in native.contiguous_groups([sizes[i] for i in pooled], threads)]
    _, error = native.run_spread([functools.partial(run, g, 1) for g in groups])  # every range finishes first
    try:
        run(alone, None)
        _scan_device(items, [i for i, ok in enumerate(host) if not ok], out)
        if not lanes:  # device ranges were digested anyway: their digests are dropped alike
            out = [None if o is None else (Digest(), o[1]) for o in out]
    except BaseException as e:
        error = error or e
    if error is not None:
        raise error
    return out  # type: ignore[return-value]


def _scan_device(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], indices: list[int],
                 out: list) -> None:
    """:func:`scan_range` of the torch-path ranges ``items[i]``, ``i`` in ``indices``, into ``out[i]``.

    On a device each ``scan_range`` ends in a host round trip (~20 launches and a sync per range:
    a model's hundreds of tensors would pay it hundreds of times). Here ranges of up to
    :data:`DEVICE_SMALL_WORDS` words are folded together (:func:`_lane_sums_many`), larger ones
    one by one, and every result crosses to the host in one copy per device."""
    sums: dict[int, torch.Tensor] = {}
    small: dict[tuple, list[tuple[int, torch.Tensor, int]]] = {}
    for i in indices:
        values, start, copy_to = items[i]
        w, mask = _words_per_element(values), _EXP_MASK.get(values.dtype, 0)
        words, dst = _words(values), _copy_target(values, copy_to)
        if dst is not None:
            dst.copy_(words)
        if words.numel() <= DEVICE_SMALL_WORDS:
            small.setdefault((words.device, mask, w), []).append((i, words, start * w))
        else:
            sums[i] = lane_sums(words, start * w, len(_LANES), mask, w)
    for (_, mask, w), members in small.items():
        for lo, hi in native.capped_groups([m[1].numel() for m in members], DEVICE_CHUNK_WORDS):
            part = members[lo:hi]
            rows = _lane_sums_many([(words, word0) for _, words, word0 in part], len(_LANES), mask, w)
            sums.update((i, row) for (i, _, _), row in zip(part, rows.unbind(0)))
    for i, row in zip(sums, read_back(list(sums.values()))):  # the one sync per device
        out[i] = (Digest(*row[:len(_LANES)]), row[len(_LANES)])


def nonfinite_count(values: torch.Tensor) -> int:
    """How many elements of ``values`` are Inf or NaN: the exponent test of :func:`scan_range`
    without its lanes (on host memory ~25x faster than ``torch.isfinite`` on bf16 here)."""
    _, bad = _scan_words(_words(values), 0, 0, _EXP_MASK.get(values.dtype, 0), _words_per_element(values))
    return bad


def digest_range(values: torch.Tensor, start: int = 0) -> Digest:
    """Digest of ``values`` (any shape, flattened) standing at flat indices ``start, start+1, ...``."""
    w = _words_per_element(values)
    lanes, _ = _scan_words(_words(values), start * w, len(_LANES), 0, w)
    return Digest(*lanes)


def digest_elements(indices: torch.Tensor, values: torch.Tensor) -> Digest:
    """Digest of the elements ``values[k]`` standing at flat index ``indices[k]``."""
    return Digest(*element_sums(indices, values).tolist())


def element_sums(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """int64 lane residues of :func:`digest_elements`, on the values' device (no host round trip)."""
    flat = values.reshape(-1)
    w = _words_per_element(flat)
    idx = indices.reshape(-1)
    primes = torch.tensor([p for p, _, _ in _LANES], dtype=torch.int64, device=flat.device).unsqueeze(1)
    mults = torch.tensor([a for _, a, _ in _LANES], dtype=torch.int64, device=flat.device).unsqueeze(1)
    adds = torch.tensor([c for _, _, c in _LANES], dtype=torch.int64, device=flat.device).unsqueeze(1)
    acc = torch.zeros(len(_LANES), dtype=torch.int64, device=flat.device)
    for e in range(0, flat.numel(), CHUNK // w):  # CHUNK words at a time: bounded temporaries
        n = min(CHUNK // w, flat.numel() - e)
        part = _words(flat.narrow(0, e, n)).to(torch.int32)
        pos = idx.narrow(0, e, n).to(torch.int64)
        if w > 1:
            pos = (pos.unsqueeze(1) * w + torch.arange(w, device=pos.device)).reshape(-1)
        weight = ((pos.unsqueeze(0) % primes) * mults + adds) % primes
        acc = (acc + (part.unsqueeze(0) * weight.to(torch.int32)).sum(dim=1, dtype=torch.int64)) % primes.squeeze(1)
    return acc


def digest_tensor(t: torch.Tensor) -> Digest:
    return digest_range(t, 0)


def checksum_bytes(*parts: torch.Tensor) -> str:
    """Checksum of byte buffers (a bucket's index and value payloads), in order, on their device.

    Per buffer: its byte count and two digest lanes over its 16-bit words (a zero byte pads an
    odd length). It guards a bucket in flight (a flipped, dropped or shifted word) at half the
    digest's cost, with the same kernel.
    """
    out = []
    for buf in parts:
        flat = buf.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n % 2 or (flat.storage_offset() % 2):
            padded = torch.zeros(n + n % 2, dtype=torch.uint8, device=flat.device)
            padded[:n] = flat
            flat = padded
        lanes, _ = _scan_words(flat.view(torch.int16), 0, 2, 0, 1)
        out.append(f"{n:x}.{lanes[0] % _LANES[0][0]:x}.{lanes[1] % _LANES[1][0]:x}")
    return "/".join(out)
