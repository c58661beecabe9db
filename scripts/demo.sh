#!/usr/bin/env bash
# Set up (if needed) and run the demo (python -m megatron_harts.demo). Extra args go to the demo.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
sha256sum --quiet -c .venv/.harts-setup-stamp 2>/dev/null || bash scripts/setup.sh
exec .venv/bin/python -m megatron_harts.demo "$@"
