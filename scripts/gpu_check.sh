#!/usr/bin/env bash
# One-GPU check of the CUDA path (NCCL, bf16, TransformerEngine spec when installed, else the local spec),
# in under 8 minutes; prints a summary table and writes OUT/gpu_check.json.
#
#  1. bfpp train, P=1, V=2, --pipeline-schedule breadth-first --zero-stage 3, 20 iterations, against the same
#     model as one chunk under 1f1b with ZeRO-1 (at P=1 the order of Megatron's default schedule; the trainer's
#     initialisation does not depend on the layout, and dropout is off, so the losses must agree).
#     The same with --pipeline-schedule interleaved-zb (split backward: I now, W later; the deferred weight
#     GEMMs on CUDA, and a W after its stage's ZeRO-3 release) against the same reference.
#  2. Megatron-LM pretrain_gpt.py (a patched copy of MEGATRON_LM_DIR), P=1, --pipeline-schedule 1f1b
#     --zero-stage 3 (the plugin's runtime and sharded optimizer on CUDA; Megatron-LM's own argument checks refuse
#     virtual stages at P=1, so breadth-first needs P >= 2, i.e. two GPUs), against --pipeline-schedule default
#     (Megatron's own schedule and DDP, same model, same initial values). The same with --pipeline-schedule
#     zb-h1 --zero-stage 2 (split backward in Megatron-LM: with TransformerEngine >= 2.3 its layers are built with
#     delay_wgrad_compute and their weight GEMMs run at W, fused into main_grad as Megatron-LM's default does;
#     TransformerEngine binds main_grad at I, before ZeRO-2 gives the stage its gradient buffer at its first W).
#  3. Per-op forward/backward times of one 52B-shaped layer (h=8192, 64 heads, s=2048, T=1) against the
#     simulator's h200 profile.
#  4. Summary: losses against the reference (bf16 tolerance: relative 5e-3 at iteration 1, 2e-2 at every
#     iteration), step-time ratio, peak memory against the planner's prediction, the layer table.
#
# usage: scripts/gpu_check.sh [--dry-run] [--out DIR] [--iters N]
#   --dry-run   print the commands it would run and exit (no GPU, no Megatron-LM checkout needed)
#   --out DIR   output directory (default runs/gpu_check)
#   --iters N   training iterations per run (default 20)
# environment: MEGATRON_LM_DIR (Megatron-LM checkout, core_v0.19.0 or core_v0.16.1; copied, never modified),
#   GPU_CHECK_RUN_TIMEOUT (seconds per training run, default 100), PYTHON (default python)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
OUT="$ROOT/runs/gpu_check"
ITERS=20
PYTHON="${PYTHON:-python}"
RUN_TIMEOUT="${GPU_CHECK_RUN_TIMEOUT:-100}"
LAYER_TIMEOUT=90

die() { echo "gpu_check: error: $*" >&2; exit 2; }
usage() { sed -n '19,24p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT="$2"; shift ;;
    --iters) [ $# -ge 2 ] || die "--iters needs a number"; ITERS="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
case "$ITERS" in ''|*[!0-9]*) die "--iters must be a positive integer (got '$ITERS')" ;; esac

MLM_SRC="${MEGATRON_LM_DIR:-}"
if [ "$DRY_RUN" = 0 ]; then
  [ -n "$MLM_SRC" ] || die "set MEGATRON_LM_DIR to a Megatron-LM checkout"
  [ -f "$MLM_SRC/pretrain_gpt.py" ] || die "$MLM_SRC has no pretrain_gpt.py"
  command -v bfpp >/dev/null || die "bfpp not on PATH: activate the venv (README, quick start)"
  "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || die "no CUDA device visible to torch (use --dry-run on a machine without a GPU)"
  mkdir -p "$OUT"
fi
MLM_SRC="${MLM_SRC:-\$MEGATRON_LM_DIR}"
MLM="$OUT/megatron-lm"

if "$PYTHON" -c 'import transformer_engine.pytorch' >/dev/null 2>&1; then
  IMPL=transformer_engine
else
  IMPL=local
fi

# The model: 8 layers of h=2048 (about 0.6 B parameters with the untied output layer), s=2048, 8 micro-batches.
# Untied embeddings and learned positions: the planner's model. Dropout off: the losses are compared.
COMMON=(
  --num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
  --micro-batch-size 1 --global-batch-size 8 --train-iters "$ITERS"
  --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0
  --init-method-std 0.006 --hidden-dropout 0 --attention-dropout 0 --seed 1234 --bf16
  --untie-embeddings-and-output-weights --vocab-size 50257 --log-interval 1
  --pipeline-model-parallel-size 1
)
VIRTUAL=(--num-layers-per-virtual-pipeline-stage 4)   # V = 2 chunks at P = 1
BF=(--pipeline-schedule breadth-first --zero-stage 3)
ZB=(--pipeline-schedule interleaved-zb --zero-stage 3 --bfpp-weight-buffers 1)
MLM_FLAGS=(--mock-data --tokenizer-type NullTokenizer --transformer-impl "$IMPL" --eval-iters 0
  --eval-interval $((ITERS + 1)) --log-throughput --log-memory-interval 1)

declare -A STATUS=()
START=$SECONDS

step() { echo; echo "== $*"; }

# run NAME LIMIT CMD...: record the command (one argument per line) and its log; a failure does not stop the check.
run() {
  local name="$1" limit="$2" rc=0 t0=$SECONDS
  shift 2
  echo "+ $(printf '%q ' "$@")"
  [ "$DRY_RUN" = 1 ] && return 0
  printf '%s\n' "$@" >"$OUT/$name.cmd"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then STATUS[$name]=0; else STATUS[$name]="exit $rc"; fi
  echo "   $name: exit $rc after $((SECONDS - t0)) s, log $OUT/$name.log"
  [ "$rc" = 0 ] || tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
}

step "setup: layer spec $IMPL; Megatron-LM copied from $MLM_SRC to $MLM and patched"
# A copy without .git: the patch series is picked from megatron/core/package_info.py and applied with git apply.
copy_tree() { rm -rf "$2" && mkdir -p "$2" && tar -C "$1" --exclude=.git -cf - . | tar -C "$2" -xf -; }
echo "+ rm -rf $(printf '%q' "$MLM") && tar -C $(printf '%q' "$MLM_SRC") --exclude=.git -cf - . | tar -C $(printf '%q' "$MLM") -xf -"
echo "+ $(printf '%q ' "$ROOT/scripts/apply_megatron_patches.sh" --no-commit "$MLM")"
if [ "$DRY_RUN" = 0 ]; then
  copy_tree "$MLM_SRC" "$MLM"
  "$ROOT/scripts/apply_megatron_patches.sh" --no-commit "$MLM"
fi

step "1. bfpp train: breadth-first and interleaved-zb, ZeRO-3 (V=2), against 1f1b ZeRO-1 (V=1)"
run bfpp_bf "$RUN_TIMEOUT" bfpp train --nproc-per-node 1 "${COMMON[@]}" "${VIRTUAL[@]}" "${BF[@]}" --mock-data \
  --report-json "$OUT/bfpp_bf.json"
run bfpp_zb "$RUN_TIMEOUT" bfpp train --nproc-per-node 1 "${COMMON[@]}" "${VIRTUAL[@]}" "${ZB[@]}" --mock-data \
  --report-json "$OUT/bfpp_zb.json"
run bfpp_ref "$RUN_TIMEOUT" bfpp train --nproc-per-node 1 "${COMMON[@]}" --pipeline-schedule 1f1b --zero-stage 1 \
  --mock-data --report-json "$OUT/bfpp_ref.json"

# preflight NAME FLAGS...: Megatron-LM's argument validation plus the plugin's checks, without a GPU, so a
# rejected combination costs seconds, not a training launch; its message goes to NAME.log.
preflight() {
  local name="$1" rc=0
  shift
  local cmd=(env "PYTHONPATH=$MLM${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron_bfpp.megatron.check
    --world-size 1 -- "$@")
  echo "+ $(printf '%q ' "${cmd[@]}")"
  [ "$DRY_RUN" = 1 ] && return 0
  printf '%s\n' pretrain_gpt.py "$@" >"$OUT/$name.cmd"
  (cd "$MLM" && "${cmd[@]}") >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    STATUS[$name]="rejected by the argument check"
    echo "   $name: not run, the arguments were rejected:"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
    return 1
  fi
}

step "2. Megatron-LM pretrain_gpt.py: the plugin's 1f1b with ZeRO-3 and zb-h1 against --pipeline-schedule default (P=1)"
export CUDA_DEVICE_MAX_CONNECTIONS=1
MLM_BF=("${COMMON[@]}" --pipeline-schedule 1f1b --zero-stage 3 "${MLM_FLAGS[@]}")
MLM_ZB=("${COMMON[@]}" --pipeline-schedule zb-h1 --zero-stage 2 "${MLM_FLAGS[@]}")
MLM_REF=("${COMMON[@]}" --pipeline-schedule default "${MLM_FLAGS[@]}")
if preflight megatron_bf "${MLM_BF[@]}"; then
  run megatron_bf "$RUN_TIMEOUT" torchrun --standalone --nproc-per-node 1 "$MLM/pretrain_gpt.py" "${MLM_BF[@]}"
fi
if preflight megatron_zb "${MLM_ZB[@]}"; then
  run megatron_zb "$RUN_TIMEOUT" torchrun --standalone --nproc-per-node 1 "$MLM/pretrain_gpt.py" "${MLM_ZB[@]}"
fi
if preflight megatron_ref "${MLM_REF[@]}"; then
  run megatron_ref "$RUN_TIMEOUT" torchrun --standalone --nproc-per-node 1 "$MLM/pretrain_gpt.py" "${MLM_REF[@]}"
fi

step "3. one gpt-52b layer against the simulator's h200 profile"
run layer "$LAYER_TIMEOUT" "$PYTHON" "$ROOT/scripts/gpu_check.py" layer --model gpt-52b --hardware h200 \
  --json "$OUT/layer.json"

step "4. summary"
summary=("$PYTHON" "$ROOT/scripts/gpu_check.py" summary --out "$OUT" --hardware h200
  --pair bfpp_bf=bfpp_ref --pair bfpp_zb=bfpp_ref --pair megatron_bf=megatron_ref --pair megatron_zb=megatron_ref)
echo "+ $(printf '%q ' "${summary[@]}")"
if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: nothing was run"
  exit 0
fi
rc=0
"${summary[@]}" || rc=$?
failed=()
for name in "${!STATUS[@]}"; do
  [ "${STATUS[$name]}" = 0 ] || failed+=("$name (${STATUS[$name]})")
done
echo "gpu_check: $((SECONDS - START)) s in all"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed runs: ${failed[*]}"
  rc=1
fi
exit "$rc"
