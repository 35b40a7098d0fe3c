#!/usr/bin/env bash
# One device call, several named steps, each logged to $OUT/<step>.log (the device tool fetches $OUT).
#   bash benchmarks/on_gpu.sh tests-kernels tune-norms run-headline ...
# Liger-Kernel comes from carried wheels in .whl/ when present. Steps are listed in the case below.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/fuseforge-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD/kernels:$PWD/workflows${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    # .whl/flyte/: flytekit and the parts of its closure the GPU image lacks (for @training_task runs)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        $(ls .whl/flyte/*.whl 2>/dev/null) && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.log"
run_step() {
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    timeout "${STEP_TIMEOUT:-300}" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-25}" "$OUT/$name.log"
}
for step in "$@"; do
    case "$step" in
        tests-kernels) run_step "$step" python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_cross_entropy.py \
            tests/kernels/test_fused_linear_cross_entropy.py tests/kernels/test_rms_norm.py tests/kernels/test_layer_norm.py tests/kernels/test_bad_inputs.py ;;
        tests-all-kernels) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_cross_entropy.py \
            tests/kernels/test_fused_linear_cross_entropy.py tests/kernels/test_rms_norm.py tests/kernels/test_layer_norm.py tests/kernels/test_bad_inputs.py \
            tests/kernels/test_glu.py tests/kernels/test_rope.py tests/kernels/test_jsd.py tests/kernels/test_kl_div.py tests/hf/test_transformers_patching.py ;;
        tests-issue16) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_glu.py tests/kernels/test_jsd.py \
            tests/kernels/test_cross_entropy.py tests/kernels/test_layer_norm.py tests/kernels/test_bad_inputs.py tests/platform/test_data_path.py \
            tests/platform/test_finetune.py -k "not workflow" ;;
        seed-710610153) FUSEFORGE_SEED=710610153 run_step "$step" python3 -m pytest -q -p no:cacheprovider \
            "tests/kernels/test_layer_norm.py::test_layer_norm_matches_reference[torch.float32-(1, 1)]" ;;
        data-path) run_step "$step" python3 benchmarks/bench_data_path.py --data .gpu/chat2048 --json "$OUT/data-path.json" ;;
        tune-norms) run_step "$step" python3 benchmarks/tune.py --op rms_norm --op layer_norm \
            --shape 4096,1024 --shape 2048,16384 --shape 16384,4096 ;;
        tune-split) run_step "$step" python3 benchmarks/tune.py --op rms_norm_split --op layer_norm_split \
            --shape 2048,16384 --shape 8192,8192 ;;
        ce-host) run_step "$step" python3 benchmarks/ce_host.py ;;
        run-headline) run_step "$step" python3 benchmarks/run.py --json "$OUT/headline.json" ;;
        run-ce) run_step "$step" python3 benchmarks/run.py --op cross_entropy --json "$OUT/ce.json" ;;
        run-sweep-norms) run_step "$step" python3 benchmarks/run.py --sweep --op rms_norm --op layer_norm \
            --op fused_add_rms_norm --json "$OUT/sweep-norms.json" ;;
        run-sweep-ce) run_step "$step" python3 benchmarks/run.py --sweep --op cross_entropy --json "$OUT/sweep-ce.json" ;;
        run-sweep) run_step "$step" python3 benchmarks/run.py --sweep --op rms_norm --op layer_norm \
            --op fused_add_rms_norm --op cross_entropy --op swiglu --json "$OUT/sweep.json" ;;
        flce) run_step "$step" python3 benchmarks/bench_flce.py --impls fuseforge,liger ;;
        model) run_step "$step" python3 benchmarks/bench_model.py --variants liger fuseforge ;;
        # LoRA / QLoRA (issues 36, 38): Llama-3-8B r=16, HF+peft vs Liger+peft vs fuseforge+peft, best batch each;
        # one sequence length per device call (6 variants x 90 s). Needs peft 0.21.2, torchao, liger-kernel wheels.
        lora-2048) STEP_TIMEOUT=580 run_step "$step" python3 benchmarks/bench_lora.py --seq 2048 --json "$OUT/lora-2048.json" ;;
        lora-4096) STEP_TIMEOUT=580 run_step "$step" python3 benchmarks/bench_lora.py --seq 4096 --json "$OUT/lora-4096.json" ;;
        tests-lora) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_linear.py \
            tests/hf/test_peft.py ;;
        tests-issue19) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_preference_losses.py \
            tests/kernels/test_grpo_loss.py ;;
        tests-issue18) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/hf/test_trainer_integration.py \
            tests/hf/test_trainer_fused_losses.py ;;
        tests-issue20) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rope.py tests/hf/test_transformers_tiny_models.py \
            tests/hf/test_transformers_patching.py ;;
        tests-export) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/platform/test_model_export.py ;;
        bench-preference) STEP_TIMEOUT=480 run_step "$step" python3 benchmarks/bench_preference.py --out "$OUT/pref.json" ;;
        bench-trainer) STEP_TIMEOUT=480 run_step "$step" python3 benchmarks/bench_trainer.py --out "$OUT/trainer.json" ;;
        bench-trainer-fp32w) STEP_TIMEOUT=480 run_step "$step" python3 benchmarks/bench_trainer.py --fp32-weights --out "$OUT/trainer-fp32w.json" ;;
        engine-llama1b) for k in kernels no-kernels; do STEP_TIMEOUT=240 run_step "$step-$k" python3 -m \
            fuseforge_flyte.training --model llama-1b --dataset bench:synthetic --steps 30 --batch-size 4 \
            --seq-len 2048 --dtype bf16 --$k --output "$OUT/engine-$k.json"; done ;;
        tests-issue19b) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_preference_losses.py \
            tests/kernels/test_grpo_loss.py tests/hf/test_distillation.py tests/hf/test_trainer_fused_losses.py tests/platform/test_posttrain.py ;;
        tests-issue20b) STEP_TIMEOUT=420 run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rope.py \
            tests/kernels/test_clamped_swiglu.py tests/hf/test_transformers_tiny_models.py tests/hf/test_transformers_patching.py \
            tests/hf/test_transformers_convergence.py tests/hf/test_transformers_multimodal.py ;;
        bench-moe) STEP_TIMEOUT=300 run_step "$step" python3 benchmarks/bench_model.py --preset qwen3-moe-30b-a3b-4l \
            --family qwen3_moe --variants eager liger fuseforge --json "$OUT/moe.json" ;;
        bench-vlm) STEP_TIMEOUT=300 run_step "$step" python3 benchmarks/bench_model.py --preset qwen2.5-vl-7b-4l \
            --family qwen2_5_vl --variants eager liger fuseforge --json "$OUT/vlm.json" ;;
        engine-distill) for t in "" llama-1b; do STEP_TIMEOUT=200 run_step "$step-${t:-none}" python3 -m \
            fuseforge_flyte.training --model llama-1b --dataset bench:synthetic --steps 20 --batch-size 4 \
            --seq-len 2048 --dtype bf16 --kernels --teacher "$t" --output "$OUT/distill-${t:-none}.json"; done ;;
        host-ops) run_step "$step" python3 benchmarks/host_overhead.py --profile --json "$OUT/host-ops.json" ;;
        fp8-probe) run_step "$step" python3 -c "
import torch, torchao; from torchao.float8 import convert_to_float8_training
m = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096)).cuda().bfloat16()
convert_to_float8_training(m); print(torchao.__version__, m)
x = torch.randn(8192, 4096, device='cuda', dtype=torch.bfloat16, requires_grad=True)
m(x).float().pow(2).mean().backward(); print('ok', x.grad.abs().mean().item())
mc = torch.compile(m); mc(x).float().sum().backward(); print('compiled ok')" ;;
        plan-llama8b) STEP_TIMEOUT=560 TAIL=40 run_step "$step" python3 benchmarks/plan_llama8b.py \
            --json "$OUT/plan-llama8b.json" ;;
        tests-planner) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/platform/test_planner.py ;;
        fp8-check) STEP_TIMEOUT=540 run_step "$step" python3 benchmarks/fp8_check.py ;;
        tests-fp8-compile) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/platform/test_fp8_compile.py ;;
        tests-issue21) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_custom_ops.py \
            tests/hf/test_compile.py tests/platform/test_master_weights.py tests/platform/test_fp8_compile.py ;;
        model-1b-issue21) STEP_TIMEOUT=420 run_step "$step" python3 benchmarks/bench_model.py --variants liger fuseforge \
            fuseforge+compile --json "$OUT/model-1b.json" ;;
        engine-1b-issue21) for v in "off --no-compile" "auto --no-compile" "off --compile"; do set -- $v; STEP_TIMEOUT=200 \
            run_step "engine-1b-plan-$1$2" python3 -m fuseforge_flyte.training --model llama-1b --dataset bench:synthetic \
            --steps 40 --batch-size 4 --seq-len 2048 --dtype bf16 --kernels --plan $1 $2 --output "$OUT/engine-$1$2.json"; done ;;
        compile-check) STEP_TIMEOUT=300 run_step "$step" python3 benchmarks/compile_check.py ;;
        model-1b-compile) STEP_TIMEOUT=560 run_step "$step" python3 benchmarks/bench_model.py --variants liger fuseforge \
            fuseforge+compile fuseforge-loss+compile fuseforge+compile-layers fuseforge-loss+compile-layers \
            --json "$OUT/model-1b-compile.json" ;;
        model-8b-fp8) STEP_TIMEOUT=560 run_step "$step" python3 benchmarks/bench_model.py --preset llama3-8b --batch 2 \
            --seq 4096 --variants liger fuseforge fuseforge-loss+compile-layers fuseforge+fp8 fuseforge-loss+fp8 \
            --json "$OUT/model-8b-fp8.json" ;;
        plan-llama8b-fp8) STEP_TIMEOUT=590 TAIL=40 run_step "$step" python3 benchmarks/plan_llama8b.py --probe-seconds 40 \
            --variants liger fuseforge+fp8 fuseforge-loss+compile-layers --json "$OUT/plan-llama8b-fp8.json" ;;
        profile-engine) STEP_TIMEOUT=240 TAIL=60 run_step "$step" python3 benchmarks/profile_engine.py ;;
        tests-master-adamw) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_master_adamw.py \
            tests/platform/test_master_weights.py tests/platform/test_training_engine.py -k "not slow" ;;
        model-1b-plain) STEP_TIMEOUT=200 run_step "$step" python3 benchmarks/bench_model.py --variants fuseforge \
            fuseforge+compile-layers --json "$OUT/model-1b-plain.json" ;;
        tests-host-ops) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_glu.py \
            tests/kernels/test_rms_norm.py tests/kernels/test_layer_norm.py tests/kernels/test_rope.py \
            tests/kernels/test_bad_inputs.py tests/kernels/test_custom_ops.py tests/hf/test_compile.py ;;
        run-sweep-rope) run_step "$step" python3 benchmarks/run.py --sweep --op rope --json "$OUT/sweep-rope.json" ;;
        host-rope) run_step "$step" python3 benchmarks/host_overhead.py --op rope --op rms_norm --op swiglu --profile \
            --rounds 15 --json "$OUT/host-rope.json" ;;
        host-rope-only) run_step "$step" python3 benchmarks/host_overhead.py --op rope --rounds 25 --json "$OUT/host-rope-only.json" ;;
        tests-rope-launch) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_launch.py tests/kernels/test_rope.py ;;
        tests-rope) run_step "$step" python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rope.py \
            tests/kernels/test_launch.py tests/kernels/test_custom_ops.py tests/kernels/test_bad_inputs.py tests/hf/test_compile.py ;;
        # the launch cache without the alignment in its key must fail test_launch's misaligned case
        mutation-launch-key) rm -rf /tmp/mut && cp -r . /tmp/mut && sed -i 's/tuple(t.data_ptr() % 16 == 0 for t in tensors),/(),/' \
            /tmp/mut/kernels/fuseforge/ops/_shared/launch.py && (cd /tmp/mut && PYTHONPATH="/tmp/mut/kernels:$PYTHONPATH" run_step "$step" \
            python3 -m pytest -q -p no:cacheprovider tests/kernels/test_launch.py -k misaligned) ;;
        # The residual add fused into the decoder layers' post-attention norm, A/B against HF's add (hf-add), Liger
        model-1b-residual) STEP_TIMEOUT=${STEP_TIMEOUT:-200} TAIL=40 run_step "$step" python3 benchmarks/bench_model.py \
            --variants fuseforge+hf-add fuseforge liger fuseforge+hf-add fuseforge --steps 15 --profile \
            --json "$OUT/model-1b-residual.json" ;;
        tests-residual) STEP_TIMEOUT=${STEP_TIMEOUT:-100} run_step "$step" python3 -m pytest -q -p no:cacheprovider \
            tests/hf/test_transformers_patching.py tests/hf/test_transformers_tiny_models.py -k "decoder_layer or recognised or unpatch" ;;
        model-1b) STEP_TIMEOUT=300 run_step "$step" python3 benchmarks/bench_model.py --variants liger fuseforge \
            --json "$OUT/model-1b.json" ;;
        # Issue 23, on a multi-GPU kind (every visible GPU). DeepSpeed is not in the GPU image: carry its wheel and
        # those of hjson, py-cpuinfo, msgpack, einops and ninja in .whl/ (pip wheel --no-deps deepspeed==0.19.8 builds
        # the pure-Python wheel; pip download the others for cp312 manylinux).
        scaling-ddp-fsdp) STEP_TIMEOUT=590 run_step "$step" python3 benchmarks/bench_scaling.py --parts scaling \
            --strategies ddp fsdp --steps 20 --json "$OUT/$step.json" ;;
        scaling-zero12|scaling-zero3) zero=${step#scaling-}; [ "$zero" = zero12 ] && zero="zero1 zero2"
            STEP_TIMEOUT=590 run_step "$step" python3 benchmarks/bench_scaling.py --parts scaling --strategies $zero \
            --steps 20 --json "$OUT/$step.json" ;;
        scaling-8b) STEP_TIMEOUT=590 run_step "$step" python3 benchmarks/bench_scaling.py --parts scaling \
            --strategies fsdp zero3 --model llama3-8b --batch 1 --seq 4096 --steps 12 --json "$OUT/$step.json" ;;
        lm-head-elastic) STEP_TIMEOUT=590 run_step "$step" python3 benchmarks/bench_scaling.py --parts lm-head elastic \
            --strategies fsdp zero3 --json "$OUT/$step.json" ;;
        engine-1b-eager|engine-1b-compile) compile=--no-compile; [ "$step" = engine-1b-compile ] && compile=--compile
            STEP_TIMEOUT=200 run_step "$step" python3 -m fuseforge_flyte.training --model llama-1b \
            --dataset bench:synthetic --steps 40 --batch-size 4 --seq-len 2048 --dtype bf16 --kernels --plan off $compile \
            --output "$OUT/$step.json" ;;
        *) echo "unknown step $step"; exit 2 ;;
    esac
done
