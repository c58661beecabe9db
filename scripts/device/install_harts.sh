#!/usr/bin/env bash
# On the GPU machine, one call per folder, back to back (/tmp survives only while the machine is
# warm): bash scripts/device/install_harts.sh .tw1 | .tw2 | .tw3 | ".tw4 .whl"
# (folders made here by shared/device/prepare_wheels.sh). The call with .tw4 reassembles Triton
# 3.7.1 and installs it with .whl/* (megatron-core, fla) into /tmp/harts_site: the trainer's
# PYTHONPATH, kept apart from SGLang's /tmp/site (install_sglang.sh), whose server runs on the
# machine's own Triton.
set -euo pipefail
mkdir -p /tmp/twparts
for d in "$@"; do
  case "$d" in
    .tw[123]) cp "$d"/part* /tmp/twparts/ ;;
    .tw4)
      cp "$d"/part* /tmp/twparts/
      name=$(cat "$d/NAME")
      cat /tmp/twparts/part0 /tmp/twparts/part1 /tmp/twparts/part2 /tmp/twparts/part3 > "/tmp/$name"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/harts_site \
        "/tmp/$name" .whl/*.whl
      PYTHONPATH=/tmp/harts_site python3 -c 'import triton, fla, megatron.core as m; print("[install] harts stack: triton", triton.__version__, "megatron-core", m.__version__)' ;;
    .whl) ;;
    *) echo "unknown folder $d" >&2; exit 2 ;;
  esac
done
ls /tmp/twparts
