"""The single place that knows device families and their collective backends.

Ascend NPUs (torch_npu, HCCL), CUDA GPUs (NCCL) and CPU (gloo). Nothing else in the project says
``cuda`` or ``npu``: it asks this module.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from .errors import DeviceNotAvailable

log = logging.getLogger(__name__)

BACKEND_OF = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
FAMILY_OF_BACKEND = {v: k for k, v in BACKEND_OF.items()}


@functools.cache
def _import_torch_npu() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return True


def family_available(family: str) -> bool:
    if family == "cpu":
        return True
    if family == "cuda":
        return torch.cuda.is_available()
    if family == "npu":
        return _import_torch_npu() and torch.npu.is_available()  # type: ignore[attr-defined]
    raise ValueError(f"unknown device family {family!r}; expected one of {sorted(BACKEND_OF)}")


def require_family(family: str) -> None:
    """Raise a message that names what is missing, instead of torch's bare device error."""
    if family_available(family):
        return
    if family == "npu" and not _import_torch_npu():
        raise DeviceNotAvailable(
            "NPU requested but torch_npu is not installed: install torch_npu + CANN "
            "(the `ascend` extra), or use a cuda/cpu transport (nccl/gloo)")
    raise DeviceNotAvailable(f"{family} requested but no {family} device is visible to this process")


def detect_family() -> str:
    """The best family present: npu, then cuda, then cpu.

    A driver that is installed but fails (``torch.npu.is_available()`` raising, a broken
    torch_npu) is an error, not "cpu": a silent CPU run looks healthy and is orders of magnitude slower."""
    for family in ("npu", "cuda"):
        try:
            if family_available(family):
                return family
        except Exception as e:
            raise DeviceNotAvailable(f"checking for {family} devices failed ({type(e).__name__}: {e}); fix the "
                                     f"driver install, or ask for the CPU explicitly (device 'cpu', backend "
                                     f"'gloo')") from e
    return "cpu"


def accelerated() -> bool:
    """This process has an accelerator (NPU or CUDA GPU): CPU-only shims must stay off."""
    return detect_family() != "cpu"


def backend_for(family: str) -> str:
    return BACKEND_OF[family]


def family_for_backend(backend: str) -> str:
    try:
        return FAMILY_OF_BACKEND[backend]
    except KeyError:
        raise ValueError(f"unknown collective backend {backend!r}; expected one of "
                         f"{sorted(FAMILY_OF_BACKEND)}") from None


@dataclass(frozen=True)
class Placement:
    """Where one process computes and communicates."""

    family: str
    device: torch.device
    backend: str

    def describe(self) -> str:
        return f"{self.device} via {self.backend}"


def bind(family: str | None = None, local_rank: int | None = None) -> Placement:
    """Bind this process to its device (LOCAL_RANK) before any process group is created.

    A fallback to CPU that was not asked for is refused: it looks healthy and is far slower.
    """
    family = family or detect_family()
    require_family(family)
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if family == "cpu":
        device = torch.device("cpu")
    else:
        mod = getattr(torch, family)
        mod.set_device(local_rank)
        device = torch.device(family, local_rank)
    placement = Placement(family, device, BACKEND_OF[family])
    log.info("delta-sync bound to %s (local rank %d)", placement.describe(), local_rank)
    return placement


def device_module(device: torch.device | str):
    device = torch.device(device)
    if device.type == "npu":
        _import_torch_npu()
    return getattr(torch, device.type, None)


def use_device(device: torch.device | str) -> None:
    """Make ``device`` the current one of the calling thread (a new thread starts on device 0);
    a no-op on CPU."""
    device = torch.device(device)
    if device.type != "cpu" and device.index is not None:
        device_module(device).set_device(device)


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device``; a no-op on CPU (torch.accelerator.synchronize raises there)."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cpu":
        return
    device_module(device).synchronize(device)


def read_back(tensors: list[torch.Tensor]) -> list[list]:
    """Each tensor's values, flattened, as a list: one host read per device for all of them (each
    read of a device tensor waits for the device), not one per tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[list] = [[] for _ in tensors]
    for members in by_device.values():
        flat, at = torch.cat([tensors[i].reshape(-1) for i in members]).tolist(), 0
        for i in members:
            out[i] = flat[at:at + tensors[i].numel()]
            at += tensors[i].numel()
    return out


class ReadBack:
    """Device values that host decisions wait for, read together: a bucket's checks and checksum
    each need a few numbers from the device, and each read would wait for it once. ``later``
    queues tensors and what to do with their values; :meth:`run` reads every queued tensor in one
    :func:`read_back` and calls each ``then`` in the order queued (one that raises stops the rest)."""

    def __init__(self):
        self._tensors: list[torch.Tensor] = []
        self._then: list[tuple[int, Callable[[list[list]], None]]] = []

    def later(self, tensors: list[torch.Tensor], then: Callable[[list[list]], None]) -> None:
        """``then(values)`` at :meth:`run`, ``values[k]`` the flattened values of ``tensors[k]``."""
        self._tensors += tensors
        self._then.append((len(tensors), then))

    def run(self) -> None:
        values, calls = read_back(self._tensors) if self._tensors else [], self._then
        self._tensors, self._then = [], []
        at = 0
        for n, then in calls:
            then(values[at:at + n])
            at += n


_PINNED = [True]  # until pinning host memory once failed in this process


def host_buffer(shape, dtype: torch.dtype) -> torch.Tensor:
    """Host memory for copies from and to a device: pinned (asynchronous copies, full link
    speed) where the device's runtime can pin it, else pageable (copies then wait)."""
    if _PINNED[0]:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except torch.OutOfMemoryError:  # no pinned memory left now: this buffer is pageable
            return torch.empty(shape, dtype=dtype)
        except RuntimeError as e:  # no allocator for pinned memory (a runtime without one)
            _PINNED[0] = False
            log.warning("delta-sync: host memory cannot be pinned here (%s); copies to and from the device "
                        "use pageable memory", e)
    return torch.empty(shape, dtype=dtype)


def to_host(t: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    """``t``'s copy in :func:`host_buffer` memory (``non_blocking``: queued behind the device's
    work, no wait; a later copy back on the same stream is ordered after it)."""
    return host_buffer(t.shape, t.dtype).copy_(t, non_blocking=non_blocking)


def memory_allocated(device: torch.device | str) -> int:
    device = torch.device(device)
    if device.type == "cpu":
        return 0
    return int(device_module(device).memory_allocated(device))


def make_process_group(backend: str, store, rank: int, world_size: int, timeout, device: torch.device,
                       bind: str | None = None):
    """A process group over ``store`` that is independent of torch.distributed's default group.

    The engine already has its own default group (vLLM TP); this one links the sender with every
    engine worker, so it is constructed directly and never registered globally. ``bind`` (gloo):
    the local address its connections listen on; by default gloo takes the address this host's
    name resolves to, which may be reachable from networks the channel's store was kept off.
    """
    from torch.distributed import distributed_c10d as c10d

    if backend == "gloo":
        if bind is None:
            pg = c10d.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            opts = c10d.ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [c10d.ProcessGroupGloo.create_device(hostname=bind)]
            pg = c10d.ProcessGroupGloo(store, rank, world_size, opts)
    elif backend == "nccl":
        opts = c10d.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = c10d.ProcessGroupNCCL(store, rank, world_size, opts)
    elif backend == "hccl":
        require_family("npu")
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL  # type: ignore

        opts = ProcessGroupHCCL.Options()
        opts._timeout = timeout
        pg = ProcessGroupHCCL(store, rank, world_size, opts)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return pg
