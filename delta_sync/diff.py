"""Bitwise diff of a tensor against its snapshot.

Changed means "bits differ": the comparison runs on integer views, never ``!=`` on floats
(NaN != NaN would mark every NaN changed; -0.0 == 0.0 would hide a sign flip).

The scan is memory-bound, so it is shaped to read each input once and write as little as possible:

1. compare 64-bit words (4 bf16 elements per compare) into a reused bool mask, chunk by chunk,
   so temporary memory is bounded by ``chunk_words`` whatever the tensor size;
2. find changed words hierarchically: the bool mask is viewed as int64 (8 flags per word) and
   only non-zero flag words are expanded; ``nonzero`` never runs over the full mask;
3. gather just the changed words, xor them and split the xor into element-width lanes; the new
   values come out of the gathered words, not from another pass over the tensor.

Indices come out strictly increasing, as the patch format requires.

For host tensors a compiled one-pass kernel (:mod:`delta_sync.native`) replaces steps 1-3 when a
C compiler is present; the torch-op path is the portable reference and the fallback.
"""

from __future__ import annotations

import torch

from . import native
from .patch import Patch, check_indexable

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: words compared per chunk: 8M words = 64 MiB of each input, 8 MiB of mask.
DEFAULT_CHUNK_WORDS = 1 << 23


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same bits, integer dtype of the same width, flattened."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


class BitwiseDiff:
    """Reusable scanner: holds its bounded scratch mask across calls."""

    def __init__(self, chunk_words: int = DEFAULT_CHUNK_WORDS, use_native: bool = True):
        if chunk_words <= 0 or chunk_words % 8:
            raise ValueError(f"chunk_words must be a positive multiple of 8, got {chunk_words}")
        self.chunk_words = chunk_words
        self.use_native = use_native
        self._mask: torch.Tensor | None = None

    def _scratch(self, n: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device or self._mask.numel() < n:
            self._mask = torch.empty(max(n, 8), dtype=torch.bool, device=device)
        return self._mask[:n]

    def diff(self, name: str, old: torch.Tensor, new: torch.Tensor) -> Patch:
        """The patch that turns ``old`` into ``new``: int32 indices + values of ``new``."""
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"diff of {name!r}: snapshot {tuple(old.shape)}/{old.dtype} vs "
                             f"new {tuple(new.shape)}/{new.dtype}")
        check_indexable(name, new.numel())
        idx, bits = self.changed(old, new)
        values = bits.view(new.dtype)
        return Patch(name, tuple(new.shape), new.dtype, idx, values)

    def changed(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int32 flat indices, integer bits of new at them)``; indices strictly increasing."""
        o = int_view(old.contiguous())
        n = int_view(new.contiguous())
        lanes = 8 // o.element_size()
        numel = o.numel()
        nwords = numel // lanes if (word_aligned(o) and word_aligned(n)) else 0
        idx_parts: list[torch.Tensor] = []
        val_parts: list[torch.Tensor] = []
        if nwords:
            o64 = o[: nwords * lanes].view(torch.int64)
            n64 = n[: nwords * lanes].view(torch.int64)
            if self.use_native and native.supports(o):
                idx_parts, val_parts = native.changed_words(o64, n64, lanes)
            else:
                for start in range(0, nwords, self.chunk_words):
                    stop = min(start + self.chunk_words, nwords)
                    self._scan_chunk(o64[start:stop], n64[start:stop], start, lanes, o.dtype,
                                     idx_parts, val_parts)
        tail = nwords * lanes
        if tail < numel:  # unaligned or ragged end: element-width compare
            hit = (o[tail:] != n[tail:]).nonzero().squeeze(1)
            idx_parts.append((hit + tail).to(torch.int32))
            val_parts.append(n[tail:].take(hit))
        if not idx_parts:
            return (torch.empty(0, dtype=torch.int32, device=o.device),
                    torch.empty(0, dtype=o.dtype, device=o.device))
        if len(idx_parts) == 1:
            return idx_parts[0], val_parts[0]
        return torch.cat(idx_parts), torch.cat(val_parts)

    def _scan_chunk(self, o64, n64, word0, lanes, lane_dtype, idx_parts, val_parts) -> None:
        mask = self._scratch(o64.numel(), o64.device)
        torch.ne(o64, n64, out=mask)
        # Level 1: 8 word-flags per int64; nonzero over N/8 flag words, not N flags.
        whole = (mask.numel() // 8) * 8
        flags = mask[:whole].view(torch.int64)
        hot = flags.nonzero().squeeze(1)
        sub = flags.take(hot).view(torch.bool).nonzero().squeeze(1)
        words = hot.take(sub >> 3) * 8 + (sub & 7)
        if whole < mask.numel():
            extra = torch.arange(whole, mask.numel(), device=mask.device)
            words = torch.cat([words, extra[mask[whole:]]])
        if words.numel() == 0:
            return
        # Level 2: which lanes of each changed word differ (xor of the two words' bits).
        new_words = n64.take(words)
        lane_bits = torch.bitwise_xor(o64.take(words), new_words).view(lane_dtype)
        hit = lane_bits.nonzero().squeeze(1)
        shift = lanes.bit_length() - 1
        elem = words.take(hit >> shift) * lanes + (hit & (lanes - 1)) + word0 * lanes
        idx_parts.append(elem.to(torch.int32))
        val_parts.append(new_words.view(lane_dtype).take(hit))


def word_aligned(flat: torch.Tensor) -> bool:
    return (flat.storage_offset() * flat.element_size()) % 8 == 0
