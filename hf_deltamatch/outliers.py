"""Outlier-robust pre-transforms of q and k (docs/numerics.md, "Outlier channels: rotation and K smoothing").

FP8 tile scales follow tokens, not channels: one large channel sets a tile's scale and the others lose their bits.
Two transforms that leave attention unchanged in exact arithmetic, applied before the op (either backend):
  qk_rotation="hadamard":  q' = q R_q, k' = k R_k with R_q R_k^T = I: R_q = R 2^-e, R_k = R 2^e, R = diag(signs)
                           blockdiag(H_b / sqrt(b)) orthogonal, e in {0, 1/2} per block so that every entry is a
                           power of two; q' k'^T = q k^T; backward dq = dq' R_q^T, dk = dk' R_k^T.
  smooth_k:                k' = k - mean_j k_j over the keys of each sequence (per batch row, KV head); query i's
                           scores all shift by q_i . mean, which softmax ignores; backward dk = dk' - mean_j dk'_j.
Both: k' = C(k) R_k, dk = C(dk') R_k^T (C, the centering, acts on tokens and R on channels: they commute).
The rotation is a matmul in the input dtype (fp32 accumulation, one rounding: its matrices are exact there); means
are taken in fp32 and subtracted as input-dtype constants (one rounding).
Here the transforms are torch ops around the op; the fp8 Triton path takes `fused_args`' matrices and means into its
quantization pass instead (kernels/quantize.py) and applies `_TransformQK.backward`'s maps to the op's gradients
(kernels/transform.py), with the same rounding points.
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
def _rotations_cpu(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_q, R_k) (d, d) float64: diag(signs) @ blockdiag(H_b * 2^-ceil(log2(b) / 2)) and the same with
    2^-floor(log2(b) / 2), H_b the Sylvester Hadamard matrix of order b: R_q R_k^T = I, entries +-2^-m."""
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(_SIGN_SEED + d),
                          dtype=torch.int64).double() * 2 - 1
    r_q, r_k = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
    start = 0
    for b in hadamard_blocks(d):
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < b:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        log2b = b.bit_length() - 1
        r_q[start:start + b, start:start + b] = h * 2.0 ** -((log2b + 1) // 2)
        r_k[start:start + b, start:start + b] = h * 2.0 ** -(log2b // 2)
        start += b
    return signs[:, None] * r_q, signs[:, None] * r_k


_ROTATIONS: dict = {}


def rotation_matrices(d: int, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(R_q, R_k) for head dim d on `device` in `dtype` (exact in any float dtype; cached)."""
    key = (d, torch.device(device), dtype)
    if key not in _ROTATIONS:
        _ROTATIONS[key] = tuple(r.to(device=device, dtype=dtype) for r in _rotations_cpu(d))
    return _ROTATIONS[key]


def _accumulate_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def sequence_of_tokens(cu_seqlens: torch.Tensor, n: int) -> torch.Tensor:
    """(n,) int64: the sequence each token belongs to, -1 for tokens outside every sequence."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True) - 1
    return torch.where(seq < cu.numel() - 1, seq, -1)


def _key_means(x: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Mean over the tokens of each sequence in fp32 (float64 for float64 x): (B, H, 1, D) for a dense batch,
    (B, H, nseq, D) for a packed one.

    Packed: differences of one prefix sum (deterministic on every device, unlike scatter-adds); its fp32 rounding
    moves the mean by ~1e-7 x the prefix's magnitude, and any vector subtracted from all keys of a sequence is exact.
    """
    acc = _accumulate_dtype(x)
    if cu_seqlens is None:
        return x.mean(dim=2, keepdim=True, dtype=acc)
    cu = cu_seqlens.long()
    prefix = torch.nn.functional.pad(x.cumsum(dim=2, dtype=acc), (0, 0, 1, 0))
    sums = prefix[:, :, cu[1:]] - prefix[:, :, cu[:-1]]
    return sums / (cu[1:] - cu[:-1]).clamp_min(1).to(acc)[:, None]


def key_means(x: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The means smoothing subtracts from x (B, H, M, D): per batch row, head and sequence, taken in fp32 and
    rounded to x's dtype; (B, H, 1, D) for a dense batch, (B, H, nseq, D) for a packed one, contiguous."""
    return _key_means(x, cu_seqlens).to(x.dtype).contiguous()


def _per_token(means: torch.Tensor, seq: torch.Tensor | None) -> torch.Tensor:
    """Each token's sequence mean (0 for tokens outside every sequence); dense batches broadcast."""
    if seq is None:
        return means
    return torch.where((seq >= 0)[:, None], means[:, :, seq.clamp_min(0)], 0.0)


def _center(x: torch.Tensor, cu_seqlens: torch.Tensor | None, seq: torch.Tensor | None):
    """x minus its per-sequence means, rounded to x's dtype first (any constant is exact; one rounding of the
    difference), and those rounded means."""
    means = key_means(x, cu_seqlens)
    return x - _per_token(means, seq), means


class _TransformQK(torch.autograd.Function):
    """y = C(x) R; C centers the keys of each sequence (or is the identity), R is R_q or R_k (or the identity).
    Its vector-Jacobian product is dx = C(dy) R^T: C is an orthogonal projection (symmetric) and commutes with R;
    centering first lets a fused backward take the means of dy before its one pass (kernels/transform.py). The
    forward also returns the subtracted means (no gradient)."""

    @staticmethod
    def forward(ctx, x, r, center, cu_seqlens):
        ctx.r, ctx.center, ctx.cu_seqlens = r, center, cu_seqlens
        ctx.seq = sequence_of_tokens(cu_seqlens, x.shape[2]) if center and cu_seqlens is not None else None
        y, means = x, x.new_empty(0)
        if center:
            y, means = _center(y, cu_seqlens, ctx.seq)
        if r is not None:
            y = y @ r
        ctx.mark_non_differentiable(means)
        return y, means

    @staticmethod
    def backward(ctx, dy, _dmeans):
        if dy is None:
            return None, None, None, None
        g = dy
        if ctx.center:
            g = _center(g, ctx.cu_seqlens, ctx.seq)[0]
        if ctx.r is not None:
            g = g @ ctx.r.T
        return g, None, None, None


def transform_qk(q, k, rotation: str = "none", smooth_k: bool = False, cu_seqlens_k=None):
    """(q', k', key_means): the op's inputs after the configured transforms (differentiable), and the means
    smoothing subtracted from the keys (rotated with them; None without smoothing) for `lse_shift`.

    q (B, Hq, N, D), k (B, Hkv, M, D); cu_seqlens_k: packed sequences (each sequence's keys get their own mean).
    """
    if rotation not in ROTATIONS:
        raise ValueError(f"qk_rotation={rotation!r} is not supported; choose one of {list(ROTATIONS)}.")
    r_q = r_k = None
    if rotation == "hadamard":
        r_q, r_k = rotation_matrices(q.shape[-1], q.device, q.dtype)
        q = _TransformQK.apply(q, r_q, False, None)[0]
    if r_k is not None or smooth_k:
        k, means = _TransformQK.apply(k, r_k, smooth_k, cu_seqlens_k)
    if not smooth_k:
        return q, k, None
    return q, k, _rotated_means(means, r_k)


def _rotated_means(means, r_k):
    """The subtracted means in the op's key space (mean R_k), fp32 (float64 for float64 inputs), for lse_shift."""
    means = means.to(_accumulate_dtype(means))
    return means if r_k is None else means @ r_k.to(means.dtype)


def fused_args(q, k, rotation: str = "none", smooth_k: bool = False, cu_seqlens_k=None):
    """transform_qk's transforms as a quantization pass applies them itself (kernels/quantize.py): (r_q, r_k,
    k_means, key_means): R_q and R_k (D, D) in q's dtype or None, the means to subtract from k (key_means(k):
    (B, Hkv, 1 or nseq, D) in k's dtype) or None, and transform_qk's third result (for lse_shift)."""
    if rotation not in ROTATIONS:
        raise ValueError(f"qk_rotation={rotation!r} is not supported; choose one of {list(ROTATIONS)}.")
    r_q = r_k = None
    if rotation == "hadamard":
        r_q, r_k = rotation_matrices(q.shape[-1], q.device, q.dtype)
    if not smooth_k:
        return r_q, r_k, None, None
    means = key_means(k.detach(), cu_seqlens_k)  # constants to the op: its backward centers dk' itself
    return r_q, r_k, means, _rotated_means(means, r_k)


def rotate_queries(q, r_q):
    """q' = q R_q as transform_qk computes it (one rounding to q's dtype), without a gradient: for lse_shift where
    the op took q and R_q apart."""
    return q if r_q is None else q.detach() @ r_q


@torch.no_grad()
def lse_shift(q: torch.Tensor, key_means: torch.Tensor, softmax_scale: float, cu_seqlens_q=None) -> torch.Tensor:
    """(B, Hq, N) fp32: softmax_scale * q'_i . mean, what smoothing took from every score of query i; the
    log-sum-exp of the original problem is the op's plus this. q: the op's (transformed) q; key_means from
    transform_qk. Queries outside every sequence get 0."""
    B, Hq, N, D = q.shape
    hkv = key_means.shape[1]
    means = key_means.float()
    if cu_seqlens_q is not None:
        means = _per_token(means, sequence_of_tokens(cu_seqlens_q, N))
    qg = q.float().view(B, hkv, Hq // hkv, N, D)
    return (qg * means[:, :, None]).sum(-1).reshape(B, Hq, N) * softmax_scale
