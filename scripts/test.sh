#!/usr/bin/env bash
# Run the test suite. Without a GPU the kernels run through Triton's CPU interpreter.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
exec "$VENV/bin/python" -m pytest -n "${FUSEFORGE_TEST_WORKERS:-2}" "$@" tests
