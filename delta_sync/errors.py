"""Typed errors. Each says what was wrong and what was kept."""

from __future__ import annotations


class DeltaSyncError(RuntimeError):
    """Base class. ``kept`` names the state that survived the failure (e.g. "engine on v3")."""

    def __init__(self, message: str, *, kept: str | None = None):
        self.kept = kept
        super().__init__(f"{message}; kept: {kept}" if kept else message)


def with_kept(error: BaseException, kept: str) -> BaseException:
    """``error``, saying what was kept if it does not yet (errors raised deep in a pipeline know what
    went wrong; the caller that settles the update knows what survived)."""
    if isinstance(error, DeltaSyncError) and error.kept is None:
        error.kept = kept
        error.args = (f"{error.args[0]}; kept: {kept}",) + error.args[1:]
    return error


class PatchValidationError(DeltaSyncError):
    """A patch is malformed: name, dtype, shape, bounds, order, duplicates, non-finite values."""

    def __init__(self, name: str, reason: str, *, index: int | None = None, kept: str | None = None):
        self.name = name
        self.reason = reason
        self.index = index
        where = f" at position {index}" if index is not None else ""
        super().__init__(f"patch for {name!r}{where}: {reason}", kept=kept)


class ChecksumMismatch(DeltaSyncError):
    """A bucket's payload does not match the checksum in its header."""


class GatherError(DeltaSyncError):
    """A rank failed during prepare/gather; raised identically on every rank."""

    def __init__(self, failures: dict[int, str], *, kept: str | None = None):
        self.failures = dict(failures)
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(self.failures.items()))
        super().__init__(f"update failed on {len(self.failures)} rank(s): {detail}", kept=kept)


class ChannelError(DeltaSyncError):
    """Rendezvous, authentication or transfer on the sync channel failed."""


class LayoutNotSupported(DeltaSyncError):
    """The engine's runtime layout differs from checkpoint layout; in-place patching would write garbage."""


class NeedsSeed(DeltaSyncError):
    """The receiver has no valid base version (fresh, restarted, or a failed seed): send a full seed."""


class EngineClaimed(DeltaSyncError):
    """Another trainer holds this engine (it synced it recently and did not close): refused."""


class UpdateInFlight(DeltaSyncError):
    """``update`` was called while another update of the same sync was still running."""


class EngineError(DeltaSyncError):
    """An engine rejected or failed an update; carries the engine's own message."""

    def __init__(self, engine: str, message: str, *, kind: str | None = None, kept: str | None = None):
        self.engine = engine
        self.kind = kind
        self.engine_message = message
        super().__init__(f"engine {engine}: {kind + ': ' if kind else ''}{message}", kept=kept)


class DeviceNotAvailable(DeltaSyncError):
    """A device family was requested that this process cannot use (e.g. NPU without torch_npu)."""
