#!/usr/bin/env bash
# The test command: the whole suite, failing on "no tests ran" (pytest exit code 5).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
python -m pytest -q "$@" tests
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: no tests ran" >&2; exit 1; fi
exit "$rc"
