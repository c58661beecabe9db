#!/usr/bin/env bash
# Create .venv with a Python >= 3.12 and install megatron_harts with its test extras.
# Usage: scripts/setup.sh            (idempotent; re-installs the package in place)
# Env:   HARTS_PYTHON=/path/to/python3.12   to choose the interpreter explicitly;
#        HARTS_UNPINNED=1   to ignore constraints.txt (the tested versions) and take the newest allowed.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  if [ -n "${HARTS_PYTHON:-}" ]; then
    ok "$HARTS_PYTHON" && { echo "$HARTS_PYTHON"; return; }
    echo "HARTS_PYTHON=$HARTS_PYTHON is not a Python >= 3.12" >&2; return 1
  fi
  local c
  # Prefer 3.12 (the tested version), then newer ones: on PATH first, then pyenv's versions.
  for c in python3.12 python3 python3.13 python3.14; do
    if command -v "$c" >/dev/null 2>&1 && ok "$(command -v "$c")"; then command -v "$c"; return; fi
  done
  local root_dir=${PYENV_ROOT:-$HOME/.pyenv}
  for c in $(ls -d "$root_dir"/versions/3.12* 2>/dev/null | sort -rV) \
           $(ls -d "$root_dir"/versions/3.1[3-9]* 2>/dev/null | sort -V); do
    if [ -x "$c/bin/python3" ] && ok "$c/bin/python3"; then echo "$c/bin/python3"; return; fi
  done
  echo "error: no Python >= 3.12 found (looked on PATH, then in $root_dir/versions)." >&2
  echo "       megatron-core 0.19 needs Python >= 3.12; install one or set HARTS_PYTHON." >&2
  return 1
}

# The rollout side's sandboxes run tools under bubblewrap (Debian/Ubuntu package: bubblewrap).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing bubblewrap (sandboxes of megatron_harts.rollout)"
    apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }
  else
    echo "[setup] warning: bwrap (bubblewrap) not found; install it for megatron_harts.rollout's sandboxes" >&2
  fi
fi
if [ ! -x .venv/bin/python ] || ! ok .venv/bin/python; then
  py=$(find_python)
  echo "[setup] creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# constraints.txt pins the versions CI last passed with (a fresh transformers release once broke CI
# overnight); HARTS_UNPINNED=1 installs the newest versions setup.py allows instead.
pins=(-c constraints.txt); [ "${HARTS_UNPINNED:-0}" = 1 ] && pins=()
.venv/bin/python -m pip install -q "${pins[@]}" -e ".[test]"
# WAR's SGLang plugin tests import SGLang 0.5.17 on CPU: installed without its dependencies into its
# own directory (~/.cache/megatron_harts/sglang-0.5.17), never into the venv (it pins another torch)
.venv/bin/python -c 'from megatron_harts.rollout.war.sglang_plugin import sglang_site; print("[setup] SGLang for the WAR plugin tests in", sglang_site())'
.venv/bin/python -c 'import megatron_harts, torch, megatron.core; print("[setup] ok: torch", torch.__version__, "megatron-core", megatron.core.__version__)'
sha256sum setup.py constraints.txt > .venv/.harts-setup-stamp   # test.sh / demo.sh re-run setup when either changes
