#!/usr/bin/env bash
# Belayer on the H200 with SGLang 0.5.17. Tried once (2026-12-02, no rows): with CUDA graphs on, SGLang
# 0.5.17 also captures 58 prefill graphs (backend 'breakable', 4..8192 tokens), which took > 240 s with
# --enable-deterministic-inference, so the first start timed out; the fallback (no CUDA graphs) started
# in 63 s and the shadow's start was cut by the budget. Now --disable-prefill-cuda-graph keeps only the
# decode graphs (batch 1-8), a 150 s first-start limit leaves time for the fallback, and BUDGET is 450.
#   bash scripts/gpu_belayer.sh [extra bench_belayer.py args]            quick (default): one device call
#   MODE=full bash scripts/gpu_belayer.sh                                 the full set: ~15-30 min, not one call
#   MODE=rearm bash scripts/gpu_belayer.sh                                GPU state reuse: one device call
# MODE=rearm (bench_belayer.py --parts rearm): a weight keeper process holds the checkpoint's tensors on
# cuda:0; a replacement SGLang worker started with --load-format dummy (random weights, no checkpoint
# read) is re-armed through SGLang's POST /update_weights_from_tensor with CUDA IPC handles of the
# keeper's tensors, vs a worker started from the checkpoint; REARM_REPS (3) of each alternated, after one
# unmeasured checkpoint start (compile caches, reference output). Phases: process start (SGLang's own
# "Load weight end. elapsed" from its log), keeper health check + handles + update, first token; the
# re-armed worker's greedy tokens / log-probs vs the reference. 1 + 2 * REARM_REPS SGLang starts, one at a
# time (~40-60 s each after the first): ~420 s at 3 reps; BUDGET cuts the reps that would not fit.
# REARM_COLD=1 adds a third mode per rep (checkpoint evicted from the page cache first): 1 + 3 * REARM_REPS
# starts, so REARM_REPS=2 in one call. Writes $OUT/belayer_h200_rearm.json; merge with
#   python scripts/bench_belayer.py --merge-rows out/belayer/belayer_h200_rearm.json --out docs/benchmarks/belayer.json
# Needs SGLang in /tmp/site (scripts/device/install_sglang.sh, see docs/rollout.md); MODE=full also
# bubblewrap on PATH (environment rows). Makes a random small-moe Qwen3-Next checkpoint (bf16, steered so
# that <eos> has p ~ 1e-6 per token: SGLang stops at the config's eos_token_id whatever the request's
# stop_token_ids, and an unsteered random model samples it with p ~ 1/264, ending most 320-token requests
# early), then runs the engine steps on one supervisor: an active SGLang server and, when the next step
# needs one, a shadow on the same GPU (--mem-fraction-static 0.3 each: SGLang sizes its pools from the
# memory free when it starts, so the servers are started one after the other, never together):
#   quick: shadow:group  SIGKILL of the server's process group after 200 of 320 tokens -> shadow + prefix resume
#          cold:group    the same without a shadow: cold SGLang start + prefix resume (the baseline)
#          restart:group on the shadow, but the request starts over (abort-and-resubmit baseline)
#          shadow:child  only the scheduler child (process title sglang::scheduler) SIGKILLed: SGLang's
#                        subprocess watchdog (1 s poll) SIGQUITs the HTTP server, which kills its tree
#                        (measured 2026-12-02: 6.75 s, 5 s of it SGLang's crash-diagnostics sleep). Since
#                        then (not yet rerun here): SGLangServer sets SGLANG_PYSPY_DUMP_BEFORE_CRASH=0 and
#                        SGLANG_CUDA_COREDUMP_BEFORE_CRASH=0 unless they are in the environment, its
#                        alive() watches the sglang:: children (the supervisor sees the dead scheduler
#                        within its 0.25 s period) and the supervisor SIGKILLs a failed worker's group at
#                        promotion (the request's silent stream breaks at once). CPU stub: ~0.02-0.25 s.
#   One SGLang start per step (the killed server's replacement) plus the first two; a step that would not
#   end within BUDGET is skipped, the JSON is rewritten after every step, phases are logged with times.
# --enable-deterministic-inference (SM90: fa3 attention, as without it; pytorch sampling with Gumbel noise
# keyed by sampling_seed and position; batch-invariant matmuls) should make the resumed continuation equal
# the uninterrupted one (the log says "output differs" where it does not, and the step's detail records
# first_diff: position and tokens around it; GDN prefill and recurrent decode kernels round differently). It was never run with Qwen3-Next's GDN layers: if the first start fails, the
# bench starts again with FALLBACK_ARGS (the flags the H200 rollout runs used) and records it.
# START_TIMEOUT (240 s): a fresh machine's first SGLang start took 143-180 s on 2026-12-03 (130 s was too short).
# Overhead part on SGLang: add --overhead-temperature 0 (seeded sampling stalled SGLang 0.5.17's scheduler for
# 34-80 s on new batch sizes; greedy has no seeds) and, for comparable resumed outputs without deterministic
# inference, --temperature 0 for the engine part.
# Files in $OUT (the device returns at most 8): belayer_h200.json, gpu_belayer.log, sglang_logs.tgz.
# Time (quick; F = first SGLang start on the machine 55-180 s + warm-up with the first torch.compile,
# L = a later start 20-60 s): checkpoint ~15-30 s, F, L (the shadow), ~5 s reference + step 1, L + ~3 s
# (step 2's cold start), L (shadow for step 3) + ~3 s, L (shadow for step 4) + ~3 s, ~8 s teardown:
# ~320 s at F = 120, L = 35 (measured 2026-12-02: F = 63 s without CUDA graphs); BUDGET (450) cuts the last steps when starts are slower. Run it as
#   bash scripts/gpu_belayer.sh        (device call timeout ~480 s; measured starts: 63 s without CUDA graphs)
# MODE=full (the old configuration, reps 5 / cold-reps 2, twice) needs 2 + 9 + 2 = 13 SGLang starts per
# invocation, 26 in all (~15-30 min with env + overhead): several device calls, not one.
set -uo pipefail
cd "$(dirname "$0")/.."
T0=$(date +%s)
OUT=${OUT:-$PWD/out/belayer}
MODE=${MODE:-quick}
BUDGET=${BUDGET:-450}                  # quick: seconds for the whole script (the device call needs ~30 more)
CK=${CK:-/tmp/belayer-small-moe}       # not under $OUT: 183 MB
LOGS=${LOGS:-/tmp/belayer-logs}
ENGINE_ARGS=${ENGINE_ARGS:---mem-fraction-static 0.3 --enable-deterministic-inference --cuda-graph-max-bs-decode 8 --disable-prefill-cuda-graph}
FALLBACK_ARGS=${FALLBACK_ARGS:---mem-fraction-static 0.3 --disable-cuda-graph}
SITE=${SITE:-/tmp/site}                # where SGLang is installed
mkdir -p "$OUT" "$LOGS"
export PYTHONPATH=$SITE:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

stamp() { echo "[gpu_belayer $(date +%H:%M:%S) +$(( $(date +%s) - T0 )) s] $*"; }

run() {
  stamp "mode $MODE, budget ${BUDGET} s"
  nvidia-smi --query-gpu=name,memory.used,memory.total,compute_mode --format=csv,noheader || true
  python3 -c "import importlib.metadata as m; print('sglang', m.version('sglang'), 'torch', m.version('torch'), \
'transformers', m.version('transformers'))" || { stamp "SGLang is not importable from PYTHONPATH=$PYTHONPATH"; return 1; }
  if [ ! -f "$CK/belayer_tiny.json" ]; then        # written last: a half-made or unsteered checkpoint is redone
    stamp "making the checkpoint $CK"
    rm -rf "$CK"
    python3 -c "
import json
from megatron_harts.rollout.belayer.tiny import make_tiny_checkpoint
from megatron_harts.rollout.weight_sync import sglang_incompatibilities
st = make_tiny_checkpoint('$CK', preset='small-moe', dtype='bfloat16', call_prob=1e-4, eos_prob=1e-6)
print(st)
assert st['p_eos_saved'] < 1e-4, st
cfg = json.load(open('$CK/config.json'))
bad = sglang_incompatibilities(cfg)
assert not bad and cfg.get('full_attention_interval') == 4 and cfg.get('dtype', cfg.get('torch_dtype')) == 'bfloat16', (bad, cfg)
json.dump(st, open('$CK/belayer_tiny.json', 'w'))
" || { stamp "checkpoint failed"; return 1; }
    stamp "checkpoint made"
  fi
  local common=(--engine sglang --model-path "$CK" --engine-args "$ENGINE_ARGS" --fallback-engine-args "$FALLBACK_ARGS"
                --kill-at 200 --max-new-tokens 320 --log-dir "$LOGS" --startup-timeout-s ${START_TIMEOUT:-240})
  if [ "$MODE" = rearm ]; then
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    [ "$left" -ge 150 ] || { stamp "only ${left} s left of BUDGET=${BUDGET}: not starting the bench"; return 1; }
    stamp "rearm bench: ${left} s left"
    timeout --kill-after=10 "$(( left - 5 ))" python3 scripts/bench_belayer.py "${common[@]}" --parts rearm \
      --rearm-reps "${REARM_REPS:-3}" --deadline-s "$(( left - 25 ))" --startup-estimate-s 60 \
      "$([ "${REARM_COLD:-0}" = 1 ] && echo --rearm-cold-cache || echo --no-rearm-cold-cache)" \
      --out "$OUT/belayer_h200_rearm.json" "$@"
    stamp "bench exit $?"
  elif [ "$MODE" = quick ]; then
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    [ "$left" -ge 150 ] || { stamp "only ${left} s left of BUDGET=${BUDGET}: not starting the bench"; return 1; }
    stamp "bench: ${left} s left (engine deadline $(( left - 25 )) s)"
    timeout --kill-after=10 "$(( left - 5 ))" python3 scripts/bench_belayer.py "${common[@]}" --parts engine \
      --plan shadow:group,cold:group,restart:group,shadow:child --deadline-s "$(( left - 25 ))" \
      --startup-estimate-s 45 --step-margin-s 15 --out "$OUT/belayer_h200.json" "$@"
    stamp "bench exit $?"
  else
    python3 scripts/bench_belayer.py "${common[@]}" --reps 5 --cold-reps 2 --parts engine,env,overhead \
      --out "$OUT/belayer_h200.json" "$@"
    stamp "bench (group kill) exit $?"
    python3 scripts/bench_belayer.py "${common[@]}" --reps 5 --cold-reps 2 --parts engine --kill child \
      --out "$OUT/belayer_h200_scheduler.json" "$@"
    stamp "bench (scheduler kill) exit $?"
  fi
  nvidia-smi --query-gpu=memory.used --format=csv,noheader || true     # 0 MiB-ish: no server left behind
}

run "$@" 2>&1 | tee -a "$OUT/gpu_belayer.log"
rc=${PIPESTATUS[0]}
tar czf "$OUT/sglang_logs.tgz" -C "$LOGS" . 2>/dev/null
stamp "done (exit $rc); $(ls "$OUT" | tr '\n' ' ')" | tee -a "$OUT/gpu_belayer.log"
exit "$rc"
