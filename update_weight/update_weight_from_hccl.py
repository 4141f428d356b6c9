"""The full-broadcast baseline over ``{hccl,nccl,gloo}``: every tensor, every step, through the same
channel, bucket format and receiver as the delta updater (what every benchmark compares against)."""

from __future__ import annotations

from .update_weight_from_sparse_hccl import UpdateWeightFromSparseHCCL


class UpdateWeightFromHCCL(UpdateWeightFromSparseHCCL):
    mode = "full"
