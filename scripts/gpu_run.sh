#!/usr/bin/env bash
# One GPU benchmark step with fla's saved autotuning (configs/fla/<GPU>) reused and extended.
#   scripts/gpu_run.sh STEP [extra args]      STEP: check | ops | e2e-swe | e2e-tau | e2e-sweep | e2e-moe
#                                                   | e2e-moe-grouped | moe-experts | e2e-norc | verify | verify-moe | calibrate | pretrain | rl | libra
#                                                   | text-model
# text-model: a small MoE Qwen3-Next trained on the standard library's sources + scripted code_repair
# episodes (megatron_harts.rollout.text_model; bf16 checkpoint in $OUT/text_model/model, servable by
# SGLang): the model of docs/war.md's H200 rows.
# rl: the on-policy RL loop with SGLang (scripts/gpu_rl.py; SGLang in /tmp/site, see scripts/device/)
# e2e-norc: recomputation off at 16K-token microbatches (the 1.48B model without recomputation runs
# out of memory at 32K on the 139 GiB H200, so SWE-like trajectories of up to 64K tokens cannot run).
# pretrain: 3 iterations of scripts/pretrain_hybrid_harts.py (Megatron's pretrain loop, one GPU, small
# model, tau-like rollouts) tree-packed and trajectory-wise from the same seed; logs pretrain_tree{1,0}.log
# (the first iteration's "rl loss" / "rl loss negated" and "grad norm" of the two should agree to bf16
# noise; without old log-probs in the data the loss is minus the token-mean advantage on both sides,
# so the grad norm is the informative one).
# Results go to $OUT (default ./out); the tuned configs are also packed into $OUT/fla_configs.tgz
# (unpack into configs/fla/<GPU> and commit, so the next fresh machine skips autotuning), and
# Triton's own autotuning results (plain ``triton.autotune`` kernels such as simple GLA's, which
# fla's config files do not cover) into $OUT/triton_autotune.tgz (commit as configs/triton/<GPU>.tgz;
# used only while the Triton, fla and driver versions match, since Triton's cache key hashes them);
# torch.compile's inductor cache into $OUT/inductor_cache.tgz (commit as configs/inductor/<GPU>.tgz).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
# the trainer stack of scripts/device/install_harts.sh (Triton 3.7.1, fla, megatron-core): without it on
# the path a fresh machine's steps die at `import megatron` (2026-12-04, first call)
[ -d /tmp/harts_site ] && export PYTHONPATH=/tmp/harts_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# the model word of the device name ("NVIDIA H200" -> H200, "NVIDIA H100 80GB HBM3" -> H100)
GPU=${HARTS_GPU:-}     # set only by the CPU test of these scripts
[ -n "$GPU" ] || GPU=$(python3 -c "import re, torch; n = torch.cuda.get_device_name(); m = re.search(r'\b[A-Z]+\d{2,4}[A-Z]?\b', n); print(m.group(0) if m else n.split()[-1])")
CFG=/tmp/fla_configs
mkdir -p "$CFG"
[ -d "configs/fla/$GPU" ] && cp -n "configs/fla/$GPU"/*.json "$CFG"/ 2>/dev/null || true
# An H100 without its own configs takes the H200's (same sm_90 kernels): on 2026-12-05 a bare H100
# spent a whole 245 s step autotuning fla's kernels before its first forward finished.
[ "$GPU" = H100 ] && [ -d configs/fla/H200 ] && cp -n configs/fla/H200/*.json "$CFG"/ 2>/dev/null || true
export FLA_CACHE_MODE=${FLA_CACHE_MODE:-fuzzy} FLA_CONFIG_DIR=$CFG TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# Several rows per process: without expandable segments the allocator kept 26 GiB reserved but
# unusable after one row and the next ran out of memory.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$TRITON_CACHE_DIR"
[ -f "configs/triton/$GPU.tgz" ] && tar xzf "configs/triton/$GPU.tgz" -C "$TRITON_CACHE_DIR" --skip-old-files || true
# torch.compile's caches (FlexAttention's kernels, inductor's FX graph and AOT-autograd entries): on a
# bare H100 (2026-12-06) the first no-recomputation HARTS step spent 285 s compiling. Restored from
# configs/inductor/$GPU.tgz when committed; packed after the step into $OUT/inductor_cache.tgz when
# under 15 MiB (the device returns files of at most 16 MiB; commit it as configs/inductor/<GPU>.tgz).
# Entries are keyed by torch/Triton versions, the device and the graph, so a stale one is just a miss.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/torchinductor_cache}
mkdir -p "$TORCHINDUCTOR_CACHE_DIR"
[ -f "configs/inductor/$GPU.tgz" ] && tar xzf "configs/inductor/$GPU.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" --skip-old-files || true
step=${1:?STEP}; shift
save=(--save-fla-configs "$CFG")
rc=0
case "$step" in
  check)     python3 scripts/gpu_check_ops.py --out "$OUT" "${save[@]}" "$@" ;;
  ops)       python3 scripts/bench_ops.py --out "$OUT" "${save[@]}" "$@" ;;
  e2e-swe)   python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_dense_swe.json --models dense --workloads swe --recompute on "${save[@]}" "$@" ;;
  e2e-tau)   python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_dense_tau.json --models dense --workloads tau --recompute on "${save[@]}" "$@" ;;
  e2e-sweep) python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_dense_sweep.json --models dense --workloads sweep --recompute on "${save[@]}" "$@" ;;
  e2e-moe)   python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_moe.json --models moe --workloads swe,tau --recompute on "${save[@]}" "$@" ;;
  e2e-moe-grouped) python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_moe_grouped.json --models moe --workloads swe,tau \
               --recompute on --grouped-experts "${save[@]}" "$@" ;;
  moe-experts) python3 scripts/bench_moe_experts.py --out "$OUT" "$@" ;;
  e2e-norc)  python3 scripts/bench_e2e.py --out "$OUT" --name e2e_fresh_dense_norc16k.json --models dense --workloads tau,sweep \
               --compressions 2,6,10 --capacity 16384 --recompute off "${save[@]}" "$@" ;;
  rl)        [ -d /tmp/harts_site ] && export PYTHONPATH=/tmp/harts_site:$PWD${PYTHONPATH:+:$PYTHONPATH}   # trainer stack
             command -v bwrap >/dev/null || { [ -d .bw ] && mkdir -p /tmp/bw && for f in .bw/*.deb; do dpkg -x "$f" /tmp/bw; done; } || true
             PATH=/tmp/bw/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/bw/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
               python3 scripts/gpu_rl.py --out "$OUT" "$@" ;;   # SGLang: --engine-env PYTHONPATH=/tmp/site
  text-model) command -v bwrap >/dev/null || { [ -d .bw ] && mkdir -p /tmp/bw && for f in .bw/*.deb; do dpkg -x "$f" /tmp/bw; done; } || true
               PATH=/tmp/bw/usr/bin:$PATH LD_LIBRARY_PATH=/tmp/bw/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
               python3 -m megatron_harts.rollout.text_model --device cuda --out "$OUT/text_model" --moe --dtype bfloat16 \
               --hidden-size 512 --num-layers 8 --head-dim 64 --seq-len 1024 --batch 32 --lr 1e-3 --lr-decay cosine \
               --agent-tasks 16 --agent-samples 3 --agent-fraction 0.125 \
               --minutes 2.75 --wall-minutes 6.5 --export-every-minutes 1 "$@" ;;
             # (the minutes count after the first step; on a bare H100 on 2026-12-07 that step took 115 s and
             #  the old 3.8-minute wall stopped training after it: give the call 420 s on a bare machine)
  libra)     [ -d /tmp/harts_site ] && export PYTHONPATH=/tmp/harts_site:$PWD${PYTHONPATH:+:$PYTHONPATH}   # trainer: Triton 3.7.1, fla, mcore
             python3 scripts/libra_colocated_h200.py --out "$OUT" "$@" ;;   # SGLang: --engine-env PYTHONPATH=/tmp/site
  libra-calibrate) [ -d /tmp/harts_site ] && export PYTHONPATH=/tmp/harts_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
             python3 scripts/libra_calibrate_h200.py --out "$OUT" "$@" ;;
  verify)    python3 -m megatron_harts.verify --device cuda --model 1.5b "$@" | tee "$OUT/verify_1p5b.json" ;;
  verify-moe) python3 -m megatron_harts.verify --device cuda --pattern 'G*E-G*E-' --num-moe-experts 8 "$@" \
               | tee "$OUT/verify_moe.json" ;;
  calibrate) python3 scripts/calibrate_cost.py --out "$OUT/cost_model.json" "$@" ;;
  pretrain)
    python3 -m megatron_harts.workloads tau --groups 4 --out "$OUT/rollouts.jsonl"
    for tree in 1 0; do
      TREE=$tree NPROC=1 ITERS=3 PATTERN='G*-G-' HIDDEN=512 HEADS=4 FFN=2048 SEQ=32768 VOCAB=32768 \
        MBS_PER_STEP=2 GROUPS_PER_STEP=4 TORCHRUN="python3 -m torch.distributed.run" \
        bash scripts/launch_torchrun.sh "$OUT/rollouts.jsonl" --transformer-impl local \
        --no-persist-layer-norm --no-gradient-accumulation-fusion --seed 1 "$@" > "$OUT/pretrain_tree$tree.log" 2>&1
      grep -E "iteration|rl loss|grad norm|compression|Error|error" "$OUT/pretrain_tree$tree.log" | tail -n 8
    done ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac || rc=$?
tar czf "$OUT/fla_configs.tgz" -C "$CFG" . 2>/dev/null || true
(cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/triton_autotune.tgz" -T -) 2>/dev/null || true
if [ -n "$(ls -A "$TORCHINDUCTOR_CACHE_DIR" 2>/dev/null)" ]; then
  tar czf "$OUT/inductor_cache.tgz" -C "$TORCHINDUCTOR_CACHE_DIR" . 2>/dev/null || true
  size=$(stat -c %s "$OUT/inductor_cache.tgz" 2>/dev/null || echo 0)
  if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
    echo "[gpu_run] inductor cache is $((size / 1048576)) MiB (> 15): not packed" >&2
    rm -f "$OUT/inductor_cache.tgz"
  fi
fi
exit $rc
