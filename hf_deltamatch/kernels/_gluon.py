"""What the Gluon kernels for Hopper (fwd_hopper.py, dq_hopper.py, dkdv_hopper.py) share: tile sizes, TMA
descriptors over our FP8 and row tensors, the grid order, fp8 operands from accumulators. Written against Triton
3.6's Gluon API; compiles with 3.6, 3.7 and 3.9 (the TMA copy's name below). They run with the versions of
kernels/toolchain.py only (plan.gluon_why_not)."""

import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._descriptors import descriptor
from ._fp8 import SCALE_FLOOR, UNITS_SPAN

# Triton renamed the TMA copy into shared memory after 3.6 (3.9 keeps the old name only to raise)
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared

KEYS_PER_PROGRAM = 128  # keys per dS tile (config.block)
BLOCK_N = gl.constexpr(KEYS_PER_PROGRAM)
QUERIES_PER_TILE = 64  # queries per dS tile (DS_TILE_Q): one warpgroup's wgmma rows
QUERIES_PER_PROGRAM = 2 * QUERIES_PER_TILE  # the dQ kernel's programs: two warpgroups of 64 queries
BLOCK_M = gl.constexpr(QUERIES_PER_TILE)
# 1-D boxes of fp32 row values (LSE2, delta): no swizzle
ROW_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1))


@gluon.constexpr_function
def mma_layout(n):
    """The accumulator layout of one warpgroup's wgmma over a 64 x n tile (64 rows: 4 warps x 16)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])


@gluon.constexpr_function
def fp8_a_layout(parent):
    """The register layout of an fp8 A operand (P8, dS8) of a wgmma accumulating in `parent`."""
    return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=4)


@gluon.jit
def fp8_operand(x, layout: gl.constexpr):
    """The fp32 wgmma accumulator x (64 x n) as the fp8 A operand (`layout`, fp8_a_layout) of the next wgmma with
    no data movement: its columns reordered within each group of 32 (column c = 16 g1 + 8 g0 + 2 q + e goes to
    k = 16 g1 + 4 q + 2 g0 + e: quantize.k_order), so that each thread's accumulator values are the operand values it
    holds. The B operand's K rows must be stored in that order (quantize.token_major(k_order=True)); the plain
    conversion costs 8 shuffles, 8 selects and 8 byte permutes per 64 x 64 tile."""
    m: gl.constexpr = x.shape[0]
    n: gl.constexpr = x.shape[1]
    y = gl.reshape(x.to(gl.float8e4nv), [m, n // 32, 2, 2, 4, 2])
    y = gl.reshape(gl.permute(y, (0, 1, 2, 4, 3, 5)), [m, n])
    return gl.convert_layout(y, layout, assert_trivial=True)


@functools.lru_cache(maxsize=None)
def _layout(block):
    """The shared-memory layout of an fp8 TMA box (cached: building one is host time on every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


def _desc(x, block):
    """TMA descriptor over the 2-D view of x (B, H, N, D): (B*H*N, D) rows for a contiguous x, (B*H*D, N) for a
    token-major one (kernels.quantize.token_major: (B, H, D, N16) storage)."""
    B, H, N, D = x.shape
    if x.stride(2) == 1:
        return descriptor(TensorDescriptor, x, (B * H * D, N), (x.stride(3), 1), block, _layout(tuple(block)))
    return descriptor(TensorDescriptor, x, (B * H * N, D), (D, 1), block, _layout(tuple(block)))


def _row_desc(x, box=QUERIES_PER_TILE):
    """1-D TMA descriptor over the (B, H, N) fp32 row values x (LSE2, delta), boxes of `box` rows."""
    return descriptor(TensorDescriptor, x.view(-1), (x.numel(),), (1,), (box,), ROW_LAYOUT.value)


@gluon.jit
def _grid_ids(n_tiles, head_group):
    """(tile, batch * head) of this program, in the Triton kernels' order (forward._grid_ids): head groups,
    tile-major inside a group."""
    pid = gl.program_id(0)
    heads = gl.num_programs(0) // n_tiles
    g0 = (pid // (head_group * n_tiles)) * head_group
    size = gl.minimum(head_group, heads - g0)
    within = pid - g0 * n_tiles
    return within // size, g0 + within % size


@gluon.jit
def tile_scale(amax, FMAX: gl.constexpr, POW2: gl.constexpr):
    """_fp8.tile_scale in Gluon: max(amax / fmax, SCALE_FLOOR), optionally rounded up to a power of two; 1 for an
    all-zero tile."""
    scale = gl.maximum(amax / FMAX, SCALE_FLOOR)
    if POW2:
        scale = ((scale.to(gl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(gl.float32, bitcast=True)
    return gl.where(amax > 0, scale, 1.0)


@gluon.jit
def acc_units(c, c_max):
    """_fp8.acc_units in Gluon: (the accumulator's units for a tile of scale product c, the running max of c)."""
    c_max = gl.maximum(c_max, c)
    return gl.maximum(gl.maximum(c, c_max * UNITS_SPAN), SCALE_FLOOR), c_max


# One element per thread of a 4-warp partition: inline asm over it runs once per thread
_THREAD_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))


@gluon.jit
def _per_thread(ASM: gl.constexpr):
    """The PTX statement ASM once in each thread of a 4-warp partition (its result register unused)."""
    gl.inline_asm_elementwise(ASM + "\nmov.b32 $0, $1;", "=r,r", [gl.arange(0, 128, _THREAD_LAYOUT)], gl.int32,
                              False, 1)


@gluon.jit
def wait_turn(WG: gl.constexpr):
    """FA3's ping-pong of two MMA warpgroups: block until it is warpgroup WG's turn to issue its MMAs. Hardware
    named barriers 14 (warpgroup 0's turn) and 15 (1's), 256 threads each: WG's 128 threads sync there and the
    other warpgroup's 128 arrive (pass_turn). mbarriers would do the same through shared memory, at a higher
    latency (an mbarrier ping-pong of the forward was slower). Ids 0-2 are Triton's own (warp_specialize, arrive)."""
    if WG == 0:
        _per_thread("bar.sync 14, 256;")
    else:
        _per_thread("bar.sync 15, 256;")


@gluon.jit
def pass_turn(WG: gl.constexpr):
    """Warpgroup WG has issued its MMAs: the other warpgroup's turn (wait_turn). Non-blocking."""
    if WG == 0:
        _per_thread("bar.arrive 15, 256;")
    else:
        _per_thread("bar.arrive 14, 256;")


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr = 2):
    """(ready, empty) mbarriers of a ring of STAGES buffers: ready[s] completes when the loader's bytes landed
    (one arrive with the byte count), empty[s] when all CONSUMERS MMA warpgroups are done with the stage."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # one arrive per MMA warpgroup
    return ready, empty


@gluon.jit
def _release(ready, empty, u0, u1, STAGES: gl.constexpr):
    """Release the ring's steps u0 .. u1-1 unread (a warpgroup of a three-warpgroup program whose rows need fewer
    key tiles than the program's): each once loaded, or two releases of one stage could count as all consumers'
    arrives while another warpgroup still reads it."""
    for u in range(u0, u1):
        s = u % STAGES
        mbarrier.wait(ready.index(s), (u // STAGES) & 1)
        mbarrier.arrive(empty.index(s))


@gluon.jit
def _segment(CU, PCU, N, VARLEN: gl.constexpr):
    """(first padded row, tokens, first output row) of this program's sequence: grid axis 2 of a packed batch, whose
    sequence s sits at rows PCU[s] .. of the padded inputs (kernels.segments) and CU[s] .. of the outputs; a dense
    batch is one sequence of N rows at row 0 (constants: the dense kernels compile as without varlen)."""
    if VARLEN:
        s = gl.program_id(2)
        start = gl.load(CU + s)
        return gl.load(PCU + s), gl.load(CU + s + 1) - start, start
    else:
        return 0, N, 0


@gluon.jit
def _query_program(n_tiles, head_group, Hq, Hkv, N, GROUPS: gl.constexpr, CAUSAL: gl.constexpr,
                   WGS: gl.constexpr = 2, TAIL: gl.constexpr = False):
    """(KV head b * Hkv + hk, first query of the sequence's block, query head b * Hq + h, key tiles) of a
    query-major program of WGS warpgroups' queries (fwd_hopper, dq_hopper): the heaviest (last, under causal)
    query blocks first, as the Triton kernels. N: the sequence's tokens. TAIL (a padded sequence under the full
    mask): the last key tile may be partial (its keys past N masked by the caller)."""
    t, pid_bh = _grid_ids(n_tiles, head_group)  # pid_bh: b * Hq + h
    pid_m = n_tiles - 1 - t
    b = pid_bh // Hq
    hk = (pid_bh % Hq) // GROUPS
    q0 = pid_m * (WGS * BLOCK_M)
    if TAIL:
        n_k = (N + BLOCK_N - 1) // BLOCK_N
    else:
        n_k = N // BLOCK_N
    if CAUSAL:
        if WGS == 2:
            n_k = (q0 + 2 * BLOCK_M) // BLOCK_N  # key tiles up to the program's diagonal one (N = M)
        else:  # a block of 3 x 64 queries ends mid-tile, and the last block may pass the sequence's end
            n_k = gl.minimum(q0 + WGS * BLOCK_M + BLOCK_N - 1, N + BLOCK_N - 1) // BLOCK_N
    return b * Hkv + hk, q0, pid_bh, n_k
