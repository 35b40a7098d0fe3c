#!/usr/bin/env bash
# The main job, locally: a tiny Llama trained with fuseforge's kernels on, through Flyte's local
# executor, as 2 torch-elastic worker processes on the CPU (kernels run in Triton's interpreter).
# Extra arguments are passed to the workflow, e.g. `bash scripts/demo.sh --steps 40`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
export PATH="$VENV/bin:$PATH"
exec pyflyte run workflows/train.py train --model tiny-llama --steps 20 --kernels "$@"
