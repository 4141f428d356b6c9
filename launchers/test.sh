#!/usr/bin/env bash
# Sets up both environments if needed, lints (ruff), then runs the whole test suite in .venv (vLLM 0.32) and the
# engine-side tests (marker `receiver`) again in .venv-vllm023 (vLLM 0.23, what vLLM-Ascend
# 0.23.0.post1 builds on). Fails when either fails or collects no test. Extra arguments go to both
# pytest runs (e.g. `-m "not slow"` to skip the slowest end-to-end tests locally: the second run
# then selects `receiver and (not slow)`).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launchers/setup.sh"
cd "$root"
run() {  # $1: the venv; the rest: pytest arguments. Exit 5 (nothing collected) is a failure.
  local venv="$1" rc
  shift
  echo "[test] $venv: $("$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null)" >&2
  set +e
  "$venv/bin/python" -m pytest -q --durations=15 "$@"
  rc=$?
  set -e
  if [[ $rc -eq 5 && ( "$venv" == .venv || $# -eq 2 ) ]]; then  # the whole suite, or the whole receiver set
    echo "[test] $venv: no tests were collected: failing" >&2
    rc=1
  elif [[ $rc -eq 5 ]]; then
    echo "[test] $venv: none of the selected tests is a receiver test" >&2
    rc=0
  fi
  return $rc
}
rc=0
echo "[test] ruff (pyproject.toml: pyflakes, blind excepts, complexity)" >&2
.venv/bin/ruff check . || rc=$?
run .venv "$@" || rc=$?
second=() mark="receiver"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -m) [[ $# -gt 1 ]] && { mark="receiver and ($2)"; shift 2; continue; } ;;
    --markexpr=*) mark="receiver and (${1#--markexpr=})"; shift; continue ;;
    -m?*) mark="receiver and (${1#-m})"; shift; continue ;;
  esac
  second+=("$1")
  shift
done
run .venv-vllm023 -m "$mark" "${second[@]}" || rc=$?
exit $rc
