"""Learnable attention sinks (`deltamatch_attention(..., sinks=...)`, gpt-oss `s_aux`; docs/numerics.md "Attention
sinks") against float64 exact attention with a sink column, on the reference backend and the Triton kernels under
the interpreter.

Tolerances:
  - fp32 inputs in precision="bf16" (nothing rounded but fp32 arithmetic) against float64 autograd: 1e-5 relative,
    for out and every gradient, d sinks included: a wrong formula is off by percents, fp32 rounding by ~1e-7.
  - bf16/fp16 inputs: out and dq/dk/dv as without sinks (fp8 ~5% / ~7%, bf16 ~2.5e-3), bounded per case at 1.2x
    the measured error (tests/_measured.py); BOUND (fp8 8% / 11%, bf16 1e-2) where a case has no measured value.
    d sinks = -sum_i P_i,sink * delta_i sums terms of both signs: its FP8 error (dO and V rounded to e4m3, ~2^-4
    per element, in every delta_i) is relative to sum_i |P_i,sink * delta_i|, not to the (cancelled) sum; measured
    0.3% to 2.1% of it (SINK_BOUND 3%), bf16 mode ~1e-7 (fp32 rounding, held to 1e-6).
  - The invariant with the sink's column, sum_j dS_ij + dS_i,sink = 0 (dS_i,sink = -P_i,sink * delta_i): matching
    at fp32 rounding (<= 1e-5 of the row's sum of |dS|), stale orders of magnitude larger.
  - Kernels (interpreter) vs reference: 1e-3, as tests/test_kernels.py.
"""

import math
import os
import sys

import pytest
import torch

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention, reference
from hf_deltamatch.diagnostics import exact_attention, visible
from hf_deltamatch.testing import rel_err

sys.path.insert(0, os.path.dirname(__file__))
from _measured import bound, measured_close  # noqa: E402

BOUND = {"fp8": (0.08, 0.11), "bf16": (0.01, 0.01)}  # out, dq/dk/dv on gaussian inputs (tests/test_attention.py)
SINK_BOUND = {"fp8": 0.03, "bf16": 1e-4}  # d sinks, relative to sum_i |P_i,sink * delta_i| per head


def make(b, hq, hkv, n, m, d, seed=0, dtype=torch.bfloat16):
    """q, k, v, dO and sinks of about log(m) (the sink then takes a share of each row comparable to the keys')."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    sinks = math.log(max(m, 2)) - 1.0 + 2.0 * torch.randn(hq, generator=g)
    return mk(b, hq, n, d), mk(b, hkv, m, d), mk(b, hkv, m, d), mk(b, hq, n, d), sinks


def run_op(q, k, v, do, sinks, config, **kw):
    q, k, v, s = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    out = deltamatch_attention(q, k, v, sinks=s, config=config, **kw)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad, s.grad


def run_exact(q, k, v, do, sinks, **kw):
    q, k, v, s = (t.detach().double().requires_grad_() for t in (q, k, v, sinks))
    out = exact_attention(q, k, v, sinks=s, **kw)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad, s.grad


def sink_terms(q, k, v, do, sinks, **kw):
    """sum_{b,i} |P_i,sink * delta_i| per head, float64 (delta_i = dO_i . O_i): the scale of d sinks' error."""
    lse = exact_lse(q, k, **kw)
    s = sinks.double().view(1, -1, 1)
    p_sink = torch.exp(s - torch.logaddexp(lse, s))
    out = exact_attention(q, k, v, sinks=sinks, **kw)
    return (p_sink * (do.double() * out).sum(-1)).abs().sum(dim=(0, 2))


def exact_lse(q, k, causal=True, window=None, cu_seqlens_q=None, cu_seqlens_k=None):
    """float64 LSE over the visible keys (no sink), -inf where none is visible."""
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)
    segs = [(0, q.shape[2], 0, k.shape[2])] if cu_seqlens_q is None else list(zip(
        cu_seqlens_q.tolist()[:-1], cu_seqlens_q.tolist()[1:], cu_seqlens_k.tolist()[:-1], cu_seqlens_k.tolist()[1:]))
    out = []
    for q0, q1, k0, k1 in segs:
        n, m = q1 - q0, k1 - k0
        s = q[:, :, q0:q1] @ k[:, :, k0:k1].transpose(-1, -2) / math.sqrt(q.shape[-1])
        out.append(torch.logsumexp(s.masked_fill(~visible(n, m, causal, window), float("-inf")), dim=-1))
    return torch.cat(out, dim=2)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


CASES = {
    "causal": dict(shape=(2, 4, 4, 150, 150, 32), causal=True),
    "full": dict(shape=(1, 4, 4, 130, 130, 32), causal=False),
    "decode-chunk (N<M)": dict(shape=(1, 4, 2, 40, 200, 32), causal=True),
    "gqa": dict(shape=(1, 8, 2, 140, 140, 32), causal=True),
    "window": dict(shape=(1, 2, 2, 300, 300, 32), causal=True, window=70),
    "no key for the first rows (N>M)": dict(shape=(1, 2, 2, 100, 30, 32), causal=True),
    "varlen": dict(shape=(1, 4, 2, 280, 280, 32), causal=True, lens=[70, 1, 129, 80]),
    "varlen window": dict(shape=(1, 2, 1, 280, 280, 32), causal=True, window=40, lens=[200, 80]),
}


def _case(name, dtype=torch.bfloat16, seed=0):
    c = CASES[name]
    q, k, v, do, sinks = make(*c["shape"], seed=seed, dtype=dtype)
    kw = dict(causal=c["causal"], window=c.get("window"))
    if "lens" in c:
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = _cu(c["lens"])
    return (q, k, v, do, sinks), kw


@pytest.mark.parametrize("delta", ["matching", "stale"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_reference_equals_float64_autograd(case, delta):
    """The derivation: with nothing rounded (fp32 inputs, precision='bf16' rounds P and dS to the input dtype),
    the op's out, dq, dk, dv and d sinks are float64 autograd's of a softmax with a sink column, to fp32 rounding.
    Through the custom op (the public function takes bf16/fp16 only)."""
    (q, k, v, do, sinks), kw = _case(case, dtype=torch.float32)
    qq, kk, vv, ss = (t.clone().requires_grad_() for t in (q, k, v, sinks))
    out = torch.ops.hf_deltamatch.attention_forward(
        qq, kk, vv, kw["causal"], q.shape[-1] ** -0.5, kw["window"], kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"),
        "bf16", delta, 128, "fp32", "e4m3", "reference", False, ss)[0]
    out.backward(do)
    want = run_exact(q, k, v, do, sinks, **kw)
    for name, got, w in zip(("out", "dq", "dk", "dv", "dsinks"), (out.detach(), qq.grad, kk.grad, vv.grad, ss.grad),
                            want):
        assert got.dtype == torch.float32 and torch.isfinite(got).all(), name
        assert rel_err(w, got) < 1e-5, (name, rel_err(w, got))


# (out, dq, dk, dv, d sinks) errors against float64 exact attention with the sink column, measured (seed 1);
# out..dv relative Frobenius, d sinks the largest over heads of |error| / sum_i |P_i,sink delta_i|
MEASURED = {
    ("causal", "fp8-matching"): (0.0537, 0.0658, 0.0661, 0.0550, 0.0042),
    ("causal", "fp8-stale"): (0.0537, 0.0668, 0.0667, 0.0550, 0.0028),
    ("causal", "bf16-matching"): (0.0027, 0.0024, 0.0024, 0.0023, 5.87e-08),
    ("full", "fp8-matching"): (0.0552, 0.0698, 0.0675, 0.0562, 0.0056),
    ("full", "fp8-stale"): (0.0552, 0.0711, 0.0679, 0.0562, 0.0055),
    ("full", "bf16-matching"): (0.0027, 0.0024, 0.0023, 0.0024, 5.17e-08),
    ("decode-chunk (N<M)", "fp8-matching"): (0.0508, 0.0671, 0.0671, 0.0556, 0.0212),
    ("decode-chunk (N<M)", "fp8-stale"): (0.0508, 0.0678, 0.0674, 0.0556, 0.0175),
    ("decode-chunk (N<M)", "bf16-matching"): (0.0028, 0.0023, 0.0023, 0.0024, 2.73e-07),
    ("gqa", "fp8-matching"): (0.0521, 0.0655, 0.0655, 0.0532, 0.0079),
    ("gqa", "fp8-stale"): (0.0521, 0.0671, 0.0661, 0.0532, 0.0107),
    ("gqa", "bf16-matching"): (0.0026, 0.0023, 0.0023, 0.0023, 8.16e-08),
    ("window", "fp8-matching"): (0.0541, 0.0680, 0.0666, 0.0557, 0.0061),
    ("window", "fp8-stale"): (0.0541, 0.0688, 0.0669, 0.0557, 0.0028),
    ("window", "bf16-matching"): (0.0027, 0.0024, 0.0023, 0.0023, 3.94e-08),
    ("no key for the first rows (N>M)", "fp8-matching"): (0.0477, 0.0580, 0.0600, 0.0530, 0.0151),
    ("no key for the first rows (N>M)", "fp8-stale"): (0.0477, 0.0589, 0.0603, 0.0530, 0.0200),
    ("no key for the first rows (N>M)", "bf16-matching"): (0.0025, 0.0027, 0.0026, 0.0025, 5.42e-08),
    ("varlen", "fp8-matching"): (0.0528, 0.0662, 0.0676, 0.0536, 0.0067),
    ("varlen", "fp8-stale"): (0.0528, 0.0668, 0.0671, 0.0536, 0.0056),
    ("varlen", "bf16-matching"): (0.0026, 0.0024, 0.0024, 0.0023, 5.79e-08),
    ("varlen window", "fp8-matching"): (0.0522, 0.0654, 0.0640, 0.0557, 0.0029),
    ("varlen window", "fp8-stale"): (0.0522, 0.0659, 0.0645, 0.0557, 0.0031),
    ("varlen window", "bf16-matching"): (0.0026, 0.0024, 0.0023, 0.0024, 4.38e-08),
}
MEASURED = {key: dict(zip(("out", "dq", "dk", "dv", "dsinks"), errs)) for key, errs in MEASURED.items()}


@pytest.mark.parametrize("precision,delta", [("fp8", "matching"), ("fp8", "stale"), ("bf16", "matching")])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_exact_attention_with_sinks(case, precision, delta):
    """Bounded at 1.2x the measured errors (tests/_measured.py)."""
    (q, k, v, do, sinks), kw = _case(case, seed=1)
    got = run_op(q, k, v, do, sinks, DeltaMatchConfig(precision=precision, delta=delta, backend="reference"), **kw)
    want = run_exact(q, k, v, do, sinks, **kw)
    key = (case, f"{precision}-{delta}")
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        measured_close(MEASURED, key, name, w, g, "test_sinks")
    dsinks, scale = got[4], sink_terms(q, k, v, do, sinks, **kw)
    assert dsinks.dtype == torch.float32 and dsinks.shape == sinks.shape
    err = ((dsinks.double() - want[4]).abs() / scale).max().item()
    assert err <= bound(MEASURED[key]["dsinks"]), (key, err, MEASURED[key]["dsinks"])


def test_sinks_change_the_result_and_zero_weight_sinks_do_not():
    """The comparisons above can fail: sinks move out by far more than the bounds; a sink of -1e4 (weight
    exp(-1e4) = 0 in fp32) gives the no-sink result bit for bit, and its gradient is 0."""
    (q, k, v, do, sinks), kw = _case("causal")
    cfg = DeltaMatchConfig(backend="reference")
    with_sinks = run_op(q, k, v, do, sinks, cfg, **kw)
    plain = deltamatch_attention(q, k, v, config=cfg, **kw)
    assert rel_err(with_sinks[0], plain) > 5 * BOUND["fp8"][0]
    off = run_op(q, k, v, do, torch.full_like(sinks, -1e4), cfg, **kw)
    assert torch.equal(off[0], plain)
    assert (off[4] == 0).all()


# d sinks' error in test_invariant_with_the_sink_column, relative to sum_i |P_i,sink delta_i|, measured
INVARIANT_DSINKS = {(True, 64, "matching"): 0.0038, (True, 64, "stale"): 0.0057, (True, 128, "matching"): 0.0037,
                    (True, 128, "stale"): 0.0017, (False, 64, "matching"): 0.0025, (False, 64, "stale"): 0.0020,
                    (False, 128, "matching"): 0.0023, (False, 128, "stale"): 0.0023}


@pytest.mark.parametrize("block", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_invariant_with_the_sink_column(causal, block):
    """sum_j dS_ij + dS_i,sink = 0, dS_i,sink = -P_i,sink * delta_i, with the delta the backward used (returned by
    reference.backward) and P from the sink-aware LSE: matching at fp32 rounding, stale broken."""
    q, k, v, do, sinks = make(1, 4, 4, 512, 512, 64, seed=3)
    scale = 64 ** -0.5
    want = run_exact(q, k, v, do, sinks, causal=causal)
    scale_ds = sink_terms(q, k, v, do, sinks, causal=causal)
    resid = {}
    for delta in ("matching", "stale"):
        config = DeltaMatchConfig(delta=delta, block=block)
        kw = dict(causal=causal, softmax_scale=scale, window=None, cu_seqlens_q=None, cu_seqlens_k=None, config=config)
        out, lse, *saved = reference.forward(q, k, v, **kw)
        out, lse = reference.apply_sinks(out, lse, sinks)
        *_, rs, ra, delta_rows = reference.backward(do, None, None, None, out, lse, *saved, **kw,
                                                    return_row_sums=True, return_delta=True)
        ds_sink = -torch.exp(sinks.view(1, -1, 1) - lse) * delta_rows
        resid[delta] = ((rs + ds_sink).abs() / (ra + ds_sink.abs()).clamp_min(1e-30))
        # d s_h from that delta (what the op returns) against float64 autograd of the softmax with a sink column
        dsinks = reference.sinks_grad(lse, delta_rows, sinks)
        err = ((dsinks.double() - want[4]).abs() / scale_ds).max().item()
        assert err <= bound(INVARIANT_DSINKS[(causal, block, delta)]), (delta, err)
    assert resid["matching"].max() < 1e-5
    assert resid["stale"].norm() > 100 * resid["matching"].norm()


def test_fully_masked_rows_give_zeros_and_the_sink_lse():
    """Rows that see no key (N > M, bottom-right causal): out 0, LSE = s_h (the sink alone), zero gradients and
    no contribution to d sinks (P_sink = 1 there, but delta = 0), never NaN."""
    q, k, v, do, sinks = make(1, 2, 2, 100, 30, 32)
    for precision in ("fp8", "bf16"):
        cfg = DeltaMatchConfig(precision=precision)
        out, dq, dk, dv, ds = run_op(q, k, v, do, sinks, cfg, causal=True)
        assert all(torch.isfinite(t).all() for t in (out, dq, dk, dv, ds))
        assert (out[:, :, :70] == 0).all() and (dq[:, :, :70] == 0).all()
        _, lse = deltamatch_attention(q, k, v, causal=True, config=cfg, return_lse=True, sinks=sinks)
        assert torch.equal(lse[:, :, :70], sinks.view(1, -1, 1).expand(1, 2, 70))
        if precision == "bf16":  # (fp8: other quantization tiles) d sinks is that of the rows with keys alone
            alone = run_op(q[:, :, 70:], k, v, do[:, :, 70:], sinks, cfg, causal=True)
            torch.testing.assert_close(ds, alone[4], rtol=1e-6, atol=1e-6)


def test_packed_equals_separate_sequences_with_sinks():
    lens = [70, 1, 200, 129]
    q, k, v, do, sinks = make(1, 4, 2, sum(lens), sum(lens), 32, seed=5)
    cu = _cu(lens)
    for precision in ("fp8", "bf16"):
        config = DeltaMatchConfig(precision=precision)
        packed = run_op(q, k, v, do, sinks, config, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        dsinks = torch.zeros_like(sinks)
        for i in range(len(lens)):
            a, b = cu[i].item(), cu[i + 1].item()
            sep = run_op(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], do[:, :, a:b], sinks, config, causal=True)
            for x, y in zip(packed[:4], sep[:4]):
                # the same tiles and formulas; the sink's exp and logaddexp may differ in the last fp32 bit between
                # tensor shapes (CPU kernels' vectorized body vs scalar tail), flipping a rare bf16 rounding
                torch.testing.assert_close(x[:, :, a:b], y, rtol=2 ** -7, atol=1e-5)
            dsinks += sep[4]
        torch.testing.assert_close(packed[4], dsinks, rtol=1e-5, atol=1e-6)  # a sum in another order


@pytest.mark.parametrize("delta", ["matching", "stale"])
def test_eager_path_is_the_custom_op_with_sinks(delta):
    q, k, v, do, sinks = make(1, 4, 2, 80, 80, 32, seed=3)
    cfg = DeltaMatchConfig(delta=delta)
    eager = run_op(q, k, v, do, sinks, cfg)
    qq, kk, vv, ss = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    out = torch.ops.hf_deltamatch.attention_forward(
        qq, kk, vv, True, 32 ** -0.5, None, None, None, cfg.precision, cfg.delta, cfg.block, cfg.scale_rounding,
        cfg.grad_format, "reference", cfg.deterministic, ss)[0]
    out.backward(do)
    for a, b in zip(eager, (out.detach(), qq.grad, kk.grad, vv.grad, ss.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_compile_traces_sinks_without_graph_breaks():
    q, k, v, do, sinks = make(1, 2, 2, 96, 96, 32)
    eager = run_op(q, k, v, do, sinks, DeltaMatchConfig())

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v, s):
        return deltamatch_attention(q, k, v, causal=True, config=DeltaMatchConfig(), sinks=s).float()

    qq, kk, vv, ss = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    out = f(qq, kk, vv, ss)
    out.backward(do.float())
    torch.testing.assert_close(out, eager[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(qq.grad, eager[1], rtol=0, atol=0)
    torch.testing.assert_close(ss.grad, eager[4], rtol=0, atol=0)


def test_frozen_sinks_get_no_gradient_and_change_nothing_else():
    q, k, v, do, sinks = make(1, 2, 2, 64, 64, 32)
    cfg = DeltaMatchConfig()
    learned = run_op(q, k, v, do, sinks, cfg)
    qq = q.clone().requires_grad_()
    out = deltamatch_attention(qq, k, v, sinks=sinks, config=cfg)  # sinks.requires_grad is False
    out.backward(do)
    assert torch.equal(out.detach(), learned[0]) and torch.equal(qq.grad, learned[1])


def test_bad_sinks_raise_clear_errors():
    q, k, v, _, sinks = make(1, 4, 2, 32, 32, 16)
    with pytest.raises(ValueError, match=r"shape \(4,\).*one logit per query head"):
        deltamatch_attention(q, k, v, sinks=sinks[:2])
    with pytest.raises(TypeError, match=r"float32.*sinks.float\(\)"):
        deltamatch_attention(q, k, v, sinks=sinks.bfloat16())
    with pytest.raises(TypeError, match="torch.Tensor"):
        deltamatch_attention(q, k, v, sinks=[0.0] * 4)
    with pytest.raises(ValueError, match="q's device"):
        deltamatch_attention(q, k, v, sinks=sinks.to("meta"))



def test_non_finite_sinks():
    """No host sync to validate them: a NaN or +inf sink makes its head's outputs NaN (as exact attention's softmax
    does) and leaves the other heads bit-identical; a -inf sink is no sink."""
    q, k, v, _, sinks = make(1, 4, 2, 32, 32, 16)
    clean = deltamatch_attention(q, k, v, sinks=sinks, config=DeltaMatchConfig(backend="reference"))
    for bad in (float("nan"), float("inf")):
        s = sinks.clone()
        s[1] = bad
        out = deltamatch_attention(q, k, v, sinks=s, config=DeltaMatchConfig(backend="reference"))
        assert torch.isnan(out[:, 1]).all()
        assert torch.equal(out[:, [0, 2, 3]], clean[:, [0, 2, 3]])
    s = sinks.clone()
    s[1] = float("-inf")
    out = deltamatch_attention(q, k, v, sinks=s, config=DeltaMatchConfig(backend="reference"))
    plain = deltamatch_attention(q, k, v, config=DeltaMatchConfig(backend="reference"))
    torch.testing.assert_close(out[:, 1], plain[:, 1], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------
# The Triton kernels (interpreter on CPU): the same sinks around them, the delta they used
# ----------------------------------------------------------------------------------------------------

KERNEL_CASES = {
    "dense fp8": dict(shape=(1, 2, 1, 192, 192, 64), causal=True),
    "full bf16": dict(shape=(1, 2, 2, 130, 130, 32), causal=False, precision="bf16"),
    "gqa window block64": dict(shape=(1, 4, 2, 200, 200, 32), causal=True, window=50, block=64),
    "stale": dict(shape=(1, 2, 2, 160, 160, 32), causal=True, delta="stale"),
    "N>M": dict(shape=(1, 2, 2, 130, 60, 32), causal=True),
    "varlen": dict(shape=(1, 2, 1, 260, 260, 32), causal=True, lens=[70, 1, 129, 60]),
}


@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_triton_kernels_match_reference_with_sinks(case):
    pytest.importorskip("hf_deltamatch.kernels")
    c = dict(KERNEL_CASES[case])
    q, k, v, do, sinks = make(*c.pop("shape"), seed=2)
    kw = dict(causal=c.pop("causal"), window=c.pop("window", None))
    if "lens" in c:
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = _cu(c.pop("lens"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, do, sinks = (t.to(dev) for t in (q, k, v, do, sinks))
    kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    got = run_op(q, k, v, do, sinks, DeltaMatchConfig(backend="triton", **c), **kw)
    want = run_op(q, k, v, do, sinks, DeltaMatchConfig(backend="reference", **c), **kw)
    tol = 1e-3 if dev == "cpu" else 1e-2
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(b, a) <= tol, (name, rel_err(b, a))


def test_kernel_backward_returns_the_delta_it_used():
    """kernels.backward(return_delta=True) gives the reference's delta (the correction pass's rowsum(P * dP))."""
    K = pytest.importorskip("hf_deltamatch.kernels")
    q, k, v, do, sinks = make(1, 2, 2, 150, 150, 32, seed=4)
    cu = _cu([100, 50])
    kw = dict(causal=True, softmax_scale=32 ** -0.5, window=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=DeltaMatchConfig())
    out, lse, *saved = reference.forward(q, k, v, **kw)
    out, lse = reference.apply_sinks(out, lse, sinks)
    dk_ = K.backward(do, q, k, v, out, lse, *saved, **kw, return_delta=True)[-1]
    dr = reference.backward(do, q, k, v, out, lse, *saved, **kw, return_delta=True)[-1]
    assert dk_.shape == dr.shape == (1, 2, 150) and dk_.dtype == torch.float32
    assert rel_err(dr, dk_) <= 1e-4


def test_unpad_rows_inverts_pad():
    """The packed Gluon backward's delta comes back from the padded layout through kernels._unpad_rows: the inverse
    of segments.pad on the tokens of every sequence, the other rows left as they were."""
    pytest.importorskip("triton")
    from hf_deltamatch.kernels import ops as K
    from hf_deltamatch.kernels import segments as S

    cu = torch.tensor([3, 8, 8, 143, 303], dtype=torch.int32)
    z = torch.zeros(1, 1, 310, 16)
    vl, seqs = K.sequences(z, z, cu, cu)
    seg = S.padded_layout(vl.cu_q, *seqs.packing)
    x = torch.randn(2, 3, 310)
    back = K._unpad_rows(S.pad(x, seg, float("-inf")), seg, torch.full_like(x, 7.0))
    assert torch.equal(back[:, :, 3:303], x[:, :, 3:303])
    assert (back[:, :, :3] == 7).all() and (back[:, :, 303:] == 7).all()


def test_smooth_k_with_sinks_is_refused():
    """K smoothing lowers each query's scores by softmax_scale * q . mean(k); a sink's logit would have to move
    with them, so the combination raises instead of computing another softmax."""
    q, k, v, do, sinks = make(1, 2, 2, 64, 64, 32, seed=1)
    with pytest.raises(ValueError, match="smooth_k=True is not supported with attention sinks"):
        deltamatch_attention(q, k, v, sinks=sinks, config=DeltaMatchConfig(smooth_k=True, backend="reference"))


# out, dq, dk, dv, d sinks errors of the rotation with sinks against float64 (as MEASURED), and without the rotation
ROTATION_MEASURED = {"hadamard": (0.0535, 0.0669, 0.0654, 0.0551, 0.0144),
                     "none": (0.0534, 0.0690, 0.0650, 0.0536, 0.0109)}


def test_rotation_with_sinks_is_exact_attention_with_sinks():
    """The rotation leaves every score, hence the sink's share of each row, unchanged in exact arithmetic: with
    sinks the rotated op is float64 attention with a sink column to FP8 accuracy (measured beside the unrotated op's:
    a rotation that moved the scores, or a sink applied to rotated scores in other units, would be far off)."""
    (q, k, v, do, sinks), kw = _case("gqa", seed=2)
    want = run_exact(q, k, v, do, sinks, **kw)
    scale = sink_terms(q, k, v, do, sinks, **kw)
    for rotation, measured in ROTATION_MEASURED.items():
        got = run_op(q, k, v, do, sinks, DeltaMatchConfig(qk_rotation=rotation, backend="reference"), **kw)
        table = {rotation: dict(zip(("out", "dq", "dk", "dv"), measured))}
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            measured_close(table, rotation, name, w, g, "test_sinks rotation")
        err = ((got[4].double() - want[4]).abs() / scale).max().item()
        assert err <= bound(measured[4]), (rotation, err)
