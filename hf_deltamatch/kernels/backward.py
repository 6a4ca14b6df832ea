"""Backward: the correction pass + dQ (query-major) and dK/dV (key-major), no atomics.

Kernel 1, `_bwd_dq_kernel`, one program per BLOCK_M-row query block (64 or 128 = one or two dS tiles of
DS_TILE_Q = 64 rows, each with its own scale):
  pass 1 (delta="matching", the correction pass): over the visible key tiles recompute S from q8/k8,
          P = exp(S - LSE) in fp32, dP = (dO8 @ v8^T) * sdo * sv in fp32, delta += rowsum(P * dP).
          (delta="stale": delta = rowsum(dO * O) from the high-precision dO and out instead.)
  pass 2: the same S, P, dP again; dS = P * (dP - delta) in fp32, quantized per 64 x block tile with a
          dynamic scale; dQ += (dS8 @ k8) * sds * sk. Writes dQ and delta (for kernel 2), and where
          configs.dkdv_ds_scales says so each dS tile's scale (DSS).
Kernel 2, `_bwd_dkdv_kernel`, one program per key tile per KV head, looping over the GQA group's query
  heads and the query tiles that see it (so dK/dV sum over the group without atomics):
  S^T, P^T, dP^T, dS^T as above (same tile, same dynamic scale: its own absmax, or kernel 1's scale, which lets
  a program cover part of a dS tile's keys, configs.dkdv_block_n), dV += (P8^T @ dO8) * sdo / 256,
  dK += (dS8^T @ q8) * sds * sq. Above D=128 it runs twice, for dV alone (PART 1: no dP, no dS) and for dK
  alone (PART 2), so a program holds one BLOCK_N x D accumulator, not two (configs.DKDV_SPLIT_ABOVE).
Everything is deterministic (dQ is written once by its owner), so config.deterministic costs nothing.
FP8 operands contracted over tokens (dO and q in kernel 2, k in kernel 1) are read from (D, N) copies
(tokens contiguous) so every FP8 matmul gets K-major operands. TMA=True in kernel 1 (configs.use_tma): k8, its
token-major copy and v8 come through tensor descriptors (see _tile for the rows they read past a sequence).
"""

import triton
import triton.language as tl

from ._fp8 import acc_units, cast_to, tile_scale, to_fp8
from .forward import _grid_ids, _key_ranges, _load_2d, _per_row, _scale, _seq_bounds, _tile, _visible


@triton.jit
def _p_dp(q, do, lse2, s_f, dp_f, K, V, skn, skd, svn, svd, kv_row, offs_m, offs_n, n, m, window,
          BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
          MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FP8: tl.constexpr,
          INTERP: tl.constexpr, ONE_TILE: tl.constexpr, TMA: tl.constexpr, RAW_DP: tl.constexpr):
    """P = exp(S - LSE) and dP (fp32, scales applied unless RAW_DP) for query rows offs_m and keys offs_n; also
    returns k. TMA: K, V are descriptors and kv_row the tile's first row in them (see _tile)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _tile(K, kv_row, 0, offs_n, offs_dqk, skn, skd, m, DQK, MASK, BLOCK_DQK != DQK, TMA, False)
    v = _tile(V, kv_row, 0, offs_n, offs_dv, svn, svd, m, DV, MASK, BLOCK_DV != DV, TMA, False)
    if INTERP and not FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * _per_row(s_f, ONE_TILE)
    dp = tl.dot(do, tl.trans(v))
    if FP8 and not RAW_DP:
        dp = dp * _per_row(dp_f, ONE_TILE)
    if MASK:
        s = tl.where(_visible(offs_m, offs_n, n, m, window, CAUSAL, HAS_WINDOW), s, float("-inf"))
    return tl.exp2(s - lse2[:, None]), dp, k


@triton.jit
def _dq_inner(dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, K, KT, V, SK, SV, DSS, skn, skd, ktn, ktd,
              svn, svd, dss_tk, kv_row, kt_row, k0, start_m, lo, hi, n, m, window,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              DQK: tl.constexpr, DV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, FP8: tl.constexpr, PASS1: tl.constexpr, ROW_SUMS: tl.constexpr,
              FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, INTERP: tl.constexpr,
              DS_Q: tl.constexpr, ONE_TILE: tl.constexpr, TMA: tl.constexpr, ASM_SCALES: tl.constexpr,
              SCALE_AFTER_SUM: tl.constexpr, DSS_OUT: tl.constexpr):
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # ONE_TILE (BLOCK_M == DS_Q): row_f, dp_f, c_dq are scalars (one quantization tile holds the
        # block's rows); otherwise per-row vectors. Scalars keep the 64-row kernel's registers low.
        s_f = row_f
        dpf = dp_f
        if FP8:
            s_f = row_f * _scale(SK + start_n, ASM_SCALES)
            dpf = dp_f * _scale(SV + start_n, ASM_SCALES)
        fold = PASS1 and FP8 and SCALE_AFTER_SUM
        p, dp, k = _p_dp(q, do, lse2, s_f, dpf, K, V, skn, skd, svn, svd, kv_row + start_n, offs_m, offs_n, n, m,
                         window, BLOCK_DQK, BLOCK_DV, DQK, DV, MASK, CAUSAL, HAS_WINDOW, FP8, INTERP, ONE_TILE, TMA,
                         fold)
        if fold:  # the tile's dP scale (per row) applied to its row sums, not to each dP: one FMUL per score less
            delta += tl.sum(p * dp, 1) * dpf
        elif PASS1:
            delta += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            if ROW_SUMS:
                rs += tl.sum(ds, 1)
                ra += tl.sum(tl.abs(ds), 1)
            if FP8:
                # one dynamic scale per dS tile of DS_Q rows x BLOCK_N keys (BLOCK_M holds 1 or 2 of them)
                amax = tl.max(tl.abs(ds), 1)
                if ONE_TILE:
                    sds = tile_scale(tl.max(amax, 0), FMAX, POW2)
                    if DSS_OUT:  # for the dK/dV kernel (configs.dkdv_ds_scales)
                        tl.store(DSS + start_n // BLOCK_N, sds, mask=start_m < n)
                else:
                    sub = tile_scale(tl.max(tl.reshape(amax, (BLOCK_M // DS_Q, DS_Q)), 1), FMAX, POW2)
                    sds = tl.reshape(tl.broadcast_to(sub[:, None], (BLOCK_M // DS_Q, DS_Q)), (BLOCK_M,))
                    if DSS_OUT:  # a sub-tile past the sequence's end is not a tile: its slot may be the next's
                        i = tl.arange(0, BLOCK_M // DS_Q)
                        tl.store(DSS + i * dss_tk + start_n // BLOCK_N, sub, mask=start_m + i * DS_Q < n)
                # dq is kept in units of the last tile's sds * sk (or of _fp8.acc_units' floor, which keeps it
                # finite), the tile quantized at sk / units (1 / sds but at the floor). Multiplied: Triton's fp32 `/`
                # is div.full.f32, one MUFU op per element, and the MUFU unit is already busy with exp2
                sk_t = _scale(SK + start_n, ASM_SCALES)
                u, c_max = acc_units(sds * sk_t, c_max)
                r = _per_row(sk_t / u, ONE_TILE)
                kt = _tile(KT, kt_row, k0 + start_n, offs_n, offs_dqk, ktn, ktd, m, DQK, MASK, BLOCK_DQK != DQK,
                           TMA, True)
                dq = tl.dot(to_fp8(ds * r, E5M2, INTERP), kt, dq * _per_row(c_dq / u, ONE_TILE))
                c_dq = u
            else:
                dq = tl.dot(cast_to(ds, K.dtype.element_ty, INTERP).to(k.dtype), k, dq)
    return dq, c_dq, c_max, delta, rs, ra


@triton.jit
def _dq_sweep(dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, K, KT, V, SK, SV, DSS, skn, skd, ktn, ktd, svn,
              svd, dss_tk, kv_row, kt_row, k0, start_m, lo, mid_lo, mid_hi, hi, n, m, window,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
              DQK: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              FP8: tl.constexpr, PASS1: tl.constexpr, ROW_SUMS: tl.constexpr, FMAX: tl.constexpr,
              E5M2: tl.constexpr, POW2: tl.constexpr, INTERP: tl.constexpr, DS_Q: tl.constexpr,
              ONE_TILE: tl.constexpr, TMA: tl.constexpr, ASM_SCALES: tl.constexpr,
              SCALE_AFTER_SUM: tl.constexpr, DSS_OUT: tl.constexpr):
    """One pass over a query block's visible key tiles: the window's masked edge [lo, mid_lo) (only with a
    window), the unmasked middle [mid_lo, mid_hi), the masked diagonal/tail [mid_hi, hi). Inlined by Triton."""
    if HAS_WINDOW:
        dq, c_dq, c_max, delta, rs, ra = _dq_inner(
            dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, K, KT, V, SK, SV, DSS, skn, skd, ktn, ktd,
            svn, svd, dss_tk, kv_row, kt_row, k0, start_m, lo, mid_lo, n, m, window, BLOCK_M, BLOCK_N, BLOCK_DQK,
            BLOCK_DV, DQK, DV, True, CAUSAL, HAS_WINDOW, FP8, PASS1, ROW_SUMS, FMAX, E5M2, POW2, INTERP, DS_Q, ONE_TILE,
            TMA, ASM_SCALES, SCALE_AFTER_SUM, DSS_OUT)
    dq, c_dq, c_max, delta, rs, ra = _dq_inner(
        dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, K, KT, V, SK, SV, DSS, skn, skd, ktn, ktd, svn, svd,
        dss_tk, kv_row, kt_row, k0, start_m, mid_lo, mid_hi, n, m, window, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        DQK, DV, False, CAUSAL, HAS_WINDOW, FP8, PASS1, ROW_SUMS, FMAX, E5M2, POW2, INTERP, DS_Q, ONE_TILE, TMA,
        ASM_SCALES, SCALE_AFTER_SUM, DSS_OUT)
    dq, c_dq, c_max, delta, rs, ra = _dq_inner(
        dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, K, KT, V, SK, SV, DSS, skn, skd, ktn, ktd, svn, svd,
        dss_tk, kv_row, kt_row, k0, start_m, mid_hi, hi, n, m, window, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV,
        DQK, DV, True, CAUSAL, HAS_WINDOW, FP8, PASS1, ROW_SUMS, FMAX, E5M2, POW2, INTERP, DS_Q, ONE_TILE, TMA,
        ASM_SCALES, SCALE_AFTER_SUM, DSS_OUT)
    return dq, c_dq, c_max, delta, rs, ra


@triton.jit
def _bwd_dq_kernel(
    Q, K, KT, V, DO, SQ, SK, SV, SDO, LSE, DOHP, O, DQ, DELTA, LSE2, RS, RA, DSS, CUQ, CUK,
    sqb, sqh, sqn, sqd, skb, skh, skn, skd, ktb, kth, ktn, ktd, svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod, shb, shh, shn, shd, sob, soh, son, sod, sdqb, sdqh, sdqn, sdqd,
    Hq, Hkv, N, M, softmax_scale, window, n_tiles, head_group, dss_tq, dss_tk,
    GROUPS: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr, FP8: tl.constexpr,
    STALE: tl.constexpr, ROW_SUMS: tl.constexpr, FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr,
    INTERP: tl.constexpr, DS_Q: tl.constexpr, ONE_TILE: tl.constexpr,  # ONE_TILE: BLOCK_M == DS_Q
    TMA: tl.constexpr,  # K, KT, V are tensor descriptors over 2-D views of k8, k8 token-major, v8
    ASM_SCALES: tl.constexpr,
    SCALE_AFTER_SUM: tl.constexpr,  # the correction pass scales each tile's sum of P * dP, not each dP
    LSE2_OUT: tl.constexpr, P_SHIFT: tl.constexpr,  # write LSE2 = LSE * log2(e) - P_SHIFT for _bwd_dkdv_kernel
    DSS_OUT: tl.constexpr,  # write each dS tile's scale for _bwd_dkdv_kernel (at _dss_row)
):
    t, pid_bh = _grid_ids(n_tiles, head_group)
    pid_m = n_tiles - 1 - t  # heaviest query blocks first
    pid_s = tl.program_id(2)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // GROUPS
    q0, n, k0, m = _seq_bounds(CUQ, CUK, pid_s, N, M, VARLEN)
    start_m = pid_m * BLOCK_M
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    q064 = q0.to(tl.int64)
    Kb, KTb, Vb = K, KT, V
    if not TMA:
        Kb = K + b64 * skb + hk64 * skh + k0.to(tl.int64) * skn
        KTb = KT + b64 * ktb + hk64 * kth + k0.to(tl.int64) * ktn
        Vb = V + b64 * svb + hk64 * svh + k0.to(tl.int64) * svn
    kv_row = (b * Hkv + hk) * (skh // skn) + k0  # TMA: rows of the (B*Hkv*Rk, D) views (ops._desc), and of the
    # (B*Hkv*Dqk, M) view of k8t
    kt_row = (b * Hkv + hk) * DQK
    SKb = SK + (b64 * Hkv + hk) * M + k0
    SVb = SV + (b64 * Hkv + hk) * M + k0
    row0 = pid_bh.to(tl.int64) * N + q0  # offset of this sequence in the (B, H, N) fp32 row arrays
    DSSm = DSS + _dss_row(pid_bh, q0, pid_s, dss_tq, DS_Q) * dss_tk + (start_m // DS_Q) * dss_tk

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    rmask = offs_m < n
    q = _load_2d(Q + b64 * sqb + h64 * sqh + q064 * sqn + offs_m[:, None] * sqn + offs_dqk[None, :] * sqd,
                 offs_m, offs_dqk, n, DQK, True, BLOCK_DQK != DQK)
    do = _load_2d(DO + b64 * sdob + h64 * sdoh + q064 * sdon + offs_m[:, None] * sdon + offs_dv[None, :] * sdod,
                  offs_m, offs_dv, n, DV, True, BLOCK_DV != DV)
    if INTERP and not FP8:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    # -inf LSE (no visible key) or a row past the end: +inf makes P = exp2(S - inf) = 0 without NaN
    lse = tl.load(LSE + row0 + offs_m, mask=rmask, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    if ONE_TILE:  # the 64-row block lies inside one quantization tile (block 64 or 128): scalar scales
        row_f = softmax_scale * 1.4426950408889634
        dp_f = softmax_scale * 0.0 + 1.0
        c_dq = softmax_scale * 0.0 + 1.0  # dq is kept in units of c_dq (fp8: sds * sk of the last key tile)
        c_max = softmax_scale * 0.0  # the largest sds * sk so far (_fp8.acc_units)
        if FP8:
            row_f = row_f * tl.load(SQ + row0 + start_m, mask=start_m < n, other=1.0)
            dp_f = tl.load(SDO + row0 + start_m, mask=start_m < n, other=1.0)
    else:
        row_f = tl.zeros([BLOCK_M], tl.float32) + softmax_scale * 1.4426950408889634
        dp_f = tl.zeros([BLOCK_M], tl.float32) + 1.0
        c_dq = tl.zeros([BLOCK_M], tl.float32) + 1.0  # per row: two dS tiles, two scales
        c_max = tl.zeros([BLOCK_M], tl.float32)
        if FP8:
            row_f = row_f * tl.load(SQ + row0 + offs_m, mask=rmask, other=1.0)
            dp_f = tl.load(SDO + row0 + offs_m, mask=rmask, other=1.0)

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    delta = tl.zeros([BLOCK_M], tl.float32)
    rs = tl.zeros([BLOCK_M], tl.float32)
    ra = tl.zeros([BLOCK_M], tl.float32)
    lo, mid_lo, mid_hi, hi = _key_ranges(start_m, BLOCK_M, BLOCK_N, n, m, window, CAUSAL, HAS_WINDOW)
    if STALE:
        dohp = _load_2d(DOHP + b64 * shb + h64 * shh + q064 * shn + offs_m[:, None] * shn + offs_dv[None, :] * shd,
                        offs_m, offs_dv, n, DV, True, BLOCK_DV != DV).to(tl.float32)
        o = _load_2d(O + b64 * sob + h64 * soh + q064 * son + offs_m[:, None] * son + offs_dv[None, :] * sod,
                     offs_m, offs_dv, n, DV, True, BLOCK_DV != DV).to(tl.float32)
        delta = tl.sum(dohp * o, 1)
    else:  # the correction pass
        dq, c_dq, c_max, delta, rs, ra = _dq_sweep(
            dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, Kb, KTb, Vb, SKb, SVb, DSSm,
            skn, skd, ktn, ktd, svn, svd, dss_tk, kv_row, kt_row, k0, start_m, lo, mid_lo, mid_hi, hi, n, m, window,
            BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, DQK, DV, CAUSAL, HAS_WINDOW, FP8, True, ROW_SUMS,
            FMAX, E5M2, POW2, INTERP, DS_Q, ONE_TILE, TMA, ASM_SCALES, SCALE_AFTER_SUM, False)
    dq, c_dq, c_max, delta, rs, ra = _dq_sweep(
        dq, c_dq, c_max, delta, rs, ra, q, do, lse2, row_f, dp_f, Kb, KTb, Vb, SKb, SVb, DSSm,
        skn, skd, ktn, ktd, svn, svd, dss_tk, kv_row, kt_row, k0, start_m, lo, mid_lo, mid_hi, hi, n, m, window,
        BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, DQK, DV, CAUSAL, HAS_WINDOW, FP8, False, ROW_SUMS,
        FMAX, E5M2, POW2, INTERP, DS_Q, ONE_TILE, TMA, ASM_SCALES, SCALE_AFTER_SUM, DSS_OUT)
    dq = dq * _per_row(c_dq * softmax_scale, ONE_TILE)
    tl.store(DQ + b64 * sdqb + h64 * sdqh + q064 * sdqn + offs_m[:, None] * sdqn + offs_dqk[None, :] * sdqd,
             cast_to(dq, DQ.dtype.element_ty, INTERP), mask=rmask[:, None] & (offs_dqk[None, :] < DQK))
    tl.store(DELTA + row0 + offs_m, delta, mask=rmask)
    if LSE2_OUT:
        tl.store(LSE2 + row0 + offs_m, lse2 - P_SHIFT, mask=rmask)
    if ROW_SUMS:
        tl.store(RS + row0 + offs_m, rs, mask=rmask)
        tl.store(RA + row0 + offs_m, ra, mask=rmask)


@triton.jit
def _dss_row(bh, q0, pid_s, dss_tq, DS_Q: tl.constexpr):
    """Row of a sequence's first dS tile in the (B*Hq, dss_tq, dss_tk) tile-scale array: q0 // DS_Q + the sequence
    index keeps sequences that share a DS_Q-token stretch apart (varlen starts need not be multiples of DS_Q)."""
    return bh.to(tl.int64) * dss_tq + q0 // DS_Q + pid_s


@triton.jit
def _query_ranges(start_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, n, m, window,
                  CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query-tile bounds (multiples of BLOCK_M) that see keys [start_n, start_n + BLOCK_N)."""
    lo = 0
    hi = n
    full_lo = 0
    full_hi = (n // BLOCK_M) * BLOCK_M  # a row tail needs row masks on the loads
    if CAUSAL:
        lo = tl.maximum(0, start_n + n - m)  # first row that sees key start_n
        lo = (lo // BLOCK_M) * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(0, start_n + BLOCK_N - 1 + n - m), BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(n, tl.maximum(0, start_n + BLOCK_N - 1 + n - m + window))
            full_hi = tl.minimum(full_hi, (tl.maximum(0, start_n + n - m + window) // BLOCK_M) * BLOCK_M)
    hi = tl.cdiv(hi, BLOCK_M) * BLOCK_M
    if start_n + BLOCK_N > m:  # key tail (or a tile past the end): mask everything
        full_hi = 0
    lo = tl.minimum(lo, hi)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _pt_dst(k, v, Q, DO, LSE, DELTA, st_f, dp_f, sqn, sqd, sdon, sdod, offs_m, offs_n, n, m, window,
            BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr,
            MASK: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, FP8: tl.constexpr,
            INTERP: tl.constexpr, LSE2_IN: tl.constexpr, P_SHIFT: tl.constexpr, PART: tl.constexpr):
    """P^T and dS^T (fp32, keys x queries) of keys offs_n and queries offs_m, both times 2^P_SHIFT; also the
    loaded q, dO. PART 1 (dV only): no dS^T (P^T stands in for it) and, with FP8, no row-major dO (q stands
    in)."""
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    # the pointer path of _tile, the tile loader of every kernel (this one has no TMA path)
    q = _tile(Q, 0, 0, offs_m, offs_dqk, sqn, sqd, n, DQK, MASK, BLOCK_DQK != DQK, False, False)
    if INTERP and not FP8:
        q = q.to(tl.float32)
    do = q
    if PART != 1 or not FP8:  # dP needs dO; so does bf16's dV (its dO operand is the row-major tile)
        do = _tile(DO, 0, 0, offs_m, offs_dv, sdon, sdod, n, DV, MASK, BLOCK_DV != DV, False, False)
        if INTERP and not FP8:
            do = do.to(tl.float32)
    if MASK:
        lse = tl.load(LSE + offs_m, mask=offs_m < n, other=float("inf"))
        if PART != 1:
            delta = tl.load(DELTA + offs_m, mask=offs_m < n, other=0.0)
    else:
        lse = tl.load(LSE + offs_m)
        if PART != 1:
            delta = tl.load(DELTA + offs_m)
    if LSE2_IN:  # the dQ kernel's LSE2 (already in base 2, minus P_SHIFT)
        lse2 = lse
    else:
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634) - P_SHIFT
    st = tl.dot(k, tl.trans(q)) * st_f  # S^T (keys x queries)
    dpt = st
    if PART != 1:
        dpt = tl.dot(v, tl.trans(do))
        if FP8:
            dpt = dpt * dp_f
    if MASK:  # _visible, transposed: (keys, queries)
        vis = offs_n[:, None] < m
        if CAUSAL:
            pos = offs_m[None, :] + (m - n)
            vis = vis & (offs_n[:, None] <= pos)
            if HAS_WINDOW:
                vis = vis & (offs_n[:, None] > pos - window)
        st = tl.where(vis, st, float("-inf"))
    pt = tl.exp2(st - lse2[None, :])
    if PART == 1:
        dst = pt
    else:
        dst = pt * (dpt - delta[None, :])
    return pt, dst, q, do


@triton.jit
def _dkdv_inner(dk, dv, c_dk, ck_max, c_dv, k, v, Q, QT, DO, DOT, SQ, SDO, LSE, DELTA, DSS, col_f, dp_f,
                sqn, sqd, qtn, qtd, sdon, sdod, dtn, dtd, dss_tk, start_n, lo, hi, n, m, window,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
                DQK: tl.constexpr, DV: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_WINDOW: tl.constexpr, FP8: tl.constexpr,
                FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, INTERP: tl.constexpr,
                ASM_SCALES: tl.constexpr, LSE2_IN: tl.constexpr, P_SHIFT: tl.constexpr, PART: tl.constexpr,
                DSS_IN: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        st_f = col_f
        dpf = dp_f
        if FP8:
            sq_t = _scale(SQ + start_m, ASM_SCALES)  # one quantization tile holds the whole 64-row query tile
            sdo_t = _scale(SDO + start_m, ASM_SCALES)
            st_f = col_f * sq_t
            dpf = dp_f * sdo_t
        pt, dst, q, do = _pt_dst(k, v, Q, DO, LSE, DELTA, st_f, dpf, sqn, sqd, sdon, sdod, offs_m, offs_n, n, m,
                                 window, BLOCK_DQK, BLOCK_DV, DQK, DV, MASK, CAUSAL, HAS_WINDOW, FP8, INTERP, LSE2_IN,
                                 P_SHIFT, PART)
        if FP8:
            # dk, dv are kept in units of the last tile's scale (c_dk, c_dv): the MMA accumulates in place
            if PART != 2:
                cv = sdo_t / 256.0
                dot_ = _tile(DOT, 0, 0, offs_m, offs_dv, dtn, dtd, n, DV, MASK, BLOCK_DV != DV, False, True)
                # P * 256, the static scale: exp2 gives it directly when P_SHIFT = 8 (the shift is in LSE2)
                p256 = pt
                if P_SHIFT != 8:
                    p256 = pt * (256.0 / (1 << P_SHIFT))
                dv = tl.dot(to_fp8(p256, False, INTERP), dot_, dv * (c_dv / cv))
                c_dv = cv
            if PART != 1:
                if DSS_IN:  # the dQ kernel's scale of this tile (configs.dkdv_ds_scales)
                    sds = _scale(DSS + (start_m // BLOCK_M) * dss_tk, ASM_SCALES)
                else:
                    # dst is dS^T * 2^P_SHIFT: the powers of two are exact, so sds is the same as from dS^T
                    amax = tl.max(tl.max(tl.abs(dst), 1), 0) * (1.0 / (1 << P_SHIFT))
                    sds = tile_scale(amax, FMAX, POW2)
                # dk is kept in units of the last tile's sds * sq or acc_units' floor; r multiplies (_dq_inner)
                uk, ck_max = acc_units(sds * sq_t, ck_max)
                r = sq_t * (1.0 / (1 << P_SHIFT)) / uk
                qt = _tile(QT, 0, 0, offs_m, offs_dqk, qtn, qtd, n, DQK, MASK, BLOCK_DQK != DQK, False, True)
                dk = tl.dot(to_fp8(dst * r, E5M2, INTERP), qt, dk * (c_dk / uk))
                c_dk = uk
        else:
            if PART != 2:
                dv = tl.dot(cast_to(pt, Q.dtype.element_ty, INTERP).to(do.dtype), do, dv)
            if PART != 1:
                dk = tl.dot(cast_to(dst, Q.dtype.element_ty, INTERP).to(q.dtype), q, dk)
    return dk, dv, c_dk, ck_max, c_dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, QT, K, V, DO, DOT, SQ, SK, SV, SDO, LSE, DELTA, DSS, DK, DV, CUQ, CUK,
    sqb, sqh, sqn, sqd, qtb, qth, qtn, qtd, skb, skh, skn, skd, svb, svh, svn, svd,
    sdob, sdoh, sdon, sdod, dtb, dth, dtn, dtd, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
    Hq, Hkv, N, M, softmax_scale, window, n_tiles, head_group, dss_tq, dss_tk,
    GROUPS: tl.constexpr, DQK: tl.constexpr, DV_: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr, FP8: tl.constexpr,
    FMAX: tl.constexpr, E5M2: tl.constexpr, POW2: tl.constexpr, INTERP: tl.constexpr,
    ASM_SCALES: tl.constexpr,
    LSE2_IN: tl.constexpr,  # LSE holds the dQ kernel's LSE2 (log2 units, P_SHIFT subtracted), not the LSE
    P_SHIFT: tl.constexpr,  # 8 (fp8 only): exp2 yields P * 256, the value quantized for P^T dO
    PART: tl.constexpr,  # 0: dK and dV; 1: dV only (no dP, no dS); 2: dK only (configs.dkdv_parts)
    DSS_IN: tl.constexpr,  # read each dS tile's scale from the dQ kernel's DSS instead of the tile's absmax
    DS_K: tl.constexpr,  # keys per dS tile (the block); BLOCK_N may be a divisor of it only with DSS_IN
):
    pid_n, pid_bh = _grid_ids(n_tiles, head_group)  # pid_bh over B * Hkv; the heaviest key tiles (first) first
    pid_s = tl.program_id(2)
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    q0, n, k0, m = _seq_bounds(CUQ, CUK, pid_s, N, M, VARLEN)
    start_n = pid_n * BLOCK_N
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    k064 = k0.to(tl.int64)
    q064 = q0.to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_2d(K + b64 * skb + hk64 * skh + k064 * skn + offs_n[:, None] * skn + offs_dqk[None, :] * skd,
                 offs_n, offs_dqk, m, DQK, True, BLOCK_DQK != DQK)
    v = _load_2d(V + b64 * svb + hk64 * svh + k064 * svn + offs_n[:, None] * svn + offs_dv[None, :] * svd,
                 offs_n, offs_dv, m, DV_, True, BLOCK_DV != DV_)
    if INTERP and not FP8:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    col_f = softmax_scale * 1.4426950408889634
    dp_f = 1.0
    if FP8:
        kv_row = (b64 * Hkv + hk) * M + k0 + start_n
        col_f = col_f * tl.load(SK + kv_row, mask=start_n < m, other=1.0)
        dp_f = tl.load(SV + kv_row, mask=start_n < m, other=1.0)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    c_dk = softmax_scale * 0.0 + 1.0  # dk, dv are kept in units of c_dk, c_dv (the last tile scales)
    ck_max = softmax_scale * 0.0  # the largest sds * sq so far (_fp8.acc_units)
    c_dv = softmax_scale * 0.0 + 1.0
    lo, mid_lo, mid_hi, hi = _query_ranges(start_n, BLOCK_M, BLOCK_N, n, m, window, CAUSAL, HAS_WINDOW)
    if start_n >= m:
        hi = 0
        lo = 0
        mid_lo = 0
        mid_hi = 0
    for g in range(GROUPS):  # GQA: this KV head's query heads, summed here (no atomics)
        h64 = hk64 * GROUPS + g
        bh = b64 * Hq + h64
        Qg = Q + b64 * sqb + h64 * sqh + q064 * sqn
        QTg = QT + b64 * qtb + h64 * qth + q064 * qtn
        DOg = DO + b64 * sdob + h64 * sdoh + q064 * sdon
        DOTg = DOT + b64 * dtb + h64 * dth + q064 * dtn
        SQg = SQ + bh * N + q0
        SDOg = SDO + bh * N + q0
        LSEg = LSE + bh * N + q0
        DELTAg = DELTA + bh * N + q0
        DSSg = DSS + _dss_row(bh, q0, pid_s, dss_tq, BLOCK_M) * dss_tk + start_n // DS_K  # BLOCK_M: the tile's rows
        dk, dv, c_dk, ck_max, c_dv = _dkdv_inner(
            dk, dv, c_dk, ck_max, c_dv, k, v, Qg, QTg, DOg, DOTg, SQg, SDOg, LSEg, DELTAg, DSSg, col_f, dp_f, sqn, sqd,
            qtn, qtd, sdon, sdod, dtn, dtd, dss_tk, start_n, lo, mid_lo, n, m, window,
            BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, DQK, DV_, True, CAUSAL, HAS_WINDOW, FP8, FMAX, E5M2, POW2, INTERP,
            ASM_SCALES, LSE2_IN, P_SHIFT, PART, DSS_IN)
        dk, dv, c_dk, ck_max, c_dv = _dkdv_inner(
            dk, dv, c_dk, ck_max, c_dv, k, v, Qg, QTg, DOg, DOTg, SQg, SDOg, LSEg, DELTAg, DSSg, col_f, dp_f, sqn, sqd,
            qtn, qtd, sdon, sdod, dtn, dtd, dss_tk, start_n, mid_lo, mid_hi, n, m, window,
            BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, DQK, DV_, False, CAUSAL, HAS_WINDOW, FP8, FMAX, E5M2, POW2, INTERP,
            ASM_SCALES, LSE2_IN, P_SHIFT, PART, DSS_IN)
        dk, dv, c_dk, ck_max, c_dv = _dkdv_inner(
            dk, dv, c_dk, ck_max, c_dv, k, v, Qg, QTg, DOg, DOTg, SQg, SDOg, LSEg, DELTAg, DSSg, col_f, dp_f, sqn, sqd,
            qtn, qtd, sdon, sdod, dtn, dtd, dss_tk, start_n, mid_hi, hi, n, m, window,
            BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, DQK, DV_, True, CAUSAL, HAS_WINDOW, FP8, FMAX, E5M2, POW2, INTERP,
            ASM_SCALES, LSE2_IN, P_SHIFT, PART, DSS_IN)
    dk = dk * (c_dk * softmax_scale)
    dv = dv * c_dv
    nmask = offs_n < m
    if PART != 1:
        tl.store(DK + b64 * sdkb + hk64 * sdkh + k064 * sdkn + offs_n[:, None] * sdkn + offs_dqk[None, :] * sdkd,
                 cast_to(dk, DK.dtype.element_ty, INTERP), mask=nmask[:, None] & (offs_dqk[None, :] < DQK))
    if PART != 2:
        tl.store(DV + b64 * sdvb + hk64 * sdvh + k064 * sdvn + offs_n[:, None] * sdvn + offs_dv[None, :] * sdvd,
                 cast_to(dv, DV.dtype.element_ty, INTERP), mask=nmask[:, None] & (offs_dv[None, :] < DV_))
