"""bf16 parameters with fp32 master weights (issue 21's efficient engine), on the CPU.

On GPUs the DDP strategy holds the model in bf16 and lets the optimizer update fp32 masters
(training/precision.py). CPU runs compute in fp32, so these tests force the bf16 path on the CPU
(torch runs bf16 matmuls there): gradients accumulate in fp32, the optimizer sees only masters, the
model is refreshed from them once per step, checkpoints hold the masters and a resume reproduces the
uninterrupted run bit for bit, and two gloo ranks agree with one process at the same global batch.
"""

import copy

import pytest
import torch

from fuseforge_flyte.training import optim, strategies
from fuseforge_flyte.training.engine import train
from fuseforge_flyte.training.faults import FAULT_ENV, InjectedFault
from fuseforge_flyte.training.local import run_local
from fuseforge_flyte.training.precision import MasterWeights, master_dtype_for
from fuseforge_flyte.training.spec import TrainSpec
import forking  # tests/support

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


class _Tied(torch.nn.Module):
    """An embedding tied to its output head, a hidden layer and a norm-like 1-D scale."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.hidden = torch.nn.Linear(16, 16)
        self.scale = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("inv_freq", torch.rand(4))  # buffers keep their dtype

    def forward(self, ids):
        h = torch.tanh(self.hidden(self.embed(ids))) * self.scale
        return torch.nn.functional.cross_entropy(self.head(h).float().flatten(0, 1), ids.flatten())


def _batch(seed):
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(seed))


def test_gradients_accumulate_in_fp32_on_the_masters():
    torch.manual_seed(0)
    model = _Tied()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    masters = MasterWeights(model, torch.bfloat16)
    assert [n for n, _ in masters.named_parameters()] == ["scale", "embed.weight", "hidden.weight", "hidden.bias"]
    assert all(p.dtype == torch.bfloat16 for p in model.parameters()) and model.inv_freq.dtype == torch.float32
    expected = [torch.zeros_like(m) for m in masters.parameters()]
    for seed in (1, 2, 3):
        batch = _batch(seed)
        model(batch).backward()
        grads = torch.autograd.grad(reference(batch), list(reference.parameters()))
        expected = [e + g.float() for e, g in zip(expected, grads)]
    assert all(p.grad is None for p in model.parameters())  # the bf16 gradients were handed over
    for master, want in zip(masters.parameters(), expected):
        assert master.dtype == torch.float32
        assert torch.equal(master.grad, want)  # bf16 gradients summed in fp32, exactly


def test_the_optimizer_updates_masters_and_the_model_follows_once_per_step():
    torch.manual_seed(0)
    model = _Tied()
    fp32 = [p.detach().clone() for p in model.parameters()]
    masters = MasterWeights(model, torch.bfloat16)
    optimizer = torch.optim.SGD(masters.parameters(), lr=1e-4)  # steps far below bf16's resolution
    model(_batch(1)).backward()
    optimizer.step()
    for before, master in zip(fp32, masters.parameters()):
        assert not torch.equal(before, master)  # the masters moved ...
    changed = [not torch.equal(p, b.to(torch.bfloat16)) for p, b in zip(model.parameters(), fp32)]
    assert not any(changed)  # ... the model not yet
    masters.refresh_model()
    for param, master in zip(model.parameters(), masters.parameters()):
        assert torch.equal(param, master.to(torch.bfloat16))


def _step_with(optimizer_of, micro_batches, device):
    """(model, masters, optimizer) with the gradients of `micro_batches` batches, before the step."""
    torch.manual_seed(0)
    model = _Tied().to(device)
    masters = MasterWeights(model, torch.bfloat16)
    optimizer = optimizer_of(optim.param_groups(masters.named_parameters(), 0.1), masters)
    for i, seed in enumerate(micro_batches):
        masters.start_micro_batch(last=i == len(micro_batches) - 1)
        model(_batch(seed).to(device)).backward()
    return model, masters, optimizer


@pytest.mark.parametrize("micro_batches", [(1,), (1, 2)], ids=["one micro-batch", "two micro-batches"])
def test_master_adamw_takes_bf16_gradients_and_writes_the_model(micro_batches, device):
    """One micro-batch on one rank: the bf16 gradients are used as they are (no fp32 copy); with two they sum
    in fp32. Either way MasterAdamW's update equals torch's AdamW on the fp32 gradients, and the model is the
    rounded masters right after the step (no refresh)."""
    model, masters, optimizer = _step_with(lambda groups, m: optim.master_adamw(groups, 1e-2, m), micro_batches,
                                           device)
    grads = [masters.gradient_of(m) for m in masters.parameters()]
    single = len(micro_batches) == 1
    assert all(g.dtype == (torch.bfloat16 if single else torch.float32) for g in grads)
    assert all((m.grad is None) == single for m in masters.parameters())
    _, reference, torch_adamw = _step_with(lambda groups, m: optim.adamw(groups, 1e-2), micro_batches, device)
    for master, grad in zip(reference.parameters(), grads):
        master.grad = grad.float()  # the same gradients, as torch's AdamW needs them: fp32
    optimizer.step()
    torch_adamw.step()
    for mine, theirs in zip(masters.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    for param, master in zip(model.parameters(), masters.parameters()):
        assert torch.equal(param, master.to(torch.bfloat16))
    masters.clear_gradients()
    optimizer.zero_grad(set_to_none=True)
    assert masters.gradients() == []


def test_state_dict_holds_the_fp32_masters_under_every_name():
    torch.manual_seed(0)
    model = _Tied()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    masters = MasterWeights(model, torch.bfloat16)
    state = masters.state_dict(model)
    assert state.keys() == original.keys()  # the tied head keeps its own key
    for key, value in state.items():
        assert value.dtype == torch.float32 and torch.equal(value, original[key])

    other = _Tied()
    other_masters = MasterWeights(other, torch.bfloat16)
    other_masters.load_state_dict(other, state)
    for mine, theirs in zip(masters.parameters(), other_masters.parameters()):
        assert torch.equal(mine, theirs)
    for mine, theirs in zip(model.parameters(), other.parameters()):
        assert theirs.dtype == torch.bfloat16 and torch.equal(mine, theirs)


def test_master_weights_need_an_fp32_model():
    with pytest.raises(TypeError, match="parameter 'scale' is torch.bfloat16"):
        MasterWeights(_Tied().to(torch.bfloat16), torch.bfloat16)


def test_only_bf16_on_gpus_uses_master_weights():
    assert master_dtype_for("bf16", torch.device("cuda", 0)) == torch.bfloat16
    assert master_dtype_for("fp16", torch.device("cuda", 0)) is None  # autocast + gradient scaler
    assert master_dtype_for("bf16", torch.device("cpu")) is None  # CPU runs compute in fp32


# ---------------------------------------------------------------- the engine with master weights forced on


@pytest.fixture
def bf16_masters(monkeypatch):
    """The DDP strategy's GPU path on the CPU: bf16 parameters with fp32 masters."""
    monkeypatch.setattr(strategies, "master_dtype_for", lambda dtype, device: torch.bfloat16)


def _spec(**overrides):
    base = dict(model="tiny-llama", dataset="bench:bytes", steps=6, batch_size=4, seq_len=32, lr=3e-3,
                warmup_steps=2, kernels=False, seed=7)
    base.update(overrides)
    return TrainSpec(**base)


def test_engine_trains_in_bf16_and_resumes_bit_for_bit(tmp_path, monkeypatch, one_torch_thread):
    plain = train(_spec(dtype="fp32"))  # before the bf16 path is forced on
    monkeypatch.setattr(strategies, "master_dtype_for", lambda dtype, device: torch.bfloat16)
    reference = train(_spec(checkpoint_dir=str(tmp_path / "ref"), checkpoint_every=2))
    assert reference.loss_curve[-1] < reference.loss_curve[0]
    # bf16 compute on fp32 masters follows the fp32 run closely, but not exactly (the bf16 path really ran)
    assert reference.loss_curve != plain.loss_curve
    torch.testing.assert_close(reference.loss_curve, plain.loss_curve, rtol=2e-2, atol=2e-2)
    spec = _spec(checkpoint_dir=str(tmp_path / "run"), checkpoint_every=2)
    monkeypatch.setenv(FAULT_ENV, "0:5:raise")
    with pytest.raises(InjectedFault):
        train(spec)
    monkeypatch.delenv(FAULT_ENV)
    resumed = train(spec)
    assert resumed.resumed_from_step == 4
    assert resumed.loss_curve == reference.loss_curve  # the masters, not their bf16 copies, were saved
    saved = torch.load(tmp_path / "run" / "step_00000006" / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for k, v in saved.items() if "inv_freq" not in k)


@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="two ranks need two GPUs (or the CPU's gloo)")
def test_two_ranks_reduce_the_master_gradients(bf16_masters, one_torch_thread):
    single = train(_spec(steps=4))
    results = run_local(_spec(steps=4, batch_size=2), 2, start_method=forking.start_method())
    assert results[0].loss_curve == results[1].loss_curve
    # each rank's bf16 gradients of half the batch, summed in fp32, against one bf16 backward of all of it
    torch.testing.assert_close(results[0].loss_curve, single.loss_curve, rtol=2e-3, atol=2e-3)
