"""Trainer-side updaters, one per transport, chosen from launcher arguments (slime's shape).

``--update-weight-mode delta`` pairs with a ``sparse_*`` transport, ``full`` with a plain one;
the backend (hccl / nccl / gloo) follows the transport name. Every updater has the same surface::

    updater = build_updater(args, engines, group=None)
    report = updater.update_weights(named_tensors)   # on every trainer rank, each step
"""

from .args import UpdateWeightConfig, add_update_weight_args, resolve_update_weight_args
from .update_weight_from_hccl import UpdateWeightFromHCCL
from .update_weight_from_sparse_hccl import UpdateWeightFromSparseHCCL

__all__ = ["UpdateWeightConfig", "add_update_weight_args", "resolve_update_weight_args", "build_updater",
           "UpdateWeightFromHCCL", "UpdateWeightFromSparseHCCL"]


def build_updater(args, engines, group=None, **sync_options):
    """The updater for ``args`` (an argparse namespace or an :class:`UpdateWeightConfig`)."""
    cfg = args if isinstance(args, UpdateWeightConfig) else resolve_update_weight_args(args)
    cls = UpdateWeightFromSparseHCCL if cfg.mode == "delta" else UpdateWeightFromHCCL
    return cls(cfg, engines, group=group, **sync_options)
