"""The outlier transforms of q and k (hf_deltamatch.outliers; docs/numerics.md, "Outlier channels") on the fp8 path.

Forward: `transform_rows` is applied by the quantization pass to each tile it loads (kernels/quantize.py), so q'
and k' are never written. Backward, on the op's gradients dq', dk' (outliers._TransformQK.backward's maps):
  dq = dq' R_q^T           one torch matmul (a pass over dq of its own: the dQ kernels' stores are Gluon's or
                           Triton's epilogues, and R_q^T there is one more D x D operand in their shared memory);
  dk = C(dk') R_k^T        the means of dk' (outliers.key_means: one reduction, fp32), then `_center_rotate_kernel`,
                           one pass, in place: minus the token's sequence mean, rounded, times R_k^T, rounded.
C needs the mean over all keys of a sequence, which no single program of the dK/dV kernel holds.
"""

import torch
import triton
import triton.language as tl

from . import configs
from ._fp8 import INTERPRET, cast_to
from .. import outliers


@triton.jit
def load_rotation(R, cols, srr, src_, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """R (D x D, strides srr, src_) as a (BLOCK_D, BLOCK_D) tile, zeros outside it: transform_rows' `r`."""
    dmask = (cols[:, None] < D) & (cols[None, :] < D)
    return tl.load(R + cols[:, None] * srr + cols[None, :] * src_, mask=dmask, other=0.0)


@triton.jit
def transform_rows(x, mask, mean, r, DTYPE: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr,
                   INTERP: tl.constexpr):
    """outliers.py's transform of the rows x (BLOCK_T, BLOCK_D) fp32 holding DTYPE values: minus `mean` (fp32
    holding DTYPE values, broadcast to x) rounded to DTYPE (CENTER; entries outside `mask` become 0), then times r
    (load_rotation's tile, DTYPE) accumulated in fp32 and rounded to DTYPE (ROTATE). Returned in fp32."""
    if CENTER:
        x = tl.where(mask, cast_to(x - mean, DTYPE, INTERP).to(tl.float32), 0.0)
    if ROTATE:
        if INTERP:  # the interpreter's bf16 dot multiplies raw bits; fp32 holds the products exactly
            y = tl.dot(x, r.to(tl.float32))
        else:  # R's entries are powers of two: exact products, fp32 accumulation
            y = tl.dot(x.to(DTYPE), r)
        x = cast_to(y, DTYPE, INTERP).to(tl.float32)
    return x


@triton.jit
def _center_rotate_kernel(X, MEAN, SEQ, R, sxb, sxh, sxn, sxd, H, N, NMEAN,
                          D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, VARLEN: tl.constexpr,
                          ROTATE: tl.constexpr, INTERP: tl.constexpr):
    """One (BLOCK_T, D) tile of X (B, H, N, D) in place: x - mean of its token's sequence (MEAN (B, H, NMEAN, D)
    contiguous; VARLEN: SEQ (N,) int32 is each token's sequence, -1 for none: mean 0), then times R^T (ROTATE)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    ptrs = X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + rows.to(tl.int64)[:, None] * sxn + cols[None, :] * sxd
    x = tl.load(ptrs, mask=mask, other=0.0)
    seq = tl.zeros([BLOCK_T], tl.int32)
    if VARLEN:
        seq = tl.load(SEQ + rows, mask=rows < N, other=-1)
    mean = tl.load(MEAN + (pid_bh.to(tl.int64) * NMEAN + seq[:, None]) * D + cols[None, :],
                   mask=mask & (seq[:, None] >= 0), other=0.0).to(tl.float32)
    # R^T: element (i, j) is R[j, i]
    r = 0.0
    if ROTATE:
        r = load_rotation(R, cols, 1, D, D, BLOCK_D)
    y = transform_rows(x.to(tl.float32), mask, mean, r, X.dtype.element_ty, True, ROTATE, INTERP)
    tl.store(ptrs, y.to(X.dtype.element_ty), mask=mask)


def center_rotate_(x, means, rotation=None, cu_seqlens=None):
    """x (B, H, N, D) <- C(x) rotation^T in place (outliers._TransformQK.backward's map with means = key_means(x,
    cu_seqlens), computed by the caller) in one pass; returns x."""
    B, H, N, D = x.shape
    nmean = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    if means.shape != (B, H, nmean, D) or means.dtype != x.dtype or not means.is_contiguous():
        raise ValueError(f"means must be contiguous ({B}, {H}, {nmean}, {D}) {x.dtype} (outliers.key_means), got "
                         f"{tuple(means.shape)} {means.dtype}")
    if rotation is not None and (rotation.shape != (D, D) or rotation.dtype != x.dtype
                                 or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous ({D}, {D}) {x.dtype} matrix, got {tuple(rotation.shape)}")
    if x.numel() == 0 or nmean == 0:
        return x
    seq = outliers.sequence_of_tokens(cu_seqlens, N).to(torch.int32) if cu_seqlens is not None else None
    block = 64 if D > 128 or rotation is not None else 128  # the fp32 product tile: 64 x 128 over 4 warps
    _center_rotate_kernel[(configs.cdiv(N, block), B * H)](
        x, means, seq if seq is not None else means, rotation if rotation is not None else means, *x.stride(),
        H, N, nmean, D=D, BLOCK_T=block, BLOCK_D=configs.pow2(D), VARLEN=cu_seqlens is not None,
        ROTATE=rotation is not None, INTERP=INTERPRET, num_warps=4)
    return x


def transform_grads(dq, dk, r_q=None, r_k=None, center=False, cu_seqlens_k=None):
    """(dq, dk): the gradients of the untransformed q and k from the op's dq', dk' (module docstring). dk' is
    overwritten when centering."""
    if r_q is not None:
        dq = dq @ r_q.T
    if center:
        dk = center_rotate_(dk, outliers.key_means(dk, cu_seqlens_k), r_k, cu_seqlens_k)
    elif r_k is not None:
        dk = dk @ r_k.T
    return dq, dk
