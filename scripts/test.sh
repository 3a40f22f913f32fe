#!/usr/bin/env bash
# The test command: the whole suite, failing on "no tests ran" (pytest exit code 5); skip reasons and the 15
# slowest tests are printed.
#   scripts/test.sh          every tier (what .ci/run runs)
#   scripts/test.sh --fast   the unit tier only: no process started (tests/conftest.py sets the tiers)
# Further arguments go to pytest. MEGATRON_LM_DIR (a Megatron-LM checkout for the patch, script runner and
# pretrain_gpt.py tests) defaults to ../shared/megatron-lm/core_v0.19.0 next to the repository when it exists.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
if [ -z "${MEGATRON_LM_DIR:-}" ] && [ -f "$ROOT/../shared/megatron-lm/core_v0.19.0/pretrain_gpt.py" ]; then
  MEGATRON_LM_DIR="$(cd "$ROOT/../shared/megatron-lm/core_v0.19.0" && pwd)"
  export MEGATRON_LM_DIR
fi
# Bytecode written once to a cache outside the clone, read by every later process (tests/conftest.py).
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX="${PYTHONPYCACHEPREFIX:-${BFPP_VENV_CACHE:-$HOME/.cache/megatron_bfpp}/pycache}"
SELECT=()
if [ "${1:-}" = "--fast" ]; then
  shift
  SELECT=(-m unit)
fi
echo "MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-<unset: the Megatron-LM checkout tests skip>}"
# No path given: pyproject.toml's testpaths (tests/).
python -m pytest -q -rs --durations=15 "${SELECT[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: no tests ran" >&2; exit 1; fi
exit "$rc"
