#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with a CPU torch and every test/platform dependency.
# torch is installed first and pinned, so no later requirement can pull a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FUSEFORGE_VENV:-$ROOT/.venv}"
TORCH_SPEC="${FUSEFORGE_TORCH:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import fuseforge, fuseforge_flyte, flytekit, pytest" >/dev/null 2>&1 || [ "${FUSEFORGE_REINSTALL:-0}" = 1 ]; then
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q "$TORCH_SPEC"
    # DeepSpeed: no CUDA/C++ ops at install time (they JIT-compile on first use, if ever).
    DS_BUILD_OPS=0 "$PY" -m pip install -q -e "$ROOT[dev]"
fi
echo "$VENV"
