"""TrainSpec.fp8 (torchao float8 linear layers) and TrainSpec.compile (per-layer torch.compile) on the CPU.

FP8: which layers convert, the refusals (CPU, old GPU, dtype, DeepSpeed, no torchao), and the numbers
of a converted model against its fp32 self (torchao's FP8 matmuls also run on the CPU). Compile: the
same losses as eager, resume and export with plain parameter names. The GPU side (real speed and
the loss after 200 steps) is benchmarks/fp8_check.py.
"""

import copy
import sys

import pytest
import torch
import transformers

from fuseforge_flyte.training import fp8
from fuseforge_flyte.training.compilation import BACKEND_ENV
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.models import build_model
from fuseforge_flyte.training.permanent import is_permanent
from fuseforge_flyte.training.spec import TrainSpec

pytest.importorskip("torchao")
pytestmark = [pytest.mark.compiles,
              pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")]

TINY = dict(model="tiny-llama", dataset="bench:bytes", batch_size=2, seq_len=32, lr=3e-3, kernels=False, seed=3)
CPU = torch.device("cpu")
LLAMA_LINEARS = {f"model.layers.{i}.{name}" for i in range(2) for name in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


def _float8_names(model):
    from torchao.float8.float8_linear import Float8Linear

    return {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}


# ---------------------------------------------------------------- which layers


def test_every_attention_and_mlp_linear_converts_but_not_lm_head_or_embeddings():
    model = build_model("tiny-llama", seed=0, device=CPU)  # hidden 64, intermediate 176, kv 32: all multiples of 16
    names = fp8.convert_to_fp8(model)
    assert set(names) == LLAMA_LINEARS == _float8_names(model)
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.embed_tokens) is torch.nn.Embedding
    assert set(model.state_dict()) == set(build_model("tiny-llama", seed=0, device=CPU).state_dict())


def test_dims_not_multiples_of_16_and_routers_stay_unconverted():
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=72, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    model = transformers.LlamaForCausalLM(config)
    model.model.layers[0].mlp.router = torch.nn.Linear(64, 16)  # a router-like layer, dims fit
    names = fp8.convert_to_fp8(model)
    assert set(names) == {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert _float8_names(model) == set(names)

    moe = transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4, vocab_size=96)
    model = transformers.AutoModelForCausalLM.from_config(moe)
    model.model.layers[0].mlp.gate = torch.nn.Linear(64, 16, bias=False)  # the router as an nn.Linear (older layout)
    model.model.layers[0].mlp.shared_expert_gate = torch.nn.Linear(64, 16, bias=False)
    names = set(fp8.convert_to_fp8(model))
    assert "model.layers.0.mlp.shared_expert.gate_proj" in names and "model.layers.0.self_attn.o_proj" in names
    assert not {"model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "lm_head"} & names


def test_a_model_without_fp8_sized_layers_is_refused():
    config = transformers.LlamaConfig(hidden_size=40, intermediate_size=72, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=96)
    with pytest.raises(ValueError, match=r"TrainSpec\.fp8: LlamaForCausalLM has no nn\.Linear layer .* multiples "
                                         r"of 16"):
        fp8.convert_to_fp8(transformers.LlamaForCausalLM(config))


def test_converted_model_keeps_the_fused_loss_and_stays_close_to_fp32(device):
    """FP8 matmuls (tensorwise e4m3 forward, e5m2 gradients): loss and gradients near the fp32 model's, not equal."""
    from fuseforge.transformers import apply_kernels

    reference = build_model("tiny-llama", seed=0, device=torch.device(device))
    apply_kernels(reference)
    model = copy.deepcopy(reference)
    fp8.convert_to_fp8(model)
    ids = torch.randint(0, reference.config.vocab_size, (2, 32), device=device)
    losses = []
    for m in (reference, model):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert type(model.lm_head) is type(reference.lm_head)  # still fuseforge's fused loss head
    assert losses[0] != losses[1]
    assert losses[1] == pytest.approx(losses[0], rel=5e-3)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten().double(), q.grad.flatten().double(), dim=0)
        assert cos > 0.99, (name, cos.item())


# ---------------------------------------------------------------- refusals


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine trains on the GPU here")
def test_fp8_is_refused_on_the_cpu_before_any_data_or_model(tmp_path):
    with pytest.raises(ValueError, match=r"TrainSpec\.fp8 needs a GPU with FP8 tensor cores .*on the CPU") as info:
        train(TrainSpec(fp8=True, **dict(TINY, steps=1, output_dir=str(tmp_path / "out"))))
    assert not (tmp_path / "out").exists()
    assert is_permanent(info.value)  # torch elastic restarts would fail the same way: not retried


def test_fp8_is_refused_on_a_gpu_older_than_capability_8_9(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"TrainSpec\.fp8 needs a GPU .*on the CPU: set fp8 false"):
        fp8.check_fp8_device(CPU)
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9 .*NVIDIA A100-SXM4-80GB has 8\.0"):
        fp8.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    fp8.check_fp8_device(torch.device("cuda", 0))  # L4 / L40S: allowed
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8_device(torch.device("cuda", 0))  # H100 / H200


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_fp8_needs_bf16(dtype):
    with pytest.raises(ValueError, match=rf"TrainSpec\.fp8 needs dtype='bf16' .*got dtype='{dtype}'"):
        TrainSpec(fp8=True, dtype=dtype).validate()
    TrainSpec(fp8=True, dtype="bf16").validate()


@pytest.mark.parametrize("name", ["fp8", "compile"])
def test_fp8_and_compile_are_refused_with_deepspeed(name):
    with pytest.raises(ValueError, match=rf"TrainSpec\.{name} is not supported with strategy='deepspeed'"):
        TrainSpec(strategy="deepspeed", **{name: True}).validate()
    for strategy in ("ddp", "fsdp"):
        TrainSpec(strategy=strategy, **{name: True}).validate()


def test_fp8_without_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"TrainSpec\.fp8 needs torchao.*pip install 'fuseforge\[fp8\]'"):
        fp8.import_float8()
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)  # past the device check: torchao's turn
    with pytest.raises(ImportError, match=r"fuseforge\[fp8\]") as info:
        train(TrainSpec(fp8=True, **dict(TINY, steps=1)))
    assert is_permanent(info.value)


# ---------------------------------------------------------------- the engine


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_engine_fp8_run_converts_reports_and_tracks_the_fp32_losses(monkeypatch, caplog, strategy):
    """The engine path on the CPU (device check bypassed): layers converted after the kernels and before the
    strategy wraps them, counted in the metrics, fused loss kept, losses within 1 % of the fp32 run's; without
    compile it warns that the FP8 casts run unfused."""
    monkeypatch.setattr(fp8, "check_fp8_device", lambda device: None)
    spec = dict(TINY, steps=2, kernels=True, strategy=strategy)
    with caplog.at_level("WARNING", logger="fuseforge.training"):
        low, full = train(TrainSpec(fp8=True, **spec)), train(TrainSpec(**spec))
    assert sum("fp8 without compile" in r.getMessage() for r in caplog.records) == 1
    assert (low.fp8_linears, full.fp8_linears) == (len(LLAMA_LINEARS), 0)
    assert "fp8 (14 linear layers)" in str(low) and "fp8" not in str(full)
    assert "fused_linear_cross_entropy" in low.kernels_patched
    assert low.loss_curve != full.loss_curve
    torch.testing.assert_close(low.loss_curve, full.loss_curve, rtol=1e-2, atol=0)


def _compiled(monkeypatch):
    """aot_eager: dynamo graphs and AOT autograd as with inductor, without generating code (fast on the CPU)."""
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    return counters


@pytest.mark.parametrize("extra", [dict(), dict(kernels=True), dict(gradient_checkpointing=True),
                                   dict(kernels=True, gradient_checkpointing=True), dict(strategy="fsdp")],
                         ids=["plain", "kernels", "checkpointing", "kernels+checkpointing", "fsdp"])
def test_compiled_run_gives_the_eager_losses(monkeypatch, extra):
    counters = _compiled(monkeypatch)
    spec = dict(TINY, steps=2, **extra)
    compiled = train(TrainSpec(compile=True, **spec))
    if extra != dict(kernels=True, gradient_checkpointing=True):  # there a graph break in a checkpointed layer
        assert counters["stats"]["unique_graphs"] >= 1, "nothing went through torch.compile"  # runs it eager
    eager = train(TrainSpec(**spec))
    assert compiled.loss_curve == eager.loss_curve  # aot_eager runs the same aten ops: bitwise


def test_every_layer_shares_one_graph_even_with_a_kv_cache_configured(monkeypatch):
    """More layers than dynamo's recompile limit: a KV cache would make each layer recompile (guarding on its
    index) until the limit and run the rest eagerly; compile_layers turns the cache off."""
    from fuseforge_flyte.training.compilation import compile_layers

    counters = _compiled(monkeypatch)
    layers = torch._dynamo.config.recompile_limit + 2
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64, use_cache=True)
    model = transformers.LlamaForCausalLM(config).train()
    assert compile_layers(model) == layers and model.config.use_cache is False
    ids = torch.randint(0, 64, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


def test_compiled_run_resumes_and_exports_with_plain_names(monkeypatch, tmp_path):
    from safetensors.torch import load_file

    _compiled(monkeypatch)
    spec = dict(TINY, steps=4, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, compile=True,
                output_dir=str(tmp_path / "compiled"))
    monkeypatch.setenv(FAULT_ENV, "0:3:raise")
    with pytest.raises(InjectedFault):
        train(TrainSpec(**spec))
    monkeypatch.delenv(FAULT_ENV)
    saved = torch.load(tmp_path / "ckpt" / "step_00000002" / "model.pt", weights_only=True)
    plain = set(build_model("tiny-llama", seed=0, device=CPU).state_dict())
    assert set(saved) == plain
    resumed = train(TrainSpec(**spec))
    assert resumed.resumed_from_step == 2
    eager = train(TrainSpec(**dict(spec, compile=False, checkpoint_dir="", output_dir=str(tmp_path / "eager"))))
    assert resumed.loss_curve == eager.loss_curve
    exported, reference = load_file(tmp_path / "compiled" / "model" / "model.safetensors"), \
        load_file(tmp_path / "eager" / "model" / "model.safetensors")
    assert set(exported) == set(reference) and not any("_orig_mod" in k for k in exported)
    for name, tensor in reference.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- the inputs


def test_both_settings_round_trip_through_platform_toml_env_and_cli(tmp_path):
    from fuseforge_flyte.config import load_config
    from fuseforge_flyte.inputs import help_text, input_type
    from fuseforge_flyte.training import cli

    path = tmp_path / "platform.toml"
    path.write_text('[image]\nregistry = "ghcr.io/acme"\n[flyte]\nproject = "ml"\ndomain = "dev"\n'
                    "[training]\nfp8 = true\ncompile = true\n")
    spec = load_config(path, env={}).train_spec()
    assert (spec.fp8, spec.compile) == (True, True)
    off = load_config(path, env={"FUSEFORGE__TRAINING__FP8": "false", "FUSEFORGE__TRAINING__COMPILE": "false"})
    assert (off.training.fp8, off.training.compile) == (False, False)
    defaults = load_config(env={}).train_spec()
    assert (defaults.fp8, defaults.compile) == (False, False)
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text() + 'dtype = "fp16"\n')
    with pytest.raises(ValueError, match=r"\[training\]\.fp8 needs dtype='bf16'"):
        load_config(bad, env={})

    args = vars(cli.build_parser().parse_args(["--fp8", "--compile"]))
    assert (args["fp8"], args["compile"]) == (True, True)
    args = vars(cli.build_parser().parse_args([]))
    assert (args["fp8"], args["compile"]) == (False, False)
    assert input_type("fp8") is bool and input_type("compile") is bool
    assert "torchao" in help_text("fp8") and "torch.compile" in help_text("compile")
