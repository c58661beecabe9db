#!/usr/bin/env bash
# On the GPU machine, after the Triton-copy calls (install_harts.sh .tw1 .. .tw3), in one call carrying
# .tw4, .whl and .bw:   bash scripts/device/text_model_back.sh [extra text-model args]
# Installs the trainer stack, trains docs/war.md's text model (scripts/gpu_run.sh text-model) into
# /tmp/tm (kept while the machine stays warm, for the WAR run that follows on it), and sends the
# checkpoint, its report and the autotuning archives back through $OUT as one tar in 12 MB parts
# (tm.partaa, tm.partab, ...; the device returns at most 8 files, none over 16 MiB, and on 2026-12-03
# 20 MB files did not come back). Here: cat tm.part* | tar xf - -C .tm   gives .tm/text_model/model,
# carried to the next machine instead of training again.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the output folder of the device call}"
back=$OUT
bash scripts/device/install_harts.sh .tw4 .whl >/dev/null || { echo "[text_model_back] install failed" >&2; exit 1; }
export PYTHONPATH=/tmp/harts_site:$PWD
rc=0
OUT=/tmp/tm bash scripts/gpu_run.sh text-model "$@" > /tmp/tm_train.log 2>&1 || rc=$?
tail -n 8 /tmp/tm_train.log
cp /tmp/tm_train.log /tmp/tm/ 2>/dev/null || true
(cd /tmp/tm && tar cf - text_model/model text_model/text_model.json fla_configs.tgz triton_autotune.tgz tm_train.log \
   2>/dev/null | split -b 12m - "$back/tm.part")
ls -la "$back"
exit $rc
