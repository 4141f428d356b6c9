"""delta-sync: exact delta weight sync from RL trainers into inference engines.

The core library: tensors, ranks and collectives only (no vLLM, no Megatron imports).
"""

from .errors import (ChannelError, ChecksumMismatch, DeltaSyncError, EngineError, GatherError,
                     LayoutNotSupported, NeedsSeed, PatchValidationError)
from .patch import Patch

__all__ = ["WeightSync", "UpdateReport", "FlatWeights", "Patch", "DeltaSyncError", "PatchValidationError", "ChecksumMismatch",
           "GatherError", "ChannelError", "LayoutNotSupported", "NeedsSeed", "EngineError"]


def __getattr__(name):  # WeightSync pulls in torch.distributed; import it on first use
    if name in ("WeightSync", "UpdateReport"):
        from . import sync

        return getattr(sync, name)
    if name == "FlatWeights":
        from .flat import FlatWeights

        return FlatWeights
    raise AttributeError(name)
