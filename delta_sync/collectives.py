"""The one place delta-sync issues collectives, and the check that keeps devices straight.

Two kinds of group, as vLLM keeps a device group and a ``cpu_group``:

* a **host group** (gloo): sizes, failure flags, headers and Python objects, as CPU tensors;
* a **device group** (nccl on CUDA, hccl on Ascend, gloo on CPU): payloads, as tensors on the
  group's device. On a CPU trainer both are the same gloo group.

Every function here names the group it uses and checks each tensor against that group's backend
before the call: a host tensor handed to an NCCL/HCCL group, a device tensor handed to gloo, or a
float64 tensor anywhere (HCCL has no float64 all_reduce) raises :class:`DeviceMismatch` naming the
operation. Nothing else in ``delta_sync``, ``update_weight`` or ``patches`` calls
``torch.distributed`` collectives (a test reads the sources to keep it so), so the CPU suite catches
the host/device mistakes an accelerator would otherwise reveal at the first update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import DeltaSyncError

HOST_BACKENDS = ("gloo",)
#: the in-process channel (threads of one process): each rank copies into its own tensor, any device
ANY_DEVICE_BACKENDS = ("local",)


class DeviceMismatch(DeltaSyncError):
    """A tensor's device (or dtype) does not suit the group a collective runs on."""


def backend_of(group) -> str:
    """Backend name of a registered group (``None``: the default group) or of a raw process group."""
    if group is not None and not _registered(group):
        name = getattr(group, "name", None)
        return name() if callable(name) else str(name)
    return str(dist.get_backend(group))


def _registered(group) -> bool:
    try:
        dist.get_backend(group)
        return True
    except (ValueError, RuntimeError, AttributeError, TypeError):
        return False


def check(op: str, group, *tensors: torch.Tensor) -> None:
    """Raise :class:`DeviceMismatch` unless every tensor suits ``group``'s backend."""
    backend = backend_of(group)
    if ":" in backend:  # a mixed group ("cpu:gloo,cuda:nccl") routes each tensor by its device
        per = dict(part.split(":") for part in backend.split(","))
        for t in tensors:
            if t.device.type not in per:
                raise DeviceMismatch(f"{op} on {backend}: no backend for a tensor on {t.device}")
            check(op, _Named(per[t.device.type]), t)
        return
    host = backend in HOST_BACKENDS
    for t in tensors:
        if t.dtype == torch.float64:
            raise DeviceMismatch(f"{op} on {backend}: float64 tensor (HCCL has no float64 collectives; send "
                                 "float32/int64 or split the value)")
        if backend in ANY_DEVICE_BACKENDS:
            continue
        if host and t.device.type != "cpu":
            raise DeviceMismatch(f"{op} on host group ({backend}): tensor on {t.device}; metadata goes over the "
                                 "host group as CPU tensors, payloads over the device group")
        if not host and t.device.type == "cpu":
            raise DeviceMismatch(f"{op} on device group ({backend}): host tensor; {backend} takes tensors on "
                                 "the group's device (move it there, or send metadata over the host group)")


# ---- registered groups (the trainer's) ------------------------------------------------------------
def all_gather_into_tensor(out: torch.Tensor, t: torch.Tensor, group) -> None:
    check("all_gather_into_tensor", group, out, t)
    # torch 2.13 renamed it (the old name warns); older releases have only the old one
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    check("all_reduce", group, t)
    dist.all_reduce(t, op=op, group=group)


def all_agree(ok: bool, group) -> bool:
    """True on every rank of ``group`` (a host group) where ``ok`` on all of them; ``ok`` itself
    without an initialized world."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    all_reduce(flag, group, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def send(t: torch.Tensor, dst_group_rank: int, group) -> None:
    check("send", group, t)
    dist.send(t, global_rank(group, dst_group_rank), group=group)


def recv(t: torch.Tensor, src_group_rank: int, group) -> None:
    check("recv", group, t)
    dist.recv(t, global_rank(group, src_group_rank), group=group)


def all_gather_object(obj, group) -> list:
    """Every rank's ``obj`` (host group only: object collectives pickle into CPU tensors)."""
    _host_only("all_gather_object", group)
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src_group_rank: int, group):
    """``obj`` of group rank ``src_group_rank`` on every rank (host group only)."""
    _host_only("broadcast_object_list", group)
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, src_group_rank), group=group)
    return box[0]


def global_rank(group, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class _Named:
    """A stand-in group that only reports a backend name (one part of a mixed group)."""

    def __init__(self, backend: str):
        self._backend = backend

    def name(self) -> str:
        return self._backend


def _host_only(op: str, group) -> None:
    backend = backend_of(group)
    if backend not in HOST_BACKENDS and "cpu:gloo" not in backend:
        raise DeviceMismatch(f"{op} on {backend}: Python objects go over the host group (gloo)")


# ---- raw process groups (the sync channel) --------------------------------------------------------
def pg_broadcast_all(pg, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Broadcasts on a process group that is not registered with torch.distributed (the channel):
    one per tensor, in order, all issued before the first is awaited (gloo runs them on its worker
    threads, NCCL/HCCL queue them on one stream), so many mid-sized tensors keep the link as busy
    as one large one."""
    from torch.distributed import BroadcastOptions

    check("broadcast", pg, *tensors)
    works = []
    for t in tensors:
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        works.append(pg.broadcast([t], opts))
    for w in works:
        w.wait()


def pg_all_reduce_max(pg, t: torch.Tensor) -> None:
    """``t`` becomes its elementwise maximum over the ranks of a raw process group (the channel)."""
    from torch.distributed import AllreduceOptions

    check("all_reduce", pg, t)
    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX
    pg.allreduce([t], opts).wait()


def pg_abort(pg) -> bool:
    """Abort a raw process group so that collectives blocked in it raise (NCCL's ``abort``,
    HCCL's, or a ``shutdown``); False if it has none that worked."""
    for name in ("abort", "_abort", "shutdown"):
        fn = getattr(pg, name, None)
        if callable(fn):
            try:
                fn()
                return True
            except Exception:  # noqa: BLE001 - the next way may work; the caller logs if none did
                continue
    return False


# ---- the trainer's pair of groups -----------------------------------------------------------------
@dataclass(frozen=True)
class TrainerGroups:
    """The trainer's device group (payloads) and the host group made beside it (metadata)."""

    device_group: object
    host_group: object
    device: torch.device

    @property
    def rank(self) -> int:
        return dist.get_rank(self.device_group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.device_group)

    @classmethod
    def around(cls, group=None, device: torch.device | str | None = None) -> "TrainerGroups":
        """Groups for a trainer whose process group is ``group`` (``None``: the default one).

        A gloo group serves both roles on CPU. Otherwise a gloo group over the same ranks is
        created beside it; like every ``new_group``, every rank of the default group must call
        this, in the same order."""
        backend = backend_of(group)
        if backend in HOST_BACKENDS:
            return cls(group, group, torch.device("cpu"))
        if device is None:
            from . import accelerator

            family = next((f for f in ("npu", "cuda") if accelerator.backend_for(f) in backend), None)
            if family is None:
                raise DeviceMismatch(f"trainer group backend {backend!r}: no device family found")
            device = torch.device(family, accelerator.device_module(family).current_device())
        if "cpu:gloo" in backend:  # one mixed group already carries host tensors
            return cls(group, group, torch.device(device))
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        host = dist.new_group(ranks=ranks, backend="gloo")
        return cls(group, host, torch.device(device))
