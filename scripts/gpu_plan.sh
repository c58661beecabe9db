#!/usr/bin/env bash
# Several scripts/gpu_run.sh steps in one device call, each with its own time budget, results
# packed into one archive (the device returns at most 8 files):
#   scripts/gpu_plan.sh STEP:SECONDS[:ARGS] ...   e.g.  check:240:"--ops conv,attention" e2e-moe:300
# (ARGS: extra arguments of that step, split on spaces)
# Step STEP writes into $OUT/STEP/ (log in STEP.log); a step over its budget is stopped by its
# --watchdog (it dumps its stacks; partial JSON stays) or else by `timeout`, and the next step runs.
# Everything ends up in $OUT/results.tgz, fla/Triton autotuning archives included (torch.compile's
# inductor cache, from the last step, in $OUT/inductor_cache.tgz beside it); the step folders
# are then removed (KEEP_STEP_FILES=1 keeps them): the device returns at most 8 files per call, and
# on 2026-12-03 a second plan's folder in the same call was lost that way. Give each plan of a call
# its own OUT (OUT=$OUT/a ... ; OUT=$OUT/b ...): each leaves plan.log and results.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
# Provenance (the device gets a copy of the working tree without .git): the commit given by the
# caller (HARTS_COMMIT=<hash> bash scripts/gpu_plan.sh ...) and a fingerprint of the sources,
# reproducible on any checkout with `bash scripts/gpu_plan.sh --fingerprint`.
# (a fingerprint of a tree with uncommitted changes matches no commit)
fingerprint() { find megatron_harts scripts tests configs -type f \( -name '*.py' -o -name '*.sh' -o -name '*.json' \
  -o -name '*.tgz' \) | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12; }
[ "${1:-}" = --fingerprint ] && { fingerprint; exit 0; }
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
dirs=()
echo "[gpu_plan] commit ${HARTS_COMMIT:-unknown}, sources $(fingerprint)" | tee -a "$OUT/plan.log"
for spec in "$@"; do
  IFS=: read -r step secs args <<< "$spec"
  [[ "$secs" =~ ^[0-9]+$ ]] || { echo "expected STEP:SECONDS[:ARGS], got $spec" >&2; exit 2; }
  secs=$((10#$secs))                        # "090" is not octal
  # a step named twice gets folders STEP, STEP.2, ... (on 2026-12-05 a second verify-moe overwrote the first's)
  dir=$step; n=1
  while [ -e "$OUT/$dir" ]; do n=$((n + 1)); dir=$step.$n; done
  dirs+=("$dir")
  mkdir -p "$OUT/$dir"
  # The watchdog's clock starts after the imports (torch, Megatron, fla: up to ~30 s on a fresh
  # machine), `timeout`'s at launch: with a 10 s margin `timeout` killed two steps before any stack
  # dump (fifth session), so the margin is 45 s.
  extra=(--watchdog $((secs > 90 ? secs - 45 : secs / 2)))
  [ "$step" = pretrain ] && extra=()        # Megatron's parser: the step relies on `timeout` alone
  read -r -a more <<< "${args:-}"
  extra+=("${more[@]}")
  start=$(date +%s)
  OUT="$OUT/$dir" timeout --kill-after=10 "$secs" bash scripts/gpu_run.sh "$step" "${extra[@]}" \
    > "$OUT/$dir/$step.log" 2>&1
  echo "[gpu_plan] $dir rc=$? in $(( $(date +%s) - start )) s: $step ${args:-}" | tee -a "$OUT/plan.log"
  tail -n 12 "$OUT/$dir/$step.log"
  # the inductor cache grows over the steps (one directory per machine): the last step's archive
  # holds every entry; kept beside results.tgz, not in it (each file back is at most 16 MiB)
  [ -f "$OUT/$dir/inductor_cache.tgz" ] && mv -f "$OUT/$dir/inductor_cache.tgz" "$OUT/inductor_cache.tgz"
done
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude inductor_cache.tgz ./*) || exit 1
if [ "${KEEP_STEP_FILES:-0}" != 1 ]; then
  for dir in "${dirs[@]}"; do rm -rf "${OUT:?}/$dir"; done    # packed above
fi
