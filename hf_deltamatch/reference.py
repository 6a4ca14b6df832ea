"""The numerical contract (docs/numerics.md) in plain PyTorch: the CPU path and the kernels' oracle.

Runs on any device. Work is tiled over queries (and vectorized over key tiles) so memory stays
O(N * tile) rather than O(N^2): an 8K-token sequence runs on a CPU.
"""

from __future__ import annotations

import math

import torch

from . import _varlen
from .config import DeltaMatchConfig

FP8_DTYPE = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
P_SCALE = 256.0  # static scale of P in [0, 1] before its e4m3 cast (the FA3/cuDNN value)
DS_TILE_Q = 64  # query rows per dS quantization tile (x `block` key columns)
_FWD_TILE_Q = 128  # query rows per step of the forward (rows are independent: any value is exact)


# ----------------------------------------------------------------------------------------------------
# Quantization
# ----------------------------------------------------------------------------------------------------


# The smallest normal fp32 value: no scale is below it, so 1 / scale is finite (kernels._fp8.SCALE_FLOOR)
SCALE_FLOOR = torch.finfo(torch.float32).tiny


def tile_scale(amax: torch.Tensor, fmt: str, rounding: str) -> torch.Tensor:
    """fp32 scale of a tile from its absolute maximum: max(amax / fmax, SCALE_FLOOR), optionally rounded up to a
    power of two; 1 for an all-zero tile."""
    scale = (amax.float() / FP8_MAX[fmt]).clamp_min(SCALE_FLOOR)
    if rounding == "pow2":
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def to_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of fp32 values to FP8 (torch's cast turns overflow into NaN)."""
    fmax = FP8_MAX[fmt]
    return x.clamp(-fmax, fmax).to(FP8_DTYPE[fmt])


def quantize_tokens(x: torch.Tensor, block: int, fmt: str = "e4m3", rounding: str = "fp32"):
    """Quantize (..., N, D) in tiles of `block` tokens x the whole head dim, counted from token 0.

    Returns (x8 (..., N, D) in FP8, scale (..., N) fp32 with every token carrying its tile's scale).
    """
    *lead, n, d = x.shape
    n_tiles = max(1, math.ceil(n / block))
    xf = x.float()
    if n_tiles * block != n:
        xf = torch.nn.functional.pad(xf, (0, 0, 0, n_tiles * block - n))
    xf = xf.reshape(*lead, n_tiles, block, d)
    # non-finite values: left out of the scale, stored as NaN (docs/numerics.md "Non-finite inputs")
    finite = torch.isfinite(xf)
    scale = tile_scale(torch.where(finite, xf.abs(), 0.0).amax(dim=(-1, -2)), fmt, rounding)
    x8 = to_fp8(torch.where(finite, xf / scale[..., None, None], math.nan), fmt)
    x8 = x8.reshape(*lead, n_tiles * block, d)[..., :n, :]
    return x8, scale.repeat_interleave(block, dim=-1)[..., :n]


def _quantize_ds(ds: torch.Tensor, fmt: str, rounding: str):
    """dS of shape (B, H, rows, nK, T): one scale per (row tile, key tile). Returns (dS8 as fp32, scale).

    The tile's absmax skips NaN entries, as the kernels' max does (PTX max.f32).
    """
    scale = tile_scale(torch.where(ds.isnan(), 0.0, ds.abs()).amax(dim=(2, 4)), fmt, rounding)  # (B, H, nK)
    ds8 = to_fp8(ds / scale[:, :, None, :, None], fmt)
    return ds8.float(), scale


# ----------------------------------------------------------------------------------------------------
# One group of sequences with the same lengths (a dense batch, or one sequence of a varlen batch)
# ----------------------------------------------------------------------------------------------------


class _Operands:
    """fp32 views of the matmul operands and their per-token scales, GQA heads expanded."""

    def __init__(self, q, k, v, q_scale, k_scale, v_scale, cfg: DeltaMatchConfig, dtype):
        groups = q.shape[1] // k.shape[1]
        self.q = q.float()
        self.k = k.float().repeat_interleave(groups, dim=1)
        self.v = v.float().repeat_interleave(groups, dim=1)
        self.sq = q_scale
        self.sk = k_scale.repeat_interleave(groups, dim=1)
        self.sv = v_scale.repeat_interleave(groups, dim=1)
        self.groups = groups
        self.fp8 = cfg.precision == "fp8"
        self.dtype = dtype  # input dtype, the rounding of P and dS in bf16 mode

    def round_p(self, p: torch.Tensor) -> torch.Tensor:
        """P as the PV / P^T dO matmuls see it (divided back by the static scale, which is exact)."""
        if self.fp8:
            return to_fp8(p * P_SCALE, "e4m3").float() / P_SCALE
        return p.to(self.dtype).float()


def _visible(rows: torch.Tensor, n: int, m: int, causal: bool, window: int | None, device) -> torch.Tensor:
    """(rows, m) boolean mask of the keys each query row may see (bottom-right aligned)."""
    cols = torch.arange(m, device=device)
    pos = rows[:, None] + (m - n)
    keep = torch.ones(len(rows), m, dtype=torch.bool, device=device)
    if causal:
        keep &= cols[None, :] <= pos
        if window is not None:
            keep &= cols[None, :] > pos - window
    return keep


def _key_range(r0: int, r1: int, n: int, m: int, causal: bool, window: int | None, block: int):
    """Key tiles [lo, hi) that rows [r0, r1) can see; skipping the others is exact (docs/numerics.md)."""
    if not causal:
        return 0, m
    hi = min(m, r1 - 1 + m - n + 1)
    lo = 0 if window is None else max(0, r0 + m - n - window + 1)
    lo = (lo // block) * block
    hi = min(m, math.ceil(hi / block) * block) if hi > 0 else 0
    return lo, max(lo, hi)


def _scores(ops: _Operands, r0, r1, lo, hi, n, m, causal, window, softmax_scale):
    s = ops.q[:, :, r0:r1] @ ops.k[:, :, lo:hi].transpose(-1, -2)
    s = s * ops.sq[:, :, r0:r1, None] * ops.sk[:, :, None, lo:hi] * softmax_scale
    keep = _visible(torch.arange(r0, r1, device=s.device), n, m, causal, window, s.device)[:, lo:hi]
    return s.masked_fill(~keep, float("-inf"))


def _split_tiles(x: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    """(..., rows, cols) -> (..., rows, n_tiles, block), padding the last key tile with `fill`."""
    cols = x.shape[-1]
    n_tiles = math.ceil(cols / block)
    if n_tiles * block != cols:
        x = torch.nn.functional.pad(x, (0, n_tiles * block - cols), value=fill)
    return x.reshape(*x.shape[:-1], n_tiles, block)


def _pad_tokens(x: torch.Tensor, block: int) -> torch.Tensor:
    """(..., tokens, D) -> (..., n_tiles, block, D), zero-padded."""
    n = x.shape[-2]
    n_tiles = math.ceil(n / block)
    if n_tiles * block != n:
        x = torch.nn.functional.pad(x, (0, 0, 0, n_tiles * block - n))
    return x.reshape(*x.shape[:-2], n_tiles, block, x.shape[-1])


def _first_of_tile(scale: torch.Tensor, block: int) -> torch.Tensor:
    """Per-token scales (..., tokens) -> per-tile scales (..., n_tiles)."""
    return scale[..., ::block]


def _forward_group(ops: _Operands, n, m, causal, window, softmax_scale, block):
    B, H = ops.q.shape[:2]
    dv = ops.v.shape[-1]
    out = ops.q.new_zeros(B, H, n, dv)
    lse = ops.q.new_full((B, H, n), float("-inf"))
    for r0 in range(0, n, _FWD_TILE_Q):
        r1 = min(n, r0 + _FWD_TILE_Q)
        lo, hi = _key_range(r0, r1, n, m, causal, window, block)
        if hi <= lo:
            continue
        s = _split_tiles(_scores(ops, r0, r1, lo, hi, n, m, causal, window, softmax_scale), block, -math.inf)
        # running max after each key tile; NaN scores skipped (the kernels' max) but kept in P, so they reach out
        m_run = torch.cummax(torch.where(s.isnan(), -math.inf, s).amax(dim=-1), dim=-1).values
        alive = m_run > -math.inf  # +inf (bf16, an inf input): exp(inf - inf) = NaN below, as exact attention
        m_safe = torch.where(alive, m_run, torch.zeros_like(m_run))
        p = torch.exp(s - m_safe[..., None])  # 0 where masked; NaN where S is, also before the first finite score
        v_tiles = _pad_tokens(ops.v[:, :, lo:hi], block)
        sv = _first_of_tile(ops.sv[:, :, lo:hi], block)
        pv = torch.einsum("bhqkt,bhktd->bhqkd", ops.round_p(p), v_tiles) * sv[:, :, None, :, None]
        m_last = m_safe[..., -1:]
        w = torch.where(alive, torch.exp(m_safe - m_last), torch.zeros_like(m_safe))  # rescale to the final max
        acc = (pv * w[..., None]).sum(dim=-2)
        l = (p.sum(dim=-1) * w).sum(dim=-1)
        # a row that sees a key but got l = 0 (every visible score -inf: an inf input in bf16 mode) is NaN, as
        # exact attention's softmax; a NaN l (a NaN input) makes out and lse NaN by itself
        sees = torch.arange(r0, r1, device=s.device) + (m - n) >= 0 if causal else torch.ones_like(l, dtype=bool)
        out[:, :, r0:r1] = torch.where(sees[..., None], acc / l[..., None], 0.0)
        lse_rows = torch.where(l == 0, math.nan, m_last[..., 0] + torch.log(l))
        lse[:, :, r0:r1] = torch.where(sees, lse_rows, -math.inf)
    return out, lse


def _backward_group(ops: _Operands, do8, sdo, delta_stale, lse, n, m, causal, window, softmax_scale, cfg, dlse=None):
    block = cfg.block
    B, H = ops.q.shape[:2]
    dqk, dv = ops.q.shape[-1], ops.v.shape[-1]
    n_tiles = math.ceil(m / block)
    dq = ops.q.new_zeros(B, H, n, dqk)
    dk_tiles = ops.q.new_zeros(B, H, n_tiles, block, dqk)
    dv_tiles = ops.q.new_zeros(B, H, n_tiles, block, dv)
    row_sums = ops.q.new_zeros(B, H, n)  # sum_j dS_ij before quantization: the invariant, for diagnostics
    row_abs = ops.q.new_zeros(B, H, n)
    deltas = ops.q.new_zeros(B, H, n)  # the delta dS used (attention sinks' gradient)
    do = do8.float()
    for r0 in range(0, n, DS_TILE_Q):
        r1 = min(n, r0 + DS_TILE_Q)
        lo, hi = _key_range(r0, r1, n, m, causal, window, block)
        if hi <= lo:
            continue
        t0, t1 = lo // block, math.ceil(hi / block)
        s = _scores(ops, r0, r1, lo, hi, n, m, causal, window, softmax_scale)
        lse_rows = lse[:, :, r0:r1, None]
        alive = lse_rows != -math.inf  # -inf: no visible key (P = 0); NaN (a non-finite input): P NaN
        p = torch.where(alive, torch.exp(s - torch.where(alive, lse_rows, 0.0)), 0.0)
        dp = (do[:, :, r0:r1] @ ops.v[:, :, lo:hi].transpose(-1, -2)) * sdo[:, :, r0:r1, None]
        dp = dp * ops.sv[:, :, None, lo:hi]
        if cfg.delta == "matching":
            delta = (p * dp).sum(dim=-1, keepdim=True)  # the correction pass, over every visible key
        else:
            delta = delta_stale[:, :, r0:r1, None]
        if dlse is not None:  # d LSE_i / d S_ij = P_ij: the LSE's gradient joins dS as a shift of delta
            delta = delta - torch.where(alive, dlse[:, :, r0:r1, None], 0.0)
        ds = p * (dp - delta)
        deltas[:, :, r0:r1] = delta[..., 0]
        row_sums[:, :, r0:r1] = ds.sum(dim=-1)
        row_abs[:, :, r0:r1] = ds.abs().sum(dim=-1)
        ds = _split_tiles(ds, block, 0.0)  # (B, H, rows, nK, T)
        if ops.fp8:
            ds_q, sds = _quantize_ds(ds, cfg.grad_format, cfg.scale_rounding)
        else:
            ds_q, sds = ds.to(ops.dtype).float(), ds.new_ones(B, H, ds.shape[3])
        p_q = _split_tiles(ops.round_p(p), block, 0.0)
        sdo_tile = sdo[:, :, r0, None, None, None]  # one dO tile spans these rows (DS_TILE_Q divides block)
        sq_tile = ops.sq[:, :, r0, None, None, None]
        dv_tiles[:, :, t0:t1] += torch.einsum("bhqkt,bhqd->bhktd", p_q, do[:, :, r0:r1]) * sdo_tile
        dk_tiles[:, :, t0:t1] += (
            torch.einsum("bhqkt,bhqd->bhktd", ds_q, ops.q[:, :, r0:r1]) * sds[..., None, None] * sq_tile
        ) * softmax_scale
        k_tiles = _pad_tokens(ops.k[:, :, lo:hi], block)
        sk = _first_of_tile(ops.sk[:, :, lo:hi], block)
        dq[:, :, r0:r1] = torch.einsum("bhqkt,bhktd->bhqd", ds_q * (sds * sk)[:, :, None, :, None], k_tiles)
        dq[:, :, r0:r1] *= softmax_scale
    dk = dk_tiles.reshape(B, H, n_tiles * block, dqk)[:, :, :m]
    dv_ = dv_tiles.reshape(B, H, n_tiles * block, dv)[:, :, :m]
    if ops.groups > 1:  # GQA: a KV head's gradient sums over its query heads
        dk = dk.reshape(B, H // ops.groups, ops.groups, m, dqk).sum(dim=2)
        dv_ = dv_.reshape(B, H // ops.groups, ops.groups, m, dv).sum(dim=2)
    return dq, dk, dv_, row_sums, row_abs, deltas


# ----------------------------------------------------------------------------------------------------
# Backend entry points (the same signatures as hf_deltamatch.kernels)
# ----------------------------------------------------------------------------------------------------


def _segments(n_total: int, m_total: int, cu_seqlens_q, cu_seqlens_k, varlen=None):
    """[(q0, q1, k0, k1)] token ranges of each sequence; one range when there is no varlen. varlen: the op's checked
    reading of cu_seqlens (hf_deltamatch._varlen), else they are read here."""
    if cu_seqlens_q is None:
        return [(0, n_total, 0, m_total)]
    if varlen is None:  # a direct call (the op reads them itself): tokens may lie outside every sequence
        varlen = _varlen.varlen(cu_seqlens_q, cu_seqlens_k, n_total, m_total, cover=False)
    cq, ck = varlen.bounds_q, varlen.bounds_k
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def _quantize_inputs(x: torch.Tensor, segments, which: int, cfg: DeltaMatchConfig, fmt: str = "e4m3"):
    """Quantize the token axis sequence by sequence (tiles start at each sequence's first token).

    which: 0 for query-side tensors (q, dO), 2 for key-side ones (k, v): the index into a segment.
    """
    x8 = torch.zeros(x.shape, dtype=FP8_DTYPE[fmt], device=x.device)  # 0 outside every sequence (numerics.md)
    scale = torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)
    for seg in segments:
        a, b = seg[which], seg[which + 1]
        if b > a:
            x8[:, :, a:b], scale[:, :, a:b] = quantize_tokens(x[:, :, a:b], cfg.block, fmt, cfg.scale_rounding)
    return x8, scale


def forward(q, k, v, *, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, config: DeltaMatchConfig,
            varlen=None):
    """Returns (out, lse, q8, k8, v8, q_scale, k_scale, v_scale); the FP8 tensors are empty in bf16 mode."""
    segments = _segments(q.shape[2], k.shape[2], cu_seqlens_q, cu_seqlens_k, varlen)
    B, Hq, N, _ = q.shape
    out = q.new_zeros(B, Hq, N, v.shape[-1])
    lse = torch.full((B, Hq, N), float("-inf"), dtype=torch.float32, device=q.device)
    if config.precision == "fp8":
        saved = (*_quantize_inputs(q, segments, 0, config), *_quantize_inputs(k, segments, 2, config),
                 *_quantize_inputs(v, segments, 2, config))
        q8, sq, k8, sk, v8, sv = saved
        operands = (q8, k8, v8, sq, sk, sv)
    else:
        # Distinct empty tensors: a custom op's outputs may not alias each other.
        q8, k8, v8 = (q.new_empty(0, dtype=FP8_DTYPE["e4m3"]) for _ in range(3))
        sq, sk, sv = (q.new_empty(0, dtype=torch.float32) for _ in range(3))
        ones = lambda x: torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)  # noqa: E731
        operands = (q, k, v, ones(q), ones(k), ones(v))
    for q0, q1, k0, k1 in segments:
        if q1 == q0:
            continue
        ops = _Operands(*(t[:, :, a:b] for t, (a, b) in zip(operands, [(q0, q1), (k0, k1), (k0, k1)] * 2)),
                        config, q.dtype)
        o, l = _forward_group(ops, q1 - q0, k1 - k0, causal, window, softmax_scale, config.block)
        out[:, :, q0:q1], lse[:, :, q0:q1] = o.to(q.dtype), l
    return out, lse, q8, k8, v8, sq, sk, sv


def backward(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, *, causal, softmax_scale, window,
             cu_seqlens_q, cu_seqlens_k, config: DeltaMatchConfig, return_row_sums: bool = False,
             return_delta: bool = False, varlen=None, dlse=None):
    """Returns (dq, dk, dv) in the input dtypes (plus the dS row sums and |dS| row sums if asked, then the
    fp32 (B, Hq, N) delta dS was formed with if asked: 0 on rows that see no key or lie outside every sequence).

    fp8 mode reads q8/k8/v8 and their scales (q/k/v may be None); bf16 mode reads q/k/v.
    `out` is needed for delta="stale" only. dlse: the gradient of the LSE (B, Hq, N), folded into dS
    (docs/numerics.md, "The LSE's gradient"); the delta returned then includes it.
    """
    fp8 = config.precision == "fp8"
    dtype = do.dtype
    if fp8:
        operands = (q8, k8, v8, q_scale, k_scale, v_scale)
    else:
        ones = lambda x: torch.ones(x.shape[:-1], dtype=torch.float32, device=x.device)  # noqa: E731
        operands = (q, k, v, ones(q), ones(k), ones(v))
    qs, ks, vs = operands[:3]
    segments = _segments(qs.shape[2], ks.shape[2], cu_seqlens_q, cu_seqlens_k, varlen)
    if fp8:
        do8, sdo = _quantize_inputs(do, segments, 0, config, config.grad_format)
    else:
        do8, sdo = do, torch.ones(do.shape[:-1], dtype=torch.float32, device=do.device)
    delta_stale = None
    if config.delta == "stale":
        if out is None:
            raise ValueError("delta='stale' needs the forward output.")
        delta_stale = (do.float() * out.float()).sum(dim=-1)
    dq = torch.zeros(qs.shape, dtype=torch.float32, device=do.device)
    dk = torch.zeros(ks.shape, dtype=torch.float32, device=do.device)
    dv = torch.zeros(vs.shape, dtype=torch.float32, device=do.device)
    row_sums = torch.zeros(do.shape[:-1], dtype=torch.float32, device=do.device)
    row_abs = torch.zeros_like(row_sums)
    deltas = torch.zeros_like(row_sums)
    for q0, q1, k0, k1 in segments:
        if q1 == q0 or k1 == k0:
            continue
        ops = _Operands(*(t[:, :, a:b] for t, (a, b) in zip(operands, [(q0, q1), (k0, k1), (k0, k1)] * 2)),
                        config, dtype)
        stale = None if delta_stale is None else delta_stale[:, :, q0:q1]
        g = _backward_group(ops, do8[:, :, q0:q1], sdo[:, :, q0:q1], stale, lse[:, :, q0:q1], q1 - q0, k1 - k0,
                            causal, window, softmax_scale, config, None if dlse is None else dlse[:, :, q0:q1].float())
        dq[:, :, q0:q1], dk[:, :, k0:k1], dv[:, :, k0:k1] = g[0], g[1], g[2]
        row_sums[:, :, q0:q1], row_abs[:, :, q0:q1], deltas[:, :, q0:q1] = g[3], g[4], g[5]
    grads = (dq.to(dtype), dk.to(dtype), dv.to(dtype))
    return (*grads, *((row_sums, row_abs) if return_row_sums else ()), *((deltas,) if return_delta else ()))



# ----------------------------------------------------------------------------------------------------
# Attention sinks (docs/numerics.md, "Attention sinks"): applied around either backend's forward and backward
# ----------------------------------------------------------------------------------------------------


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor):
    """A sink logit s_h per query head joins every softmax denominator, with no value row:
    LSE' = logaddexp(LSE, s_h), O' = O * exp(LSE - LSE') (in fp32, rounded once more to out's dtype).
    A row that sees no key (LSE -inf) gets LSE' = s_h and O' = 0. A -inf sink is no sink; a NaN or +inf one makes
    its head's LSE' NaN (exact attention's softmax gives NaN there too: docs/numerics.md, "Non-finite inputs").
    Returns (O', LSE')."""
    s = sinks.view(1, -1, 1)
    lse_s = torch.logaddexp(lse, torch.where(s == math.inf, math.nan, s))
    out_s = (out.float() * torch.exp(lse - lse_s)[..., None]).to(out.dtype)
    return out_s, lse_s


def sinks_grad(lse_s: torch.Tensor, delta: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d s_h = -sum_{b,i} P_i,sink * delta_i, P_i,sink = exp(s_h - LSE'_i), with the delta the backward formed dS
    with (the sink's dP is 0, so its dS is -P_i,sink * delta_i). fp32, shape of sinks."""
    return -(torch.exp(sinks.view(1, -1, 1) - lse_s) * delta).sum(dim=(0, 2))
