#!/usr/bin/env bash
# Create (or reuse) the project's virtualenv with torch and every test/platform dependency.
# torch is installed first and pinned, so no later requirement can pull another build.
# Without an NVIDIA GPU (no nvidia-smi, no /dev/nvidia*) torch comes from PyTorch's CPU wheel index, added
# as an extra index: on Linux x86_64 a plain `pip install torch` from PyPI is the multi-GB CUDA build.
# Env: FUSEFORGE_VENV (the virtualenv), FUSEFORGE_TORCH (the torch pip spec, default torch==2.13.0),
#      FUSEFORGE_TORCH_INDEX (the extra wheel index for torch; default: the CPU index without a GPU, none
#      with one; "" for none), FUSEFORGE_REINSTALL=1 (install again), FUSEFORGE_CPU_TORCH_INDEX (that CPU
#      index), FUSEFORGE_TORCH_INDEX_CHECK=off (use the default index without checking that it answers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${FUSEFORGE_VENV:-$ROOT/.venv}"
TORCH_SPEC="${FUSEFORGE_TORCH:-torch==2.13.0}"
CPU_TORCH_INDEX="${FUSEFORGE_CPU_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

has_nvidia_gpu() {
    command -v nvidia-smi >/dev/null 2>&1 && return 0
    compgen -G "/dev/nvidia[0-9]*" >/dev/null 2>&1
}

if [ -n "${FUSEFORGE_TORCH_INDEX+set}" ]; then
    TORCH_INDEX="$FUSEFORGE_TORCH_INDEX"
elif has_nvidia_gpu; then
    TORCH_INDEX=""
else
    TORCH_INDEX="$CPU_TORCH_INDEX"
    CHECK_TORCH_INDEX="${FUSEFORGE_TORCH_INDEX_CHECK:-on}"
fi

if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import fuseforge, fuseforge_flyte, flytekit, pytest, trl, uv, material, mkdocstrings_handlers.python" >/dev/null 2>&1 || [ "${FUSEFORGE_REINSTALL:-0}" = 1 ]; then
    "$PY" -m pip install -q --upgrade pip
    # The default CPU index cannot be reached from some machines (no DNS for it): it would only add pip's
    # retries, so say so once and take torch from PyPI (on Linux x86_64 its CUDA build, which also runs
    # on the CPU). An index set in FUSEFORGE_TORCH_INDEX is used as given.
    if [ "${CHECK_TORCH_INDEX:-off}" != off ] && ! python3 - "$TORCH_INDEX" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1] + "/", timeout=10)
PY
    then
        echo "setup_env: $TORCH_INDEX cannot be reached from this machine; installing $TORCH_SPEC from PyPI" >&2
        TORCH_INDEX=""
    fi
    # An extra index (not --index-url): pip's own index and any local wheelhouse it is configured with
    # stay in use; among equal versions the index's local build (2.13.0+cpu) ranks above PyPI's.
    if [ -n "$TORCH_INDEX" ]; then
        echo "setup_env: installing $TORCH_SPEC with extra index $TORCH_INDEX" >&2
        "$PY" -m pip install -q --extra-index-url "$TORCH_INDEX" "$TORCH_SPEC"
    else
        echo "setup_env: installing $TORCH_SPEC" >&2
        "$PY" -m pip install -q "$TORCH_SPEC"
    fi
    # DeepSpeed: no CUDA/C++ ops at install time (they JIT-compile on first use, if ever).
    DS_BUILD_OPS=0 "$PY" -m pip install -q -e "$ROOT[dev]"
fi
echo "$VENV"
