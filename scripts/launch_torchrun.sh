#!/usr/bin/env bash
# Tree-packed RL training of a hybrid model on one node with torchrun.
#
#   scripts/launch_torchrun.sh TRAJECTORIES.jsonl [extra Megatron / megatron_harts flags ...]
#
# Environment (defaults in brackets):
#   NPROC [8]  GPUs per node          TP [1]  tensor parallel    PP [1] pipeline parallel
#   PATTERN ['G*-G-G*-G-'] --hybrid-layer-pattern (G: GDN, *: attention, -: MLP, E: MoE)
#   HIDDEN [1024] HEADS [8] FFN [4096] SEQ [32768] max trajectory length (rotary table size)
#   VOCAB [151936] --vocab-size (NullTokenizer; must exceed every token id)
#   MBS_PER_STEP [NPROC/TP/PP] tree packs per step = --global-batch-size (micro batch is always 1)
#   GROUPS_PER_STEP [MBS_PER_STEP] rollout groups (trees) per step, >= MBS_PER_STEP
#   ITERS [100] LR [1e-6] CHUNK [64] PLANNER [harts]  PRECISION [--bf16] (--fp16, or empty: fp32)
#   TREE [1] 1: --tree-packing, 0: trajectory-wise baseline (same code, for A/B runs)
#   LOAD / SAVE: checkpoint dirs (optional)  TORCHRUN [torchrun] launcher command
#   (e.g. "python3 -m torch.distributed.run" where torchrun is not on PATH)
# With --transformer-impl local and no Apex, also pass --no-persist-layer-norm (Megatron asserts otherwise).
# The HARTS vs trajectory-wise benchmark (scripts/bench_e2e_dist.py) has its own launcher with the same
# torchrun knobs: scripts/launch_bench_dist.sh (docs/benchmarks/multigpu.md).
# Dropout is off (Megatron's defaults are 0.1): tree attention has none, RL log-prob ratios need none.
# Logged every --log-interval: Megatron's "rl loss" (or "rl loss negated" when negative: Megatron
# prints only non-negative averages), "compression", clip fraction, KL; and per
# step (logger megatron_harts): trajectory tokens, compact tokens, compression, trajectory tokens/s.
set -euo pipefail
DATA=${1:?usage: $0 TRAJECTORIES.jsonl [extra flags]}; shift
HERE=$(cd "$(dirname "$0")" && pwd)
NPROC=${NPROC:-8}; TP=${TP:-1}; PP=${PP:-1}
MBS_PER_STEP=${MBS_PER_STEP:-$(( NPROC / TP / PP ))}
TREE_FLAG=$([ "${TREE:-1}" = 1 ] && echo --tree-packing || true)
exec ${TORCHRUN:-torchrun} --nproc-per-node "$NPROC" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
  --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  "$HERE/pretrain_hybrid_harts.py" \
  --tree-trajectories "$DATA" $TREE_FLAG --tree-chunk-size "${CHUNK:-64}" --tree-planner "${PLANNER:-harts}" \
  --tree-groups-per-step "${GROUPS_PER_STEP:-$MBS_PER_STEP}" \
  --rl-loss-type grpo --rl-loss-agg-mode token-mean --rl-clip-eps 0.2 --rl-kl-coef 0.0 \
  --hybrid-layer-pattern "${PATTERN:-G*-G-G*-G-}" --hidden-size "${HIDDEN:-1024}" \
  --num-attention-heads "${HEADS:-8}" --ffn-hidden-size "${FFN:-4096}" \
  --seq-length "${SEQ:-32768}" --max-position-embeddings "${SEQ:-32768}" \
  --position-embedding-type rope --no-rope-fusion --normalization RMSNorm --swiglu --disable-bias-linear \
  --untie-embeddings-and-output-weights --attention-dropout 0.0 --hidden-dropout 0.0 \
  --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-151936}" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --micro-batch-size 1 --global-batch-size "$MBS_PER_STEP" --dataloader-type external \
  --train-iters "${ITERS:-100}" --lr "${LR:-1e-6}" --min-lr 0 --lr-decay-style constant \
  --weight-decay 0.0 --clip-grad 1.0 --adam-beta2 0.999 ${PRECISION---bf16} \
  --eval-iters 0 --eval-interval "${ITERS:-100}" --log-interval 1 --log-throughput \
  ${LOAD:+--load "$LOAD"} ${SAVE:+--save "$SAVE" --save-interval "${SAVE_INTERVAL:-100}"} \
  "$@"
