#!/usr/bin/env bash
# The main job, locally: a small supervised fine-tuning through Flyte's local executor. A tiny Llama is
# trained with fuseforge's kernels on the shipped chat data (BPE tokenizer, chat template, loss on the
# assistant turns only, packed, 10% held out for eval) as 2 torch-elastic worker processes on the CPU
# (kernels run in Triton's interpreter); the trained model comes back as a Hugging Face directory, is
# loaded by plain transformers and answers a few questions.
# Extra arguments are passed to the workflow, e.g. `bash scripts/demo.sh --steps 200`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_prelude.sh"
export PATH="$VENV/bin:$PATH"
exec pyflyte run workflows/demo.py demo "$@"
