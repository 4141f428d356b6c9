#!/usr/bin/env bash
# Resolves delta-sync's Ascend engine side together with vLLM-Ascend 0.23.0.post1's own pins, as pip
# would on an Ascend host (aarch64, Python 3.11), without installing anything:
#   bash launchers/check_ascend_install.sh        (prints pip's "Would install ..." line)
# vLLM-Ascend publishes only an sdist whose build needs CANN, so its Requires-Dist are read from the
# pinned sdist (launchers/fetch_releases.py) and resolved directly, wheels only. Two of them are left
# out and named: triton-ascend==3.2.2 (not on the public index: 3.2.0 is its newest) and
# arctic-inference==0.1.1 (an sdist, which a resolve for another platform cannot build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="$root/.venv/bin/python"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
archive="$("$py" -m launchers.fetch_releases --print-path vllm-ascend)"
tar -xzOf "$archive" vllm_ascend-0.23.0.post1/PKG-INFO | sed -n 's/^Requires-Dist: //p' \
  | grep -v -E '^(triton-ascend|arctic-inference)\b' > "$work/vllm-ascend.txt"
echo "[check] left out of vLLM-Ascend's pins: triton-ascend==3.2.2 (not published), arctic-inference==0.1.1 (sdist)" >&2
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work" . >/dev/null
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 linux; do
  platforms+=(--platform "${tag}_aarch64")
done
"$py" -m pip install --dry-run --ignore-installed --only-binary=:all: "${platforms[@]}" --python-version 3.11 \
  --implementation cp --target "$work/target" "$(ls "$work"/delta_sync-*.whl)[ascend-engine]" \
  -r "$work/vllm-ascend.txt" 2> >(grep -v "Location '.*' is ignored" >&2) | grep -E "^Would install"
