"""The unit of a delta: changed elements of one checkpoint tensor.

A :class:`Patch` names a tensor in Hugging Face checkpoint coordinates and carries ``int32`` flat
indices (strictly increasing, within ``numel``) and the new values in the tensor's dtype. A patch
with ``indices is None`` is *dense*: ``values`` is the whole tensor (a seed, or a delta where dense
is smaller than sparse).

Patches are overwrite, not additive or XOR: applying one twice is harmless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import PatchValidationError

INT32_MAX = 2**31 - 1
#: dtypes a patch may carry; the wire format encodes them by name.
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, tensor: str = "?") -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise PatchValidationError(tensor, f"dtype {dtype} is not supported "
                                   f"(supported: {', '.join(DTYPES)})") from None


def check_indexable(name: str, numel: int) -> None:
    """int32 indices address at most 2**31-1 elements: larger tensors must be split by the caller."""
    if numel > INT32_MAX:
        raise PatchValidationError(
            name, f"{numel} elements do not fit int32 flat indices (max {INT32_MAX}); "
            "export it as smaller checkpoint tensors (e.g. per expert or per row block)")


@dataclass
class Patch:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    indices: torch.Tensor | None  # int32, 1-D, strictly increasing; None = dense
    values: torch.Tensor  # 1-D, dtype == self.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def dense(self) -> bool:
        return self.indices is None

    @property
    def count(self) -> int:
        """Elements carried (changed elements for sparse, numel for dense)."""
        return int(self.values.numel())

    @property
    def nbytes(self) -> int:
        idx = 0 if self.indices is None else self.indices.numel() * 4
        return idx + self.values.numel() * self.values.element_size()

    def to(self, device: torch.device) -> "Patch":
        """This patch with its tensors on ``device`` (itself when they are there already)."""
        if self.values.device == torch.device(device):
            return self
        idx = None if self.indices is None else self.indices.to(device)
        return Patch(self.name, self.shape, self.dtype, idx, self.values.to(device))

    @classmethod
    def full(cls, name: str, tensor: torch.Tensor) -> "Patch":
        return cls(name, tuple(tensor.shape), tensor.dtype, None, tensor.reshape(-1))

    def validate(self, *, expected_shape: tuple[int, ...] | None = None,
                 expected_dtype: torch.dtype | None = None, check_finite: bool = True,
                 contents: bool = True, kept: str | None = None) -> None:
        """Raise :class:`PatchValidationError` naming the tensor and the first bad index.

        ``contents=False`` checks the metadata only (name, dtype, shape, counts): for patches whose
        indices and values were checked per bucket (:func:`delta_sync.bucket.check_sparse_entries`)."""
        def bad(reason: str, index: int | None = None):
            return PatchValidationError(self.name, reason, index=index, kept=kept)

        self._check_meta(bad, expected_shape, expected_dtype)
        if self.indices is not None and contents:
            _check_indices(self.indices, self.numel, bad)
        v = self.values
        if check_finite and contents and v.numel():
            first_bad = first_true(~torch.isfinite(v))
            if first_bad is not None:
                where = first_bad if self.indices is None else int(self.indices[first_bad])
                raise bad(f"non-finite value {float(v[first_bad])} at flat index {where}", first_bad)

    def _check_meta(self, bad, expected_shape: tuple[int, ...] | None, expected_dtype: torch.dtype | None) -> None:
        """Name, dtype, shape and counts against each other and the target's."""
        if not isinstance(self.name, str) or not self.name:
            raise bad("empty or non-string checkpoint name")
        if self.dtype not in DTYPE_NAMES:
            raise bad(f"dtype {self.dtype} is not supported (supported: {', '.join(DTYPES)})")
        if expected_dtype is not None and self.dtype != expected_dtype:
            raise bad(f"dtype {self.dtype} does not match the target's {expected_dtype}")
        if any((not isinstance(s, int)) or s < 0 for s in self.shape):
            raise bad(f"invalid shape {self.shape}")
        if expected_shape is not None and tuple(self.shape) != tuple(expected_shape):
            raise bad(f"shape {tuple(self.shape)} does not match the target's {tuple(expected_shape)}")
        numel = self.numel
        check_indexable(self.name, numel)
        v = self.values
        if v.dtype != self.dtype:
            raise bad(f"values dtype {v.dtype} differs from the declared {self.dtype}")
        if v.dim() != 1:
            raise bad(f"values must be 1-D, got shape {tuple(v.shape)}")
        if self.indices is None:
            if v.numel() != numel:
                raise bad(f"dense patch has {v.numel()} values for {numel} elements")
            return
        idx = self.indices
        if idx.dtype != torch.int32:
            raise bad(f"indices dtype {idx.dtype}, expected torch.int32")
        if idx.dim() != 1 or idx.numel() != v.numel():
            raise bad(f"{idx.numel()} indices for {v.numel()} values")


class Whole(NamedTuple):
    """A whole tensor as a bulk update reads it from the stream, before it is a :class:`Patch`: what
    the packer puts in a dense table as it is (by address), making the patch (:meth:`patch`, a flat
    view: ~1.3 us, ~25 ms of a 30B-A3B seed's ~19k tensors) only for what goes by name."""

    name: str
    tensor: torch.Tensor

    indices = None
    dense = True

    @property
    def count(self) -> int:
        return self.tensor.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def values(self) -> torch.Tensor:
        return self.tensor.reshape(-1)

    def patch(self) -> Patch:
        return Patch.full(self.name, self.tensor)


class WholeRun(NamedTuple):
    """Consecutive whole tensors of a bulk update's stream (plain tensors, checked as a list by the
    stream): what the packer puts in a bucket's dense table with a few list operations for all of
    them where they are catalogued, fit and come in catalogue order, else one :class:`Whole` at a time."""

    names: list[str]
    tensors: list[torch.Tensor]

    dense = True

    @property
    def count(self) -> int:
        return sum(map(torch.Tensor.numel, self.tensors))

    def wholes(self):
        return map(Whole, self.names, self.tensors)


@dataclass
class PatchBatch:
    """Sparse patches of many tensors of one dtype in shared buffers, as one diff kernel batch
    produced them: tensor ``k`` (``names[k]``, ``shapes[k]``) has ``counts[k]`` changed elements,
    whose int32 flat indices and values follow those of the tensors before it in :attr:`indices` /
    :attr:`values`. What a list of :class:`Patch` would say, without a Python object per tensor:
    the packer puts a batch in its buckets' tables by ranges (:mod:`delta_sync.catalog`)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    counts: list[int]  # every one > 0
    indices: torch.Tensor  # int32, 1-D
    values: torch.Tensor  # 1-D, dtype == self.dtype

    #: each tensor's position in the update's stream, where the batch travels between trainer
    #: ranks (:mod:`delta_sync.gather` orders and splits batches by it)
    seqs: list[int] | None = None

    #: a batch is sparse (the packer reads ``dense`` of whatever it is given)
    dense = False

    @property
    def count(self) -> int:
        return int(self.values.numel())

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * 4 + self.values.numel() * self.values.element_size()

    def take(self, lo: int, hi: int) -> "PatchBatch":
        """Tensors ``lo .. hi-1`` of the batch (views of its buffers)."""
        start = sum(self.counts[:lo])
        n = sum(self.counts[lo:hi])
        return PatchBatch(self.names[lo:hi], self.shapes[lo:hi], self.dtype, self.counts[lo:hi],
                          self.indices.narrow(0, start, n), self.values.narrow(0, start, n),
                          None if self.seqs is None else self.seqs[lo:hi])

    def patches(self) -> list[Patch]:
        """One :class:`Patch` per tensor (views of the buffers)."""
        return [Patch(n, s, self.dtype, i, v) for n, s, i, v in
                zip(self.names, self.shapes, self.indices.split(self.counts), self.values.split(self.counts))]

    def validate(self, *, contents: bool = False, kept: str | None = None) -> None:
        """The batch's counts against its buffers (its indices and values are checked per bucket,
        as those of the patches it stands for; ``contents`` is for symmetry with :meth:`Patch.validate`)."""
        n = sum(self.counts)
        if (len(self.names) != len(self.counts) or len(self.shapes) != len(self.counts) or min(self.counts, default=1) <= 0
                or self.indices.dtype != torch.int32 or self.values.dtype != self.dtype
                or self.indices.numel() != n or self.values.numel() != n):
            raise PatchValidationError(self.names[0] if self.names else "<batch>",
                                       f"a batch of {len(self.names)} tensors whose counts ({n} elements) do not "
                                       f"match its buffers ({self.indices.numel()} indices, {self.values.numel()} "
                                       "values)", kept=kept)
        if contents:
            for p in self.patches():
                p.validate(kept=kept)


def member_elements(keep: list[bool] | torch.Tensor, counts: list[int] | torch.Tensor, device: torch.device
                    ) -> torch.Tensor:
    """Positions in a batch's buffers (member ``k``'s ``counts[k]`` elements after those of the
    members before it) of the elements of the members ``keep`` marks, for ``index_select``: worked
    out on the host and moved in one copy (a boolean mask over device buffers is a nonzero that
    waits for the device)."""
    keep = torch.as_tensor(keep, dtype=torch.bool)
    return torch.repeat_interleave(keep, torch.as_tensor(counts, dtype=torch.int64)).nonzero().squeeze(1).to(device)


def _check_indices(idx: torch.Tensor, numel: int, bad) -> None:
    """Indices inside ``[0, numel)`` and strictly increasing; ``bad(reason, position)`` builds the error."""
    if not idx.numel():
        return
    first_bad = first_true(idx < 0)
    if first_bad is not None:
        raise bad(f"index {int(idx[first_bad])} is negative", first_bad)
    first_bad = first_true(idx >= numel)
    if first_bad is not None:
        raise bad(f"index {int(idx[first_bad])} out of bounds for {numel} elements", first_bad)
    if idx.numel() > 1:
        step = idx[1:] - idx[:-1]
        first_bad = first_true(step == 0)
        if first_bad is not None:
            raise bad(f"duplicate index {int(idx[first_bad])}", first_bad + 1)
        first_bad = first_true(step < 0)
        if first_bad is not None:
            raise bad(f"indices not increasing: {int(idx[first_bad])} then {int(idx[first_bad + 1])}",
                      first_bad + 1)


def first_true(mask: torch.Tensor) -> int | None:
    """Position of the first True in a 1-D mask, or None."""
    if not bool(mask.any()):
        return None
    return int(mask.to(torch.uint8).argmax())


def apply_patch(target: torch.Tensor, patch: Patch) -> None:
    """Write ``patch`` into ``target`` in place (a contiguous tensor of the patch's shape)."""
    flat = target.view(-1)
    if patch.dense:
        flat.copy_(patch.values.to(flat.device))
    elif patch.count:
        flat.index_copy_(0, patch.indices.to(device=flat.device, dtype=torch.int64), patch.values.to(flat.device))
