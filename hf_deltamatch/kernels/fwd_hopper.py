"""The forward on Hopper, written in Gluon: one TMA warp feeding three independent MMA warpgroups (on at D 64 and
128: configs.GLUON_HEAD_DIMS).

The same contract and arithmetic as `_fwd_kernel` (forward.py) for the Gluon kernels' common case (plan.gluon_why_not):
fp8, Dqk = Dv in (64, 128), no window or (HAS_WINDOW) a causal sliding one, N = M a multiple of 128, or a causal packed
batch (VARLEN: its sequences padded to multiples of 128 rows by kernels.segments, outputs to the packed rows; also a
dense batch of N not a multiple of 128, each head one such sequence, causal or (its last key tile masked past N) full).
A program covers 64 queries per MMA warpgroup; the loader streams each key tile (k8 and the token-major v8) once for all
(a warpgroup whose diagonal comes before the program's last key tile releases that tile unread; with HAS_WINDOW the
loader starts at the key tile of the program's first query's window, a warpgroup whose own window starts a tile later
releases that tile unread, and the tiles the window's edge cuts are masked like the diagonal); v8 comes token-major with
its keys in k_order, so P8 is the score accumulator as it is (_gluon.fp8_operand).
Per key tile of 128 keys, in one warpgroup (rows r0 .. r0+63):
    S = q8 k8^T                                               (async)
    m' = max(m, rowmax(S) * f),  f = sq sk scale log2e         (f > 0: rowmax(S) f = rowmax(S f) exactly)
    P * 256 = exp2(S f - m' + 8),  alpha = exp2(m - m'),  l = l alpha + rowsum(P * 256)
    O = O * alpha * (c / c') + (P * 256)8 v8,  c' = sv / 256   (O is kept in units of the last tile's c')
and at the end O * c / (l / 256), LSE = (m + log2(l / 256)) ln 2. The Triton kernel's values and roundings.
Also Dv = 256 with Dqk = 256 (two MMA warpgroups: WIDE_WARPGROUPS) and MLA's Dqk = 192 / Dv = 128 (three), on
dense batches of N = M a multiple of 128 (configs.GLUON_WIDE_DIMS): the same 128-key tiles and steps.
Gluon has no interpreter; tests/test_kernels_gpu.py::test_fwd_hopper_kernel holds it to `_fwd_kernel`.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from ._gluon import (
    BLOCK_M, BLOCK_N, KEYS_PER_PROGRAM, QUERIES_PER_TILE, _desc, _query_program, _release, _ring_barriers,
    _segment, fp8_a_layout, fp8_operand, mma_layout, tma_load,
)

# MMA warpgroups per program (64 queries each), so that an SM runs three softmax streams (S, O and P8 fit in 160
# registers without spills, configs.FWD_HOPPER_REGS), faster than two (docs/kernels.md)
WARPGROUPS = 3
WGS = gl.constexpr(WARPGROUPS)
# At Dv = 256 (configs.GLUON_WIDE_DIMS) O alone takes 128 registers per thread of a warpgroup: two MMA
# warpgroups of configs.FWD_HOPPER_WIDE_REGS each, as FlashAttention-3 runs D=256
WIDE_WARPGROUPS = 2
WIDE_WGS = gl.constexpr(WIDE_WARPGROUPS)


@gluon.jit
def _loader(q_desc, k_desc, vt_desc, q_smem, k_smem, vt_smem, q_bar, ready, empty, q_row, kv_row, vt_row, vt_col,
            lo, n_k, STAGES: gl.constexpr, NWG: gl.constexpr = WGS):
    # a TMA box's rows are a power of two: one box per warpgroup (NWG: the program's MMA warpgroups)
    mbarrier.expect(q_bar, NWG * q_desc.block_type.nbytes)
    for w in gl.static_range(NWG):
        tma_load(q_desc, [q_row + w * BLOCK_M, 0], q_bar, q_smem.index(w))
    for j in range(lo, n_k):  # lo: the program's first key tile (0 without a window)
        u = j - lo  # the ring's step
        s = u % STAGES
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes at once
        mbarrier.wait(empty.index(s), ((u // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, k_desc.block_type.nbytes + vt_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], bar, k_smem.index(s))
        tma_load(vt_desc, [vt_row, vt_col + j * BLOCK_N], bar, vt_smem.index(s))


@gluon.jit
def _online_softmax(qk, f, m_i, l_i, keys, rows, window, MASK: gl.constexpr, HAS_WINDOW: gl.constexpr):
    """(P * 256, alpha, l, m) of one tile; MASK: the causal diagonal tile, or with HAS_WINDOW any tile cut by the
    diagonal or by the window's left edge (keys > rows - window). Called from both branches of the mask test, so
    that each is straight-line code (a branch between the multiply and the subtract keeps them from fusing into one
    FFMA per score)."""
    if MASK:
        if HAS_WINDOW:
            vis = (keys[None, :] <= rows[:, None]) & (keys[None, :] > rows[:, None] - window)
            qk = gl.where(vis, qk, float("-inf"))
        else:
            qk = gl.where(keys[None, :] <= rows[:, None], qk, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1) * f)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: P = 0
    p256 = gl.exp2(qk * f - (m_safe - 8.0)[:, None])  # the static P scale 256 in the exponent
    alpha = gl.exp2(m_i - m_safe)
    return p256, alpha, l_i * alpha + gl.sum(p256, 1), m_new


@gluon.jit
def _mma_partition(q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, row_f, out0, r0, kv_row, lo, n_k,
                   length, window, WG: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, VARLEN: gl.constexpr, HAS_WINDOW: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    o_layout: gl.constexpr = mma_layout(HEAD_D)
    a_layout: gl.constexpr = fp8_a_layout(o_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_sub = q_smem.index(WG)
    rows = r0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))  # this warpgroup's queries
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, o_layout)
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # fresh accumulator (use_acc=False), carried
    c_acc = row_f * 0.0 + 1.0  # acc's unit: sv / 256 of the last key tile
    n_own = n_k  # the key tiles this warpgroup computes on
    # 3 x 64 queries: the program's last key tile may lie past this warpgroup's diagonal, and the last block's
    # warpgroups past the sequence (they compute nothing, store nothing)
    diag = r0 // BLOCK_N
    if CAUSAL:
        n_own = gl.minimum(diag + 1, n_k)
    n_own = gl.where(r0 < length, n_own, 0)
    j0 = 0  # the first key tile this warpgroup computes on
    if HAS_WINDOW:  # the ring starts at the program's first key tile lo (its first query's window): steps j - lo
        # this warpgroup's rows see keys from r0 - window + 1 on; the tiles from lo before it are released unread
        n_own = gl.maximum(n_own, lo)  # a warpgroup past the sequence: nothing computed, every tile released
        j0 = gl.minimum(gl.maximum(r0 - window + 1, 0) // BLOCK_N, n_own)
        # tiles before mid_w hold keys that some of its rows cannot see (keys <= r0 + 63 - window): masked
        mid_w = (gl.maximum(r0 + BLOCK_M - window, 0) + BLOCK_N - 1) // BLOCK_N
        _release(ready, empty, 0, j0 - lo, STAGES)
    mbarrier.wait(q_bar, 0)
    for j in range(j0, n_own):
        u = j - lo  # the ring's step (lo = 0 without a window)
        s = u % STAGES
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        s_acc = warpgroup_mma(q_sub, k_smem.index(s).permute((1, 0)), s_acc, use_acc=False, is_async=True)
        f = row_f * gl.load(SK + kv_row + j * BLOCK_N)  # sk, sv: one scale per key tile
        c = gl.load(SV + kv_row + j * BLOCK_N) * (1.0 / 256.0)
        s_acc = warpgroup_mma_wait(0, deps=(s_acc, ))
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        if HAS_WINDOW:  # causal: the diagonal key tile and the tiles cut by the window's left edge
            if (j == diag) | (j < mid_w):
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, True, True)
            else:
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, False, True)
        elif CAUSAL:
            if j == diag:  # the diagonal key tile (N = M: top-left = bottom-right)
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, True, False)
            else:
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, False, False)
        elif VARLEN:  # the full mask on a padded sequence: the last key tile's keys past its end masked
            if j == n_k - 1:
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows * 0 + (length - 1), window,
                                                        True, False)
            else:
                p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, False, False)
        else:
            p256, alpha, l_i, m_i = _online_softmax(s_acc, f, m_i, l_i, keys, rows, window, False, False)
        # the rows of S's and O's MMA layouts sit in the same threads: the conversion moves nothing
        acc = acc * gl.convert_layout(alpha * (c_acc / c), orow_layout)[:, None]
        c_acc = c
        p8 = fp8_operand(p256, a_layout)  # vt_smem's keys in k_order
        acc = warpgroup_mma(p8, vt_smem.index(s).permute((1, 0)), acc, is_async=True)
        # nothing in flight across the loop's back edge (ptxas would serialize every wgmma: dkdv_hopper.py)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index(s))
    _release(ready, empty, n_own - lo, n_k - lo, STAGES)
    l_i = l_i * 0.00390625  # P * 256 was summed: back to P (a power of two, exact)
    has = l_i != 0.0  # NaN (a non-finite input) included: out and lse NaN
    l_safe = gl.where(has, l_i, 1.0)
    out = acc * gl.convert_layout(c_acc / l_safe, orow_layout)[:, None]
    lse = gl.where(has, (m_i + gl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    orows = r0 + gl.arange(0, BLOCK_M, orow_layout)
    ocols = gl.arange(0, HEAD_D, gl.SliceLayout(0, o_layout))
    optrs = O + (out0 + orows).to(gl.int64)[:, None] * HEAD_D + ocols[None, :]
    # the sequence's rows only (padded rows are not tokens; 3 x 64 may pass N)
    gl.store(optrs, out.to(O.dtype.element_ty), mask=(orows < length)[:, None])
    gl.store(LSE + out0 + rows, lse, mask=rows < length)


@gluon.jit
def _fwd_hopper_kernel(
    q_desc, k_desc, vt_desc, SQ, SK, SV, O, LSE, Hq, Hkv, N, softmax_scale, n_tiles, head_group, CU, PCU, N_OUT,
    window, GROUPS: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    VARLEN: gl.constexpr, REGS: gl.constexpr, HAS_WINDOW: gl.constexpr, NWG: gl.constexpr = WGS,
):
    # HEAD_D: Dv (O's columns, v8t's rows per head); q8's and k8's Dqk is their descriptors' box width. NWG: MMA
    # warpgroups, WARPGROUPS or (Dv = 256, dense batches without a window) WIDE_WARPGROUPS
    gl.static_assert(NWG == WGS or (NWG == WIDE_WGS and not VARLEN and not HAS_WINDOW),
                     "configs.fwd_hopper's warpgroups")
    gl.static_assert(CAUSAL or not HAS_WINDOW, "a sliding window is causal (plan.gluon_why_not)")
    # N: rows per head of the inputs (padded ones for VARLEN), N_OUT: of the outputs O, LSE
    base, length, start = _segment(CU, PCU, N, VARLEN)
    kvh, q0, pid_bh, n_k = _query_program(n_tiles, head_group, Hq, Hkv, length, GROUPS, CAUSAL, NWG,
                                          VARLEN and not CAUSAL)
    if VARLEN:
        if q0 >= length:  # a block past this sequence's end (the grid covers the longest)
            return
    row0 = pid_bh * N + base  # the sequence's rows in the (B*Hq*N, D) view of q8 and in sq
    kv_row = kvh * N + base  # the KV head's rows in the (B*Hkv*M, D) views of k8, v8 and in sk, sv
    if VARLEN:
        out0 = pid_bh * N_OUT + start  # its rows in O and LSE
    else:
        out0 = row0
    lo = 0  # the program's first key tile: the one its first query's window starts in
    if HAS_WINDOW:
        lo = gl.maximum(q0 - window + 1, 0) // BLOCK_N

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [NWG] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    ready, empty = _ring_barriers(STAGES, NWG)

    # one quantization tile holds each warpgroup's 64 rows: a scalar score factor per warpgroup
    f0 = softmax_scale * 1.4426950408889634 * gl.load(SQ + row0 + q0)
    # the last block's second and third warpgroups may lie past the sequence (their scale: a row that exists)
    f1 = softmax_scale * 1.4426950408889634 * gl.load(SQ + row0 + gl.minimum(q0 + BLOCK_M, length - 1))
    f2 = softmax_scale * 1.4426950408889634 * gl.load(SQ + row0 + gl.minimum(q0 + 2 * BLOCK_M, length - 1))
    if NWG == WIDE_WGS:  # Dv = 256 (f2 unused)
        gl.warp_specialize([
            (_mma_partition, (q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, f0, out0, q0, kv_row,
                              lo, n_k, length, window, 0, HEAD_D, STAGES, CAUSAL, VARLEN, HAS_WINDOW)),
            (_mma_partition, (q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, f1, out0, q0 + BLOCK_M,
                              kv_row, lo, n_k, length, window, 1, HEAD_D, STAGES, CAUSAL, VARLEN, HAS_WINDOW)),
            (_loader, (q_desc, k_desc, vt_desc, q_smem, k_smem, vt_smem, q_bar, ready, empty, row0 + q0, kv_row,
                       kvh * HEAD_D, base, lo, n_k, STAGES, NWG)),
        ], [4, 1], [REGS, 24])
        return
    gl.warp_specialize([
        (_mma_partition, (q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, f0, out0, q0, kv_row,
                          lo, n_k, length, window, 0, HEAD_D, STAGES, CAUSAL, VARLEN, HAS_WINDOW)),
        (_mma_partition, (q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, f1, out0, q0 + BLOCK_M,
                          kv_row, lo, n_k, length, window, 1, HEAD_D, STAGES, CAUSAL, VARLEN, HAS_WINDOW)),
        (_mma_partition, (q_smem, k_smem, vt_smem, q_bar, ready, empty, SK, SV, O, LSE, f2, out0,
                          q0 + 2 * BLOCK_M, kv_row, lo, n_k, length, window, 2, HEAD_D, STAGES, CAUSAL, VARLEN,
                          HAS_WINDOW)),
        (_loader, (q_desc, k_desc, vt_desc, q_smem, k_smem, vt_smem, q_bar, ready, empty, row0 + q0, kv_row,
                   kvh * HEAD_D, base, lo, n_k, STAGES)),
    ], [4, 4, 1], [REGS, REGS, 24])


def fwd_hopper(q8, k8, v8t, sq, sk, sv, out, lse, *, causal, softmax_scale, grid, n_tiles, head_group, stages,
               regs, segments=None, warpgroups=WARPGROUPS, window=None):
    """Launch `_fwd_hopper_kernel` (inputs as plan.gluon_why_not takes them; grid over the query blocks of
    64 x `warpgroups` queries, or the longest sequence's blocks x the sequences; `regs`: each MMA warpgroup's
    registers). segments: a packed batch's kernels.segments.Segments, the fp8 inputs and scales in its padded
    layout, out and lse packed. q8, k8 of head dim Dqk, v8t (token-major) of Dv. window: a causal sliding window,
    each query's keys in (pos - window, pos]."""
    B, Hq, N, D = q8.shape
    Hkv, dv = k8.shape[1], v8t.shape[3]
    # a box is a power of two wide: MLA's Dqk = 192 reads 256 columns, TMA filling the 64 past the row with zeros
    # (they add 0 to S)
    D = 1 << (D - 1).bit_length()
    cu, pcu = (segments.cu, segments.pcu) if segments is not None else (lse, lse)  # unread without VARLEN
    _fwd_hopper_kernel[grid](
        _desc(q8, [QUERIES_PER_TILE, D]), _desc(k8, [KEYS_PER_PROGRAM, D]),
        _desc(v8t, [dv, KEYS_PER_PROGRAM]),
        sq, sk, sv, out, lse, Hq, Hkv, N, float(softmax_scale), n_tiles, head_group, cu, pcu, out.shape[2],
        int(window) if window is not None else 0,
        GROUPS=Hq // Hkv, HEAD_D=dv, STAGES=stages, CAUSAL=bool(causal), VARLEN=segments is not None,
        REGS=regs, HAS_WINDOW=window is not None, NWG=warpgroups, num_warps=4,
    )
