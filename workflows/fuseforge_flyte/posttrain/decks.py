"""The dpo workflow's Deck: reward accuracy and margin of the policy, with the tables and plots of decks.py."""

from __future__ import annotations

import html

from fuseforge_flyte.decks import figure_html, table_html
from fuseforge_flyte.training.dpo import PreferenceMetrics


def _maybe(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def preference_deck_html(p: PreferenceMetrics) -> str:
    """DPO's reward accuracy and margin: a table and their curves over the logged steps."""
    from matplotlib.figure import Figure

    rows = [("loss type", p.loss_type), ("reference model", p.reference_model),
            ("fused DPO loss", "yes" if p.fused_loss else "no (TRL's own loss: see the notes)"),
            ("reward accuracy (last 10% of steps)", _maybe(p.reward_accuracy, ".3f")),
            ("reward margin (last 10% of steps)", _maybe(p.reward_margin, ".4f"))]
    if p.eval_reward_accuracy is not None:
        rows += [("eval reward accuracy", _maybe(p.eval_reward_accuracy, ".3f")),
                 ("eval reward margin", _maybe(p.eval_reward_margin, ".4f"))]
    fig = Figure(figsize=(10, 3.6))
    for ax, (curve, title) in zip(fig.subplots(1, 2), ((p.accuracy_curve, "reward accuracy"),
                                                       (p.margin_curve, "reward margin"))):
        ax.plot(range(1, len(curve) + 1), list(curve), marker="." if len(curve) <= 50 else None)
        ax.set(title=title, xlabel="logged step")
        ax.grid(alpha=0.3)
    notes = "".join(f"<li>{html.escape(note)}</li>" for note in p.notes)
    return (table_html(["metric", "value"], rows) + figure_html(fig, "reward accuracy and margin per step")
            + (f"<h4>kernels</h4><ul>{notes}</ul>" if notes else ""))
