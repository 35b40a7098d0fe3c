# Sourced by demo.sh and test.sh: ROOT (the checkout, made the working directory), VENV (the project's
# virtualenv, created on first use by setup_env.sh) and, when torch sees no GPU, TRITON_INTERPRET=1 so
# the Triton kernels run through the CPU interpreter.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(bash "$ROOT/scripts/setup_env.sh")"
cd "$ROOT"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    export TRITON_INTERPRET=1
fi
