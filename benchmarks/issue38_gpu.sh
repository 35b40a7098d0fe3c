#!/usr/bin/env bash
# Issue 38's device calls (LoRA/QLoRA benchmark, GPU tests on what changed, the 8B searches), one step per argument:
#   bash benchmarks/issue38_gpu.sh env lora-2048 lora-4096 tests profile-4096 plan-llama8b
# Logs and JSON go to $OUT (the device tool brings them back). peft 0.21.2, torchao 0.18.0 and liger-kernel 0.8.5
# come from carried wheels in .whl/. Each step's limit is STEP_S (seconds); keep the sum under one 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fuseforge-out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/kernels:$PWD/workflows${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site/peft ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PYTHONPATH:/tmp/site"
step() {  # name limit_s command...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"; local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-30}" "$OUT/$name.log"
}
for s in "$@"; do
    case "$s" in
        env) { cat REV36 2>/dev/null || git log -1 --format='%H %s'
               nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
               python3 -c "import sys, torch, triton, transformers, peft, torchao, liger_kernel, importlib.metadata as m
print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers',
      transformers.__version__, 'peft', peft.__version__, 'torchao', torchao.__version__, 'liger', m.version('liger-kernel'),
      'peft from', peft.__file__)" 2>&1 | grep -v Warn; } | tee "$OUT/env.log" ;;
        lora-2048|lora-4096) seq=${s#lora-}
            TAIL=40 step "$s" "${STEP_S:-570}" python3 benchmarks/bench_lora.py --seq "$seq" --json "$OUT/$s.json" ;;
        profile-*) seq=${s#profile-}  # where the QLoRA step goes: HF + peft and fuseforge + peft, best layout each
            TAIL=80 step "$s" "${STEP_S:-300}" python3 benchmarks/bench_lora.py --seq "$seq" --quant nf4 \
                --libraries hf fuseforge --profile --timeout "${VARIANT_S:-140}" --json "$OUT/$s.json" ;;
        tests) TAIL=25 step "$s" "${STEP_S:-330}" python3 -m pytest -q -p no:cacheprovider -n 4 -rf \
                tests/kernels tests/hf/test_peft.py tests/platform/test_lora_engine.py -k "not workflow" ;;
        plan-llama8b) TAIL=40 step "$s" "${STEP_S:-560}" python3 benchmarks/plan_llama8b.py --variants eager fuseforge \
                --json "$OUT/plan-llama8b.json" ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
