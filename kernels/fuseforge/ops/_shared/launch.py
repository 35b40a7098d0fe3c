"""Launching a Triton kernel without re-binding its arguments on every call.

`kernel[grid](*args)` binds and specialises every argument, builds a cache key from them and looks
the compiled kernel up on each launch: tens of microseconds of host time, more than a small op takes
on the GPU (RoPE at training shapes: ~0.1 ms of GPU time against ~0.3 ms of host time per step).
`launch` does that work once per configuration: the first launch of a configuration goes through
Triton (compiling if needed) and keeps the compiled kernel; later ones call its launcher directly.

A configuration holds everything Triton specialises the compiled kernel on, for the argument kinds
`launch` accepts: the current device, each tensor's dtype and 16-byte alignment, each integer's
width (integers must be marked `do_not_specialize`, so that their values are not specialised on),
the constexprs and `num_warps`. Under the interpreter, with a launch hook set (a profiler), or with
a Triton whose compiled kernels lack the launcher this uses, every launch goes through Triton.
"""

from __future__ import annotations

import triton
from triton import knobs

from fuseforge.ops._shared.utils import is_interpreter

_INT32 = range(-(2**31), 2**31)


def _hook_set(hook) -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps an always-present, possibly empty chain)."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _direct_launcher(compiled) -> bool:
    """Whether a compiled kernel exposes what `launch` calls (Triton 3.x's CompiledKernel does)."""
    return all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata"))


def configuration(device: int, tensors: tuple, ints: tuple, constexprs: tuple, num_warps: int) -> tuple:
    """What Triton specialises a compiled kernel on, for tensors, unspecialised integers and constexprs (one
    flat tuple: a kernel always takes as many tensors and integers)."""
    return (
        device, constexprs, num_warps,
        *[t.dtype for t in tensors],
        *[t.data_ptr() % 16 == 0 for t in tensors],
        *[v in _INT32 for v in ints],
    )


def launch(kernel, grid: tuple, tensors: tuple, ints: tuple, constexprs: tuple, num_warps: int) -> None:
    """`kernel[grid](*tensors, *ints, *constexprs, num_warps=num_warps)`, binding the arguments once per
    configuration. The kernel's parameters must come in that order: tensors, then integers marked
    do_not_specialize, then constexprs."""
    if is_interpreter() or _hook_set(knobs.runtime.launch_enter_hook) or _hook_set(knobs.runtime.launch_exit_hook):
        kernel[grid](*tensors, *ints, *constexprs, num_warps=num_warps)
        return
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    key = configuration(device, tensors, ints, constexprs, num_warps)
    cache = kernel.__dict__.setdefault("_fuseforge_compiled", {})
    compiled = cache.get(key)
    if compiled is None:
        compiled = kernel[grid](*tensors, *ints, *constexprs, num_warps=num_warps)
        if hasattr(compiled, "result"):  # a compilation still under way
            compiled = compiled.result()
        cache[key] = compiled if _direct_launcher(compiled) else False
        return
    if compiled is False:
        kernel[grid](*tensors, *ints, *constexprs, num_warps=num_warps)
        return
    compiled.run(
        grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
        driver.get_current_stream(device), compiled.function, compiled.packed_metadata, None, None, None,
        *tensors, *ints, *constexprs,
    )


def cached_configurations(kernel) -> int:
    """How many configurations of `kernel` `launch` holds a compiled kernel for (tests read it)."""
    return sum(1 for c in kernel.__dict__.get("_fuseforge_compiled", {}).values() if c is not False)

