"""Hugging Face-named tensors out of a Megatron model, through Megatron-Bridge's export.

The export is collective: every model-parallel rank must consume it fully and in step, and every
rank receives every full tensor. :class:`WeightSync` diffs each tensor on its owner rank only.
Some yielded tensors alias live parameters (TP=1 direct/column/row, replicated): the snapshot
store copies those before keeping them. Conversion tasks are planned once and reused.
"""

from __future__ import annotations

from typing import Iterator

import torch


class BridgeExportSource:
    """Re-iterable ``(hf_name, tensor)`` stream of ``model`` (a list of Megatron chunks)."""

    def __init__(self, bridge, model: list):
        self.bridge = bridge
        self.model = model
        self._tasks = None

    def tasks(self) -> list:
        """Bridge's conversion tasks, planned once (collective on first call)."""
        if self._tasks is None:
            self._tasks = self.bridge.get_conversion_tasks(self.model)
        return self._tasks

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.bridge.export_hf_weights(self.model, cpu=True, show_progress=False,
                                                 conversion_tasks=self.tasks())
