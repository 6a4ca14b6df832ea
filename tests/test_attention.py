"""deltamatch_attention (reference backend) against float64 exact attention, and the zero-row-sum invariant.

Tolerances (relative Frobenius error vs float64 exact attention, gaussian inputs):
  - fp8: e4m3 keeps 3 mantissa bits (rounding error up to 2^-4 per element) on q, k, v, P, dO and dS;
    measured ~5% on the output and ~6-7% on gradients, bounded here at 8% / 11%.
  - bf16 mode: bf16 operands (8 bits) ~2e-3, bounded at 1e-2.
  - The invariant sum_j dS_ij = 0: matching holds it at fp32 rounding (bounded at 1e-5 relative to
    sum_j |dS_ij|); stale delta is orders of magnitude off on the same inputs.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_deltamatch
from hf_deltamatch import DeltaMatchConfig, deltamatch_attention, reference
from hf_deltamatch.attention import resolve_backend
from hf_deltamatch.diagnostics import exact_attention, visible

BOUND = {"fp8": (0.08, 0.11), "bf16": (0.01, 0.01)}  # (forward, gradients)


def rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


def make(b, hq, hkv, n, m, dqk, dv, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    return mk(b, hq, n, dqk), mk(b, hkv, m, dqk), mk(b, hkv, m, dv), mk(b, hq, n, dv)


def run_op(q, k, v, do, config, **kw):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = deltamatch_attention(q, k, v, config=config, **kw)
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def run_exact(q, k, v, do, **kw):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = exact_attention(q, k, v, **kw)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


CASES = {
    "causal": dict(b=2, hq=4, hkv=4, n=150, m=150, dqk=32, dv=32, causal=True),
    "full": dict(b=2, hq=4, hkv=4, n=150, m=150, dqk=32, dv=32, causal=False),
    "decode-chunk (N<M)": dict(b=1, hq=4, hkv=2, n=40, m=200, dqk=32, dv=32, causal=True),
    "gqa": dict(b=1, hq=8, hkv=2, n=140, m=140, dqk=32, dv=32, causal=True),
    "mqa": dict(b=1, hq=4, hkv=1, n=140, m=140, dqk=32, dv=32, causal=True),
    "mla dqk!=dv": dict(b=1, hq=4, hkv=4, n=130, m=130, dqk=48, dv=32, causal=True),
    "window": dict(b=1, hq=2, hkv=2, n=300, m=300, dqk=32, dv=32, causal=True, window=70),
}


@pytest.mark.parametrize("precision,delta", [("fp8", "matching"), ("fp8", "stale"), ("bf16", "matching")])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_exact_attention(case, precision, delta):
    c = dict(CASES[case])
    kw = {"causal": c.pop("causal"), "window": c.pop("window", None)}
    q, k, v, do = make(**c)
    got = run_op(q, k, v, do, DeltaMatchConfig(precision=precision, delta=delta, backend="reference"), **kw)
    want = run_exact(q, k, v, do, **kw)
    fwd, bwd = BOUND[precision]
    assert rel(got[0], want[0]) < fwd
    for name, g, w in zip("qkv", got[1:], want[1:]):
        assert torch.isfinite(g).all()
        assert rel(g, w) < bwd, f"d{name}"
    assert got[1].dtype == q.dtype and got[0].shape == (q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def _row_sums(q, k, v, do, config, causal=True):
    scale = 1 / math.sqrt(q.shape[-1])
    fwd = reference.forward(q, k, v, causal=causal, softmax_scale=scale, window=None, cu_seqlens_q=None,
                            cu_seqlens_k=None, config=config)
    *_, sums, abs_sums = reference.backward(
        do, q, k, v, fwd[0], fwd[1], *fwd[2:], causal=causal, softmax_scale=scale, window=None,
        cu_seqlens_q=None, cu_seqlens_k=None, config=config, return_row_sums=True)
    return sums, abs_sums


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block", [64, 128])
def test_invariant_matching_holds_stale_breaks(causal, block):
    q, k, v, do = make(1, 4, 4, 512, 512, 64, 64, seed=3)
    m_sums, m_abs = _row_sums(q, k, v, do, DeltaMatchConfig(delta="matching", block=block), causal)
    s_sums, s_abs = _row_sums(q, k, v, do, DeltaMatchConfig(delta="stale", block=block), causal)
    matching = (m_sums.abs() / m_abs.clamp_min(1e-30)).max().item()
    stale = (s_sums.norm() / s_abs.norm()).item()
    assert matching < 1e-5  # fp32 rounding of a sum over <= 512 terms
    assert stale > 100 * (m_sums.norm() / m_abs.norm()).item()
    assert stale > 1e-3


def test_packed_equals_separate_sequences():
    lens = [70, 1, 200, 129]
    q, k, v, do = make(1, 4, 2, sum(lens), sum(lens), 32, 32, seed=5)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    for precision in ("fp8", "bf16"):
        config = DeltaMatchConfig(precision=precision)
        packed = run_op(q, k, v, do, config, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        for i in range(len(lens)):
            a, b = cu[i].item(), cu[i + 1].item()
            sep = run_op(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], do[:, :, a:b], config, causal=True)
            for x, y in zip(packed, sep):
                torch.testing.assert_close(x[:, :, a:b], y, rtol=0, atol=0)  # tiles start at each sequence


def test_varlen_matches_exact_with_different_q_and_k_lengths():
    cu_q = torch.tensor([0, 10, 60, 61], dtype=torch.int32)
    cu_k = torch.tensor([0, 100, 150, 300], dtype=torch.int32)
    q, k, v, do = make(1, 2, 2, 61, 300, 32, 32, seed=9)
    kw = dict(causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    got = run_op(q, k, v, do, DeltaMatchConfig(), **kw)
    want = run_exact(q, k, v, do, **kw)
    for x, y in zip(got, want):
        assert rel(x, y) < 0.11


def test_fully_masked_rows_give_zeros_not_nan():
    # N > M with bottom-right causal alignment: the first N - M queries see no key at all.
    q, k, v, do = make(1, 2, 2, 100, 30, 32, 32)
    for precision in ("fp8", "bf16"):
        out, dq, dk, dv = run_op(q, k, v, do, DeltaMatchConfig(precision=precision), causal=True)
        assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
        assert (out[:, :, :70] == 0).all() and (dq[:, :, :70] == 0).all()
        assert out[:, :, 70:].abs().sum() > 0
        _, lse = deltamatch_attention(q, k, v, causal=True, config=DeltaMatchConfig(precision=precision),
                                      return_lse=True)
        assert torch.isinf(lse[:, :, :70]).all() and torch.isfinite(lse[:, :, 70:]).all()


def test_large_inputs_do_not_overflow_fp8():
    q, k, v, do = make(1, 2, 2, 128, 128, 32, 32, scale=3000.0)  # far beyond e4m3's 448 before scaling
    out, dq, dk, dv = run_op(q, k, v, do * 1000, DeltaMatchConfig(), causal=True)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all()


def uncancelled_grad_norms(q, k, v, do, causal, window):
    """Norms of scale * A |K| and A^T |Q| (summed over each GQA group), A_ij = P_ij |dO_i o V_j|, float64: the
    scale of dQ's and dK's FP8 error. Rounding dO and V to e4m3 (relative error ~2^-4 per element) moves
    dP_ij = dO_i . V_j by about |dO_i o V_j| times that, however much the sum itself cancels; when the
    cancellation in dP or in dS = P o (dP - delta) leaves a small gradient (e.g. two keys with nearly equal
    dP), the error is relative to these norms, not to the gradient's own."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    n, m = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5
    keep = visible(n, m, causal, window)
    p = torch.nan_to_num(torch.softmax((q @ kk.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf")), -1))
    a = p * (do.square() @ vv.square().transpose(-1, -2)).sqrt() * scale
    dk = (a.transpose(-1, -2) @ q.abs()).unflatten(1, (k.shape[1], g)).sum(2)
    return (a @ kk.abs()).norm().item(), dk.norm().item()


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 260), m_extra=st.integers(0, 120), hkv=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3]),
    d=st.sampled_from([16, 32, 48]), causal=st.booleans(), block=st.sampled_from([64, 128]),
    window=st.one_of(st.none(), st.integers(1, 200)), precision=st.sampled_from(["fp8", "bf16"]),
    seed=st.integers(0, 2**16),
)
def test_fuzzed_shapes(n, m_extra, hkv, groups, d, causal, block, window, precision, seed):
    m = n + m_extra
    window = window if causal else None
    q, k, v, do = make(1, hkv * groups, hkv, n, m, d, d, seed=seed)
    kw = dict(causal=causal, window=window)
    got = run_op(q, k, v, do, DeltaMatchConfig(precision=precision, block=block), **kw)
    want = run_exact(q, k, v, do, **kw)
    tol = 0.2 if precision == "fp8" else 0.02  # short rows put single-element errors in the Frobenius norm
    # dq, dk may instead be off by 4 % (fp8) of their error scale: where cancellation makes them small, FP8's
    # error is relative to that scale (300 fuzzed shapes: the errors above 20 % were <= 1.8 % of it)
    mags = (0.0, *uncancelled_grad_norms(q, k, v, do, **kw), 0.0)  # out, dq, dk, dv
    for x, y, mag in zip(got, want, mags):
        assert torch.isfinite(x).all()
        if y.norm() > 1e-3 * y.numel() ** 0.5:  # skip relative error on ~empty gradients (e.g. one key)
            assert (x.double() - y).norm().item() < max(tol * y.norm().item(), tol / 5 * mag)


@pytest.mark.slow
def test_8k_tokens_on_cpu():
    q, k, v, do = make(1, 1, 1, 8192, 8192, 64, 64, seed=1)
    out, dq, dk, dv = run_op(q, k, v, do, DeltaMatchConfig(), causal=True)
    assert torch.isfinite(out).all() and torch.isfinite(dq).all() and torch.isfinite(dk).all()
    # Spot-check the last rows against float64 (they see every key).
    tail = slice(8192 - 64, 8192)
    ref = exact_attention(q[:, :, tail].double(), k.double(), v.double(), causal=True)
    assert rel(out[:, :, tail], ref) < 0.08


def test_env_overrides(monkeypatch):
    q, k, v, do = make(1, 2, 2, 64, 64, 32, 32)
    bf16 = deltamatch_attention(q, k, v, config=DeltaMatchConfig(precision="bf16"))
    monkeypatch.setenv("HF_DELTAMATCH_PRECISION", "bf16")
    torch.testing.assert_close(deltamatch_attention(q, k, v), bf16, rtol=0, atol=0)
    monkeypatch.setenv("HF_DELTAMATCH_PRECISION", "fp4")
    with pytest.raises(ValueError, match="HF_DELTAMATCH_PRECISION"):
        deltamatch_attention(q, k, v)


def test_set_default_config_is_used():
    q, k, v, _ = make(1, 2, 2, 64, 64, 32, 32)
    hf_deltamatch.set_default_config(DeltaMatchConfig(precision="bf16"))
    torch.testing.assert_close(deltamatch_attention(q, k, v),
                               deltamatch_attention(q, k, v, config=DeltaMatchConfig(precision="bf16")))


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = make(1, 2, 2, 64, 64, 32, 32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        deltamatch_attention(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="multiple of 16"):
        deltamatch_attention(q[..., :24], k[..., :24], v)
    with pytest.raises(ValueError, match="causal=True"):
        deltamatch_attention(q, k, v, causal=False, window=8)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        deltamatch_attention(torch.cat([q, q[:, :1]], 1), k, v)
    with pytest.raises(ValueError, match="must start at 0 and end at"):
        cu = torch.tensor([0, 10, 50], dtype=torch.int32)
        deltamatch_attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="choose one of"):
        DeltaMatchConfig(delta="fresh")
    for bad in (0.0, -0.125, float("nan")):
        with pytest.raises(ValueError, match="softmax_scale must be"):
            deltamatch_attention(q, k, v, softmax_scale=bad)


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        resolve_backend(DeltaMatchConfig(backend="triton"), torch.device("cpu"))
    assert resolve_backend(DeltaMatchConfig(), torch.device("cpu")) == "reference"
    monkeypatch.setenv("HF_DELTAMATCH_BACKEND", "reference")
    assert DeltaMatchConfig(backend="triton").with_env_overrides().backend == "reference"


def test_torch_compile_traces_without_graph_breaks():
    q, k, v, do = make(1, 2, 2, 96, 96, 32, 32)
    eager = run_op(q, k, v, do, DeltaMatchConfig())

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v):
        return deltamatch_attention(q, k, v, causal=True, config=DeltaMatchConfig()).float()

    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = f(qq, kk, vv)
    out.backward(do.float())
    torch.testing.assert_close(out, eager[0].float(), rtol=0, atol=0)
    torch.testing.assert_close(qq.grad, eager[1], rtol=0, atol=0)


@pytest.mark.parametrize("delta", ["matching", "stale"])
def test_eager_path_is_the_custom_op(delta):
    """Eager calls skip torch.library's dispatch (attention._EagerAttention); the custom op, which torch.compile
    traces, must give the same bits, forward and backward, and keep the same tensors for the backward."""
    q, k, v, do = make(1, 4, 2, 80, 80, 32, 32, seed=3)
    cfg = DeltaMatchConfig(delta=delta)
    eager = run_op(q, k, v, do, cfg)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = torch.ops.hf_deltamatch.attention_forward(
        qq, kk, vv, True, 32 ** -0.5, None, None, None, cfg.precision, cfg.delta, cfg.block, cfg.scale_rounding,
        cfg.grad_format, "reference", cfg.deterministic)[0]
    out.backward(do)
    for a, b in zip(eager, (out.detach(), qq.grad, kk.grad, vv.grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_quantization_tiles_and_scales():
    x = torch.randn(1, 1, 200, 32)
    x[0, 0, 130] *= 100  # an outlier only affects its own tile
    x8, scale = reference.quantize_tokens(x, 128)
    assert scale.shape == (1, 1, 200)
    assert (scale[0, 0, :128] == scale[0, 0, 0]).all() and (scale[0, 0, 128:] == scale[0, 0, 128]).all()
    torch.testing.assert_close(scale[0, 0, 0], x[0, 0, :128].abs().max() / 448)
    assert x8.float().abs().max() == 448  # the absmax maps to fmax exactly
    err = (x8.float() * scale[..., None] - x).abs() / x.abs().clamp_min(1e-3)
    assert err[x.abs() > scale[..., None] * 2**-6].max() <= 2**-4 + 1e-6  # e4m3 rounding, normal range
    _, pow2 = reference.quantize_tokens(x, 64, rounding="pow2")
    assert (torch.log2(pow2) == torch.log2(pow2).round()).all()
    zeros8, zscale = reference.quantize_tokens(torch.zeros(1, 1, 64, 16), 64)
    assert (zscale == 1).all() and (zeros8.float() == 0).all()
    assert reference.to_fp8(torch.tensor([1e9, -1e9]), "e4m3").float().tolist() == [448.0, -448.0]


def test_lse_is_returned_with_its_value():
    q, k, v, _ = make(1, 2, 2, 64, 64, 32, 32)
    out, lse = deltamatch_attention(q, k, v, return_lse=True)
    # fp8 q and k perturb each score by up to ~2^-4 relative: lse moves by a few hundredths
    torch.testing.assert_close(lse, exact_lse(q, k), atol=0.2, rtol=0)


def exact_lse(q, k):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    keep = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return torch.logsumexp(s.masked_fill(~keep, float("-inf")), dim=-1).float()
