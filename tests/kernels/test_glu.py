"""swiglu/geglu and the gated MLP modules against float64 PyTorch and transformers' MLPs."""

import pytest
import torch
import torch.nn.functional as F
from tolerances import assert_close

import fuseforge.ops.glu as glu_module
from fuseforge.functional import geglu, swiglu
from fuseforge.modules import GeGLUMLP, SwiGLUMLP

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# name -> (fused op, float64 reference)
OPS = {
    "swiglu": (swiglu, lambda g, u: F.silu(g) * u),
    "geglu_tanh": (lambda g, u, **kw: geglu(g, u, "tanh", **kw), lambda g, u: F.gelu(g, approximate="tanh") * u),
    "geglu_erf": (lambda g, u, **kw: geglu(g, u, "none", **kw), lambda g, u: F.gelu(g) * u),
}

# The interpreter computes exp(-g) in numpy, which warns when it overflows to inf (the intended result).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def make_inputs(shape, dtype, device, big_fraction=0.1, big=20.0):
    """Gate with a fraction of entries at |x| in [big - 5, big + 5], where naive sigmoid/tanh overflow."""
    gate = torch.randn(shape, device=device) * 3
    is_big = torch.rand(shape, device=device) < big_fraction
    big_values = (torch.rand(shape, device=device) * 10 + big - 5) * torch.randn(shape, device=device).sign()
    gate = torch.where(is_big, big_values, gate)
    up = torch.randn(shape, device=device)
    return gate.to(dtype).requires_grad_(), up.to(dtype).requires_grad_()


def check_against_reference(op_name, gate, up, dtype, **kwargs):
    op, reference = OPS[op_name]
    gate_before, up_before = gate.detach().clone(), up.detach().clone()
    out = op(gate, up, **kwargs)
    gate64 = gate.detach().double().requires_grad_()
    up64 = up.detach().double().requires_grad_()
    expected = reference(gate64, up64)
    assert out.dtype == dtype and out.shape == gate.shape
    assert torch.isfinite(out).all()
    assert_close(out, expected, dtype, msg=f"{op_name} output")
    grad_out = torch.randn_like(out)
    d_gate, d_up = torch.autograd.grad(out, (gate, up), grad_out)
    d_gate_ref, d_up_ref = torch.autograd.grad(expected, (gate64, up64), grad_out.double())
    assert_close(d_gate, d_gate_ref, dtype, msg=f"{op_name} grad gate")
    assert_close(d_up, d_up_ref, dtype, msg=f"{op_name} grad up")
    # Leaves belong to the caller: backward must never write into them.
    assert torch.equal(gate.detach(), gate_before) and torch.equal(up.detach(), up_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op_name", list(OPS))
def test_matches_float64_reference(device, op_name, dtype):
    gate, up = make_inputs((3, 5, 67), dtype, device)
    check_against_reference(op_name, gate, up, dtype)


@pytest.mark.parametrize("op_name", list(OPS))
def test_extreme_fp32_inputs_stay_finite(device, op_name):
    """|gate| up to 100: exp overflows to inf inside the sigmoid, and results must still be exact."""
    gate, up = make_inputs((131,), torch.float32, device, big_fraction=0.5, big=90.0)
    check_against_reference(op_name, gate, up, torch.float32)


@pytest.mark.parametrize("tile", [64, 256])
def test_launch_tiling_does_not_change_results(device, monkeypatch, tile):
    """Small tiles give a 2D grid with masked tails in both rows and columns."""
    monkeypatch.setattr(glu_module, "_INTERPRETER_TILE", tile)
    monkeypatch.setattr(glu_module, "_GPU_TILE", tile)
    gate, up = make_inputs((7, 3, 150), torch.float32, device)
    check_against_reference("swiglu", gate, up, torch.float32)


@pytest.mark.parametrize("op_name", list(OPS))
def test_strided_inputs(device, op_name):
    """Chunks of one fused gate_up projection (row-strided, read in place) and transposed (copied) inputs."""
    gate_up = torch.randn(4, 6, 2 * 45, device=device)
    gate, up = (t.requires_grad_() for t in gate_up.chunk(2, dim=-1))
    assert gate.stride() == (6 * 90, 90, 1)
    check_against_reference(op_name, gate, up, torch.float32)
    gate_t = torch.randn(45, 6, device=device).t().requires_grad_()
    up_t = torch.randn(45, 6, device=device).t().requires_grad_()
    check_against_reference(op_name, gate_t, up_t, torch.float32)


@pytest.mark.parametrize("op_name", list(OPS))
def test_dense_and_strided_operands_mixed(device, op_name):
    """Dense operands launch as one flat row, others as [rows, cols] views: one dense and one row-strided
    input, and a dense forward whose upstream gradient is transposed (the backward takes the rows path)."""
    gate = torch.randn(4, 6, 45, device=device, requires_grad=True)
    up = torch.randn(4, 6, 2 * 45, device=device)[..., :45].requires_grad_()
    check_against_reference(op_name, gate, up, torch.float32)
    op, reference = OPS[op_name]
    gate, up = torch.randn(45, 6, device=device, requires_grad=True), torch.randn(45, 6, device=device, requires_grad=True)
    grad_out = torch.randn(6, 45, device=device).t()
    assert not grad_out.is_contiguous()
    grads = torch.autograd.grad(op(gate, up), (gate, up), grad_out)
    gate64, up64 = gate.detach().double().requires_grad_(), up.detach().double().requires_grad_()
    expected = torch.autograd.grad(reference(gate64, up64), (gate64, up64), grad_out.double())
    for got, want, name in zip(grads, expected, ("gate", "up")):
        assert_close(got, want, torch.float32, msg=f"{op_name} grad {name}")


def _mlp_activations(device, width=40):
    """gate/up as an MLP makes them: non-leaf outputs of projections, with gradients flowing to x."""
    x = torch.randn(5, 16, device=device, requires_grad=True)
    w_gate = torch.randn(16, width, device=device)
    w_up = torch.randn(16, width, device=device)
    return x, w_gate, w_up


@pytest.mark.parametrize("op_name", list(OPS))
def test_backward_reuses_activation_buffers(device, op_name):
    """Non-leaf gate/up receive their gradients in their own memory (no new allocation), correctly."""
    op, reference = OPS[op_name]
    x, w_gate, w_up = _mlp_activations(device)
    gate, up = x @ w_gate, x @ w_up
    seen = {}
    gate.register_hook(lambda g: seen.__setitem__("gate", g.data_ptr()))
    up.register_hook(lambda g: seen.__setitem__("up", g.data_ptr()))
    gate_ptr, up_ptr = gate.data_ptr(), up.data_ptr()
    grad_out = torch.randn(5, 40, device=device)
    op(gate, up).backward(grad_out)
    assert seen == {"gate": gate_ptr, "up": up_ptr}

    x64 = x.detach().double().requires_grad_()
    reference(x64 @ w_gate.double(), x64 @ w_up.double()).backward(grad_out.double())
    assert_close(x.grad, x64.grad, torch.float32, scale=10)


@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "copied"])
def test_inplace_backward_false_keeps_activations(device, transposed):
    """Neither the caller's activations nor a private contiguous copy are reused: backward twice works."""
    x, w_gate, w_up = _mlp_activations(device)
    gate, up = x @ w_gate, x @ w_up
    if transposed:
        gate, up = gate.t(), up.t()
    gate_before = gate.detach().clone()
    out = swiglu(gate, up, inplace_backward=False)
    out.sum().backward(retain_graph=True)  # .sum() hands backward a stride-0 gradient
    first = x.grad.clone()
    out.sum().backward()
    assert torch.equal(gate.detach(), gate_before)
    assert_close(x.grad, 2 * first, torch.float32)
    x64 = x.detach().double().requires_grad_()
    (F.silu(x64 @ w_gate.double()) * (x64 @ w_up.double())).sum().backward()
    assert_close(first, x64.grad, torch.float32, scale=10)


def test_second_backward_after_buffer_reuse_raises(device):
    x, w_gate, w_up = _mlp_activations(device)
    out = swiglu(x @ w_gate, x @ w_up)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward=False"):
        out.sum().backward()


def test_other_reader_of_reused_buffer_fails_loudly(device):
    """If another op saved gate and runs its backward later, autograd's version check stops it."""
    x, w_gate, w_up = _mlp_activations(device)
    gate = x @ w_gate
    side = (gate * gate).sum()  # saves gate; created first, so its backward runs after swiglu's
    loss = swiglu(gate, x @ w_up).sum() + side
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


# Inputs made from caller-owned leaves in ways that share memory or are saved by autograd (issue 16):
# layout -> (leaf shapes, build(leaves) -> (gate, up)). Backward must leave every leaf as it was
# and give the gradients float64 PyTorch gives.
SHARED_MEMORY_LAYOUTS = {
    "leaf_slice": ([(4, 16), (4, 8)], lambda p, u: (p[:, :8], u)),  # a view of a parameter
    "leaf_reshape": ([(4, 8), (4, 8)], lambda p, u: (p.view(2, 16), u.view(2, 16))),  # covers the whole leaf
    "expanded_leaf": ([(1, 8), (4, 8)], lambda g0, u: (g0.expand(4, 8), u)),  # 4 rows share 8 cells
    "expanded_matmul": ([(1, 5), (5, 8), (4, 8)], lambda x, w, u: ((x @ w).expand(4, 8), u)),
    "output_saved_upstream": ([(4, 8), (4, 8)], lambda z, u: (torch.sigmoid(z), torch.exp(u))),  # backward reads it
}


@pytest.mark.parametrize("layout", list(SHARED_MEMORY_LAYOUTS))
@pytest.mark.parametrize("op_name", list(OPS))
def test_inputs_sharing_memory_are_never_overwritten(device, op_name, layout):
    op, reference = OPS[op_name]
    shapes, build = SHARED_MEMORY_LAYOUTS[layout]
    leaves = [torch.randn(shape, device=device, requires_grad=True) for shape in shapes]
    before = [leaf.detach().clone() for leaf in leaves]
    out = op(*build(*leaves))
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    leaves64 = [leaf.detach().double().requires_grad_() for leaf in leaves]
    reference(*build(*leaves64)).backward(grad_out.double())
    for i, (leaf, leaf64, old) in enumerate(zip(leaves, leaves64, before)):
        assert torch.equal(leaf.detach(), old), f"leaf {i} was overwritten"
        assert_close(leaf.grad, leaf64.grad, torch.float32, scale=10, msg=f"grad of leaf {i}")


@pytest.mark.parametrize("bias", [False, True])
def test_3d_linear_outputs_are_reused(device, bias):
    """gate_proj(x) of an HF MLP ([batch, seq, hidden] input) keeps the memory win; with a bias it is a
    full-size view of the addmm output, still the op's to overwrite."""
    x = torch.randn(2, 3, 16, device=device, requires_grad=True)
    proj = torch.nn.Linear(16, 40, bias=bias, device=device)
    gate, up = proj(x), proj(x)
    assert (gate._base is not None) == bias
    seen = {}
    gate.register_hook(lambda g: seen.__setitem__("gate", g.data_ptr()))
    up.register_hook(lambda g: seen.__setitem__("up", g.data_ptr()))
    ptrs = {"gate": gate.data_ptr(), "up": up.data_ptr()}
    swiglu(gate, up).sum().backward()
    assert seen == ptrs


def test_same_tensor_as_gate_and_up(device):
    """swiglu(a, a): the buffers alias, so backward must not reuse them; gradient is the sum of both."""
    x, w_gate, _ = _mlp_activations(device)
    a = x @ w_gate
    out = swiglu(a, a)
    grad_out = torch.randn_like(out)
    (d_a,) = torch.autograd.grad(out, a, grad_out)
    a64 = a.detach().double().requires_grad_()
    (d_ref,) = torch.autograd.grad(F.silu(a64) * a64, a64, grad_out.double())
    assert_close(d_a, d_ref, torch.float32)


@pytest.mark.parametrize("op_name", list(OPS))
def test_gradcheck_float64(device, op_name):
    op, _ = OPS[op_name]
    gate = (torch.randn(3, 5, dtype=torch.float64, device=device) * 3).requires_grad_()
    up = torch.randn(3, 5, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(op, (gate, up), fast_mode=True)


def test_empty_input(device):
    gate = torch.randn(0, 8, device=device, requires_grad=True)
    up = torch.randn(0, 8, device=device, requires_grad=True)
    out = swiglu(gate, up)
    out.sum().backward()
    assert out.shape == (0, 8) and gate.grad.shape == (0, 8)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (lambda g, u: swiglu(g, u[:, :7]), ValueError, r"gate \(4, 8\) and up \(4, 7\) must have the same shape"),
        (lambda g, u: swiglu(g, u.double()), TypeError, "up has dtype"),
        (lambda g, u: swiglu(g.long(), u), TypeError, "gate must have dtype"),
        (lambda g, u: swiglu(g.tolist(), u), TypeError, "gate must be a torch.Tensor"),
        (lambda g, u: swiglu(g[0, 0], u[0, 0]), ValueError, "gate must have at least 1 dimensions"),
        (lambda g, u: geglu(g, u, approximate="erf"), ValueError, "approximate must be one of .*'erf'"),
        (lambda g, u: geglu(g, u[:1]), ValueError, "must have the same shape"),
    ],
)
def test_bad_inputs(device, call, error, match):
    gate, up = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    with pytest.raises(error, match=match):
        call(gate, up)


# ---------------------------------------------------------------- modules vs transformers


def _hf_mlp(kind, hidden, intermediate, bias):
    from transformers import GemmaConfig, LlamaConfig
    from transformers.models.gemma.modeling_gemma import GemmaMLP
    from transformers.models.llama.modeling_llama import LlamaMLP

    sizes = dict(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=2, num_key_value_heads=2)
    if kind == "gemma":
        return GemmaMLP(GemmaConfig(**sizes, head_dim=hidden // 2))
    act = "silu" if kind == "llama" else "gelu"
    return LlamaMLP(LlamaConfig(**sizes, hidden_act=act, mlp_bias=bias))


@pytest.mark.parametrize(
    "kind,bias",
    [("llama", False), ("llama", True), ("gemma", False), ("llama_exact_gelu", False)],
)
def test_mlp_matches_transformers(device, kind, bias):
    hidden, intermediate = 24, 70
    hf = _hf_mlp(kind, hidden, intermediate, bias).to(device)
    if kind == "llama":
        ours = SwiGLUMLP(hidden, intermediate, bias=bias, device=device)
    else:
        ours = GeGLUMLP(hidden, intermediate, approximate="tanh" if kind == "gemma" else "none", device=device)
    ours.load_state_dict(hf.state_dict())  # strict: parameter names and shapes must match HF's
    x = torch.randn(2, 5, hidden, device=device)
    x_ours, x_hf = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_hf = ours(x_ours), hf(x_hf)
    assert_close(out, out_hf, torch.float32, scale=10)
    grad = torch.randn_like(out)
    out.backward(grad)
    out_hf.backward(grad)
    assert_close(x_ours.grad, x_hf.grad, torch.float32, scale=10)
    hf_params = dict(hf.named_parameters())
    for name, param in ours.named_parameters():
        assert_close(param.grad, hf_params[name].grad, torch.float32, scale=10, msg=name)


def test_mlp_bf16_parameters(device):
    mlp = SwiGLUMLP(32, 48, dtype=torch.bfloat16, device=device)
    x = torch.randn(3, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
    out = mlp(x)
    expected = mlp.down_proj(F.silu(mlp.gate_proj(x).float()).to(torch.bfloat16) * mlp.up_proj(x))
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, torch.bfloat16, scale=2)
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in mlp.parameters())


@pytest.mark.parametrize(
    "make,error,match",
    [
        (lambda: SwiGLUMLP(0, 8), ValueError, "hidden_size must be > 0"),
        (lambda: SwiGLUMLP(8, 2.5), TypeError, "intermediate_size must be an int"),
        (lambda: GeGLUMLP(8, 16, approximate="exact"), ValueError, "approximate must be one of"),
    ],
)
def test_mlp_bad_config(make, error, match):
    with pytest.raises(error, match=match):
        make()
