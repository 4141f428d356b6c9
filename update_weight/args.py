"""``--update-weight-*`` launcher flags and their validation (contradictions fail at start)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from delta_sync import accelerator
from delta_sync.bucket import DEFAULT_BUCKET_BYTES
from delta_sync.options import SyncOptions

TRANSPORTS = ("hccl", "sparse_hccl", "nccl", "sparse_nccl", "gloo", "sparse_gloo")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def transport_for(mode: str, backend: str) -> str:
    """The transport name of ``mode`` over ``backend``: ``sparse_<backend>`` for a delta."""
    return ("sparse_" if mode == "delta" else "") + backend


@dataclass(frozen=True)
class UpdateWeightConfig:
    """The launcher's choice of transport and the sync options its flags set (validated once)."""

    transport: str  # --update-weight-transport, resolved
    options: SyncOptions  # mode, bucket_bytes, verify_every, host, port, backend

    @classmethod
    def of(cls, mode: str, backend: str = "gloo", **options) -> "UpdateWeightConfig":
        """The config for ``mode`` over ``backend`` (its sparse transport for a delta)."""
        return cls(transport_for(mode, backend), SyncOptions(mode=mode, backend=backend, **options))

    @classmethod
    def from_dict(cls, d: dict) -> "UpdateWeightConfig":
        """Back from ``dataclasses.asdict`` (a launcher hands the config to its rank processes)."""
        return cls(d["transport"], SyncOptions(**d["options"]))

    @property
    def mode(self) -> str:
        return self.options.mode

    @property
    def backend(self) -> str:
        return self.options.backend


def parse_size(text: str | int) -> int:
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"--update-weight-buffer-size {text!r}: use bytes or e.g. 512MiB, 1GiB")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def add_update_weight_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("weight sync")
    g.add_argument("--update-weight-mode", choices=("full", "delta"), default="delta",
                   help="delta: full seed once, then only changed elements; full: every tensor every step")
    g.add_argument("--update-weight-transport", choices=TRANSPORTS, default=None,
                   help="sparse_* transports carry deltas, plain names full broadcasts; the backend is the "
                        "suffix (hccl on Ascend, nccl on CUDA, gloo on CPU). Default: sparse_/plain + this "
                        "machine's backend")
    g.add_argument("--update-weight-buffer-size", type=parse_size, default=DEFAULT_BUCKET_BYTES,
                   help="bucket payload bound, bytes or with a unit (default 512MiB)")
    g.add_argument("--update-weight-verify-every", type=int, default=0,
                   help="compare engine and trainer digests every K versions (seeds always); 0 = seeds only")
    g.add_argument("--update-weight-master-addr", default="127.0.0.1",
                   help="address of trainer rank 0 (the sender) that engine workers dial for the channel "
                        "rendezvous; set it to a routable address when engines run on other hosts")
    g.add_argument("--update-weight-master-port", type=int, default=0,
                   help="port of the channel rendezvous on that address (0: a free port)")
    return parser


def resolve_update_weight_args(args) -> UpdateWeightConfig:
    """Validate the flags against each other and this machine; the error says what to use instead."""
    mode = args.update_weight_mode
    transport = args.update_weight_transport
    here = accelerator.backend_for(accelerator.detect_family())
    if transport is None:
        transport = transport_for(mode, here)
    if transport not in TRANSPORTS:
        raise SystemExit(f"--update-weight-transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    sparse = transport.startswith("sparse_")
    backend = transport.removeprefix("sparse_")
    if mode == "delta" and not sparse:
        raise SystemExit(f"--update-weight-mode delta needs a sparse transport: use "
                         f"--update-weight-transport sparse_{backend} (or --update-weight-mode full)")
    if mode == "full" and sparse:
        raise SystemExit(f"--update-weight-mode full broadcasts dense tensors: use --update-weight-transport "
                         f"{backend} (or --update-weight-mode delta)")
    family = accelerator.family_for_backend(backend)
    if not accelerator.family_available(family):
        raise SystemExit(f"--update-weight-transport {transport} needs {family.upper()} devices, which this "
                         f"machine does not have: use {'sparse_' if sparse else ''}{here}")
    addr = getattr(args, "update_weight_master_addr", "127.0.0.1")
    port = getattr(args, "update_weight_master_port", 0)
    try:
        options = SyncOptions(mode=mode, bucket_bytes=parse_size(args.update_weight_buffer_size),
                              verify_every=args.update_weight_verify_every, host=addr, port=port or None,
                              backend=backend)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return UpdateWeightConfig(transport, options)
