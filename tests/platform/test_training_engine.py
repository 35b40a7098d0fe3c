"""The training engine in one process: learning, metrics, models/FLOPs, data sharding, bad input, the CLI."""

import json
import math
import os

import pytest
import torch

from fuseforge_flyte.data.benchmark import SyntheticTokens, benchmark_dataset, bytes_corpus_path, decode, encode
from fuseforge_flyte.model_names import BYTE_VOCAB_SIZE, PRESETS
from fuseforge_flyte.training import cli
from fuseforge_flyte.training.batches import DataPosition, ShardedBatches
from fuseforge_flyte.training.engine import NonFiniteLossError, train
from fuseforge_flyte.training.faults import NONFINITE_ENV
from fuseforge_flyte.training.metrics import History, summarize
from fuseforge_flyte.training.models import PEAK_TFLOPS_ENV, build_model, model_flops, peak_flops
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.strategies import deepspeed_config

TINY = dict(model="tiny-llama", dataset="bench:bytes", batch_size=4, seq_len=32, kernels=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""


# ---------------------------------------------------------------- training


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a CPU run's metrics (device, fp32, MFU 0)")
def test_loss_decreases_on_byte_text_and_metrics_are_real():
    m = train(TrainSpec(steps=24, lr=3e-3, **TINY))
    assert len(m.loss_curve) == len(m.step_time_curve) == len(m.tokens_per_s_curve) == 24
    assert all(math.isfinite(x) for x in m.loss_curve)
    assert m.loss_curve[0] == pytest.approx(math.log(BYTE_VOCAB_SIZE), rel=0.1)  # random init ~ uniform
    assert sum(m.loss_curve[-4:]) / 4 < m.loss_curve[0] - 1.5
    assert m.final_loss == m.loss_curve[-1]
    assert m.tokens_per_step == 4 * 32 and m.world_size == 1 and m.device == "cpu" and m.dtype == "fp32"
    assert m.tokens_per_s > 0 and m.samples_per_s == pytest.approx(m.tokens_per_s / 32)
    steady = sorted(m.step_time_curve[1:])  # step 1 is the warm-up: 23 steady steps
    assert m.step_time_p50_s == steady[11]
    assert m.step_time_p50_s <= m.step_time_p90_s <= m.step_time_p99_s <= steady[-1]
    assert m.mfu == 0.0  # no peak FLOP/s for a CPU
    assert m.peak_memory_gib > 0 and m.memory_gib_curve[-1] <= m.peak_memory_gib
    assert m.num_params == sum(p.numel() for p in build_model("tiny-llama", seed=0, device="cpu").parameters())
    assert (m.restarts, m.steps_redone, m.skipped_steps, m.resumed_from_step) == (0, 0, 0, 0)


def test_same_seed_same_run_and_synthetic_data_learns():
    spec = TrainSpec(model="tiny-qwen2", dataset="bench:synthetic", steps=12, batch_size=2, seq_len=48,
                     lr=3e-3, kernels=False, seed=11, grad_accum=2)
    first, second = train(spec), train(spec)
    assert first.loss_curve == second.loss_curve
    assert first.loss_curve[-1] < first.loss_curve[0] - 0.5


def test_summary_excludes_warmup_and_computes_mfu():
    h = History(loss=[1.0] * 4, step_time=[5.0, 1.0, 2.0, 3.0], memory_gib=[1.0] * 4, warmup=[0])
    s = summarize(h, tokens_per_step=1000, samples_per_step=10, flops_per_token=6e6, peak_flops_total=1.2e11)
    assert s.tokens_per_s == pytest.approx(500.0)  # 1000 tokens / mean(1, 2, 3)
    assert s.samples_per_s == pytest.approx(5.0)
    assert s.mfu == pytest.approx(6e6 * 500 / 1.2e11)
    assert s.step_time_p50_s == pytest.approx(2.0)
    assert s.tokens_per_s_curve == pytest.approx([200.0, 1000.0, 500.0, 1000 / 3])


def test_kernels_patch_the_model_and_match_the_unfused_run():
    spec = dict(TINY, steps=3, lr=3e-3, model="tiny-gemma2")  # softcapped logits, tied embeddings
    fused, plain = train(TrainSpec(**{**spec, "kernels": True})), train(TrainSpec(**spec))
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"} <= set(fused.kernels_patched)
    assert plain.kernels_patched == []
    torch.testing.assert_close(fused.loss_curve, plain.loss_curve, rtol=1e-4, atol=1e-4)


def test_skip_kernels_leaves_those_kernels_out():
    """Per-kernel switches from the platform's inputs: the named kernels stay unpatched, the rest are fused."""
    m = train(TrainSpec(**dict(TINY, steps=1, kernels=True, skip_kernels="rope, swiglu")))
    assert {"rms_norm", "fused_linear_cross_entropy"} <= set(m.kernels_patched)
    assert not {"rope", "swiglu"} & set(m.kernels_patched)


def test_kernel_switches_are_apply_kernels_flags():
    from fuseforge.transformers import DEFAULT_FLAGS
    from fuseforge_flyte.training.validation import kernel_switches

    assert set(kernel_switches()) == set(DEFAULT_FLAGS) - {"cross_entropy"}
    # in the order TrainSpec.skip_kernels' help and the unknown-kernel message list them
    assert kernel_switches() == ("rms_norm", "layer_norm", "rope", "swiglu", "fused_linear_cross_entropy", "lora")


def test_loss_chunk_size_reaches_apply_kernels_and_trains_the_same(monkeypatch):
    import fuseforge.transformers as hf
    from fuseforge_flyte.training.engine import _apply_kernels

    real, seen = hf.apply_kernels, []

    def spy(model, **kwargs):
        report = real(model, **kwargs)
        seen.append((kwargs, report.loss_chunk_size))
        return report

    monkeypatch.setattr(hf, "apply_kernels", spy)
    spec = dict(TINY, steps=2, lr=3e-3, loss_chunk_size=48)  # 4 x 31 targets: 3 chunks, the last one ragged
    chunked = train(TrainSpec(**{**spec, "kernels": True}))
    assert seen == [({"loss_chunk_size": 48}, 48)]
    plain = train(TrainSpec(**spec))  # without kernels the chunk size is unused
    assert len(seen) == 1 and plain.kernels_patched == []
    torch.testing.assert_close(chunked.loss_curve, plain.loss_curve, rtol=1e-4, atol=1e-4)
    _apply_kernels(build_model("tiny-llama", seed=0, device="cpu"), TrainSpec(**TINY), log_it=False)
    assert seen[-1] == ({"loss_chunk_size": None}, None)  # 0 = fuseforge's default rule


def test_gradient_checkpointing_recomputes_the_same_numbers():
    spec = dict(TINY, steps=3, lr=3e-3)
    ckpt, plain = train(TrainSpec(gradient_checkpointing=True, **spec)), train(TrainSpec(**spec))
    torch.testing.assert_close(ckpt.loss_curve, plain.loss_curve, rtol=1e-6, atol=1e-6)


def test_warmup_cosine_schedule():
    from fuseforge_flyte.training.optim import MIN_LR_RATIO, scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = scheduler(optimizer, warmup=4, total=20)
    f = []  # the lr multiplier each step trains with
    for _ in range(21):
        f.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert f[:4] == [0.0, 0.25, 0.5, 0.75]
    assert f[4] == 1.0 and f[12] == pytest.approx((1 + MIN_LR_RATIO) / 2) and f[20] == pytest.approx(MIN_LR_RATIO)
    assert all(f[s] >= f[s + 1] for s in range(4, 20))


@pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipped", "under-the-norm"])
def test_clipping_inside_the_fused_adamw_step_equals_clip_grad_norm(max_norm):
    """The fused optimizer divides the gradients by grad_scale as it reads them: the same update as
    clip_grad_norm_ then the step (torch's fused AdamW also runs on the CPU)."""
    from types import SimpleNamespace

    from fuseforge_flyte.training import optim
    from fuseforge_flyte.training.strategies import _TorchOptimized

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)]
    results = []
    for fold in (False, True):
        model = torch.nn.Sequential(*[torch.nn.Linear(l.in_features, l.out_features) for l in layers])
        model.load_state_dict(torch.nn.Sequential(*layers).state_dict())
        opt = torch.optim.AdamW(optim.param_groups(model.named_parameters(), 0.1), lr=1e-2, fused=True)
        strategy = SimpleNamespace(spec=SimpleNamespace(grad_clip=max_norm), optimizer=opt,
                                   _gradients=lambda: [p.grad for p in model.parameters()])
        for step in range(3):
            model(torch.randn(5, 16, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
            if fold:
                assert _TorchOptimized._clip_in_fused_step(strategy)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
            opt.__dict__.pop("grad_scale", None)
            opt.zero_grad(set_to_none=True)
        results.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], rtol=1e-6, atol=1e-7)
    assert not torch.equal(results[0], torch.cat([p.detach().flatten() for p in torch.nn.Sequential(*layers).parameters()]))


def test_the_clipping_norm_is_fp32_for_bf16_gradients():
    from types import SimpleNamespace

    from fuseforge_flyte.training.strategies import _TorchOptimized

    grads = [torch.randn(1000).to(torch.bfloat16) * 3, torch.randn(7).to(torch.bfloat16)]
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    strategy = SimpleNamespace(spec=SimpleNamespace(grad_clip=0.5), optimizer=opt, _gradients=lambda: grads)
    assert _TorchOptimized._clip_in_fused_step(strategy)
    norm = torch.cat([g.double().flatten() for g in grads]).norm()
    assert opt.grad_scale.dtype == torch.float32
    assert float(opt.grad_scale) == pytest.approx(float((norm + 1e-6) / 0.5), rel=1e-6)


def test_elastic_environment_is_checked(monkeypatch):
    from fuseforge_flyte.training.distributed import DistContext

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2, WORLD_SIZE=2"):
        DistContext.from_env(need_group=False)
    monkeypatch.setenv("RANK", "one")
    with pytest.raises(ValueError, match="RANK='one' is not an integer"):
        DistContext.from_env(need_group=False)


# ---------------------------------------------------------------- non-finite loss


def test_nonfinite_loss_raises_naming_the_step(monkeypatch):
    monkeypatch.setenv(NONFINITE_ENV, "0:3")
    with pytest.raises(NonFiniteLossError, match="step 3"):
        train(TrainSpec(steps=5, **TINY))


def test_nonfinite_skip_drops_exactly_that_update(monkeypatch, tmp_path):
    monkeypatch.setenv(NONFINITE_ENV, "0:3")
    m = train(TrainSpec(steps=4, nonfinite_policy="skip", grad_accum=2, checkpoint_dir=str(tmp_path),
                        checkpoint_every=1, keep_last=4, **TINY))
    assert m.skipped_steps == 1
    assert math.isnan(m.loss_curve[2]) and all(math.isfinite(x) for i, x in enumerate(m.loss_curve) if i != 2)
    assert math.isfinite(m.final_loss)
    load = lambda step, name: torch.load(tmp_path / f"step_{step:08d}" / name, weights_only=True)  # noqa: E731
    before, after = load(2, "model.pt"), load(3, "model.pt")
    assert all(torch.equal(before[k], after[k]) for k in before)  # the skipped step changed no weight
    assert load(3, "optimizer.pt")["state"][0]["step"] == load(2, "optimizer.pt")["state"][0]["step"]
    assert load(3, "scheduler.pt")["last_epoch"] == load(2, "scheduler.pt")["last_epoch"]
    assert not torch.equal(load(4, "model.pt")["lm_head.weight"], after["lm_head.weight"])


# ---------------------------------------------------------------- models


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_count_flops(name):
    model = build_model(name, seed=0, device=torch.device("meta"))  # shapes only, no memory
    flops = model_flops(model, seq_len=2048)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    embed = cfg.vocab_size * cfg.hidden_size
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert flops.matmul_params == flops.num_params - (0 if tied else embed)
    assert flops.flops_per_token == 6 * flops.matmul_params + 12 * cfg.num_hidden_layers * \
        cfg.num_attention_heads * head_dim * 2048
    if name.startswith("tiny-"):
        assert cfg.vocab_size == BYTE_VOCAB_SIZE


def test_realistic_presets_have_the_public_parameter_counts():
    counts = {"llama-1b": 1.236e9, "llama3-8b": 8.030e9, "qwen2.5-0.5b": 0.494e9, "mistral-7b": 7.248e9}
    for name, expected in counts.items():
        model = build_model(name, seed=0, device=torch.device("meta"))
        assert model_flops(model, 1).num_params == pytest.approx(expected, rel=2e-3), name


def test_config_json_path_and_seeded_init(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 300, "hidden_size": 32,
                                "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}))
    a, b = (build_model(str(path), seed=4, device="cpu") for _ in range(2))
    c = build_model(str(path), seed=5, device="cpu")
    assert a.config.vocab_size == 300 and a.config.num_hidden_layers == 1
    assert torch.equal(a.lm_head.weight, b.lm_head.weight) and not torch.equal(a.lm_head.weight, c.lm_head.weight)
    path.write_text(json.dumps({"model_type": "no-such-arch"}))
    with pytest.raises(ValueError, match="model_type"):
        build_model(str(path), seed=0, device="cpu")


def test_peak_flops_table(monkeypatch):
    monkeypatch.delenv(PEAK_TFLOPS_ENV, raising=False)
    assert peak_flops(torch.device("cpu"), "bf16") == 0.0
    monkeypatch.setenv(PEAK_TFLOPS_ENV, "989")
    assert peak_flops(torch.device("cpu"), "bf16") == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.delenv(PEAK_TFLOPS_ENV)
    assert peak_flops(torch.device("cuda", 0), "bf16") == 989e12
    assert peak_flops(torch.device("cuda", 0), "fp32") == 494e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(torch.device("cuda", 0), "bf16") == 312e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert peak_flops(torch.device("cuda", 0), "bf16") == 0.0


# ---------------------------------------------------------------- data


def test_byte_tokenizer_roundtrip():
    ids = encode("naïve café")
    assert ids[0] == 256 and ids[-1] == 257 and max(ids) < BYTE_VOCAB_SIZE
    assert decode(ids) == "naïve café"


def test_synthetic_is_deterministic_and_uses_the_vocab():
    a, b, c = SyntheticTokens(1000, 37, seed=1), SyntheticTokens(1000, 37, seed=1), SyntheticTokens(1000, 37, seed=2)
    assert not torch.equal(a[12345]["input_ids"], c[12345]["input_ids"])
    assert torch.equal(a[12345]["input_ids"], b[12345]["input_ids"]) and torch.equal(a[5]["labels"], a[5]["input_ids"])
    assert not torch.equal(a[0]["input_ids"], a[1]["input_ids"]) and a[0]["input_ids"].shape == (37,)
    assert int(a[0]["input_ids"].max()) < 1000


@pytest.mark.parametrize("name", ["bench:bytes", "bench:synthetic"])
def test_global_batch_is_world_size_independent(name):
    data = benchmark_dataset(name, seq_len=16, vocab_size=BYTE_VOCAB_SIZE, seed=3)
    single = ShardedBatches(data, rank=0, world_size=1, batch_size=4, grad_accum=2, seed=3)
    ranks = [ShardedBatches(data, rank=r, world_size=2, batch_size=2, grad_accum=2, seed=3) for r in range(2)]
    for _ in range(30):  # several epochs of the small text
        one = single.next_step()
        two = [b.next_step() for b in ranks]
        for micro in range(2):  # micro-batch m of the single process == concat over ranks of micro m
            for key in one[micro]:
                assert torch.equal(one[micro][key], torch.cat([two[0][micro][key], two[1][micro][key]]))


def test_data_position_resumes_the_stream():
    data = benchmark_dataset("bench:bytes", seq_len=64, vocab_size=BYTE_VOCAB_SIZE, seed=0)
    run = ShardedBatches(data, rank=0, world_size=1, batch_size=8, grad_accum=1, seed=0)
    for _ in range(15):
        run.next_step()
    assert run.position.epoch >= 1  # crossed an epoch boundary
    saved = DataPosition(run.position.epoch, run.position.index)
    expected = [run.next_step()[0]["input_ids"] for _ in range(5)]
    resumed = ShardedBatches(data, rank=0, world_size=1, batch_size=8, grad_accum=1, seed=0, position=saved)
    assert all(torch.equal(x, resumed.next_step()[0]["input_ids"]) for x in expected)


def test_dataset_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="vocab_size is 100"):
        benchmark_dataset("bench:bytes", seq_len=8, vocab_size=100, seed=0)
    small = benchmark_dataset("bench:bytes", seq_len=4096, vocab_size=BYTE_VOCAB_SIZE, seed=0)
    with pytest.raises(ValueError, match="fewer than one global step"):
        ShardedBatches(small, rank=0, world_size=2, batch_size=4, grad_accum=1, seed=0)


# ---------------------------------------------------------------- bad TrainSpec values


@pytest.mark.parametrize("field,value,match", [
    ("steps", -1, "TrainSpec.steps must be >= 1"),
    ("steps", 0, "TrainSpec.steps must be >= 1"),
    ("batch_size", 0, "TrainSpec.batch_size"),
    ("grad_accum", 0, "TrainSpec.grad_accum"),
    ("seq_len", 1, "TrainSpec.seq_len"),
    ("lr", 0.0, "TrainSpec.lr"),
    ("lr", float("nan"), "TrainSpec.lr"),
    ("weight_decay", -0.1, "TrainSpec.weight_decay"),
    ("grad_clip", float("inf"), "TrainSpec.grad_clip"),
    ("warmup_steps", -2, "TrainSpec.warmup_steps"),
    ("keep_last", 0, "TrainSpec.keep_last"),
    ("loss_chunk_size", -1, "TrainSpec.loss_chunk_size must be a finite value >= 0, got -1"),
    ("strategy", "horovod", r"TrainSpec.strategy: 'horovod' is not one of \['ddp', 'fsdp', 'deepspeed'\]"),
    ("dtype", "fp64", "TrainSpec.dtype"),
    ("zero_stage", 4, "TrainSpec.zero_stage"),
    ("nonfinite_policy", "ignore", "TrainSpec.nonfinite_policy"),
    ("model", "gpt-9", "TrainSpec.model: unknown model 'gpt-9'.*tiny-llama"),
    ("model", "", "TrainSpec.model"),
    ("dataset", "/no/such/corpus.txt", "TrainSpec.dataset: dataset file or folder not found: '/no/such/corpus.txt'"),
    ("dataset", "builtin:wiki", "TrainSpec.dataset: unknown builtin dataset 'builtin:wiki'"),
    ("dataset", "bench:wiki", "TrainSpec.dataset: unknown benchmark dataset 'bench:wiki'"),
    ("dataset", "data.xlsx", r"TrainSpec.dataset: unsupported file extension '.xlsx'"),
    ("data_format", "chat", r"TrainSpec.data_format: 'chat' is not one of"),
    ("eval_every", 5, "the benchmark dataset 'bench:bytes' has no eval split"),
    ("eval_every", -1, "TrainSpec.eval_every must be a finite value >= 0"),
    ("offload", True, "TrainSpec.offload applies to strategy='deepspeed'"),
    ("skip_kernels", "rope,flash", r"TrainSpec.skip_kernels: unknown kernel 'flash'; use names from \['rms_norm'"),
])
def test_bad_spec_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        train(TrainSpec(**{**TINY, field: value}))


@pytest.mark.parametrize("field,value", [("steps", "10"), ("kernels", "yes"), ("lr", "0.1"), ("steps", True),
                                         ("checkpoint_dir", 3), ("loss_chunk_size", 256.0)])
def test_wrong_types_are_named(field, value):
    with pytest.raises(TypeError, match=f"TrainSpec.{field} must be"):
        TrainSpec(**{**TINY, field: value}).validate()


@pytest.mark.parametrize("field,value,match", [
    ("eval_fraction", 1.5, r"TrainSpec.eval_fraction must be in \[0, 1\)"),
    ("eval_every", 5, "TrainSpec.eval_every=5 needs eval data"),
    ("tokenizer", "builtin:gpt2", "TrainSpec.tokenizer: unknown builtin tokenizer 'builtin:gpt2'"),
])
def test_bad_data_values_are_named(field, value, match):
    with pytest.raises(ValueError, match=match):
        TrainSpec(**{**TINY, "dataset": "builtin:chat", field: value}).validate()


def test_incompatible_combinations():
    with pytest.raises(ValueError, match="fp16.*fsdp"):
        TrainSpec(strategy="fsdp", dtype="fp16").validate()
    with pytest.raises(ValueError, match="skip.*deepspeed.*grad_accum=1"):
        TrainSpec(strategy="deepspeed", nonfinite_policy="skip", grad_accum=2).validate()
    assert TrainSpec(model="meta-llama/Llama-3.2-1B").validate()  # an HF id shape is accepted


def test_deepspeed_config_from_spec():
    spec = TrainSpec(strategy="deepspeed", zero_stage=3, offload=True, batch_size=2, grad_accum=4, grad_clip=0.5)
    gpu = deepspeed_config(spec, world_size=8, device=torch.device("cuda", 0))
    assert gpu["train_batch_size"] == 64 and gpu["train_micro_batch_size_per_gpu"] == 2
    assert gpu["gradient_accumulation_steps"] == 4 and gpu["gradient_clipping"] == 0.5
    assert gpu["bf16"]["enabled"] and not gpu["fp16"]["enabled"]
    assert gpu["zero_optimization"]["stage"] == 3
    assert gpu["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert gpu["zero_optimization"]["offload_param"]["device"] == "cpu"
    cpu = deepspeed_config(TrainSpec(strategy="deepspeed", zero_stage=2, offload=True), 1, torch.device("cpu"))
    assert not cpu["bf16"]["enabled"] and "offload_param" not in cpu["zero_optimization"]
    assert cpu["zero_force_ds_cpu_optimizer"] is False


# ---------------------------------------------------------------- CLI


def test_cli_prints_and_writes_metrics(tmp_path, capsys):
    out = tmp_path / "metrics.json"
    rc = cli.main(["--model", "tiny-mistral", "--steps", "3", "--seq_len", "16", "--batch_size", "2",
                   "--no_kernels", "--dataset", "bench:synthetic", "--metrics_file", str(out), "--log_level", "WARNING"])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert printed["model"] == "tiny-mistral" and printed["steps"] == 3 and printed["kernels"] is False
    assert len(printed["loss_curve"]) == 3 and printed["tokens_per_s"] > 0


def test_cli_rejects_bad_values(capsys):
    assert cli.main(["--steps", "-3"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: --steps must be >= 1, got -3"
    assert cli.build_parser().parse_args(["--loss_chunk_size", "512"]).loss_chunk_size == 512
    assert cli.main(["--loss_chunk_size", "-1"]) == 2
    assert "error: --loss_chunk_size must be a finite value >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--strategy"])  # argparse: missing value


def test_byte_corpus_ships_with_the_package():
    path = bytes_corpus_path()
    assert os.path.isfile(path) and os.path.getsize(path) > 4000
    assert "public domain" in open(path, encoding="utf-8").read(400)


def test_missing_deepspeed_is_a_permanent_error(monkeypatch):
    """A restart cannot install DeepSpeed: the error must be one torch elastic does not retry."""
    import builtins

    from fuseforge_flyte.training import permanent
    from fuseforge_flyte.training.strategies import import_deepspeed

    real_import = builtins.__import__

    def no_deepspeed(name, *args, **kwargs):
        if name == "deepspeed":
            raise ImportError("No module named 'deepspeed'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_deepspeed)
    with pytest.raises(ImportError, match=r"pip install 'fuseforge\[deepspeed\]'") as err:
        import_deepspeed()
    assert permanent.is_permanent(err.value)
