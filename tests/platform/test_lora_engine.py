"""LoRA / QLoRA runs of the training engine (training/lora.py): adapters only, trained-only checkpoints and their
exact resume, DDP and FSDP2 on 2 gloo workers, the PEFT-format adapter and the merged model loaded without
fuseforge, either as the next run's model, and bad settings refused before any worker starts.

CPU, fp32, kernels off unless a test says so (tests/hf/test_peft.py checks the kernels under peft).
"""

import json
import os
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from fuseforge_flyte.training import outputs  # noqa: E402
from fuseforge_flyte.training.engine import train  # noqa: E402
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault  # noqa: E402
from fuseforge_flyte.training.local import run_local  # noqa: E402
from fuseforge_flyte.training.models import build_model  # noqa: E402
from fuseforge_flyte.training.spec import TrainSpec  # noqa: E402
import forking  # noqa: E402 - tests/support
from peft_support import load_without_fuseforge  # noqa: E402 - tests/support

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")

STEPS = 6


def _spec(**overrides):
    base = dict(model="tiny-llama", dataset="bench:bytes", steps=STEPS, batch_size=4, seq_len=32, lr=3e-2,
                kernels=False, seed=7, lora=True, lora_rank=4, lora_alpha=8.0)
    base.update(overrides)
    return TrainSpec(**base)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module")
def reference():
    return train(_spec())


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """tiny-llama's random init saved as a Hugging Face directory: a base model plain transformers can load."""
    path = str(tmp_path_factory.mktemp("base") / "tiny-llama")
    model = build_model("tiny-llama", seed=1, device=torch.device("cpu"))
    model.config.use_cache = True
    model.save_pretrained(path)
    return path


def test_lora_run_learns_with_the_base_frozen_and_checkpoints_hold_only_adapters(reference, tmp_path, monkeypatch):
    assert reference.loss_curve[-1] < reference.loss_curve[0] - 0.2
    spec = _spec(checkpoint_dir=str(tmp_path), checkpoint_every=2, keep_last=5)
    monkeypatch.setenv(FAULT_ENV, "0:3:raise")  # a crash after step 3: the step-2 checkpoint is the newest
    with pytest.raises(InjectedFault):
        train(spec)
    monkeypatch.delenv(FAULT_ENV)
    state = torch.load(tmp_path / "step_00000002" / "model.pt", weights_only=True)
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state), sorted(state)[:5]
    manifest = json.loads((tmp_path / "step_00000002" / "COMPLETE.json").read_text())
    assert "model.pt" in json.dumps(manifest)  # the signed manifest lists (and hashes) the trained-only file
    resumed = train(spec)
    assert resumed.resumed_from_step == 2
    assert resumed.loss_curve == reference.loss_curve  # bitwise: adapters, optimizer, schedule, data order


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_workers_match_one_process(reference, strategy):
    results = run_local(_spec(strategy=strategy, batch_size=2), 2, start_method=forking.start_method())
    assert sorted(results) == [0, 1]
    torch.testing.assert_close(results[0].loss_curve, reference.loss_curve, rtol=2e-5, atol=2e-5)
    assert results[0].loss_curve == results[1].loss_curve


def _lora_loss(model, strategy_forward=None):
    ids = torch.randint(0, 259, (2, 16), generator=torch.Generator().manual_seed(3))
    return (strategy_forward or (lambda b, last: model(**b).loss))({"input_ids": ids, "labels": ids}, True)


def _fsdp_kernels_worker():
    """FSDP2 unshards each decoder layer for its forward: the fused LoRA linear runs on the gathered weights."""
    from fuseforge.ops import lora as lora_op
    from fuseforge.transformers import apply_kernels
    from fuseforge_flyte.training import lora, strategies
    from fuseforge_flyte.training.distributed import DistContext

    torch.set_num_threads(1)
    calls = []
    real = lora_op._LoraLinear.apply
    lora_op._LoraLinear.apply = lambda *a: calls.append(1) or real(*a)  # a forked worker: dies with it
    ctx = DistContext.from_env(need_group=True)
    try:
        spec = _spec(strategy="fsdp", kernels=True)
        model = lora.attach(build_model(spec.model, seed=0, device=ctx.device), spec, frozen_dtype=None, log_it=False)
        assert "lora" in apply_kernels(model).patched_kernels()
        strategy = strategies.make_strategy(spec, ctx, model)
        loss = _lora_loss(model, strategy.forward)
        strategy.backward(loss)
        return len(calls), loss.item()
    finally:
        ctx.close()


def test_fsdp_with_kernels_runs_the_fused_lora_layers():
    from fuseforge_flyte.training import lora
    from fuseforge_flyte.training.local import launch_local

    results = launch_local(_fsdp_kernels_worker, 2, start_method=forking.start_method())
    single = _lora_loss(lora.attach(build_model("tiny-llama", seed=0, device=torch.device("cpu")), _spec(),
                                    frozen_dtype=None, log_it=False)).item()  # peft's own layers, no kernels
    for calls, loss in results.values():
        assert calls == 14  # 7 projections x 2 layers, forward
        assert loss == pytest.approx(single, rel=1e-5)


def test_fsdp_checkpoint_holds_adapters_and_an_elastic_restart_resumes_from_it(reference, tmp_path, monkeypatch):
    """Rank 0 killed after step 4 (first attempt only); the restarted workers resume from the step-3 checkpoint,
    which holds the adapters (and their optimizer state) but no frozen weight."""
    spec = _spec(strategy="fsdp", batch_size=2, checkpoint_dir=str(tmp_path), checkpoint_every=3,
                 output_dir=str(tmp_path / "adapter"))
    monkeypatch.setenv(FAULT_ENV, "0:4")
    restarted = run_local(spec, 2, max_restarts=1, start_method=forking.start_method())
    for metrics in restarted.values():
        assert metrics.restarts == 1 and metrics.resumed_from_step == 3
        torch.testing.assert_close(metrics.loss_curve, reference.loss_curve, rtol=2e-5, atol=2e-5)
    metadata = (tmp_path / "step_00000006" / "dcp" / ".metadata").read_bytes()
    assert b"lora_A" in metadata and b"base_layer" not in metadata and b"embed_tokens" not in metadata
    # the adapter gathered from the shards: PEFT's format, every adapter tensor of the model
    from safetensors.torch import load_file

    saved = load_file(outputs.model_dir(str(tmp_path / "adapter")) + "/adapter_model.safetensors")
    assert len(saved) == 2 * 7 * 2 and all("lora_" in k for k in saved), sorted(saved)[:4]




def _fsdp_bf16_worker():
    """FSDP2 with LoRA in bf16 (forced: CPU runs are fp32): frozen weights stored in bf16, the adapters in fp32,
    all-gathered as bf16 and reduced in fp32; the optimizer and gradients cover the adapters only."""
    from fuseforge_flyte.training import lora, precision, strategies
    from fuseforge_flyte.training.distributed import DistContext

    torch.set_num_threads(1)
    precision.compute_dtype = lambda spec, device: spec.dtype  # bf16 on the CPU (a forked worker: dies with it)
    ctx = DistContext.from_env(need_group=True)
    try:
        spec = _spec(strategy="fsdp", dtype="bf16", batch_size=2)
        assert lora.frozen_dtype(spec, ctx.device) == torch.bfloat16
        model = lora.attach(build_model(spec.model, seed=0, device=ctx.device), spec, frozen_dtype=torch.bfloat16,
                            log_it=False)
        strategy = strategies.make_strategy(spec, ctx, model)
        assert strategy.dtype == "bf16"
        ids = torch.randint(0, 259, (2, 16))
        strategy.backward(strategy.forward({"input_ids": ids, "labels": ids}, True))
        trainable = {str(p.dtype) for p in model.parameters() if p.requires_grad}
        frozen = {str(p.dtype) for p in model.parameters() if not p.requires_grad and p.is_floating_point()}
        grads = [n for n, p in model.named_parameters() if p.grad is not None]
        optimized = sum(len(g["params"]) for g in strategy.optimizer.param_groups)
        strategy.optimizer_step()
        return trainable, frozen, all("lora_" in n for n in grads) and len(grads) == optimized > 0
    finally:
        ctx.close()


def test_fsdp_keeps_frozen_weights_in_bf16_apart_from_fp32_adapters():
    from fuseforge_flyte.training.local import launch_local

    results = launch_local(_fsdp_bf16_worker, 2, start_method=forking.start_method())
    assert results[0] == results[1] == ({"torch.float32"}, {"torch.bfloat16"}, True)


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_adapter_and_merged_outputs_load_without_fuseforge_and_train_on(base_dir, tmp_path, qlora):
    first = train(_spec(model=base_dir, qlora=qlora, lora_merge=True, output_dir=str(tmp_path / "run"), steps=3))
    out = Path(first.model_dir)  # the run's model folder: the merged model, its adapter beside it
    assert out == Path(outputs.model_dir(str(tmp_path / "run")))
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out / "adapter"))
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == base_dir and adapter_config["r"] == 4
    assert sorted(adapter_config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = load_without_fuseforge(base_dir, str(out / "adapter"), str(out), ids, tmp_path)
    # the merged model is the base (full precision, also under QLoRA) plus the adapters: the adapter on the base
    torch.testing.assert_close(logits["merged"], logits["adapter"], rtol=1e-4, atol=1e-4)
    base = build_model(base_dir, seed=0, device=torch.device("cpu")).eval()
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, logits["adapter"], atol=1e-3)  # the adapters learnt

    # the adapter directory as the next run's model: its adapters train on from where they were
    again = train(_spec(model=str(out / "adapter"), qlora=qlora, steps=2, lora=False))
    assert again.loss_curve[0] < first.loss_curve[0] - 0.05, (again.loss_curve, first.loss_curve)
    # the merged directory as a model: a full model (here trained with new adapters)
    merged_run = train(_spec(model=str(out), steps=2))
    assert merged_run.loss_curve[0] < first.loss_curve[0] - 0.05


def test_kernels_fuse_the_lora_layers_and_match_the_unfused_run():
    fused = train(_spec(kernels=True, steps=2, batch_size=2))
    plain = train(_spec(steps=2, batch_size=2))
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy", "lora"} <= set(fused.kernels_patched)
    torch.testing.assert_close(fused.loss_curve, plain.loss_curve, rtol=1e-4, atol=1e-4)


def test_activation_checkpointing_trains_the_adapters_the_same(reference):
    """Checkpointed decoder layers over a frozen embedding (no input that requires grad): same adapters, same loss."""
    checkpointed = train(_spec(gradient_checkpointing=True))
    torch.testing.assert_close(checkpointed.loss_curve, reference.loss_curve, rtol=1e-6, atol=1e-6)


def test_distillation_trains_the_students_adapters():
    """distill with lora: the student's adapters learn from the teacher through the fused JSD (frozen student head)."""
    m = train(_spec(teacher="tiny-llama", kernels=True, steps=2, batch_size=2, seq_len=16))
    assert "lora" in m.kernels_patched and all(x == x for x in m.loss_curve) and m.steps == 2


@pytest.mark.parametrize("settings, field", [
    (dict(lora_target_modules="q_proj,not_a_layer"), "TrainSpec.lora_target_modules: 'not_a_layer'"),
    (dict(lora_rank=0), "TrainSpec.lora_rank must be >= 1"),
    (dict(lora_alpha=0.0), "TrainSpec.lora_alpha"),
    (dict(lora_dropout=1.0), "TrainSpec.lora_dropout"),
    (dict(lora=False, lora_merge=True), "TrainSpec.lora_merge"),
    (dict(strategy="deepspeed"), "TrainSpec.lora: strategy 'deepspeed'"),
    (dict(qlora=True, strategy="fsdp"), "TrainSpec.qlora runs under strategy 'ddp'"),
    (dict(fp8=True), "TrainSpec.fp8 is not supported with LoRA"),
])
def test_bad_lora_settings_fail_validation_naming_the_input(settings, field):
    with pytest.raises(ValueError, match=__import__("re").escape(field)):
        _spec(**settings).validate()


def test_qlora_without_a_4bit_backend_fails_validation(monkeypatch):
    from fuseforge.transformers import lora as library

    monkeypatch.setattr(library, "nf4_available", lambda: "QLoRA needs torchao's NF4 tensor (pip install torchao)")
    with pytest.raises(ValueError, match="TrainSpec.qlora: no supported 4-bit backend"):
        _spec(qlora=True).validate()


def test_bad_lora_settings_stop_the_launch_before_any_worker(monkeypatch):
    """run_local validates in the launching process: no worker is started for a bad setting."""
    from fuseforge_flyte.training import local

    started = []
    monkeypatch.setattr(local, "launch_local", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match="TrainSpec.lora_rank"):
        run_local(_spec(lora_rank=0), 2)
    assert not started


def test_train_distill_and_dpo_take_the_lora_inputs_with_platform_toml_defaults():
    from fuseforge_flyte.config import load_config
    from fuseforge_flyte.workflows import distill, dpo, train as train_workflow

    names = ["lora", "lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "qlora", "lora_merge"]
    defaults = load_config().train_spec()
    assert (defaults.lora, defaults.lora_rank, defaults.lora_alpha, defaults.qlora) == (False, 16, 32.0, False)
    for workflow in (train_workflow, distill):
        inputs = workflow.python_interface.inputs_with_defaults
        assert {name: inputs[name][1] for name in names} == {name: getattr(defaults, name) for name in names}
    assert set(names) - set(dpo.python_interface.inputs) == {"lora_merge"}
