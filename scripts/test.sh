#!/usr/bin/env bash
# Run the test suite. Without a GPU the kernels run through Triton's CPU interpreter.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_prelude.sh"
exec "$VENV/bin/python" -m pytest -n "${FUSEFORGE_TEST_WORKERS:-2}" "$@" tests
