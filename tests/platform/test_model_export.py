"""The trained model as a Hugging Face directory (export.py, Strategy.full_state_dict) and training from one.

DDP in this process; FSDP2 and DeepSpeed ZeRO-3 on 2 gloo worker processes started by torch elastic with
start_method "fork" (as in test_distributed.py). The export is loaded back in a subprocess that cannot
import fuseforge, the way a user without fuseforge installed would load it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fuseforge_flyte.cache_dirs import CACHE_ENV
from fuseforge_flyte.model_names import PRESETS, is_known_model, load_config
from fuseforge_flyte.training import export as export_mod
from fuseforge_flyte.training.distributed import DistContext
from fuseforge_flyte.training.export import (ExportError, save_pretrained_model, transformers_class,
                                             verify_model_dir)
from fuseforge_flyte.training.models import build_model
from fuseforge_flyte.training.spec import TrainSpec
from fuseforge_flyte.training.strategies import make_strategy
import forking  # tests/support

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

SEQ = 16


def _spec(**overrides):
    base = dict(model="tiny-llama", dataset="bench:bytes", steps=4, batch_size=2, seq_len=SEQ, lr=3e-2,
                kernels=False, seed=5)
    base.update(overrides)
    return TrainSpec(**base)


def _train_steps(strategy, vocab: int, seed: int, steps: int = 2) -> None:
    """A few optimizer steps on random tokens (seeded per rank: ranks see different data)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, SEQ), generator=gen).to(strategy.ctx.device)
        strategy.backward(strategy.forward({"input_ids": ids, "labels": ids}, True))
        strategy.optimizer_step()


def _tokenizer_dir() -> str:
    from fuseforge_flyte.data.builtin import TOKENIZER_DIR, asset_path

    return asset_path(TOKENIZER_DIR)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    """Tests that run in this process are world size 1 whatever the environment says."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Every test of this module on one torch thread (see conftest)."""




def _launch(fn, *args):
    from fuseforge_flyte.training.local import launch_local

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two workers on a CUDA machine take one GPU each; this one has fewer")
    # fork is fast, but a child of a process that has used CUDA cannot use it
    return launch_local(fn, 2, *args, start_method="spawn" if torch.cuda.is_initialized() else forking.start_method())


def _partition_everything() -> None:
    """ZeRO-3 keeps parameters under 1e5 elements whole on every rank (param persistence): partition all.

    Only for forked workers: the patch dies with the process.
    """
    from fuseforge_flyte.training import strategies

    original = strategies.deepspeed_config

    def config(*args, **kwargs):
        result = original(*args, **kwargs)
        result["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        return result

    strategies.deepspeed_config = config


def _load_plain(out_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)


def _same_state(loaded: torch.nn.Module, expected: dict) -> None:
    state = loaded.state_dict()
    assert set(expected) <= set(state)
    for key, value in expected.items():
        assert state[key].dtype == torch.float32, key
        torch.testing.assert_close(state[key], value.cpu(), rtol=0, atol=0, msg=key)


# ---------------------------------------------------------------- DDP: the whole path, loaded without fuseforge

_LOAD_WITHOUT_FUSEFORGE = textwrap.dedent("""
    import importlib.abc, json, sys

    class _NoFuseforge(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0].startswith("fuseforge"):
                raise ImportError("fuseforge is not installed here: " + name)
            return None

    sys.meta_path.insert(0, _NoFuseforge())
    try:
        import fuseforge
        raise SystemExit("fuseforge is importable: the test would prove nothing")
    except ImportError:
        pass
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir, ids_path, logits_path = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    classes = sorted({type(m).__module__.split(".")[0] for m in model.modules()})
    with torch.no_grad():
        logits = model(input_ids=torch.load(ids_path)).logits
    torch.save(logits, logits_path)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    print(json.dumps({
        "class": type(model).__name__, "dtype": str(model.dtype), "module_roots": classes,
        "fuseforge_loaded": [m for m in sys.modules if m.startswith("fuseforge")],
        "use_cache": AutoConfig.from_pretrained(out_dir).use_cache,
        "generation_use_cache": GenerationConfig.from_pretrained(out_dir).use_cache,
        "tokenizer_len": len(tokenizer), "has_chat_template": bool(tokenizer.chat_template),
    }))
""")


def test_ddp_export_loads_without_fuseforge_and_gives_the_same_logits(tmp_path):
    from fuseforge.transformers import apply_kernels, is_patched

    ctx = DistContext.from_env(need_group=False)
    vocab = 1024  # the builtin tokenizer's: a preset's vocabulary follows the data's tokenizer
    model = build_model("tiny-llama", seed=3, device=ctx.device, vocab_size=vocab)
    assert model.config.vocab_size == vocab
    apply_kernels(model)
    strategy = make_strategy(_spec(kernels=True), ctx, model)
    _train_steps(strategy, vocab, seed=1)
    classes = {name: type(m) for name, m in model.named_modules()}
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    out_dir = str(tmp_path / "model")
    assert save_pretrained_model(strategy, ctx, out_dir, tokenizer_dir=_tokenizer_dir()) == out_dir

    # the live model is as it was: still patched, same classes and weights, still training without a KV cache
    assert is_patched(model) and "forward" in model.__dict__
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert any(type(m).__name__.startswith("Fused") for m in model.modules())
    assert model.config.use_cache is False and model.config.architectures in (None, ["LlamaForCausalLM"])
    for key, value in model.state_dict().items():
        assert torch.equal(value, weights[key]), key
    _train_steps(strategy, vocab, seed=2, steps=1)  # and it still trains

    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["use_cache"] is True
    assert config["dtype"] == "float32" and config["vocab_size"] == vocab
    assert {"model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} <= set(os.listdir(out_dir))
    assert not [n for n in os.listdir(tmp_path) if n != "model"]  # the temporary directory was renamed

    model.eval()
    for key, value in weights.items():  # back to the exported weights (the extra step changed them)
        model.state_dict()[key].copy_(value)
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids.to(ctx.device)).logits.cpu()
    torch.save(ids, tmp_path / "ids.pt")
    proc = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_FUSEFORGE, out_dir, str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt")], capture_output=True, text=True, timeout=120,
                          cwd=str(tmp_path), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["class"] == "LlamaForCausalLM" and seen["dtype"] == "torch.float32"
    assert seen["fuseforge_loaded"] == [] and seen["module_roots"] == ["torch", "transformers"]
    assert seen["use_cache"] is True and seen["generation_use_cache"] is True
    assert seen["tokenizer_len"] == vocab and seen["has_chat_template"]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_are_saved_once_and_load_tied(tmp_path):
    ctx = DistContext.from_env(need_group=False)
    model = build_model("tiny-gemma2", seed=0, device=ctx.device)  # tie_word_embeddings
    strategy = make_strategy(_spec(model="tiny-gemma2"), ctx, model)
    _train_steps(strategy, model.config.vocab_size, seed=0)
    out_dir = save_pretrained_model(strategy, ctx, str(tmp_path / "gemma"), max_shard_size="100KB")
    names = sorted(os.listdir(out_dir))
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 1
    index = json.loads((tmp_path / "gemma" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.embed_tokens.weight" in index and "lm_head.weight" not in index
    loaded = _load_plain(out_dir)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _same_state(loaded, model.state_dict())
    again = build_model(out_dir, seed=0, device="cpu")  # the missing lm_head.weight is tied, not missing
    assert again.lm_head.weight is again.model.embed_tokens.weight
    _same_state(again, model.state_dict())


# ---------------------------------------------------------------- FSDP2 and ZeRO-3: the gathered weights


def _sharded_worker(strategy_name: str, zero_stage: int, model_name: str, out_dir: str, kernels: bool):
    """Train a little sharded, export, and return (rank 0) the independently gathered weights."""
    torch.set_num_threads(1)
    ctx = DistContext.from_env(need_group=True)
    strategy = None
    try:
        spec = _spec(model=model_name, strategy=strategy_name, zero_stage=zero_stage, kernels=kernels)
        if strategy_name == "deepspeed":
            _partition_everything()
        model = build_model(model_name, seed=7, device=ctx.device)
        if kernels:
            from fuseforge.transformers import apply_kernels

            apply_kernels(model)
        strategy = make_strategy(spec, ctx, model)
        _train_steps(strategy, model.config.vocab_size, seed=10 + ctx.rank)
        live_class = type(strategy.inner).__name__
        written = save_pretrained_model(strategy, ctx, out_dir)
        gathered = {}
        for name, param in strategy.inner.named_parameters(remove_duplicate=False):
            if strategy_name == "fsdp":
                gathered[name] = param.full_tensor().detach().clone()  # still a DTensor shard: still sharded
            elif zero_stage == 3:
                import deepspeed

                assert param.numel() == 0  # still a ZeRO-3 placeholder
                with deepspeed.zero.GatheredParameters([param]):
                    gathered[name] = param.detach().clone()
            else:  # ZeRO-1/2 partition the optimizer state only
                gathered[name] = param.detach().clone()
        _train_steps(strategy, model.config.vocab_size, seed=20 + ctx.rank, steps=1)  # training goes on
        return {"written": written, "class": live_class, "weights": gathered if ctx.is_main else None}
    finally:
        if strategy is not None:
            strategy.close()
        ctx.close()


@pytest.mark.parametrize("strategy_name,zero_stage,model_name,kernels", [
    ("fsdp", 0, "tiny-gemma2", True),  # tied embeddings: FSDP's full state dict holds two separate copies
    ("deepspeed", 3, "tiny-llama", True),  # the fused loss's lm_head registered as an external parameter
    ("deepspeed", 2, "tiny-gemma2", False),
], ids=["fsdp-tied-kernels", "zero3-kernels", "zero2-tied"])
def test_sharded_export_holds_the_full_weights(tmp_path, request, strategy_name, zero_stage, model_name, kernels):
    if strategy_name == "deepspeed":
        request.getfixturevalue("deepspeed_on_cpu")
    out_dir = str(tmp_path / "model")
    results = _launch(_sharded_worker, strategy_name, zero_stage, model_name, out_dir, kernels)
    assert results[0]["written"] == out_dir and results[1]["written"] is None
    real = type(build_model(model_name, seed=0, device="meta")).__name__
    if strategy_name == "fsdp":
        assert results[0]["class"] == f"FSDP{real}"  # what a naive export would have named it
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["architectures"] == [real] and config["use_cache"] is True
    loaded = _load_plain(out_dir)
    assert type(loaded).__name__ == real
    _same_state(loaded, results[0]["weights"])
    if model_name == "tiny-gemma2":
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        from safetensors import safe_open

        with safe_open(os.path.join(out_dir, "model.safetensors"), "pt") as handle:
            assert "lm_head.weight" not in handle.keys() and "model.embed_tokens.weight" in handle.keys()


# ---------------------------------------------------------------- training from an exported directory


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A trained tiny-llama exported with the builtin tokenizer, and its weights."""
    tmp = tmp_path_factory.mktemp("exported")
    ctx = DistContext.from_env(need_group=False)
    model = build_model("tiny-llama", seed=11, device=ctx.device)
    strategy = make_strategy(_spec(), ctx, model)
    _train_steps(strategy, model.config.vocab_size, seed=3)
    out_dir = save_pretrained_model(strategy, ctx, str(tmp / "model"), tokenizer_dir=_tokenizer_dir())
    return out_dir, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def _assert_loads_exactly(model: torch.nn.Module, weights: dict) -> None:
    assert model.config.use_cache is False  # training again
    state = model.state_dict()
    assert set(state) == set(weights)
    for key, value in weights.items():
        assert torch.equal(state[key], value), key


def test_build_model_continues_from_an_exported_directory(exported):
    out_dir, weights = exported
    init = build_model("tiny-llama", seed=11, device="cpu")
    assert not torch.equal(init.lm_head.weight, weights["lm_head.weight"])  # training changed it
    for name in (out_dir, "file://" + out_dir):
        assert is_known_model(name)
        assert load_config(name).num_hidden_layers == PRESETS["tiny-llama"][1]["num_hidden_layers"]
        model = build_model(name, seed=0, device="cpu", vocab_size=4096)  # vocab_size: presets only
        _assert_loads_exactly(model, weights)
    again = build_model(out_dir, seed=99, device="cpu")  # the seed does not matter for pretrained weights
    _assert_loads_exactly(again, weights)


def test_build_model_downloads_a_remote_directory_once(exported, tmp_path, monkeypatch):
    import fsspec

    out_dir, weights = exported
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    root = f"memory://fuseforge-export-test-{os.getpid()}-{id(tmp_path)}"
    fs = fsspec.filesystem("memory")
    try:
        for name in os.listdir(out_dir):
            fs.put_file(os.path.join(out_dir, name), f"{root}/model/{name}")
        fs.put_file(os.path.join(out_dir, "config.json"), f"{root}/config-only/config.json")
        uri = f"{root}/model"
        assert is_known_model(uri) and is_known_model("s3://bucket/run/model")
        assert not is_known_model("nosuchproto://x/y") and not is_known_model("file:///no/such/dir")
        assert load_config(uri).hidden_size == 64

        downloads = []
        real_get = type(fs).get_file
        monkeypatch.setattr(type(fs), "get_file", lambda self, rpath, lpath, **kw: (downloads.append(rpath),
                                                                                    real_get(self, rpath, lpath, **kw)))
        _assert_loads_exactly(build_model(uri, seed=0, device="cpu"), weights)
        first = len(downloads)
        assert {os.path.basename(p) for p in downloads} == set(os.listdir(out_dir))  # weights, config, tokenizer
        _assert_loads_exactly(build_model(uri, seed=0, device="cpu"), weights)
        assert len(downloads) == first  # cached
        cached = os.listdir(tmp_path / "cache" / "models")
        assert len([c for c in cached if not c.endswith(".lock")]) == 1

        # a directory with only a config.json is random init from the seed, as before
        a, b = build_model(f"{root}/config-only", seed=1, device="cpu"), build_model(f"{root}/config-only", seed=1,
                                                                                     device="cpu")
        assert torch.equal(a.lm_head.weight, b.lm_head.weight)
        assert not torch.equal(a.lm_head.weight, weights["lm_head.weight"])
    finally:
        fs.rm(root.replace("memory://", ""), recursive=True)


def test_config_only_inputs_stay_random_init_and_presets_take_vocab_size(tmp_path, exported):
    out_dir, weights = exported
    only_config = tmp_path / "only-config"
    only_config.mkdir()
    (only_config / "config.json").write_text((open(os.path.join(out_dir, "config.json"))).read())
    for name in (str(only_config), str(only_config / "config.json")):
        a, b = build_model(name, seed=2, device="cpu"), build_model(name, seed=2, device="cpu")
        assert torch.equal(a.lm_head.weight, b.lm_head.weight)
        assert not torch.equal(a.lm_head.weight, weights["lm_head.weight"])
    assert load_config("tiny-llama", vocab_size=1024).vocab_size == 1024
    assert load_config("tiny-llama").vocab_size == PRESETS["tiny-llama"][1]["vocab_size"]
    assert build_model("tiny-qwen2", seed=0, device="meta", vocab_size=777).lm_head.weight.shape[0] == 777
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        load_config("tiny-llama", vocab_size=0)
    with pytest.raises(FileNotFoundError, match="without a config.json"):
        load_config(str(tmp_path))


def test_remote_out_dir_is_uploaded_with_config_last(exported, tmp_path, monkeypatch):
    import fsspec

    out_dir, weights = exported
    ctx = DistContext.from_env(need_group=False)
    model = build_model(out_dir, seed=0, device="cpu")
    strategy = make_strategy(_spec(), ctx, model)
    fs = fsspec.filesystem("memory")
    root = f"memory://fuseforge-upload-test-{os.getpid()}-{id(tmp_path)}"
    order = []
    real_put = type(fs).put_file
    monkeypatch.setattr(type(fs), "put_file", lambda self, lpath, rpath, **kw: (order.append(os.path.basename(rpath)),
                                                                                real_put(self, lpath, rpath, **kw)))
    try:
        assert save_pretrained_model(strategy, ctx, root + "/out") == root + "/out"
        assert order[-1] == "config.json" and "model.safetensors" in order
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
        _assert_loads_exactly(build_model(root + "/out", seed=0, device="cpu"), weights)
    finally:
        fs.rm(root.replace("memory://", ""), recursive=True)


# ---------------------------------------------------------------- the checks are real


def test_architectures_name_the_real_class_not_a_dynamic_wrapper():
    model = build_model("tiny-llama", seed=0, device="meta")
    real = type(model)
    mixin = type("WrapperMixin", (), {})
    wrapper = type(f"FSDP{real.__name__}", (mixin, real), {})  # as FSDP2 and fuseforge make them
    model.__class__ = wrapper
    assert transformers_class(model) is real
    config = export_mod.export_config(model, transformers_class(model))
    assert config.architectures == [real.__name__] and config.use_cache is True
    assert model.config.use_cache is False  # the live config is not touched
    with pytest.raises(ExportError, match="transformers class"):
        transformers_class(torch.nn.Linear(2, 2))


def test_verification_rejects_a_wrong_config_or_a_missing_tensor(exported, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    out_dir, _ = exported
    saved_model = export_mod._model_for_saving(build_model(out_dir, seed=0, device="cpu"),
                                               build_model(out_dir, seed=0, device="cpu").state_dict())
    verify_model_dir(out_dir, saved_model)  # the real export passes

    bad = tmp_path / "bad"
    shutil.copytree(out_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(config, architectures=["FSDPLlamaForCausalLM"])))
    with pytest.raises(ExportError, match="FSDPLlamaForCausalLM"):
        verify_model_dir(str(bad), saved_model)
    (bad / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ExportError, match="model.norm.weight is stored 0 times"):
        verify_model_dir(str(bad), saved_model)
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):  # never silently random-initialised
        build_model(str(bad), seed=0, device="cpu")
    with open(bad / "model.safetensors", "ab") as handle:
        handle.write(b"\0" * 8)
    with pytest.raises(ExportError, match="tensor data ends"):
        verify_model_dir(str(bad), saved_model)


def test_out_dir_rules_and_failures_leave_nothing_behind(exported, tmp_path):
    out_dir, weights = exported
    ctx = DistContext.from_env(need_group=False)
    strategy = make_strategy(_spec(), ctx, build_model(out_dir, seed=0, device=ctx.device))

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty directory (as tasks.py makes with mkdtemp) is replaced
    assert save_pretrained_model(strategy, ctx, str(empty)) == str(empty)
    with torch.no_grad():
        strategy.inner.lm_head.weight.add_(1.0)
    assert save_pretrained_model(strategy, ctx, str(empty)) == str(empty)  # a previous export is replaced
    assert torch.equal(_load_plain(str(empty)).lm_head.weight, weights["lm_head.weight"] + 1.0)

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        save_pretrained_model(strategy, ctx, str(other))
    assert os.listdir(other) == ["notes.txt"]
    with pytest.raises(ExportError, match="tokenizer_dir"):
        save_pretrained_model(strategy, ctx, str(tmp_path / "new"), tokenizer_dir=str(tmp_path / "missing"))
    assert sorted(os.listdir(tmp_path)) == ["empty", "other"]  # no half-written model, no temporary directory
