"""The FP8 contract itself: the reference backend against tests/_fp8_oracle.py, a float64 oracle written from
docs/numerics.md (each operand quantized as the document specifies, every product and sum after that in float64).

The op runs on fp32 tensors holding bf16 values (the custom op takes them; its output is then fp32, not rounded to
bf16), so everything but fp32 arithmetic is the contract's: out, lse, dq, dk, dv and d sinks agree with the oracle
to ~1e-7 (measured 1e-8 to 7e-7 on these cases), bounded at 1e-6 relative, plus the oracle's flip budget (where an
fp32 rounding may put a value on the other side of an FP8 rounding tie, _fp8_oracle's docstring: two cases hold one
such flip, dq/dk 5.5e-4 ("full", matching) and 2.1e-4 ("sinks", matching), within budgets of 2e-3). A quantization
error (e5m2 for P, a scale off by a factor, a tile misplaced by one token) or a formula error (stale delta,
the sink missing from the LSE) moves them by 1e-3 to 1e-1.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention, reference
from hf_deltamatch.testing import assert_rel_close, rel_err

sys.path.insert(0, os.path.dirname(__file__))
import _fp8_oracle as oracle  # noqa: E402

CONTRACT_TOL = 1e-6  # fp32 rounding against float64 (measured <= 5e-7), relative, plus the flip budget
BUDGET_MAX = 5e-3  # a case whose flip budget exceeds this would no longer tell a 1e-2 error from flips


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# (B, Hq, Hkv, N, M, Dqk, Dv) and options: every case holds at least one tile boundary of q and of k
CASES = {
    "causal": dict(shape=(1, 2, 2, 150, 150, 32, 32)),
    "full": dict(shape=(1, 2, 2, 150, 150, 32, 32), causal=False),
    "N<M block 64": dict(shape=(1, 2, 2, 40, 200, 32, 32), block=64),
    "N>M: rows without keys": dict(shape=(1, 2, 2, 100, 30, 32, 32)),
    "gqa B=2": dict(shape=(2, 4, 2, 130, 130, 32, 32)),
    "mqa dqk 48 != dv 32": dict(shape=(1, 3, 1, 130, 130, 48, 32)),
    "window block 64": dict(shape=(1, 2, 2, 200, 200, 32, 32), window=40, block=64),
    "varlen": dict(shape=(1, 2, 1, 260, 260, 32, 32), lens=([70, 1, 129, 60], None)),
    "varlen q != k lengths": dict(shape=(1, 2, 2, 61, 300, 32, 32), lens=([10, 50, 1], [100, 50, 150])),
    "sinks": dict(shape=(1, 4, 2, 150, 150, 32, 32), sinks=True),
    "sinks varlen window": dict(shape=(1, 2, 2, 200, 200, 32, 32), sinks=True, window=40, lens=([130, 70], None)),
    "sinks N>M full": dict(shape=(1, 2, 2, 90, 40, 32, 32), sinks=True, causal=False),
    "e5m2 gradients, pow2 scales": dict(shape=(1, 2, 2, 150, 150, 32, 32), grad_format="e5m2",
                                        scale_rounding="pow2"),
}


def _inputs(case, seed=0, dtype=torch.float32):
    c = CASES[case]
    B, Hq, Hkv, N, M, Dqk, Dv = c["shape"]
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(dtype)  # noqa: E731  bf16 values
    q, k, v, do = mk(B, Hq, N, Dqk), mk(B, Hkv, M, Dqk), mk(B, Hkv, M, Dv), mk(B, Hq, N, Dv)
    # sinks of about log(M): the sink takes a share of each row comparable to the keys'
    sinks = math.log(M) - 1.0 + 2.0 * torch.randn(Hq, generator=g) if c.get("sinks") else None
    kw = dict(causal=c.get("causal", True), window=c.get("window"))
    if "lens" in c:
        lq, lk = c["lens"]
        kw["cu_seqlens_q"], kw["cu_seqlens_k"] = _cu(lq), _cu(lk if lk is not None else lq)
    cfg = dict(block=c.get("block", 128), grad_format=c.get("grad_format", "e4m3"),
               scale_rounding=c.get("scale_rounding", "fp32"))
    return (q, k, v, do, sinks), kw, cfg


def _op(q, k, v, do, sinks, kw, cfg, delta, backend="reference"):
    """The custom op (what deltamatch_attention calls, fp32 inputs allowed) forward and backward; with the quantized
    operands and per-token scales it saves for the backward."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_() if sinks is not None else None
    out, lse, *saved = torch.ops.hf_deltamatch.attention_forward(
        *leaves, kw["causal"], q.shape[-1] ** -0.5, kw["window"], kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k"),
        "fp8", delta, cfg["block"], cfg["scale_rounding"], cfg["grad_format"], backend, False, s)
    out.backward(do)
    return dict(out=out.detach(), lse=lse, dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad,
                dsinks=None if s is None else s.grad, saved=saved)


def _check_saved(saved, q, k, v, kw, cfg):
    """q8, k8, v8 and their per-token scales, bit for bit the oracle's quantization (e4m3, tiles from each
    sequence's first token), on every token inside a sequence."""
    cu_q, cu_k = kw.get("cu_seqlens_q"), kw.get("cu_seqlens_k")
    segs_q = [(0, q.shape[2])] if cu_q is None else list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:]))
    segs_k = [(0, k.shape[2])] if cu_k is None else list(zip(cu_k.tolist()[:-1], cu_k.tolist()[1:]))
    for name, x, x8, sx, segs in (("q", q, saved[0], saved[3], segs_q), ("k", k, saved[1], saved[4], segs_k),
                                  ("v", v, saved[2], saved[5], segs_k)):
        assert x8.dtype == torch.float8_e4m3fn and sx.dtype == torch.float32, name
        for b in range(x.shape[0]):
            for h in range(x.shape[1]):
                for a, e in segs:
                    if e > a:
                        want8, want_s = oracle.quantize(x[b, h, a:e], cfg["block"], "e4m3", cfg["scale_rounding"])
                        assert torch.equal(x8[b, h, a:e].double(), want8), (name, b, h, a)
                        assert torch.equal(sx[b, h, a:e].double(), want_s), (name, b, h, a)


def _oracle(q, k, v, do, sinks, kw, cfg, delta, out):
    return oracle.attention(q, k, v, do, sinks=sinks, delta=delta, out=out, **kw, **cfg)


def _check(got, want, tol=CONTRACT_TOL, names=("out", "dq", "dk", "dv")):
    for name in names:
        allowance = want["budget"].get(name, 0.0) / want[name].norm().clamp_min(1e-300).item()
        assert allowance <= BUDGET_MAX, (name, allowance)
        assert_rel_close(name, want[name], got[name], tol + allowance)
    fin = torch.isfinite(want["lse"])
    assert torch.equal(torch.isfinite(got["lse"]), fin)  # -inf exactly where a row sees no key (and no sink)
    assert ((got["lse"].double() - want["lse"])[fin].abs() <= 1e-6 * (1 + want["lse"][fin].abs())).all()
    if want["dsinks"] is not None:  # d s_h sums terms of both signs: relative to sum_i |P_i,sink delta_i|
        assert ((got["dsinks"].double() - want["dsinks"]).abs() <= 1e-6 * want["dsinks_scale"]).all(), \
            (got["dsinks"], want["dsinks"])


@pytest.mark.parametrize("delta", ["matching", "stale"])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_is_the_contract(case, delta):
    (q, k, v, do, sinks), kw, cfg = _inputs(case)
    got = _op(q, k, v, do, sinks, kw, cfg, delta)
    _check_saved(got["saved"], q, k, v, kw, cfg)
    want = _oracle(q, k, v, do, sinks, kw, cfg, delta, got["out"])
    _check(got, want)


@pytest.mark.parametrize("case", ["causal", "gqa B=2", "varlen q != k lengths", "sinks varlen window"])
def test_reference_delta_is_the_contracts(case):
    """The delta dS is formed with (what d s_h and the dS row sums read), both modes, against the oracle's: matching
    sum_j P_ij dP_ij from unquantized P and the FP8 operands' dP, stale dot(dO_i, O_i)."""
    (q, k, v, do, sinks), kw, cfg = _inputs(case)
    config = DeltaMatchConfig(**cfg)
    args = dict(causal=kw["causal"], softmax_scale=q.shape[-1] ** -0.5, window=kw["window"],
                cu_seqlens_q=kw.get("cu_seqlens_q"), cu_seqlens_k=kw.get("cu_seqlens_k"))
    deltas = {}
    for delta in ("matching", "stale"):
        out, lse, *saved = reference.forward(q, k, v, **args, config=config.replace(delta=delta))
        if sinks is not None:
            out, lse = reference.apply_sinks(out, lse, sinks)
        got = reference.backward(do, None, None, None, out, lse, *saved, **args, config=config.replace(delta=delta),
                                 return_delta=True)[-1]
        want = _oracle(q, k, v, do, sinks, kw, cfg, delta, out)["delta"]
        assert_rel_close(f"delta ({delta})", want, got, CONTRACT_TOL)
        deltas[delta] = want
    # the two deltas differ by the FP8 error of delta (percents): the comparison above can tell them apart
    assert rel_err(deltas["matching"], deltas["stale"]) > 100 * CONTRACT_TOL


@pytest.mark.parametrize("delta", ["matching", "stale"])
@pytest.mark.parametrize("case", ["sinks", "varlen q != k lengths"])
def test_public_op_in_bf16_is_the_contract_rounded_to_bf16(case, delta):
    """deltamatch_attention itself (bf16 in and out, its eager autograd path): the contract's values rounded once to
    bf16, at most 2^-9 relative on each element; measured 1.6e-3 to 1.7e-3 on the gradients, bounded at 2^-8 (out:
    the oracle rounds it to bf16 too, measured 0)."""
    (q, k, v, do, sinks), kw, cfg = _inputs(case, seed=1, dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = sinks.clone().requires_grad_() if sinks is not None else None
    config = DeltaMatchConfig(delta=delta, backend="reference", **cfg)
    out = deltamatch_attention(*leaves, sinks=s, config=config, **kw)
    out.backward(do)
    got = dict(out=out.detach(), dq=leaves[0].grad, dk=leaves[1].grad, dv=leaves[2].grad)
    want = _oracle(q, k, v, do, sinks, kw, cfg, delta, got["out"])
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.bfloat16
        allowance = want["budget"].get(name, 0.0) / want[name].norm().item()
        assert_rel_close(name, want[name], got[name], 2.0 ** -8 + allowance)
    if s is not None:
        assert ((s.grad.double() - want["dsinks"]).abs() <= 2.0 ** -8 * want["dsinks_scale"]).all()


def test_triton_kernels_are_the_contract():
    """The kernels under the interpreter (bf16 in and out) against the oracle directly, not only against the
    reference: GQA, a causal window, two key tiles of 64, sinks; their saved q8/k8/v8 and scales bit for bit.
    Bounded as the bf16 test above."""
    pytest.importorskip("hf_deltamatch.kernels")
    if torch.cuda.is_available():
        pytest.skip("on a GPU the FP8 MMA accumulates with reduced precision: tests/test_kernels_gpu.py")
    B, Hq, Hkv, N, D = 1, 4, 2, 130, 32
    g = torch.Generator().manual_seed(2)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    q, k, v, do = mk(B, Hq, N, D), mk(B, Hkv, N, D), mk(B, Hkv, N, D), mk(B, Hq, N, D)
    sinks = math.log(N) - 1.0 + 2.0 * torch.randn(Hq, generator=g)
    kw, cfg = dict(causal=True, window=90), dict(block=64, grad_format="e4m3", scale_rounding="fp32")
    got = _op(q, k, v, do, sinks, kw, cfg, "matching", backend="triton")
    _check_saved(got["saved"], q, k, v, kw, cfg)
    want = oracle.attention(q, k, v, do, sinks=sinks, out=got["out"], **kw, **cfg)
    for name in ("out", "dq", "dk", "dv"):
        assert got[name].dtype == torch.bfloat16
        allowance = want["budget"].get(name, 0.0) / want[name].norm().item()
        assert_rel_close(name, want[name], got[name], 2.0 ** -8 + allowance)
    assert ((got["dsinks"].double() - want["dsinks"]).abs() <= 2.0 ** -8 * want["dsinks_scale"]).all()


# ----------------------------------------------------------------------------------------------------
# The oracle's own pieces, against independent implementations
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_oracle_rounding_is_torchs_fp8_cast(fmt, dtype):
    """round_fp8 (the oracle's own arithmetic) against torch's FP8 casts: every FP8 value, the midpoints between
    neighbours (ties, to even), points just off them, and random values over the whole range."""
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20),
                   torch.randn(20000, generator=torch.Generator().manual_seed(0)).double()
                   * torch.exp2(torch.randint(-20, 17, (20000,), generator=torch.Generator().manual_seed(1)))])
    fmax = oracle.FMT[fmt]["fmax"]
    x = x.clamp(-fmax, fmax).float().double()  # torch casts from fp32: values it can hold
    want = x.float().to(dtype).double()
    assert torch.equal(oracle.round_fp8(x, fmt), want)


def test_oracle_tile_scales_follow_the_document():
    """amax / fmax in fp32, floored at 2^-126; pow2 rounds up to a power of two; a zero tile has scale 1."""
    amax = torch.tensor([448.0, 1.0, 0.0, 1e-40, 3.0], dtype=torch.float64)
    s = oracle.tile_scale(amax, "e4m3", "fp32")
    assert s.tolist()[:3] == [1.0, torch.tensor(1 / 448, dtype=torch.float32).item(), 1.0]
    assert s[3] == 2.0 ** -126 and s[4] == torch.tensor(3 / 448, dtype=torch.float32).item()
    p = oracle.tile_scale(amax, "e4m3", "pow2")
    assert p.tolist() == [1.0, 2.0 ** -8, 1.0, 2.0 ** -126, 2.0 ** -7]
