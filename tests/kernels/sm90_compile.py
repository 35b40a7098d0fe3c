"""Compile every fuseforge Triton kernel for Hopper (sm_90) without a GPU.

Run as a script (by tests/kernels/test_sm90_compile.py) in a process WITHOUT TRITON_INTERPRET,
so that @triton.jit builds real JIT functions; triton.compile then lowers them through
TTIR/TTGIR/LLVM to PTX and runs the bundled ptxas for sm_90. This catches what the CPU
interpreter cannot: constructs the GPU compiler rejects, wrong constexpr handling,
type errors in branches the interpreter never takes. Prints one line per kernel variant;
with --resources also its registers, stack, shared memory and spill (LOCAL) bytes.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fuseforge.ops import cross_entropy as ce
from fuseforge.ops import glu, jsd, kl_div, layer_norm, master_adamw, nf4, rms_norm, rope
from fuseforge.ops import targets
from fuseforge.ops._shared import cross_entropy_tiles, rowwise, scaling
from fuseforge.ops._shared import vocab_major_cross_entropy as vm

TARGET = GPUTarget("cuda", 90, 32)
# `--resources`: also print each variant's registers and spills (LOCAL > 0 means spilled).
RESOURCES = "--resources" in sys.argv
FLOAT_ARGS = {"softcap", "label_smoothing", "z_loss_scale", "eps", "offset", "beta", "inv_temperature",
              "lr", "beta1", "beta2", "weight_decay", "step_size", "bias_correction2_sqrt"}


def signature(kernel, pointers: dict, dtype: str) -> dict:
    """Triton signature: listed pointers (None = the data dtype), UPPER constexprs, floats, else i32."""
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in pointers:
            sig[name] = pointers[name] or dtype
        elif name.isupper():
            sig[name] = "constexpr"
        elif name in FLOAT_ARGS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def resource_usage(cubin: bytes) -> str:
    """Registers, stack, shared and local (spill) bytes per thread, from the cuobjdump Triton ships."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    match = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", out)
    return match.group(0) if match else "resource usage unavailable"


def compile_for_sm90(kernel, pointers: dict, dtype: str, constexprs: dict, num_warps: int = 8) -> None:
    src = ASTSource(fn=kernel, signature=signature(kernel, pointers, dtype), constexprs=constexprs)
    compiled = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    assert "sm_90" in compiled.asm["ptx"] or ".target" in compiled.asm["ptx"]
    usage = f" [{resource_usage(compiled.asm['cubin'])}]" if RESOURCES else ""
    print(f"ok {kernel.__name__} {dtype} {constexprs}{usage}", flush=True)


def data(*names):
    return {n: None for n in names}


def main() -> int:
    f32, i64 = "*fp32", "*i64"
    for dt in ("*bf16", "*fp16", "*fp32"):
        compile_for_sm90(nf4._nf4_dequantize_kernel, {"packed_ptr": "*u8", **data("scalers_ptr", "table_ptr", "out_ptr")},
                         dt, dict(BLOCK_SIZE=64, EMULATE_RNE=False, BYTES=nf4._BYTES_PER_PROGRAM))
    for grad, copy in (("*bf16", "*bf16"), ("*fp32", "*bf16"), ("*fp16", "*fp16")):
        compile_for_sm90(master_adamw._master_adamw_kernel,
                         {"master_ptr": f32, "grad_ptr": grad, "exp_avg_ptr": f32, "exp_avg_sq_ptr": f32,
                          "copy_ptr": copy, "grad_scale_ptr": f32}, grad,
                         dict(HAS_GRAD_SCALE=True, EMULATE_RNE=False, BLOCK=master_adamw._BLOCK))
    for dt in ("*bf16", "*fp16", "*fp32"):
        for softcap in (False, True):
            for smoothing in (False, True):  # the sum of z is only accumulated with label smoothing
                stats = dict(HAS_SOFTCAP=softcap, HAS_SMOOTHING=smoothing)
                compile_for_sm90(ce._ce_stats_kernel, {**data("x_ptr"), "target_ptr": i64, "stats_ptr": f32}, dt,
                                 dict(stats, BLOCK_T=1, BLOCK_V=4096))
                compile_for_sm90(vm._stats_kernel, {**data("x_ptr"), "target_ptr": i64, "stats_ptr": f32}, dt,
                                 dict(stats, BLOCK_T=64, BLOCK_V=64))
            compile_for_sm90(ce._ce_grad_kernel, {**data("x_ptr", "g_ptr"), "target_ptr": i64, "lse_ptr": f32,
                                                  "scale_ptr": f32}, dt,
                             dict(HAS_SOFTCAP=softcap, SCALE_PER_ROW=softcap, BLOCK_T=1, BLOCK_V=4096))
            compile_for_sm90(vm._grad_kernel, {**data("x_ptr"), "target_ptr": i64, "lse_ptr": f32, "scale_ptr": f32},
                             dt, dict(HAS_SOFTCAP=softcap, SCALE_PER_TOKEN=softcap, BLOCK_T=64, BLOCK_V=64))
        compile_for_sm90(scaling._scale_unless_one_kernel, {**data("x_ptr"), "factor_ptr": dt}, dt,
                         dict(EMULATE_RNE=False, BLOCK=scaling._BLOCK))
        norm_cons = dict(COMPUTE=tl.float32, EMULATE_RNE=False, ROW_BLOCK=1, BLOCK_N=4096)
        compile_for_sm90(rms_norm._rms_norm_fwd_kernel, {**data("X", "R", "S", "Y", "W"), "RSTD": f32}, dt,
                         dict(HAS_RESIDUAL=True, ROUND_NORMED=True, **norm_cons))
        compile_for_sm90(rms_norm._rms_norm_bwd_kernel, {**data("X", "DY", "DS", "W", "DX"), "RSTD": f32,
                                                         "DW_PARTIAL": f32}, dt,
                         dict(HAS_DS=True, STORE_DX=True, STORE_DW=True, ROUND_NORMED=True, **norm_cons))
        compile_for_sm90(layer_norm._layer_norm_fwd_kernel, {**data("X", "Y", "W", "B"), "MEAN": f32, "RSTD": f32}, dt,
                         dict(HAS_WEIGHT=True, HAS_BIAS=True, **norm_cons))
        compile_for_sm90(layer_norm._layer_norm_bwd_kernel, {**data("X", "DY", "W", "DX"), "MEAN": f32, "RSTD": f32,
                                                             "DW_PARTIAL": f32, "DB_PARTIAL": f32}, dt,
                         dict(HAS_WEIGHT=True, STORE_DX=True, STORE_DW=True, STORE_DB=True, **norm_cons))
        for has_mean in (False, True):  # RMSNorm's dw (normed rounded), LayerNorm's dw and db
            compile_for_sm90(rowwise._param_grads_kernel, {**data("X", "DY"), "MEAN": f32, "RSTD": f32,
                                                           "DW_PARTIAL": f32, "DB_PARTIAL": f32}, dt,
                             dict(HAS_MEAN=has_mean, STORE_DW=True, STORE_DB=has_mean, ROUND_NORMED=not has_mean,
                                  COMPUTE=tl.float32, EMULATE_RNE=False, BLOCK_R=16, BLOCK_C=256), num_warps=4)
        for activation in (0, 1, 2):
            glu_cons = dict(ACTIVATION=activation, BLOCK_R=1, BLOCK_C=4096, FP64=False)
            compile_for_sm90(glu._glu_forward_kernel, data("gate_ptr", "up_ptr", "out_ptr"), dt, glu_cons)
            compile_for_sm90(glu._glu_backward_kernel,
                             data("grad_out_ptr", "gate_ptr", "up_ptr", "grad_gate_ptr", "grad_up_ptr"), dt, glu_cons)
        for backward in (False, True):
            compile_for_sm90(rope._rope_kernel, data("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr", "cos_ptr", "sin_ptr"),
                             dt, dict(HALF=48, HEAD_DIM=128, BLOCK_T=1, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64,
                                      BLOCK_PASS=32, BACKWARD=backward, FP64=False), num_warps=4)
        for beta_mode in (0, 1, 2):
            jsd_cons = dict(HAS_TARGET=True, BETA_MODE=beta_mode, COMPUTE_GRAD=True, BLOCK_ROWS=1, BLOCK_COLS=4096)
            compile_for_sm90(jsd._jsd_logp_kernel, {**data("s_ptr", "t_ptr", "grad_ptr"), "target_ptr": i64,
                                                    "loss_ptr": f32, "scale_ptr": f32}, dt, jsd_cons)
            compile_for_sm90(jsd._jsd_logits_kernel, {**data("zs_ptr", "zt_ptr"), "target_ptr": i64,
                                                      "loss_ptr": f32, "scale_ptr": f32}, dt, jsd_cons)
        for log_target in (False, True):
            compile_for_sm90(kl_div._kl_div_forward_kernel, {**data("x_ptr", "y_ptr"), "out_ptr": f32}, dt,
                             dict(LOG_TARGET=log_target, ELEMENTWISE=False, BLOCK=2048))
            compile_for_sm90(kl_div._kl_div_backward_kernel, data("x_ptr", "y_ptr", "g_ptr", "grad_x_ptr", "grad_y_ptr"),
                             dt, dict(LOG_TARGET=log_target, ELEMENTWISE_GRAD=False, NEED_GRAD_X=True,
                                      NEED_GRAD_Y=True, BLOCK=2048))
    for second in (False, True):
        compile_for_sm90(rowwise._sum_partials_kernel, {"P1": f32, "OUT1": "*bf16", "P2": f32, "OUT2": f32}, f32,
                         dict(HAS_SECOND=second, EMULATE_RNE=False, BLOCK_P=64, BLOCK_N=64), num_warps=4)
    compile_for_sm90(targets._scan_targets_kernel, {"target_ptr": i64, "inv_count_ptr": f32, "found_ptr": i64}, f32,
                     dict(BLOCK=targets._BLOCK))
    compile_for_sm90(cross_entropy_tiles.ce_finalize_kernel, {"stats_ptr": f32, "target_ptr": i64, "loss_ptr": f32, "lse_ptr": f32},
                     f32, dict(HAS_SMOOTHING=True, HAS_Z_LOSS=True, BLOCK_T=64, BLOCK_S=32), num_warps=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
