"""LoRA / QLoRA (peft) under apply_kernels: training equal to unpatched peft, no gradients for frozen weights,
models patched before peft wrapped them, exports that plain peft / transformers load, training on from them.

Tiny fp32 models (Llama, Qwen3, Gemma 3, Qwen3-MoE) get LoRA on every linear layer (peft's "all-linear":
attention and MLP projections, the LM head left frozen and fused), adapters in the model's dtype; QLoRA stores
the frozen projections as torchao NF4, identically in both runs. Each pair trains 10 AdamW steps from the same
weights and batches: per-step losses, the first step's adapter gradients (by name) and the final adapters agree
to fp32 tolerance, and every frozen weight ends without a gradient.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tolerances import assert_close

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_transformers_tiny_models import (  # noqa: E402
    DEVICE,
    MOE_FAMILIES,
    single_thread,  # noqa: F401 - autouse fixture
    synthetic_batches,
    tiny_model,
)

import fuseforge.transformers as ff  # noqa: E402
from fuseforge.transformers import loss as loss_module  # noqa: E402
from fuseforge.transformers.lora import FusedLoraLinearMixin, quantize_base_nf4  # noqa: E402
from peft_support import load_without_fuseforge  # noqa: E402 - tests/support

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

FP32 = torch.float32
STEPS, LR = 10, 3e-3
FAMILIES = ("llama", "qwen3", "gemma3", "qwen3_moe")
NF4_BLOCKS = dict(block_size=16, scaler_block_size=8)  # tiny weights: 2048-element matrices split evenly


def lora_config(**overrides) -> "peft.LoraConfig":
    return peft.LoraConfig(**{**dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"), **overrides})


def peft_model(family: str, *, qlora: bool = False, **config):
    """A tiny model of `family` with LoRA adapters (B initialised away from 0, so every adapter gradient is live)."""
    model = tiny_model(family, **({"experts_implementation": "eager"} if family in MOE_FAMILIES else {}))
    model = peft.get_peft_model(model, lora_config(**config), autocast_adapter_dtype=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    if qlora:
        assert quantize_base_nf4(model, **NF4_BLOCKS)
    return model.train()


class NewTensorShapes(TorchDispatchMode):
    """Shapes of the tensors ops allocate (views of existing storage left out)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t._is_view() and t.untyped_storage().data_ptr() not in inputs:
                self.shapes.append(tuple(t.shape))
        return out


def frozen_weight_shapes(model) -> set[tuple[int, ...]]:
    return {tuple(p.shape) for p in model.parameters() if not p.requires_grad and p.dim() == 2}


def adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_training_matches_unpatched_peft(family, qlora):
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    ref = peft_model(family, qlora=qlora)
    torch.manual_seed(seed)  # the same model again (torchao's NF4 tensors lose their block sizes in a deepcopy)
    fused = peft_model(family, qlora=qlora)
    report = ff.apply_kernels(fused)
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy", "lora"} <= set(report.patched_kernels()), report
    assert any("PEFT: LoRA adapter(s) default" in note for note in report.notes), report.notes
    assert any("QLoRA" in note for note in report.notes) == qlora
    lora_modules = [m for m in fused.modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    assert lora_modules and all(isinstance(m, FusedLoraLinearMixin) for m in lora_modules)
    frozen = [n for n, p in fused.named_parameters() if not p.requires_grad]
    assert "base_model.model.lm_head.weight" in frozen or family == "gemma3"  # gemma3 ties it to the embedding

    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    opt_fused = torch.optim.AdamW([p for p in fused.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    losses_ref, losses_fused = [], []
    for step, batch in enumerate(synthetic_batches(STEPS)):
        out_ref = ref(**batch)
        out_ref.loss.backward()
        # NF4 weights are dequantized per matmul ([out, in], not a gradient); peft's LoRA on MoE expert tensors
        # (lora.ParamWrapper) builds the [out, in] delta weights by design: the allocation check is for the rest.
        if step == 0 and not qlora and family not in MOE_FAMILIES:
            spy = NewTensorShapes()
            with spy:
                out_fused = fused(**batch)
                out_fused.loss.backward()
            banned = frozen_weight_shapes(fused)
            assert banned and not set(spy.shapes) & banned, set(spy.shapes) & banned  # no [out, in] buffer
        else:
            out_fused = fused(**batch)
            out_fused.loss.backward()
        assert out_fused.logits is None
        if step == 0:
            grads, grads_ref = adapter_grads(fused), adapter_grads(ref)
            assert set(grads) == set(grads_ref) and all("lora_" in n for n in grads)
            for name, g in grads.items():
                assert g is not None and g.abs().sum() > 0, name
                assert_close(g, grads_ref[name], FP32, msg=f"step 0 grad {name}")
            assert all(p.grad is None for p in fused.parameters() if not p.requires_grad)
        for opt in (opt_ref, opt_fused):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses_ref.append(out_ref.loss.item())
        losses_fused.append(out_fused.loss.item())
    assert_close(torch.tensor(losses_fused), torch.tensor(losses_ref), FP32, msg="per-step losses")
    assert min(losses_ref[-3:]) < losses_ref[0], losses_ref
    for (name, p), (_, p_ref) in zip(fused.named_parameters(), ref.named_parameters()):
        if p.requires_grad:
            assert (p.detach() - p_ref.detach()).abs().max() <= LR / 4, name


def test_model_patched_before_peft_keeps_every_kernel(monkeypatch):
    """apply_kernels, then get_peft_model: norms, RoPE, MLP and the fused loss still run, with peft's own LoRA
    forward; apply_kernels on the PeftModel then takes the patch over and fuses the LoRA layers too."""
    calls = []
    real = loss_module.fused_linear_cross_entropy
    monkeypatch.setattr(loss_module, "fused_linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    base = tiny_model("llama").train()
    reference = peft.get_peft_model(copy.deepcopy(base), lora_config(), autocast_adapter_dtype=False)
    first = ff.apply_kernels(base)
    wrapped = peft.get_peft_model(base, lora_config(), autocast_adapter_dtype=False)
    wrapped.load_state_dict(reference.state_dict())
    batch = synthetic_batches(1)[0]
    out = wrapped(**batch)
    assert out.logits is None and calls == [1]
    assert_close(out.loss, reference(**batch).loss, FP32)
    assert type(base.model.norm).__name__.startswith("Fused") and ff.is_patched(base)

    report = ff.apply_kernels(wrapped)
    assert report is not first and not ff.is_patched(base) and ff.is_patched(wrapped)
    assert report.patched["lora"] and report.patched["fused_linear_cross_entropy"], report
    assert_close(wrapped(**batch).loss, reference(**batch).loss, FP32)
    assert calls == [1, 1]
    wrapped.add_adapter("other", lora_config(target_modules=["q_proj"]))
    wrapped.base_model.model.model.layers[0].self_attn.q_proj  # still the fused class: adapters live in its dicts
    assert ff.apply_kernels(wrapped) is report  # same options: the same patch, new LoRA layers fused
    assert ff.unpatch(wrapped)
    assert not any(type(m).__name__.startswith("Fused") for m in wrapped.modules())


def test_trainable_lm_head_copy_of_modules_to_save_trains_through_the_fused_loss():
    """modules_to_save=["lm_head"]: peft trains a copy of the head; the fused loss reads whichever head peft's forward
    would use (the copy, or the frozen original with adapters disabled), with the copy's gradient and none for the
    original."""
    seed = int(torch.randint(0, 2**31, ()))
    torch.manual_seed(seed)
    ref = peft_model("llama", modules_to_save=["lm_head"])
    torch.manual_seed(seed)
    fused = peft_model("llama", modules_to_save=["lm_head"])
    report = ff.apply_kernels(fused)
    assert report.patched["fused_linear_cross_entropy"] == {"LlamaForCausalLM (lm_head and its 1 modules_to_save copies)": 1}
    opt_ref = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    opt_fused = torch.optim.AdamW([p for p in fused.parameters() if p.requires_grad], lr=LR, eps=1e-6)
    for step, batch in enumerate(synthetic_batches(3)):
        out, out_ref = fused(**batch), ref(**batch)
        assert out.logits is None
        assert_close(out.loss, out_ref.loss, FP32, msg=f"step {step} loss")
        out.loss.backward()
        out_ref.loss.backward()
        copy_grad = fused.base_model.model.lm_head.modules_to_save["default"].weight.grad
        assert copy_grad is not None and fused.base_model.model.lm_head.original_module.weight.grad is None
        assert_close(copy_grad, ref.base_model.model.lm_head.modules_to_save["default"].weight.grad, FP32)
        for opt in (opt_ref, opt_fused):
            opt.step()
            opt.zero_grad(set_to_none=True)
    batch = synthetic_batches(1)[0]
    with fused.disable_adapter(), ref.disable_adapter():  # the original head again
        assert_close(fused(**batch).loss, ref(**batch).loss, FP32)


def test_lora_on_the_lm_head_keeps_the_loss_unfused_and_says_so():
    model = peft_model("llama", target_modules=["q_proj", "lm_head"])
    report = ff.apply_kernels(model)
    assert "fused_linear_cross_entropy" not in report.patched, report
    assert any("lm_head is Linear" in reason or "lm_head is" in reason
               for reason in report.skipped["fused_linear_cross_entropy"]), report
    batch = synthetic_batches(1)[0]
    reference = copy.deepcopy(model)
    ff.unpatch(reference)
    assert_close(model(**batch).loss, reference(**batch).loss, FP32)




def test_adapter_and_merged_exports_load_without_fuseforge_and_train_on(tmp_path):
    base_dir, adapter_dir, merged_dir = (str(tmp_path / n) for n in ("base", "adapter", "merged"))
    tiny_model("llama").save_pretrained(base_dir)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(DEVICE)
    model = peft.get_peft_model(base, lora_config(), autocast_adapter_dtype=False).train()
    ff.apply_kernels(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for batch in synthetic_batches(3):
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    ids = synthetic_batches(1)[0]["input_ids"]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    ff.unpatch(model)
    model.save_pretrained(adapter_dir)
    assert set(os.listdir(adapter_dir)) == {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    merged = copy.deepcopy(model).merge_and_unload()
    merged.save_pretrained(merged_dir)
    logits = load_without_fuseforge(base_dir, adapter_dir, merged_dir, ids, tmp_path)
    assert_close(logits["adapter"], expected.cpu(), FP32, magnitude=4)
    assert_close(logits["merged"], expected.cpu(), FP32, magnitude=4)

    # training on from the adapter directory, patched: the adapter is trainable again and learns
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(DEVICE)
    again = peft.PeftModel.from_pretrained(base, adapter_dir, is_trainable=True).train()
    assert ff.apply_kernels(again).patched["lora"]
    opt = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=LR)
    batch = synthetic_batches(1)[0]
    first = again(**batch).loss
    for _ in range(3):
        loss = again(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert again(**batch).loss < first


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke mode is the CPU's check of the GPU benchmark; a GPU "
                    "machine runs the benchmark itself (Triton's interpreter there is not the one CI tests)")
def test_lora_benchmark_runs_end_to_end_in_smoke_mode(tmp_path):
    """benchmarks/bench_lora.py --smoke: the GPU benchmark's whole path (build, peft, NF4, apply_kernels, the
    batch search, the table, the JSON) on a tiny model, so that a device call does not fail on a typo."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "bench_lora.py"), "--smoke", "--seq", "16",
                           "--libraries", "hf", "fuseforge", "--quant", "nf4", "--batches", "1", "2", "--steps", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", FUSEFORGE_BENCH_FAKE_OOM="2"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())["results"]
    assert [r["variant"] for r in results] == ["hf:nf4", "fuseforge:nf4"]
    for r in results:  # batch 1 fits, batch 2 "runs out of memory", then fits with checkpointing
        assert [(p["batch"], p["ckpt"], p["oom"]) for p in r["probes"]] == [(1, False, False), (2, False, True),
                                                                           (2, True, False)], r["probes"]
        assert r["best"]["loss"] > 0
    assert "fused: rms_norm, rope, swiglu, fused_linear_cross_entropy, lora" in results[1]["note"]
    assert "| fuseforge:nf4 |" in proc.stdout and "2+ckpt:" in proc.stdout
