"""FP8 (or bf16/fp16) attention forward: QK^T and PV on the tensor cores, online softmax in fp32.

One program per (query block, batch*head, sequence). Keys are visited in `block`-sized tiles in order
(docs/numerics.md: the running max at each key tile decides how P is rounded), in three ranges:
  [lo, mid_lo)      masked   (tiles cut by the sliding window's left edge)
  [mid_lo, mid_hi)  unmasked (every row of the block sees every key: no mask arithmetic)
  [mid_hi, hi)      masked   (the causal diagonal and the key tail)
Tiles every row cannot see are skipped (exact, per the contract). Softmax runs in the log2 domain
(exp2, with log2(e) folded into the per-row score factor); LSE is stored in natural log.

fp8: S = (q8 @ k8^T) * sq * sk * softmax_scale; P8 = e4m3(P * 256); O += (P8 @ v8) * sv / 256. The
accumulator carries a running scale (the last tile's sv / 256), so the MMA accumulates in place instead of
into a second fp32 tile (which spilled). v8 is read from a (D, M) copy (tokens contiguous): the FP8 P @ V
needs a K-major B operand (with a row-major V, Triton transposes it through registers).
TMA=True (fp8, configs.use_tma): q8, k8, v8 come through tensor descriptors over 2-D views instead of
masked pointer loads (no masks on loads: the score masks do that work).
ASM_SCALES (all three kernels): whether a loop reads its per-tile scales through inline PTX (_scale); configs.asm_scales
chooses, per kernel and head dim.
"""

import triton
import triton.language as tl

from ._fp8 import cast_to, to_fp8

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _load_2d(ptrs, rows, cols, R_LIM, C_LIM, MASK_R: tl.constexpr, MASK_C: tl.constexpr):
    if MASK_R and MASK_C:
        return tl.load(ptrs, mask=(rows[:, None] < R_LIM) & (cols[None, :] < C_LIM), other=0.0)
    elif MASK_R:
        return tl.load(ptrs, mask=rows[:, None] < R_LIM, other=0.0)
    elif MASK_C:
        return tl.load(ptrs, mask=cols[None, :] < C_LIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _tile(X, row, col, offs_r, offs_c, s_r, s_c, R_LIM, C_LIM, MASK: tl.constexpr, MASK_C: tl.constexpr,
          TMA: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    """A (rows, cols) tile. Pointer path: masked load at X + offs_r * s_r + offs_c * s_c. TMA: X is a descriptor,
    read at [row, col] (token-major: a (cols, rows) box, transposed). Rows past R_LIM then hold zeros (a dense
    head's padding rows, ops._tma_rows; outside every sequence, docs/numerics.md; TMA's fill past the tensor) or
    the next sequence's tokens: the score masks give them P = 0, and plan.Seqs.whole_tiles keeps TMA off where a NaN
    there could reach an MMA (0 x NaN). (Zeroing them here instead cost the backward's dQ kernel ~1800 more byte
    permutes/selects in its masked loop, sm_90 SASS; the forward 70 more registers.)"""
    if TMA:
        if TOKEN_MAJOR:
            return tl.trans(X.load([row, col]))
        else:
            return X.load([row, col])
    else:
        return _load_2d(X + offs_r[:, None] * s_r + offs_c[None, :] * s_c, offs_r, offs_c, R_LIM, C_LIM,
                        MASK, MASK_C)


@triton.jit
def _grid_ids(n_tiles, head_group):
    """(tile, batch * head) of this program. The grid's first axis runs over n_tiles tiles x the heads, handed
    out head_group heads at a time and, within a group, tile-major: one tile index for each of the group's
    heads, then the next index. With the heaviest tiles first, a causal grid then ends on light tiles instead
    of on one head's heaviest (head_group = 1: head by head; configs.grid)."""
    pid = tl.program_id(0)
    heads = tl.num_programs(0) // n_tiles
    g0 = (pid // (head_group * n_tiles)) * head_group
    size = tl.minimum(head_group, heads - g0)
    within = pid - g0 * n_tiles
    return within // size, g0 + within % size


@triton.jit
def _scale(ptr, ASM: tl.constexpr):
    """One fp32 scale (a key or query tile's) read inside a loop over tiles. ASM: through inline PTX, which
    Triton's software pipeliner does not see; as a tl.load it becomes a cp.async copy into shared memory, and
    with that in the loop ptxas serializes every wgmma whenever an MMA is left in flight across iterations.
    Where the kernels use it: ASM_SCALES_HEAD_DIMS in configs.py."""
    if ASM:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=f,l", [ptr], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.load(ptr)


@triton.jit
def _per_row(x, SCALAR: tl.constexpr):
    """A per-row factor as a multiplier of a (rows, cols) tile: itself if scalar, else x[:, None]."""
    if SCALAR:
        return x
    else:
        return x[:, None]


@triton.jit
def _visible(rows, cols, n, m, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(rows, cols) mask in sequence-local coordinates: key tail, bottom-right causal, sliding window."""
    vis = cols[None, :] < m
    if CAUSAL:
        pos = rows[:, None] + (m - n)
        vis = vis & (cols[None, :] <= pos)
        if HAS_WINDOW:
            vis = vis & (cols[None, :] > pos - window)
    return vis


@triton.jit
def _seq_bounds(CUQ, CUK, pid_s, N, M, VARLEN: tl.constexpr):
    """(first query row, query count, first key row, key count) of this program's sequence."""
    if VARLEN:
        q0 = tl.load(CUQ + pid_s)
        n = tl.load(CUQ + pid_s + 1) - q0
        k0 = tl.load(CUK + pid_s)
        m = tl.load(CUK + pid_s + 1) - k0
    else:
        q0 = 0
        n = N
        k0 = 0
        m = M
    return q0, n, k0, m


@triton.jit
def _key_ranges(start_m, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, n, m, window,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key-tile bounds (multiples of BLOCK_N) for query rows [start_m, start_m + BLOCK_M): lo, mid_lo, mid_hi, hi."""
    full_hi = m
    hi = m
    lo = 0
    mid_lo = 0
    if CAUSAL:
        # last visible key of the block's last row, +1; first key that its first row cannot see
        hi = tl.minimum(m, tl.maximum(0, start_m + BLOCK_M + m - n))
        full_hi = tl.minimum(m, tl.maximum(0, start_m + m - n + 1))
        if HAS_WINDOW:
            lo = tl.maximum(0, start_m + m - n - window + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
            mid_lo = tl.maximum(0, start_m + BLOCK_M + m - n - window)
            mid_lo = tl.cdiv(mid_lo, BLOCK_N) * BLOCK_N
    hi = tl.cdiv(hi, BLOCK_N) * BLOCK_N
    if start_m >= n:  # a block past this sequence's end (varlen grids are sized for the longest)
        hi = 0
    lo = tl.minimum(lo, hi)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = (full_hi // BLOCK_N) * BLOCK_N
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _fwd_inner(acc, l_i, m_i, c_acc, q, row_f, K, V, SK, SV, skn, skd, svn, svd, k_row, v_row, k0,
               start_m, lo, hi, n, m, window,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
               DQK: tl.constexpr, DV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_WINDOW: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr, TMA: tl.constexpr,
               ASM_SCALES: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _tile(K, k_row + start_n, 0, offs_n, offs_dqk, skn, skd, m, DQK, MASK, BLOCK_DQK != DQK, TMA, False)
        v = _tile(V, v_row, k0 + start_n, offs_n, offs_dv, svn, svd, m, DV, MASK, BLOCK_DV != DV, TMA, True)
        if INTERP and not FP8:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k))
        f = row_f  # log2-domain score factor (scalar or per row); > 0, so max(qk) * f == max(qk * f) exactly
        if FP8:
            f = row_f * _scale(SK + start_n, ASM_SCALES)  # sk: one scale per key tile
        if MASK:
            qk = tl.where(_visible(offs_m, offs_n, n, m, window, CAUSAL, HAS_WINDOW), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * f)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: P = 0
        # One FFMA per score for S - max. fp8: P * 256 = exp2(S - max + 8), the static P scale folded into the
        # exponent, so l_i counts in units of 1/256 (undone exactly at the end).
        bias = m_safe
        if FP8:
            bias = m_safe - 8.0
        p = tl.exp2(qk * _per_row(f, BLOCK_M <= BLOCK_N) - bias[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            # acc is kept in units of the current tile's sv / 256 (c_acc) so the MMA accumulates straight
            # into it: no second 128 x D fp32 tile of registers for the product (that spilled).
            c = _scale(SV + start_n, ASM_SCALES) / 256.0
            acc = tl.dot(to_fp8(p, False, INTERP), v, acc * (alpha * (c_acc / c))[:, None])
            c_acc = c
        elif INTERP:
            acc = tl.dot(cast_to(p, V.dtype.element_ty, INTERP).to(tl.float32), v, acc * alpha[:, None])
        else:
            acc = tl.dot(p.to(V.dtype.element_ty), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i, c_acc


@triton.jit
def _fwd_kernel(
    Q, K, V, SQ, SK, SV, O, LSE, CUQ, CUK,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, son, sod,
    Hq, Hkv, N, M, softmax_scale, window, n_tiles, head_group,
    GROUPS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr, FP8: tl.constexpr,
    INTERP: tl.constexpr, TMA: tl.constexpr,  # TMA: Q, K, V are tensor descriptors (fp8, see forward())
    ASM_SCALES: tl.constexpr,
):
    t, pid_bh = _grid_ids(n_tiles, head_group)
    pid_m = n_tiles - 1 - t  # heaviest (last, under causal) query blocks first: better tail balance
    pid_s = tl.program_id(2)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUPS
    q0, n, k0, m = _seq_bounds(CUQ, CUK, pid_s, N, M, VARLEN)
    start_m = pid_m * BLOCK_M
    b64 = b.to(tl.int64)
    Qb, Kb, Vb = Q, K, V
    if not TMA:
        Qb = Q + b64 * sqb + h.to(tl.int64) * sqh + q0.to(tl.int64) * sqn
        Kb = K + b64 * skb + hk.to(tl.int64) * skh + k0.to(tl.int64) * skn
        Vb = V + b64 * svb + hk.to(tl.int64) * svh + k0.to(tl.int64) * svn
    SKb = SK + (b64 * Hkv + hk) * M + k0
    SVb = SV + (b64 * Hkv + hk) * M + k0

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    # TMA: row offsets into the 2-D views the descriptors cover ((B*Hq*Rq, Dqk), (B*Hkv*Rk, Dqk), (B*Hkv*Dv, M)),
    # R a head's rows in q8 / k8 (ops._desc)
    k_row = (b * Hkv + hk) * (skh // skn) + k0
    v_row = (b * Hkv + hk) * DV
    q = _tile(Qb, (b * Hq + h) * (sqh // sqn) + q0 + start_m, 0, offs_m, offs_dqk, sqn, sqd, n, DQK, True,
              BLOCK_DQK != DQK, TMA, False)
    if INTERP and not FP8:
        q = q.to(tl.float32)
    # BLOCK_M <= BLOCK_N: the block lies in one quantization tile of q (blocks and tiles both start at each
    # sequence start), so its score factor is one scalar rather than a per-row vector (fewer registers).
    if BLOCK_M <= BLOCK_N:
        row_f = softmax_scale * 1.4426950408889634
        if FP8:
            row_f = row_f * tl.load(SQ + pid_bh.to(tl.int64) * N + q0 + start_m, mask=start_m < n, other=1.0)
    else:
        row_f = tl.zeros([BLOCK_M], tl.float32) + softmax_scale * 1.4426950408889634
        if FP8:
            row_f = row_f * tl.load(SQ + pid_bh.to(tl.int64) * N + q0 + offs_m, mask=offs_m < n, other=1.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    c_acc = softmax_scale * 0.0 + 1.0  # runtime fp32 scalar: acc's unit (fp8: sv / 256 of the last key tile)
    lo, mid_lo, mid_hi, hi = _key_ranges(start_m, BLOCK_M, BLOCK_N, n, m, window, CAUSAL, HAS_WINDOW)
    args = (q, row_f, Kb, Vb, SKb, SVb, skn, skd, svn, svd, k_row, v_row, k0, start_m)
    if HAS_WINDOW:
        acc, l_i, m_i, c_acc = _fwd_inner(acc, l_i, m_i, c_acc, *args, lo, mid_lo, n, m, window, BLOCK_M, BLOCK_N,
                                          BLOCK_DQK, BLOCK_DV, DQK, DV, True, CAUSAL, HAS_WINDOW, FP8, INTERP, TMA,
                                          ASM_SCALES)
    acc, l_i, m_i, c_acc = _fwd_inner(acc, l_i, m_i, c_acc, *args, mid_lo, mid_hi, n, m, window, BLOCK_M, BLOCK_N,
                                      BLOCK_DQK, BLOCK_DV, DQK, DV, False, CAUSAL, HAS_WINDOW, FP8, INTERP, TMA,
                                      ASM_SCALES)
    acc, l_i, m_i, c_acc = _fwd_inner(acc, l_i, m_i, c_acc, *args, mid_hi, hi, n, m, window, BLOCK_M, BLOCK_N,
                                      BLOCK_DQK, BLOCK_DV, DQK, DV, True, CAUSAL, HAS_WINDOW, FP8, INTERP, TMA,
                                      ASM_SCALES)

    if FP8:
        l_i = l_i * 0.00390625  # P * 256 was summed: back to P (a power of two, exact)
    has = l_i != 0.0  # NaN (a non-finite input) included: out and lse NaN
    l_safe = tl.where(has, l_i, 1.0)
    out = acc * (c_acc / l_safe)[:, None]
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    if not FP8:  # l = 0 in a row that sees a key: every visible score -inf (an inf input): NaN, as exact attention
        # (fp8 scores are finite or NaN: the quantized operands hold no inf)
        sees = m > 0
        if CAUSAL:
            sees = sees & (offs_m + (m - n) >= 0)
        bad = sees & (l_i == 0.0)
        out = tl.where(bad[:, None], float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
    Ob = O + b64 * sob + h.to(tl.int64) * soh + q0.to(tl.int64) * son
    tl.store(Ob + offs_m[:, None] * son + offs_dv[None, :] * sod, cast_to(out, O.dtype.element_ty, INTERP),
             mask=(offs_m[:, None] < n) & (offs_dv[None, :] < DV))
    tl.store(LSE + pid_bh.to(tl.int64) * N + q0 + offs_m, lse, mask=offs_m < n)
