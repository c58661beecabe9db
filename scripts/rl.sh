#!/usr/bin/env bash
# Set up (if needed) and run the on-policy agentic RL loop (python -m megatron_harts.rollout).
# Default: CPU, the embedded transformers engine (not SGLang), a tiny model, 2 steps, sandboxed
# lookup tasks. Extra args go to the loop (--help lists them; --engine sglang --device cuda on a GPU).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
sha256sum --quiet -c .venv/.harts-setup-stamp 2>/dev/null || bash scripts/setup.sh
exec .venv/bin/python -m megatron_harts.rollout "$@"
