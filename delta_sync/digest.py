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

#: (P, a, c) per lane.
_LANES = ((32749, 7919, 101), (32719, 20011, 7), (32717, 12347, 3571), (32713, 28657, 1597))
#: each lane's modulus (lane sums from several parts add up modulo these)
PRIMES = tuple(p for p, _, _ in _LANES)
#: words digested per step: bounds temporaries to a few MiB whatever the tensor size.
CHUNK = 1 << 18
#: words per thread below which a range is digested on the calling thread.
_MIN_WORDS_PER_THREAD = 1 << 20
#: exponent bits that mark Inf/NaN in the word holding them, per element width.
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F80}
_tables: dict[torch.device, torch.Tensor] = {}


def _weight_table(device: torch.device) -> torch.Tensor:
    """int32 (lanes, CHUNK): (a*j + c) mod P; the weights of a range starting at s are these + a*s."""
    if device not in _tables:
        j = torch.arange(CHUNK, dtype=torch.int64)
        rows = [(j * a + c) % p for p, a, c in _LANES]
        _tables[device] = torch.stack(rows).to(torch.int32).to(device)
    return _tables[device]


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
    check for host/device mixing)."""
    table = _weight_table(words.device).narrow(0, 0, lanes)
    primes = torch.tensor([p for p, _, _ in _LANES[:lanes]], dtype=torch.int64, device=words.device)
    mults = torch.tensor([a for _, a, _ in _LANES[:lanes]], dtype=torch.int64, device=words.device)
    acc = torch.zeros(lanes, dtype=torch.int64, device=words.device)
    bad = torch.zeros((), dtype=torch.int64, device=words.device)
    total_words = words.numel()
    for e in range(0, total_words, CHUNK):  # CHUNK words at a time: bounded temporaries
        n = min(CHUNK, total_words - e)
        part = words.narrow(0, e, n).to(torch.int32)  # narrow, not [a:b]: indexing syncs with the device
        total = part.sum(dtype=torch.int64)
        weighted = (part.unsqueeze(0) * table.narrow(1, 0, n)).sum(dim=1, dtype=torch.int64)
        # sum_j s_j*((a*(k0+j)+c) mod P) == sum_j s_j*W_j + (a*k0 mod P)*sum_j s_j   (mod P)
        offset = (mults * ((word0 + e) % primes)) % primes
        acc = (acc + weighted % primes + (total % primes) * offset) % primes
        if exp_mask:
            high = part if stride == 1 else part.view(-1, stride).select(1, stride - 1)
            bad = bad + ((high & exp_mask) == exp_mask).sum()
    return torch.cat([acc, bad.view(1)])


def scan_range(values: torch.Tensor, start: int = 0, copy_to: torch.Tensor | None = None,
               threads: int | None = None) -> tuple[Digest, int]:
    """Digest of ``values`` standing at flat indices ``start, ...`` and its count of Inf/NaN elements.

    One pass over the bytes: what a receiver (and the packing sender) runs on every bulk value.
    With ``copy_to`` (a contiguous tensor of as many elements and the same element size) the
    values are also copied there in that pass: the packer fills a bucket this way. Host values
    are split over up to ``threads`` threads (None: torch's count)."""
    w = _words_per_element(values)
    mask = _EXP_MASK.get(values.dtype, 0)
    dst = None
    if copy_to is not None:
        if copy_to.numel() != values.numel() or copy_to.element_size() != values.element_size():
            raise ValueError(f"copy_to holds {copy_to.numel()} x {copy_to.element_size()} B, values "
                             f"{values.numel()} x {values.element_size()} B")
        dst = copy_to.reshape(-1).view(torch.int16)
    lanes, bad = _scan_words(_words(values), start * w, len(_LANES), mask, w, dst, threads)
    return Digest(*lanes), bad


def scan_many(items: list[tuple[torch.Tensor, int, torch.Tensor | None]]) -> list[tuple[Digest, int]]:
    """:func:`scan_range` of many ``(values, start, copy_to)`` ranges, in order.

    Host ranges are spread over the threads by whole ranges, each scanned on one thread, instead of
    each range being split over all of them: a model's hundreds of few-MB tensors would otherwise
    pay a thread handoff per range and thread (here 1.2 GB in 200 tensors: 0.15 s split one by one,
    0.09 s as one array). A range larger than a thread's share still splits by words, on its own.
    Every range is done before an error is raised."""
    threads = max(1, torch.get_num_threads())
    sizes = [v.numel() * v.element_size() for v, _, _ in items]
    whole = [threads > 1 and _native_ok(v, dst) for v, _, dst in items]
    share = sum(n for n, ok in zip(sizes, whole) if ok) // threads
    pooled = [i for i, ok in enumerate(whole) if ok and sizes[i] <= share]
    alone = sorted(set(range(len(items))) - set(pooled))
    out: list[tuple[Digest, int] | None] = [None] * len(items)

    def run(indices: list[int], threads_each: int | None) -> None:
        for i in indices:
            out[i] = scan_range(*items[i], threads=threads_each)

    groups = [pooled[lo:hi] for lo, hi in native.contiguous_groups([sizes[i] for i in pooled], threads)]
    _, error = native.run_spread([functools.partial(run, g, 1) for g in groups])  # every range finishes first
    try:
        run(alone, None)
    except BaseException as e:
        error = error or e
    if error is not None:
        raise error
    return out  # type: ignore[return-value]


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
