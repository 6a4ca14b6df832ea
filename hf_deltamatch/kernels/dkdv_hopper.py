"""dK/dV on Hopper, written in Gluon: one TMA warp feeding two (D=128) or three (D=64) independent MMA warpgroups.

The same contract and arithmetic as `_bwd_dkdv_kernel` (backward.py) with DSS_IN, LSE2_IN and P_SHIFT = 8, for its
common case only (plan.gluon_why_not says when): fp8 e4m3, Dqk = Dv in (64, 128) (PART 0: dK and dV in one launch),
or D = 256 and MLA's Dqk = 192 / Dv = 128 on dense batches of N a multiple of 128 (configs.GLUON_WIDE_DIMS: PART
1, dV alone, then PART 2, dK alone, as `_bwd_dkdv_kernel` splits them above D = 128: a warpgroup cannot hold both
64 x 256 accumulators; q and k read in boxes of Dqk rounded up to a power of two, zeros past Dqk, dK's extra columns
dropped), no window or (HAS_WINDOW) a causal sliding one (the query tiles end at the last query whose window holds
the program's last key, each warpgroup skips those past its own keys' windows and masks those the window's edge
cuts), N = M a multiple of 128, causal or full, any GQA group, or a causal packed batch (VARLEN: its
sequences padded to multiples of 128 rows by kernels.segments, LSE2, delta and the dS scales where the dQ kernel put
them; dK, dV to the packed rows; also a dense batch of N not a multiple of 128, each head one such sequence, causal
or full; padded keys are never stored, and padded query rows have P = 0 from their -inf LSE).

Why a second dK/dV kernel: Triton compiles `_bwd_dkdv_kernel` into one stream in which both warpgroups meet
at CTA barriers for every query tile and ptxas serializes its wgmmas (docs/kernels.md); the softmax of one
tile then never overlaps an MMA. Here
  - a 1-warp partition (`_loader`) loads k, v once and then streams q8, q8^T, dO8, dO8^T tiles through a ring
    of STAGES buffers with TMA, paced by mbarriers (ready: bytes landed; empty: both consumers done);
  - two (three) 4-warp partitions (`_mma_partition`) each own 64 of the program's 128 (192) keys and never wait
    for each other, so one's exp2/convert work runs while the other's wgmmas occupy the tensor cores (with three,
    a warpgroup's causal query tiles start at its own diagonal: the ones before it releases unread);
  - inside a warpgroup the wgmmas are asynchronous with explicit waits: dP^T's MMA runs under exp2(S^T) and
    dV's under dS; dK's is waited for at the end of the tile (left in flight into the next tile, ptxas
    serializes every wgmma of the kernel), or with PIPE (two warpgroups, no GQA: configs.dkdv_hopper) issued
    by the next tile after its S^T and dP^T, from dS^T / sds carried over in fp32, so that it runs under that
    tile's exponentials.
Per query tile of 64 rows (stage s), in one warpgroup (keys kb .. kb+63):
    S^T = k8[kb] q8^T,  dP^T = v8[kb] dO8^T                  (async, fresh accumulators)
    P^T * 256 = exp2(S^T * sk sq scale log2e - LSE2)         (LSE2 from the dQ kernel, 8 subtracted)
    dV = dV * (c_dv / cv) + P8^T dO8                         (cv = sdo / 256: dv is kept in units of cv)
    dS^T = P^T (dP^T * sv sdo - delta),  dK = dK * (c_dk / ck) + (dS^T / sds)8 q8   (ck = sds * sq)
with sds the dQ kernel's scale of the tile (DSS): the values and roundings of `_bwd_dkdv_kernel`. With PAIRS
(configs.dkdv_hopper) the loop takes two query tiles per iteration, and the second, which shares the first's
128-row dO8 quantization tile (cv), skips dV's rescale by c_dv / cv. With PEEL the query tiles across the causal
diagonal come before the loop, so the loop's tiles carry no mask test; with AHEAD each tile's scales are loaded a
tile ahead (always with GQA). Which combination runs where is configs.dkdv_hopper's choice, by measurement.
Gluon has no interpreter; the GPU tests hold this kernel to `_bwd_dkdv_kernel` (tests/test_kernels_gpu.py).

dQ is not added up here (FlashAttention's way) but in the dQ kernel's second pass: the fp32 reduce-adds of dQ
partials into global memory made this kernel slower than that pass (docs/kernels.md).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._gluon import (
    BLOCK_M, BLOCK_N, KEYS_PER_PROGRAM, QUERIES_PER_TILE, ROW_LAYOUT, _desc, _grid_ids, _release, _ring_barriers,
    _row_desc, _segment, acc_units, fp8_a_layout, fp8_operand, mma_layout, tma_load,
)


@gluon.jit
def _loader(k_desc, v_desc, q_desc, qt_desc, do_desc, dot_desc, lse_desc, delta_desc, k_smem, v_smem, q_smem,
            qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar, ready, empty, kv_row, q_row0, qt_row0, dot_row0,
            lo, n_q, N, GROUPS: gl.constexpr, DQK: gl.constexpr, HEAD_DV: gl.constexpr, STAGES: gl.constexpr,
            WGS: gl.constexpr, PART: gl.constexpr):
    """PART 1 (dV alone) loads k8, q8, dO8^T and LSE2; PART 2 (dK alone) all but dO8^T; 0 everything. qt_row0,
    dot_row0: the group's first head's rows in the token-major views of q8 (DQK rows per head) and dO8 (HEAD_DV)."""
    if WGS == 2:
        if PART == 1:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes)
        else:
            mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row, 0], kv_bar, k_smem)
        if PART != 1:
            tma_load(v_desc, [kv_row, 0], kv_bar, v_smem)
    else:  # a TMA box's rows are a power of two: one box per warpgroup
        mbarrier.expect(kv_bar, 2 * WGS * k_desc.block_type.nbytes)
        for w in gl.static_range(WGS):
            tma_load(k_desc, [kv_row + w * 64, 0], kv_bar, k_smem.index(w))
            tma_load(v_desc, [kv_row + w * 64, 0], kv_bar, v_smem.index(w))
    if PART == 1:
        tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + dot_desc.block_type.nbytes
                                    + lse_desc.block_type.nbytes)
    elif PART == 2:
        tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes
                                    + qt_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
    else:
        tile_bytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + qt_desc.block_type.nbytes
                                    + dot_desc.block_type.nbytes + 2 * lse_desc.block_type.nbytes)
    for t in range(GROUPS * n_q):
        g = t // n_q
        m0 = lo + (t - g * n_q) * BLOCK_M
        s = t % STAGES
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes at once
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, tile_bytes)
        row = q_row0 + g * N + m0
        tma_load(q_desc, [row, 0], bar, q_smem.index(s))
        # the issue order of the kernels as timed and GPU-tested (PART 0 at D 64/128; the two wide launches)
        if PART == 0:
            tma_load(do_desc, [row, 0], bar, do_smem.index(s))
            tma_load(qt_desc, [qt_row0 + g * DQK, m0], bar, qt_smem.index(s))
            tma_load(dot_desc, [dot_row0 + g * HEAD_DV, m0], bar, dot_smem.index(s))
            tma_load(lse_desc, [row], bar, lse_smem.index(s))
            tma_load(delta_desc, [row], bar, delta_smem.index(s))
        else:
            tma_load(lse_desc, [row], bar, lse_smem.index(s))
            if PART == 2:
                tma_load(do_desc, [row, 0], bar, do_smem.index(s))
                tma_load(qt_desc, [qt_row0 + g * DQK, m0], bar, qt_smem.index(s))
                tma_load(delta_desc, [row], bar, delta_smem.index(s))
            else:
                tma_load(dot_desc, [dot_row0 + g * HEAD_DV, m0], bar, dot_smem.index(s))


@gluon.jit
def _tile_scales(SQ, SDO, DSS, g, i, N, dss_tq, dss_tk):
    """The scales of query tile i of the group's head g: q8's and dO8's (one quantization tile holds the 64-row
    query tile) and its dS tile's (from the dQ kernel). SQ, SDO, DSS: at the group's first tile."""
    row = g * N + i * BLOCK_M
    return gl.load(SQ + row), gl.load(SDO + row), gl.load(DSS + g * (dss_tq * dss_tk) + i * dss_tk)


@gluon.jit
def _tile(k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, s, SQ, SDO, DSS, keys, col_f, dp_f,
          bh, m0, N, dss_tq, dss_tk, dss_col, sq_t, sdo_t, sds, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, masked,
          s_prev, window, CAUSAL: gl.constexpr, AHEAD: gl.constexpr, RESCALE_DV: gl.constexpr,
          PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, PART: gl.constexpr):
    """One query tile (ring stage s) of one warpgroup: dK and dV updated; masked: a tile across the diagonal.
    AHEAD: sq_t, sdo_t, sds (the tile's q8, dO8 and dS scales) were loaded a tile ahead by the caller; else they
    are loaded here, under the MMAs. RESCALE_DV False: the tile shares its dO8 quantization tile (128 rows) with
    the one this warpgroup did before it, so dv's rescale would multiply by c / c. PIPE: dp_acc comes in holding
    the previous tile's dS^T / sds (zeros before the first tile), whose dK MMA (with q8^T of stage s_prev) is
    issued after this tile's S^T and dP^T and runs under its exponentials; this tile's goes back the same way. PIPE
    2: the same with dP^T's MMA into a fresh accumulator rather than dp_acc's registers (pipe_mode). HAS_WINDOW: a
    masked tile also hides the queries past each key's window (rows >= key + window). PART 1: dV alone (no dP^T,
    no dS^T); PART 2: dK alone (no dV MMA); 0 both."""
    s_layout: gl.constexpr = s_acc.type.layout
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    if PIPE:
        ds8_prev = fp8_operand(dp_acc, fp8_a_layout(dk.type.layout))
    s_acc = warpgroup_mma(k_sub, q_smem.index(s).permute((1, 0)), s_acc, use_acc=False, is_async=True)
    if PART != 1:
        if PIPE == 2:  # a fresh accumulator: ptxas 13 moved half of the conversions above past an MMA into dp_acc
            dp_acc = gl.zeros(dp_acc.shape, gl.float32, s_layout)
        dp_acc = warpgroup_mma(v_sub, do_smem.index(s).permute((1, 0)), dp_acc, use_acc=False, is_async=True)
    if PIPE:  # dk is in the previous tile's units (c_dk) already
        dk = warpgroup_mma(ds8_prev, qt_smem.index(s_prev).permute((1, 0)), dk, is_async=True)
    if not AHEAD:
        row = bh * N + m0
        sq_t = gl.load(SQ + row)  # one quantization tile holds the 64-row query tile
        sdo_t = gl.load(SDO + row)
        if PART != 1:
            sds = gl.load(DSS + (bh * dss_tq + m0 // BLOCK_M) * dss_tk + dss_col)
    # S^T done; dP^T's MMA (and with PIPE the previous tile's dK MMA) runs under the exponentials
    s_acc = warpgroup_mma_wait((PART != 1) + (PIPE > 0), deps=(s_acc, ))
    # LSE2 and delta came with the tile (TMA) and are read where needed: per-thread loads of them, held
    # across the MMA waits, cost 32 registers and spilled
    lse2 = lse_smem.index(s).load(col_layout)
    # P^T * 256 (the static scale is in LSE2); the mask on P, not on S^T, so that the scale and LSE2 fuse
    # into one FFMA per score on every tile
    p256 = gl.exp2(s_acc * (col_f * sq_t) - lse2[None, :])
    if CAUSAL:
        if masked:
            cols = m0 + gl.arange(0, BLOCK_M, col_layout)
            if HAS_WINDOW:
                vis = (keys[:, None] <= cols[None, :]) & (cols[None, :] < keys[:, None] + window)
                p256 = gl.where(vis, p256, 0.0)
            else:
                p256 = gl.where(keys[:, None] <= cols[None, :], p256, 0.0)
    if PART != 2:
        # RESCALE_DV False (configs.dkdv_hopper): c_dv / cv is 1 up to the division's rounding, yet dV then
        # differs from _bwd_dkdv_kernel's by up to 1.4e-3 (slightly closer to the reference); a runtime skip with three
        # warpgroups made the kernel slower at D=64
        cv = sdo_t * (1.0 / 256.0)
        if RESCALE_DV:
            dv = dv * (c_dv / cv)
        c_dv = cv
        p8 = fp8_operand(p256, fp8_a_layout(dv.type.layout))
        dv = warpgroup_mma(p8, dot_smem.index(s).permute((1, 0)), dv, is_async=True)
    if PART == 1:
        dv = warpgroup_mma_wait(0, deps=(dv, ))
    else:
        dp_acc = warpgroup_mma_wait((PART != 2) + (PIPE > 0), deps=(dp_acc, ))  # dP^T done; dV's MMA runs under dS
        # dk is kept in units of the last tile's sds * sq (or of _fp8.acc_units' floor), the tile quantized at
        # sq / units: r takes dst = dS^T * 256 to dS^T / sds
        uk, ck_max = acc_units(sds * sq_t, ck_max)
        if not PIPE:
            dk = dk * (c_dk / uk)
            c_dk = uk
        r = sq_t * (1.0 / 256.0) / uk
        delta = delta_smem.index(s).load(col_layout)
        # r in dP's scale and delta: one FMUL per score less (the same dS up to fp32 rounding)
        ds_r = p256 * (dp_acc * (dp_f * sdo_t * r) - delta[None, :] * r)
        if PIPE:  # dS^T / sds goes to the next tile in fp32: an fp8 tensor across the back edge costs byte packing
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
            dk = dk * (c_dk / uk)
            c_dk = uk
            dp_acc = ds_r
        else:
            ds8 = fp8_operand(ds_r, fp8_a_layout(dk.type.layout))
            dk = warpgroup_mma(ds8, qt_smem.index(s).permute((1, 0)), dk, is_async=True)
            # nothing in flight across the loop's back edge: with dK's or dV's MMA left running into the next tile
            # ptxas serializes every wgmma of the kernel (sm_90, Triton 3.6); pairs of tiles with the first's MMAs
            # in flight into the second spilled
            if PART == 2:
                dk = warpgroup_mma_wait(0, deps=(dk, ))
            else:
                dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    return s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv


@gluon.jit
def _step(k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, empty, t, g, i, sq_n, sdo_n,
          sds_n, SQ_G, SDO_G, DSS_G, SQ, SDO, DSS, keys, col_f, dp_f, bh0, lo, n_q, N, dss_tq, dss_tk, dss_col, first,
          s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, s_prev, kb, i_end, window, GROUPS: gl.constexpr,
          STAGES: gl.constexpr, CAUSAL: gl.constexpr, WGS: gl.constexpr, RESCALE_DV: gl.constexpr,
          AHEAD: gl.constexpr, DIAG: gl.constexpr, PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, PART: gl.constexpr):
    """The ring's t-th query tile (tile i of the group's head g) through one warpgroup, its stage released after.
    AHEAD: the tile's scales were loaded a tile ahead (sq_n, sdo_n, sds_n), and the next tile's are loaded here;
    returns (g, i) of the next tile. DIAG: 0 the tile lies below the diagonal, 1 it crosses it, 2 a runtime test
    (two warpgroups: i < 2; three: i == first, and the tiles before `first` skipped). PIPE: the stage released is
    the previous tile's (s_prev), whose dK MMA this tile issues; returns the stage whose dK MMA is pending.
    HAS_WINDOW (DIAG 2, no PIPE): tiles from i_end on lie past the window of every key of this warpgroup (keys kb ..
    kb + 63): skipped (the dQ kernel wrote no dS scale there); the tiles the window's edge cuts (a row >= kb +
    window) are masked like the diagonal's."""
    if not AHEAD:
        g = 0
        i = t
        sq_t = col_f  # unread: the tile loads its scales
        sdo_t = col_f
        sds = col_f
        g1 = g
        i1 = i
    else:
        sq_t, sdo_t, sds = sq_n, sdo_n, sds_n
        wrap = i + 1 == n_q  # the next tile (the last reloads its own)
        g1 = gl.where(wrap, gl.minimum(g + 1, GROUPS - 1), g)
        i1 = gl.where(wrap, gl.where(g + 1 < GROUPS, 0, i), i + 1)
        sq_n, sdo_n, sds_n = _tile_scales(SQ_G, SDO_G, DSS_G, g1, i1, N, dss_tq, dss_tk)
    m0 = lo + i * BLOCK_M
    s = t % STAGES
    mbarrier.wait(ready.index(s), (t // STAGES) & 1)
    # PIPE (two warpgroups): the first tile, t = 0, takes its own stage: a dK MMA of zeros adds nothing (and reads
    # finite values)
    has_prev = t > 0
    if PIPE:
        s_prev = gl.where(has_prev, s_prev, s)
    if HAS_WINDOW:
        gl.static_assert(DIAG == 2 and not PIPE, "a window: no peeled diagonal, no pipelined dK MMA")
        if WGS == 2:
            diag = i < 2
        else:
            diag = i == first
        if (i >= first) & (i < i_end):
            s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv = _tile(
                k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, s, SQ, SDO, DSS, keys, col_f,
                dp_f, bh0 + g, m0, N, dss_tq, dss_tk, dss_col, sq_t, sdo_t, sds, s_acc, dp_acc, dk, dv, c_dk, ck_max,
                c_dv, diag | (m0 + BLOCK_M - 1 >= kb + window), s_prev, window, CAUSAL, AHEAD, RESCALE_DV, PIPE, True,
                PART)
    elif WGS == 2:  # the two query tiles that cross this program's diagonal: i < 2 (N = M: top-left = bottom-right)
        if DIAG == 2:
            masked = i < 2
        else:
            masked = DIAG == 1
        s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv = _tile(
            k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, s, SQ, SDO, DSS, keys, col_f,
            dp_f, bh0 + g, m0, N, dss_tq, dss_tk, dss_col, sq_t, sdo_t, sds, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv,
            masked, s_prev, window, CAUSAL, AHEAD, RESCALE_DV, PIPE, False, PART)
    elif DIAG == 2:
        if i >= first:  # the diagonal tile is this warpgroup's first
            s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv = _tile(
                k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, s, SQ, SDO, DSS, keys, col_f,
                dp_f, bh0 + g, m0, N, dss_tq, dss_tk, dss_col, sq_t, sdo_t, sds, s_acc, dp_acc, dk, dv, c_dk, ck_max,
                c_dv, i == first, s_prev, window, CAUSAL, AHEAD, RESCALE_DV, PIPE, False, PART)
    else:  # three warpgroups, peeled: the caller skipped the tiles before `first`
        s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv = _tile(
            k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, s, SQ, SDO, DSS, keys, col_f,
            dp_f, bh0 + g, m0, N, dss_tq, dss_tk, dss_col, sq_t, sdo_t, sds, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv,
            DIAG == 1, s_prev, window, CAUSAL, AHEAD, RESCALE_DV, PIPE, False, PART)
    s_next = s
    if PIPE:
        if has_prev:
            mbarrier.arrive(empty.index(s_prev))  # the previous tile's dK MMA is done with its q8^T
    else:
        mbarrier.arrive(empty.index(s))  # this stage's tiles are read
    return s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, g1, i1, sq_n, sdo_n, sds_n, s_next


@gluon.jit
def _last_dk(ds, dk, qt_smem, empty, s, d_layout: gl.constexpr):
    """PIPE: the last tile's dK MMA, from its dS^T / sds (ds) and its stage s's q8^T; the stage released after."""
    dk = warpgroup_mma(fp8_operand(ds, fp8_a_layout(d_layout)), qt_smem.index(s).permute((1, 0)), dk, is_async=True)
    dk = warpgroup_mma_wait(0, deps=(dk, ))
    mbarrier.arrive(empty.index(s))
    return dk


@gluon.jit
def _mma_partition(k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar, ready, empty,
                   SQ, SDO, DSS, DK, DV, col_f, dp_f, softmax_scale, bh0, n0, lo, n_q, N, dss_tq, dss_tk, out_row,
                   key_end, window, WG: gl.constexpr, GROUPS: gl.constexpr, HEAD_D: gl.constexpr,
                   HEAD_DV: gl.constexpr, DQK: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   VARLEN: gl.constexpr, WGS: gl.constexpr, PAIRS: gl.constexpr, PEEL: gl.constexpr,
                   AHEAD: gl.constexpr, PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, PART: gl.constexpr):
    gl.static_assert(WGS == 2 or not PIPE, "PIPE: two warpgroups only (configs.dkdv_hopper)")
    gl.static_assert(PART == 0 or not PIPE, "PIPE: dK and dV in one launch only (configs.dkdv_hopper)")
    gl.static_assert(not (HAS_WINDOW and (PAIRS or PEEL or PIPE)), "a window: no pairs, peel or pipelined dK MMA "
                                                                  "(configs.dkdv_hopper)")
    s_layout: gl.constexpr = mma_layout(BLOCK_M)
    d_layout: gl.constexpr = mma_layout(HEAD_D)  # dK's (HEAD_D: Dqk rounded up to a power of two)
    dv_layout: gl.constexpr = mma_layout(HEAD_DV)
    kb = n0 + WG * 64  # this warpgroup's first key
    if WGS == 2:
        k_sub = k_smem.slice(WG * 64, 64)
        v_sub = v_smem.slice(WG * 64, 64)
        dss_col = n0 // BLOCK_N
    else:
        k_sub = k_smem.index(WG)
        v_sub = v_smem.index(WG)
        dss_col = kb // BLOCK_N
    keys = kb + gl.arange(0, 64, gl.SliceLayout(1, s_layout))
    i_end = n_q  # HAS_WINDOW: this warpgroup's query tiles end before i_end (its last key's window ends there)
    if HAS_WINDOW:
        i_end = (kb + 64 + window - 2 - lo) // BLOCK_M + 1
    # S^T and dP^T are MMAs into fresh accumulators (use_acc=False) in registers carried from tile to tile, so
    # that no zero fill is needed per tile
    s_acc = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    dp_acc = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    # PART 1 and 2 leave the other accumulator untouched (the loops then carry nothing for it)
    dk = gl.zeros([64, HEAD_D], gl.float32, d_layout)
    dv = gl.zeros([64, HEAD_DV], gl.float32, dv_layout)
    c_dk = softmax_scale * 0.0 + 1.0  # dk, dv are kept in units of the last tile's scales (c_dk, c_dv)
    ck_max = softmax_scale * 0.0  # the largest sds * sq so far (_fp8.acc_units)
    c_dv = softmax_scale * 0.0 + 1.0
    # three warpgroups (192 keys): warpgroup WG's causal query tiles start WG tiles after the program's (the ones
    # before lie above its diagonal, where the dQ kernel wrote no dS scale: skipped, not masked), and the last
    # program's warpgroups past the keys (padded to a multiple of 128) compute nothing
    first = 0
    if WGS != 2:
        if CAUSAL:
            first = WG
        first = gl.where(kb < key_end, first, n_q)
    # AHEAD (always with GQA; where else: configs.DKDV_HOPPER_AHEAD): the query tiles' scales loaded a tile ahead
    # (Nsight Compute: the warps waited on these L2 loads under the MMAs) and the tile's head and row counted up (no
    # integer division per tile).
    g = 0
    i = 0
    SQ_G = SQ  # AHEAD: at the group's first tile
    SDO_G = SDO
    DSS_G = DSS
    if AHEAD:
        SQ_G = SQ + bh0 * N + lo
        SDO_G = SDO + bh0 * N + lo
        DSS_G = DSS + (bh0 * dss_tq + lo // BLOCK_M) * dss_tk + dss_col
        sq_n, sdo_n, sds_n = _tile_scales(SQ_G, SDO_G, DSS_G, g, i, N, dss_tq, dss_tk)
    else:
        sq_n = col_f  # unread: each tile loads its scales
        sdo_n = col_f
        sds_n = col_f
    mbarrier.wait(kv_bar, 0)
    # PEEL (dense, causal, one head): the query tiles across the diagonal before the loop, so that the loop's tiles
    # carry no mask test: two warpgroups, the first two tiles (i < 2); three, this warpgroup's tile `first` (the
    # ones before it released unread, and none past the keys). PAIRS (two warpgroups, dense: n_q is even): query
    # tiles two per iteration, the second without dv's rescale (it shares the first's 128-row dO8 quantization
    # tile: _tile's RESCALE_DV)
    DIAG: gl.constexpr = 0 if PEEL else 2
    t0 = 0
    s_prev = 0  # PIPE: the ring stage of the tile whose dK MMA is pending
    if PEEL and WGS == 2:
        for u in gl.static_range(2):  # the second tile skips dv's rescale as in a pair
            s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, g, i, sq_n, sdo_n, sds_n, s_prev = _step(
                k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, empty, u, g, i, sq_n,
                sdo_n, sds_n, SQ_G, SDO_G, DSS_G, SQ, SDO, DSS, keys, col_f, dp_f, bh0, lo, n_q, N, dss_tq, dss_tk,
                dss_col, first, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, s_prev, kb, i_end, window, GROUPS, STAGES,
                CAUSAL, WGS, u == 0 or not PAIRS, AHEAD, 1, PIPE, HAS_WINDOW, PART)
        t0 = 2
    elif PEEL:  # first <= n_q (first == n_q: a warpgroup past the keys)
        _release(ready, empty, 0, first, STAGES)
        t0 = first
        if AHEAD:  # the counters and scales start at tile `first` (the last tile's if none is left: unread)
            i = gl.minimum(first, n_q - 1)
            sq_n, sdo_n, sds_n = _tile_scales(SQ_G, SDO_G, DSS_G, g, i, N, dss_tq, dss_tk)
        if first < n_q:
            s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, g, i, sq_n, sdo_n, sds_n, s_prev = _step(
                k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, empty, first, g, i,
                sq_n, sdo_n, sds_n, SQ_G, SDO_G, DSS_G, SQ, SDO, DSS, keys, col_f, dp_f, bh0, lo, n_q, N, dss_tq,
                dss_tk, dss_col, first, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, s_prev, kb, i_end, window, GROUPS,
                STAGES, CAUSAL, WGS, True, AHEAD, 1, PIPE, HAS_WINDOW, PART)
            t0 = first + 1
    if PAIRS:
        for t2 in range(t0 // 2, GROUPS * n_q // 2):
            for u in gl.static_range(2):
                s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, g, i, sq_n, sdo_n, sds_n, s_prev = _step(
                    k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, empty, 2 * t2 + u,
                    g, i, sq_n, sdo_n, sds_n, SQ_G, SDO_G, DSS_G, SQ, SDO, DSS, keys, col_f, dp_f, bh0, lo, n_q, N,
                    dss_tq, dss_tk, dss_col, first, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, s_prev, kb, i_end,
                    window, GROUPS, STAGES, CAUSAL, WGS, u == 0, AHEAD, DIAG, PIPE, HAS_WINDOW, PART)
    else:
        for t in range(t0, GROUPS * n_q):
            s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, g, i, sq_n, sdo_n, sds_n, s_prev = _step(
                k_sub, v_sub, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, ready, empty, t, g, i, sq_n,
                sdo_n, sds_n, SQ_G, SDO_G, DSS_G, SQ, SDO, DSS, keys, col_f, dp_f, bh0, lo, n_q, N, dss_tq, dss_tk,
                dss_col, first, s_acc, dp_acc, dk, dv, c_dk, ck_max, c_dv, s_prev, kb, i_end, window, GROUPS, STAGES,
                CAUSAL, WGS, True, AHEAD, DIAG, PIPE, HAS_WINDOW, PART)
    if PIPE:  # the last tile's dK MMA
        dk = _last_dk(dp_acc, dk, qt_smem, empty, s_prev, d_layout)
    if PART == 0:
        _store_both(DK, DV, dk * (c_dk * softmax_scale), dv * c_dv, out_row, kb, key_end, VARLEN or WGS != 2)
    elif PART == 1:
        _store_rows(DV, dv * c_dv, out_row, kb, HEAD_DV)
    else:
        _store_rows(DK, dk * (c_dk * softmax_scale), out_row, kb, DQK)


@gluon.jit
def _store_both(DK, DV, dk, dv, out_row, kb, key_end, KEY_MASK: gl.constexpr):
    """PART 0: a warpgroup's 64 rows of dK and dV (Dqk = Dv: one set of offsets) at rows out_row + kb .. of DK and DV;
    KEY_MASK: only the keys before key_end (a padded sequence's end)."""
    layout: gl.constexpr = dk.type.layout
    keys = kb + gl.arange(0, 64, gl.SliceLayout(1, layout))
    cols = gl.arange(0, dk.shape[1], gl.SliceLayout(0, layout))
    offs = (out_row + keys).to(gl.int64)[:, None] * dk.shape[1] + cols[None, :]
    if KEY_MASK:
        mask = (keys < key_end)[:, None]
        gl.store(DK + offs, dk.to(DK.dtype.element_ty), mask=mask)
        gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=mask)
    else:
        gl.store(DK + offs, dk.to(DK.dtype.element_ty))
        gl.store(DV + offs, dv.to(DV.dtype.element_ty))


@gluon.jit
def _store_rows(X, x, out_row, kb, COLS: gl.constexpr):
    """PART 1 or 2 (dense batches): a warpgroup's 64 rows of dV or dK (x: 64 x a power of two >= COLS, the columns
    past COLS dropped) at rows out_row + kb .. of X (COLS per row)."""
    layout: gl.constexpr = x.type.layout
    keys = kb + gl.arange(0, 64, gl.SliceLayout(1, layout))
    cols = gl.arange(0, x.shape[1], gl.SliceLayout(0, layout))
    offs = (out_row + keys).to(gl.int64)[:, None] * COLS + cols[None, :]
    if COLS != x.shape[1]:
        gl.store(X + offs, x.to(X.dtype.element_ty), mask=(cols < COLS)[None, :])
    else:
        gl.store(X + offs, x.to(X.dtype.element_ty))


@gluon.jit
def _bwd_dkdv_hopper_kernel(
    k_desc, v_desc, q_desc, qt_desc, do_desc, dot_desc, lse_desc, delta_desc, SQ, SK, SV, SDO, DSS, DK, DV,
    Hq, Hkv, N, softmax_scale, n_tiles, head_group, dss_tq, dss_tk, CU, PCU, N_OUT, window,
    GROUPS: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    VARLEN: gl.constexpr, WGS: gl.constexpr, REGS: gl.constexpr, PAIRS: gl.constexpr, PEEL: gl.constexpr,
    AHEAD: gl.constexpr, PIPE: gl.constexpr, HAS_WINDOW: gl.constexpr, HEAD_DV: gl.constexpr, DQK: gl.constexpr,
    PART: gl.constexpr,
):
    # HEAD_D: q's and k's box width, Dqk rounded up to a power of two (TMA fills the columns past DQK with zeros);
    # HEAD_DV: Dv; DQK: Dqk, dK's row length; PART 0: dK and dV; 1: dV alone; 2: dK alone (configs.dkdv_parts)
    gl.static_assert(CAUSAL or not HAS_WINDOW, "a sliding window is causal (plan.gluon_why_not)")
    gl.static_assert(PART == 0 or (WGS == 2 and not VARLEN), "dV and dK in two launches: two warpgroups, dense "
                                                            "batches (configs.dkdv_hopper, plan.gluon_why_not)")
    # N: rows per head of the inputs and row arrays (padded ones for VARLEN: positions below are padded rows of the
    # head, and a sequence's dS tiles sit where the dQ kernel put them), N_OUT: of dK, dV
    base, length, start = _segment(CU, PCU, N, VARLEN)
    # the heaviest (first, under causal) key tiles first, as backward._bwd_dkdv_kernel
    pid_n, pid_bh = _grid_ids(n_tiles, head_group)  # pid_bh: b * Hkv + hk
    if VARLEN:
        if pid_n * (WGS * 64) >= length:  # a key block past this sequence's end (the grid covers the longest)
            return
    b = pid_bh // Hkv
    hk = pid_bh % Hkv
    n0 = base + pid_n * (WGS * 64)
    kv_row = pid_bh * N + n0  # rows of the (B*Hkv*M, D) views of k8, v8, dK, dV
    bh0 = b * Hq + hk * GROUPS  # the group's first query head
    lo = n0 * 0
    if CAUSAL:
        lo = n0
    if VARLEN:  # causal: the query tiles from the diagonal to the sequence's last (padded rows have P = 0)
        hi = base + (length + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        out_row = pid_bh * N_OUT + start - base  # + a padded key row: its packed row in dK, dV
    else:
        hi = N
        out_row = pid_bh * N
    if HAS_WINDOW:  # to the tile of the last query whose window holds the program's last key
        hi = gl.minimum(hi, (n0 + WGS * 64 + window - 2) // BLOCK_M * BLOCK_M + BLOCK_M)
    n_q = (hi - lo) // BLOCK_M
    col_f = softmax_scale * 1.4426950408889634 * gl.load(SK + kv_row)
    dp_f = gl.load(SV + kv_row)

    # the buffers a PART does not read are not allocated (at D = 256 all of them need 256 KB): their names stand for
    # buffers that are (never read). The allocation order is the one the kernels were timed and GPU-tested with (it
    # sets the shared-memory offsets, and so the SASS): PART 0 at D 64/128, and the two wide launches
    if WGS == 2:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
        if PART == 1:
            v_smem = k_smem
        else:
            v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    else:
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [WGS] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [WGS] + v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    if PART == 0:
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
        dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROW_LAYOUT)
        delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROW_LAYOUT)
    else:
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROW_LAYOUT)
        if PART == 1:
            do_smem = q_smem
            qt_smem = q_smem
            delta_smem = lse_smem
            dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape,
                                                 dot_desc.layout)
        else:
            do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
            qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
            delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], ROW_LAYOUT)
            dot_smem = q_smem
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    ready, empty = _ring_barriers(STAGES, WGS)

    if WGS == 2:
        gl.warp_specialize([
            (_mma_partition, (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
                              ready, empty, SQ, SDO, DSS, DK, DV, col_f, dp_f, softmax_scale, bh0, n0, lo, n_q, N,
                              dss_tq, dss_tk, out_row, base + length, window, 0, GROUPS, HEAD_D, HEAD_DV, DQK, STAGES,
                              CAUSAL, VARLEN, WGS, PAIRS, PEEL, AHEAD, PIPE, HAS_WINDOW, PART)),
            (_mma_partition, (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
                              ready, empty, SQ, SDO, DSS, DK, DV, col_f, dp_f, softmax_scale, bh0, n0, lo, n_q, N,
                              dss_tq, dss_tk, out_row, base + length, window, 1, GROUPS, HEAD_D, HEAD_DV, DQK, STAGES,
                              CAUSAL, VARLEN, WGS, PAIRS, PEEL, AHEAD, PIPE, HAS_WINDOW, PART)),
            (_loader, (k_desc, v_desc, q_desc, qt_desc, do_desc, dot_desc, lse_desc, delta_desc, k_smem, v_smem,
                       q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar, ready, empty, kv_row, bh0 * N,
                       bh0 * DQK, bh0 * HEAD_DV, lo, n_q, N, GROUPS, DQK, HEAD_DV, STAGES, WGS, PART)),
        ], [4, 1], [REGS, 24])
    else:
        # 192 keys span two 128-key quantization tiles (each warpgroup reads its own scales), and the last block's
        # may lie past the keys (padded to a multiple of 128: a row that exists for the scales)
        last = pid_bh * N + base + (length + BLOCK_N - 1) // BLOCK_N * BLOCK_N - 1
        row1 = gl.minimum(kv_row + 64, last)
        row2 = gl.minimum(kv_row + 128, last)
        col_f1 = softmax_scale * 1.4426950408889634 * gl.load(SK + row1)
        col_f2 = softmax_scale * 1.4426950408889634 * gl.load(SK + row2)
        dp_f1 = gl.load(SV + row1)
        dp_f2 = gl.load(SV + row2)
        gl.warp_specialize([
            (_mma_partition, (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
                              ready, empty, SQ, SDO, DSS, DK, DV, col_f, dp_f, softmax_scale, bh0, n0, lo, n_q, N,
                              dss_tq, dss_tk, out_row, base + length, window, 0, GROUPS, HEAD_D, HEAD_DV, DQK, STAGES,
                              CAUSAL, VARLEN, WGS, PAIRS, PEEL, AHEAD, PIPE, HAS_WINDOW, PART)),
            (_mma_partition, (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
                              ready, empty, SQ, SDO, DSS, DK, DV, col_f1, dp_f1, softmax_scale, bh0, n0, lo, n_q, N,
                              dss_tq, dss_tk, out_row, base + length, window, 1, GROUPS, HEAD_D, HEAD_DV, DQK, STAGES,
                              CAUSAL, VARLEN, WGS, PAIRS, PEEL, AHEAD, PIPE, HAS_WINDOW, PART)),
            (_mma_partition, (k_smem, v_smem, q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar,
                              ready, empty, SQ, SDO, DSS, DK, DV, col_f2, dp_f2, softmax_scale, bh0, n0, lo, n_q, N,
                              dss_tq, dss_tk, out_row, base + length, window, 2, GROUPS, HEAD_D, HEAD_DV, DQK, STAGES,
                              CAUSAL, VARLEN, WGS, PAIRS, PEEL, AHEAD, PIPE, HAS_WINDOW, PART)),
            (_loader, (k_desc, v_desc, q_desc, qt_desc, do_desc, dot_desc, lse_desc, delta_desc, k_smem, v_smem,
                       q_smem, qt_smem, do_smem, dot_smem, lse_smem, delta_smem, kv_bar, ready, empty, kv_row, bh0 * N,
                       bh0 * DQK, bh0 * HEAD_DV, lo, n_q, N, GROUPS, DQK, HEAD_DV, STAGES, WGS, PART)),
        ], [4, 4, 1], [REGS, REGS, 24])


def pipe_mode(pipe, fresh_dp):
    """The kernel's PIPE: 0 no pipelined dK MMA; 1 pipelined, dP^T's MMA into the registers that carried the previous
    tile's dS^T (converted to fp8 just before: no extra register); 2 pipelined, dP^T's MMA into a fresh accumulator
    (`fresh_dp`: a zero fill per tile), which ptxas of CUDA 13 needs (toolchain.PIPE_PTXAS_BELOW)."""
    return (2 if fresh_dp else 1) if pipe else 0


def dkdv_hopper(q8, q8t, k8, v8, do8, do8t, sq, sk, sv, sdo, lse2, delta, dss, dk, dv, *, causal, softmax_scale,
                dss_tq, dss_tk, grid, n_tiles, head_group, stages, warpgroups, regs, pairs, peel, ahead,
                pipe=False, fresh_dp=False, parts=(0,), segments=None, window=None):
    """Launch `_bwd_dkdv_hopper_kernel` (inputs as plan.gluon_why_not takes them; grid over the key blocks of
    64 x `warpgroups` keys, or the longest sequence's blocks x the sequences; `regs`: each MMA warpgroup's
    registers; `pairs`: query tiles two per iteration, two warpgroups only; `peel`: the causal diagonal's tiles
    before the loop, dense, one head per group only; `ahead`: each tile's scales loaded a tile ahead, required
    with GQA; `pipe`: each tile's dK MMA issued with the next tile's S^T and dP^T, two warpgroups and dense
    batches only; `fresh_dp`: with `pipe`, dP^T's MMA into a fresh accumulator, pipe_mode; `parts`: the launches,
    (0,) dK and dV at once or (1, 2) dV then dK (configs.dkdv_parts: Dqk = 192 or Dv = 256, where one warpgroup
    cannot hold both accumulators). Dqk need not be Dv (MLA: 192 / 128): q's and k's boxes are Dqk rounded up to a
    power of two wide, filled with zeros past Dqk, so dK's accumulator has that many columns, the extra ones dropped.
    segments: a packed batch's kernels.segments.Segments, every tensor but dk, dv in its padded layout. window: a causal
    sliding window (no pairs, peel or pipe then), each query's keys in (pos - window, pos]."""
    B, Hq, N, dqk = q8.shape
    Hkv, dv_ = k8.shape[1], v8.shape[3]
    box = 1 << (dqk - 1).bit_length()  # Gluon's blocks are powers of two
    cu, pcu = (segments.cu, segments.pcu) if segments is not None else (sq, sq)  # unread without VARLEN
    kbox = KEYS_PER_PROGRAM if warpgroups == 2 else 64  # three warpgroups: a box each
    descs = (_desc(k8, [kbox, box]), _desc(v8, [kbox, dv_]), _desc(q8, [QUERIES_PER_TILE, box]),
             _desc(q8t, [box, QUERIES_PER_TILE]), _desc(do8, [QUERIES_PER_TILE, dv_]),
             _desc(do8t, [dv_, QUERIES_PER_TILE]), _row_desc(lse2), _row_desc(delta))
    for part in parts:
        _bwd_dkdv_hopper_kernel[grid](
            *descs, sq, sk, sv, sdo, dss, dk, dv,
            Hq, Hkv, N, float(softmax_scale), n_tiles, head_group, dss_tq, dss_tk, cu, pcu, dk.shape[2],
            int(window) if window is not None else 0,
            GROUPS=Hq // Hkv, HEAD_D=box, STAGES=stages, CAUSAL=bool(causal), VARLEN=segments is not None,
            WGS=warpgroups, REGS=regs, PAIRS=bool(pairs), PEEL=bool(peel), AHEAD=bool(ahead),
            PIPE=pipe_mode(pipe, fresh_dp), HAS_WINDOW=window is not None, HEAD_DV=dv_, DQK=dqk, PART=part,
            num_warps=4,
        )
