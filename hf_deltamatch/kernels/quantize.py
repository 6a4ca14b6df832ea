"""Per-tile FP8 quantization: one pass over the input, writing the layouts the matmuls want.

A tile is BLOCK_T consecutive tokens of one (batch, head) x the whole head dim, counted from the start of
its sequence (varlen: from cu_seqlens[s]). One program per tile: load it, amax, scale, cast, and write
  - y  (B, H, N, D) fp8, the row-major copy (D contiguous), and/or
  - yt a (B, H, N, D) view of (B, H, D, N) storage (tokens contiguous): the K-major operand of the FP8
    matmuls that contract over tokens (P @ V in the forward, P^T @ dO in the backward),
  - the per-token fp32 scale (B, H, N): every token carries its tile's scale.
"""

import torch
import triton
import triton.language as tl

from ._fp8 import FP8_MAX, INTERPRET, tile_scale, to_fp8

FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# Whether _quantize_kernel writes the token-major copy itself (one pass over the input). Triton 3.9 compiles that
# second store wrongly for sm_90 on dense batches (the forward's v8t came out as garbage or NaN on the H200 while
# the row-major store, varlen batches and _token_major_kernel were right: GPU tests and probe, runs 2016 and 2021),
# so with any Triton but the 3.6 that the GPU tests passed with, the copy is made by _token_major_kernel instead
# (GPU tests 22/22 with Triton 3.9 then, run 2027; one more pass over the fp8 tensor, ~0.02 ms per tensor at
# B=2, H=16, N=8192, D=128).
FUSED_TOKEN_MAJOR = triton.__version__.startswith("3.6.")


@triton.jit
def _k_order_source(k):
    """The token at position k of token_major(k_order=True): the inverse of k_order()."""
    w = k & 31
    return (k - w) + ((w & 17) | (((w >> 1) & 1) << 3) | (((w >> 2) & 3) << 1))


@triton.jit
def _quantize_kernel(
    X, Y, YT, S, CU,
    sxb, sxh, sxn, sxd,
    syb, syh, syn, syd,
    stb, sth, stn, std,
    H, N,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_YT: tl.constexpr, VARLEN: tl.constexpr, INTERP: tl.constexpr,
    K_ORDER: tl.constexpr = False, TILES: tl.constexpr = False,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    if TILES:  # a packed batch's tiles listed (CU: first rows, then ends): no program past a sequence's end
        first = tl.load(CU + pid_t)
        end = tl.load(CU + tl.num_programs(0) + pid_t)
    elif VARLEN:
        first = tl.load(CU + pid_s) + pid_t * BLOCK_T
        end = tl.load(CU + pid_s + 1)
    else:
        first = pid_t * BLOCK_T
        end = N
    rows = first + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < end) & (cols[None, :] < D)
    rows = rows.to(tl.int64)  # packed varlen batches: token * stride can pass 2^31
    src = rows
    if K_ORDER:  # the tile's rows in token_major(k_order=True)'s order (the amax does not care): the token-major
        src = _k_order_source(rows)  # copy is stored in order, the row-major one at the rows it came from
    x = tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + src[:, None] * sxn + cols[None, :] * sxd,
                mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
    scale = tile_scale(amax, FMAX, POW2)
    y = to_fp8(x / scale, E5M2, INTERP)
    if WRITE_Y:
        tl.store(Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh + src[:, None] * syn + cols[None, :] * syd,
                 y, mask=mask)
    if WRITE_YT:
        tl.store(YT + b.to(tl.int64) * stb + h.to(tl.int64) * sth + rows[:, None] * stn + cols[None, :] * std,
                 y, mask=mask)
    tl.store(S + pid_bh.to(tl.int64) * N + rows, tl.zeros([BLOCK_T], tl.float32) + scale, mask=rows < end)


def quantize(x, block, fmt="e4m3", rounding="fp32", cu_seqlens=None, max_len=None, row_major=True,
             transposed=False, k_order=False, tiles=None):
    """Quantize x (B, H, N, D) per `block`-token tile. Returns (y or None, yt or None, scale (B, H, N)).

    yt is a (B, H, N, D) view of a (B, H, D, N16) buffer (tokens contiguous, N rounded up to 16), written by the
    kernel itself if FUSED_TOKEN_MAJOR, else copied from y by token_major(); k_order: its tokens in
    token_major(k_order=True)'s order (the Gluon forward's V).
    Varlen: tokens outside every sequence get zeros and scale 1 (docs/numerics.md; TMA tiles read them).
    tiles: the varlen batch's tiles as one int32 tensor, their first rows then their ends (segments.Segments.tiles
    for block 128): one program per tile instead of the longest sequence's tiles x the sequences.
    """
    if k_order and (cu_seqlens is not None or x.shape[2] % 32):
        raise ValueError("quantize(k_order=True) permutes groups of 32 tokens: no varlen, N a multiple of 32.")
    if transposed and not FUSED_TOKEN_MAJOR:
        y, _, scale = quantize(x, block, fmt, rounding, cu_seqlens, max_len, row_major=True)
        return (y if row_major else None), token_major(y, k_order), scale
    B, H, N, D = x.shape
    dt = FP8_TORCH[fmt]
    alloc = torch.zeros if cu_seqlens is not None else torch.empty
    y = alloc((B, H, N, D), dtype=dt, device=x.device) if row_major else None
    yt = None
    if transposed:  # token stride padded to 16 bytes, as a TMA descriptor over (B*H*D, N) needs
        n16 = -(-N // 16) * 16
        yt = alloc((B, H, D, n16), dtype=dt, device=x.device)[..., :N].transpose(-1, -2)
    if cu_seqlens is not None:
        scale = torch.ones((B, H, N), dtype=torch.float32, device=x.device)
        nseq = cu_seqlens.numel() - 1
    else:
        scale = torch.empty((B, H, N), dtype=torch.float32, device=x.device)
        nseq, max_len = 1, N
    if N == 0 or B * H == 0 or nseq == 0:
        return y, yt, scale
    ys = y.stride() if y is not None else (0, 0, 0, 0)
    ts = yt.stride() if yt is not None else (0, 0, 0, 0)
    tiled = tiles is not None and cu_seqlens is not None
    grid = (tiles.numel() // 2, B * H, 1) if tiled else (triton.cdiv(max(max_len, 1), block), B * H, nseq)
    _quantize_kernel[grid](
        x, y if y is not None else yt, yt if yt is not None else y, scale,
        tiles if tiled else cu_seqlens,
        *x.stride(), *ys, *ts, H, N,
        D=D, BLOCK_T=block, BLOCK_D=triton.next_power_of_2(D),
        FMAX=FP8_MAX[fmt], E5M2=fmt == "e5m2", POW2=rounding == "pow2",
        WRITE_Y=y is not None, WRITE_YT=yt is not None, VARLEN=cu_seqlens is not None, INTERP=INTERPRET,
        K_ORDER=bool(k_order), TILES=tiled, num_warps=8 if D > 128 else 4,
    )
    return y, yt, scale


@triton.jit
def _token_major_kernel(X, Y, SRC, sxb, sxh, sxn, sxd, syb, syh, syn, syd, H, N,
                        D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, K_ORDER: tl.constexpr,
                        HAS_SRC: tl.constexpr = False):
    """Copy one (BLOCK_T, D) tile of the N output tokens into Y's layout (by its strides: token-major storage,
    the layout conversion going through shared memory, or row-major). HAS_SRC: output token t is input token
    SRC[t], or 0 where SRC[t] < 0 (segments.py's padded layout)."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < N) & (cols[None, :] < D)
    rows = rows.to(tl.int64)
    src = rows
    if K_ORDER:  # position k = 16 g1 + 4 q + 2 g0 + e of each group of 32 takes token 16 g1 + 8 g0 + 2 q + e;
        # permuted on the load side, whose rows are D contiguous bytes: the token-major store stays coalesced
        src = _k_order_source(rows)
    load_mask = mask
    if HAS_SRC:
        src = tl.load(SRC + src, mask=rows < N, other=-1).to(tl.int64)
        load_mask = mask & (src[:, None] >= 0)
    x = tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + src[:, None] * sxn + cols[None, :] * sxd,
                mask=load_mask, other=0.0)
    tl.store(Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh + rows[:, None] * syn + cols[None, :] * syd,
             x, mask=mask)


def k_order(n, device=None):
    """The positions token_major(k_order=True) stores tokens 0 .. n-1 at (n a multiple of 32): within each group
    of 32, the order in which a thread's wgmma accumulator columns are its fp8 A operand's K values
    (_gluon.fp8_operand)."""
    c = torch.arange(n, device=device)
    w = c & 31
    return (c - w) + ((w & 17) | (((w >> 1) & 3) << 2) | (((w >> 3) & 1) << 1))


def token_major(x8, k_order=False, src=None):
    """(B, H, N, D) fp8 -> the same logical tensor stored (B, H, D, N) (tokens contiguous). k_order: the tokens of
    each group of 32 stored in the order of k_order() (N a multiple of 32), for the Gluon kernels' B operands.
    src (int32, one entry per output token): output token t is x8's token src[t], 0 where src[t] < 0 (a packed
    batch in segments.py's padded layout); then N = len(src)."""
    return _copy_tokens(x8, k_order, src, token_major_out=True)


def pad_tokens(x8, src):
    """(B, H, N, D) -> (B, H, len(src), D) row-major: output token t is x8's token src[t], 0 where src[t] < 0
    (segments.py's padded layout)."""
    return _copy_tokens(x8, False, src, token_major_out=False)


def _copy_tokens(x8, k_order, src, token_major_out):
    B, H, N, D = x8.shape
    if src is not None:
        N = src.numel()
    if k_order and N % 32:
        raise ValueError(f"token_major(k_order=True) permutes groups of 32 tokens; got N={N}.")
    if token_major_out:
        n16 = -(-N // 16) * 16  # token stride padded to 16 bytes for TMA descriptors
        y = torch.empty((B, H, D, n16), dtype=x8.dtype, device=x8.device)[..., :N].transpose(-1, -2)
    else:
        y = torch.empty((B, H, N, D), dtype=x8.dtype, device=x8.device)
    if y.numel():
        _token_major_kernel[(triton.cdiv(N, 128), B * H)](
            x8, y, src if src is not None else y, *x8.stride(), *y.stride(), H, N, D=D, BLOCK_T=128,
            BLOCK_D=triton.next_power_of_2(D), K_ORDER=bool(k_order), HAS_SRC=src is not None, num_warps=4)
    return y
