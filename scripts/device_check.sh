#!/usr/bin/env bash
# Device kit: the one command run on a borrowed GPU machine (one GPU, python 3.12 with torch, no package index).
# The logic is in megatron_bfpp/devkit/ (legs, budget, report: plan.py; install and run: run.py; kit: prepare.py).
#
# usage: scripts/device_check.sh --prepare [--megatron-lm DIR] [--max-mib N]
#        scripts/device_check.sh [--quick] [--device cuda|cpu] [--out DIR] [--budget S] [--dry-run] [--legs A,B]
#        scripts/device_check.sh --rehearse PYTHON [--out DIR] [--budget S]
#   --prepare   (a machine with the registry) build devkit/kit: megatron-core, numpy and packaging wheels for
#               CPython 3.12 manylinux x86_64, this project's wheel, a Megatron-LM source tarball (at most 40 MiB);
#               prints the carry list
#   (default)   (the GPU machine) probe the machine first (Python, the GPU's compute mode, CUDA and NCCL usable:
#               --device cuda fails at once, with torch's facts, when they are not), install the kit offline next to
#               the python's torch, run the legs within --budget seconds (default 480), write
#               DIR/device_report.json (rewritten before and after every leg: a killed command still returns what
#               ran) and the legs' logs (written as the legs print; 8 files at most; default DIR $OUT when set,
#               else runs/device_check); exit 0 when every leg passed, 1 when one failed, 3 when one was refused
#               by NCCL's set-up, did not fit the budget or the run was stopped
#   --quick     the first call on a machine lent for a short time: the most revealing legs within 240 s (the
#               default budget then); also the plan when --budget is under the full plan's estimate
#   --dry-run   print the legs with their estimated seconds and the total against the budget
#   --device    cpu: the same legs on CPU/gloo with tiny models (a rehearsal of everything but the GPU)
#   --rehearse PYTHON  --prepare (with this shell's python), then the CPU run under PYTHON (an environment that has
#               torch) with no package index reachable; exit non-zero unless every leg passes (the
#               TransformerEngine legs, not run without it, excepted); report in runs/device_rehearsal; budget
#               REHEARSE_BUDGET (default 900 s: about 4-6 minutes on 2 cores, more on a loaded machine)
# environment: PYTHON (the python with torch; default python3), MEGATRON_LM_DIR (for --prepare; default
#   ../shared/megatron-lm/core_v0.19.0), OUT (the default output folder)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
cd "$ROOT"
export PYTHONPATH="$ROOT"   # the kit's own modules, before anything is installed

usage() { sed -n '/^# usage:/,/^#   \.\.\/shared/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

case "${1:-}" in
  -h|--help) usage; exit 0 ;;
  --prepare) shift; exec "$PYTHON" -m megatron_bfpp.devkit.prepare "$@" ;;
  --rehearse)
    [ $# -ge 2 ] || { echo "device_check: error: --rehearse needs the python of an environment with torch" >&2; exit 2; }
    TARGET="$2"; shift 2
    "$PYTHON" -m megatron_bfpp.devkit.prepare
    # No registry: pip may use nothing but the kit, and any network attempt fails at once.
    exec env PIP_NO_INDEX=1 PIP_FIND_LINKS="" PIP_CONFIG_FILE=/dev/null http_proxy=http://127.0.0.1:9 \
      https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9 HTTPS_PROXY=http://127.0.0.1:9 PYTHONNOUSERSITE=1 \
      "$TARGET" -m megatron_bfpp.devkit.run --device cpu --python "$TARGET" --out "$ROOT/runs/device_rehearsal" \
      --budget "${REHEARSE_BUDGET:-900}" "$@" ;;
  *) exec "$PYTHON" -m megatron_bfpp.devkit.run --python "$PYTHON" "$@" ;;
esac
