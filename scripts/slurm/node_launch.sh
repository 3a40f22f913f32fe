#!/usr/bin/env bash
# Runs on every node of a job (one srun task per node) in front of torchrun:
#   node_launch.sh torchrun ... pretrain_gpt.py ...
# SLURM's warning signal (#SBATCH --signal=USR1@SECONDS) reaches every process of the step. torchrun would die
# of SIGUSR1 (it does not handle it) and take the ranks down without a checkpoint, so torchrun runs with
# SIGUSR1 ignored, and this script forwards the signal to torchrun's worker processes (the training ranks),
# where Megatron's --exit-signal-handler --exit-signal SIGUSR1 saves a checkpoint at the end of the current
# iteration and exits cleanly. Exit status: torchrun's.
set -uo pipefail

if [ "$#" -eq 0 ]; then
  echo "usage: node_launch.sh COMMAND [ARGS...]" >&2
  exit 2
fi

( trap '' USR1; exec "$@" ) &
child=$!

# shellcheck disable=SC2329  # invoked by the trap below
forward_usr1() {
  echo "node_launch.sh: SIGUSR1 on $(hostname): forwarded to the ranks (checkpoint and exit)" >&2
  pkill -USR1 -P "$child" 2>/dev/null || true
}
trap forward_usr1 USR1

rc=0
while :; do
  wait "$child"
  rc=$?
  # wait returns early (status > 128) when a trapped signal arrives: keep waiting while torchrun lives.
  if [ "$rc" -gt 128 ] && kill -0 "$child" 2>/dev/null; then continue; fi
  break
done
exit "$rc"
