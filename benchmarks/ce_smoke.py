"""Quick GPU check of cross_entropy's one-launch (resident) kernel before longer runs: loss and
gradient against fp32 eager at LLM shapes, every slice count the defaults give, each under 1 s.

    python benchmarks/ce_smoke.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from fuseforge.ops import cross_entropy as ce


def check(n: int, v: int, dtype=torch.bfloat16, **options) -> float:
    logits = (torch.randn(n, v, device="cuda") * 4).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    target[torch.rand(n, device="cuda") < 0.1] = -100
    t0 = time.perf_counter()
    loss = ce.cross_entropy(logits, target, **options)
    loss.backward()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    ref_x = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_x, target, ignore_index=-100, label_smoothing=options.get("label_smoothing", 0.0))
    ref.backward()
    loss_err = abs(float(loss.detach()) - float(ref.detach()))
    grad_err = float((logits.grad.float() - ref_x.grad).abs().max() / ref_x.grad.abs().max())
    tiling = ce.resident_tiling(n, v, logits.device)
    print(f"{n}x{v} {dtype} {options} splits={tiling and tiling.n_splits} groups={tiling and tiling.n_groups}: "
          f"loss err {loss_err:.2e}, grad rel err {grad_err:.2e}, first call {elapsed:.2f} s", flush=True)
    assert loss_err < 0.05 and grad_err < 2e-2, "mismatch"
    return grad_err


def main() -> int:
    for n, v in [(8192, 128256), (256, 128256), (8192, 32000), (4096, 256000), (1000, 151936), (7, 50001), (3, 100)]:
        check(n, v)
    check(999, 50001, torch.float32, label_smoothing=0.1)
    print("smoke ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
