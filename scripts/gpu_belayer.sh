#!/usr/bin/env bash
# Belayer on the H200 with SGLang 0.5.17 (NOT RUN YET: the session's GPU time was spent).
#   bash scripts/gpu_belayer.sh [extra bench_belayer.py args]
# Needs SGLang in /tmp/site (scripts/device/install_sglang.sh, see docs/rollout.md) and bubblewrap on
# PATH for the environment rows. Makes a random small-moe Qwen3-Next checkpoint (bf16, SGLang-servable),
# then measures, with one active SGLang server and one shadow on the same GPU (mem fraction 0.3 each):
#   * SIGKILL of the server's process group mid-request (200 of 320 tokens): shadow promotion + prefix
#     resume vs a cold SGLang start + prefix resume vs abort-and-resubmit from scratch on the shadow;
#   * the same with only SGLang's scheduler child killed (--kill child; the server's watchdog, the
#     supervisor's health probe or the broken stream detect it);
#   * the environment rows and the failure-free overhead (same as on CPU, with SGLang serving).
# --enable-deterministic-inference makes SGLang sample with (seed, position)-keyed noise, so the resumed
# continuation should equal the uninterrupted one; the log says "output differs" where it does not
# (prefill and decode kernels may round differently). GPU-state reuse (torch_memory_saver / CUDA IPC:
# the shadow adopting the dead worker's weights and KV) is not built; these rows are the baseline it
# would improve on.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out/belayer}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
CK="$OUT/small-moe"
[ -f "$CK/config.json" ] || python3 -c "
from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
print(make_tiny_checkpoint('$CK', preset='small-moe', dtype='bfloat16'))"
ARGS=(--engine sglang --model-path "$CK" --engine-args "--mem-fraction-static 0.3 --enable-deterministic-inference"
      --reps 5 --cold-reps 2 --kill-at 200 --max-new-tokens 320)
python3 scripts/bench_belayer.py "${ARGS[@]}" --parts engine,env,overhead --out "$OUT/belayer_h200.json" "$@"
python3 scripts/bench_belayer.py "${ARGS[@]}" --parts engine --kill child --out "$OUT/belayer_h200_scheduler.json" "$@"
