"""Class-index targets counted and range-checked on the device, in one launch and without a host sync.

Why: checking `0 <= target < V` on the host before the loss kernels run is a host sync; it
stalls the CPU until the GPU has finished everything queued before the loss, and the GPU then
idles while the rest of the step is launched (0.47 ms of a 2.19 ms cross_entropy step on an
H200, benchmarks/RESULTS.md). Here one small kernel counts the non-ignored targets (the "mean"
denominator) and records any bad index; the loss kernels give such tokens a NaN loss.

When the ValueError is raised (`TARGET_CHECK`, read at call time):
* "async" (default): on a CUDA device, the result is copied to pinned host memory behind the
  kernel and examined, without waiting, at the start of every later loss call and in backward;
  the first of those that runs after the GPU has finished the scan raises, naming the bad index
  and the call that received it. `raise_pending_target_errors(wait=True)` waits and raises now.
* "sync": wait for the scan right away and raise in the call itself (one host sync per call).
On the CPU (Triton's interpreter) the kernel has finished when it returns, so both raise in the call.
While a CUDA graph is being captured nothing is examined (the scan still gives the denominator).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TARGET_CHECK = "async"
TARGET_CHECK_MODES = ("async", "sync")

_BLOCK = 4096


@triton.jit
def _scan_targets_kernel(target_ptr, n, n_classes, ignore_index, inv_count_ptr, found_ptr, BLOCK: tl.constexpr):
    """One program: inv_count = 1 / max(#non-ignored, 1); found = (#bad indices, one bad index)."""
    n_valid = tl.zeros([BLOCK], tl.int32)
    n_bad = tl.zeros([BLOCK], tl.int32)
    bad_value = tl.zeros([BLOCK], tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        t = tl.load(target_ptr + offs, mask=offs < n, other=ignore_index).to(tl.int64)
        valid = t != ignore_index
        bad = valid & ((t < 0) | (t >= n_classes))
        n_valid += valid.to(tl.int32)
        n_bad += bad.to(tl.int32)
        bad_value = tl.where(bad, t, bad_value)
    total_valid = tl.sum(n_valid, axis=0)
    tl.store(inv_count_ptr, 1.0 / tl.maximum(total_valid, 1).to(tl.float32))
    tl.store(found_ptr, tl.sum(n_bad, axis=0).to(tl.int64))
    # Lanes that saw no bad index hold 0, a valid class, so take the value of a lane that did.
    lowest = -9223372036854775807
    tl.store(found_ptr + 1, tl.max(tl.where(n_bad > 0, bad_value, lowest), axis=0))


@dataclass
class _PendingScan:
    done: torch.cuda.Event
    found: torch.Tensor  # pinned host copy of the scan's (count, index)
    n_classes: int
    ignore_index: int
    caller: str


_pending: list[_PendingScan] = []
_lock = threading.Lock()


def _error(found: torch.Tensor, n_classes: int, ignore_index: int, caller: str, deferred: bool) -> ValueError | None:
    n_bad, index = int(found[0]), int(found[1])
    if n_bad == 0:
        return None
    where = f"an earlier {caller} call, whose loss is NaN at those tokens" if deferred else f"this {caller} call"
    return ValueError(
        f"target holds class index {index}, outside [0, {n_classes}) and not ignore_index={ignore_index} "
        f"({n_bad} such target{'s' if n_bad > 1 else ''} in {where})"
    )


def raise_pending_target_errors(wait: bool = False) -> None:
    """Raise the ValueError of an earlier loss call whose scan found a bad class index.

    Only scans the GPU has finished are examined, unless `wait` (then this waits for all).
    """
    global _pending
    if not _pending or torch.cuda.is_current_stream_capturing():  # no event queries inside a capture
        return
    with _lock:
        # Scans finish in launch order on one stream, so the first unfinished one ends the
        # search: a GPU running far behind costs one event query per call, not one per scan.
        # (A finished scan queued behind another stream's unfinished one is reported later, never lost.)
        n_ready = len(_pending)
        if not wait:
            n_ready = next((i for i, p in enumerate(_pending) if not p.done.query()), n_ready)
        ready, _pending = _pending[:n_ready], _pending[n_ready:]
    for p in ready:
        if wait:
            p.done.synchronize()
        err = _error(p.found, p.n_classes, p.ignore_index, p.caller, deferred=True)
        if err is not None:
            raise err


def scan_targets(target: torch.Tensor, n_classes: int, ignore_index: int, caller: str) -> torch.Tensor:
    """1 / (number of non-ignored targets, at least 1) as 1 fp32 element on target's device.

    Every loss call comes through here, so it first raises what earlier calls left pending; bad
    class indices of this call raise ValueError as TARGET_CHECK says (see the module docstring).
    """
    if TARGET_CHECK not in TARGET_CHECK_MODES:
        raise ValueError(f"fuseforge.ops.targets.TARGET_CHECK must be one of {TARGET_CHECK_MODES}, got {TARGET_CHECK!r}")
    raise_pending_target_errors()
    flat = target.reshape(-1)
    inv_count = torch.empty(1, dtype=torch.float32, device=target.device)
    found = torch.empty(2, dtype=torch.int64, device=target.device)
    _scan_targets_kernel[(1,)](flat, flat.numel(), n_classes, ignore_index, inv_count, found, BLOCK=_BLOCK, num_warps=8)
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return inv_count  # nothing can be read back inside a capture
    if not target.is_cuda or TARGET_CHECK == "sync":
        err = _error(found.cpu(), n_classes, ignore_index, caller, deferred=False)
        if err is not None:
            raise err
        return inv_count
    host = torch.empty(2, dtype=torch.int64, device="cpu", pin_memory=True)
    host.copy_(found, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    with _lock:
        _pending.append(_PendingScan(done, host, n_classes, ignore_index, caller))
    return inv_count
