#!/usr/bin/env bash
# HARTS vs trajectory-wise benchmark under Megatron's parallel state (scripts/bench_e2e_dist.py),
# one node (or one node of a SLURM job, see launch_slurm.sbatch: LAUNCH=scripts/launch_bench_dist.sh).
#
#   scripts/launch_bench_dist.sh [extra bench_e2e_dist.py flags ...]
#
# Environment (defaults in brackets):
#   NPROC [8] processes (GPUs) per node   TP [1] PP [1] EP [1]  (DP = NPROC * NNODES / (TP * PP))
#   CONFIGS [] several configurations in one launch, e.g. "2x1x1,1x2x1,1x1x2:moe" (overrides TP/PP/EP)
#   MODELS [dense] (dense, moe)  WORKLOADS [swe]  RECOMPUTE [on] (on, off, both)
#   STEPS [5] timed global batches per side  WARMUP [2] warm-up batches  SWE_GROUPS [2]
#   COST_MODEL [] CostModel JSON of scripts/calibrate_cost.py (default: FLOP estimate)
#   OUT [.] NAME [e2e_dist.json]  DEVICE [cuda] (cpu: gloo, add --tiny)  TORCHRUN [torchrun]
#   NNODES [1] NODE_RANK [0] MASTER_ADDR [127.0.0.1] MASTER_PORT [29500]
# NCCL_NVLS_ENABLE=0 (NVLink multicast off) and CUDA_DEVICE_MAX_CONNECTIONS=1 are set unless given.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
exec ${TORCHRUN:-torchrun} --nproc-per-node "${NPROC:-8}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "$HERE/bench_e2e_dist.py" --device "${DEVICE:-cuda}" \
  --tp "${TP:-1}" --pp "${PP:-1}" --ep "${EP:-1}" ${CONFIGS:+--configs "$CONFIGS"} \
  --models "${MODELS:-dense}" --workloads "${WORKLOADS:-swe}" --recompute "${RECOMPUTE:-on}" \
  --max-steps "${STEPS:-5}" --warmup-batches "${WARMUP:-2}" --swe-groups "${SWE_GROUPS:-2}" \
  ${COST_MODEL:+--cost-model "$COST_MODEL"} --out "${OUT:-.}" --name "${NAME:-e2e_dist.json}" \
  "$@"
