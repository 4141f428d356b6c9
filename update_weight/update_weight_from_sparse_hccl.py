"""The delta updater: a full seed first, then only changed elements, over ``sparse_{hccl,nccl,gloo}``.

A thin layer over :class:`delta_sync.sync.WeightSync`, which the custom-trainer API uses too: one
sender implementation serves both. The named-tensor source (a Megatron-Bridge export, or
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


class UpdateWeightFromSparseHCCL:
    mode = "delta"

    def __init__(self, cfg: UpdateWeightConfig, engines, group=None, **sync_options):
        if cfg.mode != self.mode:
            raise ValueError(f"{type(self).__name__} serves --update-weight-mode {self.mode}, got {cfg.mode}")
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
