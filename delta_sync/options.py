"""Every setting of a :class:`~delta_sync.sync.WeightSync`, in one object, validated once.

The launcher flags (slime's names, ``update_weight/args.py``) map one to one onto these fields, and
the fields keep their names down to the packer: ``--update-weight-buffer-size`` is
``bucket_bytes`` everywhere. A bad value is refused when the options are built, naming the field
and the flag that sets it, before any engine is contacted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .bucket import DEFAULT_BUCKET_BYTES, MIN_BUCKET_BYTES

#: the launcher flag that sets each field (named in its error)
FLAGS = {"mode": "--update-weight-mode", "bucket_bytes": "--update-weight-buffer-size",
         "verify_every": "--update-weight-verify-every", "host": "--update-weight-master-addr",
         "port": "--update-weight-master-port", "backend": "--update-weight-transport"}
MODES = ("delta", "full")
PAUSE_MODES = ("wait", "abort", "keep")


def env_seconds(env: Mapping[str, str], name: str, default: float | None, positive: bool = False) -> float | None:
    """The number of seconds variable ``name`` of ``env`` gives (``default`` where unset or blank);
    not a number, or below 0 (``positive``: not above 0), is a ValueError naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if not (value > 0 if positive else value >= 0):
        raise ValueError(f"{name}={raw!r} must be {'>' if positive else '>='} 0 seconds")
    return value


def is_int(x) -> bool:
    """An int that is not a bool (JSON and keyword arguments both deliver ``True`` where a count
    was meant)."""
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SyncOptions:
    """How a trainer syncs its engines (each field's doc says what it does)."""

    #: "delta": a full seed once, then only the changed elements; "full": every tensor every update
    mode: str = "delta"
    #: payload bound of one bucket (bytes): what a process holds per bucket in flight, and the size
    #: of a delta's gather rounds
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    #: compare every tensor's digest with the engines' after every K-th delta (0: never; seeds are
    #: always checked in flight)
    verify_every: int = 0
    #: every tensor's digest is compared with the engines' at least once per this many deltas (each
    #: delta checks a rotating window of ~1/drift_sweep of the bytes); 0 turns it off
    drift_sweep: int = 40
    #: where the trainer keeps its snapshot of what the engines hold
    snapshot_device: str | torch.device = "cpu"
    #: what the engines do with requests in flight while they pause: "wait" for them, "abort"
    #: them, or "keep" them frozen (their KV of the old weights is dropped)
    pause_mode: str = "wait"
    #: address of trainer rank 0 that engine workers dial for the channel (None: 127.0.0.1)
    host: str | None = None
    #: port of the channel's store on ``host`` (None: a free one)
    port: int | None = None
    #: the channel's collective backend ("nccl", "hccl", "gloo"; None: the device's)
    backend: str | None = None
    #: seconds a channel operation or engine call may take
    timeout_s: float = 300.0
    #: cast every tensor to this dtype before diffing (None: as given)
    dtype: torch.dtype | None = None

    def __post_init__(self):
        self._check(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)}")
        self._check(is_int(self.bucket_bytes) and self.bucket_bytes >= MIN_BUCKET_BYTES, "bucket_bytes",
                    f"must be at least {MIN_BUCKET_BYTES} bytes (a bucket carries at least one element and its "
                    "bookkeeping; the default is 512 MiB)")
        self._check(is_int(self.verify_every) and self.verify_every >= 0, "verify_every", "must be an integer >= 0")
        self._check(is_int(self.drift_sweep) and self.drift_sweep >= 0, "drift_sweep", "must be an integer >= 0")
        self._check(self.pause_mode in PAUSE_MODES, "pause_mode", f"must be one of {', '.join(PAUSE_MODES)}")
        self._check(self.host is None or (isinstance(self.host, str) and self.host), "host",
                    "must be a host name or address")
        self._check(self.port is None or (is_int(self.port) and 0 <= self.port < 65536), "port",
                    "must be 1-65535, or None / 0 for a free port")
        self._check(self.backend is None or isinstance(self.backend, str), "backend", "must be a backend name")
        self._check(isinstance(self.timeout_s, (int, float)) and not isinstance(self.timeout_s, bool)
                    and self.timeout_s > 0, "timeout_s", "must be a positive number of seconds")
        self._check(self.dtype is None or isinstance(self.dtype, torch.dtype), "dtype", "must be a torch.dtype")

    def _check(self, ok: bool, name: str, why: str) -> None:
        if not ok:
            flag = f" ({FLAGS[name]})" if name in FLAGS else ""
            raise ValueError(f"{name}{flag} = {getattr(self, name)!r} {why}")
