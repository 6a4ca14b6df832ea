"""Per-tile FP8 quantization: one pass over the input, writing the layouts the matmuls want.

A tile is BLOCK_T consecutive tokens of one (batch, head) x the whole head dim, counted from the start of
its sequence (varlen: from cu_seqlens[s]). One program per tile: load it, amax, scale, cast, and write
  - y  (B, H, N, D) fp8, the row-major copy (D contiguous), and/or
  - yt a (B, H, N, D) view of (B, H, D, N) storage (tokens contiguous): the K-major operand of the FP8
    matmuls that contract over tokens (P @ V in the forward, P^T @ dO in the backward),
  - the per-token fp32 scale (B, H, N): every token carries its tile's scale.
Optionally the tile is first transformed as hf_deltamatch.outliers defines q' and k' (docs/numerics.md, "Outlier
channels"): its sequence's key mean subtracted (CENTER) and/or multiplied by a D x D rotation (ROTATE), each result
rounded to the input dtype as the unfused transform rounds it, so the op pays no pass of its own over q and k.
The rotation's launches give each program several consecutive tiles (configs.QUANTIZE_ROTATE_TILES): R staged once,
the next tiles' copies in flight while the current one is multiplied, reduced and stored.
"""

import math

import torch
import triton
import triton.language as tl

from . import configs
from ._fp8 import FP8_MAX, INTERPRET, tile_scale, to_fp8
from .toolchain import current as _toolchain
from .transform import load_rotation, transform_rows

FP8_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
TAIL_ROWS = 128  # the most rows a kernel's TMA tile reads (a key tile; 64 or 128 queries)

# Whether _quantize_kernel writes the token-major copy itself (one pass over the input), and the padded layout's
# (quantize_padded: the forward's v8t and the backward's dO8^T on packed batches and ragged N), by Triton release
# (toolchain.RELEASES): elsewhere the copy comes from _token_major_kernel, one more pass over the fp8 tensor.
FUSED_TOKEN_MAJOR = _toolchain().fused_token_major
FUSED_PADDED_TOKEN_MAJOR = _toolchain().fused_padded_token_major


@triton.jit
def _k_order_source(k):
    """The token at position k of token_major(k_order=True): the inverse of k_order()."""
    w = k & 31
    return (k - w) + ((w & 17) | (((w >> 1) & 1) << 3) | (((w >> 2) & 3) << 1))


@triton.jit
def _tile_bounds(t, pid_s, CU, N, NT, BLOCK_T: tl.constexpr, VARLEN: tl.constexpr, TILES: tl.constexpr,
                 PER_PROGRAM: tl.constexpr):
    """(first, end): tile t's first row and the end of its sequence (past the last tile: rows it masks out)."""
    if TILES:  # a packed batch's tiles listed (CU: first rows, then ends): no program past a sequence's end
        if PER_PROGRAM == 1:
            first = tl.load(CU + t)
            end = tl.load(CU + tl.num_programs(0) + t)
        else:  # the NT listed tiles; t >= NT: an empty tile
            first = tl.load(CU + t, mask=t < NT, other=0)
            end = tl.load(CU + NT + t, mask=t < NT, other=0)
    elif VARLEN:
        first = tl.load(CU + pid_s) + t * BLOCK_T
        end = tl.load(CU + pid_s + 1)
    else:
        first = t * BLOCK_T
        end = N
    return first, end


@triton.jit
def _tile_rows(first, end, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, K_ORDER: tl.constexpr):
    """(i, rows, cols, rel, src, mask) of the tile from `first`: its row indices, token rows, columns, the rows in
    load order, their tokens, and the in-sequence mask."""
    i = tl.arange(0, BLOCK_T)
    rows = first.to(tl.int64) + i  # packed varlen batches: token * stride can pass 2^31
    cols = tl.arange(0, BLOCK_D)
    rel = i
    if K_ORDER:  # the tile's rows in token_major(k_order=True)'s order (the amax does not care): the token-major
        rel = _k_order_source(i)  # copies are stored in order, the row-major ones at the rows they came from
    src = first.to(tl.int64) + rel
    mask = (src[:, None] < end) & (cols[None, :] < D)
    return i, rows, cols, rel, src, mask


@triton.jit
def _load_tile(X, b, h, first, end, sxb, sxh, sxn, sxd, D: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr, K_ORDER: tl.constexpr):
    """The tile from `first` in X's dtype, zeros outside its sequence."""
    _, _, cols, _, src, mask = _tile_rows(first, end, D, BLOCK_T, BLOCK_D, K_ORDER)
    return tl.load(X + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + src[:, None] * sxn + cols[None, :] * sxd,
                   mask=mask, other=0.0)


@triton.jit
def _quantize_tile(
    x, t, first, end, r, pid_bh, pid_s, b, h, Y, YT, S, PY, PYT, PS, MEAN, SEQ,
    syb, syh, syn, syd, stb, sth, stn, std, N, NPAD, NMEAN, NT,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_YT: tl.constexpr, VARLEN: tl.constexpr, INTERP: tl.constexpr,
    K_ORDER: tl.constexpr, TILES: tl.constexpr, WRITE_S: tl.constexpr, WRITE_PY: tl.constexpr,
    WRITE_PYT: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, PER_PROGRAM: tl.constexpr,
):
    """Transform, scale, cast and store tile t (x: its rows as _load_tile gave them; r: the rotation, ROTATE)."""
    i, rows, cols, rel, src, mask = _tile_rows(first, end, D, BLOCK_T, BLOCK_D, K_ORDER)
    dtype = x.dtype
    x = x.to(tl.float32)
    if CENTER or ROTATE:  # MEAN (B, H, NMEAN, D) contiguous: row 0 (dense), the sequence (varlen), SEQ's (tiles)
        mean = tl.zeros([BLOCK_D], tl.float32)
        if CENTER:
            seq = 0
            if TILES:
                if PER_PROGRAM == 1:
                    seq = tl.load(SEQ + t)
                else:
                    seq = tl.load(SEQ + t, mask=t < NT, other=0)
            elif VARLEN:
                seq = pid_s
            mean = tl.load(MEAN + (pid_bh.to(tl.int64) * NMEAN + seq) * D + cols, mask=cols < D,
                           other=0.0).to(tl.float32)
        x = transform_rows(x, mask, mean[None, :], r, dtype, CENTER, ROTATE, INTERP)
    # docs/numerics.md "Non-finite inputs": the scale comes from the finite values (one inf would zero its tile-mates),
    # and a non-finite value is stored as NaN (FP8 e4m3 has no inf; the GPU's satfinite cast would make inf 448).
    # The GPU's max skips NaN (max.f32); an inf is rare, so its tile alone takes a second reduction, and x * 0 (NaN
    # for +-inf and NaN, 0 otherwise) turns inf into NaN in one FFMA: the selects that did both on every element
    # gave this memory-bound pass far more instructions.
    ax = tl.abs(x)
    if INTERP:  # numpy's max propagates NaN
        amax = tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1), axis=0)
    else:
        amax = tl.max(tl.max(ax, axis=1), axis=0)
        if amax == float("inf"):
            amax = tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1), axis=0)
    scale = tile_scale(amax, FMAX, POW2)
    y = to_fp8(x / scale + x * 0.0, E5M2, INTERP)
    if WRITE_Y:
        tl.store(Y + b.to(tl.int64) * syb + h.to(tl.int64) * syh + src[:, None] * syn + cols[None, :] * syd,
                 y, mask=mask)
    if WRITE_YT:
        tl.store(YT + b.to(tl.int64) * stb + h.to(tl.int64) * sth + rows[:, None] * stn + cols[None, :] * std,
                 y, mask=(rows[:, None] < end) & (cols[None, :] < D))
    if WRITE_S:
        tl.store(S + pid_bh.to(tl.int64) * N + rows, tl.zeros([BLOCK_T], tl.float32) + scale, mask=rows < end)
    if WRITE_PY or WRITE_PYT:  # segments.py's padded layout (TILES): tile t is padded rows t * BLOCK_T ..; its
        # rows past the sequence get zeros (x is 0 there) and scale 1, so every padded row is written
        prow = t.to(tl.int64) * BLOCK_T
        cmask = cols[None, :] < D
        listed = None
        if PER_PROGRAM > 1:  # a program's tiles past the list's end: nothing to write
            listed = (i * 0 + t) < NT
            cmask = listed[:, None] & cmask
        if WRITE_PY:  # (B, H, NPAD, D) contiguous
            tl.store(PY + (pid_bh.to(tl.int64) * NPAD + prow + rel[:, None]) * D + cols[None, :], y, mask=cmask)
        if WRITE_PYT:  # (B, H, D, NPAD) contiguous: tokens contiguous
            tl.store(PYT + (pid_bh.to(tl.int64) * D + cols[None, :]) * NPAD + prow + i[:, None], y, mask=cmask)
        tl.store(PS + pid_bh.to(tl.int64) * NPAD + prow + i, tl.where(rows < end, scale, 1.0), mask=listed)


@triton.jit
def _quantize_kernel(
    X, Y, YT, S, CU, PY, PYT, PS, R, MEAN, SEQ,
    sxb, sxh, sxn, sxd,
    syb, syh, syn, syd,
    stb, sth, stn, std,
    H, N, NPAD, NMEAN, NT,
    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_YT: tl.constexpr, VARLEN: tl.constexpr, INTERP: tl.constexpr,
    K_ORDER: tl.constexpr = False, TILES: tl.constexpr = False, WRITE_S: tl.constexpr = True,
    WRITE_PY: tl.constexpr = False, WRITE_PYT: tl.constexpr = False,
    CENTER: tl.constexpr = False, ROTATE: tl.constexpr = False, PER_PROGRAM: tl.constexpr = 1,
):
    """Tiles pid_t * PER_PROGRAM .. + PER_PROGRAM - 1 of head pid_bh (and sequence pid_s: VARLEN) along the
    tokens; NT: the number of listed tiles (TILES). PER_PROGRAM > 1 (the rotation's launches:
    configs.quantize_rotate) stages R once per program, and the compiler pipelines the tiles' loads."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    r = 0.0
    if ROTATE:  # R (D, D) contiguous
        r = load_rotation(R, tl.arange(0, BLOCK_D), D, 1, D, BLOCK_D)
    for j in range(PER_PROGRAM):  # PER_PROGRAM > 1: the compiler's software pipeline (launch num_stages)
        t = pid_t * PER_PROGRAM + j
        first, end = _tile_bounds(t, pid_s, CU, N, NT, BLOCK_T, VARLEN, TILES, PER_PROGRAM)
        x = _load_tile(X, b, h, first, end, sxb, sxh, sxn, sxd, D, BLOCK_T, BLOCK_D, K_ORDER)
        _quantize_tile(x, t, first, end, r, pid_bh, pid_s, b, h, Y, YT, S, PY, PYT, PS, MEAN, SEQ,
                       syb, syh, syn, syd, stb, sth, stn, std, N, NPAD, NMEAN, NT, D, BLOCK_T, BLOCK_D, FMAX,
                       E5M2, POW2, WRITE_Y, WRITE_YT, VARLEN, INTERP, K_ORDER, TILES, WRITE_S, WRITE_PY, WRITE_PYT,
                       CENTER, ROTATE, PER_PROGRAM)


def quantize(x, block, fmt="e4m3", rounding="fp32", cu_seqlens=None, max_len=None, row_major=True,
             transposed=False, k_order=False, segments=None, rotation=None, means=None):
    """Quantize x (B, H, N, D) per `block`-token tile. Returns (y or None, yt or None, scale (B, H, N)).

    yt is a (B, H, N, D) view of a (B, H, D, N16) buffer (tokens contiguous, N rounded up to 16), written by the
    kernel itself if FUSED_TOKEN_MAJOR, else copied from y by token_major(); k_order: its tokens in
    token_major(k_order=True)'s order (the Gluon forward's V).
    Varlen: tokens outside every sequence get zeros and scale 1 (docs/numerics.md; TMA tiles read them).
    segments: the packed batch's segments.Segments (block 128, cu_seqlens its cu): one program per tile of its
    sequences (Segments.tiles) instead of the longest sequence's tiles x the sequences, and only the rows outside
    every sequence filled beforehand.
    rotation (D, D) and/or means (B, H, S, D), both in x's dtype: quantize outliers.py's transform of x instead,
    (x - its sequence's mean) @ rotation (S = 1 for a dense batch, one mean per sequence of cu_seqlens).
    """
    if k_order and (cu_seqlens is not None or x.shape[2] % 32):
        raise ValueError("quantize(k_order=True) permutes groups of 32 tokens: no varlen, N a multiple of 32.")
    if transposed and not FUSED_TOKEN_MAJOR:
        y, _, scale = quantize(x, block, fmt, rounding, cu_seqlens, max_len, row_major=True, segments=segments,
                               rotation=rotation, means=means)
        return (y if row_major else None), token_major(y, k_order), scale
    B, H, N, D = x.shape
    dt = FP8_TORCH[fmt]
    tiled = segments is not None and cu_seqlens is not None
    # varlen: zeros and scale 1 outside the sequences; with the tile list the kernel writes every row inside them
    fill = cu_seqlens is not None and not tiled
    y = None
    if row_major:
        # dense: each head's rows rounded up to TAIL_ROWS, zeros past N, so that a TMA tile past a head's end reads
        # zeros, not the next head's tokens (a NaN there would reach an MMA as 0 x NaN: docs/numerics.md); the
        # kernels count TMA rows by the head stride (ops._desc)
        rows = N if fill or tiled or N % TAIL_ROWS == 0 else -(-N // TAIL_ROWS) * TAIL_ROWS
        y = (torch.zeros if fill else torch.empty)((B, H, rows, D), dtype=dt, device=x.device)
        if rows > N:
            y[:, :, N:].zero_()
            y = y[:, :, :N]
    yt = None
    if transposed:  # token stride padded to 16 bytes, as a TMA descriptor over (B*H*D, N) needs
        n16 = -(-N // 16) * 16
        yt = (torch.zeros if fill else torch.empty)((B, H, D, n16), dtype=dt, device=x.device)[..., :N]
        yt = yt.transpose(-1, -2)
    scale = (torch.ones if fill else torch.empty)((B, H, N), dtype=torch.float32, device=x.device)
    if tiled:
        for t, value in ((y, 0.0), (yt, 0.0), (scale, 1.0)):
            if t is not None:
                _fill_outside(t, segments, value)
    nseq = cu_seqlens.numel() - 1 if cu_seqlens is not None else 1
    if N == 0 or B * H == 0 or nseq == 0:
        return y, yt, scale
    if tiled:
        grid = (segments.tiles.numel() // 2, B * H, 1)
    else:
        grid = (configs.cdiv(max(max_len if cu_seqlens is not None else N, 1), block), B * H, nseq)
    _launch(x, grid, block, fmt, rounding, y=y, yt=yt, scale=scale, cu=segments.tiles if tiled else cu_seqlens,
            varlen=cu_seqlens is not None, tiles=tiled, k_order=k_order, rotation=rotation, means=means,
            seq_cu=segments.cu if tiled else None)
    return y, yt, scale


def quantize_padded(x, segments, fmt="e4m3", rounding="fp32", packed=True, row_major=True, token_major=False,
                    rotation=None, means=None):
    """Quantize a packed batch x (1, H, N, D) per 128-token tile of its sequences straight into segments.py's
    padded layout, where the Gluon kernels read it: the same bytes and scales as quantize(x, 128,
    cu_seqlens=segments.cu) followed by segments.pad (row_major) or token_major(k_order=True, src=segments.src)
    (token_major), without a second pass over the operand (but for the token-major copy with a Triton outside
    FUSED_PADDED_TOKEN_MAJOR: then token_major() of the padded row-major copy). Returns (y, scale), the packed
    tensors (the ones the backward keeps; (None, None) unless `packed`), and (py, pyt, ps): the padded row-major
    (1, H, npad, D) or None, token-major (a (1, H, npad, D) view of (1, H, D, npad) storage, tokens in k_order) or
    None, and the per-row scales (1, H, npad), 1 in the rows of no token. rotation, means: as quantize's."""
    B, H, N, D = x.shape
    dt, npad = FP8_TORCH[fmt], segments.npad
    if segments.tiles.numel() * 64 != npad:
        raise ValueError("quantize_padded needs segments.padded_layout's 128-token tiles")
    if not (packed or row_major or token_major):
        raise ValueError("quantize_padded: ask for at least one of packed, row_major, token_major")
    y = scale = None
    if packed:
        y = torch.empty((B, H, N, D), dtype=dt, device=x.device)
        scale = torch.empty((B, H, N), dtype=torch.float32, device=x.device)
        _fill_outside(y, segments, 0.0)
        _fill_outside(scale, segments, 1.0)
    fused = token_major and FUSED_PADDED_TOKEN_MAJOR
    copy = token_major and not fused  # the token-major copy from the padded row-major one
    py = torch.empty((B, H, npad, D), dtype=dt, device=x.device) if row_major or copy else None
    pyt = torch.empty((B, H, D, npad), dtype=dt, device=x.device).transpose(-1, -2) if fused else None
    ps = torch.empty((B, H, npad), dtype=torch.float32, device=x.device)
    if npad and B * H:
        _launch(x, (npad // 128, B * H, 1), 128, fmt, rounding, y=y, scale=scale, cu=segments.tiles, varlen=True,
                tiles=True, k_order=fused, py=py, pyt=pyt, ps=ps, rotation=rotation, means=means,
                seq_cu=segments.cu)
    if copy:
        pyt = _copy_tokens(py, True, None, token_major_out=True)  # token_major(py, k_order=True)
        py = py if row_major else None
    return (y, scale), (py, pyt, ps)


def _fill_outside(t, segments, value):
    """Fill the rows of t (B, H, N, ...) before the first sequence and from the last one's end on (none in a row
    that the sequences cover, the usual packed batch: no call then)."""
    if segments.first > 0:
        t[:, :, :segments.first] = value
    if segments.last < t.shape[2]:
        t[:, :, segments.last:] = value


def _launch(x, grid, block, fmt, rounding, *, y=None, yt=None, scale=None, cu=None, varlen=False, tiles=False,
            k_order=False, py=None, pyt=None, ps=None, rotation=None, means=None, seq_cu=None):
    """_quantize_kernel over `grid` writing the outputs given (None: not written; their pointers get a stand-in).
    tiles: seq_cu is the cu_seqlens whose sequence each listed tile's first row is looked up in (for `means`)."""
    B, H, N, D = x.shape
    _check_transform(x, rotation, means, 1 if cu is None else (seq_cu if tiles else cu).numel() - 1)
    seq = None
    if means is not None and tiles:  # the sequence of each listed tile (CU: first rows, then ends)
        seq = torch.searchsorted(seq_cu[1:], cu[:cu.numel() // 2], right=True).to(torch.int32)
    some = next(t for t in (y, yt, py, pyt) if t is not None)
    rows = scale if scale is not None else ps
    zeros = (0, 0, 0, 0)
    # the rotation's launches: several tiles per program (configs.quantize_rotate); NT: grid[0]'s tiles. Not
    # with a token-major copy (not the forward's q and k): its layout conversion spills at several tiles per program.
    per, warps, stages = 1, 8 if D > 128 else 4, 3
    if rotation is not None:
        per, warps, stages = configs.quantize_rotate(math.prod(grid), D, x.device)
        if yt is not None or pyt is not None:
            per = 1
    _quantize_kernel[(configs.cdiv(grid[0], per), *grid[1:])](
        x, some if y is None else y, some if yt is None else yt, rows, cu,
        some if py is None else py, some if pyt is None else pyt, rows if ps is None else ps,
        x if rotation is None else rotation, x if means is None else means, rows if seq is None else seq,
        *x.stride(), *(y.stride() if y is not None else zeros), *(yt.stride() if yt is not None else zeros),
        H, N, ps.shape[2] if ps is not None else 0, means.shape[2] if means is not None else 1, grid[0],
        D=D, BLOCK_T=block, BLOCK_D=configs.pow2(D),
        FMAX=FP8_MAX[fmt], E5M2=fmt == "e5m2", POW2=rounding == "pow2",
        WRITE_Y=y is not None, WRITE_YT=yt is not None, VARLEN=varlen, INTERP=INTERPRET,
        K_ORDER=bool(k_order), TILES=tiles, WRITE_S=scale is not None, WRITE_PY=py is not None,
        WRITE_PYT=pyt is not None, CENTER=means is not None, ROTATE=rotation is not None, PER_PROGRAM=per,
        num_warps=warps, num_stages=stages,
    )


def _check_transform(x, rotation, means, nseq):
    """The rotation (D, D) and means (B, H, nseq or 1, D) quantize takes: contiguous, in x's dtype."""
    B, H, _, D = x.shape
    if rotation is not None and (rotation.shape != (D, D) or rotation.dtype != x.dtype
                                 or not rotation.is_contiguous()):
        raise ValueError(f"rotation must be a contiguous ({D}, {D}) {x.dtype} matrix (outliers.rotation_matrices), "
                         f"got {tuple(rotation.shape)} {rotation.dtype}")
    if means is not None and (means.shape != (B, H, nseq, D) or means.dtype != x.dtype or not means.is_contiguous()):
        raise ValueError(f"means must be contiguous ({B}, {H}, {nseq}, {D}) {x.dtype} (outliers.key_means: one row "
                         f"per sequence), got {tuple(means.shape)} {means.dtype}")


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
        _token_major_kernel[(configs.cdiv(N, 128), B * H)](
            x8, y, src if src is not None else y, *x8.stride(), *y.stride(), H, N, D=D, BLOCK_T=128,
            BLOCK_D=configs.pow2(D), K_ORDER=bool(k_order), HAS_SRC=src is not None, num_warps=4)
    return y
