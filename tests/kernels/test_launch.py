"""ops/_shared/launch.py: a launch that reuses a compiled kernel must mean what Triton's own launch means."""

import pytest
import torch
from test_rope import check_against_reference, make_cos_sin

import fuseforge.ops.rope as rope_module
from fuseforge.ops._shared.launch import _hook_set, cached_configurations, configuration

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the interpreter always launches through Triton")


def test_configuration_tells_apart_what_triton_specialises_on():
    """Dtypes, 16-byte alignment, integer width, constexprs, warps and device each make a new configuration;
    other data at equally aligned addresses does not."""
    a, b = torch.randn(64), torch.randn(64)
    assert a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0

    def key(tensors=(a,), ints=(7,), constexprs=(1, True), num_warps=4, device=0):
        return configuration(device, tensors, ints, constexprs, num_warps)

    base = key()
    assert key(tensors=(b,)) == base
    changed = [
        key(tensors=(a.double(),)),
        key(tensors=(torch.randn(65)[1:],)),  # 4 bytes past an aligned address
        key(ints=(2**31,)),
        key(ints=(-(2**31) - 1,)),
        key(constexprs=(2, True)),
        key(constexprs=(1, False)),
        key(num_warps=8),
        key(device=1),
    ]
    assert all(k != base for k in changed)
    assert key(ints=(2**31 - 1,)) == base and key(ints=(-(2**31),)) == base


def test_launch_hooks_are_detected_in_either_triton_form():
    """Triton 3.6 keeps an always-present hook chain (empty when unused); others use None or a callable."""

    class Chain:
        def __init__(self, calls):
            self.calls = calls

    assert not _hook_set(None)
    assert not _hook_set(Chain([]))
    assert _hook_set(Chain([print]))
    assert _hook_set(print)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_after_a_cached_launch_with_misaligned_inputs(device, dtype):
    """The same shapes first at aligned, then at misaligned addresses: a reused kernel compiled for aligned
    pointers would read the second with vector loads at the wrong alignment."""
    batch, seq, heads, kv_heads, head_dim = 2, 6, 4, 2, 32
    cos, sin = make_cos_sin(1, seq, head_dim, dtype, device)

    def qk(offset):
        def one(h):
            n = batch * seq * h * head_dim
            flat = torch.randn(n + offset, device=device).to(dtype)[offset:]
            return flat.view(batch, seq, h, head_dim).transpose(1, 2).detach().requires_grad_()

        return one(heads), one(kv_heads)

    q, k = qk(0)
    check_against_reference(q, k, cos, sin, dtype)
    check_against_reference(q, k, cos, sin, dtype)  # a second launch of the same configuration
    q, k = qk(1)
    assert q.data_ptr() % 16 != 0
    check_against_reference(q, k, cos, sin, dtype)


@needs_gpu
def test_dense_rope_reuses_its_compiled_kernel(device):
    """After its first launch a configuration is held, and later launches of it give the reference's values."""
    kernel = rope_module._rope_dense_kernel
    q, k = (torch.randn(2, 5, h, 64, device=device).transpose(1, 2).requires_grad_() for h in (4, 2))
    cos, sin = make_cos_sin(1, 5, 64, torch.float32, device)
    check_against_reference(q, k, cos, sin, torch.float32)
    held = cached_configurations(kernel)
    assert held >= 2  # forward and backward
    for _ in range(2):
        check_against_reference(q, k, cos, sin, torch.float32)
    assert cached_configurations(kernel) == held


@needs_gpu
def test_launch_hooks_see_every_launch(device):
    """With a profiler's launch hook registered, launches go through Triton, which calls the hook."""
    from triton import knobs

    seen = []

    def hook(metadata):
        seen.append(metadata)

    q, k = (torch.randn(2, 5, h, 64, device=device).transpose(1, 2).requires_grad_() for h in (4, 2))
    cos, sin = make_cos_sin(1, 5, 64, torch.float32, device)
    check_against_reference(q, k, cos, sin, torch.float32)  # configurations held
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            check_against_reference(q, k, cos, sin, torch.float32)
        finally:
            chain.remove(hook)
    else:
        knobs.runtime.launch_enter_hook = hook
        try:
            check_against_reference(q, k, cos, sin, torch.float32)
        finally:
            knobs.runtime.launch_enter_hook = chain
    assert len(seen) == 2
