"""Bitwise diff of a tensor against its snapshot.

Changed means "bits differ": the comparison runs on integer views, never ``!=`` on floats
(NaN != NaN would mark every NaN changed; -0.0 == 0.0 would hide a sign flip).

The scan is memory-bound, so it is shaped to read each input once and write as little as possible:

1. compare 64-bit words (4 bf16 elements per compare) into a reused bool mask, chunk by chunk,
   and pack each chunk's flags 8 to a byte; a scan covers at most ``batch_words`` words (a longer
   tensor is scanned a batch at a time), so its temporaries are ``chunk_words`` bytes of mask, 1
   byte per 8 words of the batch and ~50 B per changed element of the batch;
2. find changed words hierarchically: ``nonzero`` over the packed bytes, then over the 8 bits of
   each non-zero byte; never over the full mask, and twice per scan whatever its chunk count
   (on a device each ``nonzero`` waits for it);
3. gather just the changed words, xor them and split the xor into element-width lanes; the new
   values come out of the gathered words, not from another pass over the tensor.

Indices come out strictly increasing, as the patch format requires.

A snapshot can *advance* in the same pass (:meth:`BitwiseDiff.advance`): every changed word is
overwritten with the new one while it is in cache, and the old bits come out beside the new ones,
so committing costs nothing and rolling back is one scatter of O(changed) bytes (:func:`restore`).

For host tensors a compiled one-pass kernel (:mod:`delta_sync.native`) replaces steps 1-3 when a
C compiler is present; the torch-op path is the portable reference and the fallback.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch
from torch._utils import _flatten_dense_tensors

from . import native
from .patch import Patch, check_indexable

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: words compared per chunk: 8M words = 64 MiB of each input, 8 MiB of mask.
DEFAULT_CHUNK_WORDS = 1 << 23
#: 8 flag bytes (each 0 or 1) read as one little-endian int64 (every platform torch ships for),
#: times this, have flag k at bit 56 + k, byte 7 of the product: every other partial product lands
#: below bit 56, each on a bit of its own (no carry), or past bit 63, where the product's 64 bits
#: drop it (integer multiplies wrap on every torch backend)
_PACK_FLAGS = sum(1 << (56 - 7 * k) for k in range(8))


def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same bits, integer dtype of the same width, flattened."""
    return t.reshape(-1).view(_INT_VIEW[t.element_size()])


class BitwiseDiff:
    """Reusable scanner: holds its bounded scratch mask across calls."""

    def __init__(self, chunk_words: int = DEFAULT_CHUNK_WORDS, use_native: bool = True,
                 batch_words: int | None = None):
        if chunk_words <= 0 or chunk_words % 8:
            raise ValueError(f"chunk_words must be a positive multiple of 8, got {chunk_words}")
        self.chunk_words = chunk_words
        #: words of the small device tensors scanned as one batch (:meth:`_absorb_flat`): its
        #: temporaries are ~17 B per word (both sides copied, a flag byte), its launches and four
        #: host syncs are paid per batch (~1 ms on an H200: at 30B-A3B's 3 MB experts a batch of
        #: 64 MiB holds ~20 tensors, one of 256 MiB ~80)
        self.batch_words = batch_words or 4 * chunk_words
        self.use_native = use_native
        self._mask: torch.Tensor | None = None
        self._bits: dict[torch.device, torch.Tensor] = {}  # device -> the 8 bits of a byte, as uint8
        #: by element width: the tensors in the last host-kernel batch and the elements it found changed
        self._last_changed: dict[int, tuple[int, int]] = {}

    def _scratch(self, n: int, device: torch.device) -> torch.Tensor:
        if self._mask is None or self._mask.device != device or self._mask.numel() < n:
            self._mask = torch.empty(max(n, 8), dtype=torch.bool, device=device)
        return self._mask[:n]

    def diff(self, name: str, old: torch.Tensor, new: torch.Tensor) -> Patch:
        """The patch that turns ``old`` into ``new``: int32 indices + values of ``new``."""
        self._check(name, old, new, absorb=False)
        idx, bits = self.changed(old, new)
        return Patch(name, tuple(new.shape), new.dtype, idx, bits.view(new.dtype))

    def advance(self, name: str, snapshot: torch.Tensor, new: torch.Tensor) -> tuple[Patch, torch.Tensor]:
        """:meth:`diff`, moving ``snapshot`` (contiguous) to ``new`` in the same pass: only its changed
        words are written, while they are in cache. Returns the patch and the old bits at its
        indices, which put ``snapshot`` back (:func:`restore`)."""
        return self.advance_many([(name, snapshot, new)])[0]

    def advance_many(self, items: list[tuple[str, torch.Tensor, torch.Tensor]]
                     ) -> list[tuple[Patch, torch.Tensor]]:
        """:meth:`advance` of ``(name, snapshot, new)`` items, scanned together (:meth:`absorb_many`)."""
        for name, snap, new in items:
            self._check(name, snap, new, absorb=True)
        found = self.absorb_many([(snap, new) for _, snap, new in items])
        return [(Patch(name, tuple(new.shape), new.dtype, idx, bits.view(new.dtype)), old_bits)
                for (name, _, new), (idx, bits, old_bits) in zip(items, found)]

    def absorb_many(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """:meth:`absorb` of ``(old, new)`` pairs: :meth:`absorb_batched`, each pair's result apart."""
        batches, out = self.absorb_batched(pairs)
        for b in batches:
            for i, got in zip(b.members, b.parts()):
                out[i] = got
        return out

    def absorb_batched(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], same: bool = False,
                       known: list[KernelFacts] | None = None
                       ) -> tuple[list["Absorbed"], list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]]:
        """:meth:`absorb` of ``(old, new)`` pairs. Host tensors in whole words share a few calls of
        the host kernel (:func:`native.changed_batch`) per element width instead of paying its
        per-call costs each, and come back as one :class:`Absorbed` per width; the others, one by
        one, as ``(indices, new bits, old bits)`` at their position of the list (None for the
        batched ones). All or nothing: if one fails, every ``old`` advanced here is put back before
        the error is raised. ``same``: the caller checked that each pair's two tensors share one
        shape, dtype and device (the snapshot store does), so those checks are not made again;
        ``known`` (with ``same``): each ``old``'s :func:`kernel_facts`, known to the caller (the
        store works them out once per snapshot), so only the new tensors are looked at."""
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(pairs)
        batches: list[Absorbed] = []
        batch: dict[int, list[int]] = {}  # element width -> pairs scanned together
        flat: dict[tuple, list[int]] = {}  # (width, device) -> torch-path pairs scanned together
        native_ok = self.use_native and native.kernel() is not None  # (once, not per tensor)
        new_ptrs: dict[int, int] = {}  # pair -> its new tensor's address, where known facts were given
        try:
            for i, (old, new) in enumerate(pairs):
                if known is not None and native_ok:  # (same): the snapshots' side known, the new tensors' checked
                    width, ptr = known[i].width, new.data_ptr()
                    if width and not ptr & 7 and new.is_contiguous():
                        new_ptrs[i] = ptr
                        batch.setdefault(width, []).append(i)
                        continue
                    ok = False
                else:
                    ok = native_ok and (self._batchable_same(old, new) if same else self._batchable(old, new))
                if ok:
                    # split over the threads by words, whatever the tensors' sizes
                    batch.setdefault(old.element_size(), []).append(i)
                elif self._flat(old, new):
                    flat.setdefault((old.element_size(), old.device), []).append(i)
                else:
                    out[i] = self.absorb(old, new)
            for members in flat.values():
                self._absorb_flat_groups(pairs, members, batches, out)
            for width, members in batch.items():
                olds, news = [pairs[i][0] for i in members], [pairs[i][1] for i in members]
                if new_ptrs:  # (then every member's facts are known: the addresses need no tensor call)
                    batches.append(self.absorb_known(olds, news, [known[i] for i in members],
                                                     [new_ptrs[i] for i in members], members))
                    continue
                batches.append(Absorbed(members, *self._scan_batch(olds, news, width)))
        except BaseException:
            for (old, _), done in zip(pairs, out):
                if done is not None:
                    restore(old, done[0], done[2])
            for b in batches:
                b.restore([pairs[i][0] for i in b.members])
            raise
        return batches, out

    def _absorb_flat_groups(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], members: list[int],
                            batches: list["Absorbed"], out: list) -> None:
        """``pairs[i]`` for ``i`` in ``members`` (torch-path pairs of one width and device) in
        batches of at most ``batch_words`` words (:meth:`_absorb_flat`, into ``batches``); one that
        forms a batch alone (a tensor as large as a batch) through :meth:`absorb`, read where it
        lies and scanned a batch of words at a time (into ``out``)."""
        for lo, hi, adjacent in _flat_parts([pairs[i][0] for i in members], self.batch_words):
            if hi - lo == 1:
                out[members[lo]] = self.absorb(*pairs[members[lo]])
            else:
                batches.append(self._absorb_flat(pairs, members[lo:hi], adjacent))

    def absorb_known(self, olds: list[torch.Tensor], news: list[torch.Tensor], known: list[KernelFacts],
                     new_ptrs: list[int], members: list[int] | None = None,
                     facts: tuple[list[int], list[int]] | None = None) -> "Absorbed":
        """:meth:`absorb_batched` of pairs the caller found ready for the host kernel (present) in one
        element width: each ``old``'s facts ``known``, each new tensor host memory of its shape and
        dtype, contiguous, at ``new_ptrs`` (8-byte aligned). One batch (``members``: the pairs'
        positions in the caller's list, 0.. by default); all or nothing. ``facts``: the words and
        addresses of ``known`` as two lists, where the caller keeps them."""
        words, ptrs = facts if facts is not None else ([k.words for k in known], [k.ptr for k in known])
        facts = (words, ptrs, new_ptrs)
        found = self._scan_batch(olds, news, known[0].width, facts)
        return Absorbed(list(range(len(olds))) if members is None else members, *found)

    def _scan_batch(self, olds: list[torch.Tensor], news: list[torch.Tensor], width: int,
                    facts: tuple[list[int], list[int], list[int]] | None = None) -> tuple[torch.Tensor, ...]:
        """:func:`native.changed_batch` (absorbing), its outputs sized for what the last batch of as
        many tensors of this width found changed (successive deltas change about as much: the
        kernel's calls then need no join of their outputs)."""
        n, last = len(olds), self._last_changed.get(width, (0, 0))
        found = native.changed_batch(olds, news, 8 // width, absorb=True, facts=facts,
                                     expect=last[1] if last[0] == n else 0)
        self._last_changed[width] = (n, found[1].numel())
        return found

    def _batchable(self, snap: torch.Tensor, new: torch.Tensor) -> bool:
        """A host tensor the kernel (present: the caller asked) scans whole in 64-bit words: same
        shape and dtype, both contiguous, 8-byte aligned, a whole number of words (checked per
        tensor of a model's ~19k: the cheapest tests first, no view made)."""
        return (new.is_cpu and snap.dtype is new.dtype and snap.shape == new.shape
                and self._batchable_same(snap, new))

    @staticmethod
    def _batchable_same(snap: torch.Tensor, new: torch.Tensor) -> bool:
        """:meth:`_batchable` of a pair known to share shape, dtype and device: the kernel's own
        conditions."""
        return bool(kernel_width(snap)) and not new.data_ptr() & 7 and new.is_contiguous()

    @staticmethod
    def _flat(snap: torch.Tensor, new: torch.Tensor) -> bool:
        """A torch-path pair (device tensors) that :meth:`_absorb_flat` can scan with others: whole
        64-bit words on one device (one that forms a batch alone goes through :meth:`absorb`)."""
        return snap.device == new.device and _whole_words(snap, new)

    def _absorb_flat(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], members: list[int],
                     adjacent: bool = False) -> "Absorbed":
        """:meth:`absorb` of ``pairs[i]`` for ``i`` in ``members`` (two or more of one width and
        device, at most ``batch_words`` words together) as one scan: on a device every ``nonzero``
        and ``tolist`` waits for the device, and a model's hundreds of tensors would each pay the
        three syncs of a scan. Here the whole batch pays four (:meth:`_scan_words`' three, one read
        of each tensor's counts) and no launch per tensor. Returns the batch once the snapshots
        advanced (the caller's rollback restores it). ``adjacent``: the snapshots lie back to back
        in one storage (:func:`_adjacent_runs`, e.g. a seed's arena): they are read and advanced
        there as one span, with no view or copy per tensor."""
        old0 = pairs[members[0]][0]
        # one view per tensor and side (a view is a dispatched op too: ~19k tensors at 30B-A3B);
        # a batch of one dtype concatenates as it is and is read as words after (dtypes of one
        # width mixed, bf16 and fp16, are read as integers first: a cat would convert them)
        mixed = any(pairs[i][0].dtype != old0.dtype for i in members)
        lane_dtype = _INT_VIEW[old0.element_size()]
        news = [pairs[i][1].view(-1).view(lane_dtype) if mixed else pairs[i][1].view(-1) for i in members]
        got = FlatBatch.of([pairs[i][0] for i in members], adjacent)
        olds = None
        if got.span is None:
            olds = [pairs[i][0].view(-1).view(lane_dtype) if mixed else pairs[i][0].view(-1) for i in members]
        return self._absorb_planned(got, members, news, olds)

    def absorb_flat_known(self, batch: "FlatBatch", news: list[torch.Tensor], members: list[int] | range
                          ) -> "Absorbed":
        """:meth:`_absorb_flat` of snapshots whose :class:`FlatBatch` the caller keeps (a store's delta
        plan on the torch path): ``news`` contiguous, of the snapshots' shapes and one dtype, on
        their device, word-aligned (the caller checked them as lists); no per-tensor step here
        but the flattening, done in one call (views made by torch's own loop, not Python's)."""
        olds = None if batch.span is not None else [o.view(-1) for o in batch.olds]
        return self._absorb_planned(batch, members, None, olds, flat_new=flatten(news))

    def _absorb_planned(self, batch: "FlatBatch", members: list[int] | range, news: list[torch.Tensor] | None,
                        olds: list[torch.Tensor] | None, flat_new: torch.Tensor | None = None) -> "Absorbed":
        """The scan of :meth:`_absorb_flat`: ``news`` (flat views, or ``flat_new`` already joined) against
        the batch's snapshots (``batch.span``, or ``olds`` as flat views), the snapshots advanced."""
        lanes, lane_dtype = batch.lanes, _INT_VIEW[8 // batch.lanes]
        shift = lanes.bit_length() - 1
        # both sides gathered into one buffer each: two copies of the batch cost less on a device
        # than a compare and two gathers per tensor (launches, not bytes, bound small tensors there);
        # snapshots back to back are read where they lie
        span = batch.span
        old_all = span if span is not None else torch.cat(olds).view(torch.int64)
        new_all = (flat_new if flat_new is not None else torch.cat(news)).view(torch.int64)
        if news is None and span is None:
            news = list(flat_new.view(lane_dtype).split(batch.numels))  # (views: the multi-tensor copy's sources)
        words, hit, new_w, old_w = self._scan_words(old_all, new_all, lane_dtype)
        del old_all, new_all
        hit_word = hit >> shift
        starts = batch.starts
        member = torch.searchsorted(starts, words, right=True) - 1
        # each member's end among the changed words, then among their lanes (searches: a bincount
        # reads its input's min and max back on CUDA, two host syncs more)
        ends = torch.searchsorted(words, batch.ends)
        per_member = torch.diff(ends, prepend=ends.new_zeros(1))  # changed words of each member
        local = words - starts.take(member)  # word positions in their own tensor
        cuts = torch.searchsorted(hit_word, ends)
        # both cross to the host in one read
        counts, cuts = torch.stack([per_member, cuts]).cpu().unbind(0)
        hits = torch.diff(cuts, prepend=cuts.new_zeros(1))
        elem = (local.take(hit_word) * lanes + (hit & (lanes - 1))).to(torch.int32)
        new_v, old_v = new_w.view(lane_dtype).take(hit), old_w.view(lane_dtype).take(hit)
        if span is not None:  # the changed words advance in place, one op for the batch
            span.index_copy_(0, words, new_w)
        else:
            changed = [k for k, c in enumerate(counts.tolist()) if c]
            # the changed snapshots advance whole, in one multi-tensor copy (one launch for many on a
            # device, where an index_copy_ per tensor costs a launch and two views each)
            # (as integers: the float copy of CUDA's multi-tensor kernel rewrites a NaN's payload bits)
            if changed:  # (a batch where nothing changed: an empty list is an error there)
                torch._foreach_copy_([olds[k].view(lane_dtype) for k in changed],
                                     [news[k].view(lane_dtype) for k in changed])
        # the batch's changes stay in these buffers, a count per member (no split per tensor)
        return Absorbed(members, hits, elem, new_v, old_v)

    def _scan_words(self, old: torch.Tensor, new: torch.Tensor, lane_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 64-bit words where ``old`` and ``new`` (int64, 1-D, one length) differ, in three
        ``nonzero`` whatever the length: ``(words, hit, new_w, old_w)``, the changed words'
        positions (increasing), their changed lanes of ``lane_dtype`` (positions in the gathered
        words, increasing) and the gathered words of each side. Nothing is written to ``old``.

        The compare runs chunk by chunk into the bounded scratch mask; each chunk's flags are
        packed 8 to a byte (an in-place multiply of the mask read as int64, :data:`_PACK_FLAGS`, and
        a copy of each product's top byte) into a buffer of 1 byte per 8 words, and the two levels
        of ``nonzero`` run once over that buffer and its non-zero bytes' bits, not once per chunk."""
        total, dev = old.numel(), old.device
        packed = torch.empty(-(-total // 8), dtype=torch.uint8, device=dev)
        for lo in range(0, total, self.chunk_words):
            n = min(self.chunk_words, total - lo)
            mask = self._scratch(-(-n // 8) * 8, dev)
            if mask.numel() > n:
                mask.narrow(0, n, mask.numel() - n).zero_()
            torch.ne(old.narrow(0, lo, n), new.narrow(0, lo, n), out=mask.narrow(0, 0, n))
            flags = mask.view(torch.int64).mul_(_PACK_FLAGS)  # each 8 words' flags as the top byte's bits
            packed.narrow(0, lo // 8, flags.numel()).copy_(flags.view(torch.uint8).view(-1, 8).select(1, 7))
        hot = packed.nonzero().squeeze(1)  # level 1: bytes with a changed word
        bit = self._bits.get(dev)
        if bit is None:
            bit = self._bits[dev] = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=dev)
        sub = packed.take(hot).unsqueeze(1).bitwise_and(bit).view(-1).nonzero().squeeze(1)  # level 2: words
        words = hot.take(sub >> 3) * 8 + (sub & 7)
        new_w, old_w = new.take(words), old.take(words)
        hit = torch.bitwise_xor(old_w, new_w).view(lane_dtype).nonzero().squeeze(1)  # level 3: lanes
        return words, hit, new_w, old_w

    @staticmethod
    def _check(name: str, old: torch.Tensor, new: torch.Tensor, absorb: bool) -> None:
        if old.shape != new.shape or old.dtype != new.dtype:
            raise ValueError(f"diff of {name!r}: snapshot {tuple(old.shape)}/{old.dtype} vs "
                             f"new {tuple(new.shape)}/{new.dtype}")
        check_indexable(name, new.numel())
        if absorb and not old.is_contiguous():
            raise ValueError(f"diff of {name!r}: advancing writes into the snapshot, which must be contiguous")

    def changed(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(int32 flat indices, integer bits of new at them)``; indices strictly increasing."""
        idx, bits, _ = self._changed(old, new, absorb=False)
        return idx, bits

    def absorb(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`changed` plus the bits of ``old`` at the same indices, with ``old`` (contiguous)
        overwritten by ``new`` wherever they differ."""
        self._check("<absorbed>", old, new, absorb=True)
        return self._changed(old, new, absorb=True)

    def _changed(self, old: torch.Tensor, new: torch.Tensor, absorb: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        o = int_view(old if absorb else old.contiguous())
        n = int_view(new.contiguous())
        lanes = 8 // o.element_size()
        numel = o.numel()
        nwords = numel // lanes if (word_aligned(o) and word_aligned(n)) else 0
        parts: list[list[torch.Tensor]] = [[], [], []]  # indices, new bits, old bits (absorb)
        try:
            self._scan(o, n, nwords, lanes, parts, absorb)
        except BaseException:
            if absorb:  # whatever advanced goes back: a failed diff leaves the snapshot as it was
                for idx, old_bits in zip(parts[0], parts[2]):
                    restore(o, idx, old_bits)
            raise
        out = [torch.cat(p) if len(p) > 1 else p[0] if p else torch.empty(0, dtype=dt, device=o.device)
               for p, dt in zip(parts[:3 if absorb else 2], (torch.int32, o.dtype, o.dtype))]
        return out[0], out[1], (out[2] if absorb else None)

    def _scan(self, o, n, nwords, lanes, parts, absorb) -> None:
        numel = o.numel()
        tail = nwords * lanes
        moved = []  # the torch ops' changed words of each batch of words: advanced last
        if nwords:
            o64 = o[:tail].view(torch.int64)
            n64 = n[:tail].view(torch.int64)
            if self.use_native and native.supports(o):  # (it advances as it goes, where it absorbs)
                for into, got in zip(parts, native.changed_words(o64, n64, lanes, absorb)):
                    into.extend(got)
            else:  # a batch of words at a time (each scan's temporaries grow with what it finds)
                for w0 in range(0, nwords, self.batch_words):
                    nw = min(self.batch_words, nwords - w0)
                    words, hit, new_w, old_w = self._scan_words(o64.narrow(0, w0, nw), n64.narrow(0, w0, nw), o.dtype)
                    elem = words.take(hit >> (lanes.bit_length() - 1)).add_(w0).mul_(lanes).add_(hit & (lanes - 1))
                    parts[0].append(elem.to(torch.int32))
                    parts[1].append(new_w.view(o.dtype).take(hit))
                    if absorb:
                        parts[2].append(old_w.view(o.dtype).take(hit))
                        moved.append((w0, nw, words, new_w))
                    del words, hit, new_w, old_w, elem
        hit = self._tail(o, n, tail, parts, absorb) if tail < numel else None  # unaligned or ragged end
        if absorb:  # (after every scan: one that fails has written nothing)
            for w0, nw, words, new_w in moved:
                o64.narrow(0, w0, nw).index_copy_(0, words, new_w)
            if hit is not None:
                o[tail:].index_copy_(0, hit, parts[1][-1])

    @staticmethod
    def _tail(o, n, tail, parts, absorb: bool) -> torch.Tensor:
        """The elements from ``tail`` on, compared one by one (not whole words); returns their
        changed positions after ``tail``."""
        hit = (o[tail:] != n[tail:]).nonzero().squeeze(1)
        parts[0].append((hit + tail).to(torch.int32))
        parts[1].append(n[tail:].take(hit))
        if absorb:
            parts[2].append(o[tail:].take(hit))
        return hit


@dataclass
class Absorbed:
    """Pairs ``members`` (positions in the caller's list) of one element width, scanned together:
    ``counts[k]`` (int64, on the host) changed elements of member ``k``, their int32 flat indices, new bits and
    old bits after those of the members before it in :attr:`indices`, :attr:`new`, :attr:`old`."""

    members: list[int]
    counts: torch.Tensor
    indices: torch.Tensor
    new: torch.Tensor | None  # (None in an undo record: the patches carry the new bits)
    old: torch.Tensor

    def parts(self) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
        """``(indices, new bits, old bits)`` of each member in turn (views; new None where the
        batch holds none)."""
        sizes = self.counts.tolist()
        new = self.new.split(sizes) if self.new is not None else [None] * len(sizes)
        return list(zip(self.indices.split(sizes), new, self.old.split(sizes)))

    def restore(self, snapshots: list[torch.Tensor]) -> None:
        """Put the members' snapshots (in member order) back as they were before the scan."""
        native.put_back_many(snapshots, self.counts, self.indices, self.old)


class FlatBatch(NamedTuple):
    """What a torch-path scan (:meth:`BitwiseDiff._absorb_flat`) needs of a batch's snapshots (whole
    64-bit words, one element width, one device), fixed while their memory lives: the snapshots,
    elements per word, each one's elements, each one's first word in the batch (int64, on their
    device) and, where they lie back to back in one storage, all their words where they lie."""

    olds: list[torch.Tensor]
    lanes: int
    numels: list[int]
    starts: torch.Tensor
    ends: torch.Tensor  # (each one's first word after it)
    span: torch.Tensor | None

    @classmethod
    def of(cls, olds: list[torch.Tensor], adjacent: bool) -> "FlatBatch":
        old0 = olds[0]
        lanes = 8 // old0.element_size()
        numels = list(map(torch.Tensor.numel, olds))
        words = [0, *itertools.accumulate(n // lanes for n in numels)]
        offs = torch.tensor(words, dtype=torch.int64, device=old0.device)
        span = old0.as_strided((words[-1] * lanes,), (1,), old0.storage_offset()).view(torch.int64) \
            if adjacent else None  # (its members' bits, whatever their dtypes of this width)
        return cls(olds, lanes, numels, offs[:-1], offs[1:], span)


def flat_batches(olds: list[torch.Tensor], batch_words: int) -> list[tuple[int, int, FlatBatch | None]] | None:
    """``olds`` (snapshots) cut as :meth:`BitwiseDiff.absorb_batched` cuts a torch-path batch (runs
    lying back to back, at most ``batch_words`` words each): ``(lo, hi, its FlatBatch)`` per part,
    None for a part of one tensor (as large as a batch, or alone between runs: scanned on its own,
    :meth:`BitwiseDiff.absorb`); None where they are not all of one element width and device in
    whole 64-bit words (:func:`_whole_words`)."""
    if (not olds or olds[0].element_size() not in _INT_VIEW
            or not on_one_device(olds, olds[0].get_device())
            or list(map(torch.Tensor.element_size, olds)).count(olds[0].element_size()) != len(olds)
            or not all(map(_whole_words, olds, olds))):
        return None
    return [(lo, hi, FlatBatch.of(olds[lo:hi], adjacent) if hi - lo > 1 else None)
            for lo, hi, adjacent in _flat_parts(olds, batch_words)]


def on_one_device(ts: list[torch.Tensor], device: int) -> bool:
    """Do ``ts`` all lie on the device of index ``device`` (``get_device``: -1 for the host)? As one
    list, no Python step per tensor."""
    return list(map(torch.Tensor.get_device, ts)).count(device) == len(ts)


def _flat_parts(olds: list[torch.Tensor], batch_words: int) -> Iterator[tuple[int, int, bool]]:
    """``(lo, hi, adjacent)``: ``olds`` in runs lying back to back or not (:func:`_adjacent_runs`),
    each cut to at most ``batch_words`` words (a larger tensor alone)."""
    for (lo, hi), adjacent in _adjacent_runs(olds):
        for a, b in native.capped_groups([t.numel() * t.element_size() // 8 for t in olds[lo:hi]], batch_words):
            yield lo + a, lo + b, adjacent


def flatten(ts: list[torch.Tensor]) -> torch.Tensor:
    """``ts`` (contiguous, one dtype) joined flat in one call (their views made by torch's own loop,
    not one Python call each); never part of an autograd graph (the bits are read)."""
    with torch.no_grad():
        return _flatten_dense_tensors(ts).detach()  # (one tensor comes back as a view of itself)


class KernelFacts(NamedTuple):
    """What the host kernel needs of a snapshot (the old side of a pair), fixed while its memory lives:
    the element width it scans with (0: it does not), its 64-bit words, its address."""

    width: int
    words: int
    ptr: int


_ON_HOST = operator.attrgetter("is_cpu")


def kernel_facts(snap: torch.Tensor) -> KernelFacts:
    """:class:`KernelFacts` of ``snap`` (see :func:`kernel_width`)."""
    width = kernel_width(snap)
    return KernelFacts(width, snap.numel() * width // 8, snap.data_ptr())


def kernel_facts_many(snaps: list[torch.Tensor]) -> list[KernelFacts]:
    """:func:`kernel_facts` of each of ``snaps``, as whole lists where all are contiguous host
    tensors (a snapshot store's first delta after a seed: ~19k at 30B-A3B), else one by one."""
    if not (all(map(_ON_HOST, snaps)) and all(map(torch.Tensor.is_contiguous, snaps))):
        return list(map(kernel_facts, snaps))
    sizes, numels = list(map(torch.Tensor.element_size, snaps)), list(map(torch.Tensor.numel, snaps))
    ptrs = list(map(torch.Tensor.data_ptr, snaps))
    widths = list(map(_scan_width, sizes, numels, ptrs))
    return [KernelFacts(w, n * w // 8, p) for w, n, p in zip(widths, numels, ptrs)]


def _scan_width(size: int, numel: int, ptr: int) -> int:
    """:func:`kernel_width` of a contiguous host tensor of ``numel`` elements of ``size`` bytes at ``ptr``."""
    return size if not ptr & 7 and numel * size % 8 == 0 and size in native.WORD_WIDTHS else 0


def kernel_width(snap: torch.Tensor) -> int:
    """The element width with which the host kernel scans ``snap`` (host, contiguous, starting on an
    8-byte word, a whole number of words, a width it takes) as the old side of a pair whose new
    side shares its shape, dtype and device and also starts on a word, contiguous; 0 where it
    does not."""
    if not (snap.is_cpu and snap.is_contiguous()):
        return 0
    return _scan_width(snap.element_size(), snap.numel(), snap.data_ptr())


def restore(snapshot: torch.Tensor, indices: torch.Tensor, old_bits: torch.Tensor) -> None:
    """Undo :meth:`BitwiseDiff.advance`: put the old bits back at ``indices`` (flat, int32)."""
    native.put_back(snapshot, indices, old_bits)


def _adjacent_runs(ts: list[torch.Tensor]) -> list[tuple[tuple[int, int], bool]]:
    """``ts`` (contiguous, word-aligned) cut into consecutive ``((lo, hi), adjacent)`` parts: each
    maximal run of two or more of one element width lying back to back inside the first one's
    storage is ``adjacent``, the tensors between runs one part that is not. Pointer arithmetic
    only, no op."""
    out: list[tuple[tuple[int, int], bool]] = []
    loose = lo = 0
    n = len(ts)
    while lo < n:
        first = ts[lo]
        room = first.untyped_storage().nbytes() - first.storage_offset() * first.element_size()
        end, hi = first.data_ptr() + first.numel() * first.element_size(), lo + 1
        while hi < n:
            t = ts[hi]
            size = t.numel() * t.element_size()
            if t.element_size() != first.element_size() or t.data_ptr() != end or end + size - first.data_ptr() > room:
                break
            end, hi = end + size, hi + 1
        if hi - lo > 1:
            if loose < lo:
                out.append(((loose, lo), False))
            out.append(((lo, hi), True))
            loose = hi
        lo = hi
    if loose < n:
        out.append(((loose, n), False))
    return out


def _whole_words(snap: torch.Tensor, new: torch.Tensor) -> bool:
    """Same shape and dtype, both contiguous and starting on an 8-byte word, a whole number of
    64-bit words: what the word-at-a-time scans (host kernel or batched torch ops) take."""
    return (snap.shape == new.shape and snap.dtype == new.dtype and snap.element_size() in _INT_VIEW
            and snap.is_contiguous() and new.is_contiguous() and snap.numel() % (8 // snap.element_size()) == 0
            and word_aligned(snap) and word_aligned(new))  # contiguous: no flat view needed (a MoE has ~19k)


def word_aligned(flat: torch.Tensor) -> bool:
    """Does ``flat`` (1-D, or any contiguous tensor) start on an 8-byte word of its storage?"""
    return (flat.storage_offset() * flat.element_size()) % 8 == 0
