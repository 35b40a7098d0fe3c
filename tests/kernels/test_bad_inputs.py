"""Bad input sweep (issue 7): every public entry point rejects bad values with an error that names the problem.

Each table row is (id, call, exception type, regex): `call(ctx)` must raise that type (or warn, for a
Warning type) with a message matching the regex, and the regex names the argument, key or problem.
Empty batches are not bad input: `test_empty_batches_return_cleanly` checks that they do not raise.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fuseforge.functional as F
from fuseforge import modules as M
from fuseforge_flyte.config import ConfigError, load_config
from fuseforge_flyte.training.spec import TrainSpec

FP32, FP16, LONG = torch.float32, torch.float16, torch.long


@dataclass
class Ctx:
    """What a row's call may use: the test device, a temp dir and monkeypatch."""

    device: str
    tmp_path: Path
    monkeypatch: pytest.MonkeyPatch

    def randn(self, *shape, dtype=FP32, device=None):
        return torch.randn(shape, dtype=dtype, device=device or self.device)

    def logp(self, *shape):
        return self.randn(*shape).log_softmax(-1)

    def ints(self, high, *shape):
        return torch.randint(0, high, shape, device=self.device)

    def full(self, value, *shape, dtype=LONG):
        return torch.full(shape, value, dtype=dtype, device=self.device)

    def write(self, text: str, name: str = "platform.toml") -> Path:
        path = self.tmp_path / name
        path.write_text(textwrap.dedent(text))
        return path


@pytest.fixture
def ctx(device, tmp_path, monkeypatch) -> Ctx:
    return Ctx(device, tmp_path, monkeypatch)


def case(case_id, call, exc, match):
    return pytest.param(call, exc, match, id=case_id)


def check(call, exc, match, ctx):
    from fuseforge.ops import targets

    ctx.monkeypatch.setattr(targets, "TARGET_CHECK", "sync")  # on a GPU, raise in the call (see ops/targets.py)
    expect = pytest.warns if issubclass(exc, Warning) else pytest.raises
    with expect(exc, match=match):
        call(ctx)


NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------- fuseforge.functional
def _rms(c, x=None, w=None, **kw):
    return F.rms_norm(c.randn(3, 8) if x is None else x, c.randn(8) if w is None else w, **kw)


def _add_rms(c, residual=None, **kw):
    return F.fused_add_rms_norm(c.randn(3, 8), c.randn(3, 8) if residual is None else residual, c.randn(8), **kw)


def _ln(c, x=None, w="default", b="default", **kw):
    x = c.randn(3, 8) if x is None else x
    return F.layer_norm(x, c.randn(8) if w == "default" else w, c.randn(8) if b == "default" else b, **kw)


def _rope(c, q=None, k=None, cos=None, sin=None, **kw):
    q = c.randn(1, 4, 3, 8) if q is None else q
    k = c.randn(1, 2, 3, 8) if k is None else k
    cos = c.randn(1, 3, 8) if cos is None else cos
    sin = c.randn(*cos.shape, dtype=cos.dtype, device=cos.device) if sin is None else sin
    return F.rope(q, k, cos, sin, **kw)


def _ce(c, logits=None, target=None, **kw):
    logits = c.randn(3, 10) if logits is None else logits
    return F.cross_entropy(logits, c.ints(10, 3) if target is None else target, **kw)


def _flce(c, hidden=None, weight=None, target=None, **kw):
    hidden = c.randn(3, 6) if hidden is None else hidden
    weight = c.randn(10, 6) if weight is None else weight
    return F.fused_linear_cross_entropy(hidden, weight, c.ints(10, 3) if target is None else target, **kw)


def _jsd(c, s=None, t=None, **kw):
    return F.jsd(c.logp(4, 10) if s is None else s, c.logp(4, 10) if t is None else t, **kw)


def _fljsd(c, hs=None, ws=None, ht=None, wt=None, **kw):
    return F.fused_linear_jsd(
        c.randn(4, 6) if hs is None else hs, c.randn(10, 6) if ws is None else ws,
        c.randn(4, 5) if ht is None else ht, c.randn(10, 5) if wt is None else wt, **kw,
    )


def _kl(c, x=None, y=None, **kw):
    return F.kl_div(c.logp(4, 10) if x is None else x, c.logp(4, 10).exp() if y is None else y, **kw)


def _cpu_without_interpreter(c):
    c.monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    F.rms_norm(torch.randn(3, 8), torch.randn(8))


_NAN_TARGET = "probability \\(soft\\) targets are not supported"

FUNCTIONAL_CASES = [
    # rms_norm
    case("rms_norm-x-not-tensor", lambda c: F.rms_norm([1.0, 2.0], c.randn(2)), TypeError, "x must be a torch.Tensor, got list"),
    case("rms_norm-x-0d", lambda c: _rms(c, x=c.randn()), ValueError, r"x must have at least 1 dimensions, got shape \(\)"),
    case("rms_norm-x-int", lambda c: _rms(c, x=c.ints(5, 3, 8)), TypeError, "x must have dtype in .*got int64"),
    case("rms_norm-weight-2d", lambda c: _rms(c, w=c.randn(1, 8)), ValueError, "weight must have 1 dimensions"),
    case("rms_norm-weight-size", lambda c: _rms(c, w=c.randn(7)), ValueError, r"weight must have shape \(8,\) to match x's last dimension, got \(7,\)"),
    case("rms_norm-weight-int", lambda c: _rms(c, w=c.ints(3, 8)), TypeError, "weight must have dtype in"),
    case("rms_norm-weight-other-device", lambda c: _rms(c, w=torch.ones(8, device="meta")), ValueError, "weight is on meta but x is on"),
    case("rms_norm-eps-zero", lambda c: _rms(c, eps=0.0), ValueError, "eps must be a finite number > 0, got 0"),
    case("rms_norm-eps-negative", lambda c: _rms(c, eps=-1e-6), ValueError, "eps must be a finite number > 0"),
    case("rms_norm-eps-nan", lambda c: _rms(c, eps=NAN), ValueError, "eps must be a finite number > 0, got nan"),
    case("rms_norm-eps-inf", lambda c: _rms(c, eps=INF), ValueError, "eps must be a finite number > 0, got inf"),
    case("rms_norm-eps-str", lambda c: _rms(c, eps="small"), TypeError, "eps must be a number, got str"),
    case("rms_norm-offset-nan", lambda c: _rms(c, offset=NAN), ValueError, "offset must be finite"),
    case("rms_norm-offset-str", lambda c: _rms(c, offset="one"), TypeError, "offset must be a number, got str"),
    case("rms_norm-casting-unknown", lambda c: _rms(c, casting="mistral"), ValueError, "casting must be one of .*got 'mistral'"),
    case("rms_norm-cpu-without-interpreter", _cpu_without_interpreter, ValueError, "x is on cpu; fuseforge kernels run on CUDA devices .*TRITON_INTERPRET=1"),
    # fused_add_rms_norm
    case("fused_add_rms_norm-residual-shape", lambda c: _add_rms(c, residual=c.randn(3, 4, 8)), ValueError, r"residual must have x's shape \(3, 8\)"),
    case("fused_add_rms_norm-residual-dtype", lambda c: _add_rms(c, residual=c.randn(3, 8, dtype=FP16)), TypeError, "residual has dtype torch.float16 but x has dtype torch.float32"),
    case("fused_add_rms_norm-residual-not-tensor", lambda c: _add_rms(c, residual=3.0), TypeError, "residual must be a torch.Tensor"),
    case("fused_add_rms_norm-residual-none", lambda c: F.fused_add_rms_norm(c.randn(3, 8), None, c.randn(8)), TypeError, "residual must be a torch.Tensor, got NoneType; without a residual use rms_norm"),
    case("fused_add_rms_norm-eps-nan", lambda c: _add_rms(c, eps=NAN), ValueError, "eps must be a finite number > 0"),
    case("fused_add_rms_norm-casting", lambda c: _add_rms(c, casting="fp8"), ValueError, "casting must be one of"),
    # layer_norm
    case("layer_norm-x-0d", lambda c: _ln(c, x=c.randn()), ValueError, "x must have at least 1 dimensions"),
    case("layer_norm-x-int", lambda c: _ln(c, x=c.ints(4, 3, 8)), TypeError, "x must have dtype in"),
    case("layer_norm-weight-size", lambda c: _ln(c, w=c.randn(9)), ValueError, r"weight must have shape \(8,\) to match x's last dimension, got \(9,\)"),
    case("layer_norm-bias-size", lambda c: _ln(c, b=c.randn(7)), ValueError, r"bias must have shape \(8,\)"),
    case("layer_norm-bias-2d", lambda c: _ln(c, b=c.randn(2, 8)), ValueError, "bias must have 1 dimensions"),
    case("layer_norm-bias-other-device", lambda c: _ln(c, b=torch.ones(8, device="meta")), ValueError, "bias is on meta but x is on"),
    case("layer_norm-eps-negative", lambda c: _ln(c, eps=-1.0), ValueError, "eps must be a finite number > 0"),
    case("layer_norm-eps-nan", lambda c: _ln(c, eps=NAN), ValueError, "eps must be a finite number > 0, got nan"),
    # rope
    case("rope-q-3d", lambda c: _rope(c, q=c.randn(4, 3, 8)), ValueError, r"q must have 4 dimensions, got shape \(4, 3, 8\)"),
    case("rope-k-int", lambda c: _rope(c, k=c.ints(3, 1, 2, 3, 8)), TypeError, "k must have dtype in"),
    case("rope-q-k-dtype", lambda c: _rope(c, k=c.randn(1, 2, 3, 8, dtype=FP16)), TypeError, "k has dtype torch.float16 but q has dtype torch.float32"),
    case("rope-cos-2d", lambda c: _rope(c, cos=c.randn(3, 8)), ValueError, "cos must have 3 dimensions"),
    case("rope-cos-int", lambda c: _rope(c, cos=c.ints(2, 1, 3, 8), sin=c.randn(1, 3, 8)), TypeError, "cos must have dtype in"),
    case("rope-sin-shape", lambda c: _rope(c, sin=c.randn(1, 3, 6)), ValueError, r"cos \(1, 3, 8\) and sin \(1, 3, 6\) must have the same shape"),
    case("rope-unsqueeze_dim-0", lambda c: _rope(c, unsqueeze_dim=0), ValueError, "unsqueeze_dim must be 1 .* or 2 .*got 0"),
    case("rope-unsqueeze_dim-float", lambda c: _rope(c, unsqueeze_dim=1.0), TypeError, "unsqueeze_dim must be an int, got float"),
    case("rope-seq-mismatch", lambda c: _rope(c, k=c.randn(1, 2, 5, 8)), ValueError, "q .* and k .* must agree in batch, seq and head_dim"),
    case("rope-heads-not-divisible", lambda c: _rope(c, q=c.randn(1, 3, 3, 8)), ValueError, "k's 2 heads must divide q's 3 heads"),
    case("rope-cos-seq", lambda c: _rope(c, cos=c.randn(1, 4, 8)), ValueError, r"cos/sin must have shape \[1 or batch=1, seq=3, rotary_dim\]"),
    case("rope-cos-batch", lambda c: _rope(c, q=c.randn(2, 4, 3, 8), k=c.randn(2, 2, 3, 8), cos=c.randn(3, 3, 8)), ValueError, "cos/sin must have shape .*batch=2"),
    case("rope-rotary-odd", lambda c: _rope(c, cos=c.randn(1, 3, 7)), ValueError, r"rotary_dim=7\) must be even"),
    case("rope-rotary-too-wide", lambda c: _rope(c, cos=c.randn(1, 3, 10)), ValueError, "rotary_dim=10.* <= q/k's head_dim=8"),
    case("rope-layout-unknown", lambda c: _rope(c, layout="gptj"), ValueError,
         r"layout must be one of \('rotate_half', 'interleaved', 'interleaved_to_half'\), got 'gptj'"),
    case("rope-interleaved-rotary-odd", lambda c: _rope(c, cos=c.randn(1, 3, 5), layout="interleaved"), ValueError, r"rotary_dim=5\) must be even"),
    case("rope-interleaved-q-k-dtype", lambda c: _rope(c, k=c.randn(1, 2, 3, 8, dtype=FP16), layout="interleaved"), TypeError, "k has dtype torch.float16 but q has dtype torch.float32"),
    # swiglu / geglu
    case("swiglu-shape", lambda c: F.swiglu(c.randn(3, 8), c.randn(3, 9)), ValueError, r"gate \(3, 8\) and up \(3, 9\) must have the same shape"),
    case("swiglu-dtype", lambda c: F.swiglu(c.randn(3, 8), c.randn(3, 8, dtype=FP16)), TypeError, "up has dtype torch.float16 but gate has dtype torch.float32"),
    case("swiglu-int", lambda c: F.swiglu(c.ints(3, 3, 8), c.ints(3, 3, 8)), TypeError, "gate must have dtype in"),
    case("swiglu-0d", lambda c: F.swiglu(c.randn(), c.randn()), ValueError, "gate must have at least 1 dimensions"),
    case("swiglu-up-not-tensor", lambda c: F.swiglu(c.randn(3, 8), None), TypeError, "up must be a torch.Tensor, got NoneType"),
    case("swiglu-other-device", lambda c: F.swiglu(c.randn(3, 8), torch.ones(3, 8, device="meta")), ValueError, "up is on meta but gate is on"),
    case("geglu-approximate", lambda c: F.geglu(c.randn(3, 8), c.randn(3, 8), approximate="erf"), ValueError, "approximate must be one of .*got 'erf'"),
    case("geglu-shape", lambda c: F.geglu(c.randn(3, 8), c.randn(2, 8)), ValueError, "gate .* and up .* must have the same shape"),
    # clamped_swiglu (GPT-OSS experts)
    case("clamped_swiglu-odd", lambda c: F.clamped_swiglu(c.randn(3, 7), 1.702, 7.0), ValueError, r"gate_up's last dim must be even .*\(3, 7\)"),
    case("clamped_swiglu-int", lambda c: F.clamped_swiglu(c.ints(3, 3, 8), 1.702, 7.0), TypeError, "gate_up must have dtype in"),
    case("clamped_swiglu-not-tensor", lambda c: F.clamped_swiglu(None, 1.702, 7.0), TypeError, "gate_up must be a torch.Tensor, got NoneType"),
    case("clamped_swiglu-layout", lambda c: F.clamped_swiglu(c.randn(3, 8), 1.702, 7.0, layout="halves"), ValueError, "layout must be one of .*got 'halves'"),
    case("clamped_swiglu-limit-negative", lambda c: F.clamped_swiglu(c.randn(3, 8), 1.702, -1.0), ValueError, r"limit must be >= 0 \(math.inf: no clamp\), got -1.0"),
    case("clamped_swiglu-alpha-nan", lambda c: F.clamped_swiglu(c.randn(3, 8), NAN, 7.0), ValueError, "alpha must be finite, got nan"),
    case("clamped_swiglu-alpha-tensor", lambda c: F.clamped_swiglu(c.randn(3, 8), torch.tensor(1.7), 7.0), TypeError, "alpha must be a float, got Tensor"),
    # cross_entropy
    case("cross_entropy-target-float", lambda c: _ce(c, target=c.randn(3)), TypeError, "target must hold integer class indices .*got dtype torch.float32"),
    case("cross_entropy-target-nan", lambda c: _ce(c, target=torch.tensor([0.0, NAN, 1.0], device=c.device)), TypeError, _NAN_TARGET),
    case("cross_entropy-target-bool", lambda c: _ce(c, target=c.full(True, 3, dtype=torch.bool)), TypeError, "target must hold integer class indices .*torch.bool"),
    case("cross_entropy-target-list", lambda c: _ce(c, target=[0, 1, 2]), TypeError, "target must be a torch.Tensor, got list"),
    case("cross_entropy-target-shape", lambda c: _ce(c, target=c.ints(10, 4)), ValueError, r"target must have shape \(3,\) \(logits.shape\[:-1\]\), got \(4,\)"),
    case("cross_entropy-target-too-big", lambda c: _ce(c, target=c.full(10, 3)), ValueError, r"target holds class index 10, outside \[0, 10\) and not ignore_index=-100"),
    case("cross_entropy-target-negative", lambda c: _ce(c, target=c.full(-1, 3)), ValueError, r"class index -1, outside \[0, 10\)"),
    case("cross_entropy-target-other-device", lambda c: _ce(c, target=torch.zeros(3, dtype=LONG, device="meta")), ValueError, "target is on meta but logits is on"),
    case("cross_entropy-logits-fp64", lambda c: _ce(c, logits=c.randn(3, 10, dtype=torch.float64)), TypeError, "logits must have dtype in .*got float64"),
    case("cross_entropy-logits-0d", lambda c: _ce(c, logits=c.randn(), target=c.full(0)), ValueError, "logits must have at least 1 dimensions"),
    case("cross_entropy-no-classes", lambda c: _ce(c, logits=c.randn(3, 0)), ValueError, "logits must have at least one class"),
    case("cross_entropy-reduction", lambda c: _ce(c, reduction="avg"), ValueError, "reduction must be one of .*got 'avg'"),
    case("cross_entropy-ignore_index-float", lambda c: _ce(c, ignore_index=-100.0), TypeError, "ignore_index must be an int, got float"),
    case("cross_entropy-ignore_index-above-int64", lambda c: _ce(c, ignore_index=2**70), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 1180591620717411303424"),
    case("cross_entropy-ignore_index-below-int64", lambda c: _ce(c, ignore_index=-(2**63) - 1), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got -9223372036854775809"),
    case("cross_entropy-label_smoothing-range", lambda c: _ce(c, label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\], got 1.5"),
    case("cross_entropy-label_smoothing-nan", lambda c: _ce(c, label_smoothing=NAN), ValueError, "label_smoothing must be in"),
    case("cross_entropy-z_loss_scale-negative", lambda c: _ce(c, z_loss_scale=-1e-4), ValueError, "z_loss_scale must be a finite number >= 0"),
    case("cross_entropy-z_loss_scale-inf", lambda c: _ce(c, z_loss_scale=INF), ValueError, "z_loss_scale must be a finite number >= 0, got inf"),
    case("cross_entropy-softcap-zero", lambda c: _ce(c, softcap=0.0), ValueError, "softcap must be a finite number > 0"),
    case("cross_entropy-softcap-nan", lambda c: _ce(c, softcap=NAN), ValueError, "softcap must be a finite number > 0, got nan"),
    # fused_linear_cross_entropy
    case("flce-weight-1d", lambda c: _flce(c, weight=c.randn(60)), ValueError, "weight must have 2 dimensions"),
    case("flce-hidden-size", lambda c: _flce(c, hidden=c.randn(3, 5)), ValueError, "hidden has 5 features .* but weight expects 6"),
    case("flce-bias-vocab", lambda c: _flce(c, bias=c.randn(9)), ValueError, "bias has 9 entries but weight has 10 rows: vocabulary sizes differ"),
    case("flce-target-vocab", lambda c: _flce(c, target=c.full(10, 3)), ValueError, r"target holds class index 10, outside \[0, 10\)"),
    case("flce-empty-vocab", lambda c: _flce(c, weight=c.randn(0, 6)), ValueError, "weight must have at least one row"),
    case("flce-dtype", lambda c: _flce(c, weight=c.randn(10, 6, dtype=FP16)), TypeError, "weight has dtype torch.float16 but hidden has dtype torch.float32; cast them to one dtype"),
    case("flce-target-nan", lambda c: _flce(c, target=torch.tensor([1.0, NAN, 2.0], device=c.device)), TypeError, _NAN_TARGET),
    case("flce-target-shape", lambda c: _flce(c, target=c.ints(10, 3, 1)), ValueError, r"target must have shape \(3,\) \(hidden.shape\[:-1\]\)"),
    case("flce-chunk_size-zero", lambda c: _flce(c, chunk_size=0), ValueError, "chunk_size must be a positive int or None, got 0"),
    case("flce-chunk_size-float", lambda c: _flce(c, chunk_size=2.5), TypeError, r"chunk_size must be a positive int or None, got 2\.5 \(float\)"),
    case("flce-num_items-zero", lambda c: _flce(c, num_items_in_batch=0), ValueError, "num_items_in_batch must be > 0, got 0"),
    case("flce-num_items-nan", lambda c: _flce(c, num_items_in_batch=NAN), ValueError, "num_items_in_batch must be > 0"),
    case("flce-num_items-inf", lambda c: _flce(c, num_items_in_batch=INF), ValueError, "num_items_in_batch must be"),
    case("flce-num_items-tensor-shape", lambda c: _flce(c, num_items_in_batch=c.full(3, 2)), ValueError, "num_items_in_batch must be a 1-element numeric tensor"),
    case("flce-num_items-with-sum", lambda c: _flce(c, reduction="sum", num_items_in_batch=3), ValueError, "num_items_in_batch only applies to reduction='mean'"),
    case("flce-reduction", lambda c: _flce(c, reduction="batchmean"), ValueError, "reduction must be one of"),
    case("flce-ignore_index-above-int64", lambda c: _flce(c, ignore_index=2**63), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 9223372036854775808"),
    # jsd
    case("jsd-1d", lambda c: _jsd(c, s=c.logp(10), t=c.logp(10)), ValueError, "student_logp must have at least 2 dimensions"),
    case("jsd-shape", lambda c: _jsd(c, t=c.logp(4, 11)), ValueError, "student_logp and teacher_logp must have the same shape"),
    case("jsd-empty-vocab", lambda c: _jsd(c, s=c.randn(4, 0), t=c.randn(4, 0)), ValueError, "student_logp has an empty vocabulary dimension"),
    case("jsd-teacher-int", lambda c: _jsd(c, t=c.ints(3, 4, 10)), TypeError, "teacher_logp must have dtype in"),
    case("jsd-target-float-nan", lambda c: _jsd(c, target=torch.tensor([0.0, NAN, 1.0, 2.0], device=c.device)), TypeError, r"target must have dtype in \(int64, int32\), got float32"),
    case("jsd-target-shape", lambda c: _jsd(c, target=c.ints(10, 5)), ValueError, r"target must have shape \(4,\) \(the leading dimensions of student_logp\)"),
    case("jsd-beta-range", lambda c: _jsd(c, beta=1.5), ValueError, r"beta must be in \[0, 1\], got 1.5"),
    case("jsd-beta-nan", lambda c: _jsd(c, beta=NAN), ValueError, r"beta must be in \[0, 1\], got nan"),
    case("jsd-beta-str", lambda c: _jsd(c, beta="half"), TypeError, "beta must be a number"),
    case("jsd-reduction", lambda c: _jsd(c, reduction="avg"), ValueError, "reduction must be one of .*got 'avg'"),
    case("jsd-ignore_index-str", lambda c: _jsd(c, target=c.ints(10, 4), ignore_index="pad"), TypeError, "ignore_index must be an int"),
    case("jsd-ignore_index-float", lambda c: _jsd(c, target=c.ints(10, 4), ignore_index=1.5), TypeError, "ignore_index must be an int"),
    case("jsd-ignore_index-above-int64", lambda c: _jsd(c, target=c.ints(10, 4), ignore_index=2**70), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 1180591620717411303424"),
    case("jsd-ignore_index-above-int64-no-target", lambda c: _jsd(c, ignore_index=2**64), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 18446744073709551616"),
    # fused_linear_jsd
    case("fljsd-vocab", lambda c: _fljsd(c, wt=c.randn(9, 5)), ValueError, "vocabulary size mismatch: student_weight has V=10 but teacher_weight has V=9"),
    case("fljsd-student-hidden-size", lambda c: _fljsd(c, ws=c.randn(10, 7)), ValueError, r"student_weight must have shape \[V, 6\]"),
    case("fljsd-teacher-hidden-size", lambda c: _fljsd(c, wt=c.randn(10, 4)), ValueError, r"teacher_weight must have shape \[V, 5\]"),
    case("fljsd-tokens", lambda c: _fljsd(c, ht=c.randn(3, 5)), ValueError, "teacher_hidden has leading shape .* they must cover the same tokens"),
    case("fljsd-student-dtype", lambda c: _fljsd(c, ws=c.randn(10, 6, dtype=FP16)), TypeError, "student_weight has dtype torch.float16 but student_hidden"),
    case("fljsd-hidden-1d", lambda c: _fljsd(c, hs=c.randn(6)), ValueError, "student_hidden must have at least 2 dimensions"),
    case("fljsd-empty-vocab", lambda c: _fljsd(c, ws=c.randn(0, 6), wt=c.randn(0, 5)), ValueError, "student_weight has an empty vocabulary"),
    case("fljsd-target-nan", lambda c: _fljsd(c, target=c.randn(4).fill_(NAN)), TypeError, r"target must have dtype in \(int64, int32\)"),
    case("fljsd-temperature-zero", lambda c: _fljsd(c, temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    case("fljsd-temperature-nan", lambda c: _fljsd(c, temperature=NAN), ValueError, "temperature must be a finite number > 0, got nan"),
    case("fljsd-beta", lambda c: _fljsd(c, beta=-0.1), ValueError, r"beta must be in \[0, 1\]"),
    case("fljsd-chunk_size", lambda c: _fljsd(c, chunk_size=0), ValueError, "chunk_size must be a positive int or None, got 0"),
    case("fljsd-chunk_size-float", lambda c: _fljsd(c, chunk_size=2.5), TypeError, r"chunk_size must be a positive int or None, got 2\.5 \(float\)"),
    case("fljsd-ignore_index-str", lambda c: _fljsd(c, target=c.ints(10, 4), ignore_index="pad"), TypeError, "ignore_index must be an int"),
    case("fljsd-ignore_index-below-int64", lambda c: _fljsd(c, target=c.ints(10, 4), ignore_index=-(2**64)), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got -18446744073709551616"),
    # kl_div
    case("kl_div-input-not-tensor", lambda c: F.kl_div([0.1], c.randn(1)), TypeError, "input must be a torch.Tensor"),
    case("kl_div-target-int", lambda c: _kl(c, y=c.ints(2, 4, 10)), TypeError, "target must have dtype in .*got int64"),
    case("kl_div-shapes", lambda c: _kl(c, y=c.randn(4, 9).softmax(-1)), ValueError, r"input of shape \(4, 10\) and target of shape \(4, 9\) do not broadcast"),
    case("kl_div-reduction", lambda c: _kl(c, reduction="elementwise_mean"), ValueError, "reduction must be one of .*'elementwise_mean'"),
    case("kl_div-log_target", lambda c: _kl(c, log_target="yes"), TypeError, "log_target must be a bool, got str"),
    case("kl_div-other-device", lambda c: _kl(c, y=torch.ones(4, 10, device="meta")), ValueError, "target is on meta but input is on"),
]


# ----------------------------------------------------------------------------- preference and RL losses (issue 19)
def _pref(fn, c, hidden=None, weight=None, target=None, **kw):
    hidden = c.randn(4, 5, 6) if hidden is None else hidden
    weight = c.randn(10, 6) if weight is None else weight
    return fn(hidden, weight, c.ints(10, 4, 5) if target is None else target, **kw)


PREFERENCE_CASES = [
    case("fused_linear_dpo_loss-odd-batch", lambda c: _pref(F.fused_linear_dpo_loss, c, hidden=c.randn(3, 5, 6), target=c.ints(10, 3, 5), ref_logps=c.randn(3)), ValueError, "so its batch must be even; got 3"),
    case("fused_linear_dpo_loss-no-reference", lambda c: _pref(F.fused_linear_dpo_loss, c), ValueError, "DPO needs a reference model"),
    case("fused_linear_dpo_loss-two-references", lambda c: _pref(F.fused_linear_dpo_loss, c, ref_logps=c.randn(4), ref_hidden=c.randn(4, 5, 6), ref_weight=c.randn(10, 6)), ValueError, "not both"),
    case("fused_linear_dpo_loss-ref_logps-shape", lambda c: _pref(F.fused_linear_dpo_loss, c, ref_logps=c.randn(2)), ValueError, r"ref_logps must have shape \(4,\)"),
    case("fused_linear_dpo_loss-beta-zero", lambda c: _pref(F.fused_linear_dpo_loss, c, ref_logps=c.randn(4), beta=0.0), ValueError, "beta must be a finite number > 0, got 0.0"),
    case("fused_linear_dpo_loss-loss_type", lambda c: _pref(F.fused_linear_dpo_loss, c, ref_logps=c.randn(4), loss_type="nca_pair"), ValueError, "unknown loss_type 'nca_pair'"),
    case("fused_linear_dpo_loss-weight-dtype", lambda c: _pref(F.fused_linear_dpo_loss, c, weight=c.randn(10, 6, dtype=FP16), ref_logps=c.randn(4)), ValueError, "weight has dtype torch.float16 but hidden has dtype torch.float32"),
    case("fused_linear_cpo_loss-nll_target-shape", lambda c: _pref(F.fused_linear_cpo_loss, c, nll_target=c.ints(10, 2, 5)), ValueError, r"nll_target must have target's shape \(4, 5\)"),
    case("fused_linear_simpo_loss-gamma", lambda c: _pref(F.fused_linear_simpo_loss, c, gamma=-1.0), ValueError, "simpo_gamma must be a finite number >= 0"),
    case("fused_linear_orpo_loss-beta-nan", lambda c: _pref(F.fused_linear_orpo_loss, c, beta=NAN), ValueError, "beta must be a finite number > 0, got nan"),
    case("fused_linear_kto_loss-desirable", lambda c: _pref(F.fused_linear_kto_loss, c, desirable=c.ints(2, 4), ref_logps=c.randn(4), kl=0.0), ValueError, r"desirable must be a bool tensor of shape \(4,\)"),
    case("fused_linear_kto_loss-no-kl", lambda c: _pref(F.fused_linear_kto_loss, c, desirable=c.ints(2, 4) > 0, ref_logps=c.randn(4)), ValueError, "KTO needs the KL estimate"),
    case("fused_linear_kto_kl-no-reference", lambda c: _pref(F.fused_linear_kto_kl, c), ValueError, "KTO's KL estimate needs a reference model"),
    case("fused_linear_grpo_loss-advantages-shape", lambda c: _pref(F.fused_linear_grpo_loss, c, advantages=c.randn(3)), ValueError, r"advantages must have shape \(4,\) or \(4, 5\)"),
    case("fused_linear_grpo_loss-beta-needs-reference", lambda c: _pref(F.fused_linear_grpo_loss, c, advantages=c.randn(4), beta=0.04), ValueError, "GRPO with beta=0.04 needs a reference model"),
    case("fused_linear_grpo_loss-loss_type", lambda c: _pref(F.fused_linear_grpo_loss, c, advantages=c.randn(4), loss_type="ppo"), ValueError, "unknown loss_type 'ppo'"),
    case("fused_linear_token_logprobs-temperature", lambda c: _pref(F.fused_linear_token_logprobs, c, temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    case("fused_linear_token_logprobs-int-hidden-tempered", lambda c: _pref(F.fused_linear_token_logprobs, c, hidden=c.ints(3, 4, 5, 6), temperature=2.0), TypeError, r"hidden must have dtype in \(float32, float16, bfloat16\), got int64"),
    case("fused_linear_token_objective-token_loss", lambda c: _pref(F.fused_linear_token_objective, c, token_loss=3), TypeError, "token_loss must be callable, got int"),
]
FUNCTIONAL_CASES += PREFERENCE_CASES
FUNCTIONAL_CASES += [
    case("lora_linear-shapes", lambda c: F.lora_linear(c.randn(4, 8), c.randn(6, 8), c.randn(2, 7), c.randn(6, 2), 1.0),
         ValueError, r"do not chain \(\[out, in\], \[r, in\], \[out, r\]\)"),
    case("lora_linear-dtypes", lambda c: F.lora_linear(c.randn(4, 8), c.randn(6, 8), c.randn(2, 8, dtype=FP16),
                                                       c.randn(6, 2), 1.0), ValueError, "must share one dtype"),
    case("lora_linear-dropped", lambda c: F.lora_linear(c.randn(4, 8), c.randn(6, 8), c.randn(2, 8), c.randn(6, 2), 1.0,
                                                        dropped=c.randn(3, 8)), ValueError, "must have x's shape"),
    case("dequantize_nf4-plain-tensor", lambda c: F.dequantize_nf4(c.randn(4, 64)), TypeError,
         "takes a torchao NF4Tensor, got Tensor"),
]


@pytest.mark.parametrize("call, exc, match", FUNCTIONAL_CASES)
def test_functional_rejects(call, exc, match, ctx):
    check(call, exc, match, ctx)


def test_every_public_function_is_in_the_table():
    covered = {p.id.split("-")[0] for p in FUNCTIONAL_CASES}
    aliases = {"flce": "fused_linear_cross_entropy", "fljsd": "fused_linear_jsd"}
    assert {aliases.get(name, name) for name in covered} == set(F.__all__)


def test_empty_batches_return_cleanly(device):
    """Zero tokens is a legal batch (e.g. a fully padded micro-batch): forward and backward must not raise."""

    def leaf(*shape):
        return torch.randn(*shape, device=device, requires_grad=True)

    x, w = leaf(0, 8), leaf(8)
    y = F.rms_norm(x, w)
    y.sum().backward()
    assert y.shape == (0, 8) and x.grad.shape == (0, 8) and torch.equal(w.grad, torch.zeros_like(w))

    x, r = leaf(2, 0, 8), leaf(2, 0, 8)
    y, s = F.fused_add_rms_norm(x, r, leaf(8))
    assert y.shape == s.shape == (2, 0, 8)

    x, w, b = leaf(0, 8), leaf(8), leaf(8)
    F.layer_norm(x, w, b).sum().backward()
    assert torch.equal(b.grad, torch.zeros_like(b))

    q, k = F.rope(leaf(1, 4, 0, 8), leaf(1, 2, 0, 8), torch.randn(1, 0, 8, device=device), torch.randn(1, 0, 8, device=device))
    assert q.shape == (1, 4, 0, 8) and k.shape == (1, 2, 0, 8)

    for glu in (F.swiglu, F.geglu):
        gate, up = leaf(0, 8), leaf(0, 8)
        glu(gate, up).sum().backward()
        assert gate.grad.shape == up.grad.shape == (0, 8)

    logits, target = leaf(0, 10), torch.zeros(0, dtype=LONG, device=device)
    loss = F.cross_entropy(logits, target)  # documented: a mean over zero tokens is 0 (torch gives NaN)
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.shape == (0, 10)
    assert F.cross_entropy(logits, target, reduction="none").shape == (0,)

    hidden, weight = leaf(0, 6), leaf(10, 6)
    loss = F.fused_linear_cross_entropy(hidden, weight, target)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(weight.grad, torch.zeros_like(weight))

    student = leaf(0, 10)
    loss = F.jsd(student, torch.randn(0, 10, device=device).log_softmax(-1))
    loss.backward()
    assert loss.item() == 0.0 and student.grad.shape == (0, 10)

    hs, ws = leaf(0, 6), leaf(10, 6)
    loss = F.fused_linear_jsd(hs, ws, torch.randn(0, 5, device=device), torch.randn(10, 5, device=device))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(ws.grad, torch.zeros_like(ws))

    x, y = leaf(0, 10), torch.rand(0, 10, device=device)
    assert F.kl_div(x, y, reduction="sum").item() == 0.0
    assert F.kl_div(x, y, reduction="none").shape == (0, 10)
    # "batchmean" divides by the batch size 0, exactly like torch (NaN): kl_div keeps torch's semantics.
    torch_batchmean = torch.nn.functional.kl_div(x.detach(), y, reduction="batchmean")
    assert F.kl_div(x, y).isnan().item() == torch_batchmean.isnan().item()


# ----------------------------------------------------------------------------- fuseforge.modules
MODULE_CASES = [
    case("RMSNorm-negative-size", lambda c: M.RMSNorm(-4), ValueError, "hidden_size must be > 0, got -4"),
    case("RMSNorm-zero-size", lambda c: M.RMSNorm(0), ValueError, "hidden_size must be > 0, got 0"),
    case("RMSNorm-float-size", lambda c: M.RMSNorm(8.5), TypeError, "hidden_size must be an int, got float"),
    case("RMSNorm-eps-zero", lambda c: M.RMSNorm(8, eps=0), ValueError, "eps must be a finite number > 0"),
    case("RMSNorm-eps-nan", lambda c: M.RMSNorm(8, eps=NAN), ValueError, "eps must be a finite number > 0, got nan"),
    case("RMSNorm-eps-setter", lambda c: setattr(M.RMSNorm(8), "eps", -1.0), ValueError, "eps must be a finite number > 0"),
    case("RMSNorm-offset-nan", lambda c: M.RMSNorm(8, offset=NAN), ValueError, "offset must be finite"),
    case("RMSNorm-offset-str", lambda c: M.RMSNorm(8, offset="one"), TypeError, "offset must be a number, got str"),
    case("RMSNorm-casting", lambda c: M.RMSNorm(8, casting="bogus"), ValueError, "casting must be one of"),
    case("RMSNorm-init", lambda c: M.RMSNorm(8, init="normal"), ValueError, "init must be one of"),
    case("FusedAddRMSNorm-negative-size", lambda c: M.FusedAddRMSNorm(-1), ValueError, "hidden_size must be > 0"),
    case("LayerNorm-wrong-input", lambda c: M.LayerNorm(8, device=c.device)(c.randn(3, 7)), ValueError, r"input's trailing dimensions must be \(8,\), got shape \(3, 7\)"),
    case("SwiGLUMLP-zero-hidden", lambda c: M.SwiGLUMLP(0, 16), ValueError, "hidden_size must be > 0, got 0"),
    case("SwiGLUMLP-negative-intermediate", lambda c: M.SwiGLUMLP(8, -16), ValueError, "intermediate_size must be > 0, got -16"),
    case("SwiGLUMLP-float-size", lambda c: M.SwiGLUMLP(8.0, 16), TypeError, "hidden_size must be an int, got float"),
    case("SwiGLUMLP-bool-size", lambda c: M.SwiGLUMLP(8, True), TypeError, "intermediate_size must be an int, got bool"),
    case("GeGLUMLP-approximate", lambda c: M.GeGLUMLP(8, 16, approximate="erf"), ValueError, "approximate must be one of"),
    case("CrossEntropyLoss-reduction", lambda c: M.CrossEntropyLoss(reduction="avg"), ValueError, "reduction must be one of"),
    case("CrossEntropyLoss-label_smoothing", lambda c: M.CrossEntropyLoss(label_smoothing=2.0), ValueError, "label_smoothing must be in"),
    case("CrossEntropyLoss-ignore_index", lambda c: M.CrossEntropyLoss(ignore_index=None), TypeError, "ignore_index must be an int, got NoneType"),
    case("CrossEntropyLoss-ignore_index-above-int64", lambda c: M.CrossEntropyLoss(ignore_index=2**70), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 1180591620717411303424"),
    case("FusedLinearCrossEntropyLoss-ignore_index-above-int64", lambda c: M.FusedLinearCrossEntropyLoss(ignore_index=2**63), ValueError, "ignore_index must be an int in the int64 range"),
    case("FusedLinearCrossEntropyLoss-chunk_size", lambda c: M.FusedLinearCrossEntropyLoss(chunk_size=0), ValueError, "chunk_size must be a positive int or None, got 0"),
    case("FusedLinearCrossEntropyLoss-softcap", lambda c: M.FusedLinearCrossEntropyLoss(softcap=-30.0), ValueError, "softcap must be a finite number > 0"),
    case("JSDLoss-beta", lambda c: M.JSDLoss(beta=2.0), ValueError, r"beta must be in \[0, 1\]"),
    case("JSDLoss-reduction", lambda c: M.JSDLoss(reduction="avg"), ValueError, "reduction must be one of"),
    case("JSDLoss-ignore_index-float", lambda c: M.JSDLoss(ignore_index=1.5), TypeError, "ignore_index must be an int, got float"),
    case("JSDLoss-ignore_index-above-int64", lambda c: M.JSDLoss(ignore_index=2**70), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 1180591620717411303424"),
    case("FusedLinearJSDLoss-temperature", lambda c: M.FusedLinearJSDLoss(temperature=0.0), ValueError, "temperature must be a finite number > 0"),
    case("FusedLinearJSDLoss-chunk_size", lambda c: M.FusedLinearJSDLoss(chunk_size=0), ValueError, "chunk_size must be a positive int or None, got 0"),
    case("FusedLinearDPOLoss-chunk_size-str", lambda c: M.FusedLinearDPOLoss(chunk_size="8"), TypeError, r"chunk_size must be a positive int or None, got '8' \(str\)"),
    case("FusedLinearJSDLoss-ignore_index-above-int64", lambda c: M.FusedLinearJSDLoss(ignore_index=2**63), ValueError, r"ignore_index must be an int in the int64 range \[-2\*\*63, 2\*\*63 - 1\], got 9223372036854775808"),
    case("KLDivLoss-reduction", lambda c: M.KLDivLoss(reduction="elementwise_mean"), ValueError, "reduction must be one of"),
    case("KLDivLoss-log_target", lambda c: M.KLDivLoss(log_target="yes"), TypeError, "log_target must be a bool, got str"),
]


@pytest.mark.parametrize("call, exc, match", MODULE_CASES)
def test_module_constructors_reject(call, exc, match, ctx):
    check(call, exc, match, ctx)


# ----------------------------------------------------------------------------- fuseforge.transformers
VOCAB = 37


def _tiny_llama(c):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config).to(c.device)


def _ff():
    pytest.importorskip("transformers")
    import fuseforge.transformers as ff

    return ff


def _labels_outside_vocab(c):
    ff, model = _ff(), _tiny_llama(c)
    ff.apply_kernels(model)
    try:
        model.train()
        model(input_ids=c.ints(VOCAB, 1, 5), labels=c.full(VOCAB, 1, 5))  # labels from a bigger tokenizer
    finally:
        ff.unpatch(model)


def _unknown_model_type(c):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    report = _ff().apply_kernels(model)
    assert report.patched_kernels() == ["layer_norm"] and not report.supported
    _ff().unpatch(model)


def _apply(c, target="llama", **flags):
    ff = _ff()
    model = _tiny_llama(c) if target == "llama" else target
    try:
        return ff.apply_kernels(model, **flags)
    finally:
        if isinstance(model, torch.nn.Module):
            ff.unpatch(model)


TRANSFORMERS_CASES = [
    case("apply_kernels-model-id-string", lambda c: _apply(c, "meta-llama/Llama-3.2-1B"), TypeError, "model_or_class must be an nn.Module or an nn.Module class, got str"),
    case("apply_kernels-non-module-class", lambda c: _apply(c, dict), TypeError, "model_or_class must be an nn.Module or an nn.Module class, got <class 'dict'>"),
    case("apply_kernels-unknown-flag", lambda c: _apply(c, flash_attention=True), TypeError, "unexpected keyword argument 'flash_attention'"),
    case("apply_kernels-flag-not-bool", lambda c: _apply(c, rms_norm="yes"), TypeError, "kernel flag rms_norm must be a bool, got str"),
    case("apply_kernels-unknown-model-type", _unknown_model_type, UserWarning,
         "(?s)model type 'gpt2', not a supported fuseforge family.*layer_norm: patched.*fused_linear_cross_entropy: NOT patched"),
    case("apply_kernels-not-a-transformer", lambda c: _apply(c, torch.nn.Sequential(torch.nn.Linear(4, 4))), UserWarning,
         "(?s)model of unknown type, not a supported fuseforge family.*rms_norm: nothing to patch"),
    case("apply_kernels_to_qwen2-on-llama", lambda c: _ff().apply_kernels_to_qwen2(_tiny_llama(c)), ValueError,
         r"apply_kernels_to_qwen2 expects a model with config.model_type in \('qwen2',\), got 'llama'"),
    case("apply_kernels_to_llama-on-plain-module", lambda c: _ff().apply_kernels_to_llama(torch.nn.Linear(2, 2)), ValueError,
         "apply_kernels_to_llama expects .*got None"),
    case("patched-model-labels-outside-vocab", _labels_outside_vocab, ValueError,
         rf"target holds class index {VOCAB}, outside \[0, {VOCAB}\)"),
    case("apply_kernels-loss-chunk-size-zero", lambda c: _apply(c, loss_chunk_size=0), ValueError,
         "loss_chunk_size must be a positive int .*got 0"),
    case("apply_kernels-loss-chunk-size-negative", lambda c: _apply(c, loss_chunk_size=-1), ValueError,
         "loss_chunk_size must be a positive int .*got -1"),
    case("apply_kernels-loss-chunk-size-float", lambda c: _apply(c, loss_chunk_size=2.5), TypeError,
         r"loss_chunk_size must be a positive int .*got 2\.5 \(float\)"),
    case("apply_kernels-loss-chunk-size-bool", lambda c: _apply(c, loss_chunk_size=True), TypeError,
         r"loss_chunk_size must be a positive int .*got True \(bool\)"),
    case("apply_kernels-loss-chunk-size-str", lambda c: _apply(c, loss_chunk_size="8"), TypeError,
         r"loss_chunk_size must be a positive int .*got '8' \(str\)"),
    case("apply_kernels-loss-chunk-size-without-fused-loss",
         lambda c: _apply(c, fused_linear_cross_entropy=False, loss_chunk_size=8), ValueError,
         "loss_chunk_size=8 sizes the chunks of the fused loss head, but fused_linear_cross_entropy=False"),
]


@pytest.mark.parametrize("call, exc, match", TRANSFORMERS_CASES)
def test_apply_kernels_rejects(call, exc, match, ctx):
    check(call, exc, match, ctx)


# ----------------------------------------------------------------------------- platform.toml loading
REQUIRED = """
[image]
registry = "ghcr.io/acme"
[flyte]
project = "ml"
domain = "production"
"""


def _load(c, body="", required=REQUIRED, **kwargs):
    kwargs.setdefault("env", {})
    return load_config(c.write(required + textwrap.dedent(body)), **kwargs)


CONFIG_CASES = [
    case("unknown-key", lambda c: _load(c, "[cluster]\ngpu = 1"), ConfigError, r'platform\.toml: unknown key \[cluster\]\.gpu .*did you mean "gpus"\?'),
    case("unknown-training-key", lambda c: _load(c, "[training]\nlearning_rate = 0.1"), ConfigError, r"unknown key \[training\]\.learning_rate"),
    case("unknown-section", lambda c: _load(c, "[clustr]\ngpus = 1"), ConfigError, r'unknown section \[clustr\] .*did you mean "cluster"\?'),
    case("wrong-type-int", lambda c: _load(c, '[cluster]\ngpus = "two"'), ConfigError, r'platform\.toml: \[cluster\]\.gpus must be an integer >= 0, got "two"'),
    case("wrong-type-bool", lambda c: _load(c, '[training]\nkernels = "yes"'), ConfigError, r"\[training\]\.kernels must be"),
    case("wrong-type-steps", lambda c: _load(c, '[training]\nsteps = "many"'), ConfigError, r'\[training\]\.steps must be an integer, got "many"'),
    case("section-not-table", lambda c: _load(c, required="cluster = 3\n" + REQUIRED), ConfigError, r"\[cluster\] must be a table, got 3"),
    case("missing-registry", lambda c: _load(c, required='[flyte]\nproject = "p"\ndomain = "d"\n'), ConfigError, r"platform\.toml: missing required key \[image\]\.registry"),
    case("missing-domain", lambda c: _load(c, required='[image]\nregistry = "ghcr.io/acme"\n[flyte]\nproject = "p"\n'), ConfigError, r"missing required key \[flyte\]\.domain"),
    case("negative-steps", lambda c: _load(c, "[training]\nsteps = -1"), ConfigError, r"platform\.toml: \[training\]\.steps must be >= 1, got -1"),
    case("zero-batch", lambda c: _load(c, "[training]\nbatch_size = 0"), ConfigError, r"\[training\]\.batch_size must be >= 1, got 0"),
    case("unknown-strategy", lambda c: _load(c, '[training]\nstrategy = "horovod"'), ConfigError, r"\[training\]\.strategy: 'horovod' is not one of"),
    case("unknown-model", lambda c: _load(c, '[training]\nmodel = "gpt-9"'), ConfigError, r"\[training\]\.model: unknown model 'gpt-9'"),
    case("missing-dataset", lambda c: _load(c, '[training]\ndataset = "/no/such/corpus.txt"'), ConfigError, r"\[training\]\.dataset: dataset file or folder not found: '/no/such/corpus.txt'"),
    case("bad-dtype", lambda c: _load(c, '[training]\ndtype = "fp64"'), ConfigError, r"\[training\]\.dtype: 'fp64' is not one of"),
    case("negative-loss_chunk_size", lambda c: _load(c, "[training]\nloss_chunk_size = -1"), ConfigError, r"platform\.toml: \[training\]\.loss_chunk_size must be a finite value >= 0, got -1"),
    case("env-override-loss_chunk_size-str", lambda c: _load(c, env={"FUSEFORGE__TRAINING__LOSS_CHUNK_SIZE": "big"}), ConfigError, r'environment variable FUSEFORGE__TRAINING__LOSS_CHUNK_SIZE: \[training\]\.loss_chunk_size must be an integer, got "big"'),
    case("checkpoint-every-without-dir", lambda c: _load(c, '[checkpoint]\nevery = 5\ndir = "off"'), ConfigError, r"\[checkpoint\]\.every > 0 needs checkpoints, but \[checkpoint\]\.dir is 'off'"),
    case("nproc-over-gpus", lambda c: _load(c, "[cluster]\ngpus = 2\n[elastic]\nnproc_per_node = 4"), ConfigError, r"\[elastic\]\.nproc_per_node \(4\) must be <= \[cluster\]\.gpus \(2\)"),
    case("invalid-toml", lambda c: load_config(c.write("[cluster\ngpus = 1"), env={}), ConfigError, r"platform\.toml: invalid TOML"),
    case("no-such-file", lambda c: load_config(c.tmp_path / "nope.toml", env={}), ConfigError, r"nope\.toml: no such config file"),
    case("env-path-missing", lambda c: load_config(env={"FUSEFORGE_CONFIG": str(c.tmp_path / "gone.toml")}), ConfigError, r"FUSEFORGE_CONFIG=.*gone\.toml: no such config file"),
    case("env-override-wrong-type", lambda c: _load(c, env={"FUSEFORGE__CLUSTER__GPUS": "two"}), ConfigError, r"environment variable FUSEFORGE__CLUSTER__GPUS: \[cluster\]\.gpus must be"),
    case("env-override-malformed", lambda c: _load(c, env={"FUSEFORGE__GPUS": "2"}), ConfigError, "environment variable FUSEFORGE__GPUS: expected FUSEFORGE__<SECTION>__<KEY>"),
    case("cli-override-negative-steps", lambda c: _load(c, overrides={"training.steps": "-3"}), ConfigError, r"--set training\.steps=-3: \[training\]\.steps must be >= 1"),
    case("cli-override-no-section", lambda c: _load(c, overrides={"steps": "3"}), ConfigError, r"--set steps=3: expected SECTION\.KEY=VALUE"),
    case("resolved-config-not-json", lambda c: load_config(env={"FUSEFORGE_RESOLVED_CONFIG": "{not json"}), ConfigError, "FUSEFORGE_RESOLVED_CONFIG: invalid JSON"),
]


@pytest.mark.parametrize("call, exc, match", CONFIG_CASES)
def test_config_loading_rejects(call, exc, match, ctx):
    check(call, exc, match, ctx)


# ----------------------------------------------------------------------------- training inputs
TINY = dict(model="tiny-llama", dataset="bench:bytes", batch_size=4, seq_len=32, kernels=False)


def _spec(**fields):
    return TrainSpec(**{**TINY, **fields}).validate()


def _workflow(name, **inputs):
    pytest.importorskip("flytekit", reason="the platform extra is not installed (e.g. the GPU image)")
    from fuseforge_flyte import workflows

    return getattr(workflows, name)(**inputs)


def _prepare(c, name, text=None, model="tiny-llama", tokenizer=""):
    """The data layer's preparation (what the Flyte prepare_data task and the engine run)."""
    pytest.importorskip("datasets", reason="the platform extra is not installed (e.g. the GPU image)")
    from fuseforge_flyte.data.prepare import prepare
    from fuseforge_flyte.data.spec import DataSpec

    if text is not None:
        name = str(c.write(text, name))
    return prepare(DataSpec(dataset=name, model=model, seq_len=32, tokenizer=tokenizer), str(c.tmp_path / "prepared"))


def _small_vocab_model(c):
    config = '{"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, ' \
             '"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}'
    return str(c.write(config, "config.json"))


def _nan_loss(c):
    from fuseforge_flyte.training.engine import train
    from fuseforge_flyte.training.faults import NONFINITE_ENV

    c.monkeypatch.setenv(NONFINITE_ENV, "0:2")
    train(TrainSpec(steps=2, **TINY))


TRAIN_CASES = [
    # TrainSpec.validate(): what the Flyte task, the CLI and platform.toml all go through
    case("spec-negative-steps", lambda c: _spec(steps=-5), ValueError, "TrainSpec.steps must be >= 1, got -5"),
    case("spec-zero-steps", lambda c: _spec(steps=0), ValueError, "TrainSpec.steps must be >= 1, got 0"),
    case("spec-zero-batch", lambda c: _spec(batch_size=0), ValueError, "TrainSpec.batch_size must be >= 1, got 0"),
    case("spec-zero-grad_accum", lambda c: _spec(grad_accum=0), ValueError, "TrainSpec.grad_accum must be >= 1"),
    case("spec-seq_len-1", lambda c: _spec(seq_len=1), ValueError, "TrainSpec.seq_len must be >= 2"),
    case("spec-lr-nan", lambda c: _spec(lr=NAN), ValueError, "TrainSpec.lr must be a finite value > 0, got nan"),
    case("spec-negative-warmup", lambda c: _spec(warmup_steps=-1), ValueError, "TrainSpec.warmup_steps must be a finite value >= 0"),
    case("spec-unknown-strategy", lambda c: _spec(strategy="horovod"), ValueError, r"TrainSpec.strategy: 'horovod' is not one of \['ddp', 'fsdp', 'deepspeed'\]"),
    case("spec-bad-dtype", lambda c: _spec(dtype="float32"), ValueError, r"TrainSpec.dtype: 'float32' is not one of \['fp32', 'bf16', 'fp16'\]"),
    case("spec-zero_stage", lambda c: _spec(zero_stage=4), ValueError, "TrainSpec.zero_stage: 4 is not one of"),
    case("spec-nonfinite_policy", lambda c: _spec(nonfinite_policy="ignore"), ValueError, "TrainSpec.nonfinite_policy: 'ignore' is not one of"),
    case("spec-unknown-model", lambda c: _spec(model="gpt-9"), ValueError, "TrainSpec.model: unknown model 'gpt-9'.*tiny-llama"),
    case("spec-empty-model", lambda c: _spec(model=""), ValueError, "TrainSpec.model: unknown model ''"),
    case("spec-missing-dataset", lambda c: _spec(dataset=str(c.tmp_path / "missing.jsonl")), ValueError, "TrainSpec.dataset: dataset file or folder not found: .*missing.jsonl"),
    case("spec-unknown-builtin-dataset", lambda c: _spec(dataset="builtin:wiki"), ValueError, "TrainSpec.dataset: unknown builtin dataset 'builtin:wiki'"),
    case("spec-unknown-benchmark-dataset", lambda c: _spec(dataset="bench:wiki"), ValueError, "TrainSpec.dataset: unknown benchmark dataset 'bench:wiki'"),
    case("spec-dataset-format", lambda c: _spec(dataset="data.xlsx"), ValueError, r"TrainSpec.dataset: unsupported file extension '.xlsx'"),
    case("spec-data-format", lambda c: _spec(data_format="chat"), ValueError, r"TrainSpec.data_format: 'chat' is not one of"),
    case("spec-eval-on-benchmark-data", lambda c: _spec(eval_fraction=0.1), ValueError, "benchmark dataset 'bench:bytes' has no eval split"),
    case("spec-eval-every-without-eval-data", lambda c: _spec(dataset="builtin:chat", eval_every=5), ValueError, "TrainSpec.eval_every=5 needs eval data"),
    case("spec-steps-str", lambda c: _spec(steps="10"), TypeError, "TrainSpec.steps must be int, got '10'"),
    case("spec-steps-bool", lambda c: _spec(steps=True), TypeError, "TrainSpec.steps must be int, got True"),
    case("spec-checkpoint-every-without-dir", lambda c: _spec(checkpoint_every=5, checkpoint_dir="off"), ValueError, "TrainSpec.checkpoint_every > 0 needs checkpoints, but TrainSpec.checkpoint_dir is 'off'"),
    case("spec-fsdp-fp16", lambda c: _spec(strategy="fsdp", dtype="fp16"), ValueError, "TrainSpec.dtype='fp16' is not supported with strategy='fsdp'"),
    case("spec-negative-loss_chunk_size", lambda c: _spec(loss_chunk_size=-1), ValueError, "TrainSpec.loss_chunk_size must be a finite value >= 0, got -1"),
    case("spec-loss_chunk_size-float", lambda c: _spec(loss_chunk_size=1024.0), TypeError, "TrainSpec.loss_chunk_size must be int, got 1024.0"),
    # the Flyte workflows, run locally: rejected before any worker process starts
    case("workflow-train-negative-steps", lambda c: _workflow("train", steps=-1), ValueError, "TrainSpec.steps must be >= 1, got -1"),
    case("workflow-train-zero-batch", lambda c: _workflow("train", batch_size=0), ValueError, "TrainSpec.batch_size must be >= 1, got 0"),
    case("workflow-train-missing-dataset", lambda c: _workflow("train", dataset="/no/such/corpus.txt"), FileNotFoundError, "DataSpec.dataset: dataset file or folder not found"),
    case("workflow-train-unknown-model", lambda c: _workflow("train", model="gpt-9"), ValueError, "TrainSpec.model: unknown model 'gpt-9'"),
    case("workflow-train-steps-str", lambda c: _workflow("train", steps="ten"), TypeError, "Failed argument 'steps'"),
    case("workflow-compare-unknown-strategy", lambda c: _workflow("compare", strategy="horovod"), Exception, "horovod is not in Enum <enum 'Strategy'>"),
    case("workflow-train-negative-loss_chunk_size", lambda c: _workflow("train", loss_chunk_size=-1), ValueError, "TrainSpec.loss_chunk_size must be a finite value >= 0, got -1"),
    case("workflow-compare-negative-loss_chunk_size", lambda c: _workflow("compare", loss_chunk_size=-1), ValueError, "TrainSpec.loss_chunk_size must be a finite value >= 0, got -1"),
    # datasets the spec cannot check up front (contents, vocabulary)
    case("data-vocab-mismatch", lambda c: _prepare(c, "builtin:chat", model=_small_vocab_model(c), tokenizer="builtin:tiny-bpe"), ValueError, r"the tokenizer's ids go up to 1023 \(vocabulary 1024\) but the model's vocab_size is 100"),
    case("data-empty-file", lambda c: _prepare(c, "empty.jsonl", "\n\n"), ValueError, "DataSpec.dataset: .*empty.jsonl' has no rows"),
    case("data-bad-jsonl", lambda c: _prepare(c, "bad.jsonl", '{"text": "ok"}\n{"text": \n'), ValueError, r"DataSpec.dataset: .*bad.jsonl, line 2: not valid JSON"),
    case("data-unknown-columns", lambda c: _prepare(c, "notext.jsonl", '{"content": "hi"}\n'), ValueError, r"DataSpec.dataset: cannot tell the format of .*notext.jsonl' from its columns \['content'\]"),
    case("data-missing-uri", lambda c: _prepare(c, f"file://{c.tmp_path}/gone.jsonl"), FileNotFoundError, "DataSpec.dataset: dataset file or folder not found: 'file://.*gone.jsonl'"),
    # NaN loss policy "raise": the step is named
    case("nan-loss-raise", _nan_loss, FloatingPointError, "non-finite training loss at step 2 .*nonfinite_policy='raise'"),
]


@pytest.mark.parametrize("call, exc, match", TRAIN_CASES)
def test_training_inputs_reject(call, exc, match, ctx):
    check(call, exc, match, ctx)


def test_training_cli_reports_bad_input_and_exits_2(capsys):
    from fuseforge_flyte.training import cli

    assert cli.main(["--steps", "-1", "--model", "tiny-llama"]) == 2
    assert "error: --steps must be >= 1, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # a choice: argparse names the allowed values
        cli.main(["--strategy", "horovod"])
    assert exited.value.code == 2 and "invalid choice: 'horovod'" in capsys.readouterr().err
