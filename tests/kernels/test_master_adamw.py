"""fuseforge.optim.MasterAdamW: torch's AdamW update on fp32 masters, fused with writing their bf16/fp16 copies.

Compared with torch.optim.AdamW on the same masters, given the same gradients upcast to fp32: masters and both
moments after several steps with a changing learning rate and two weight-decay groups, ragged sizes, bf16, fp16
and fp32 gradients, a grad_scale, skipped parameters, state dicts both ways, and the refusals.
"""

import copy

import pytest
import torch

from fuseforge.optim import MasterAdamW

SHAPES = [(33, 65), (5000,), (7,), (3, 1, 4097)]
BETAS, EPS = (0.9, 0.95), 1e-8


def _groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def _run(device, grad_dtype, low=torch.bfloat16, steps=4, grad_scale=None, skip=None):
    """MasterAdamW and torch's AdamW from the same fresh masters, `steps` steps with the same gradients (torch's
    upcast to fp32): (starting masters, masters, their copies, MasterAdamW, torch's masters, torch's AdamW)."""
    masters = [torch.randn(s, device=device) for s in SHAPES]
    start = [m.clone() for m in masters]
    copies = {id(m): m.to(low) for m in masters}
    reference = [m.clone() for m in masters]
    grads = {}
    ours = MasterAdamW(_groups(masters), lr=1e-2, betas=BETAS, eps=EPS, model_copy_of=lambda m: copies[id(m)],
                       gradient_of=lambda m: grads.get(id(m)))
    theirs = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=BETAS, eps=EPS)
    for step in range(steps):
        for i, (m, r) in enumerate(zip(masters, reference)):
            g = (torch.randn(m.shape, device=device) * (step + 1)).to(grad_dtype)
            skipped = skip is not None and i == skip
            grads[id(m)] = None if skipped else g
            r.grad = None if skipped else g.float() / (1.0 if grad_scale is None else grad_scale)
        for group in ours.param_groups + theirs.param_groups:
            group["lr"] = 1e-2 * (0.5 + step)  # a scheduler changing lr between steps
        if grad_scale is not None:
            ours.grad_scale = torch.tensor(grad_scale, device=device)
        ours.step()
        theirs.step()
    return start, masters, copies, ours, reference, theirs


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_update_matches_torch_adamw_and_writes_the_copy(device, grad_dtype):
    low = torch.float16 if grad_dtype == torch.float16 else torch.bfloat16
    start, masters, copies, ours, reference, theirs = _run(device, grad_dtype, low=low)
    for m, r, before in zip(masters, reference, start):
        assert not torch.equal(m, before)  # it moved
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)
        # torch's CPU AdamW lerps the first moment, its fused CUDA kernel (and this one) use b1*m + (1-b1)*g
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[m][key], theirs.state[r][key], rtol=1e-5, atol=1e-6)
        assert float(ours.state[m]["step"]) == float(theirs.state[r]["step"]) == 4
        assert copies[id(m)].dtype == low and torch.equal(copies[id(m)], m.to(low))  # rounded to nearest even


def test_grad_scale_divides_the_gradients(device):
    _, masters, _, _, reference, _ = _run(device, torch.bfloat16, grad_scale=3.0)
    for m, r in zip(masters, reference):
        torch.testing.assert_close(m, r, rtol=1e-5, atol=1e-6)


def test_a_parameter_without_gradient_is_skipped(device):
    start, masters, copies, ours, reference, theirs = _run(device, torch.bfloat16, skip=2)
    assert torch.equal(masters[2], start[2]) and torch.equal(copies[id(masters[2])], start[2].to(torch.bfloat16))
    assert not ours.state[masters[2]] and not theirs.state[reference[2]]
    torch.testing.assert_close(masters[0], reference[0], rtol=1e-5, atol=1e-6)


def test_state_dicts_move_between_torch_adamw_and_master_adamw(device):
    _, masters, copies, ours, reference, theirs = _run(device, torch.float32, steps=2)
    # as a checkpoint would: ours -> a fresh torch AdamW on copies of our masters, theirs -> a fresh MasterAdamW
    mine_in_torch = [m.clone() for m in masters]
    torch_from_ours = torch.optim.AdamW(_groups(mine_in_torch), lr=1e-2, betas=BETAS, eps=EPS)
    torch_from_ours.load_state_dict(copy.deepcopy(ours.state_dict()))
    theirs_in_ours = [r.clone() for r in reference]
    fresh_copies = {id(m): m.to(torch.bfloat16) for m in theirs_in_ours}
    ours_from_torch = MasterAdamW(_groups(theirs_in_ours), lr=1e-2, betas=BETAS, eps=EPS,
                                  model_copy_of=lambda m: fresh_copies[id(m)])
    ours_from_torch.load_state_dict(copy.deepcopy(theirs.state_dict()))
    assert all(s["step"].device.type == "cpu" for s in ours_from_torch.state.values())
    grads = [torch.randn(m.shape, device=device) for m in masters]
    for params in (masters, mine_in_torch, reference, theirs_in_ours):
        for p, g in zip(params, grads):
            p.grad = g
    ours.gradient_of = lambda m: m.grad
    for optimizer in (ours, torch_from_ours, theirs, ours_from_torch):
        optimizer.step()
    for a, b, c, d in zip(masters, mine_in_torch, reference, theirs_in_ours):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(d, c, rtol=1e-5, atol=1e-6)


def test_bad_inputs_are_named(device):
    master = torch.randn(4, 6, device=device)
    copy = master.to(torch.bfloat16)

    def step(m, c, g):
        MasterAdamW([m], model_copy_of=lambda _: c, gradient_of=lambda _: g).step()

    with pytest.raises(TypeError, match="fp32 master weights, got a torch.float64"):
        step(master.double(), copy, copy)
    with pytest.raises(TypeError, match="model copy .* bf16 or fp16, got torch.float32"):
        step(master, master.clone(), copy)
    with pytest.raises(ValueError, match=r"must have the same shape"):
        step(master, copy, torch.randn(6, 4, device=device).to(torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous model copy"):
        step(master, master.t().contiguous().to(torch.bfloat16).t(), copy)
    with pytest.raises(ValueError, match="neither amsgrad nor maximize"):
        MasterAdamW([{"params": [master], "amsgrad": True}], model_copy_of=lambda _: copy,
                    gradient_of=lambda _: copy).step()
