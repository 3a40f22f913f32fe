#!/usr/bin/env bash
# One torchrun worker of a check that runs several ranks on one GPU (scripts/gpu_check.sh on a one-GPU machine):
#   torchrun --standalone --nproc-per-node 2 --no-python scripts/shared_gpu_rank.sh python SCRIPT ARGS...
# NCCL refuses two ranks of one communicator on one device: initTransportsRank (src/init.cc) fails with
# "Duplicate GPU detected : rank %d and rank %d both on CUDA device %lx" (ncclInvalidUsage) when two ranks report
# the same host hash and PCI bus id. The host hash is taken from NCCL_HOSTID when set (getHostHash,
# src/misc/utils.cc), so each rank gets its own: NCCL then treats the ranks as separate hosts and connects them
# with its socket transport over loopback. What runs for real: the communicators, the posting of p2p ops and
# collectives, their streams and ordering (a hang or a mismatched pair shows); what does not: NVLink, P2P and
# shared-memory transports, and meaningful step times.
set -euo pipefail
: "${RANK:?run this under torchrun (RANK is unset)}"
# Every rank on device 0: Megatron-LM and the trainer call torch.cuda.set_device(LOCAL_RANK).
export LOCAL_RANK=0
export NCCL_HOSTID="bfpp-gpu-check-rank-$RANK"
export NCCL_NET=Socket NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
export NCCL_NVLS_ENABLE=0
exec "$@"
