#!/usr/bin/env bash
# The main job: install (cached venv) and print a breadth-first schedule.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=/dev/null
source "$ROOT/scripts/venv.sh"
bfpp_venv
exec bfpp schedule --schedule breadth-first --pp 2 --vp 2 --microbatches 4 --zero-stage 3 "$@"
