"""The platform's DPO path: preference data checks, the reference scored once, the policy on the fused loss.

Offline: the shipped builtin:preferences pairs (or small files written here), the tiny-llama preset and the
shipped tiny BPE tokenizer (its chat template is applied by TRL's tokenization in the reference step).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("trl")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

from fuseforge_flyte.data.preferences import load_prepared, prepare_preferences  # noqa: E402
from fuseforge_flyte.measure import FuseforgeMetricsCallback  # noqa: E402
from fuseforge_flyte.training.dpo import (DPOSettings, _fused, check_scored, dpo_trainer,  # noqa: E402
                                          score_reference, train_dpo)
import forking  # noqa: E402 - tests/support


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    return str(path)


def _settings(**overrides) -> DPOSettings:
    values = dict(model="tiny-llama", steps=3, batch_size=4, max_length=48, lr=1e-3, seed=0)
    return DPOSettings(**{**values, **overrides})


def _train(settings: DPOSettings, scored_dir: str, output_dir: str):
    """train_dpo measured as the dpo task measures it: (TrainMetrics, PreferenceMetrics)."""
    meter = FuseforgeMetricsCallback(model_name=settings.model)
    preference = train_dpo(settings, scored_dir, output_dir, callbacks=[meter])
    return meter.metrics(), preference


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """The first 48 builtin pairs (8 held out), prepared and scored by the reference (= the policy's start)."""
    root = tmp_path_factory.mktemp("dpo")
    prepared, out = str(root / "prepared"), str(root / "scored")
    counts = prepare_preferences("builtin:preferences", prepared, split="train[:48]", eval_fraction=1 / 6, seed=0)
    summary = score_reference(_settings(), prepared, out)
    return counts, summary, out


# --- data ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "Q", "chosen": "A"}], r"no column 'rejected' needed for preference data"),
        ([{"prompt": "Q", "chosen": "A", "rejected": 3}], r"row 0, column 'rejected': expected a non-empty string"),
        ([{"prompt": "Q", "chosen": "A", "rejected": "B"}, {"prompt": "Q", "chosen": "A", "rejected": "A"}],
         r"row 1: chosen and rejected are identical"),
        ([{"prompt": "Q", "chosen": [{"role": "assistant", "content": "A"}], "rejected": "B"}],
         r"row 0: columns mix strings and message lists"),
    ],
)
def test_bad_preference_rows_are_named(tmp_path, rows, message):
    source = _write_jsonl(tmp_path / "pairs.jsonl", rows)
    with pytest.raises(ValueError, match=message):
        prepare_preferences(source, str(tmp_path / "out"))


def test_preferences_keep_only_pair_columns_and_hold_out_eval(tmp_path):
    rows = [{"prompt": f"Q{i}", "chosen": f"yes {i}", "rejected": f"no {i}", "score": i} for i in range(20)]
    counts = prepare_preferences(_write_jsonl(tmp_path / "pairs.jsonl", rows), str(tmp_path / "out"),
                                 eval_fraction=0.25, seed=1)
    data = load_prepared(str(tmp_path / "out"))
    assert counts == {"train": 15, "eval": 5}
    assert data["train"].column_names == ["prompt", "chosen", "rejected"]
    assert sorted(list(data["train"]["prompt"]) + list(data["eval"]["prompt"])) == sorted(r["prompt"] for r in rows)


# --- reference and policy ----------------------------------------------------------------------------


def test_reference_scoring_saves_tokenized_pairs_with_their_log_probs(scored):
    counts, summary, out = scored
    data = load_prepared(out)
    assert counts == {"train": 40, "eval": 8} and summary["rows"] == counts
    assert set(data["train"].column_names) == {"prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps",
                                               "ref_rejected_logps"}
    ref = torch.tensor(list(data["train"]["ref_chosen_logps"]))
    assert torch.isfinite(ref).all() and (ref < 0).all()
    with pytest.raises(ValueError, match="scored with max_length=48, this run uses max_length=64"):
        check_scored(out, _settings(max_length=64))


def test_policy_trains_on_the_fused_loss_against_the_scored_reference(scored, tmp_path, capfd, caplog):
    """Step 1's policy is the reference: the sigmoid loss is log 2 exactly when the stored log-probs are the
    reference's for the same tokens (a misaligned pair, a wrong truncation or another model would not be)."""
    _, _, out = scored
    capfd.readouterr()
    with caplog.at_level("INFO", logger="fuseforge.training"):
        metrics, preference = _train(_settings(), out, str(tmp_path / "model"))
    printed = "\n".join(capfd.readouterr())
    assert "{'loss'" not in printed and "'rewards/accuracies'" not in printed  # no raw Trainer dicts
    assert any(m.startswith("step 3/3 loss") and "reward accuracy" in m for m in caplog.messages)  # step lines
    assert preference.fused_loss, preference.notes
    # fp32 on the CPU; on a GPU both passes run under bf16 autocast (a misaligned pair is off by nats, not 1e-3)
    assert metrics.loss_curve[0] == pytest.approx(math.log(2), abs=2e-6 if DEVICE == "cpu" else 1e-3)
    assert metrics.steps == 3 and len(preference.accuracy_curve) == 3
    assert preference.eval_reward_accuracy is not None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    AutoTokenizer.from_pretrained(str(tmp_path / "model"))
    assert not hasattr(model, "_fuseforge_state")  # saved plain: loads without fuseforge
    from fuseforge_flyte.posttrain.decks import preference_deck_html

    deck = preference_deck_html(preference)
    assert "fused DPO loss" in deck and "eval reward accuracy" in deck and "<img" in deck


@pytest.mark.parametrize("qlora", [False, True], ids=["lora", "qlora"])
def test_lora_policy_trains_on_the_fused_loss_and_saves_a_peft_adapter(scored, tmp_path, qlora):
    """dpo with lora: the policy's adapters train (LoRA B starts at 0: step 1's loss is log 2 against the scored
    base), on the fused DPO loss; the output is an adapter directory plain peft loads onto the base."""
    pytest.importorskip("peft")
    _, _, out = scored
    settings = _settings(lora=True, qlora=qlora, lora_rank=4, lora_alpha=8.0, lr=1e-2)
    metrics, preference = _train(settings, out, str(tmp_path / "adapter"))
    assert preference.fused_loss, preference.notes
    assert any("PEFT: LoRA adapter(s) default" in note for note in preference.notes), preference.notes
    # QLoRA's step-1 policy is the NF4-rounded base, the scored reference the full-precision one: near log 2
    tolerance = 2e-2 if qlora else 2e-6 if DEVICE == "cpu" else 1e-3
    assert metrics.loss_curve[0] == pytest.approx(math.log(2), abs=tolerance)
    assert metrics.loss_curve[-1] != metrics.loss_curve[0]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["base_model_name_or_path"] == "tiny-llama"
    import peft
    from fuseforge_flyte.data.tokenizer import load_tokenizer
    from fuseforge_flyte.training.models import build_model

    base = build_model("tiny-llama", seed=0, device=torch.device("cpu"), vocab_size=len(load_tokenizer("", "tiny-llama")))
    adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    trained = [p for n, p in adapted.named_parameters() if "lora_B" in n]
    assert trained and any(p.abs().sum() > 0 for p in trained)  # the adapters moved away from B = 0


@pytest.mark.parametrize("settings, message", [
    (dict(lora=True, lora_rank=0), "DPO.lora_rank must be >= 1"),
    (dict(lora=True, lora_target_modules="nope"), "DPO.lora_target_modules: 'nope'"),
])
def test_bad_dpo_lora_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        _settings(**settings).validate()


def test_unfused_run_matches_the_fused_run(scored, tmp_path):
    _, _, out = scored
    fused, _ = _train(_settings(), out, str(tmp_path / "fused"))
    plain, preference = _train(_settings(kernels=False), out, str(tmp_path / "plain"))
    assert not preference.fused_loss
    assert fused.loss_curve == pytest.approx(plain.loss_curve, abs=2e-4)


def _ddp_worker(out: str, kernels: bool):
    """One of two DDP workers: train, then compare every rank's parameters (they must be the same replicas)."""
    import torch.distributed as dist

    trainer, _, notes = dpo_trainer(_settings(kernels=kernels), out)
    trainer.train()
    flat = torch.cat([p.detach().reshape(-1).float() for p in trainer.model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return {"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h], "fused": _fused(notes),
            "world": dist.get_world_size(), "replicas_equal": all(torch.equal(gathered[0], g) for g in gathered)}


def test_two_ddp_workers_train_on_the_fused_loss_with_synchronised_replicas(scored):
    """Under DDP the fused loss runs inside the wrapper's forward: gradients are all-reduced, so both ranks
    hold the same weights after training, and the losses are the unfused DDP run's."""
    from fuseforge_flyte.training.local import launch_local

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("two workers on a CUDA machine take one GPU each; this one has fewer")
    _, _, out = scored
    results = {}
    for kernels in (True, False):
        results[kernels] = launch_local(_ddp_worker, 2, out, kernels,
                                        start_method=forking.start_method())
    fused, plain = results[True], results[False]
    assert all(r["fused"] and r["world"] == 2 and r["replicas_equal"] for r in fused.values()), fused
    assert fused[0]["loss"] == pytest.approx(plain[0]["loss"], abs=2e-4)
