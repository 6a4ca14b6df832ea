"""The correction pass and dQ on Hopper, written in Gluon: one TMA warp feeding two independent MMA warpgroups.

The same contract and arithmetic as `_bwd_dq_kernel` (backward.py) with 64-row blocks (ONE_TILE), matching delta,
LSE2_OUT (P_SHIFT 8) and DSS_OUT, for its common case only (plan.gluon_why_not says when): fp8 e4m3, Dqk = Dv in (64,
128), no window or (HAS_WINDOW) a causal sliding one (both passes over the key tiles from the program's first query's
window on, each warpgroup's tiles before its own window released, the edge's masked), N = M a multiple of 128, causal or
full, any GQA group, or a causal packed batch (VARLEN: its sequences padded to multiples of 128 rows by
kernels.segments, as LSE, delta, LSE2 and the dS scales, whose tiles the dK/dV kernel then finds at the same padded
places; dQ to the packed rows; also a dense batch of N not a multiple of 128, each head one such sequence, causal or
(its last key tile masked past N) full); or, in two launches over dQ's column halves (HALF 1, 2:
configs.GLUON_WIDE_DIMS), D = 256 and MLA's Dqk = 192 / Dv = 128 on dense batches, q and k read in boxes of Dqk rounded
up to a power of two: the first launch runs the correction pass and stores delta, LSE2 and the dS scales, the second
reads delta.

Why: `_bwd_dq_kernel` at D=128 takes 116 KB of shared memory, so one warpgroup runs per SM and nothing
overlaps its softmax. Here a program covers 128 queries: the loader (1 warp) streams each key tile once for
both MMA warpgroups (64 queries each, so each owns its dS tiles and their scales), which never wait for each
other. Per key tile of 128 keys (stage s), in one warpgroup (rows r0 .. r0+63):
  pass 1 (the correction pass): S = q8 k8^T, dP = dO8 v8^T (async); P = exp2(S * sq sk scale log2e - LSE2);
          delta += rowsum(P * dP) * sdo sv  (SCALE_AFTER_SUM; else rowsum(P * dP * sdo sv))
  pass 2: S, dP, P again; dS = P (dP sdo sv - delta); sds = tile_scale(absmax dS), stored for the dK/dV kernel;
          dQ = dQ * (c / c') + (dS / sds)8 k8   (c' = sds * sk: dq is kept in units of the last tile's c')
With PINGPONG (on at D=128, configs.DQ_HOPPER_PINGPONG) the two warpgroups take turns to issue their S and dP MMAs
(FlashAttention-3's ping-pong through named barriers, _gluon.wait_turn), so one's exponentials overlap the other's
MMAs more often. With PIPE (on the full mask, configs.DQ_HOPPER_PIPE_FULL) pass 2 is software-pipelined: tile j's
dQ MMA is issued after tile j+1's S and dP and runs under its exponentials (_dq_tile_pipe).
Gluon has no interpreter; the GPU tests hold this kernel to `_bwd_dq_kernel` (tests/test_kernels_gpu.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._gluon import (
    BLOCK_M, BLOCK_N, KEYS_PER_PROGRAM, QUERIES_PER_PROGRAM, _desc, _query_program, _ring_barriers, _segment,
    acc_units, fp8_a_layout, fp8_operand, mma_layout, pass_turn, tile_scale, tma_load, wait_turn,
)


@gluon.jit
def _first_tile(q0, window, HAS_WINDOW: gl.constexpr):
    """The program's first key tile: 0, or with HAS_WINDOW the one its first query's (q0's) window starts in.
    Each partition computes it (as a value handed to the partitions, it spilled)."""
    if HAS_WINDOW:
        return gl.maximum(q0 - window + 1, 0) // BLOCK_N
    else:
        return 0


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem, v_smem, kt_smem,
            qo_bar, ready, empty, q_row, kv_row, kt_row, kt_col, q0, n_k, window, STAGES: gl.constexpr,
            HEAD_D: gl.constexpr, HAS_WINDOW: gl.constexpr, HALF: gl.constexpr):
    """HALF 2 (the second half of dQ's columns, configs.dq_hopper): pass 2's loads only (delta is read)."""
    mbarrier.expect(qo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
    tma_load(q_desc, [q_row, 0], qo_bar, q_smem)
    tma_load(do_desc, [q_row, 0], qo_bar, do_smem)
    lo = _first_tile(q0, window, HAS_WINDOW)
    n_t = n_k - lo  # key tiles lo .. n_k - 1
    u0 = n_t if HALF == 2 else 0  # HALF 2: no pass 1
    for u in range(u0, 2 * n_t):  # pass 1: k8, v8 of each key tile; pass 2: the same and k8^T
        j = lo + u % n_t
        s = (u - u0) % STAGES
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes at once
        mbarrier.wait(empty.index(s), (((u - u0) // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        if u < n_t:
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes + kt_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], bar, k_smem.index(s))
        tma_load(v_desc, [kv_row + j * BLOCK_N, 0], bar, v_smem.index(s))
        if u >= n_t:
            tma_load(kt_desc, [kt_row, kt_col + j * BLOCK_N], bar, kt_smem.index(s))


@gluon.jit
def _issue_s_dp(q_sub, do_sub, k_smem, v_smem, ready, u, s_acc, dp_acc, STAGES: gl.constexpr, WG: gl.constexpr,
                PINGPONG: gl.constexpr):
    """The ring's load u: wait for it, then (in this warpgroup's turn with PINGPONG, left to the caller to pass)
    issue S = q8 k8^T and dP = dO8 v8^T into fresh accumulators."""
    s = u % STAGES
    mbarrier.wait(ready.index(s), (u // STAGES) & 1)
    if PINGPONG:
        wait_turn(WG)
    s_acc = warpgroup_mma(q_sub, k_smem.index(s).permute((1, 0)), s_acc, use_acc=False, is_async=True)
    dp_acc = warpgroup_mma(do_sub, v_smem.index(s).permute((1, 0)), dp_acc, use_acc=False, is_async=True)
    return s_acc, dp_acc, s


@gluon.jit
def _skip(ready, empty, u0, u1, STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Release the ring's loads u0 .. u1-1 unread (HAS_WINDOW: key tiles before this warpgroup's window that the
    other's reaches), each once loaded (_gluon._release); with PINGPONG taking a turn for each, as the other
    warpgroup does for its MMAs there, so that the two keep alternating."""
    for u in range(u0, u1):
        s = u % STAGES
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        if PINGPONG:
            wait_turn(WG)
            pass_turn(WG)
        mbarrier.arrive(empty.index(s))


@gluon.jit
def _p_of(s_acc, dp_acc, j, n_k, row_f, dp_f, sk_t, sv_t, lse2, rows, SK, SV, kv_row, j0, window,
          MASKED: gl.constexpr, WRAP: gl.constexpr, PENDING: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Key tile j (sk_t, sv_t: its scales), its S and dP MMAs issued (then PENDING more): P = exp2(S * s_f - LSE2),
    masked on the diagonal tile (HAS_WINDOW: also on the tiles cut by the window's left edge, keys > rows -
    window), dP unscaled and its scale. Also returns the next key tile's scales (WRAP: after the last, those of
    the warpgroup's first, j0), loaded under the MMAs: read in the tile they were loaded for, they left the warps
    waiting on L2 (Nsight Compute)."""
    s_f = row_f * sk_t
    dpf = dp_f * sv_t
    if WRAP:
        ahead = kv_row + gl.where(j + 1 < n_k, j + 1, j0) * BLOCK_N
    else:
        ahead = kv_row + gl.minimum(j + 1, n_k - 1) * BLOCK_N
    sk_t = gl.load(SK + ahead)
    sv_t = gl.load(SV + ahead)
    s_acc = warpgroup_mma_wait(1 + PENDING, deps=(s_acc, ))  # S done; dP's MMA runs under the exponentials
    # the mask on P, not on S: the scale and LSE2 then fuse into one FFMA per score on every tile
    p = gl.exp2(s_acc * s_f - lse2[:, None])
    if MASKED:  # the program's diagonal key tile (N = M: top-left = bottom-right)
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_acc.type.layout))
        if HAS_WINDOW:
            p = gl.where((keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - window), p, 0.0)
        else:
            p = gl.where(keys[None, :] <= rows[:, None], p, 0.0)
    dp_acc = warpgroup_mma_wait(PENDING, deps=(dp_acc, ))
    return s_acc, p, dp_acc, dpf, sk_t, sv_t


@gluon.jit
def _p_dp(q_sub, do_sub, k_smem, v_smem, ready, u, j, n_k, s_acc, dp_acc, row_f, dp_f, sk_t, sv_t, lse2, rows, SK, SV,
          kv_row, j0, window, MASKED: gl.constexpr, WRAP: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
          PINGPONG: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Key tile j, the ring's load u: _issue_s_dp, then _p_of. Returns the stage too."""
    s_acc, dp_acc, s = _issue_s_dp(q_sub, do_sub, k_smem, v_smem, ready, u, s_acc, dp_acc, STAGES, WG, PINGPONG)
    if PINGPONG:
        pass_turn(WG)
    s_acc, p, dp_acc, dpf, sk_t, sv_t = _p_of(s_acc, dp_acc, j, n_k, row_f, dp_f, sk_t, sv_t, lse2, rows, SK, SV,
                                              kv_row, j0, window, MASKED, WRAP, 0, HAS_WINDOW)
    return s_acc, p, dp_acc, dpf, sk_t, sv_t, s


@gluon.jit
def _delta_tile(q_sub, do_sub, k_smem, v_smem, ready, empty, u, j, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows,
                s_acc, dp_acc, delta, sk_t, sv_t, j0, window, MASKED: gl.constexpr, STAGES: gl.constexpr,
                SCALE_AFTER_SUM: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Pass 1 on key tile j, the ring's load u: delta += rowsum(P * dP). sk_t, sv_t: its scales; returns the next
    tile's (after the last, pass 2's first, j0)."""
    s_acc, p, dp_acc, dpf, sk_t, sv_t, s = _p_dp(
        q_sub, do_sub, k_smem, v_smem, ready, u, j, n_k, s_acc, dp_acc, row_f, dp_f, sk_t, sv_t, lse2, rows, SK, SV,
        kv_row, j0, window, MASKED, True, STAGES, WG, PINGPONG, HAS_WINDOW)
    mbarrier.arrive(empty.index(s))
    if SCALE_AFTER_SUM:  # the tile's dP scale on its row sums, not on each dP: one FMUL per score less
        delta += gl.sum(p * dp_acc, 1) * dpf
    else:
        delta += gl.sum(p * (dp_acc * dpf), 1)
    return s_acc, dp_acc, delta, sk_t, sv_t


@gluon.jit
def _ds(p, dp_acc, dpf, delta, rs, ra, DSS, dss_at, j, FMAX: gl.constexpr, POW2: gl.constexpr, ROW_SUMS: gl.constexpr):
    """Key tile j's dS = P (dP dpf - delta), its row sums (ROW_SUMS: the invariant) and its tile scale, stored for
    the dK/dV kernel (this warpgroup's tile)."""
    ds = p * (dp_acc * dpf - delta[:, None])
    if ROW_SUMS:
        rs += gl.sum(ds, 1)
        ra += gl.sum(gl.abs(ds), 1)
    sds = tile_scale(gl.max(gl.abs(ds), None), FMAX, POW2)
    gl.store(DSS + dss_at + j, sds)
    return ds, rs, ra, sds


@gluon.jit
def _dq_units(sds, sk_j, dq, c_dq, c_max):
    """Key tile j's operand factor r (dS8 = dS * r) and dq rescaled into its units: dq is kept in units of the last
    tile's sds * sk (or of _fp8.acc_units' floor), the tile quantized at sk / units (1 / sds but at the floor).
    r is multiplied, as fp32 `/` is a MUFU op per element and exp2 keeps the MUFU busy."""
    u, c_max = acc_units(sds * sk_j, c_max)
    dq = dq * (c_dq / u)
    return sk_j / u, dq, u, c_max


@gluon.jit
def _dq_tile(q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, u, j, n_k, SK, SV, DSS, kv_row, dss_at, row_f,
             dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, window, MASKED: gl.constexpr,
             STAGES: gl.constexpr, FMAX: gl.constexpr, POW2: gl.constexpr, ROW_SUMS: gl.constexpr, WG: gl.constexpr,
             PINGPONG: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """Pass 2 on key tile j, the ring's load u: dS, its tile scale (stored for the dK/dV kernel) and
    dQ += dS8 k8. sk_t, sv_t: its scales; returns the next tile's."""
    a_layout: gl.constexpr = fp8_a_layout(dq.type.layout)
    sk_j = sk_t
    s_acc, p, dp_acc, dpf, sk_t, sv_t, s = _p_dp(
        q_sub, do_sub, k_smem, v_smem, ready, u, j, n_k, s_acc, dp_acc, row_f, dp_f, sk_t, sv_t, lse2, rows,
        SK, SV, kv_row, 0, window, MASKED, False, STAGES, WG, PINGPONG, HAS_WINDOW)
    ds, rs, ra, sds = _ds(p, dp_acc, dpf, delta, rs, ra, DSS, dss_at, j, FMAX, POW2, ROW_SUMS)
    r, dq, c_dq, c_max = _dq_units(sds, sk_j, dq, c_dq, c_max)
    ds8 = fp8_operand(ds * r, a_layout)  # kt_smem's keys in k_order
    dq = warpgroup_mma(ds8, kt_smem.index(s).permute((1, 0)), dq, is_async=True)
    # nothing in flight across the loop's back edge (ptxas would serialize every wgmma: dkdv_hopper.py)
    dq = warpgroup_mma_wait(0, deps=(dq, ))
    mbarrier.arrive(empty.index(s))
    return s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t


@gluon.jit
def _dq_tile_pipe(q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, t, j, n_k, SK, SV, DSS, kv_row, dss_at, row_f,
                  dp_f, lse2, delta, rows, s_acc, ds, dq, c_dq, c_max, rs, ra, sk_t, sv_t, r_prev, s_prev,
                  MASKED: gl.constexpr, STAGES: gl.constexpr, FMAX: gl.constexpr, POW2: gl.constexpr,
                  ROW_SUMS: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr, PREV: gl.constexpr):
    """Pass 2 on key tile j, the pass's t-th (PIPE): as _dq_tile, but this tile's dQ MMA is left to the next
    tile's call, which issues it (from ds, sds_prev, stage s_prev; PREV) with its own S and dP, so that it runs
    under that tile's exponentials rather than the warpgroup waiting on it (r_prev: its operand factor, _dq_units).
    Returns this tile's dS in fp32 (in
    dP's accumulator registers, which the next tile's dP MMA takes over): an fp8 tensor carried across the loop's
    back edge costs ~200 byte unpacking and packing instructions per tile. PREV: 0 no pending MMA (the first
    tile), 1 one."""
    a_layout: gl.constexpr = fp8_a_layout(dq.type.layout)
    sk_j = sk_t
    if PREV:
        ds8 = fp8_operand(ds * r_prev, a_layout)
    s_acc, dp_acc, s = _issue_s_dp(q_sub, do_sub, k_smem, v_smem, ready, n_k + t, s_acc, ds, STAGES, WG, PINGPONG)
    if PREV:
        dq = warpgroup_mma(ds8, kt_smem.index(s_prev).permute((1, 0)), dq, is_async=True)
    if PINGPONG:
        pass_turn(WG)
    s_acc, p, dp_acc, dpf, sk_t, sv_t = _p_of(s_acc, dp_acc, j, n_k, row_f, dp_f, sk_t, sv_t, lse2, rows, SK, SV,
                                              kv_row, 0, 0, MASKED, True, PREV != 0, False)
    ds, rs, ra, sds = _ds(p, dp_acc, dpf, delta, rs, ra, DSS, dss_at, j, FMAX, POW2, ROW_SUMS)
    if PREV:  # the previous tile's dQ MMA: done with its ds8 registers (ptxas tracks those) and its ring stage
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(empty.index(s_prev))
    r, dq, c_dq, c_max = _dq_units(sds, sk_j, dq, c_dq, c_max)  # into this tile's units, for its MMA in the next call
    return s_acc, ds, dq, c_dq, c_max, rs, ra, sk_t, sv_t, r, s


@gluon.jit
def _mma_partition(q_smem, do_smem, k_smem, v_smem, kt_smem, qo_bar, ready, empty,
                   SQ, SK, SV, SDO, LSE, DQ, DELTA, LSE2, DSS, RS, RA, softmax_scale, row0, r0, kv_row, n_k,
                   dss_row, dss_tk, dss_col0, out0, length, window, WG: gl.constexpr, HEAD_D: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, SCALE_AFTER_SUM: gl.constexpr, FMAX: gl.constexpr,
                   POW2: gl.constexpr, ROW_SUMS: gl.constexpr, VARLEN: gl.constexpr, PINGPONG: gl.constexpr,
                   PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, DQK: gl.constexpr, DQ_COLS: gl.constexpr,
                   HALF: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    d_layout: gl.constexpr = mma_layout(DQ_COLS)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_sub = q_smem.slice(WG * 64, 64)
    do_sub = do_smem.slice(WG * 64, 64)
    rows = r0 + gl.arange(0, BLOCK_M, row_layout)  # this warpgroup's queries (sequence positions)
    lse = gl.load(LSE + row0 + rows)
    # -inf LSE (no visible key): +inf makes P = exp2(S - inf) = 0 without NaN
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    row_f = softmax_scale * 1.4426950408889634 * gl.load(SQ + row0 + r0)  # one quantization tile: 64 rows
    dp_f = gl.load(SDO + row0 + r0)
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # fresh accumulators (use_acc=False) carried
    dp_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # from tile to tile: no zero fill per tile
    delta = gl.zeros([BLOCK_M], gl.float32, row_layout)
    lo = _first_tile(r0 - WG * BLOCK_M, window, HAS_WINDOW)
    if HAS_WINDOW:
        # this warpgroup's first key tile, j0 (its first row's window starts there; the program's, lo, may be one
        # before it: released unread, its dS scale never written), and the first tile its rows see whole, edge:
        # [j0, edge) masked like the diagonal tile
        j0 = gl.maximum(r0 - window + 1, 0) // BLOCK_N
        edge = (gl.maximum(r0 + BLOCK_M - window, 0) + BLOCK_N - 1) // BLOCK_N
        edge = gl.maximum(gl.minimum(edge, n_k - 1), j0)
        n_t = n_k - lo  # the ring's loads per pass
        sk_t = gl.load(SK + kv_row + j0 * BLOCK_N)
        sv_t = gl.load(SV + kv_row + j0 * BLOCK_N)
    else:
        j0 = 0
        sk_t = gl.load(SK + kv_row)
        sv_t = gl.load(SV + kv_row)
    # the causal diagonal key tile (the program's last) peeled off both loops: with the mask under a runtime
    # condition inside the loop, ptxas may predicate it onto every tile (128 instructions per tile). The full mask
    # on a padded sequence (TAIL) peels its last key tile the same way, masked past the sequence's end: the mask
    # `keys <= rows` with every row at the last token
    TAIL: gl.constexpr = VARLEN and not CAUSAL
    n_plain = n_k - 1 if CAUSAL or TAIL else n_k
    mbarrier.wait(qo_bar, 0)
    if PINGPONG:
        if WG == 1:  # warpgroup 0 issues first
            pass_turn(WG)
    p2 = n_k  # the ring's first load of pass 2 (dense, no window)
    if HALF == 2:  # dQ's second column half: delta from the first half's launch, no pass 1
        p2 = 0
        delta = gl.load(DELTA + row0 + rows)
    elif HAS_WINDOW:  # pass 1 on the window's tiles: the ones before j0 released, the edge's masked
        _skip(ready, empty, 0, j0 - lo, STAGES, WG, PINGPONG)
        for j in range(j0, edge):
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, j - lo, j, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows,
                s_acc, dp_acc, delta, sk_t, sv_t, j0, window, True, STAGES, SCALE_AFTER_SUM, WG, PINGPONG, True)
        for j in range(edge, n_plain):
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, j - lo, j, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows,
                s_acc, dp_acc, delta, sk_t, sv_t, j0, window, False, STAGES, SCALE_AFTER_SUM, WG, PINGPONG, True)
        s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
            q_sub, do_sub, k_smem, v_smem, ready, empty, n_plain - lo, n_plain, SK, SV, kv_row, n_k, row_f, dp_f,
            lse2, rows, s_acc, dp_acc, delta, sk_t, sv_t, j0, window, True, STAGES, SCALE_AFTER_SUM, WG, PINGPONG,
            True)
    else:
        for u in range(n_plain):  # pass 1: delta = rowsum(P * dP), the correction pass
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, u, u, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows,
                s_acc, dp_acc, delta, sk_t, sv_t, 0, window, False, STAGES, SCALE_AFTER_SUM, WG, PINGPONG, False)
        if CAUSAL:
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, n_plain, n_plain, SK, SV, kv_row, n_k, row_f, dp_f, lse2,
                rows, s_acc, dp_acc, delta, sk_t, sv_t, 0, window, True, STAGES, SCALE_AFTER_SUM, WG, PINGPONG,
                False)
        if TAIL:
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, n_plain, n_plain, SK, SV, kv_row, n_k, row_f, dp_f, lse2,
                rows * 0 + (length - 1), s_acc, dp_acc, delta, sk_t, sv_t, 0, window, True, STAGES, SCALE_AFTER_SUM,
                WG, PINGPONG, False)
    dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, d_layout)
    rs = gl.zeros([BLOCK_M], gl.float32, row_layout)  # ROW_SUMS: sum_j dS_ij and sum_j |dS_ij| (the invariant)
    ra = gl.zeros([BLOCK_M], gl.float32, row_layout)
    c_dq = softmax_scale * 0.0 + 1.0  # dq is kept in units of c_dq (sds * sk of the last key tile: _dq_units)
    c_max = softmax_scale * 0.0  # the largest sds * sk so far
    dss_at = dss_row * dss_tk + dss_col0
    if PIPE:  # pass 2 pipelined (the full mask only): the first tile without a pending dQ MMA
        s_acc, ds, dq, c_dq, c_max, rs, ra, sk_t, sv_t, r, s_prev = _dq_tile_pipe(
            q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, 0, 0, n_k, SK, SV, DSS, kv_row, dss_at, row_f,
            dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, c_dq, 0, False, STAGES, FMAX,
            POW2, ROW_SUMS, WG, PINGPONG, 0)
        for t in range(1, n_k):
            s_acc, ds, dq, c_dq, c_max, rs, ra, sk_t, sv_t, r, s_prev = _dq_tile_pipe(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, t, t, n_k, SK, SV, DSS, kv_row, dss_at, row_f,
                dp_f, lse2, delta, rows, s_acc, ds, dq, c_dq, c_max, rs, ra, sk_t, sv_t, r, s_prev, False, STAGES, FMAX,
                POW2, ROW_SUMS, WG, PINGPONG, 1)
    if PIPE:  # the last tile's dQ MMA
        ds8 = fp8_operand(ds * r, fp8_a_layout(d_layout))
        dq = warpgroup_mma(ds8, kt_smem.index(s_prev).permute((1, 0)), dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq, ))
        mbarrier.arrive(empty.index(s_prev))
    elif HAS_WINDOW:  # pass 2 on the window's tiles, as pass 1: ring loads n_t + j - lo
        _skip(ready, empty, n_t, n_t + j0 - lo, STAGES, WG, PINGPONG)
        for j in range(j0, edge):
            s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, n_t + j - lo, j, n_k, SK, SV, DSS, kv_row,
                dss_at, row_f, dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, window,
                True, STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, True)
        for j in range(edge, n_plain):
            s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, n_t + j - lo, j, n_k, SK, SV, DSS, kv_row,
                dss_at, row_f, dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, window,
                False, STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, True)
        s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
            q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, n_t + n_plain - lo, n_plain, n_k, SK, SV, DSS,
            kv_row, dss_at, row_f, dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, window,
            True, STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, True)
    else:
        for j in range(n_plain):  # pass 2: dS and dQ
            s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, p2 + j, j, n_k, SK, SV, DSS, kv_row, dss_at,
                row_f, dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t, window, False,
                STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, False)
        if CAUSAL:
            s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, p2 + n_plain, n_plain, n_k, SK, SV, DSS,
                kv_row, dss_at, row_f, dp_f, lse2, delta, rows, s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t,
                window, True, STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, False)
        if TAIL:
            s_acc, dp_acc, dq, c_dq, c_max, rs, ra, sk_t, sv_t = _dq_tile(
                q_sub, do_sub, k_smem, v_smem, kt_smem, ready, empty, p2 + n_plain, n_plain, n_k, SK, SV, DSS,
                kv_row, dss_at, row_f, dp_f, lse2, delta, rows * 0 + (length - 1), s_acc, dp_acc, dq, c_dq, c_max, rs,
                ra, sk_t, sv_t, window, True, STAGES, FMAX, POW2, ROW_SUMS, WG, PINGPONG, False)
    if PINGPONG:
        if WG == 0:  # the turn warpgroup 1 passed with its last MMAs: every named-barrier arrive is consumed
            wait_turn(WG)
    dq = dq * (c_dq * softmax_scale)
    drows = r0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, d_layout))
    dcols = gl.arange(0, DQ_COLS, gl.SliceLayout(0, d_layout))
    col0: gl.constexpr = DQ_COLS if HALF == 2 else 0  # this launch's first column of dQ
    dptrs = DQ + (out0 + drows).to(gl.int64)[:, None] * DQK + (col0 + dcols)[None, :]
    if VARLEN:  # the sequence's rows only
        gl.store(dptrs, dq.to(DQ.dtype.element_ty), mask=(drows < length)[:, None])
    elif col0 + DQ_COLS > DQK:  # MLA's second half: Dqk = 192 in a 256-wide box
        gl.store(dptrs, dq.to(DQ.dtype.element_ty), mask=(col0 + dcols < DQK)[None, :])
    else:
        gl.store(dptrs, dq.to(DQ.dtype.element_ty))
    if HALF != 2:  # the second half recomputed these: the first half's launch wrote them
        gl.store(DELTA + row0 + rows, delta)
        gl.store(LSE2 + row0 + rows, lse2 - 8.0)  # for the dK/dV kernel: its exp2 then yields P * 256
        if ROW_SUMS:
            gl.store(RS + row0 + rows, rs)
            gl.store(RA + row0 + rows, ra)


@gluon.jit
def _bwd_dq_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, kt_desc, SQ, SK, SV, SDO, LSE, DQ, DELTA, LSE2, DSS, RS, RA,
    Hq, Hkv, N, softmax_scale, n_tiles, head_group, dss_tq, dss_tk, CU, PCU, N_OUT, window,
    GROUPS: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    SCALE_AFTER_SUM: gl.constexpr, FMAX: gl.constexpr, POW2: gl.constexpr, ROW_SUMS: gl.constexpr,
    VARLEN: gl.constexpr, PINGPONG: gl.constexpr, PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, DQK: gl.constexpr,
    HEAD_DV: gl.constexpr, DQ_COLS: gl.constexpr, HALF: gl.constexpr,
):
    # HEAD_D: q's and k's box width (Dqk rounded up to a power of two), DQK: Dqk (dQ's row length), HEAD_DV: Dv;
    # HALF 0: all of dQ's columns (DQ_COLS = HEAD_D); 1 and 2: its first and second DQ_COLS = HEAD_D / 2 columns in
    # two launches (the wide dims: configs.dq_hopper), the second reading the first's delta
    gl.static_assert(CAUSAL or not HAS_WINDOW, "a sliding window is causal (plan.gluon_why_not)")
    gl.static_assert(HALF == 0 or not (PIPE or VARLEN or HAS_WINDOW), "dQ in column halves: dense batches, no window, "
                                                                       "no pipelined pass 2 (configs.dq_hopper)")
    gl.static_assert(not (PIPE and CAUSAL), "the pipelined pass 2 is the full mask's (configs.dq_hopper)")
    gl.static_assert(not (PIPE and VARLEN), "the pipelined pass 2 masks no key tail (configs.dq_hopper)")
    # N: rows per head of the inputs and row arrays (padded ones for VARLEN), N_OUT: of dQ
    base, length, start = _segment(CU, PCU, N, VARLEN)
    kvh, q0, pid_bh, n_k = _query_program(n_tiles, head_group, Hq, Hkv, length, GROUPS, CAUSAL, 2,
                                          VARLEN and not CAUSAL)
    if VARLEN:
        if q0 >= length:  # a block past this sequence's end (the grid covers the longest)
            return
    row0 = pid_bh * N + base  # the sequence's rows in the (B*Hq*N,) row arrays and the (B*Hq*N, D) views of q8, dO8
    kv_row = kvh * N + base  # the KV head's rows in the (B*Hkv*M, D) views of k8, v8 and in sk, sv
    if VARLEN:
        out0 = pid_bh * N_OUT + start  # its rows in dQ
    else:
        out0 = row0

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    kt_smem = gl.allocate_shared_memory(kt_desc.dtype, [STAGES] + kt_desc.block_type.shape, kt_desc.layout)
    qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qo_bar, count=1)
    ready, empty = _ring_barriers(STAGES)

    # warpgroup 0's dS tile row and the first key tile's column, both in the padded layout for VARLEN (the dK/dV
    # kernel indexes them so)
    dss_row = pid_bh * dss_tq + (base + q0) // BLOCK_M
    dss_col0 = base // BLOCK_N
    gl.warp_specialize([
        (_mma_partition, (q_smem, do_smem, k_smem, v_smem, kt_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DQ,
                          DELTA, LSE2, DSS, RS, RA, softmax_scale, row0, q0, kv_row, n_k, dss_row, dss_tk,
                          dss_col0, out0, length, window, 0, HEAD_D, STAGES, CAUSAL, SCALE_AFTER_SUM, FMAX, POW2,
                          ROW_SUMS, VARLEN, PINGPONG, PIPE, HAS_WINDOW, DQK, DQ_COLS, HALF)),
        (_mma_partition, (q_smem, do_smem, k_smem, v_smem, kt_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DQ,
                          DELTA, LSE2, DSS, RS, RA, softmax_scale, row0, q0 + BLOCK_M, kv_row, n_k, dss_row + 1,
                          dss_tk, dss_col0, out0, length, window, 1, HEAD_D, STAGES, CAUSAL, SCALE_AFTER_SUM, FMAX,
                          POW2, ROW_SUMS, VARLEN, PINGPONG, PIPE, HAS_WINDOW, DQK, DQ_COLS, HALF)),
        (_loader, (q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem, v_smem, kt_smem, qo_bar, ready,
                   empty, row0 + q0, kv_row, kvh * DQK + (DQ_COLS if HALF == 2 else 0), base, q0, n_k, window, STAGES,
                   HEAD_D, HAS_WINDOW, HALF)),
    ], [4, 1], [240, 24])


def dq_hopper(q8, k8, k8t, v8, do8, sq, sk, sv, sdo, lse, dq, delta, lse2, dss, rs, ra, *, causal, softmax_scale,
              dss_tq, dss_tk, grid, n_tiles, head_group, stages, pingpong, scale_after_sum, fmax, pow2, row_sums,
              pipe=False, halves=(0,), segments=None, window=None):
    """Launch `_bwd_dq_hopper_kernel` (inputs as plan.gluon_why_not takes them; grid over N // 128 query blocks, or
    the longest sequence's blocks x the sequences). segments: a packed batch's kernels.segments.Segments, every
    tensor but dq in its padded layout. window: a causal sliding window, each query's keys
    in (pos - window, pos]. halves: (0,) one launch for all of dQ's columns, or (1, 2) one per half of them (D = 256
    and MLA's Dqk = 192 / Dv = 128, dense: configs.dq_hopper), the first with the correction pass. q and k are read
    in boxes of Dqk rounded up to a power of two (zeros past Dqk), v and dO in boxes of Dv."""
    B, Hq, N, dqk = q8.shape
    Hkv, dv = k8.shape[1], v8.shape[3]
    box = 1 << (dqk - 1).bit_length()  # Gluon's blocks are powers of two
    cols = box if halves == (0,) else box // 2  # dQ's columns per launch
    cu, pcu = (segments.cu, segments.pcu) if segments is not None else (lse, lse)  # unread without VARLEN
    descs = (_desc(q8, [QUERIES_PER_PROGRAM, box]), _desc(do8, [QUERIES_PER_PROGRAM, dv]),
             _desc(k8, [KEYS_PER_PROGRAM, box]), _desc(v8, [KEYS_PER_PROGRAM, dv]),
             _desc(k8t, [cols, KEYS_PER_PROGRAM]))
    for half in halves:
        _bwd_dq_hopper_kernel[grid](
            *descs, sq, sk, sv, sdo, lse, dq, delta, lse2,
            dss, rs, ra, Hq, Hkv, N, float(softmax_scale), n_tiles, head_group, dss_tq, dss_tk, cu, pcu, dq.shape[2],
            int(window) if window is not None else 0,
            GROUPS=Hq // Hkv, HEAD_D=box, STAGES=stages, CAUSAL=bool(causal), SCALE_AFTER_SUM=scale_after_sum,
            FMAX=fmax, POW2=pow2, ROW_SUMS=row_sums, VARLEN=segments is not None, PINGPONG=int(pingpong),
            PIPE=bool(pipe), HAS_WINDOW=window is not None, DQK=dqk, HEAD_DV=dv, DQ_COLS=cols, HALF=half, num_warps=4,
        )
