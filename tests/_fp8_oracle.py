"""The FP8 contract of docs/numerics.md in float64, written from the document (not from hf_deltamatch.reference).

Every operand is quantized as the document specifies (tile scales in fp32, round-to-nearest-even onto the e4m3 or
e5m2 grid by this file's own arithmetic, not torch's FP8 casts); every product and sum after that is float64. Rows
are computed one (batch, head, sequence) at a time with whole matrices: small problems only.

What a backend computes in fp32 differs from this by fp32 rounding (~1e-7), except where an fp32 difference moves a
value to the other side of an FP8 rounding tie (a "flip": one element one FP8 step apart). The oracle finds every
rounding it did within `TIE_MARGIN` (relative to the magnitude the fp32 error scales with) of a tie and returns, per
output, the sum of the norms of what flipping each of them would change (`budget`): a backend agrees with the oracle
to `1e-6 * norm + budget`. On the small problems of tests/test_fp8_contract.py that is 2 to 80 near ties and budgets
up to ~5e-3 of the norm, while the flips that really happen are rarer (two in its 26 cases).
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64
FMT = {"e4m3": dict(mbits=3, emin=-6, fmax=448.0), "e5m2": dict(mbits=2, emin=-14, fmax=57344.0)}
P_SCALE = 256.0  # "P: static scale, P8 = to_e4m3(P * 256)"
DS_ROWS = 64  # "DS_TILE_Q = 64 query rows x T key columns"
FP32_TINY = 2.0 ** -126  # "2^-126 is the smallest normal fp32 value"
# How far an fp32 backend's value of a rounded quantity may be from its float64 value, relative to P (for P8) or to
# P (|dP| + sum_j P |dP|) (for dS8, which cancels): measured at most 8.5e-7 and 5.8e-7 (reference, gaussian inputs,
# exp arguments up to ~10); 2^-19 = 1.9e-6 is twice that.
TIE_MARGIN = 2.0 ** -19


def _quantum(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The FP8 grid spacing at x: 2^(max(e, emin) - mbits), e = floor(log2 |x|)."""
    f = FMT[fmt]
    e = torch.frexp(x.abs().clamp_min(1e-300))[1].to(F64) - 1  # |x| = m 2^(e+1), m in [0.5, 1)
    return torch.exp2(e.clamp_min(f["emin"]) - f["mbits"])


def round_fp8(x: torch.Tensor, fmt: str, uncertainty: torch.Tensor | None = None):
    """(x clamped to +-fmax, rounded to the nearest FP8 value, ties to even; float64 in and out), and where
    `uncertainty` (same shape: how far an fp32 computation of x may be from this float64 x) is given, the boolean
    tensor of the values that lie closer than that to a rounding tie, and the size of the step a flip would make."""
    f = FMT[fmt]
    x = x.clamp(-f["fmax"], f["fmax"])
    q = _quantum(x, fmt)
    r = torch.round(x / q) * q  # x / q is exact (q a power of two); torch.round rounds half to even
    if uncertainty is None:
        return r
    frac = (x / q) - torch.floor(x / q)  # in [0, 1): a tie at 0.5
    near = ((frac - 0.5).abs() * q < uncertainty) & (x.abs() < f["fmax"])
    return r, near, q


def tile_scale(amax: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """scale = max(amax / fmax, 2^-126) in fp32 (pow2: rounded up to a power of two); 1 for a tile of zeros."""
    s = (amax / FMT[fmt]["fmax"]).to(torch.float32).to(F64).clamp_min(FP32_TINY)
    if rounding == "pow2":
        m, e = torch.frexp(s)
        s = torch.where(m == 0.5, s, torch.ldexp(torch.ones_like(s), e))
    return torch.where(amax > 0, s, torch.ones_like(s))


def _fp32(x: torch.Tensor) -> torch.Tensor:
    """x / scale as the quantization computes it: in fp32, rounded once before the FP8 rounding. The exact quotient
    of a bf16 value and an fp32 scale can lie within 2^-24 of an FP8 tie (x = 3/8 amax: 168.0000048, between 160 and
    176): fp32 makes it the tie, which rounds to even (160), where the exact quotient would round up (176). A float64
    division rounded to fp32 is the correctly rounded fp32 division (53 >= 2 * 24 + 2 bits)."""
    return x.to(torch.float32).to(F64)


def quantize(x: torch.Tensor, block: int, fmt: str, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (tokens, D) of one sequence, one head: tiles of `block` tokens from the first. Returns (x8, scale): the FP8
    values (float64) and each token's tile scale, as the backends store them."""
    x = x.to(F64)
    x8, scale = torch.empty_like(x), torch.empty(x.shape[0], dtype=F64)
    for t0 in range(0, x.shape[0], block):
        tile = x[t0:t0 + block]
        s = tile_scale(tile.abs().max(), fmt, rounding)
        x8[t0:t0 + block], scale[t0:t0 + block] = round_fp8(_fp32(tile / s), fmt), s
    return x8, scale


def quantize_tokens(x: torch.Tensor, block: int, fmt: str, rounding: str) -> torch.Tensor:
    """x8 * scale (quantize's), the value every matmul sees."""
    x8, scale = quantize(x, block, fmt, rounding)
    return x8 * scale[:, None]


def visible(n: int, m: int, causal: bool, window: int | None) -> torch.Tensor:
    """(n, m): query i sits at key position i + m - n; causal: j <= that; window w: also j > that - w."""
    pos = torch.arange(n)[:, None] + (m - n)
    j = torch.arange(m)[None, :]
    keep = torch.ones(n, m, dtype=torch.bool)
    if causal:
        keep = j <= pos
        if window is not None:
            keep = keep & (j > pos - window)
    return keep


class _Budget:
    """Sum of the norms of the changes a flip of each near-tie rounding would make, per output."""

    def __init__(self):
        self.total = {}
        self.flips = 0

    def add(self, name: str, norms: torch.Tensor):
        self.total[name] = self.total.get(name, 0.0) + norms.sum().item()
        self.flips += int((norms > 0).sum())


def _forward_one(q8, k8, v8, keep, softmax_scale, block, budget):
    """One head of one sequence. q8 (n, D), k8, v8 (m, D) dequantized float64. Returns (out, lse) float64."""
    n, m = keep.shape
    s_all = (q8 @ k8.T) * softmax_scale
    s_all = s_all.masked_fill(~keep, -math.inf)
    m_run = torch.full((n,), -math.inf, dtype=F64)
    acc = torch.zeros(n, v8.shape[1], dtype=F64)
    l = torch.zeros(n, dtype=F64)
    flips = []  # (J, near, step) of each key tile: their effect needs the final max and l
    for j0 in range(0, m, block):  # the key tiles J, in order
        s = s_all[:, j0:j0 + block]
        m_new = torch.maximum(m_run, s.max(dim=1).values)
        alive = m_new > -math.inf
        m_safe = torch.where(alive, m_new, 0.0)
        pt = torch.where(alive[:, None], torch.exp(s - m_safe[:, None]), 0.0)
        corr = torch.where(alive, torch.exp(torch.where(alive, m_run, 0.0) - m_safe), 0.0)
        corr = torch.where(m_run > -math.inf, corr, 0.0)  # nothing accumulated yet
        p8, near, step = round_fp8(pt * P_SCALE, "e4m3", uncertainty=pt * P_SCALE * TIE_MARGIN)
        acc = acc * corr[:, None] + (p8 @ v8[j0:j0 + block]) / P_SCALE
        l = l * corr + pt.sum(dim=1)  # unquantized P in the row sum
        flips.append((j0, near, step, m_safe.clone()))
        m_run = m_new
    sees = keep.any(dim=1)
    out = torch.where(sees[:, None], acc / torch.where(sees, l, 1.0)[:, None], 0.0)
    lse = torch.where(sees, m_run + torch.log(torch.where(sees, l, 1.0)), -math.inf)
    for j0, near, step, m_at in flips:  # a P8 element one step off moves out_i by step/256 * w_i * v_j / l_i
        if near.any():
            w = torch.where(sees, torch.exp(m_at - torch.where(sees, m_run, 0.0)) / torch.where(sees, l, 1.0), 0.0)
            i, j = near.nonzero(as_tuple=True)
            budget.add("out", step[i, j] / P_SCALE * w[i] * v8[j0 + j].norm(dim=1))
    return out, lse


def _backward_one(q8, k8, v8, do8, do, out, lse, keep, softmax_scale, block, delta_mode, grad_format, rounding,
                  budget, head_budget_scale=1.0):
    """One head of one sequence. Returns (dq, dk, dv, delta) float64 (dk, dv for this query head)."""
    n, m = keep.shape
    alive = lse > -math.inf
    s = ((q8 @ k8.T) * softmax_scale).masked_fill(~keep, -math.inf)
    p = torch.where(alive[:, None], torch.exp(s - torch.where(alive, lse, 0.0)[:, None]), 0.0)  # unquantized
    dp = do8 @ v8.T
    if delta_mode == "matching":
        delta = (p * dp).sum(dim=1)  # over ALL key tiles
        delta_mag = (p * dp.abs()).sum(dim=1)
    else:
        delta = (do * out).sum(dim=1)  # dot(dO_i, O_i) from the unquantized dO and the op's output
        delta_mag = (do * out).abs().sum(dim=1)
    delta = torch.where(alive, delta, 0.0)
    ds = p * (dp - delta[:, None])
    ds_mag = p * (dp.abs() + delta_mag.abs()[:, None])  # what an fp32 dS's error scales with
    p8, near_p, step_p = round_fp8(p * P_SCALE, "e4m3", uncertainty=p * P_SCALE * TIE_MARGIN)
    p8 = p8 / P_SCALE
    dv = p8.T @ do8
    if near_p.any():
        i, j = near_p.nonzero(as_tuple=True)
        budget.add("dv", step_p[i, j] / P_SCALE * do8[i].norm(dim=1))
    ds8 = torch.zeros_like(ds)
    for i0 in range(0, n, DS_ROWS):  # dS tiles: 64 query rows x `block` key columns, one scale each
        for j0 in range(0, m, block):
            t = ds[i0:i0 + DS_ROWS, j0:j0 + block]
            mag = ds_mag[i0:i0 + DS_ROWS, j0:j0 + block]
            top = t.abs().argmax()
            sds = tile_scale(t.abs().flatten()[top], grad_format, rounding)
            # an fp32 dS is off by ~1e-7 of its uncancelled magnitude; so is the amax, which moves every dS8
            amax_unc = (mag.flatten()[top] / t.abs().flatten()[top].clamp_min(1e-300)).item() * TIE_MARGIN
            unc = (mag * TIE_MARGIN + t.abs() * (amax_unc + 2.0 ** -22)) / sds
            r, near, step = round_fp8(_fp32(t / sds), grad_format, uncertainty=unc)
            ds8[i0:i0 + DS_ROWS, j0:j0 + block] = r * sds
            if near.any():
                i, j = near.nonzero(as_tuple=True)
                size = step[i, j] * sds * softmax_scale
                budget.add("dq", size * k8[j0 + j].norm(dim=1))
                budget.add("dk", size * q8[i0 + i].norm(dim=1))
    dq = (ds8 @ k8) * softmax_scale
    dk = (ds8.T @ q8) * softmax_scale
    return dq, dk, dv, delta


def attention(q, k, v, do, *, causal=True, window=None, softmax_scale=None, cu_seqlens_q=None, cu_seqlens_k=None,
              sinks=None, block=128, delta="matching", grad_format="e4m3", scale_rounding="fp32", out=None):
    """The FP8 contract (precision="fp8") in float64.

    q (B, Hq, N, Dqk), k (B, Hkv, M, Dqk), v (B, Hkv, M, Dv), do (B, Hq, N, Dv), any float dtype (their values are
    the inputs; the dtype is the "input dtype" the output is rounded to). sinks: (Hq,) logits or None.
    out: the op's output, which delta="stale" reads (dot(dO_i, O_i)); by default this oracle's own, rounded to the
    input dtype.

    Returns a dict of float64 tensors: out, lse, dq, dk, dv, delta (B, Hq, N), dsinks (or None), and
    `budget` (a dict: output name -> flip allowance, see the module docstring) and `flips` (how many near ties).
    """
    B, Hq, N, _ = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    groups = Hq // Hkv
    dtype = q.dtype
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    qd, kd, vd, dod = (t.detach().to(F64) for t in (q, k, v, do))
    if cu_seqlens_q is None:
        segs = [(0, N, 0, M)]
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        segs = list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))
    res = {name: torch.zeros(B, Hq, N, d, dtype=F64) for name, d in (("out", v.shape[-1]), ("dq", q.shape[-1]))}
    res["dk"] = torch.zeros(B, Hkv, M, k.shape[-1], dtype=F64)
    res["dv"] = torch.zeros(B, Hkv, M, v.shape[-1], dtype=F64)
    res["lse"] = torch.full((B, Hq, N), -math.inf, dtype=F64)
    res["delta"] = torch.zeros(B, Hq, N, dtype=F64)
    budget = _Budget()

    def quant(x, fmt):  # per sequence: tiles start at its first token
        return quantize_tokens(x, block, fmt, scale_rounding)

    for b in range(B):
        for q0, q1, k0, k1 in segs:
            n, m = q1 - q0, k1 - k0
            if n == 0:
                continue
            keep = visible(n, m, causal, window)
            k8 = [quant(kd[b, g, k0:k1], "e4m3") for g in range(Hkv)] if m else None
            v8 = [quant(vd[b, g, k0:k1], "e4m3") for g in range(Hkv)] if m else None
            for h in range(Hq):
                g = h // groups  # query head h reads KV head h // (Hq // Hkv)
                if m == 0:
                    continue
                q8 = quant(qd[b, h, q0:q1], "e4m3")
                o, lse = _forward_one(q8, k8[g], v8[g], keep, scale, block, budget)
                o = o.to(dtype).to(F64)  # "out in the input dtype"
                if sinks is not None:  # LSE' = logaddexp(LSE, s_h), O' = O exp(LSE - LSE'), rounded once more
                    s_h = torch.tensor(float(sinks[h]), dtype=F64)
                    lse_s = torch.logaddexp(lse, s_h.expand_as(lse))
                    o = (o * torch.exp(lse - lse_s)[:, None]).to(dtype).to(F64)
                    lse = lse_s
                res["out"][b, h, q0:q1], res["lse"][b, h, q0:q1] = o, lse
                o_for_delta = o if out is None else out[b, h, q0:q1].detach().to(F64)
                do8 = quant(dod[b, h, q0:q1], grad_format)
                # rows that see no key have LSE -inf without sinks, s_h with: either way P = 0 on every key
                lse_bwd = torch.where(keep.any(dim=1), lse, -math.inf)
                dq, dk, dv, dl = _backward_one(q8, k8[g], v8[g], do8, dod[b, h, q0:q1], o_for_delta, lse_bwd, keep,
                                               scale, block, delta, grad_format, scale_rounding, budget)
                res["dq"][b, h, q0:q1] = dq
                res["dk"][b, g, k0:k1] += dk  # GQA: a KV head's gradients sum over its query heads
                res["dv"][b, g, k0:k1] += dv
                res["delta"][b, h, q0:q1] = dl
    res["dsinks"] = None
    if sinks is not None:  # d s_h = -sum_{b,i} P_i,sink delta_i, with the delta dS was formed with
        p_sink = torch.exp(sinks.detach().to(F64).view(1, -1, 1) - res["lse"])
        res["dsinks"] = -(p_sink * res["delta"]).sum(dim=(0, 2))
        res["dsinks_scale"] = (p_sink * res["delta"]).abs().sum(dim=(0, 2))
    res["budget"] = budget.total
    res["flips"] = budget.flips
    return res
