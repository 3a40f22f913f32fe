#!/usr/bin/env bash
# The main job: install (cached venv), then train a small GPT on 4 CPU processes (gloo) with breadth-first
# pipeline parallelism (P = 2, V = 2) and ZeRO-3 over D = 2, on Megatron's mock data (the embedded default).
# Extra flags are passed to the trainer (e.g. --train-iters 100, --pipeline-schedule interleaved-1f1b).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
# shellcheck source=/dev/null
source "$ROOT/scripts/venv.sh"
bfpp_venv
mkdir -p "$ROOT/runs"
exec bfpp train --nproc-per-node 4 \
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
  --micro-batch-size 2 --global-batch-size 16 --train-iters 40 \
  --lr 3e-3 --min-lr 3e-4 --lr-warmup-iters 4 --lr-decay-style cosine --seed 1234 \
  --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 \
  --pipeline-schedule breadth-first --zero-stage 3 --mock-data \
  --log-interval 5 --report-json "$ROOT/runs/main.json" --timeline "$ROOT/runs/main_timeline.json" "$@"
