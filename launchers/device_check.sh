#!/usr/bin/env bash
# One short device check (one GPU or NPU, PyTorch; no vLLM or Megatron needed): the library's
# trainer- and receiver-side paths on device tensors, compared bit for bit with the host, and the
# device diff against the device's copy bandwidth. Prints one JSON line; exit 1 if a check failed.
#   bash launchers/device_check.sh [--device cuda|npu] [--bench-gib 2]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[[ -x .venv/bin/python ]] && py=.venv/bin/python
exec timeout 480 "$py" -m launchers.device_check "$@"
