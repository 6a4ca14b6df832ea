"""The correction pass on Hopper as its own Gluon kernel: delta = rowsum(P * dP), with three (or two) MMA
warpgroups, for the dQ kernel to read (launch.DQ_HOPPER_SPLIT; the dQ kernel then runs its second pass only).

Why: inside the dQ kernel the correction pass shares the program's two warpgroups with the dQ pass, whose S, dP
and dQ accumulators do not fit three warpgroups' registers. Alone it holds S and dP only, so an SM can run three
softmax streams, as the three-warpgroup forward does (launch.FWD_HOPPER_WARPGROUPS). The arithmetic is the dQ
kernel's pass 1 (dq_hopper._delta_tile) on the same tiles in the same order, so delta is bit-identical.
The program layout is the forward's (fwd_hopper.py): 64 queries per warpgroup, a TMA box each, each warpgroup's
own causal diagonal, the program's later key tiles released unread, rows past the sequence computing nothing.
Gluon has no interpreter; the GPU tests hold it to the fused dQ kernel (tests/test_kernels_gpu.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from ._gluon import (
    BLOCK_M, BLOCK_N, KEYS_PER_PROGRAM, QUERIES_PER_TILE, _desc, _query_program, _release, _ring_barriers, _segment,
    mma_layout, tma_load,
)
from .dq_hopper import _delta_tile


@gluon.jit
def _loader(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, q_row, kv_row,
            n_k, STAGES: gl.constexpr, WGS: gl.constexpr):
    mbarrier.expect(qo_bar, 2 * WGS * q_desc.block_type.nbytes)
    for w in gl.static_range(WGS):  # a TMA box's rows are a power of two: one box per warpgroup
        tma_load(q_desc, [q_row + w * BLOCK_M, 0], qo_bar, q_smem.index(w))
        tma_load(do_desc, [q_row + w * BLOCK_M, 0], qo_bar, do_smem.index(w))
    for j in range(n_k):
        s = j % STAGES
        # a fresh barrier counts as having completed the phase before its first: parity 1 passes at once
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(s)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [kv_row + j * BLOCK_N, 0], bar, k_smem.index(s))
        tma_load(v_desc, [kv_row + j * BLOCK_N, 0], bar, v_smem.index(s))


@gluon.jit
def _mma_partition(q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA, softmax_scale,
                   row0, r0, kv_row, n_k, length, WG: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                   SCALE_AFTER_SUM: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_sub = q_smem.index(WG)
    do_sub = do_smem.index(WG)
    rows = r0 + gl.arange(0, BLOCK_M, row_layout)  # this warpgroup's queries (sequence positions)
    valid = rows < length  # the last block's warpgroups may lie past the sequence
    # delta of the padded rows too (0: their P is 0), which the dQ and dK/dV kernels read: up to the next 128
    padded = rows < (length + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lse = gl.load(LSE + row0 + rows, mask=valid, other=float("-inf"))
    # -inf LSE (no visible key): +inf makes P = exp2(S - inf) = 0 without NaN
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    srow = row0 + gl.minimum(r0, length - 1)  # one quantization tile holds the 64 rows (a row that exists)
    row_f = softmax_scale * 1.4426950408889634 * gl.load(SQ + srow)
    dp_f = gl.load(SDO + srow)
    n_own = n_k  # the key tiles this warpgroup computes on: up to its own diagonal (N = M)
    if CAUSAL:
        n_own = gl.minimum(r0 // BLOCK_N + 1, n_k)
    n_own = gl.where(r0 < length, n_own, 0)
    s_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)  # fresh accumulators (use_acc=False), carried
    dp_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    delta = gl.zeros([BLOCK_M], gl.float32, row_layout)
    sk_t = gl.load(SK + kv_row)
    sv_t = gl.load(SV + kv_row)
    # the causal diagonal tile peeled off the loop, as in the dQ kernel
    n_plain = n_own - 1 if CAUSAL else n_own
    mbarrier.wait(qo_bar, 0)
    for u in range(n_plain):
        s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
            q_sub, do_sub, k_smem, v_smem, ready, empty, u, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows, s_acc,
            dp_acc, delta, sk_t, sv_t, False, STAGES, SCALE_AFTER_SUM, WG, 0)
    if CAUSAL:
        if n_own > 0:
            s_acc, dp_acc, delta, sk_t, sv_t = _delta_tile(
                q_sub, do_sub, k_smem, v_smem, ready, empty, n_plain, SK, SV, kv_row, n_k, row_f, dp_f, lse2, rows,
                s_acc, dp_acc, delta, sk_t, sv_t, True, STAGES, SCALE_AFTER_SUM, WG, 0)
    _release(ready, empty, n_own, n_k, STAGES)
    gl.store(DELTA + row0 + rows, delta, mask=padded)


@gluon.jit
def _bwd_delta_hopper_kernel(
    q_desc, do_desc, k_desc, v_desc, SQ, SK, SV, SDO, LSE, DELTA, Hq, Hkv, N, softmax_scale, n_tiles, head_group,
    CU, PCU, GROUPS: gl.constexpr, HEAD_D: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    SCALE_AFTER_SUM: gl.constexpr, VARLEN: gl.constexpr, WGS: gl.constexpr, REGS: gl.constexpr,
):
    # N: rows per head of every input and of DELTA (padded ones for VARLEN, where DELTA stays padded too)
    base, length, _ = _segment(CU, PCU, N, VARLEN)
    kvh, q0, pid_bh, n_k = _query_program(n_tiles, head_group, Hq, Hkv, length, GROUPS, CAUSAL, WGS)
    if VARLEN:  # a block past this sequence's padded rows (the grid covers the longest)
        if q0 >= (length + BLOCK_N - 1) // BLOCK_N * BLOCK_N:
            return
    row0 = pid_bh * N + base  # the sequence's rows in the (B*Hq*N,) row arrays and the (B*Hq*N, D) views
    kv_row = kvh * N + base  # the KV head's rows in the (B*Hkv*M, D) views of k8, v8 and in sk, sv

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [WGS] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [WGS] + do_desc.block_type.shape, do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qo_bar, count=1)
    ready, empty = _ring_barriers(STAGES, WGS)

    if WGS == 2:
        gl.warp_specialize([
            (_mma_partition, (q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA,
                              softmax_scale, row0, q0, kv_row, n_k, length, 0, STAGES, CAUSAL, SCALE_AFTER_SUM)),
            (_mma_partition, (q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA,
                              softmax_scale, row0, q0 + BLOCK_M, kv_row, n_k, length, 1, STAGES, CAUSAL,
                              SCALE_AFTER_SUM)),
            (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty,
                       row0 + q0, kv_row, n_k, STAGES, WGS)),
        ], [4, 1], [REGS, 24])
    else:
        gl.warp_specialize([
            (_mma_partition, (q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA,
                              softmax_scale, row0, q0, kv_row, n_k, length, 0, STAGES, CAUSAL, SCALE_AFTER_SUM)),
            (_mma_partition, (q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA,
                              softmax_scale, row0, q0 + BLOCK_M, kv_row, n_k, length, 1, STAGES, CAUSAL,
                              SCALE_AFTER_SUM)),
            (_mma_partition, (q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty, SQ, SK, SV, SDO, LSE, DELTA,
                              softmax_scale, row0, q0 + 2 * BLOCK_M, kv_row, n_k, length, 2, STAGES, CAUSAL,
                              SCALE_AFTER_SUM)),
            (_loader, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, qo_bar, ready, empty,
                       row0 + q0, kv_row, n_k, STAGES, WGS)),
        ], [4, 4, 1], [REGS, REGS, 24])


def delta_hopper(q8, k8, v8, do8, sq, sk, sv, sdo, lse, delta, *, causal, softmax_scale, grid, n_tiles, head_group,
                 stages, warpgroups, regs, scale_after_sum, segments=None):
    """Launch `_bwd_delta_hopper_kernel` (the dQ kernel's case, launch._dq_hopper; grid over the query blocks of
    64 x `warpgroups` queries, or the longest sequence's blocks x the sequences). segments: a packed batch's
    kernels.segments.Segments, every tensor in its padded layout."""
    B, Hq, N, D = q8.shape
    Hkv = k8.shape[1]
    cu, pcu = (segments.cu, segments.pcu) if segments is not None else (lse, lse)  # unread without VARLEN
    _bwd_delta_hopper_kernel[grid](
        _desc(q8, [QUERIES_PER_TILE, D]), _desc(do8, [QUERIES_PER_TILE, D]), _desc(k8, [KEYS_PER_PROGRAM, D]),
        _desc(v8, [KEYS_PER_PROGRAM, D]), sq, sk, sv, sdo, lse, delta, Hq, Hkv, N, float(softmax_scale), n_tiles,
        head_group, cu, pcu, GROUPS=Hq // Hkv, HEAD_D=D, STAGES=stages, CAUSAL=bool(causal),
        SCALE_AFTER_SUM=scale_after_sum, VARLEN=segments is not None, WGS=warpgroups, REGS=regs, num_warps=4,
    )
