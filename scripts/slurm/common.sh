#!/usr/bin/env bash
# Shared body of the pretrain_*.sbatch scripts: multi-node `srun` + `torchrun` (c10d rendezvous) running
# Megatron-LM's pretrain_gpt.py with megatron_bfpp, NCCL/InfiniBand environment, checkpoint and log directories.
# Sourced by a batch script that sets MODEL_NAME, MODEL_ARGS, NNODES, TP, PP, LAYERS_PER_STAGE, MBS, GBS, then
# calls `bfpp_slurm_main "$@"`.
#
# Arguments:    --dry-run  print the environment, directories and the exact srun command; run nothing.
#               Any other argument is appended to Megatron's flags.
# Environment (all optional):
#   MEGATRON_LM_DIR   Megatron-LM checkout (default: $BFPP_ROOT/../Megatron-LM)
#   USE_PATCH=1       run the patched pretrain_gpt.py (scripts/apply_megatron_patches.sh) instead of the
#                     no-patch launcher `python -m megatron_bfpp.launch`
#   GPUS_PER_NODE TP PP LAYERS_PER_STAGE MBS GBS GROUP_SIZE SCHEDULE ZERO_STAGE TRAIN_ITERS
#   DATA_PATH VOCAB_FILE MERGE_FILE  (unset DATA_PATH: Megatron's mock data with a null tokenizer)
#   OUT_ROOT RUN_NAME CKPT_DIR LOG_DIR SAVE_INTERVAL MASTER_PORT TIMELINE=1 EXTRA_ARGS
#   NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_DEBUG ...  (passed through to every rank)

bfpp_die() { echo "error: $*" >&2; exit 1; }

bfpp_slurm_main() {
  local dry_run=0 arg
  local -a extra=()
  for arg in "$@"; do
    case "$arg" in
      --dry-run) dry_run=1 ;;
      *) extra+=("$arg") ;;
    esac
  done

  # SLURM copies batch scripts to a spool directory: locate the project from the submit directory.
  local root="${BFPP_ROOT:-}"
  if [ -z "$root" ]; then
    if [ -f "${SLURM_SUBMIT_DIR:-}/scripts/slurm/common.sh" ]; then root="$SLURM_SUBMIT_DIR"
    else root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"; fi
  fi
  local mlm="${MEGATRON_LM_DIR:-$root/../Megatron-LM}"
  local nnodes="${NNODES:?set NNODES}"
  local gpus="${GPUS_PER_NODE:-8}"
  local schedule="${SCHEDULE:-breadth-first}"
  local zero="${ZERO_STAGE-3}"
  local run="${RUN_NAME:-$MODEL_NAME-$schedule${zero:+-zero$zero}}"
  local out="${OUT_ROOT:-$root/runs}/$run"
  local ckpt="${CKPT_DIR:-$out/checkpoints}"
  local logs="${LOG_DIR:-$out/logs}"
  local master_addr master_port="${MASTER_PORT:-29500}"
  if [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
    master_addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
  else
    master_addr="${MASTER_ADDR:-$(hostname)}"
  fi

  local -a megatron=("${MODEL_ARGS[@]}"
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --num-layers-per-virtual-pipeline-stage "$LAYERS_PER_STAGE"
    --micro-batch-size "$MBS" --global-batch-size "$GBS"
    --pipeline-schedule "$schedule"
  )
  [ -n "$zero" ] && megatron+=(--zero-stage "$zero")
  [ -n "${GROUP_SIZE:-}" ] && megatron+=(--microbatch-group-size-per-virtual-pipeline-stage "$GROUP_SIZE")
  [ "${TIMELINE:-0}" = 1 ] && megatron+=(--timeline "$logs/timeline.json")
  megatron+=(
    --bf16 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006
    --train-iters "${TRAIN_ITERS:-500}" --eval-interval 1000 --eval-iters 10
    --save "$ckpt" --load "$ckpt" --save-interval "${SAVE_INTERVAL:-1000}"
    --log-interval 1 --log-throughput --log-memory-interval 10 --tensorboard-dir "$logs/tensorboard"
    --distributed-timeout-minutes 30
  )
  if [ -n "${DATA_PATH:-}" ]; then
    megatron+=(--data-path "$DATA_PATH" --split "949,50,1" --tokenizer-type GPT2BPETokenizer
      --vocab-file "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}" --merge-file "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}")
  else
    megatron+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
  fi
  if [ -n "${EXTRA_ARGS:-}" ]; then
    local -a env_extra
    read -r -a env_extra <<< "$EXTRA_ARGS"
    megatron+=("${env_extra[@]}")
  fi
  megatron+=("${extra[@]}")

  local -a entry
  if [ "${USE_PATCH:-0}" = 1 ]; then entry=("$mlm/pretrain_gpt.py")
  else entry=(-m megatron_bfpp.launch "$mlm/pretrain_gpt.py"); fi

  local -a cmd=(srun --nodes "$nnodes" --ntasks-per-node 1 --kill-on-bad-exit=1
    --output "$logs/%x-%j-node%n.log"
    torchrun --nnodes "$nnodes" --nproc-per-node "$gpus"
    --rdzv-id "${SLURM_JOB_ID:-bfpp}" --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
    "${entry[@]}" "${megatron[@]}")

  # Communication environment (every variable can be overridden from the submitting shell).
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron's TP/SP overlap ordering
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-4}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export PYTHONUNBUFFERED=1
  local -a envs=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG NCCL_IB_TIMEOUT
    NCCL_IB_QPS_PER_CONNECTION OMP_NUM_THREADS PYTHONUNBUFFERED)
  local v
  for v in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_NET_GDR_LEVEL; do
    if [ -n "${!v:-}" ]; then export "${v?}"; envs+=("$v"); fi
  done

  if [ "$dry_run" = 1 ]; then
    echo "# $MODEL_NAME on $nnodes node(s) x $gpus GPU(s): TP=$TP PP=$PP, $LAYERS_PER_STAGE layer(s) per virtual stage"
    for v in "${envs[@]}"; do printf 'export %s=%q\n' "$v" "${!v}"; done
    printf 'mkdir -p %q %q\n' "$ckpt" "$logs"
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi
  [ -n "${SLURM_JOB_ID:-}" ] || bfpp_die "not inside a SLURM job: submit with sbatch (or pass --dry-run)"
  [ -f "$mlm/pretrain_gpt.py" ] || bfpp_die "MEGATRON_LM_DIR=$mlm has no pretrain_gpt.py"
  mkdir -p "$ckpt" "$logs"
  cd "$mlm" || bfpp_die "cannot enter $mlm"
  "${cmd[@]}"
}
