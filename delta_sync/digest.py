"""Keyed position-weighted digest, additive over flat-index ranges.

For the 16-bit words ``k`` of a tensor (a bf16/fp16 element is one word, fp32 two, low word
first) read as signed integers ``s_k``, lane ``l`` of the digest under key ``K`` is::

    D_l = sum_k s_k * t1_l[k % R] * t2_l[(k / R) % R] * t3_l[k / R**2]   mod P_l,   R = 1024

in four lanes with distinct primes ``P_l < 2**15``; the tables are the key, drawn from a seed by
SHAKE-256 (:class:`DigestKey`). Because it is a sum over words, the digest of a tensor is the sum
of the digests of any partition of its flat indices: TP shards, buckets and patches add up to the
whole. A word's weight depends on its position, so shifted rows, swapped elements and wrong shard
offsets change it.

Without the key, changing bytes so that every lane stays put is a guess: a nonzero change is a
nonzero polynomial of degree 3 in the (secret, uniformly drawn) table entries, which vanishes with
probability at most ``1/2**12 + 2/P`` per lane (Schwartz-Zippel: ``t1`` is drawn below ``2**12``
so that eight of the kernel's 16-bit multiply-adds sum in int32), about ``2**-46`` for the four
together, and a failed try is refused loudly under a key that the next bucket changes. A weight that is affine in the position (this module's earlier form) is not keyed by any
choice of constants: adding ``+d, -2d, +d`` to three neighbouring words kept every lane. The bulk
payload is digested under a key derived from the channel key and a nonce per bucket
(:meth:`DigestKey.derive`), and the digests a bucket's header carries are masked with a pad drawn
from the same key (:meth:`DigestKey.pad`), so they reveal nothing about the tables. Digests that
two parties compare without a shared secret (verify, the drift sweep) use :data:`PUBLIC`.

Every product is ``< 2**31`` and is summed in int64, so int32 multiply + int64 sum reproduce the
same bits on CPU, CUDA and NPU; no float64 and no overflow anywhere (HCCL rejects float64
all_reduce; ``torch.hash_tensor`` has no NPU kernel). Host tensors take the compiled kernel of
:mod:`delta_sync.native` (one 16-bit multiply-add per word and lane, fused with the non-finite
scan that validation needs, so verification costs no pass of its own); other devices take torch
ops.
"""

from __future__ import annotations

import array
import ctypes
import functools
import hashlib
import hmac
import sys
from typing import Callable

import torch

from . import native
from .accelerator import ReadBack, read_back

#: each lane's modulus (lane sums from several parts add up modulo these)
PRIMES = (32749, 32719, 32717, 32713)
_LANES = len(PRIMES)
_HEX = "%04x" * _LANES  # a digest's text: four hex digits per lane
#: words per row of the key's first table (the kernel's unit: a row's weights stay in L1)
KEY_ROW = 1 << 10
#: rows per entry of the third table; positions reach ``KEY_ROW * KEY_ROW * T3`` words (8 GiB)
T3 = 1 << 12
MAX_WORDS = KEY_ROW * KEY_ROW * T3
#: first-table entries are below this, so eight products of a word and one sum in int32
T1_BOUND = 1 << 12
#: elements per step of :func:`element_sums`: bounds its temporaries to a few MiB.
CHUNK = 1 << 18
#: words per step of the device formula (its temporaries: two int8 pieces per word, or with the
#: per-lane fallback an int32 copy and an int32 product per word)
DEVICE_CHUNK_WORDS = 1 << 24
#: words per thread below which a range is digested on the calling thread.
_MIN_WORDS_PER_THREAD = 1 << 20
#: digest pads drawn per SHAKE-256 call (:meth:`DigestKey._pad`)
PAD_BLOCK = 256
#: exponent bits that mark Inf/NaN in the word holding them, per element width.
_EXP_MASK = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F80}


class DigestKey:
    """The tables of one key: ``t1`` (lanes, KEY_ROW) below :data:`T1_BOUND`, ``t2`` (lanes,
    KEY_ROW) and ``t3`` (lanes, T3) in ``[1, P)``, int16 on the host, drawn from ``seed`` by
    SHAKE-256. A nonzero entry everywhere: no row of a key is blind."""

    def __init__(self, seed: bytes):
        self.seed = seed
        n = _LANES * (2 * KEY_ROW + T3)
        raw = torch.frombuffer(bytearray(hashlib.shake_256(b"delta-sync/digest-key\0" + seed).digest(2 * n)),
                               dtype=torch.int16).to(torch.int64) & 0xFFFF
        p = torch.tensor(PRIMES, dtype=torch.int64).view(-1, 1)
        t1, t2, t3 = raw.view(_LANES, -1).split([KEY_ROW, KEY_ROW, T3], dim=1)
        self.t1 = (t1 % (T1_BOUND - 1) + 1).to(torch.int16).contiguous()
        self.t2 = (t2 % (p - 1) + 1).to(torch.int16).contiguous()
        self.t3 = (t3 % (p - 1) + 1).to(torch.int16).contiguous()
        self.p = p.view(-1).contiguous()
        self._on: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._int8: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # :meth:`int8_columns`, per device
        self._pads: dict[int, torch.Tensor] = {}  # pad blocks drawn so far
        self._pad_tuples: dict[int, list[tuple[int, ...]]] = {}  # and as tuples, for :meth:`_pad`

    @classmethod
    def derive(cls, secret: bytes, nonce: str) -> "DigestKey":
        """The key of one bucket: from the channel's key and the bucket's nonce (which its MACed
        header carries), so both ends draw the same tables and nobody else can."""
        return cls(hmac.digest(secret, b"delta-sync/payload-digest\0" + nonce.encode(), "sha256"))

    def pad(self, i: int) -> "Digest":
        """The mask of the ``i``-th digest a header carries under this key."""
        return Digest(*self._pad(i))

    def _pad(self, i: int) -> tuple[int, ...]:
        """Pads come from SHAKE-256 in blocks of :data:`PAD_BLOCK` (one XOF call per block, not
        per digest: a seed bucket's header carries thousands), block ``i // PAD_BLOCK`` keyed by
        the seed and its number."""
        b, at = divmod(i, PAD_BLOCK)
        block = self._pad_tuples.get(b)
        if block is None:
            block = self._pad_tuples[b] = [tuple(r) for r in self._block(b).tolist()]
        return block[at]

    def _block(self, b: int) -> torch.Tensor:
        """Pad block ``b`` as a (PAD_BLOCK, lanes) int64 tensor (drawn once per key)."""
        block = self._pads.get(b)
        if block is None:
            raw = hashlib.shake_256(b"delta-sync/digest-pads\0" + self.seed + b.to_bytes(8, "little")
                                    ).digest(2 * _LANES * PAD_BLOCK)
            words = array.array("H", raw)  # little-endian 16-bit words, on any host
            if sys.byteorder == "big":
                words.byteswap()
            block = self._pads[b] = (torch.frombuffer(bytearray(words.tobytes()), dtype=torch.int16)
                                     .to(torch.int64) & 0xFFFF).view(PAD_BLOCK, _LANES)
        return block

    def pads(self, positions: list[int] | range) -> torch.Tensor:
        """(n, lanes) int64: :meth:`pad` of each header position, as numbers (positions that lie
        close together, a bucket's entries, from whole blocks at once; a ``range`` of them, a dense
        table's, as one slice)."""
        if not positions:
            return torch.zeros(0, _LANES, dtype=torch.int64)
        lo, hi = min(positions) // PAD_BLOCK, max(positions) // PAD_BLOCK
        if hi - lo >= len(positions) // PAD_BLOCK + 8:  # scattered: pad by pad
            return torch.tensor([self._pad(i) for i in positions], dtype=torch.int64).view(-1, _LANES)
        rows = torch.cat([self._block(b) for b in range(lo, hi + 1)])
        if isinstance(positions, range) and positions.step == 1:
            return rows[positions.start - lo * PAD_BLOCK:positions.stop - lo * PAD_BLOCK]
        return rows[torch.tensor(positions, dtype=torch.int64) - lo * PAD_BLOCK]

    def masked_table(self, sums: torch.Tensor, positions: list[int] | range) -> torch.Tensor:
        """:meth:`masked` of many digests at once, as numbers: ``sums`` (n, >= lanes) int64 lane
        residues (a kernel's output rows) plus the pads of header ``positions``, mod the primes
        (:func:`digest_texts` writes them as a header's texts, :func:`parse_texts` reads those)."""
        return (sums[:, :_LANES] + self.pads(positions)) % self.p

    def masked(self, digest: "Digest", i: int) -> str:
        """``(digest + self.pad(i)).hex()``: what the ``i``-th digest of a header says, in one step
        (a seed's header carries one per tensor: ~19k at 30B-A3B)."""
        return _HEX % tuple([(x + m) % p for x, m, p in zip(digest, self._pad(i), PRIMES)])

    def on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(p, t1, t2, t3)`` on ``device`` as (lanes, 1) int64 and int32 / int64 / int64 tables
        (copied once per device)."""
        got = self._on.get(device)
        if got is None:  # made from lists: a factory call, which fake tensor modes (tests) intercept too
            got = (torch.tensor(self.p.tolist(), dtype=torch.int64, device=device).view(-1, 1),
                   *(torch.tensor(t.tolist(), dtype=dt, device=device)
                     for t, dt in ((self.t1, torch.int32), (self.t2, torch.int64), (self.t3, torch.int64))))
            if type(got[0]) is torch.Tensor:  # a fake tensor is not kept for real ones to find
                self._on[device] = got
        return got

    def int8_columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``t1`` as the int8 right-hand side of :func:`_dots_int8`, (KEY_ROW, 2 * lanes) in column
        order (the layout cuBLAS's int8 product takes): ``t1 >> 6`` per lane, then ``t1 & 63``;
        and each lane's ``sum(t1)``, (lanes,) int64."""
        got = self._int8.get(device)
        if got is None:
            t1 = self.t1.tolist()  # from lists, as :meth:`on`
            cols = [[v >> 6 for v in lane] for lane in t1] + [[v & 63 for v in lane] for lane in t1]
            got = (torch.tensor(cols, dtype=torch.int8, device=device).t(),  # (KEY_ROW, 2 * lanes)
                   torch.tensor([sum(lane) for lane in t1], dtype=torch.int64, device=device))
            if type(got[0]) is torch.Tensor:
                self._int8[device] = got
        return got


#: the key of digests compared without a shared secret (verify, drift): accidental change only
PUBLIC = DigestKey(b"delta-sync/public")


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
        lanes = lanes or (0,) * _LANES
        return super().__new__(cls, tuple(int(x) % p for x, p in zip(lanes, PRIMES)))

    @classmethod
    def of_residues(cls, lanes) -> "Digest":
        """The digest of lane values reduced already (a kernel's output): no modulo again."""
        return tuple.__new__(cls, lanes)

    def __add__(self, other):  # type: ignore[override]
        return Digest(*(x + y for x, y in zip(self, other)))

    def __sub__(self, other):
        return Digest(*(x - y for x, y in zip(self, other)))

    def hex(self) -> str:
        return "".join(f"{x:04x}" for x in self)

    @classmethod
    def parse(cls, text: str) -> "Digest":
        return cls(*(int(text[i:i + 4], 16) for i in range(0, 4 * _LANES, 4)))


def _check_span(word0: int, n: int) -> None:
    if word0 < 0 or word0 + n > MAX_WORDS:
        raise ValueError(f"digest of words [{word0}, {word0 + n}): positions reach {MAX_WORDS} words at most")


def _native_range(words: torch.Tensor, word0: int, lanes: int, exp_mask: int, stride: int, key: DigestKey,
                  dst: torch.Tensor | None = None) -> tuple[list[int], int]:
    out = torch.zeros(_LANES, dtype=torch.int64)
    bad = native.kernel().digest_words(words.data_ptr(), words.numel(), word0, lanes, key.p.data_ptr(),
                                       key.t1.data_ptr(), key.t2.data_ptr(), key.t3.data_ptr(), T3,
                                       out.data_ptr(),
                                       ctypes.c_int16(exp_mask - 65536 if exp_mask > 32767 else exp_mask),
                                       stride, stride - 1, None if dst is None else dst.data_ptr())
    return out.tolist()[:lanes], int(bad)


def _scan_words(words: torch.Tensor, word0: int, lanes: int, exp_mask: int, stride: int, key: DigestKey,
                dst: torch.Tensor | None = None, threads: int | None = None) -> tuple[list[int], int]:
    """Lane sums under ``key`` and non-finite count of int16 ``words`` at word positions ``word0,
    ...``; with ``dst`` (int16, as many words, same device) the words are copied there in the same
    pass. Host words are split over up to ``threads`` threads (None: torch's count)."""
    _check_span(word0, words.numel())
    if _native_ok(words, dst):
        n = words.numel()
        threads = max(1, min(threads or torch.get_num_threads(), n // _MIN_WORDS_PER_THREAD))
        if threads == 1:
            return _native_range(words, word0, lanes, exp_mask, stride, key, dst)
        step = -(-n // threads)
        step += (-step) % max(stride, 1)  # every part starts on an element boundary
        parts, error = native.run_spread([
            functools.partial(_native_range, words[s:s + step], word0 + s, lanes, exp_mask, stride, key,
                              None if dst is None else dst[s:s + step]) for s in range(0, n, step)])
        if error is not None:
            raise error
        return [sum(x[0][lane] for x in parts) % PRIMES[lane] for lane in range(lanes)], sum(x[1] for x in parts)
    if dst is not None:
        dst.copy_(words)
    sums = lane_sums(words, word0, lanes, exp_mask, stride, key)
    values = sums.tolist()  # the one host sync of a device digest
    return values[:lanes], values[_LANES]


def _native_ok(words: torch.Tensor, dst: torch.Tensor | None) -> bool:
    return native.supports_words(words) and (dst is None or (dst.is_cpu and dst.is_contiguous()))


def _row_weights(key: DigestKey, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p, weight)``: (lanes, 1) primes and the (lanes, len(rows)) weight of each row index."""
    p, _, t2, t3 = key.on(rows.device)
    return p, (t2.index_select(1, rows % KEY_ROW) * t3.index_select(1, rows // KEY_ROW)) % p


def lane_sums(words: torch.Tensor, word0: int, lanes: int = _LANES, exp_mask: int = 0,
              stride: int = 1, key: DigestKey | None = None) -> torch.Tensor:
    """int64 ``[lane residues (all four)..., non-finite count]`` of int16 ``words`` under ``key``
    (None: :data:`PUBLIC`) on their own device; ``lanes=0``: the count alone, zero residues.

    Torch ops only, no host round trip: what device tensors run (and what the fake-device tests
    check for host/device mixing). The words are laid out in whole rows of :data:`KEY_ROW` (the
    first and last zero-padded where the range does not start or end on a row), a chunk of
    :data:`DEVICE_CHUNK_WORDS` at a time, and folded by :func:`_fold_rows`."""
    key = key or PUBLIC
    dev = words.device
    total = words.numel()
    _check_span(word0, total)
    acc = torch.zeros(_LANES, 1, dtype=torch.int64, device=dev)
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    for e in range(0, total, DEVICE_CHUNK_WORDS):
        n = min(DEVICE_CHUNK_WORDS, total - e)
        part = words.narrow(0, e, n)  # narrow, not [a:b]: indexing syncs with the device
        if lanes:
            lead = (word0 + e) % KEY_ROW
            rows = -(-(lead + n) // KEY_ROW)
            x = part
            if lead or (lead + n) % KEY_ROW:
                x = torch.cat([x.new_zeros(lead), x, x.new_zeros(rows * KEY_ROW - lead - n)])
            first = (word0 + e) // KEY_ROW
            acc = acc + _fold_rows(key, x.view(rows, KEY_ROW),
                                   torch.arange(first, first + rows, dtype=torch.int64, device=dev))
        if exp_mask:
            high = part if stride == 1 else part.view(-1, stride).select(1, stride - 1)
            bad = bad + ((high & exp_mask) == exp_mask).sum()
    p = key.on(dev)[0]
    return torch.cat([(acc % p).squeeze(1), bad.view(1)])


def _fold_rows(key: DigestKey, x: torch.Tensor, rows: torch.Tensor, owner: torch.Tensor | None = None,
               items: int = 1) -> torch.Tensor:
    """Lane residues, (lanes, items) int64, of int16 rows ``x`` (n, KEY_ROW) whose row indices
    (position // KEY_ROW) are ``rows`` (int64, per row) and which belong to item ``owner`` (per
    row; None: all to one). Per lane, the row's dot product with ``t1`` (:func:`_row_dots`),
    reduced, times the row's weight (below ``2**30``), summed."""
    dots = _row_dots(key, x)
    p, weight = _row_weights(key, rows)
    terms = (dots % p) * weight  # (lanes, rows)
    if owner is None:
        return terms.sum(dim=1, keepdim=True) % p
    return torch.zeros(_LANES, items, dtype=torch.int64, device=x.device).index_add_(1, owner, terms) % p


#: device types whose torch lacks an int8 matrix product (``torch._int_mm``): they take
#: :func:`_dots_by_lane` (found at the first call; vLLM-Ascend's torch-npu, for one)
_NO_INT_MM: set[str] = set()


def _row_dots(key: DigestKey, x: torch.Tensor) -> torch.Tensor:
    """(lanes, n) int64 dot products of int16 rows ``x`` (n, KEY_ROW) with each lane's ``t1``,
    exact. One int8 matrix product where the device has one (:func:`_dots_int8`), else a multiply
    and a sum per lane."""
    if x.device.type not in _NO_INT_MM:
        try:
            return _dots_int8(key, x)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, NotImplementedError):  # no int8 kernel on this device type
            _NO_INT_MM.add(x.device.type)
    return _dots_by_lane(key, x)


def _dots_by_lane(key: DigestKey, x: torch.Tensor) -> torch.Tensor:
    """:func:`_row_dots` as int32 products (below ``2**27``) summed in int64, one lane at a time:
    ~3 passes over an int32 copy of the words per lane."""
    t1 = key.on(x.device)[1]
    x = x.to(torch.int32)
    return torch.stack([(x * row).sum(dim=1, dtype=torch.int64) for row in t1.unbind(0)])


def _dots_int8(key: DigestKey, x: torch.Tensor) -> torch.Tensor:
    """:func:`_row_dots` as one int8 x int8 -> int32 matrix product (memory-bound on a GPU: a
    word is read as two bytes, once for all lanes). A word ``s = 256 h + l`` (``h = s >> 8``
    signed, ``l = s & 255``) and a table entry ``t = 64 a + b`` (``t < 2**12``) split into int8
    pieces; ``l - 128`` keeps the low byte signed, and ``128 * sum(t)`` puts it back:

        s . t = 256 (64 h.a + h.b) + 64 l'.a + l'.b + 128 sum(t),   l' = l - 128

    Each piece's dot is below ``128 * 63 * KEY_ROW < 2**23``: exact in the product's int32."""
    n = x.shape[0]
    cols, t1_sums = key.int8_columns(x.device)
    pieces = torch.cat([(x >> 8).to(torch.int8), ((x & 0xFF) - 128).to(torch.int8)])
    if pieces.shape[0] <= 16:  # CUDA's int8 product wants more than 16 rows: zero rows add nothing
        pieces = torch.cat([pieces, pieces.new_zeros(17 - pieces.shape[0], KEY_ROW)])
    d = torch._int_mm(pieces, cols).to(torch.int64)  # (rows, 2 * lanes): the a and the b columns
    hi, lo = d.narrow(0, 0, n), d.narrow(0, n, n)
    a, b = slice(0, _LANES), slice(_LANES, 2 * _LANES)
    return (256 * (64 * hi[:, a] + hi[:, b]) + 64 * lo[:, a] + lo[:, b] + 128 * t1_sums).t()


#: ranges of at most this many words are digested together on a device (:func:`_lane_sums_many`):
#: 8 MB, so a MoE's expert matrices (Qwen3-30B-A3B: 3 MB each, 18k of them) share launches
#: instead of paying a launch and a sync each.
DEVICE_SMALL_WORDS = 1 << 22


def _lane_sums_many(parts: list[tuple[torch.Tensor, int]], exp_mask: int, stride: int, key: DigestKey
                    ) -> torch.Tensor:
    """:func:`lane_sums` of many small ``(words, word0)`` ranges on one device, (ranges, lanes+1):
    each range is copied into whole rows of :data:`KEY_ROW` words of one buffer, at its offset in
    its first row, and the buffer is folded at once. A few launches per range (its copy) and ~20
    per batch, instead of ~20 per range; the rows' indices and owners cross from the host in one
    copy."""
    dev = parts[0][0].device
    spans = [(word0 % KEY_ROW, -(-(word0 % KEY_ROW + w.numel()) // KEY_ROW)) for w, word0 in parts]
    zeros = torch.zeros(KEY_ROW, dtype=torch.int16, device=dev)  # the padding, as views of one row
    pieces = []
    for (w, word0), (lead, r) in zip(parts, spans):
        _check_span(word0, w.numel())
        tail = r * KEY_ROW - lead - w.numel()
        pieces += [zeros.narrow(0, 0, lead), w, zeros.narrow(0, 0, tail)] if lead or tail else [w]
    buf = torch.cat(pieces)  # one copy of every range into whole rows (a launch or a few, not one per range)
    # per row, host: its row index (position // KEY_ROW) and the range it belongs to
    r = torch.tensor([r for _, r in spans], dtype=torch.int64)
    total = int(r.sum())
    first = torch.tensor([word0 // KEY_ROW for _, word0 in parts], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(len(parts)), r, output_size=total)
    rows = (first - (torch.cumsum(r, 0) - r)).index_select(0, owner) + torch.arange(total)
    rows, owner = torch.stack([rows, owner]).to(dev).unbind(0)
    words = buf.view(total, KEY_ROW)
    sums = _fold_rows(key, words, rows, owner, len(parts))
    bad = torch.zeros(len(parts), dtype=torch.int64, device=dev)
    if exp_mask:  # padding words are zero: never counted
        high = words if stride == 1 else _phase_mask(words, parts, spans, stride)
        bad.index_add_(0, owner, ((high & exp_mask) == exp_mask).sum(dim=1))
    return torch.cat([sums.t(), bad.unsqueeze(1)], dim=1)


def _phase_mask(words: torch.Tensor, parts: list[tuple[torch.Tensor, int]], spans: list[tuple[int, int]],
                stride: int) -> torch.Tensor:
    """``words`` with every word that is not an element's last (high) word zeroed: each range's
    elements start on its own first word, wherever its first row puts it."""
    keep = torch.zeros(words.numel(), dtype=torch.bool)
    at = 0
    for (w, _), (lead, r) in zip(parts, spans):
        keep[at * KEY_ROW + lead + stride - 1:at * KEY_ROW + lead + w.numel():stride] = True
        at += r
    return words * keep.view(words.shape).to(words.device)


def scan_range(values: torch.Tensor, start: int = 0, copy_to: torch.Tensor | None = None,
               threads: int | None = None, lanes: bool = True, key: DigestKey | None = None
               ) -> tuple[Digest, int]:
    """Digest under ``key`` (None: :data:`PUBLIC`) of ``values`` standing at flat indices ``start,
    ...`` and its count of Inf/NaN elements.

    One pass over the bytes: what a receiver (and the packing sender) runs on every bulk value.
    With ``copy_to`` (a contiguous tensor of as many elements and the same element size) the
    values are also copied there in that pass: the packer fills a bucket this way. Host values
    are split over up to ``threads`` threads (None: torch's count). ``lanes=False``: the Inf/NaN
    count alone (an all-zero digest), the validation a sender runs on every range before it
    leaves, digest or not: what the digest's own cost is measured against."""
    w = _words_per_element(values)
    sums, bad = _scan_words(_words(values), start * w, _LANES if lanes else 0, _EXP_MASK.get(values.dtype, 0),
                            w, key or PUBLIC, _copy_target(values, copy_to), threads)
    return Digest(*sums), bad


def _copy_target(values: torch.Tensor, copy_to: torch.Tensor | None) -> torch.Tensor | None:
    """``copy_to`` as int16 words, checked against ``values``."""
    if copy_to is None:
        return None
    if copy_to.numel() != values.numel() or copy_to.element_size() != values.element_size():
        raise ValueError(f"copy_to holds {copy_to.numel()} x {copy_to.element_size()} B, values "
                         f"{values.numel()} x {values.element_size()} B")
    return copy_to.reshape(-1).view(torch.int16)


def scan_many(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], lanes: bool = True,
              key: DigestKey | None = None, reads: ReadBack | None = None) -> list[tuple[Digest, int]]:
    """:func:`scan_range` of many ``(values, start, copy_to)`` ranges under one ``key``, in order
    (``lanes``: as there). With ``reads``, device ranges' results are read back with its others:
    their places in the list returned are filled at ``reads.run()``.

    Host ranges are spread over the threads by whole ranges, each scanned on one thread, instead of
    each range being split over all of them: a model's hundreds of few-MB tensors would otherwise
    pay a thread handoff per range and thread. A range larger than a thread's share still splits
    by words, on its own. Device ranges are digested without a host round trip each
    (:func:`_scan_device`): one for all. Every range is done before an error is raised."""
    key = key or PUBLIC
    threads = max(1, torch.get_num_threads())
    sizes = [v.numel() * v.element_size() for v, _, _ in items]
    host = [_native_ok(v, dst) for v, _, dst in items]
    share = sum(n for n, ok in zip(sizes, host) if ok) // threads
    pooled = [i for i, ok in enumerate(host) if ok and sizes[i] <= share]  # (one thread: every host range)
    alone = sorted(set(i for i, ok in enumerate(host) if ok) - set(pooled))
    out: list[tuple[Digest, int] | None] = [None] * len(items)

    def run(indices: list[int], threads_each: int | None) -> None:
        for i in indices:
            out[i] = scan_range(*items[i], threads=threads_each, lanes=lanes, key=key)

    def run_group(indices: list[int]) -> None:  # one kernel call for the whole group
        for i, got in zip(indices, _native_many([items[i] for i in indices], lanes, key)):
            out[i] = got

    groups = [pooled[lo:hi] for lo, hi in native.contiguous_groups([sizes[i] for i in pooled], threads)]
    _, error = native.run_spread([functools.partial(run_group, g) for g in groups])  # every range finishes first
    try:
        run(alone, None)
        if not lanes:  # device ranges are digested anyway: their digests are dropped alike
            out[:] = [None if o is None else (Digest(), o[1]) for o in out]
        _scan_device(items, [i for i, ok in enumerate(host) if not ok], out, key, lanes, reads)
    except BaseException as e:  # noqa: BLE001 - every range finishes first; the first error is raised below
        error = error or e
    if error is not None:
        raise error
    return out  # type: ignore[return-value]


#: int64 per range of :func:`_native_many`'s table (``DIGEST_ITEM`` of the kernel)
_ITEM = 6


def _native_many(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], lanes: bool, key: DigestKey
                 ) -> list[tuple[Digest, int]]:
    """:func:`scan_range` of host ranges ``(values, start, copy_to)`` on one thread, in one call of
    the kernel: a range costs a row of its table, not a foreign call, a scratch tensor and a
    round of argument checks (a 30B-A3B seed has ~19k ranges of a few KB). A bad range raises
    once the others are done."""
    kept, rows, error = [], [], None
    for k, (values, start, copy_to) in enumerate(items):
        try:
            if values.is_contiguous() and values.element_size() > 1 and (
                    copy_to is None or (copy_to.is_contiguous() and copy_to.numel() == values.numel()
                                        and copy_to.element_size() == values.element_size())):
                words, dst = values, copy_to  # their bytes as they are: no view per range
            else:
                words, dst = _words(values), _copy_target(values, copy_to)
            row = range_row(words.data_ptr(), values.numel(), start, row_spec(values.dtype),
                            0 if dst is None else dst.data_ptr())
        except (TypeError, ValueError) as e:
            error = error or e
            continue
        kept.append((words, dst))  # alive until the call returns
        rows.append(row)
    out = _digest_rows(rows, lanes, key)
    if error is not None:
        raise error
    return out


def _digest_rows(rows: list[tuple[int, ...]], lanes: bool, key: DigestKey) -> list[tuple[Digest, int]]:
    """One call of the kernel over ``rows`` (:data:`_ITEM` integers each), on this thread."""
    return _as_digests(_digest_table(rows, lanes, key))


def _digest_table(rows: list[tuple[int, ...]] | torch.Tensor, lanes: bool, key: DigestKey) -> torch.Tensor:
    """:func:`_digest_rows` as the kernel writes it: (n, lanes + 1) int64, lane residues and the
    Inf/NaN count per row (``rows`` also as an (n, 6) int64 tensor)."""
    out = torch.empty(len(rows), _LANES + 1, dtype=torch.int64)
    if len(rows):
        table = rows.contiguous() if isinstance(rows, torch.Tensor) else torch.tensor(rows, dtype=torch.int64)
        native.kernel().digest_many(len(rows), table.data_ptr(), _LANES if lanes else 0, key.p.data_ptr(),
                                    key.t1.data_ptr(), key.t2.data_ptr(), key.t3.data_ptr(), T3, out.data_ptr())
    return out


def _as_digests(table: torch.Tensor) -> list[tuple[Digest, int]]:
    return [(Digest.of_residues(r[:_LANES]), r[_LANES]) for r in table.tolist()]


def digest_texts(masked: torch.Tensor) -> list[str]:
    """The header texts (:meth:`Digest.hex`) of (n, lanes) residues, e.g. :meth:`DigestKey.masked_table`'s."""
    raw = bytes(torch.stack([masked >> 8, masked & 255], -1).reshape(-1).tolist()).hex()
    width = 4 * _LANES
    return [raw[i:i + width] for i in range(0, len(raw), width)]


def parse_texts(texts: list) -> torch.Tensor | None:
    """What header digest texts say, (n, lanes) int64; None where one is not a digest's text (the
    caller then names the entry, checking one by one)."""
    try:
        if texts and set(map(len, texts)) != {4 * _LANES}:
            return None
        joined = "".join(texts)
        if joined != joined.lower():  # (what Digest.hex writes: a text compare would refuse the rest)
            return None
        raw = bytes.fromhex(joined)
    except (TypeError, ValueError):
        return None
    if len(raw) != 2 * _LANES * len(texts):  # (fromhex skips whitespace)
        return None
    pairs = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64).view(-1, _LANES, 2) \
        if raw else torch.empty(0, _LANES, 2, dtype=torch.int64)
    return pairs[..., 0] * 256 + pairs[..., 1]


@functools.cache
def row_spec(dtype: torch.dtype) -> tuple[int, int, int]:
    """``(element size, 16-bit words per element, signed exponent mask)`` of ``dtype`` in a row of
    :func:`range_row` (worked out once per dtype, kept)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if size == 1:
        raise TypeError(f"digest of 1-byte dtype {dtype} is not defined")
    mask = _EXP_MASK.get(dtype, 0)
    return size, max(1, size // 2), mask - 65536 if mask > 32767 else mask


def rows_supported() -> bool:
    """Can host ranges go to :func:`scan_rows_table` (the host kernel is built and on)? Where not,
    callers take :func:`scan_many` with tensors (its torch-op path)."""
    return native.kernel() is not None


def range_row(src: int, count: int, start: int, spec: tuple[int, int, int], dst: int = 0) -> tuple[int, ...]:
    """The kernel's row for ``count`` elements (of :func:`row_spec` ``spec``) at host address ``src``,
    checkpoint elements ``[start, start + count)``, copied to host address ``dst`` in the same pass
    where not 0: for a caller that has the addresses already (a seed written through loader views:
    no tensor view per range and segment). The caller keeps both memories alive, holding the
    bytes, until :func:`scan_rows` returns."""
    size, w, mask = spec
    _check_span(start * w, count * size // 2)
    return src, count * size // 2, start * w, dst, mask, w


def scan_rows(rows: list[tuple[int, ...]], key: DigestKey | None = None, lanes: bool = True
              ) -> list[tuple[Digest, int]]:
    """:func:`scan_many` of :func:`range_row` rows (:func:`scan_rows_table`, as digests)."""
    return _as_digests(scan_rows_table(rows, key, lanes))


def scan_rows_table(rows: list[tuple[int, ...]] | torch.Tensor, key: DigestKey | None = None, lanes: bool = True
                    ) -> torch.Tensor:
    """:func:`scan_many` of :func:`range_row` rows, as one (n, lanes + 1) int64 table of lane
    residues and Inf/NaN counts: shared out between the threads in order, by words, each share one
    call of the kernel; a row larger than a thread's share (and than ``_MIN_WORDS_PER_THREAD``
    twice) is cut at element boundaries first and its pieces' digests added up. ``rows`` may be an
    (n, 6) int64 tensor of them (rows made as columns: no Python list of them at all)."""
    key = key or PUBLIC
    threads = max(1, torch.get_num_threads())
    if isinstance(rows, torch.Tensor):
        words = rows[:, 1].numpy().tolist() if rows.numel() else []
        if threads > 1 and words and max(words) > max(sum(words) // threads, 2 * _MIN_WORDS_PER_THREAD - 1):
            return scan_rows_table(rows.numpy().tolist(), key, lanes)  # rows to cut: as a list
        groups = native.contiguous_groups(words, threads)
        got, error = native.run_spread([functools.partial(_digest_table, rows[lo:hi], lanes, key) for lo, hi in groups])
        if error is not None:
            raise error
        return got[0] if len(got) == 1 else torch.cat(got) if got else torch.empty(0, _LANES + 1, dtype=torch.int64)
    share = sum(r[1] for r in rows) // threads
    pieces, owner = rows, None
    if threads > 1 and rows and max(r[1] for r in rows) > max(share, 2 * _MIN_WORDS_PER_THREAD - 1):
        pieces, owner = [], []
        for k, (src, n, word0, dst, mask, w) in enumerate(rows):
            if n <= share or n < 2 * _MIN_WORDS_PER_THREAD:
                pieces.append((src, n, word0, dst, mask, w))
                owner.append(k)
                continue
            step = -(-n // threads)
            step += (-step) % w  # every piece starts on an element boundary
            for at in range(0, n, step):
                pieces.append((src + 2 * at, min(step, n - at), word0 + at, dst + 2 * at if dst else 0, mask, w))
                owner.append(k)
    groups = native.contiguous_groups([r[1] for r in pieces], threads)
    got, error = native.run_spread([functools.partial(_digest_table, pieces[lo:hi], lanes, key) for lo, hi in groups])
    if error is not None:
        raise error
    table = got[0] if len(got) == 1 else torch.cat(got) if got else torch.empty(0, _LANES + 1, dtype=torch.int64)
    return table if owner is None else sum_rows(table, owner, len(rows), key)


def sum_rows(table: torch.Tensor, owner: list[int], n: int, key: DigestKey | None = None) -> torch.Tensor:
    """Rows of a :func:`scan_rows_table` added up into ``n`` (row ``k`` into ``owner[k]``): the
    digests of disjoint parts add up to their whole's, mod the primes, and so do the Inf/NaN counts.
    An owner of no row gets the empty digest."""
    out = torch.zeros(n, _LANES + 1, dtype=torch.int64).index_add_(0, torch.tensor(owner, dtype=torch.int64), table)
    out[:, :_LANES] %= (key or PUBLIC).p
    return out


def _scan_device(items: list[tuple[torch.Tensor, int, torch.Tensor | None]], indices: list[int],
                 out: list, key: DigestKey, lanes: bool = True, reads: ReadBack | None = None) -> None:
    """:func:`scan_range` of the torch-path ranges ``items[i]``, ``i`` in ``indices``, into ``out[i]``
    (with ``reads``: when it runs).

    On a device each ``scan_range`` ends in a host round trip (~20 launches and a sync per range:
    a model's hundreds of tensors would pay it hundreds of times). Here ranges of up to
    :data:`DEVICE_SMALL_WORDS` words are folded together (:func:`_lane_sums_many`), larger ones
    one by one, and every result crosses to the host in one copy per device."""
    sums: dict[int, torch.Tensor] = {}
    small: dict[tuple, list[tuple[int, torch.Tensor, int]]] = {}
    copies: tuple[list, list] = ([], [])  # made together: one multi-tensor copy, not a launch per range
    for i in indices:
        values, start, copy_to = items[i]
        w, mask = _words_per_element(values), _EXP_MASK.get(values.dtype, 0)
        words, dst = _words(values), _copy_target(values, copy_to)
        if dst is not None:
            copies[0].append(dst)
            copies[1].append(words)
        if words.numel() <= DEVICE_SMALL_WORDS:
            small.setdefault((words.device, mask, w), []).append((i, words, start * w))
        else:
            sums[i] = lane_sums(words, start * w, _LANES, mask, w, key)
    if copies[0]:
        torch._foreach_copy_(*copies)
    for (_, mask, w), members in small.items():
        for lo, hi in native.capped_groups([m[1].numel() for m in members], DEVICE_CHUNK_WORDS):
            part = members[lo:hi]
            rows = _lane_sums_many([(words, word0) for _, words, word0 in part], mask, w, key)
            sums.update((i, row) for (i, _, _), row in zip(part, rows.unbind(0)))

    def fill(rows: list[list]) -> None:
        for i, row in zip(sums, rows):
            out[i] = (Digest(*row[:_LANES]) if lanes else Digest(), row[_LANES])

    if reads is not None:
        reads.later(list(sums.values()), fill)
    elif sums:
        fill(read_back(list(sums.values())))  # the one sync per device


def nonfinite_on_device(values: torch.Tensor) -> torch.Tensor:
    """:func:`nonfinite_count` of device ``values`` as a one-element int64 tensor on their device
    (torch ops, no read: for a :class:`ReadBack`)."""
    return lane_sums(_words(values), 0, 0, _EXP_MASK.get(values.dtype, 0), _words_per_element(values)
                     ).narrow(0, _LANES, 1)


def nonfinite_count(values: torch.Tensor) -> int:
    """How many elements of ``values`` are Inf or NaN: the exponent test of :func:`scan_range`
    without its lanes (on host memory one read, no temporaries, unlike ``torch.isfinite``)."""
    _, bad = _scan_words(_words(values), 0, 0, _EXP_MASK.get(values.dtype, 0), _words_per_element(values), PUBLIC)
    return bad


def digest_range(values: torch.Tensor, start: int = 0, key: DigestKey | None = None) -> Digest:
    """Digest of ``values`` (any shape, flattened) standing at flat indices ``start, start+1, ...``."""
    w = _words_per_element(values)
    lanes, _ = _scan_words(_words(values), start * w, _LANES, 0, w, key or PUBLIC)
    return Digest(*lanes)


def digest_elements(indices: torch.Tensor, values: torch.Tensor, key: DigestKey | None = None) -> Digest:
    """Digest of the elements ``values[k]`` standing at flat index ``indices[k]``."""
    return Digest(*element_sums(indices, values, key).tolist())


def element_sums(indices: torch.Tensor, values: torch.Tensor, key: DigestKey | None = None) -> torch.Tensor:
    """int64 lane residues of :func:`digest_elements`, on the values' device (no host round trip):
    each word's weight gathered from the key's tables at its position."""
    key = key or PUBLIC
    flat = values.reshape(-1)
    w = _words_per_element(flat)
    idx = indices.reshape(-1)
    if idx.device != flat.device:  # one device per computation: a mix is a caller's bug, named here
        raise ValueError(f"digest of elements: indices on device {idx.device}, values on device {flat.device}")
    p, t1, _, _ = key.on(flat.device)
    acc = torch.zeros(_LANES, dtype=torch.int64, device=flat.device)
    for e in range(0, flat.numel(), CHUNK // w):  # CHUNK words at a time: bounded temporaries
        n = min(CHUNK // w, flat.numel() - e)
        part = _words(flat.narrow(0, e, n)).to(torch.int64)
        pos = idx.narrow(0, e, n).to(torch.int64)
        if w > 1:
            pos = (pos.unsqueeze(1) * w + torch.arange(w, device=pos.device)).reshape(-1)
        _, rows = _row_weights(key, pos // KEY_ROW)
        weight = (t1.index_select(1, pos % KEY_ROW).to(torch.int64) * rows) % p
        acc = (acc + (part.unsqueeze(0) * weight).sum(dim=1)) % p.squeeze(1)
    return acc


def digest_tensor(t: torch.Tensor, key: DigestKey | None = None) -> Digest:
    return digest_range(t, 0, key)


def checksum_later(*parts: torch.Tensor, key: DigestKey | None = None, reads: ReadBack | None = None
                   ) -> Callable[[], str]:
    """Checksum under ``key`` of byte buffers (a bucket's index and value payloads), in order, on
    their device: per buffer, its byte count and its digest as 16-bit words (a zero byte pads an
    odd length), masked with the key's pad for its place (nothing about the tables shows). Returns
    what makes its text: call it once ``reads`` ran (its device sums are read with ``reads``'
    others; without ``reads``, at once).
    """
    key = key or PUBLIC
    words, sizes = [], []
    for buf in parts:
        flat = buf.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n % 2 or (flat.storage_offset() % 2):
            padded = torch.zeros(n + n % 2, dtype=torch.uint8, device=flat.device)
            padded[:n] = flat
            flat = padded
        words.append((flat.view(torch.int16), 0, None))
        sizes.append(n)
    # every buffer in one scan: on a device one fold and one host read for all, not one per buffer
    sums = scan_many(words, key=key, reads=reads)
    return lambda: "/".join(f"{n:x}.{(d + key.pad(CHECKSUM_PADS + i)).hex()}"
                            for i, (n, (d, _)) in enumerate(zip(sizes, sums)))


#: pads of a checksum's buffers are drawn from this index on (entries' digests take the ones below)
CHECKSUM_PADS = 1 << 40


def tensor_texts(tensors: list[torch.Tensor], key: DigestKey | None = None) -> list[str]:
    """:meth:`Digest.hex` of each whole tensor under ``key`` (None: :data:`PUBLIC`), in order,
    written together (a verify digests every one of a 30B-A3B's ~19k tensors: no digest object
    per tensor)."""
    return digest_texts(_tensor_table(tensors, key))


def tensor_digests(tensors: list[torch.Tensor], key: DigestKey | None = None) -> list[Digest]:
    """:func:`tensor_texts`, as digests."""
    return [Digest.of_residues(r) for r in _tensor_table(tensors, key).tolist()]


def span_digests(buf: torch.Tensor, offsets: list[int], numels: list[int], key: DigestKey | None = None
                 ) -> list[Digest] | None:
    """:func:`tensor_digests` of whole tensors lying at element ``offsets[k]`` (``numels[k]``
    elements each) of the contiguous host buffer ``buf``: rows of one kernel scan made as columns,
    no view or row per tensor in Python (a sweep window names hundreds of a 30B-A3B's tensors, a
    verify all ~19k). None where the host kernel is off or ``buf`` is not such a buffer."""
    if not offsets or not rows_supported() or not buf.is_cpu or not buf.is_contiguous() or buf.element_size() == 1:
        return None
    size, w, mask = row_spec(buf.dtype)
    n = torch.tensor(numels, dtype=torch.int64)
    if int(n.max()) * size // 2 > MAX_WORDS:  # (the general path names it)
        return None
    rows = torch.zeros(len(offsets), 6, dtype=torch.int64)
    rows[:, 0] = torch.tensor(offsets, dtype=torch.int64) * size + buf.data_ptr()  # source address
    rows[:, 1] = n * size // 2  # 16-bit words, from word 0 of the tensor, nothing copied
    rows[:, 4], rows[:, 5] = mask, w
    return [Digest.of_residues(r) for r in scan_rows_table(rows, key)[:, :_LANES].tolist()]


def _tensor_table(tensors: list[torch.Tensor], key: DigestKey | None) -> torch.Tensor:
    """(n, lanes) residues of each whole tensor: contiguous host tensors as rows of one kernel scan,
    any other through :func:`scan_many`."""
    table = torch.zeros(len(tensors), _LANES, dtype=torch.int64)
    rows, at, rest = [], [], []
    as_rows = rows_supported()
    for k, t in enumerate(tensors):
        if as_rows and t.is_cpu and t.is_contiguous() and t.element_size() > 1:
            rows.append(range_row(t.data_ptr(), t.numel(), 0, row_spec(t.dtype)))
            at.append(k)
        else:
            rest.append(k)
    if rows:
        table[at] = scan_rows_table(rows, key)[:, :_LANES]
    if rest:
        table[rest] = torch.tensor([d for d, _ in scan_many([(tensors[k], 0, None) for k in rest], key=key)],
                                   dtype=torch.int64).view(-1, _LANES)
    return table


def add_texts(groups: list[list[str]], key: DigestKey | None = None) -> list[str]:
    """Per group, the text of the sum of the digests its texts say (the shares of one tensor add
    up to the whole's); a group of one text is kept as it is. Raises ValueError if a summed
    text is not a digest's."""
    out = [g[0] if len(g) == 1 else None for g in groups]
    multi = [k for k, g in enumerate(groups) if len(g) > 1]
    if multi:
        flat = [t for k in multi for t in groups[k]]
        table = parse_texts(flat)
        if table is None:
            raise ValueError(f"not a digest's text among {flat[:4]}...")
        owner = torch.tensor([i for i, k in enumerate(multi) for _ in groups[k]], dtype=torch.int64)
        sums = torch.zeros(len(multi), _LANES, dtype=torch.int64).index_add_(0, owner, table) % (key or PUBLIC).p
        for k, text in zip(multi, digest_texts(sums)):
            out[k] = text
    return out  # type: ignore[return-value]


def combine_reports(reports: list[dict]) -> dict[str, str]:
    """One digest per tensor from every engine worker's report: TP shards add up, replicas must agree."""
    if len(reports) == 1:  # one worker: it holds each tensor whole, or it is inconsistent
        return {name: h if count == numel else "inconsistent"
                for name, (h, count, numel) in (reports[0].get("digests") or {}).items()}
    per: dict[str, list] = {}
    for r in reports:
        for name, (h, count, numel) in (r.get("digests") or {}).items():
            per.setdefault(name, []).append((h, count, numel))
    out, shares = {}, []
    for name, parts in per.items():
        numel = parts[0][2]
        if sum(c for _, c, _ in parts) == numel:
            out[name] = None  # (summed below, together)
            shares.append(name)
        elif all(c == numel for _, c, _ in parts) and len({h for h, _, _ in parts}) == 1:
            out[name] = parts[0][0]
        else:
            out[name] = "inconsistent"
    out.update(zip(shares, add_texts([[h for h, _, _ in per[n]] for n in shares])))
    return out


def differs(engine: str, reports: list[dict], want: dict[str, str]) -> str | None:
    """What differs between an engine's workers' digest reports and the trainer's ``want``, or None."""
    got = combine_reports(reports)
    bad = [n for n in want if got.get(n) != want[n]]
    if not bad:
        return None
    what = "missing" if bad[0] not in got else "digest mismatch"
    return f"engine {engine}: {len(bad)} tensor(s) differ, first {bad[0]!r} ({what})"
