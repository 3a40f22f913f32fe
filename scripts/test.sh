#!/usr/bin/env bash
# The test command: the whole suite, failing on "no tests ran" (pytest exit code 5); skip reasons and the 15
# slowest tests are printed.
#   scripts/test.sh          every tier (what .ci/run runs)
#   scripts/test.sh --fast   the unit tier only: no process started (tests/conftest.py sets the tiers)
#   scripts/test.sh --floor  the torch-floor selection (FLOOR_TESTS below: runtime, sharded optimizer, split
#                            backward, schedules, one pretrain_gpt.py breadth-first ZeRO-3 run), which .ci/run
#                            runs in the venv holding pyproject's lowest torch (requirements-floor.txt)
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
FLOOR_TESTS=(
  tests/unit/test_torch_floor.py
  tests/distributed/test_install_keeps_torch.py
  tests/unit/test_schedule.py
  tests/unit/test_split_autograd.py
  tests/distributed/test_runtime.py
  tests/distributed/test_sharded.py
  tests/distributed/test_zero_bubble.py
  tests/distributed/test_megatron_ddp.py
  "tests/megatron_lm/test_pretrain_gpt.py::test_breadth_first_matches_stock[bf-zero3]"
)
SELECT=()
if [ "${1:-}" = "--fast" ]; then
  shift
  SELECT=(-m unit)
elif [ "${1:-}" = "--floor" ]; then
  shift
  SELECT=("${FLOOR_TESTS[@]}")
fi
echo "MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-<unset: the Megatron-LM checkout tests skip>}"
# No path given: pyproject.toml's testpaths (tests/).
python -m pytest -q -rs --durations=15 "${SELECT[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: no tests ran" >&2; exit 1; fi
exit "$rc"
