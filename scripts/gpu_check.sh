#!/usr/bin/env bash
# GPU check of the CUDA path (NCCL, bf16, TransformerEngine spec when installed, else the local spec) on every GPU
# of this machine (`nvidia-smi -L`); prints a summary table and writes OUT/gpu_check.json.
#
# Legs (each against its reference; bf16 loss tolerance: relative 5e-3 at iteration 1, 2e-2 at every iteration):
#  multi-rank (the NCCL p2p between pipeline ranks, consecutive W's, data-parallel collectives), shape from the
#  GPU count G: G >= 8: P=4, D=2 (8 ranks); 4 <= G < 8: P=4, D=1; G = 2 or 3: P=G, D=1; G = 1: P=2, D=1 with the
#  two ranks sharing the GPU (scripts/shared_gpu_rank.sh: NCCL refuses two ranks of one communicator on one
#  device, so each rank is its own NCCL host and they talk over sockets: NCCL's code paths, not its transports).
#  Always V=2, M=2P micro-batches per data-parallel rank, 2P layers of h=1024, s=1024.
#   - Megatron-LM pretrain_gpt.py breadth-first --zero-stage 3, and breadth-first-zb with Megatron's own DDP
#     (--overlap-grad-reduce; consecutive W's on one chunk), against --pipeline-schedule default (Megatron's
#     interleaved 1F1B, same P, V, D).
#   - bfpp train breadth-first --zero-stage 3 and breadth-first-zb --zero-stage 2, against bfpp train on one GPU
#     (P=1, 1f1b, ZeRO-1, same model and batch).
#  one-GPU (P=1, D=1; 8 layers of h=2048, s=2048, 8 micro-batches; no p2p, no data-parallel collectives, no
#  consecutive W's):
#   - Megatron-LM pretrain_gpt.py 1f1b --zero-stage 3 and zb-h1 --zero-stage 2 (TransformerEngine's delayed
#     weight gradients where installed) against --pipeline-schedule default.
#   - bfpp train breadth-first and interleaved-zb (V=2) with --zero-stage 3 against 1f1b ZeRO-1 (V=1).
#  layer: per-op times of one gpt-52b layer against the simulator's h200 profile.
#
# Running time: at most --budget seconds (default 540) from start to summary. Each run is killed at its own
# timeout or at what the budget has left, whichever comes first; a leg that no longer fits is reported as not run
# and the check exits 3 (1 when a run failed or its losses differ).
#
# Apex: without its fused_weight_gradient_mlp_cuda, Megatron-LM's default gradient-accumulation fusion fails in
# the output layer (ColumnParallelLinear), so the Megatron-LM legs then pass --no-gradient-accumulation-fusion
# (TransformerEngine then delays weight gradients only from 2.7: the plugin says so at start-up).
#
# usage: scripts/gpu_check.sh [--dry-run] [--out DIR] [--iters N] [--gpus N] [--budget S] [--legs LIST]
#   --dry-run   print the legs and commands this machine would run, and exit (no GPU, no Megatron-LM needed)
#   --out DIR   output directory (default runs/gpu_check)
#   --iters N   training iterations per run (default 20)
#   --gpus N    GPUs to use (default: GPU_CHECK_GPUS, else `nvidia-smi -L`; a dry run without either assumes 1)
#   --budget S  seconds for the whole check (default 540)
#   --legs LIST comma-separated groups to run: multi,one-gpu,layer (default all three)
# environment: MEGATRON_LM_DIR (Megatron-LM checkout, core_v0.19.0 or core_v0.16.1; copied, never modified),
#   GPU_CHECK_RUN_TIMEOUT (seconds per training run, default 100), GPU_CHECK_GPUS, PYTHON (default python)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY_RUN=0
OUT="$ROOT/runs/gpu_check"
ITERS=20
GPUS="${GPU_CHECK_GPUS:-}"
BUDGET=540
LEGS="multi,one-gpu,layer"
PYTHON="${PYTHON:-python}"
RUN_TIMEOUT="${GPU_CHECK_RUN_TIMEOUT:-100}"
PREFLIGHT_TIMEOUT=60
LAYER_TIMEOUT=90
SUMMARY_RESERVE=20   # seconds kept for the summary
MIN_RUN=30           # a run given less than this would only time out: reported as not run

die() { echo "gpu_check: error: $*" >&2; exit 2; }
usage() { sed -n '/^# usage:/,/^#   GPU_CHECK_RUN_TIMEOUT/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
positive() { case "$2" in ''|*[!0-9]*|0) die "$1 must be a positive integer (got '$2')" ;; esac; }

while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) [ $# -ge 2 ] || die "--out needs a directory"; OUT="$2"; shift ;;
    --iters) [ $# -ge 2 ] || die "--iters needs a number"; ITERS="$2"; shift ;;
    --gpus) [ $# -ge 2 ] || die "--gpus needs a number"; GPUS="$2"; shift ;;
    --budget) [ $# -ge 2 ] || die "--budget needs a number of seconds"; BUDGET="$2"; shift ;;
    --legs) [ $# -ge 2 ] || die "--legs needs a list"; LEGS="$2"; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
  shift
done
positive --iters "$ITERS"
positive --budget "$BUDGET"
for group in ${LEGS//,/ }; do
  case "$group" in multi|one-gpu|layer) ;; *) die "--legs: unknown group '$group' (multi, one-gpu, layer)" ;; esac
done
wants() { case ",$LEGS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

if [ -z "$GPUS" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    GPUS="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
  fi
  if [ -z "$GPUS" ] || [ "$GPUS" = 0 ]; then
    [ "$DRY_RUN" = 1 ] || die "no GPU listed by nvidia-smi -L (use --dry-run on a machine without a GPU)"
    GPUS=1
    echo "gpu_check: no GPU found: the dry run shows a one-GPU machine (--gpus N for another)"
  fi
fi
positive --gpus "$GPUS"

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

# TransformerEngine's version and whether apex's fused weight-gradient kernel imports (scripts/gpu_check.py probe).
TE_VERSION=""
APEX_WGRAD=0
while IFS='=' read -r key value; do
  case "$key" in
    te_version) TE_VERSION="$value" ;;
    apex_fused_wgrad) APEX_WGRAD="$value" ;;
  esac
done < <("$PYTHON" "$ROOT/scripts/gpu_check.py" probe 2>/dev/null || true)
IMPL=local
[ -n "$TE_VERSION" ] && IMPL=transformer_engine
GRAD_FUSION=()
[ "$APEX_WGRAD" = 1 ] || GRAD_FUSION=(--no-gradient-accumulation-fusion)

# Multi-rank shape from the GPU count (see the header).
SHARED=0
if [ "$GPUS" -ge 8 ]; then MP=4 MD=2
elif [ "$GPUS" -ge 4 ]; then MP=4 MD=1
elif [ "$GPUS" -ge 2 ]; then MP="$GPUS" MD=1
else MP=2 MD=1 SHARED=1
fi
MW=$((MP * MD))
MM=$((2 * MP))

# One-GPU model: 8 layers of h=2048 (about 0.6 B parameters with the untied output layer), s=2048, 8 micro-batches.
# Untied embeddings and learned positions: the planner's model. Dropout off: the losses are compared.
TRAIN=(--micro-batch-size 1 --train-iters "$ITERS" --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine
  --lr-warmup-iters 2 --weight-decay 0.1 --clip-grad 1.0 --init-method-std 0.006 --hidden-dropout 0
  --attention-dropout 0 --seed 1234 --bf16 --untie-embeddings-and-output-weights --vocab-size 50257 --log-interval 1)
COMMON=(--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
  --global-batch-size 8 "${TRAIN[@]}" --pipeline-model-parallel-size 1)
# Multi-rank model: 2P layers of h=1024, s=1024, one layer per virtual stage (V = 2), M = 2P per data-parallel rank.
SMALL=(--num-layers $((2 * MP)) --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
  --max-position-embeddings 1024 --global-batch-size $((MM * MD)) "${TRAIN[@]}")
MULTI=("${SMALL[@]}" --pipeline-model-parallel-size "$MP" --num-layers-per-virtual-pipeline-stage 1)
VIRTUAL=(--num-layers-per-virtual-pipeline-stage 4)   # V = 2 chunks at P = 1
MLM_FLAGS=(--mock-data --tokenizer-type NullTokenizer --transformer-impl "$IMPL" "${GRAD_FUSION[@]}" --eval-iters 0
  --eval-interval $((ITERS + 1)) --log-throughput --log-memory-interval 1)

declare -A STATUS=()
NOT_RUN=()
PAIRS=()
START=$SECONDS

step() { echo; echo "== $*"; }

# left LIMIT: the seconds a run may take now (its limit, cut to what the budget has left; 0: it does not fit).
left() {
  local rest=$((BUDGET - (SECONDS - START) - SUMMARY_RESERVE))
  [ "$rest" -lt "$1" ] || rest="$1"
  [ "$rest" -ge "$MIN_RUN" ] || rest=0
  echo "$rest"
}

# run NAME LIMIT CMD...: record the command (one argument per line) and its log; a failure does not stop the check.
run() {
  local name="$1" limit="$2" rc=0 t0=$SECONDS
  shift 2
  echo "run $name:"
  echo "+ $(printf '%q ' "$@")"
  [ "$DRY_RUN" = 1 ] && return 0
  limit="$(left "$limit")"
  if [ "$limit" = 0 ]; then
    NOT_RUN+=("$name"); echo "   $name: not run, the check's --budget $BUDGET s is spent"; return 0
  fi
  printf '%s\n' "$@" >"$OUT/$name.cmd"
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then STATUS[$name]=0; else STATUS[$name]="exit $rc"; fi
  echo "   $name: exit $rc after $((SECONDS - t0)) s (limit $limit s), log $OUT/$name.log"
  [ "$rc" = 0 ] || tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
}

# preflight NAME WORLD FLAGS...: Megatron-LM's argument validation plus the plugin's checks, without a GPU, so a
# rejected combination costs seconds, not a training launch; its message goes to NAME.log.
preflight() {
  local name="$1" world="$2" rc=0 limit
  shift 2
  local cmd=(env "PYTHONPATH=$MLM${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m megatron_bfpp.megatron.check
    --world-size "$world" -- "$@")
  echo "check $name:"
  echo "+ $(printf '%q ' "${cmd[@]}")"
  [ "$DRY_RUN" = 1 ] && return 0
  limit="$(left "$PREFLIGHT_TIMEOUT")"
  if [ "$limit" = 0 ]; then
    NOT_RUN+=("$name"); echo "   $name: not run, the check's --budget $BUDGET s is spent"; return 1
  fi
  printf '%s\n' pretrain_gpt.py "$@" >"$OUT/$name.cmd"
  (cd "$MLM" && timeout "$limit" "${cmd[@]}") >"$OUT/$name.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    STATUS[$name]="rejected by the argument check"
    echo "   $name: not run, the arguments were rejected:"
    tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
    return 1
  fi
}

# launch N: torchrun for N processes on this node; with SHARED=1 each runs through scripts/shared_gpu_rank.sh.
launch() {
  LAUNCH=(torchrun --standalone --nproc-per-node "$1")
  if [ "$SHARED" = 1 ] && [ "$1" -gt 1 ]; then LAUNCH+=(--no-python "$ROOT/scripts/shared_gpu_rank.sh" "$PYTHON"); fi
}

# megatron_leg NAME WORLD FLAGS...: preflight, then pretrain_gpt.py on WORLD processes.
megatron_leg() {
  local name="$1" world="$2"
  shift 2
  launch "$world"
  if preflight "$name" "$world" "$@" "${MLM_FLAGS[@]}"; then
    run "$name" "$RUN_TIMEOUT" "${LAUNCH[@]}" "$MLM/pretrain_gpt.py" "$@" "${MLM_FLAGS[@]}"
  fi
}

# bfpp_leg NAME WORLD FLAGS...: the plugin's trainer on WORLD processes (bfpp train; torchrun when sharing a GPU).
bfpp_leg() {
  local name="$1" world="$2"
  shift 2
  if [ "$SHARED" = 1 ] && [ "$world" -gt 1 ]; then
    launch "$world"
    run "$name" "$RUN_TIMEOUT" "${LAUNCH[@]}" -m megatron_bfpp.train "$@" --mock-data --report-json "$OUT/$name.json"
  else
    run "$name" "$RUN_TIMEOUT" bfpp train --nproc-per-node "$world" "$@" --mock-data --report-json "$OUT/$name.json"
  fi
}

# leg NAME REFERENCE WHAT: print one line of the plan and pair the leg with its reference for the summary.
leg() {
  echo "leg $1: $3 (reference: $2)"
  PAIRS+=(--pair "$1=$2")
}

sharing=""
[ "$SHARED" = 1 ] && sharing=", 2 ranks sharing GPU 0 over NCCL sockets"
S=""
[ "$SHARED" = 1 ] && S="-1gpu"
SHAPE="P${MP}V2D${MD}"
MB="megatron-${SHAPE}${S}"
BB="bfpp-${SHAPE}${S}"
MBREF="megatron-${SHAPE}${S}-default"
BBREF="bfpp-P1-1f1b-zero1-small"
step "plan: $GPUS GPU(s); layer spec $IMPL${TE_VERSION:+ (TransformerEngine $TE_VERSION)}; apex fused weight" \
  "gradients $([ "$APEX_WGRAD" = 1 ] && echo present || echo "absent: --no-gradient-accumulation-fusion")"
if wants multi; then
  leg "$MB-breadth-first-zero3" "$MBREF" "Megatron-LM, $MW ranks (P=$MP V=2 D=$MD, M=$MM$sharing), breadth-first ZeRO-3"
  leg "$MB-breadth-first-zb-ddp" "$MBREF" \
    "Megatron-LM, $MW ranks (P=$MP V=2 D=$MD, M=$MM$sharing), breadth-first-zb with Megatron's DDP and --overlap-grad-reduce"
  leg "$BB-breadth-first-zero3" "$BBREF" "bfpp train, $MW ranks (P=$MP V=2 D=$MD, M=$MM$sharing), breadth-first ZeRO-3"
  leg "$BB-breadth-first-zb-zero2" "$BBREF" \
    "bfpp train, $MW ranks (P=$MP V=2 D=$MD, M=$MM$sharing), breadth-first-zb ZeRO-2"
fi
if wants one-gpu; then
  leg megatron-P1-1f1b-zero3 megatron-P1-default "Megatron-LM, 1 GPU, the plugin's 1f1b with ZeRO-3"
  leg megatron-P1-zb-h1-zero2 megatron-P1-default "Megatron-LM, 1 GPU, zb-h1 (split backward) with ZeRO-2"
  leg bfpp-P1V2-breadth-first-zero3 bfpp-P1-1f1b-zero1 "bfpp train, 1 GPU, breadth-first V=2 ZeRO-3"
  leg bfpp-P1V2-interleaved-zb-zero3 bfpp-P1-1f1b-zero1 \
    "bfpp train, 1 GPU, interleaved-zb V=2 ZeRO-3 with one weight buffer"
fi
wants layer && echo "leg layer-gpt-52b: per-op times of one gpt-52b layer (reference: the simulator's h200 profile)"
echo "budget: at most $BUDGET s in all; each run at most $RUN_TIMEOUT s (preflight $PREFLIGHT_TIMEOUT s, layer" \
  "$LAYER_TIMEOUT s)"

step "setup: Megatron-LM copied from $MLM_SRC to $MLM and patched"
# A copy without .git: the patch series is picked from megatron/core/package_info.py and applied with git apply.
copy_tree() { rm -rf "$2" && mkdir -p "$2" && tar -C "$1" --exclude=.git -cf - . | tar -C "$2" -xf -; }
echo "+ rm -rf $(printf '%q' "$MLM") && tar -C $(printf '%q' "$MLM_SRC") --exclude=.git -cf - . | tar -C $(printf '%q' "$MLM") -xf -"
echo "+ $(printf '%q ' "$ROOT/scripts/apply_megatron_patches.sh" --no-commit "$MLM")"
if [ "$DRY_RUN" = 0 ]; then
  copy_tree "$MLM_SRC" "$MLM"
  "$ROOT/scripts/apply_megatron_patches.sh" --no-commit "$MLM"
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1

if wants multi; then
  step "multi-rank: P=$MP V=2 D=$MD on $GPUS GPU(s)$sharing"
  megatron_leg "$MB-breadth-first-zero3" "$MW" "${MULTI[@]}" --pipeline-schedule breadth-first --zero-stage 3
  megatron_leg "$MB-breadth-first-zb-ddp" "$MW" "${MULTI[@]}" --pipeline-schedule breadth-first-zb \
    --overlap-grad-reduce
  megatron_leg "$MBREF" "$MW" "${MULTI[@]}" --pipeline-schedule default
  bfpp_leg "$BB-breadth-first-zero3" "$MW" "${MULTI[@]}" --pipeline-schedule breadth-first --zero-stage 3
  bfpp_leg "$BB-breadth-first-zb-zero2" "$MW" "${MULTI[@]}" --pipeline-schedule breadth-first-zb --zero-stage 2
  bfpp_leg "$BBREF" 1 "${SMALL[@]}" --pipeline-model-parallel-size 1 --pipeline-schedule 1f1b --zero-stage 1
fi

if wants one-gpu; then
  step "one GPU: P=1"
  megatron_leg megatron-P1-1f1b-zero3 1 "${COMMON[@]}" --pipeline-schedule 1f1b --zero-stage 3
  megatron_leg megatron-P1-zb-h1-zero2 1 "${COMMON[@]}" --pipeline-schedule zb-h1 --zero-stage 2
  megatron_leg megatron-P1-default 1 "${COMMON[@]}" --pipeline-schedule default
  bfpp_leg bfpp-P1V2-breadth-first-zero3 1 "${COMMON[@]}" "${VIRTUAL[@]}" --pipeline-schedule breadth-first \
    --zero-stage 3
  bfpp_leg bfpp-P1V2-interleaved-zb-zero3 1 "${COMMON[@]}" "${VIRTUAL[@]}" --pipeline-schedule interleaved-zb \
    --zero-stage 3 --bfpp-weight-buffers 1
  bfpp_leg bfpp-P1-1f1b-zero1 1 "${COMMON[@]}" --pipeline-schedule 1f1b --zero-stage 1
fi

if wants layer; then
  step "layer: one gpt-52b layer against the simulator's h200 profile"
  run layer-gpt-52b "$LAYER_TIMEOUT" "$PYTHON" "$ROOT/scripts/gpu_check.py" layer --model gpt-52b --hardware h200 \
    --json "$OUT/layer.json"
fi

step "summary"
summary=("$PYTHON" "$ROOT/scripts/gpu_check.py" summary --out "$OUT" --hardware h200 "${PAIRS[@]}")
echo "+ $(printf '%q ' "${summary[@]}")"
if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: nothing was run"
  exit 0
fi
for name in "${NOT_RUN[@]}"; do summary+=(--not-run "$name"); done
rc=0
"${summary[@]}" || rc=$?
failed=()
for name in "${!STATUS[@]}"; do
  [ "${STATUS[$name]}" = 0 ] || failed+=("$name (${STATUS[$name]})")
done
echo "gpu_check: $((SECONDS - START)) s in all (budget $BUDGET s)"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed runs: ${failed[*]}"
  rc=1
fi
if [ "$rc" = 0 ] && [ ${#NOT_RUN[@]} -gt 0 ]; then
  echo "gpu_check: incomplete, not run within the budget: ${NOT_RUN[*]} (raise --budget or choose --legs)"
  rc=3
fi
exit "$rc"
