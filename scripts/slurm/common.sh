#!/usr/bin/env bash
# Shared body of the pretrain_*.sbatch scripts: multi-node `srun` + `torchrun` (c10d rendezvous) running
# Megatron-LM's pretrain_gpt.py with megatron_bfpp, NCCL/InfiniBand environment, checkpoints outside the
# checkout, preemption handling (SLURM warning signal -> Megatron saves and exits -> requeue).
# Sourced by a batch script that sets BFPP_ROOT (the project), BFPP_SCRIPT (its own real path), MODEL_NAME,
# MODEL_ARGS, NNODES, TP, PP, LAYERS_PER_STAGE, MBS, GBS, RECOMPUTE, then calls `bfpp_slurm_main "$@"`.
#
# Arguments:    --dry-run  print what will run (working directory, real script path, rendezvous, environment,
#               directories, the preflight and training commands) after running the project's flag
#               validation (python -m megatron_bfpp.megatron.check) here; start nothing.
#               --plan PLAN.json [--candidate K]  train a `bfpp plan --json` candidate (K 1-based, default 1):
#               its megatron_base_args and megatron_args replace the batch script's model, layout, schedule,
#               sharding, batch, recomputation and precision (python -m megatron_bfpp.megatron.ab.plan_file
#               checks it first: the job's ranks must be the candidate's T x CP x P x D, and the layout
#               variables below, exported, and extra arguments must not conflict with it).
#               Any other argument is appended to Megatron's flags.
# Environment (all optional; relative paths are taken from the directory you submit from):
#   MEGATRON_LM_DIR   Megatron-LM checkout (default: next to the project, $BFPP_ROOT/../Megatron-LM)
#   BFPP_SRUN_ARGS    extra srun options for every step, split on spaces, e.g. for enroot/pyxis:
#                     "--container-image=/images/pytorch.sqsh --container-mounts=/home:/home,/data:/data"
#   TRANSFORMER_IMPL  auto (default: TransformerEngine when the first node can import it, else
#                     --transformer-impl local with a note), transformer_engine or local
#   TP_COMM_OVERLAP=0 no --tp-comm-overlap (default: on when TP > 1 and TransformerEngine is used)
#   RECOMPUTE         full | selective | none (activation recomputation; default from the batch script)
#   USE_PATCH=1       run the patched pretrain_gpt.py (scripts/apply_megatron_patches.sh) instead of the
#                     no-patch script runner `python -m megatron_bfpp.run_megatron_script`
#   GPUS_PER_NODE (default: the allocation's, else 8)
#   TP PP LAYERS_PER_STAGE MBS GBS GROUP_SIZE SCHEDULE ZERO_STAGE TRAIN_ITERS
#                     ZERO_STAGE= (empty) keeps Megatron's distributed optimizer (overlapped grad reduce and
#                     param gather) under the plugin's schedule
#   DATA_PATH VOCAB_FILE MERGE_FILE DATA_CACHE_PATH  (unset DATA_PATH: Megatron's mock data, null tokenizer)
#   OUT_ROOT (default: ${SCRATCH:-$HOME}/megatron_bfpp-runs) RUN_NAME CKPT_DIR LOG_DIR
#   SAVE_INTERVAL (default 100)  EXIT_MARGIN_MINS (default 15; or EXIT_DURATION_MINS outright)
#   REQUEUE=0 (no automatic requeue)
#   MASTER_PORT TIMELINE=1 EXTRA_ARGS BFPP_SKIP_CHECK=1 (no flag validation)
#   NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_NET_GDR_LEVEL NCCL_DEBUG ... (passed to every rank)
# Bash >= 4.2 (possibly empty arrays are expanded as ${a[@]+"${a[@]}"} under `set -u`).

bfpp_die() { echo "error: $*" >&2; exit 1; }
bfpp_note() { echo "note: $*" >&2; }

# Absolute form of a path, relative ones taken from the current (submit) directory; need not exist.
bfpp_abs() {
  case "$1" in
    /*) printf '%s\n' "$1" ;;
    *) printf '%s\n' "$PWD/${1#./}" ;;
  esac
}

# Minutes in a SLURM time string: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S (empty for UNLIMITED and the like).
bfpp_minutes() {
  local t="$1" d=0 h=0 m=0
  local -a f
  case "$t" in *[!0-9:-]*|'') return 0 ;; esac
  if [[ "$t" == *-* ]]; then
    d="${t%%-*}"; t="${t#*-}"
    IFS=: read -r -a f <<< "$t"
    h="${f[0]:-0}"; m="${f[1]:-0}"
  else
    IFS=: read -r -a f <<< "$t"
    case "${#f[@]}" in
      1) m="${f[0]}" ;;
      2) m="${f[0]}" ;;
      *) h="${f[0]}"; m="${f[1]}" ;;
    esac
  fi
  echo $(( 10#$d * 1440 + 10#$h * 60 + 10#$m ))
}

# The flags that the layout variables stand for where the user exported them (the batch script's defaults are
# not exported): what a --plan must not contradict.
bfpp_exported_layout_flags() {
  local v value
  for v in TP PP LAYERS_PER_STAGE MBS GBS GROUP_SIZE SCHEDULE ZERO_STAGE RECOMPUTE; do
    value="$(printenv "$v")" || continue
    case "$v" in
      TP) printf '%s\n' --tensor-model-parallel-size "$value" ;;
      PP) printf '%s\n' --pipeline-model-parallel-size "$value" ;;
      LAYERS_PER_STAGE) printf '%s\n' --num-layers-per-virtual-pipeline-stage "$value" ;;
      MBS) printf '%s\n' --micro-batch-size "$value" ;;
      GBS) printf '%s\n' --global-batch-size "$value" ;;
      GROUP_SIZE) printf '%s\n' --microbatch-group-size-per-virtual-pipeline-stage "$value" ;;
      SCHEDULE) printf '%s\n' --pipeline-schedule "$value" ;;
      ZERO_STAGE)
        if [ -n "$value" ]; then printf '%s\n' --zero-stage "$value"
        else printf '%s\n' --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather; fi ;;
      RECOMPUTE)
        case "$value" in
          full) printf '%s\n' --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 ;;
          selective) printf '%s\n' --recompute-granularity selective ;;
        esac ;;
    esac
  done
}

bfpp_slurm_main() {
  local dry_run=0 plan="" candidate=1
  local -a extra=()
  while [ "$#" -gt 0 ]; do
    case "$1" in
      --dry-run) dry_run=1 ;;
      --plan) [ "$#" -ge 2 ] || bfpp_die "--plan needs a file (a bfpp plan --json output)"; plan="$2"; shift ;;
      --plan=*) plan="${1#--plan=}" ;;
      --candidate) [ "$#" -ge 2 ] || bfpp_die "--candidate needs a number (1-based)"; candidate="$2"; shift ;;
      --candidate=*) candidate="${1#--candidate=}" ;;
      *) extra+=("$1") ;;
    esac
    shift
  done
  if [ -z "$plan" ] && [ "$candidate" != 1 ]; then bfpp_die "--candidate needs --plan PLAN.json"; fi

  local root="${BFPP_ROOT:?the batch script sets BFPP_ROOT}"
  root="$(cd "$root" && pwd -P)" || bfpp_die "BFPP_ROOT=$BFPP_ROOT is not a directory"
  local script="${BFPP_SCRIPT:-$root/scripts/slurm/$MODEL_NAME.sbatch}"
  local submit_dir="$PWD"

  # Paths: absolute before anything changes directory (srun runs in the Megatron-LM checkout).
  local mlm
  mlm="$(bfpp_abs "${MEGATRON_LM_DIR:-$root/../Megatron-LM}")"
  if [ -d "$mlm" ]; then mlm="$(cd "$mlm" && pwd -P)"; fi
  local entry_script="$mlm/pretrain_gpt.py"
  if [ -f "$entry_script" ]; then entry_script="$(readlink -f "$entry_script")"; fi

  local nnodes="${NNODES:?set NNODES}"
  local gpus="${GPUS_PER_NODE:-${SLURM_GPUS_PER_NODE:-8}}"
  gpus="${gpus##*:}"  # SLURM writes typed requests as TYPE:COUNT
  local world=$(( nnodes * gpus ))
  local -a env_extra=()
  if [ -n "${EXTRA_ARGS:-}" ]; then read -r -a env_extra <<< "$EXTRA_ARGS"; fi
  # A plan's candidate: checked against the job (ranks, exported layout variables, extra flags) before anything.
  local plan_flags=() plan_has_tokenizer=0 plan_has_impl=0 plan_name="" plan_summary="" plan_out
  if [ -n "$plan" ]; then
    local -a given=()
    local v where=""
    mapfile -t given < <(bfpp_exported_layout_flags)
    for v in TP PP LAYERS_PER_STAGE MBS GBS GROUP_SIZE SCHEDULE ZERO_STAGE RECOMPUTE; do
      if printenv "$v" >/dev/null; then where+="$v=${!v} "; fi
    done
    where+="EXTRA_ARGS, the script's arguments"
    # In the batch shell, outside any container: any Python 3, no packages needed.
    local py=python3
    command -v python3 >/dev/null 2>&1 || py=python
    plan_out="$(PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" -m megatron_bfpp.megatron.ab.plan_file \
      --plan "$(bfpp_abs "$plan")" --candidate "$candidate" --world "$world" \
      --launch "$nnodes node(s) x $gpus GPU(s)" --launch-flags "$where" \
      -- ${given[@]+"${given[@]}"} ${env_extra[@]+"${env_extra[@]}"} ${extra[@]+"${extra[@]}"})" || exit 1
    eval "$plan_out"
  elif (( world % (TP * PP) != 0 )); then
    bfpp_die "$nnodes node(s) x $gpus GPU(s) = $world ranks is not a multiple of TP x PP = $TP x $PP = $(( TP * PP )):" \
      "submit with sbatch -N a multiple of $(( (TP * PP + gpus - 1) / gpus )) nodes, or change TP/PP"
  fi
  local dp=0
  if [ -z "$plan" ]; then dp=$(( world / (TP * PP) )); fi
  local schedule="${SCHEDULE:-breadth-first}"
  local zero="${ZERO_STAGE-3}"
  local run="${RUN_NAME:-$MODEL_NAME-$schedule${zero:+-zero$zero}}"
  if [ -n "$plan" ]; then run="${RUN_NAME:-$plan_name}"; fi
  local out
  out="$(bfpp_abs "${OUT_ROOT:-${SCRATCH:-$HOME}/megatron_bfpp-runs}")/$run"
  local ckpt logs
  ckpt="$(bfpp_abs "${CKPT_DIR:-$out/checkpoints}")"
  logs="$(bfpp_abs "${LOG_DIR:-$out/logs}")"
  case "$ckpt/" in
    "$root"/*) bfpp_note "checkpoints go inside the code checkout ($ckpt): set OUT_ROOT or CKPT_DIR to a" \
                 "scratch file system" ;;
  esac
  local train_iters="${TRAIN_ITERS:-500}"
  local save_interval="${SAVE_INTERVAL:-100}"
  (( save_interval <= train_iters )) || save_interval="$train_iters"

  local in_job=0
  [ -n "${SLURM_JOB_ID:-}" ] && in_job=1
  local master_addr master_port="${MASTER_PORT:-29500}" rdzv_id="${SLURM_JOB_ID:-bfpp}"
  if [ "$in_job" = 1 ] && [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
    master_addr="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
  else
    master_addr="${MASTER_ADDR:-$(hostname)}"
  fi

  # Time limit -> Megatron's --exit-duration-in-mins (saves and exits before the limit, even without the
  # warning signal). In a job: the time left (squeue); otherwise the script's #SBATCH --time.
  local limit="" exit_mins=""
  if [ "$in_job" = 1 ] && command -v squeue >/dev/null 2>&1; then
    limit="$(bfpp_minutes "$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | sed -n 1p)")"
  elif [ -f "$script" ]; then
    limit="$(bfpp_minutes "$(sed -n 's/^#SBATCH --time=\([^[:space:]]*\).*/\1/p' "$script" | sed -n 1p)")"
  fi
  if [ -n "${EXIT_DURATION_MINS:-}" ]; then exit_mins="$EXIT_DURATION_MINS"
  elif [ -n "$limit" ] && (( limit > ${EXIT_MARGIN_MINS:-15} )); then exit_mins=$(( limit - ${EXIT_MARGIN_MINS:-15} )); fi

  # Site srun options (containers, accounts, ...) for every step.
  local -a site=()
  if [ -n "${BFPP_SRUN_ARGS:-}" ]; then read -r -a site <<< "$BFPP_SRUN_ARGS"; fi

  # Communication and Python environment (every variable can be overridden from the submitting shell).
  export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron's TP/SP overlap ordering
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  export NCCL_IB_QPS_PER_CONNECTION="${NCCL_IB_QPS_PER_CONNECTION:-4}"
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  export PYTHONUNBUFFERED=1
  # The project and the Megatron-LM checkout importable without installing them (containers).
  export PYTHONPATH="$root:$mlm${PYTHONPATH:+:$PYTHONPATH}"
  local -a envs=(CUDA_DEVICE_MAX_CONNECTIONS TORCH_NCCL_ASYNC_ERROR_HANDLING NCCL_DEBUG NCCL_IB_TIMEOUT
    NCCL_IB_QPS_PER_CONNECTION OMP_NUM_THREADS PYTHONUNBUFFERED PYTHONPATH)
  local v
  for v in NCCL_IB_HCA NCCL_SOCKET_IFNAME NCCL_IB_GID_INDEX NCCL_NET_GDR_LEVEL; do
    if [ -n "${!v:-}" ]; then export "${v?}"; envs+=("$v"); fi
  done

  # One-task steps on the first node, in the same environment (container) as the ranks.
  local -a step=(srun --nodes=1 --ntasks=1 --chdir="$mlm" ${site[@]+"${site[@]}"})

  # TransformerEngine: Megatron's default model path needs it; without it, the local implementation.
  local impl="${TRANSFORMER_IMPL:-auto}" probe_where="on the first node"
  local -a probe=(python -c "import transformer_engine.pytorch")
  [ "$dry_run" = 1 ] && probe_where="here"
  if [ "$impl" = auto ]; then
    if { [ "$dry_run" = 1 ] && "${probe[@]}" >/dev/null 2>&1; } ||
       { [ "$dry_run" = 0 ] && "${step[@]}" "${probe[@]}" >/dev/null 2>&1; }; then
      impl=transformer_engine
    else
      impl=local
      bfpp_note "TransformerEngine is not importable $probe_where: running with --transformer-impl local" \
        "(Megatron's own layers, no fused kernels). Use NVIDIA's PyTorch container or install" \
        "transformer-engine[pytorch] (README, GPU environment), or set TRANSFORMER_IMPL."
    fi
  fi
  case "$impl" in local|transformer_engine) ;; *) bfpp_die "TRANSFORMER_IMPL=$impl: use auto, local or transformer_engine" ;; esac

  local -a training=(
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1
    --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.006 --seed 1234
  )
  local -a megatron
  if [ -n "$plan" ]; then
    # The training defaults, then the plan's flags (where they set one, the plan's wins): model, precision,
    # features, layout, schedule, sharding, batch, recomputation and overlaps as planned.
    megatron=("${training[@]}" "${plan_flags[@]}")
    if [ "$plan_has_impl" = 0 ]; then megatron+=(--transformer-impl "$impl"); fi
  else
    megatron=("${MODEL_ARGS[@]}"
      --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
      --num-layers-per-virtual-pipeline-stage "$LAYERS_PER_STAGE"
      --micro-batch-size "$MBS" --global-batch-size "$GBS"
      --pipeline-schedule "$schedule"
      --transformer-impl "$impl"
    )
    if [ -n "$zero" ]; then
      megatron+=(--zero-stage "$zero")
    else  # Megatron's own distributed optimizer under the plugin's schedule
      megatron+=(--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
    fi
    if (( TP > 1 )); then
      megatron+=(--sequence-parallel)
      if [ "$impl" = transformer_engine ] && [ "${TP_COMM_OVERLAP:-1}" != 0 ]; then megatron+=(--tp-comm-overlap); fi
    fi
    case "${RECOMPUTE:-none}" in
      full) megatron+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1) ;;
      selective) megatron+=(--recompute-granularity selective) ;;
      none) ;;
      *) bfpp_die "RECOMPUTE=$RECOMPUTE: use full, selective or none" ;;
    esac
    if [ -n "${GROUP_SIZE:-}" ]; then megatron+=(--microbatch-group-size-per-virtual-pipeline-stage "$GROUP_SIZE"); fi
  fi
  if [ "${TIMELINE:-0}" = 1 ]; then megatron+=(--timeline "$logs/timeline.json"); fi
  if [ -z "$plan" ]; then megatron+=(--bf16 "${training[@]}"); fi
  megatron+=(
    --train-iters "$train_iters" --eval-interval 1000 --eval-iters 10
    --save "$ckpt" --load "$ckpt" --save-interval "$save_interval"
    --exit-signal-handler --exit-signal SIGUSR1
    --log-interval 1 --log-throughput --log-memory-interval 10 --tensorboard-dir "$logs/tensorboard"
    --distributed-timeout-minutes 30
  )
  if [ -n "$exit_mins" ]; then megatron+=(--exit-duration-in-mins "$exit_mins"); fi
  if [ -n "${DATA_PATH:-}" ]; then
    # DATA_PATH may be a blend "WEIGHT PREFIX WEIGHT PREFIX ...": make the prefixes absolute.
    local -a blend=()
    local tok
    read -r -a blend <<< "$DATA_PATH"
    local -a data=()
    for tok in "${blend[@]}"; do
      if [[ "$tok" =~ ^[0-9.eE+-]+$ ]]; then data+=("$tok"); else data+=("$(bfpp_abs "$tok")"); fi
    done
    megatron+=(--data-path "${data[@]}" --split "949,50,1" --tokenizer-type GPT2BPETokenizer
      --vocab-file "$(bfpp_abs "${VOCAB_FILE:?set VOCAB_FILE with DATA_PATH}")"
      --merge-file "$(bfpp_abs "${MERGE_FILE:?set MERGE_FILE with DATA_PATH}")"
      # Index caches in the run directory: the data directory may be read-only.
      --data-cache-path "$(bfpp_abs "${DATA_CACHE_PATH:-$out/data-cache}")")
  elif [ "$plan_has_tokenizer" = 1 ]; then
    megatron+=(--mock-data)  # the plan's tokenizer and vocabulary
  else
    megatron+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
  fi
  megatron+=(${env_extra[@]+"${env_extra[@]}"})
  megatron+=(${extra[@]+"${extra[@]}"})

  local -a entry
  if [ "${USE_PATCH:-0}" = 1 ]; then entry=("$entry_script")
  else entry=(-m megatron_bfpp.run_megatron_script "$entry_script"); fi

  local -a check=(python -m megatron_bfpp.megatron.check --world-size "$world" -- "${megatron[@]}")
  local -a cmd=(srun --nodes="$nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1 --chdir="$mlm"
    --open-mode=append --output="$logs/%x-%j-node%n.log" ${site[@]+"${site[@]}"}
    bash "$root/scripts/slurm/node_launch.sh"
    torchrun --nnodes "$nnodes" --nproc-per-node "$gpus"
    --rdzv-id "$rdzv_id" --rdzv-backend c10d --rdzv-endpoint "$master_addr:$master_port"
    "${entry[@]}" "${megatron[@]}")

  local header
  if [ -n "$plan" ]; then
    header="# $plan_summary: $nnodes node(s) x $gpus GPU(s) = $world ranks"
  else
    local m=$(( GBS / (MBS * dp) ))
    header="# $MODEL_NAME: $nnodes node(s) x $gpus GPU(s) = $world ranks: TP=$TP PP=$PP DP=$dp,"
    header+=" $LAYERS_PER_STAGE layer(s) per virtual stage, global batch $GBS = $m micro-batch(es) of $MBS per DP rank"
  fi

  if [ "$dry_run" = 1 ]; then
    echo "$header"
    echo "# project:             $root"
    echo "# batch script:        $(readlink -f "$script")"
    echo "# submitted from:      $submit_dir"
    echo "# working directory:   $mlm"
    echo "# training script:     $entry_script"
    if [ ! -f "$entry_script" ]; then echo "# (no such file here: set MEGATRON_LM_DIR to the Megatron-LM checkout)"; fi
    if [ "$in_job" = 1 ]; then
      echo "# rendezvous:          c10d at $master_addr:$master_port, id $rdzv_id (first node of job $SLURM_JOB_ID)"
    else
      echo "# rendezvous:          c10d at $master_addr:$master_port, id $rdzv_id (outside a job: this host;" \
        "under sbatch: the first node of the allocation and the job id)"
    fi
    echo "# checkpoints:         $ckpt (save every $save_interval iterations, on SIGUSR1 and after" \
      "${exit_mins:-no} minutes)"
    if [ "${BFPP_SKIP_CHECK:-0}" != 1 ]; then
      local verdict
      verdict="$(cd "$mlm" 2>/dev/null; "${check[@]}" 2>&1)" ||
        { echo "$verdict" | tail -n 5 >&2; bfpp_die "the project's check rejects these flags (above)"; }
      echo "# check:               $(echo "$verdict" | tail -n 1)"
    fi
    for v in "${envs[@]}"; do printf 'export %s=%q\n' "$v" "${!v}"; done
    printf 'mkdir -p %q %q\n' "$ckpt" "$logs"
    printf '%q ' "${step[@]}" "${check[@]}"
    echo
    printf '%q ' "${cmd[@]}"
    echo
    return 0
  fi

  [ "$in_job" = 1 ] || bfpp_die "not inside a SLURM job: submit with sbatch (or pass --dry-run)"
  [ -f "$entry_script" ] || bfpp_die "MEGATRON_LM_DIR=$mlm has no pretrain_gpt.py"
  echo "$header"
  mkdir -p "$ckpt" "$logs"
  if [ "${BFPP_SKIP_CHECK:-0}" != 1 ]; then
    "${step[@]}" "${check[@]}" || bfpp_die "the project's check rejects the job's flags (above): nothing started"
  fi
  local start_iter=0 end_iter=0
  if [ -f "$ckpt/latest_checkpointed_iteration.txt" ]; then start_iter="$(cat "$ckpt/latest_checkpointed_iteration.txt")"; fi
  local rc=0
  "${cmd[@]}" || rc=$?
  if [ "$rc" != 0 ]; then bfpp_die "training exited with status $rc: see $logs"; fi
  if [ -f "$ckpt/latest_checkpointed_iteration.txt" ]; then end_iter="$(cat "$ckpt/latest_checkpointed_iteration.txt")"; fi
  # Stopped early (warning signal or --exit-duration-in-mins) after progress: come back from the checkpoint.
  if [[ "$end_iter" =~ ^[0-9]+$ ]] && [[ "$start_iter" =~ ^[0-9]+$ ]] && (( end_iter < train_iters )) &&
     (( end_iter > start_iter )) && [ "${REQUEUE:-1}" = 1 ]; then
    echo "stopped at iteration $end_iter of $train_iters (time limit): requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID"
  fi
}
