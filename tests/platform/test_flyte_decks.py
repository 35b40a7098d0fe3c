"""The comparison arithmetic and the Deck HTML, on made-up metrics (no training, no Flyte run)."""

from __future__ import annotations

import base64
import html
import math
import random
import re

import pytest

from fuseforge_flyte.comparison import compare_metrics
from fuseforge_flyte.decks import comparison_deck_html, training_deck_html
from fuseforge_flyte.training.spec import TrainMetrics


def run(kernels: bool, steps: int = 9, **changes) -> TrainMetrics:
    loss = [6.0 - 0.2 * i + random.uniform(-0.05, 0.05) for i in range(steps)]
    values = dict(
        model="tiny-llama", kernels=kernels, strategy="ddp", device="cpu", world_size=2, steps=steps,
        tokens_per_s=random.uniform(1e3, 1e5), samples_per_s=random.uniform(1, 100), mfu=random.uniform(0.1, 0.6),
        peak_memory_gib=random.uniform(1, 80), step_time_p50_s=random.uniform(0.05, 0.5),
        step_time_p90_s=0.6, step_time_p99_s=0.7, final_loss=loss[-1], loss_curve=loss,
        tokens_per_s_curve=[random.uniform(1e3, 1e5) for _ in range(steps)],
        memory_gib_curve=[random.uniform(1, 80) for _ in range(steps)], num_params=123_456, tokens_per_step=4096,
        kernels_patched=["rms_norm", "rope"] if kernels else [],
    )
    values.update(changes)
    return TrainMetrics(**values)


def pngs(html: str) -> list[bytes]:
    return [base64.b64decode(b) for b in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html)]


def test_comparison_ratios():
    fused, base = run(True), run(False)
    c = compare_metrics(fused, base)
    assert c.throughput_gain_pct == pytest.approx(100 * (fused.tokens_per_s - base.tokens_per_s) / base.tokens_per_s)
    assert c.memory_reduction_pct == pytest.approx(100 * (base.peak_memory_gib - fused.peak_memory_gib) / base.peak_memory_gib)
    assert c.step_time_p50_speedup == pytest.approx(base.step_time_p50_s / fused.step_time_p50_s)
    assert c.final_loss_diff == pytest.approx(fused.final_loss - base.final_loss)
    diffs = [abs(a - b) for a, b in zip(fused.loss_curve, base.loss_curve)]
    assert c.max_loss_curve_diff == pytest.approx(max(diffs))
    assert c.with_kernels is fused and c.without_kernels is base


def test_comparison_skips_steps_skipped_for_nonfinite_loss():
    fused, base = run(True), run(False)
    fused.loss_curve[3] = math.nan
    expected = max(abs(a - b) for i, (a, b) in enumerate(zip(fused.loss_curve, base.loss_curve)) if i != 3)
    assert compare_metrics(fused, base).max_loss_curve_diff == pytest.approx(expected)


@pytest.mark.parametrize(
    "fused_changes, base_changes, message",
    [
        ({"kernels": False}, {}, "expected with_kernels.kernels=True and without_kernels.kernels=False"),
        ({"world_size": 8}, {}, "they differ in world_size (8 with kernels, 2 without)"),
        ({}, {"model": "tiny-qwen2"}, "they differ in model"),
        ({}, {"tokens_per_s": 0.0}, "without_kernels.tokens_per_s must be a positive finite number, got 0.0"),
        ({"peak_memory_gib": math.nan}, {}, "with_kernels.peak_memory_gib must be a positive finite number"),
    ],
)
def test_incomparable_runs_are_rejected(fused_changes, base_changes, message):
    fused = run(**{"kernels": True, **fused_changes})
    with pytest.raises(ValueError, match=re.escape(message)):
        compare_metrics(fused, run(False, **base_changes))


def test_training_deck_has_table_and_plots():
    m = run(True)
    html = training_deck_html(m)
    assert f"{m.tokens_per_s:,.1f}" in html and f"{m.final_loss:.4f}" in html and "123,456" in html
    assert "tiny-llama · ddp · 2 × cpu · fuseforge kernels (rms_norm, rope)" in html
    images = pngs(html)
    assert len(images) == 1 and images[0].startswith(b"\x89PNG\r\n\x1a\n") and len(images[0]) > 5000
    sparse = run(True, steps=20, loss_curve=[5.0, 4.0, 3.0, 2.0])  # logged every 5 steps
    assert pngs(training_deck_html(sparse))[0].startswith(b"\x89PNG")


def test_training_deck_names_where_the_model_is(monkeypatch):
    """Locally the folder; on a cluster pod its local folder means nothing in the console: the output is named."""
    from fuseforge_flyte import run_outputs

    m = run(True, model_dir="/tmp/fuseforge-model-x/model")
    monkeypatch.setenv(run_outputs.LOCAL_RUN_ENV, "1")
    assert "/tmp/fuseforge-model-x/model" in training_deck_html(m)
    monkeypatch.delenv(run_outputs.LOCAL_RUN_ENV)
    html = training_deck_html(m)
    assert "/tmp/fuseforge-model-x" not in html and "the task's model output" in html
    assert "s3://b/model" in training_deck_html(run(True, model_dir="s3://b/model"))


def test_comparison_deck_has_side_by_side_table_and_bars():
    c = compare_metrics(run(True), run(False))
    html = comparison_deck_html(c)
    for header in ("without kernels", "with kernels", "change"):
        assert f"<th>{header}</th>" in html
    assert f"{c.without_kernels.tokens_per_s:,.1f}" in html and f"{c.with_kernels.tokens_per_s:,.1f}" in html
    assert f"throughput {c.throughput_gain_pct:+.1f} %" in html
    images = pngs(html)
    assert len(images) == 1 and images[0].startswith(b"\x89PNG")


def test_printed_results_are_a_short_summary():
    """What pyflyte prints for an output: a few lines with the numbers a user looks for, not every field."""
    m = run(True, steps=200, eval_loss=2.5, eval_perplexity=math.exp(2.5), eval_loss_curve=[3.0, 2.5],
            eval_steps=[100, 200], model_dir="/runs/model", dataset="builtin:chat")
    text = repr(m)
    assert len(text) < 600 and text.count("\n") <= 4
    for needle in ("tokens/s", "MFU", "peak memory", "eval loss 2.5000", "/runs/model", "builtin:chat"):
        assert needle in text
    assert m.loss_curve[3] and str(m) == text  # the typed fields are all still there
    c = compare_metrics(run(True), run(False))
    assert len(repr(c)) < 800 and "throughput" in repr(c)


def test_cpu_comparisons_say_the_interpreter_makes_throughput_meaningless():
    cpu = compare_metrics(run(True), run(False))
    assert "Triton's interpreter" in cpu.note and "NOTE" in repr(cpu)
    assert html.escape(cpu.note) in comparison_deck_html(cpu)
    gpu = compare_metrics(run(True, device="NVIDIA H200"), run(False, device="NVIDIA H200"))
    assert gpu.note == "" and "NOTE" not in repr(gpu)
