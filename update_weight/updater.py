"""The launcher's updater: ``WeightSync`` behind slime's ``update_weights`` surface.

One class serves every ``--update-weight-transport``: a delta updater (``sparse_*``: a full seed,
then only changed elements) or the full-broadcast baseline (plain names: every tensor every step),
over hccl, nccl or gloo; the mode and backend come from the config. The named-tensor source (a
Megatron-Bridge export, a :class:`~update_weight.megatron_shard_delta.MegatronShardDelta`, or
``model.named_parameters()``) is consumed by every trainer rank in lock-step; each tensor is diffed
by its owner rank only.
"""

from __future__ import annotations

import logging
from dataclasses import fields, replace
from typing import Iterable

import torch

from delta_sync.options import SyncOptions
from delta_sync.sync import UpdateReport, WeightSync

from .args import UpdateWeightConfig

log = logging.getLogger(__name__)

_FIELDS = {f.name for f in fields(SyncOptions)}


class WeightUpdater:
    """Syncs the engines after every training step (``update_weights`` on every trainer rank).
    ``sync_options`` override the config's :class:`SyncOptions` fields or go to ``WeightSync``."""

    def __init__(self, cfg: UpdateWeightConfig, engines, group=None, **sync_options):
        self.cfg = cfg
        options = replace(cfg.options, **{k: sync_options.pop(k) for k in list(sync_options) if k in _FIELDS})
        self.sync = WeightSync(engines, options, group=group, **sync_options)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> UpdateReport:
        report = self.sync.update(named_tensors)
        log.info("update-weight %s v%d via %s: %d changed (%.4f%%), %.2f MiB, pause %.3f s, stages %s",
                 report.kind, report.version, self.cfg.transport, report.changed_elements,
                 100 * report.changed_fraction, report.payload_bytes / 2**20, report.pause_window_s, report.timings)
        return report

    def close(self) -> None:
        self.sync.close()
