"""The trainer-side updater, configured from launcher arguments (slime's flags and surface).

``--update-weight-mode delta`` pairs with a ``sparse_*`` transport, ``full`` with a plain one;
the backend (hccl / nccl / gloo) follows the transport name. One updater serves them all::

    updater = build_updater(args, engines, group=None)
    report = updater.update_weights(named_tensors)   # on every trainer rank, each step
"""

from .args import UpdateWeightConfig, add_update_weight_args, resolve_update_weight_args
from .updater import WeightUpdater

__all__ = ["UpdateWeightConfig", "add_update_weight_args", "resolve_update_weight_args", "build_updater",
           "WeightUpdater"]


def build_updater(args, engines, group=None, **sync_options):
    """The updater for ``args`` (an argparse namespace or an :class:`UpdateWeightConfig`)."""
    cfg = args if isinstance(args, UpdateWeightConfig) else resolve_update_weight_args(args)
    return WeightUpdater(cfg, engines, group=group, **sync_options)
