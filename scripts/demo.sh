#!/usr/bin/env bash
# The main job, locally: a tiny Llama trained with fuseforge's kernels on, through Flyte's local
# executor, as 2 torch-elastic worker processes on the CPU (kernels run in Triton's interpreter).
# Extra arguments are passed to the workflow, e.g. `bash scripts/demo.sh --steps 40`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_prelude.sh"
export PATH="$VENV/bin:$PATH"
exec pyflyte run workflows/train.py train --model tiny-llama --steps 20 --kernels "$@"
