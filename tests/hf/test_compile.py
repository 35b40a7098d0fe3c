"""A fuseforge-patched Hugging Face model under torch.compile: one graph, and eager's loss and gradients.

The patched forward hands its loss request to the patched lm_head, and patched attention opens a
fused-RoPE scope; eagerly both go through ContextVars, which dynamo cannot trace (a graph break each),
so while compiling they go through lists dynamo does trace (transformers/loss.py, transformers/rope.py).
The fused ops themselves run as custom ops there (tests/kernels/test_custom_ops.py).
"""

from __future__ import annotations

import pytest
import torch

from fuseforge.transformers import apply_kernels
from test_transformers_tiny_models import synthetic_batches, tiny_model
from tolerances import assert_close

pytestmark = pytest.mark.compiles  # torch.compile: run last in the test process (tests/conftest.py)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(model, forward, batch, **kwargs):
    """Loss and parameter gradients of one training step of `model` run through `forward`."""
    model.zero_grad(set_to_none=True)
    loss = forward(**batch, **kwargs).loss
    loss.backward()
    return loss, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    "family, count",
    [
        ("llama", None),
        # Gemma 2: final-logit softcapping in the fused loss, GELU-tanh MLP, offset RMSNorm; the
        # Trainer's num_items_in_batch as a tensor.
        ("gemma2", "tensor"),
    ],
)
def test_patched_model_compiles_to_one_graph(family, count, device):
    model = tiny_model(family)
    report = apply_kernels(model)
    assert not report.needs_warning(), report
    assert {"rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"} <= set(report.patched_kernels()), report
    model.train()
    batch = {k: v.to(device) for k, v in synthetic_batches(1)[0].items()}
    assert (batch["labels"] == -100).any()  # prompt and padding tokens are ignored
    kwargs = {} if count is None else {"num_items_in_batch": torch.tensor(17, device=device)}

    explained = torch._dynamo.explain(model)(**batch, **kwargs)
    assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
    assert explained.graph_count == 1
    graph = explained.graphs[0].code
    for op in ("rms_norm", "rope", "glu", "fused_linear_cross_entropy"):  # fused, not traced past
        assert f"torch.ops.fuseforge.{op}.default" in graph, op

    torch._dynamo.reset()
    loss, grads = _step(model, model, batch, **kwargs)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled_loss, compiled_grads = _step(model, compiled, batch, **kwargs)
    assert type(compiled_loss.grad_fn).__name__ == "CompiledFunctionBackward"  # not a silent eager fallback
    assert torch.isfinite(loss) and loss > 0
    assert_close(compiled_loss, loss, torch.float32)
    assert compiled_grads.keys() == grads.keys() and len(grads) == len(list(model.parameters()))
    for name, grad in grads.items():
        assert_close(compiled_grads[name], grad, torch.float32, msg=name)


def test_new_sequence_length_recompiles_dynamic(device):
    """A batch of another length recompiles with dynamic shapes (SymInt sizes through the ops' host
    planning and fake implementations), still one graph and still eager's numbers."""
    model = tiny_model("llama")
    apply_kernels(model)
    model.train()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for seq in (24, 17, 31):
        batch = {k: v.to(device) for k, v in synthetic_batches(1, seq=seq)[0].items()}
        loss, grads = _step(model, model, batch)
        compiled_loss, compiled_grads = _step(model, compiled, batch)
        assert_close(compiled_loss, loss, torch.float32)
        for name, grad in grads.items():
            assert_close(compiled_grads[name], grad, torch.float32, msg=name)


def test_layer_by_layer_compile(device):
    """The platform's mode (fuseforge_flyte.training.compilation): each decoder layer compiled on its own,
    in place; the fused RoPE scope opens inside the compiled layer, the loss head runs eagerly."""
    model = tiny_model("llama")
    apply_kernels(model)
    model.train()
    batch = {k: v.to(device) for k, v in synthetic_batches(1)[0].items()}
    loss, grads = _step(model, model, batch)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)  # fullgraph: a graph break raises
    compiled_loss, compiled_grads = _step(model, model, batch)
    assert_close(compiled_loss, loss, torch.float32)
    for name, grad in grads.items():
        assert_close(compiled_grads[name], grad, torch.float32, msg=name)
