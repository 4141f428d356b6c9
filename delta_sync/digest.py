"""Position-weighted digest, additive over flat-index ranges.

For the 16-bit words ``k`` of a tensor (a bf16/fp16 element is one word, fp32 two) with bits
``b_k``, lane ``l`` of the digest is::

    D_l = sum_k (b_k + 1) * ((a_l * k + c_l) mod P_l)   mod P_l

in four lanes with distinct primes ``P_l < 2**15`` (about 60 bits together; by the CRT two
positions share every weight only if they are ~2**60 apart, so shifted rows, swapped elements
and wrong shard offsets change the digest). Because it is a sum over words, the digest of a
tensor is the sum of the digests of any partition of its flat indices: TP shards, buckets and
patches add up to the whole.

Every product is ``< 2**31`` and is summed in int64, so int32 multiply + int64 sum reproduce the
same bits on CPU, CUDA and NPU; no float64 and no overflow anywhere (HCCL rejects float64
all_reduce; ``torch.hash_tensor`` has no NPU kernel).
"""

from __future__ import annotations

import torch

#: (P, a, c) per lane.
_LANES = ((32749, 7919, 101), (32719, 20011, 7), (32717, 12347, 3571), (32713, 28657, 1597))
#: words digested per step: bounds temporaries to a few MiB whatever the tensor size.
CHUNK = 1 << 18
_tables: dict[torch.device, torch.Tensor] = {}


def _weight_table(device: torch.device) -> torch.Tensor:
    """int32 (lanes, CHUNK): (a*j + c) mod P; the weights of a range starting at s are these + a*s."""
    if device not in _tables:
        j = torch.arange(CHUNK, dtype=torch.int64)
        rows = [(j * a + c) % p for p, a, c in _LANES]
        _tables[device] = torch.stack(rows).to(torch.int32).to(device)
    return _tables[device]


def _terms(values: torch.Tensor) -> torch.Tensor:
    """``b_k + 1`` for the unsigned 16-bit words (bytes for 1-byte dtypes) of ``values``, int32."""
    flat = values.reshape(-1).contiguous()
    if flat.element_size() == 1:
        return flat.view(torch.uint8).to(torch.int32) + 1
    return (flat.view(torch.int16).to(torch.int32) & 0xFFFF) + 1


def _words_per_element(values: torch.Tensor) -> int:
    return max(1, values.element_size() // 2)


class Digest(tuple):
    """Residues of the four lanes; ``+`` combines digests of disjoint index sets."""

    def __new__(cls, *lanes: int):
        lanes = lanes or (0,) * len(_LANES)
        return super().__new__(cls, tuple(int(x) % p for x, (p, _, _) in zip(lanes, _LANES)))

    def __add__(self, other):  # type: ignore[override]
        return Digest(*(x + y for x, y in zip(self, other)))

    def hex(self) -> str:
        return "".join(f"{x:04x}" for x in self)

    @classmethod
    def parse(cls, text: str) -> "Digest":
        return cls(*(int(text[i:i + 4], 16) for i in range(0, 4 * len(_LANES), 4)))

    def as_tensor(self) -> torch.Tensor:
        """int64 lanes, for an all_reduce(SUM) across shards followed by ``Digest(*t.tolist())``."""
        return torch.tensor(list(self), dtype=torch.int64)


def digest_range(values: torch.Tensor, start: int = 0) -> Digest:
    """Digest of ``values`` (any shape, flattened) standing at flat indices ``start, start+1, ...``."""
    flat = values.reshape(-1)
    w = _words_per_element(flat)
    word0 = start * w
    table = _weight_table(flat.device)
    acc = [0] * len(_LANES)
    for e in range(0, flat.numel(), CHUNK // w):  # CHUNK words at a time: bounded temporaries
        part = _terms(flat[e:e + CHUNK // w])
        n = part.numel()
        total = int(part.sum(dtype=torch.int64))
        for lane, (p, a, _) in enumerate(_LANES):
            weighted = int((part * table[lane, :n]).sum(dtype=torch.int64))
            # sum_j t_j*((a*(p0+j)+c) mod P) == sum_j t_j*W_j + (a*p0 mod P)*sum_j t_j   (mod P)
            acc[lane] += weighted + (a * (word0 + e * w) % p) * total
    return Digest(*acc)


def digest_elements(indices: torch.Tensor, values: torch.Tensor) -> Digest:
    """Digest of the elements ``values[k]`` standing at flat index ``indices[k]``."""
    flat = values.reshape(-1)
    w = _words_per_element(flat)
    idx = indices.reshape(-1)
    acc = [0] * len(_LANES)
    for e in range(0, flat.numel(), CHUNK // w):  # CHUNK words at a time: bounded temporaries
        part = _terms(flat[e:e + CHUNK // w])
        pos = idx[e:e + CHUNK // w].to(torch.int64)
        if w > 1:
            pos = (pos.unsqueeze(1) * w + torch.arange(w, device=pos.device)).reshape(-1)
        for lane, (p, a, c) in enumerate(_LANES):
            weight = ((pos % p) * a + c) % p
            acc[lane] += int((part * weight.to(torch.int32)).sum(dtype=torch.int64))
    return Digest(*acc)


def digest_tensor(t: torch.Tensor) -> Digest:
    return digest_range(t, 0)


#: bucket checksum: one lane over 16-bit words, in chunks that are a multiple of its prime, so
#: one cached weight table serves every chunk of every buffer.
_CHECK_P = _LANES[0][0]
_CHECK_CHUNK = _CHECK_P * 128
_check_tables: dict[torch.device, torch.Tensor] = {}


def checksum_bytes(*parts: torch.Tensor) -> str:
    """Checksum of byte buffers (a bucket's index and value payloads), in order, on their device.

    Per buffer, over its 16-bit words ``w_k`` (a zero byte pads an odd length): the byte count,
    ``sum w_k`` and ``sum w_k * (k mod P + 1)``; int32 products below 2**31 summed in int64, as the
    digest, so every device computes the same bits. One lane where the digest has four: it
    guards a bucket in flight (a flipped, dropped or shifted word), at ~3x the digest's speed.
    """
    out = []
    for buf in parts:
        flat = buf.reshape(-1).view(torch.uint8)
        n = flat.numel()
        if n % 2 or (flat.storage_offset() % 2):
            padded = torch.zeros(n + n % 2, dtype=torch.uint8, device=flat.device)
            padded[:n] = flat
            flat = padded
        words = flat.view(torch.int16)
        table = _check_tables.get(words.device)
        if table is None:
            table = (torch.arange(_CHECK_CHUNK, device=words.device) % _CHECK_P + 1).to(torch.int32)
            _check_tables[words.device] = table
        s1 = s2 = 0
        for s in range(0, words.numel(), _CHECK_CHUNK):
            w = words[s:s + _CHECK_CHUNK].to(torch.int32)
            s1 += int(w.sum(dtype=torch.int64))
            s2 += int((w * table[:w.numel()]).sum(dtype=torch.int64))
        out.append(f"{n:x}.{s1 % (1 << 64):x}.{s2 % (1 << 64):x}")
    return "/".join(out)
