"""Launch choices of the Triton kernels: block sizes, warps and stages per kernel, and where each kernel reads
through TMA descriptors, waits on its MMAs or reads its scales through inline PTX; all measured on the H200
(benchmarks/NOTES.md), all overridable for tuning runs through TUNE.
"""

from ._fp8 import INTERPRET

# Launch-config overrides for tuning runs (benchmarks/kernel_breakdown.py, benchmarks/sm90_registers.py):
# {"fwd": (BLOCK_M, warps, stages), "dq": (BLOCK_M, warps, stages), "dkdv": (warps, stages), and per kernel
# "fwd_maxnreg" / "dq_maxnreg" / "dkdv_maxnreg": a register cap (ptxas .maxnreg, to fit more programs per SM),
# "fwd_tma" / "dq_tma" / "dkdv_tma": True / False to force TMA descriptor loads on / off (see _use_tma),
# "fwd_wait_mma" / "dq_wait_mma" / "dkdv_wait_mma": True / False to wait on accumulating MMAs inside the loop
# iteration or not (see _wait_mma), "<kernel>_asm_scales": False to read per-tile scales with tl.load (_asm_scales),
# "fwd_head_group" / "dq_head_group" / "dkdv_head_group": heads handed out together (see _grid),
# "dq_scale_after_sum": True / False (see _scale_after_sum), "dkdv_lse2" / "dkdv_p256": True / False (see
# _dkdv_lse2, _dkdv_p_shift), "dkdv_split": True / False (see _dkdv_parts), "dkdv_ds_scales": True / False (see
# _dkdv_ds_scales), "dkdv_block_n": the dK/dV kernel's key tile (see _dkdv_block_n), "dkdv_fold_ds_scale": True /
# False (see _dkdv_fold_ds_scale), "dkdv_hopper": True / False for the Gluon dK/dV kernel where it applies (see
# _dkdv_hopper), "dkdv_hopper_stages": its ring of q/dO buffers, "dkdv_hopper_fold": True / False (1/sds in dP's scale
# and delta, as _dkdv_fold_ds_scale), "dkdv_hopper_pairs": True / False (see DKDV_HOPPER_PAIRS),
# "dq_hopper": True / False for the Gluon dQ kernel (see _dq_hopper),
# "dq_hopper_stages": its ring of k/v buffers, "dq_hopper_pingpong": 0, 1, 2 (see DQ_HOPPER_PINGPONG),
# "dq_hopper_pipe": True / False (see DQ_HOPPER_PIPE_FULL), "dkdv_hopper_pipe": True / False (DKDV_HOPPER_PIPE),
# "fwd_hopper" / "fwd_hopper_stages": the same for the forward,
# "fwd_hopper_wgs" / "dkdv_hopper_wgs": (MMA warpgroups, registers) of the Gluon forward / dK/dV kernel, or
# {head dim: that} (see FWD_HOPPER_WARPGROUPS),
# "hopper_packed": True / False for the Gluon kernels on packed batches (see _hopper_case)}.
# Empty in normal use.
TUNE: dict = {}
TUNE_KEYS = ({"fwd", "dq", "dkdv", "dq_scale_after_sum", "dkdv_lse2", "dkdv_p256", "dkdv_split", "dkdv_ds_scales",
              "dkdv_block_n", "dkdv_fold_ds_scale", "dkdv_hopper", "dkdv_hopper_stages",
              "dkdv_hopper_fold", "dkdv_hopper_pairs", "dkdv_hopper_peel", "dkdv_hopper_ahead", "dq_hopper",
              "dq_hopper_stages", "fwd_hopper", "fwd_hopper_stages", "fwd_hopper_wgs", "dkdv_hopper_wgs",
              "hopper_packed", "dq_hopper_pingpong", "dq_hopper_pipe", "dkdv_hopper_pipe"}
             | {f"{k}_{o}" for k in ("fwd", "dq", "dkdv")
                for o in ("maxnreg", "tma", "wait_mma", "asm_scales", "head_group")})


def _check_tune():
    """A misspelt TUNE key would silently time the defaults: refuse it."""
    unknown = set(TUNE) - TUNE_KEYS
    if unknown:
        raise KeyError(f"unknown kernels.TUNE keys {sorted(unknown)}; known: {sorted(TUNE_KEYS)}")


def _fwd_launch_cfg(dqk: int, dv: int, fp8: bool):
    """(BLOCK_M, num_warps, num_stages) of the forward, by head dim (H200 measurements, benchmarks/NOTES.md)."""
    if "fwd" in TUNE:
        return TUNE["fwd"]
    d = max(dqk, dv)
    if d <= 128:  # H200, N=8192 causal D=128 (run 1917): (64, 4, 3) 0.787 ms vs (128, 8, 3) 0.962, (64, 4, 2) 1.009
        return 64, 4, 3
    # D=256 (run 2144): (64, 8, 3) 1.196 ms vs (64, 8, 2) 1.371, (64, 8, 1) 1.551; 2 warpgroups split the head dim.
    # bf16 tiles are twice the bytes: 1 stage keeps shared memory within the SM's 227 KB (3 stages: 416 KB)
    return (64, 8, 3) if fp8 else (64, 8, 1)


# The head dims (max of Dqk, Dv) at which each kernel reads its FP8 tiles through TMA tensor descriptors by
# default (H200, N=8192, same run, benchmarks/NOTES.md): the forward kernel 6-11 % faster at D 64/128, the
# dQ kernel 9-10 % faster at D=128 but 2 % slower at D=64, the dK/dV kernel 5-20 % slower (opt-in only).
TMA_HEAD_DIMS = {"fwd": (64, 128), "dq": (128,), "dkdv": ()}


def _use_tma(kernel: str, fp8: bool, dqk: int, dv: int, starts_aligned: bool = True) -> bool:
    """Whether `kernel` ("fwd", "dq" or "dkdv") reads its FP8 tiles through TMA tensor descriptors. fp8 only
    (q8, k8, v8, dO8 and their token-major copies are contiguous buffers of ours, so 2-D descriptors over
    them are valid; bf16 inputs may have any strides); by default at the head dims of TMA_HEAD_DIMS, or at
    any head dim <= 128 (True) / never (False) with TUNE[f"{kernel}_tma"]. Token-major tiles start at a
    sequence's first token in the innermost dimension: the H200 faulted (illegal instruction) on a varlen
    batch whose starts were not multiples of 16 tokens, and the interpreter rejects them too, so such
    batches (starts_aligned=False, from _seq_info) take the pointer path."""
    d = max(dqk, dv)
    want = TUNE.get(f"{kernel}_tma", d in TMA_HEAD_DIMS[kernel])
    return fp8 and bool(want) and d <= 128 and starts_aligned


# How the loops treat their MMAs and per-tile scales (H200, N=8192, each choice against the other in the same
# run, benchmarks/NOTES.md). Left alone, Triton keeps each loop's accumulating MMA (into O, dQ, dK/dV) in flight
# across the back edge and turns the in-loop scale loads into cp.async copies, and with both ptxas serializes
# every wgmma of the kernel. Two ways out: wait on the MMA inside the iteration (forward._mma_done; the dQ kernel
# 5-10 % faster than serialized, the forward slower), or read the scales through inline PTX (forward._scale),
# which keeps the MMAs in flight unserialized: the forward kernel 2-3 % faster at D=128 (18 % slower at D=64),
# the dQ kernel 4 % faster than waiting, dK/dV 10 % faster at D=128 causal but 4 % slower on the full mask.
# All chosen against Triton 3.6's code generation (the GPU image's); Triton 3.9 does not serialize these loops.
WAIT_MMA_HEAD_DIMS = {"fwd": (), "dq": (), "dkdv": ()}
ASM_SCALES_HEAD_DIMS = {"fwd": (128,), "dq": (64, 128), "dkdv": (128,)}
ASM_SCALES_CAUSAL_ONLY = ("dkdv",)


def _wait_mma(kernel: str, d: int) -> bool:
    """Whether `kernel` ("fwd", "dq", "dkdv") waits on its accumulating MMA inside each loop iteration (dK/dV: on
    the iteration's last one, dK's), at head dim d = max(Dqk, Dv) (WAIT_MMA_HEAD_DIMS, or TUNE)."""
    return bool(TUNE.get(f"{kernel}_wait_mma", d in WAIT_MMA_HEAD_DIMS[kernel]))


def _asm_scales(kernel: str, d: int, causal: bool = True) -> bool:
    """Whether `kernel` reads its per-tile scales in the loop through inline PTX (ASM_SCALES_HEAD_DIMS and
    ASM_SCALES_CAUSAL_ONLY, or TUNE[f"{kernel}_asm_scales"]); never under the interpreter, which has no PTX."""
    want = d in ASM_SCALES_HEAD_DIMS[kernel] and (causal or kernel not in ASM_SCALES_CAUSAL_ONLY)
    return not INTERPRET and bool(TUNE.get(f"{kernel}_asm_scales", want))


# Head dims at which the correction pass multiplies each key tile's row sums of P * dP by the tile's dP scale
# instead of scaling every dP first (the same delta up to fp32 rounding): its unmasked loop 385 -> 321 SASS
# instructions per warp per tile at D=128 (sm_90, Triton 3.6; benchmarks/sm90_registers.py --loops). H200,
# N=8192 (run 2110): the dQ kernel 1.783 -> 1.720 ms causal, 3.253 -> 3.182 full at D=128; 2.563 -> 2.589 at D=64.
# D=256 with LSE2 and P*256 below (run 2144): dQ 2.255 -> 2.244, dK/dV 2.467 -> 2.402. The Gluon dQ kernel at D=64
# (run 1359): pass 1 322 -> 258 instructions per tile, yet causal 2.310/2.321 -> 2.361/2.361 ms, full 4.305/4.312
# -> 4.355/4.370, so still not there.
SCALE_AFTER_SUM_HEAD_DIMS = (128, 256)


def _scale_after_sum(d: int) -> bool:
    """Whether the dQ kernel's correction pass scales row sums rather than each dP, at head dim d = max(Dqk, Dv)
    (SCALE_AFTER_SUM_HEAD_DIMS, or TUNE["dq_scale_after_sum"])."""
    return bool(TUNE.get("dq_scale_after_sum", d in SCALE_AFTER_SUM_HEAD_DIMS))


# Head dims at which the dK/dV kernel reads per query the dQ kernel's LSE2 = LSE * log2(e) (minus the shift
# below) instead of converting the LSE itself (three instructions per query column and tile less), and at which
# its exp2 yields P * 256 directly, the shift 8 subtracted in LSE2 (one FMUL per score less; dS^T then comes
# out times 256, undone exactly in the per-tile scale). Unmasked loop 830 -> 751 instructions at D=128. H200,
# N=8192 (run 2110, the two together vs neither): the dK/dV kernel 2.181 -> 2.108 ms causal, 3.939 -> 3.895 full
# at D=128, 3.232 -> 3.080 at D=64 (LSE2 alone: 2.148, 3.990, 3.082).
DKDV_LSE2_HEAD_DIMS = (64, 128, 256)
DKDV_P256_HEAD_DIMS = (64, 128, 256)


def _dkdv_lse2(d: int) -> bool:
    """Whether the dQ kernel writes LSE2 for the dK/dV kernel to read (DKDV_LSE2_HEAD_DIMS or TUNE["dkdv_lse2"])."""
    return bool(TUNE.get("dkdv_lse2", d in DKDV_LSE2_HEAD_DIMS))


def _dkdv_p_shift(d: int, fp8: bool) -> int:
    """The dK/dV kernel's exponent shift: 8 where its exp2 yields P * 256 (fp8 only; DKDV_P256_HEAD_DIMS or
    TUNE["dkdv_p256"]), else 0."""
    return 8 if fp8 and TUNE.get("dkdv_p256", d in DKDV_P256_HEAD_DIMS) else 0


# Head dims at which the dQ kernel writes each dS tile's scale (one fp32 per DS_TILE_Q x block tile) and the
# dK/dV kernel reads it instead of finding the tile's absmax itself: the same tile, the same scale (up to fp32
# rounding between the kernels' recomputed dS), without the absmax, its shuffles and its two CTA barriers per
# tile (the tile spans both warpgroups there). Unmasked loop 596 -> 544 instructions at D=64 (sm_90, Triton 3.6).
# H200, N=8192 (runs 2234 and 2245, dK/dV kernel ms, off -> on): D=64 causal 3.003 -> 2.612 (-> 2.396 with the
# 64-key programs of DKDV_BLOCK_N that it allows), D=128 causal 2.106 -> 2.072 / 2.085 / 2.075 / 2.084, full
# 3.763 -> 3.593 / 3.613 / 3.624 / 3.594, but D=128 GQA (4 query heads per KV head) 2.344 / 2.349 -> 2.390 / 2.422
# / 2.394 / 2.385, so not with GQA there; D=256 dK/dV 2.403 -> 2.321 but its dQ kernel (128-row blocks: a
# two-scale store per tile) 2.248 -> 2.469, so not there.
DKDV_DS_SCALES_HEAD_DIMS = (64, 128)
DKDV_DS_SCALES_GQA_HEAD_DIMS = (64,)


def _dkdv_ds_scales(d: int, fp8: bool, gqa: bool = False) -> bool:
    """Whether the dK/dV kernel reads the dQ kernel's dS tile scales (fp8 only; DKDV_DS_SCALES_HEAD_DIMS, with GQA
    DKDV_DS_SCALES_GQA_HEAD_DIMS, or TUNE["dkdv_ds_scales"])."""
    dims = DKDV_DS_SCALES_GQA_HEAD_DIMS if gqa else DKDV_DS_SCALES_HEAD_DIMS
    return fp8 and bool(TUNE.get("dkdv_ds_scales", d in dims))


# Head dims at which the dK/dV kernel, given the dQ kernel's dS scale, folds 1/sds into dP's per-tile scale and
# into delta (dS^T = P^T * (dP^T * (sdp / sds) - delta / sds)) instead of multiplying every dS by it: one FMUL per
# score less for one per query column (the same dS up to fp32 rounding). Prepared in session 7 and not timed on
# the H200 yet, so on nowhere by default.
DKDV_FOLD_DS_SCALE_HEAD_DIMS = ()


def _dkdv_fold_ds_scale(d: int, ds_scales: bool) -> bool:
    """Whether the dK/dV kernel folds the dQ kernel's dS scale into dP's scale and delta (needs ds_scales;
    DKDV_FOLD_DS_SCALE_HEAD_DIMS or TUNE["dkdv_fold_ds_scale"])."""
    return ds_scales and bool(TUNE.get("dkdv_fold_ds_scale", d in DKDV_FOLD_DS_SCALE_HEAD_DIMS))


# Keys per dK/dV program by head dim, where the dQ kernel's dS scales are read (_dkdv_ds_scales) and so a program
# may cover part of a dS tile: 64 keys are one warpgroup's wgmma rows, a program of 4 warps, two per SM that
# share no barrier (one's softmax can run under the other's MMAs), instead of one program of two warpgroups in
# lockstep. Elsewhere the block (one dS tile's keys).
DKDV_BLOCK_N = {64: 64}


def _dkdv_block_n(block: int, d: int, ds_scales: bool) -> int:
    """Keys per program of the dK/dV kernel at head dim d: the block (one dS tile's keys), or with the dQ
    kernel's dS scales a divisor of it (DKDV_BLOCK_N or TUNE["dkdv_block_n"]): a program then covers part of
    each dS tile, whose scale it reads, so the quantization is the block's either way."""
    bn = int(TUNE.get("dkdv_block_n", min(block, DKDV_BLOCK_N.get(d, block)) if ds_scales else block))
    if bn != block and not (ds_scales and bn >= 16 and block % bn == 0):
        raise ValueError(f"dkdv_block_n={bn} needs dkdv_ds_scales on and a divisor >= 16 of the block ({block}): a "
                         "program must hold whole dS tiles to find their scales itself")
    return bn


# Head dims at which dK/dV and dQ (with the correction pass) come from the Gluon kernels (dkdv_hopper.py,
# dq_hopper.py: a TMA warp and two independent MMA warpgroups, asynchronous wgmmas) wherever they apply
# (_hopper_case). H200, N=8192, kernel ms against the Triton kernels in the same run (session 8, runs 0027 and
# 0034): dK/dV at D=128 causal 2.06 -> 1.51 (fold, 3 stages; 1.55 with 2 stages, no fold), full 3.61 -> 3.05,
# GQA 2.34 -> 1.46; dQ at D=128 causal 1.685 -> 1.518 (3 stages), full 3.14 -> 2.88, GQA 1.67 -> 1.50. With the
# fp8 operands taken from the accumulators as they are (_gluon.fp8_operand, session 9, runs 0148 and 0156): dK/dV
# 1.49 at D=128 causal, 2.78 full, 1.47 GQA, and at D=64 2.03 vs the Triton kernel's 2.42 (so now on there too);
# dQ 1.48, 2.83, 1.47, and at D=64 2.65 vs 2.57 then; with session 11's changes 2.51 vs 2.56 (run 0625, bwd
# 4.386 vs 4.436 ms at N=8192 causal), so on there too since session 12.
DKDV_HOPPER_HEAD_DIMS = (64, 128)
DKDV_HOPPER_STAGES = 3
DKDV_HOPPER_FOLD = True  # 1/sds in dP's scale and delta: 1.55 -> 1.51 ms at D=128 causal with 3 stages
# MMA warpgroups per program (64 keys each) and their registers, by head dim (as FWD_HOPPER_WARPGROUPS): three at
# D=64, where the kernel needs under 128 registers (H200, run 0537: N=8192 causal 2.08 -> 1.76 ms, the packed batch
# of kernel_breakdown.py 1.66 -> 1.27); at D=128 the dK and dV accumulators alone take 128
DKDV_HOPPER_WARPGROUPS = {64: (3, 160), 128: (2, 240)}
# With two warpgroups (D=128), the query tiles in pairs that share their 128-row dO8 quantization tile: the second
# skips dv's rescale (c / c' = 1 up to the division's rounding; 538 -> 501 SASS instructions per tile, causal), by
# case: H200, N=8192, dK/dV kernel ms, two same-run readings each (run 1108): full 2.844/2.836 -> 2.661/2.725, GQA
# 1.441/1.460 -> 1.369/1.367. dV then differs from the single-tile loop's by up to 1.4e-3 and is slightly closer to
# the reference (GPU runs dbe6443, 4fdc48a). Dense causal without GQA gained only together with the causal
# diagonal's two tiles taken before the loop (DKDV_HOPPER_PEEL: no mask test in the loop, 408 instructions per
# tile), run 1217: 1.401/1.408 -> 1.375/1.374 ms; pairs alone 1.424/1.410 -> 1.483/1.507 (run 1108), the peel
# alone 1.473/1.480, pairs with the scales a tile ahead as with GQA (DKDV_HOPPER_AHEAD) 1.421, all three
# 1.470/1.450 (run 1217): not understood, instruction counts do not order them. Never on packed batches: a
# sequence's query tiles can be odd in number there, and counting them to 128 rows gave a wrong dV (run 1209) and
# was slower anyway (1.074/1.079 -> 1.096/1.098 ms); the peel hung there (run 1126).
DKDV_HOPPER_PAIRS = True
# With three warpgroups (D=64) on dense batches, the tiles' scales loaded a tile ahead (DKDV_HOPPER_AHEAD), and
# under causal masks without GQA each warpgroup's diagonal tile before the loop: causal run 1224, 1.771/1.756 ->
# 1.687/1.688 ms (the peel alone 1.807/1.794; 16 B of spills with Triton 3.6, faster nonetheless); full mask run
# 1241, 3.728/3.754 -> 3.070/3.113 (ahead). Not on packed batches: D=64 1.265/1.269 -> 1.269/1.269, D=128
# 1.070/1.072 -> 1.095/1.097 (run 1241). The scales a tile ahead always with GQA; at D=128 without GQA slower:
# 1.408 -> 1.511 ms with single tiles (run 0744), 1.375 -> 1.421-1.470 with pairs (run 1217).
DKDV_HOPPER_PEEL = {2: True, 3: True}  # by MMA warpgroups
# With two warpgroups on dense batches without GQA, each tile's dK MMA issued with the next tile's S^T and dP^T
# MMAs, to run under that tile's exponentials (as DQ_HOPPER_PIPE_FULL; dQ, dK, dV bit-identical). H200, N=8192,
# dK/dV kernel ms, two same-run readings each: full mask 2.655/2.674 -> 2.390/2.344 (run 1403; 2.508/2.515 with 4
# stages), causal 1.409/1.360 -> 1.281/1.282 (run 1404, with 40 B of spills); GQA 1.369/1.351 -> 1.392/1.393 (56 B
# of spills), so not with GQA (without pairs: 1.386/1.359 -> 1.384/1.395, run 1455). With three warpgroups (D=64;
# one head per group only: a warpgroup's skipped tiles would otherwise come between a pending dK MMA and the next
# tile, and the ring could stall): causal 1.697/1.688 -> 1.841/1.825, full 3.119/3.099 -> 3.949/3.939 (run 1455).
DKDV_HOPPER_PIPE = {2: True, 3: False}  # by MMA warpgroups
DKDV_HOPPER_AHEAD = {2: False, 3: True}  # by MMA warpgroups, dense batches
DQ_HOPPER_HEAD_DIMS = (64, 128)
DQ_HOPPER_STAGES = 3
# The two MMA warpgroups take turns to issue their MMAs (FA3's ping-pong, _gluon.wait_turn), so that one's
# exponentials run under the other's MMAs rather than both at once, by head dim: 0 never, 1 the S and dP MMAs, 2
# those and dQ's. H200, N=8192 causal, same run (runs 0837, 0845, 0852): D=128 dQ 1.448-1.486 -> 1.400-1.417 ms
# with 1, 1.474 with 2; D=64 2.324 -> 2.401 with 1. In the dK/dV kernel (D=128) turns made it slower: 1.414 ->
# 1.448 (S^T, dP^T) and 1.483 (every MMA), run 0837
DQ_HOPPER_PINGPONG = {128: 1}
# Head dims at which the dQ kernel's second pass is pipelined on the full mask: each tile's dQ MMA issued with the
# next tile's S and dP MMAs, so that it runs under that tile's exponentials instead of the warpgroup waiting on it
# at the tile's end (the loop 611 -> 629 instructions at D=128). H200, N=8192, dQ kernel ms, two same-run readings
# each (runs 1324, 1327): full mask D=128 2.788/2.834/2.786/2.799 -> 2.713/2.716/2.720/2.703, D=64 4.534/4.573 ->
# 4.393/4.430; causal D=128 1.375/1.374 -> 1.440/1.400 (1.402/1.382 without the ping-pong vs 1.401/1.379), D=64
# 2.311/2.319 -> 2.344/2.347, GQA 1.394/1.393 -> 1.409/1.407 with the diagonal tile first; in the plain loop's
# order (a dQ MMA of zeros first, bit-identical: test_dq_hopper_pipe) D=128 causal 1.381/1.425 -> 1.494/1.461,
# D=64 2.320/2.337 -> 2.418/2.434, GQA 1.391/1.404 -> 1.491/1.458, packed D=64 1.616 -> 1.747 (run 1515): not
# under causal masks.
DQ_HOPPER_PIPE_FULL = (64, 128)
# The ring's stages by head dim where the pass is pipelined: D=64 full mask 4.456/4.423 -> 4.338/4.304 ms with 4
# (run 1348; 4.393/4.430 -> 4.280/4.306 in run 1327); 4 stages were slower without the pipeline (D=64 causal
# 2.326/2.311 -> 2.373/2.398) and at D=128 (full 2.721/2.744 -> 2.741/2.784, causal 1.414/1.444 -> 1.458/1.461)
DQ_HOPPER_PIPE_STAGES = {64: 4}
# Always two MMA warpgroups (64 queries each): three spilled with the full 128-key tile (run 0527: 2.73 vs 2.55 ms
# at D=64) and, with the second pass in 64-key halves (no spills), were no faster (run 0625: 2.52 vs 2.51 ms dense
# D=64, 1.865 vs 1.859 packed); commit 6f8193a has that version
DQ_HOPPER_WARPGROUPS = 2


# Whether the Gluon kernels take packed (varlen) batches (kernels.segments: each sequence at rows starting at
# multiples of 128): causal self-attention, one batch row, no window, forward and backward alike. The Triton
# kernels on a packed batch are far slower than on a dense one (H200, 32768 tokens of 26 documents, B=1, H=32,
# D=64, run 0506: fwd+bwd 11.6 ms on the Triton kernels; forward 1.15 vs 1.81 ms and dQ 1.88 vs 4.15 ms with the
# Gluon ones; FlashAttention-2 varlen 4.87 ms; with the padded layout written by the quantization, 4.59 vs 4.91,
# run 0641).
HOPPER_PACKED = True


def _hopper_case(*, fp8: bool, e4m3: bool, dqk: int, dv: int, block: int, varlen: bool, window, n: int, m: int,
                 device, lse2_in: bool, p_shift: int, packed: bool = False) -> bool:
    """Whether the input is the Gluon kernels' case: fp8 e4m3, Dqk = Dv in 64/128, block 128, no window, N = M a
    multiple of 128 or a packed batch they take (packed: varlen, causal, cu_seqlens_q = cu_seqlens_k, B = 1; and
    HOPPER_PACKED or TUNE["hopper_packed"]), an sm_90 GPU, Triton 3.6 (the version their GPU tests passed with;
    they also compile with 3.9's renamed Gluon API, tests/test_sm90_registers.py, but have not run on a GPU with
    it), the dQ kernel's LSE2 with P * 256."""
    if INTERPRET:
        return False
    import torch
    import triton
    shape_ok = (packed and bool(TUNE.get("hopper_packed", HOPPER_PACKED))) if varlen else (
        n == m and n > 0 and n % 128 == 0)
    return (fp8 and e4m3 and dqk == dv and dqk in (64, 128) and block == 128 and window is None and shape_ok
            and lse2_in and p_shift == 8 and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == (9, 0) and triton.__version__.startswith("3.6"))


# Head dims at which the forward comes from fwd_hopper's Gluon kernel where it applies (_hopper_case). H200,
# N=8192, kernel ms against _fwd_kernel in the same run (session 9, run 0156): D=128 causal 0.775 -> 0.754, full
# 1.469 -> 1.436, GQA 0.786 -> 0.747 (2 stages; 3 stages the same); at D=64 1.10 -> 1.41 then (_fwd_kernel runs
# three programs per SM there, the Gluon kernel one of two warpgroups); with three warpgroups (below) and session
# 15's kernel, D=64 causal 1.099/1.113 -> 1.047/1.048 (run 1327), so there too since session 18. FA3's schedule
# (tile j-1's PV issued with tile j's QK^T, the warpgroups taking turns through mbarriers; run 0208) was slower:
# 0.832 causal, 0.824 GQA, 1.393 full (the same loop without the turns: 0.759-0.815, runs 0140 and 0148).
FWD_HOPPER_HEAD_DIMS = (64, 128)
FWD_HOPPER_STAGES = 2
# MMA warpgroups per program (64 queries each) and their registers, by head dim: three of 160, so that an SM runs
# three softmax streams. D=64 (H200, run 0519): 1.50 -> 1.13 ms at N=8192 causal, vs 1.11 for the Triton forward
# then (1.05 vs 1.10 in run 1327); the packed batch 1.15 -> 0.96. D=128 (run 0955; S, O and P8 fit in 160 registers, no
# spills): 0.791 -> 0.665 ms causal (827 TFLOP/s), 1.437 -> 1.218 full (903), packed 0.660 -> 0.538; 3 stages
# 0.680. The dQ kernel spills with three (D=64, run 0527: 2.73 vs 2.55 ms) and keeps two (DQ_HOPPER_WARPGROUPS).
FWD_HOPPER_WARPGROUPS = {64: (3, 160), 128: (3, 160)}


def _fwd_hopper(d: int, *, fp8: bool, dqk: int, dv: int, block: int, varlen: bool, window, n: int, m: int,
                device, packed: bool = False) -> bool:
    """Whether the forward comes from fwd_hopper's Gluon kernel: FWD_HOPPER_HEAD_DIMS, a packed batch
    (HOPPER_PACKED) or TUNE["fwd_hopper"], and the input is the Gluon kernels' case (_hopper_case; the forward
    always quantizes to e4m3 and has no LSE2)."""
    return bool(TUNE.get("fwd_hopper", d in FWD_HOPPER_HEAD_DIMS or varlen)) and _hopper_case(
        fp8=fp8, e4m3=True, dqk=dqk, dv=dv, block=block, varlen=varlen, window=window, n=n, m=m, device=device,
        lse2_in=True, p_shift=8, packed=packed)


def _dkdv_hopper(d: int, **case) -> bool:
    """Whether dK/dV comes from dkdv_hopper's Gluon kernel: DKDV_HOPPER_HEAD_DIMS or TUNE["dkdv_hopper"], and the
    input is its case (_hopper_case)."""
    return bool(TUNE.get("dkdv_hopper", d in DKDV_HOPPER_HEAD_DIMS)) and _hopper_case(**case)


def _warpgroups(kernel: str, d: int, table: dict) -> dict:
    """(warpgroups, registers) of a Gluon kernel ("fwd" or "dkdv") at head dim d: `table` or
    TUNE[f"{kernel}_hopper_wgs"], a pair or {head dim: pair}."""
    want = TUNE.get(f"{kernel}_hopper_wgs", table)
    wgs, regs = want.get(d, table[d]) if isinstance(want, dict) else want
    if wgs not in (2, 3):  # 4 spill: the default partition keeps the launch's 96 registers
        raise ValueError(f"{kernel}_hopper_wgs: 2 or 3 MMA warpgroups, got {wgs}")
    return dict(warpgroups=int(wgs), regs=int(regs))


def _dkdv_hopper_pairs(*, causal: bool, groups: int, packed: bool, peel: bool) -> bool:
    """Whether the Gluon dK/dV kernel (two warpgroups) takes its query tiles in pairs: TUNE["dkdv_hopper_pairs"],
    or by default (DKDV_HOPPER_PAIRS) on dense batches with the full mask, GQA, or the diagonal peeled. Never on
    packed batches."""
    if packed:
        if TUNE.get("dkdv_hopper_pairs"):
            raise ValueError("dkdv_hopper_pairs: not on packed batches (a sequence's 64-row query tiles can be odd in "
                             "number); leave it unset for cu_seqlens inputs")
        return False
    return bool(TUNE.get("dkdv_hopper_pairs", DKDV_HOPPER_PAIRS and (not causal or groups > 1 or peel)))


def _dkdv_hopper_peel(*, causal: bool, groups: int, packed: bool, warpgroups: int) -> bool:
    """Whether the Gluon dK/dV kernel takes the causal diagonal's query tiles before its loop:
    TUNE["dkdv_hopper_peel"] or DKDV_HOPPER_PEEL[warpgroups], on dense causal batches without GQA only (a packed
    sequence can have one query tile past a key block; with GQA each head has its diagonal)."""
    want = bool(TUNE.get("dkdv_hopper_peel", DKDV_HOPPER_PEEL[warpgroups]))
    if want and "dkdv_hopper_peel" in TUNE and (packed or groups > 1):
        raise ValueError("dkdv_hopper_peel: dense batches without GQA only; leave it unset for cu_seqlens or GQA")
    return want and causal and groups == 1 and not packed


def _dkdv_hopper_cfg(d: int, *, causal: bool, groups: int, packed: bool) -> dict:
    """dkdv_hopper.dkdv_hopper's options at head dim d for the case (causal, GQA groups, a packed batch):
    DKDV_HOPPER_* or TUNE["dkdv_hopper_<option>"]. Pairs only with two warpgroups; the scales a tile ahead always
    with GQA (the loop counts the group's heads that way), else by default on dense batches by warpgroups
    (DKDV_HOPPER_AHEAD)."""
    wgs = _warpgroups("dkdv", d, DKDV_HOPPER_WARPGROUPS)
    n = wgs["warpgroups"]
    peel = _dkdv_hopper_peel(causal=causal, groups=groups, packed=packed, warpgroups=n)
    pairs = _dkdv_hopper_pairs(causal=causal, groups=groups, packed=packed, peel=peel) and n == 2
    ahead = groups > 1 or bool(TUNE.get("dkdv_hopper_ahead", DKDV_HOPPER_AHEAD[n] and not packed))
    pipe = bool(TUNE.get("dkdv_hopper_pipe", DKDV_HOPPER_PIPE[n] and groups == 1))
    if pipe and (packed or (n == 3 and groups > 1)):
        if "dkdv_hopper_pipe" in TUNE:
            raise ValueError("dkdv_hopper_pipe: dense batches only, and with three MMA warpgroups (dkdv_hopper_wgs) "
                             "one query head per KV head")
        pipe = False
    return dict(stages=int(TUNE.get("dkdv_hopper_stages", DKDV_HOPPER_STAGES)),
                fold=bool(TUNE.get("dkdv_hopper_fold", DKDV_HOPPER_FOLD)), pairs=pairs, peel=peel, ahead=ahead,
                pipe=pipe, **wgs)


def _fwd_hopper_cfg(d: int) -> dict:
    """fwd_hopper.fwd_hopper's options at head dim d: FWD_HOPPER_STAGES and FWD_HOPPER_WARPGROUPS, or
    TUNE["fwd_hopper_stages"], TUNE["fwd_hopper_wgs"] = (warpgroups, registers)."""
    return dict(stages=int(TUNE.get("fwd_hopper_stages", FWD_HOPPER_STAGES)),
                **_warpgroups("fwd", d, FWD_HOPPER_WARPGROUPS))


def _dq_hopper_cfg(d: int, causal: bool) -> dict:
    """dq_hopper.dq_hopper's options at head dim d: DQ_HOPPER_STAGES (DQ_HOPPER_PIPE_STAGES when pipelined),
    DQ_HOPPER_PINGPONG and DQ_HOPPER_PIPE_FULL (without a causal mask, and not with ping-pong mode 2), or
    TUNE["dq_hopper_stages"], TUNE["dq_hopper_pingpong"], TUNE["dq_hopper_pipe"]."""
    pingpong = int(TUNE.get("dq_hopper_pingpong", DQ_HOPPER_PINGPONG.get(d, 0)))
    pipe = bool(TUNE.get("dq_hopper_pipe", d in DQ_HOPPER_PIPE_FULL and not causal and pingpong != 2))
    stages = DQ_HOPPER_PIPE_STAGES.get(d, DQ_HOPPER_STAGES) if pipe else DQ_HOPPER_STAGES
    if pipe and pingpong == 2:
        raise ValueError("dq_hopper_pipe issues each dQ MMA in the next tile's turn: use it with dq_hopper_pingpong "
                         "0 or 1, not 2")
    return dict(stages=int(TUNE.get("dq_hopper_stages", stages)), pingpong=pingpong, pipe=pipe)


def _dq_hopper(d: int, *, stale: bool, **case) -> bool:
    """Whether dQ and the correction pass come from dq_hopper's Gluon kernel: DQ_HOPPER_HEAD_DIMS, a packed
    batch (HOPPER_PACKED) or TUNE["dq_hopper"], the matching delta, and the input is its case (_hopper_case)."""
    return (bool(TUNE.get("dq_hopper", d in DQ_HOPPER_HEAD_DIMS or case["varlen"])) and not stale
            and _hopper_case(**case))


# How many heads each kernel's grid hands out together under a causal mask, tile-major within the group
# (forward._grid_ids; 1 is head by head, as with any other mask, whose tiles all carry the same work). Causal
# tiles differ in work up to N / BLOCK-fold, and head by head the last head's heaviest tile starts near the end
# and runs alone (a list-scheduling model at N=8192, 32 heads, 132 SMs: dK/dV ends 7 % after the average SM,
# under 2 % with groups of 2 or more; GQA's dK/dV, 8 KV heads of 4x the work, 24 %), while too large a group
# spreads the reads over more heads' K/V or q/dO than the L2 holds. H200, N=8192 (run 2119, same run, kernel ms
# head by head -> groups of 4 / 8): forward 0.798 -> 0.762 / 0.765 at D=128, 1.126 -> 1.101 / 1.091 at D=64, GQA
# 0.794 -> 0.762 / 0.764; dQ 1.752 -> 1.698 / 1.662, 2.588 -> 2.559 / 2.533, GQA 1.687 -> 1.718 / 1.651; dK/dV
# 2.127 -> 2.103 / 2.093, 3.072 -> 2.998 / 3.006, GQA 2.723 -> 2.337 / 2.366. All heads at once (run 2114) made
# the dQ kernel 6 % slower at D=128. On the full mask groups did not pay (forward +1.5 %, dQ in 8s +4 %).
HEAD_GROUP_CAUSAL = {"fwd": 4, "dq": 8, "dkdv": 4}


def _grid(kernel: str, tiles: int, heads: int, nseq: int, causal: bool):
    """(grid, n_tiles, head_group) of `kernel` over `tiles` tiles x `heads` (batch x head) x `nseq` sequences;
    the head group from HEAD_GROUP_CAUSAL (causal) or 1, or TUNE[f"{kernel}_head_group"]."""
    group = int(TUNE.get(f"{kernel}_head_group", HEAD_GROUP_CAUSAL[kernel] if causal else 1))
    if group < 1:
        raise ValueError(f"{kernel}_head_group must be >= 1, got {group}")
    return (tiles * heads, 1, nseq), tiles, min(group, max(heads, 1))


# Above this head dim dK and dV come from two launches of the dK/dV kernel (dV alone: S^T and P^T dO; dK
# alone: S^T, dP^T and dS^T q) instead of one: one fp32 accumulator of BLOCK_N x D per program instead of two,
# for one more matmul (5 instead of 4). At D=256 two accumulators spill 2.2 KB per thread, one 40-56 B: the
# kernel 9.98 ms (best unsplit config) -> 2.47 ms (run 2144); at D=128 splitting costs 2.11 -> 3.00 ms.
DKDV_SPLIT_ABOVE = 128


def _dkdv_parts(d: int) -> tuple:
    """The dK/dV kernel's launches at head dim d, as its PART constant: (0,) both at once, or (1, 2) dV then dK
    (d > DKDV_SPLIT_ABOVE, or TUNE["dkdv_split"])."""
    return (1, 2) if TUNE.get("dkdv_split", d > DKDV_SPLIT_ABOVE) else (0,)


def _maxnreg(kernel: str) -> dict:
    """Launch kwargs capping registers per thread for `kernel` ("fwd", "dq", "dkdv"), if tuning asks for it."""
    cap = TUNE.get(f"{kernel}_maxnreg")
    return {"maxnreg": cap} if cap else {}


def _bwd_launch_cfg(dqk: int, dv: int, fp8: bool, kv_n: int = 128, block: int = 128):
    """(dq BLOCK_M, dq warps, dq stages, dkdv warps, dkdv stages); kv_n: the dK/dV program's keys
    (_dkdv_block_n), 64 of them one warpgroup (4 warps) where fewer than the block."""
    d = max(dqk, dv)
    if d <= 64:  # H200 N=8192 causal D=64 (run 1956): dq (64, 4, 3) 2.558 ms vs (64, 4, 2) 2.896; dK/dV (8, 3)
        # 3.239 vs (8, 2) 3.781
        base = (64, 4, 3, 8, 3)
    elif d <= 128:  # D=128 (run 1917): dq (64, 4, 2) 1.778 ms vs (128, 8, 2) 2.122, (64, 4, 3) 2.235; dK/dV (8, 3)
        # 2.163 vs (8, 2) 2.314, (8, 4) 2.170
        base = (64, 4, 2, 8, 3)
    else:  # D=256 causal (runs 2137, 2144): dq (128, 8, 1) 2.256 ms vs (64, 8, 1) 3.732, (64, 8, 2) 3.067;
        # dK/dV split (_dkdv_parts) (8, 2) 2.467 vs (8, 1) 2.691; unsplit (8, 1) 9.983, (16, 1) 21.449 (1.9 KB
        # spills), (16, 2) 10.845. bf16: configs within the SM's 227 KB of shared memory (untimed)
        base = (128, 8, 1, 8, 2) if fp8 else (64, 8, 1, 8, 1)
    if kv_n < block and kv_n <= 64:
        base = (*base[:3], 4, base[4])
    return (*TUNE.get("dq", base[:3]), *TUNE.get("dkdv", base[3:]))
