#!/usr/bin/env bash
# Sets up the environment if needed, then runs the whole test suite. Fails when no test ran.
# Extra arguments go to pytest (e.g. `-m "not slow"` to skip the slowest end-to-end tests locally).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launchers/setup.sh"
cd "$root"
set +e
.venv/bin/python -m pytest -q --durations=15 "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit $rc
