"""HTML for the Flyte Decks: metric tables and matplotlib plots embedded as base64 PNGs.

Plain functions of the metrics dataclasses (no Flyte context needed), so they can be tested and
reused outside a task. matplotlib is used through `Figure` directly: no pyplot global state.
"""

from __future__ import annotations

import base64
import html
import io
from typing import List, Sequence, Tuple

from fuseforge_flyte import run_outputs
from fuseforge_flyte.comparison import Comparison
from fuseforge_flyte.training.spec import TrainMetrics

_GIB = "GiB"


def _model_location(model_dir: str) -> str:
    """Where the person reading the Deck finds the model: a folder inside a cluster pod means nothing in the
    console; Flyte uploads it as the task's `model` output."""
    if not model_dir:
        return "not saved"
    if "://" in model_dir or run_outputs.is_local_run():
        return model_dir
    return "the task's model output (Flyte uploads the pod's folder to the object store)"


def figure_html(fig, alt: str) -> str:
    """A matplotlib figure as an inline <img> (PNG, base64)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{encoded}" style="max-width:100%"/>'


def table_html(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    import pandas as pd
    from flytekitplugins.deck.renderer import TableRenderer

    return TableRenderer().to_html(pd.DataFrame([list(map(str, r)) for r in rows], columns=list(header)))


def _steps_axis(curve: Sequence[float], steps: int) -> Tuple[List[int], str]:
    """x values for a per-step curve; curves logged every k steps are spread over the run."""
    n = len(curve)
    if n == 0:
        return [], "step"
    if n == steps:
        return list(range(1, n + 1)), "step"
    stride = max(steps // n, 1)
    return [stride * (i + 1) for i in range(n)], f"step (logged every {stride})"


def _metric_rows(m: TrainMetrics) -> List[Tuple[str, str]]:
    return [
        ("tokens/s", f"{m.tokens_per_s:,.1f}"),
        ("samples/s", f"{m.samples_per_s:,.2f}"),
        ("MFU", _mfu(m)),
        ("peak memory", f"{m.peak_memory_gib:.3f} {_GIB}"),
        ("step time p50 / p90 / p99", f"{m.step_time_p50_s * 1e3:.1f} / {m.step_time_p90_s * 1e3:.1f} / {m.step_time_p99_s * 1e3:.1f} ms"),
        ("final loss", f"{m.final_loss:.4f}"),
        ("eval loss / perplexity", f"{m.eval_loss:.4f} / {m.eval_perplexity:.3f}" if m.eval_loss is not None else "no eval data"),
        ("data wait (share of step time)", f"{m.data_wait_fraction * 100:.2f} %"),
        ("dataset", m.dataset or "n/a"),
        ("trained model", _model_location(m.model_dir)),
        ("steps", str(m.steps)),
        ("tokens per step (global)", f"{m.tokens_per_step:,}"),
        ("parameters", f"{m.num_params:,}"),
        ("dtype", m.dtype),
        ("Flyte attempt / restarts / steps redone / skipped",
         f"{m.attempt} / {m.restarts} / {m.steps_redone} / {m.skipped_steps}"),
        ("resumed from step", str(m.resumed_from_step)),
    ]


def _mfu(m: TrainMetrics) -> str:
    """One way to show MFU in every Deck: a share of the device's peak, or why there is none."""
    return f"{m.mfu * 100:.1f} %" if m.mfu else "n/a (device peak unknown)"


def _describe_setup(m: TrainMetrics) -> str:
    return f"{m.model} · {m.strategy} · {m.world_size} × {m.device}"


def _describe_run(m: TrainMetrics) -> str:
    kernels = "fuseforge kernels" if m.kernels else "stock PyTorch/HF"
    if m.kernels and m.kernels_patched:
        kernels += f" ({', '.join(m.kernels_patched)})"
    return f"{_describe_setup(m)} · {kernels}"


def training_deck_html(m: TrainMetrics) -> str:
    """Metrics table and loss / tokens/s / memory per step for one run."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 3.6))
    panels = (
        (m.loss_curve, "loss", "training loss"),
        (m.tokens_per_s_curve, "tokens/s", "throughput"),
        (m.memory_gib_curve, _GIB, "memory"),
    )
    for ax, (curve, ylabel, title) in zip(fig.subplots(1, 3), panels):
        xs, xlabel = _steps_axis(curve, m.steps)
        ax.plot(xs, list(curve), marker="." if len(xs) <= 50 else None)
        if title == "training loss" and m.eval_loss_curve:
            ax.plot(list(m.eval_steps), list(m.eval_loss_curve), marker="o", label="eval")
            ax.legend()
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if ylabel == _GIB:
            ax.set_ylim(bottom=0)  # memory from zero: a flat 18.4 GiB must not look like a swing
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    return (
        f"<h3>{html.escape(_describe_run(m))}</h3>"
        + table_html(["metric", "value"], _metric_rows(m))
        + figure_html(fig, "loss, throughput and memory per step")
        + plan_html(m.plan)
    )


def plan_html(plan_json: str) -> str:
    """The planner's probes (one row each: layout, peak memory, tokens/s, verdict) and its choice; "" without."""
    if not plan_json:
        return ""
    from fuseforge_flyte.training.plan import Plan

    plan = Plan.from_json(plan_json)
    rows = []
    for p in plan.probes:
        c = p.candidate
        verdict = ("chosen" if c == plan.choice else "out of memory" if p.oom
                   else "over budget" if not p.fits(plan.budget_bytes) else "fits")
        rows.append((c.micro_batch, c.grad_accum, {0: "none", 1: "all"}.get(c.checkpoint_every,
                                                                           f"every {c.checkpoint_every}"),
                     c.loss_chunk_size or "default", "" if p.oom else f"{p.peak_bytes / 2**30:.2f}",
                     "" if p.oom else f"{p.tokens_per_s * plan.world_size:,.0f}", verdict))
    header = ["micro-batch", "grad_accum", "checkpointed layers", "loss chunk", f"peak ({_GIB})", "tokens/s",
              "result"]
    return (f"<h4>batch layout plan: {html.escape(plan.summary())}</h4>"
            f"<p>budget per GPU {plan.budget_bytes / 2**30:.2f} {_GIB} for the probes' peak (optimizer state "
            f"{plan.optimizer_bytes / 2**30:.2f} {_GIB} set aside); global batch {plan.global_batch} sequences "
            f"on {plan.world_size} GPU(s)</p>" + table_html(header, rows))


def _change(new: float, old: float, lower_is_better: bool = False) -> str:
    if old == 0:
        return "n/a"
    pct = (new / old - 1.0) * 100.0
    return f"{-pct if lower_is_better else pct:+.1f} %"


def comparison_deck_html(c: Comparison) -> str:
    """Side-by-side table and bar plots of the same run with and without the kernels."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    w, wo = c.with_kernels, c.without_kernels
    headline = (
        f"throughput {c.throughput_gain_pct:+.1f} % · peak memory {-c.memory_reduction_pct:+.1f} % · "
        f"final loss difference {c.final_loss_diff:+.2e}"
    )
    rows = [
        ("tokens/s", f"{wo.tokens_per_s:,.1f}", f"{w.tokens_per_s:,.1f}", _change(w.tokens_per_s, wo.tokens_per_s)),
        ("samples/s", f"{wo.samples_per_s:,.2f}", f"{w.samples_per_s:,.2f}", _change(w.samples_per_s, wo.samples_per_s)),
        ("MFU", _mfu(wo), _mfu(w), _change(w.mfu, wo.mfu)),
        ("peak memory (GiB)", f"{wo.peak_memory_gib:.3f}", f"{w.peak_memory_gib:.3f}",
         f"{-c.memory_reduction_pct:+.1f} %"),
        ("step time p50 (ms)", f"{wo.step_time_p50_s * 1e3:.1f}", f"{w.step_time_p50_s * 1e3:.1f}",
         _change(w.step_time_p50_s, wo.step_time_p50_s)),
        ("step time p90 (ms)", f"{wo.step_time_p90_s * 1e3:.1f}", f"{w.step_time_p90_s * 1e3:.1f}",
         _change(w.step_time_p90_s, wo.step_time_p90_s)),
        ("final loss", f"{wo.final_loss:.4f}", f"{w.final_loss:.4f}", f"{c.final_loss_diff:+.2e}"),
        ("max |loss difference| per step", "", "", f"{c.max_loss_curve_diff:.2e}"),
    ]

    fig = Figure(figsize=(15, 3.6))
    axes = fig.subplots(1, 4)
    labels, colors = ["without", "with"], ["#9e9e9e", "#1f77b4"]
    bars = (
        ("tokens/s", wo.tokens_per_s, w.tokens_per_s),
        (f"peak memory ({_GIB})", wo.peak_memory_gib, w.peak_memory_gib),
        ("step time p50 (ms)", wo.step_time_p50_s * 1e3, w.step_time_p50_s * 1e3),
    )
    for ax, (title, base, fused) in zip(axes, bars):
        ax.bar_label(ax.bar(labels, [base, fused], color=colors), fmt="%.4g")
        ax.set_title(title)
        ax.set_ylim(bottom=0, top=max(base, fused) * 1.15 or 1)  # from zero, room for the labels
        ax.grid(axis="y", alpha=0.3)
    for metrics, label, color in ((wo, "without kernels", colors[0]), (w, "with kernels", colors[1])):
        xs, xlabel = _steps_axis(metrics.loss_curve, metrics.steps)
        axes[3].plot(xs, list(metrics.loss_curve), label=label, color=color)
    axes[3].set(title="loss", xlabel=xlabel)
    axes[3].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[3].legend()
    note = f"<p><b>Note:</b> {html.escape(c.note)}</p>" if c.note else ""
    return (
        f"<h3>{html.escape(_describe_setup(w))}: {html.escape(headline)}</h3>"
        + note
        + table_html(["metric", "without kernels", "with kernels", "change"], rows)
        + figure_html(fig, "with vs without kernels")
    )
