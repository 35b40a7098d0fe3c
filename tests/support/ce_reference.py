"""Float64 reference for fuseforge's cross-entropy family, built only from torch ops.

torch has no z-loss or softcapping, so they are composed here from their definitions:
softcap: z = softcap * tanh(logits / softcap); z-loss: + z_loss_scale * logsumexp(z)**2
per non-ignored token. The mean divides by the non-ignored count (or num_items_in_batch)
and is 0 when every token is ignored.
"""

import torch
import torch.nn.functional as F


def reference_cross_entropy(
    logits,
    target,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    z_loss_scale=0.0,
    softcap=None,
    num_items_in_batch=None,
):
    """Loss of `logits` [N, V] (any float dtype; use float64) against `target` [N]."""
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    per_token = F.cross_entropy(z, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    valid = target != ignore_index
    if z_loss_scale:
        per_token = per_token + z_loss_scale * torch.logsumexp(z, dim=-1) ** 2 * valid
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    denom = num_items_in_batch if num_items_in_batch is not None else valid.sum().clamp(min=1)
    return total / denom


def reference_lse(logits, softcap=None):
    z = logits if softcap is None else softcap * torch.tanh(logits / softcap)
    return torch.logsumexp(z, dim=-1)


def random_targets(n, n_classes, ignore_index=-100, ignored_fraction=0.25):
    """Class indices with about `ignored_fraction` of them set to ignore_index (never all, if n > 1)."""
    target = torch.randint(0, n_classes, (n,))
    drop = torch.rand(n) < ignored_fraction
    if n > 1:
        drop[0] = False
    target[drop] = ignore_index
    return target
