"""Outlier-robust pre-transforms of q and k (docs/numerics.md, "Outlier channels: rotation and K smoothing").

FP8 tile scales follow tokens, not channels: one large channel sets a tile's scale and the others lose their bits.
Two transforms that leave attention unchanged in exact arithmetic, applied before the op (either backend):
  qk_rotation="hadamard":  q' = q R, k' = k R with R = diag(signs) blockdiag(H_b / sqrt(b)) orthogonal, so
                           q' k'^T = q k^T; backward dq = dq' R^T, dk = dk' R^T.
  smooth_k:                k' = k - mean_j k_j over the keys of each sequence (per batch row, KV head); query i's
                           scores all shift by q_i . mean, which softmax ignores; backward dk = dk' - mean_j dk'_j.
Both run in fp32 (float64 for float64 inputs) with one rounding back to the input dtype.
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")
_SIGN_SEED = 20240229  # fixed: the same signs on every device and in every process


def hadamard_blocks(d: int) -> list[int]:
    """Sizes of the diagonal Hadamard blocks for head dim d: its binary digits, largest first (128 -> [128],
    192 -> [128, 64], 80 -> [64, 16]). A power of two is one block over the whole head dim."""
    if d < 1:
        raise ValueError(f"head dim must be >= 1, got {d}")
    return [1 << i for i in range(d.bit_length() - 1, -1, -1) if d >> i & 1]


@functools.lru_cache(maxsize=None)
def _rotation_cpu(d: int) -> torch.Tensor:
    """R (d, d) float64: diag(signs) @ blockdiag(H_b / sqrt(b)), H_b the Sylvester Hadamard matrix of order b."""
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(_SIGN_SEED + d),
                          dtype=torch.int64).double() * 2 - 1
    r = torch.zeros(d, d, dtype=torch.float64)
    start = 0
    for b in hadamard_blocks(d):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < b:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        r[start:start + b, start:start + b] = h / b ** 0.5
        start += b
    return signs[:, None] * r


_ROTATIONS: dict = {}


def rotation_matrix(d: int, device, dtype=torch.float32) -> torch.Tensor:
    """The head-dim rotation R (d, d) on `device` (cached; built once on the CPU in float64)."""
    key = (d, torch.device(device), dtype)
    if key not in _ROTATIONS:
        _ROTATIONS[key] = _rotation_cpu(d).to(device=device, dtype=dtype)
    return _ROTATIONS[key]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _sequence_of_tokens(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64: the sequence each token belongs to, -1 for tokens outside every sequence."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True) - 1
    return torch.where(seq < cu.numel() - 1, seq, -1)


def _key_means(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Mean over the tokens of each sequence: (B, H, 1, D) for a dense batch, (B, H, nseq, D) for a packed one.

    Packed: differences of one prefix sum (deterministic on every device, unlike scatter-adds); its fp32 rounding
    moves the mean by ~1e-7 x the prefix's magnitude, and any vector subtracted from all keys of a sequence is exact.
    """
    if cu_seqlens is None:
        return x.mean(dim=2, keepdim=True)
    cu = cu_seqlens.long()
    prefix = torch.nn.functional.pad(x.cumsum(dim=2), (0, 0, 1, 0))
    sums = prefix[:, :, cu[1:]] - prefix[:, :, cu[:-1]]
    return sums / (cu[1:] - cu[:-1]).clamp_min(1).to(x.dtype)[:, None]


def _per_token(means: torch.Tensor, seq: torch.Tensor | None) -> torch.Tensor:
    """Each token's sequence mean (0 for tokens outside every sequence); dense batches broadcast."""
    if seq is None:
        return means
    return torch.where((seq >= 0)[:, None], means[:, :, seq.clamp_min(0)], 0.0)


def _center(x: torch.Tensor, cu_seqlens: torch.Tensor | None, seq: torch.Tensor | None):
    means = _key_means(x, cu_seqlens)
    return x - _per_token(means, seq), means


class _TransformQK(torch.autograd.Function):
    """y = C(x) R in fp32, cast to x's dtype; C centers the keys of each sequence (or is the identity), R rotates
    the head dim (or is the identity). Its vector-Jacobian product is dx = C(dy R^T): C is an orthogonal
    projection (symmetric), R is orthogonal. The forward also returns the subtracted means (no gradient)."""

    @staticmethod
    def forward(ctx, x, r, center, cu_seqlens):
        ctx.r, ctx.center, ctx.cu_seqlens = r, center, cu_seqlens
        ctx.seq = _sequence_of_tokens(cu_seqlens, x.shape[2]) if center and cu_seqlens is not None else None
        y = x.to(_compute_dtype(x))
        means = None
        if center:
            y, means = _center(y, cu_seqlens, ctx.seq)
        if r is not None:
            y = y @ r.to(y.dtype)
        if means is None:
            means = x.new_empty(0, dtype=torch.float32)
        ctx.mark_non_differentiable(means)
        return y.to(x.dtype), means

    @staticmethod
    def backward(ctx, dy, _dmeans):
        if dy is None:
            return None, None, None, None
        g = dy.to(_compute_dtype(dy))
        if ctx.r is not None:
            g = g @ ctx.r.to(g.dtype).T
        if ctx.center:
            g = _center(g, ctx.cu_seqlens, ctx.seq)[0]
        return g.to(dy.dtype), None, None, None


def transform_qk(q, k, rotation: str = "none", smooth_k: bool = False, cu_seqlens_k=None):
    """(q', k', key_means): the op's inputs after the configured transforms (differentiable), and the means
    smoothing subtracted from the keys (rotated with them; None without smoothing) for `lse_shift`.

    q (B, Hq, N, D), k (B, Hkv, M, D); cu_seqlens_k: packed sequences (each sequence's keys get their own mean).
    """
    if rotation not in ROTATIONS:
        raise ValueError(f"qk_rotation={rotation!r} is not supported; choose one of {list(ROTATIONS)}.")
    r = rotation_matrix(q.shape[-1], q.device, _compute_dtype(q)) if rotation == "hadamard" else None
    if r is not None:
        q = _TransformQK.apply(q, r, False, None)[0]
    if r is not None or smooth_k:
        k, means = _TransformQK.apply(k, r, smooth_k, cu_seqlens_k)
    if not smooth_k:
        return q, k, None
    return q, k, means if r is None else means @ r.to(means.dtype)


@torch.no_grad()
def lse_shift(q: torch.Tensor, key_means: torch.Tensor, softmax_scale: float, cu_seqlens_q=None) -> torch.Tensor:
    """(B, Hq, N) fp32: softmax_scale * q'_i . mean, what smoothing took from every score of query i; the
    log-sum-exp of the original problem is the op's plus this. q: the op's (transformed) q; key_means from
    transform_qk. Queries outside every sequence get 0."""
    B, Hq, N, D = q.shape
    hkv = key_means.shape[1]
    means = key_means.float()
    if cu_seqlens_q is not None:
        means = _per_token(means, _sequence_of_tokens(cu_seqlens_q, N))
    qg = q.float().view(B, hkv, Hq // hkv, N, D)
    return (qg * means[:, :, None]).sum(-1).reshape(B, Hq, N) * softmax_scale
