"""Launch configurations of the kernels, by kernel and head dim: the tables plan.py reads, one reason per entry.

Each default was the faster choice measured on the H200 (Triton 3.6); the measurements, and the alternatives
measured slower, are in docs/kernels.md. TUNE overrides launch shapes (blocks, warps, stages, warpgroups,
registers) for tuning runs and is empty in normal use; which kernel runs is plan.py's to decide (an A/B run pins
a plan: plan.pinned).
"""

from __future__ import annotations

import functools

# Launch-shape overrides for tuning runs, read where each default is defined below (docs/knobs.md tables them):
# "fwd" / "dq" (BLOCK_M, warps, stages) and "dkdv" (warps, stages) of the Triton kernels, f"{kernel}_maxnreg" (a
# register cap), the Gluon kernels' "fwd_hopper_stages" / "dq_hopper_stages" / "dkdv_hopper_stages",
# "dkdv_hopper_wgs" ((MMA warpgroups, registers), or {head dim: that}), and "quantize_rotate" ((tiles per program,
# warps, stages) of the q/k quantization pass with the fused rotation).
TUNE: dict = {}
TUNE_KEYS = frozenset({"fwd", "dq", "dkdv", "fwd_maxnreg", "dq_maxnreg", "dkdv_maxnreg", "fwd_hopper_stages",
                       "dq_hopper_stages", "dkdv_hopper_stages", "dkdv_hopper_wgs", "quantize_rotate"})


def check_tune() -> None:
    """A misspelt TUNE key would silently time the defaults: refuse it."""
    unknown = set(TUNE) - TUNE_KEYS
    if unknown:
        raise KeyError(f"unknown kernels.TUNE keys {sorted(unknown)}; known: {sorted(TUNE_KEYS)}. Which kernel runs "
                       "is pinned with hf_deltamatch.kernels.plan.pinned(...), not TUNE.")


def tune_key() -> tuple:
    """TUNE's contents as a hashable key (plans are cached per TUNE state)."""
    return tuple(sorted((k, repr(v)) for k, v in TUNE.items()))


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (triton.cdiv is a constexpr function since Triton 3.5, slow to call from host code)."""
    return -(-a // b)


def pow2(x: int) -> int:
    """The power of two at or above x >= 1 (triton.next_power_of_2, as plain host arithmetic)."""
    return 1 << (x - 1).bit_length()


# ----------------------------------------------------------------------------------------------------
# The Triton kernels (forward.py, backward.py): every supported input
# ----------------------------------------------------------------------------------------------------


def fwd_launch(dqk: int, dv: int, fp8: bool) -> tuple:
    """(BLOCK_M, num_warps, num_stages) of _fwd_kernel."""
    if "fwd" in TUNE:
        return tuple(TUNE["fwd"])
    if max(dqk, dv) <= 128:
        return 64, 4, 3
    # D=256: two warpgroups split the head dim; bf16 tiles are twice the bytes: 1 stage keeps them in shared memory
    return (64, 8, 3) if fp8 else (64, 8, 1)


def bwd_launch(dqk: int, dv: int, fp8: bool, kv_n: int, block: int) -> tuple:
    """(dQ BLOCK_M, dQ warps, dQ stages, dK/dV warps, dK/dV stages); kv_n: the dK/dV program's keys (dkdv_block_n),
    64 of them one warpgroup (4 warps) where fewer than the block."""
    d = max(dqk, dv)
    if d <= 64:
        base = (64, 4, 3, 8, 3)
    elif d <= 128:
        base = (64, 4, 2, 8, 3)
    else:  # bf16 at D=256: configs within the SM's 227 KB of shared memory
        base = (128, 8, 1, 8, 2) if fp8 else (64, 8, 1, 8, 1)
    if kv_n < block and kv_n <= 64:
        base = (*base[:3], 4, base[4])
    return (*TUNE.get("dq", base[:3]), *TUNE.get("dkdv", base[3:]))


def maxnreg(kernel: str) -> dict:
    """Launch kwargs capping registers per thread for `kernel` ("fwd", "dq", "dkdv"), if tuning asks for it."""
    cap = TUNE.get(f"{kernel}_maxnreg")
    return {"maxnreg": cap} if cap else {}


# Head dims at which a kernel reads its FP8 tiles through TMA descriptors (dK/dV never: its pointer loads were
# faster). Only on buffers of ours, whose layout TMA needs (ops._tma_rows).
TMA_HEAD_DIMS = {"fwd": (64, 128), "dq": (128,)}


def use_tma(kernel: str, fp8: bool, dqk: int, dv: int, starts_aligned: bool = True) -> bool:
    """Whether `kernel` ("fwd" or "dq") reads its FP8 tiles through TMA: fp8, TMA_HEAD_DIMS, and every sequence
    starting at a multiple of 16 tokens (the token-major tiles' starts: the H200 faulted on others)."""
    d = max(dqk, dv)
    return fp8 and d in TMA_HEAD_DIMS[kernel] and d <= 128 and starts_aligned


# Head dims at which the loops read their per-tile scales through inline PTX (forward._scale): otherwise Triton 3.6
# turns the in-loop scale loads into cp.async copies and ptxas serializes every wgmma of the loop. dK/dV: causal only.
ASM_SCALES_HEAD_DIMS = {"fwd": (128,), "dq": (64, 128), "dkdv": (128,)}
ASM_SCALES_CAUSAL_ONLY = ("dkdv",)


def asm_scales(kernel: str, d: int, causal: bool, interpret: bool) -> bool:
    return not interpret and d in ASM_SCALES_HEAD_DIMS[kernel] and (causal or kernel not in ASM_SCALES_CAUSAL_ONLY)


# Head dims at which the correction pass scales each key tile's row sums of P * dP by the tile's dP scale instead of
# scaling every dP first (the same delta up to fp32 rounding, fewer instructions per tile)
SCALE_AFTER_SUM_HEAD_DIMS = (128, 256)

# Head dims at which the dK/dV kernel reads the dQ kernel's LSE2 = LSE * log2(e) - 8, so that its exp2 yields
# P * 256 in one FMA (the shift undone in the per-tile scale); 192 is MLA's (the Gluon dK/dV kernel reads them)
DKDV_LSE2_HEAD_DIMS = (64, 128, 192, 256)
DKDV_P256_HEAD_DIMS = (64, 128, 192, 256)

# Head dims at which the dQ kernel stores each dS tile's scale for the dK/dV kernel, which then skips the tile's
# absmax (its shuffles and two CTA barriers per tile); with GQA at D=64 only (the store cost more elsewhere)
DKDV_DS_SCALES_HEAD_DIMS = (64, 128)
DKDV_DS_SCALES_GQA_HEAD_DIMS = (64,)


def dkdv_ds_scales(d: int, fp8: bool, gqa: bool) -> bool:
    return fp8 and d in (DKDV_DS_SCALES_GQA_HEAD_DIMS if gqa else DKDV_DS_SCALES_HEAD_DIMS)


# Keys per Triton dK/dV program by head dim where the dS scales are read: at D=64 one warpgroup's 64 keys, two
# programs per SM sharing no barrier (one's softmax under the other's MMAs); elsewhere one dS tile's keys (the block)
DKDV_BLOCK_N = {64: 64}


def dkdv_block_n(block: int, d: int, ds_scales: bool) -> int:
    return min(block, DKDV_BLOCK_N.get(d, block)) if ds_scales else block


# Above this head dim dK and dV come from two launches (dV alone, then dK alone): one fp32 accumulator of
# BLOCK_N x D per program instead of two, which spill at D=256
DKDV_SPLIT_ABOVE = 128


def dkdv_parts(d: int) -> tuple:
    """The dK/dV kernels' launches at head dim d (their PART constant): (0,) both at once, or (1, 2) dV then dK."""
    return (1, 2) if d > DKDV_SPLIT_ABOVE else (0,)


# Heads each kernel's grid hands out together under a causal mask, tile-major within the group: causal tiles differ in
# work up to N / BLOCK-fold, so head by head the last head's heaviest tile would run alone, while too large a group
# spreads the reads over more heads' K/V than the L2 holds. Other masks: head by head (every tile the same work).
HEAD_GROUP_CAUSAL = {"fwd": 4, "dq": 8, "dkdv": 4}


def grid(kernel: str, tiles: int, heads: int, nseq: int, causal: bool) -> tuple:
    """(grid, n_tiles, head_group) of `kernel` over `tiles` tiles x `heads` (batch x head) x `nseq` sequences."""
    group = HEAD_GROUP_CAUSAL[kernel] if causal else 1
    return (tiles * heads, 1, nseq), tiles, min(group, max(heads, 1))


# ----------------------------------------------------------------------------------------------------
# The Gluon kernels (fwd_hopper.py, dq_hopper.py, dkdv_hopper.py): the common fp8 case on sm_90
# ----------------------------------------------------------------------------------------------------

GLUON_HEAD_DIMS = (64, 128)  # Dqk = Dv: every batch layout
GLUON_WIDE_DIMS = ((256, 256), (192, 128))  # (Dqk, Dv): dense batches of whole 128-token tiles, no window
ROW_ALIGN = 128  # the padded layout's rows per sequence start (segments.py), one key tile

# The forward: three MMA warpgroups of 64 queries (S, O and P8 fit in 160 registers), so an SM runs three softmax
# streams; at Dv = 256 two of 240 (O alone is 128 registers per thread)
FWD_HOPPER_STAGES = 2
FWD_HOPPER_REGS = 160
FWD_HOPPER_WIDE_REGS = 240
FWD_HOPPER_WIDE_STAGES = 2


def fwd_hopper(dv: int) -> dict:
    from .fwd_hopper import WARPGROUPS, WIDE_WARPGROUPS
    if dv > 128:
        return dict(stages=int(TUNE.get("fwd_hopper_stages", FWD_HOPPER_WIDE_STAGES)), regs=FWD_HOPPER_WIDE_REGS,
                    warpgroups=WIDE_WARPGROUPS)
    return dict(stages=int(TUNE.get("fwd_hopper_stages", FWD_HOPPER_STAGES)), regs=FWD_HOPPER_REGS,
                warpgroups=WARPGROUPS)


# The dQ kernel: two MMA warpgroups of 64 queries (three spill); at D=128 they take turns to issue their S and dP MMAs
# (FA3's ping-pong: one's exponentials under the other's MMAs); on the full mask pass 2 is software-pipelined (each
# tile's dQ MMA issued with the next tile's S and dP), with 4 ring stages at D=64; above D=128 dQ's columns come in two
# launches (2 stages: 224 KB of shared memory at D=256)
DQ_HOPPER_WARPGROUPS = 2
DQ_HOPPER_STAGES = 3
DQ_HOPPER_PINGPONG = {128: 1}
DQ_HOPPER_PIPE_FULL = (64, 128)
DQ_HOPPER_PIPE_STAGES = {64: 4}
DQ_HOPPER_WIDE_STAGES = 2


def dq_hopper(d: int, causal: bool, padded: bool) -> dict:
    """The Gluon dQ kernel's options; padded (packed or ragged batches): no pipelined pass 2, whose last key tile
    would go unmasked."""
    pipe = d in DQ_HOPPER_PIPE_FULL and not causal and not padded
    stages = DQ_HOPPER_PIPE_STAGES.get(d, DQ_HOPPER_STAGES) if pipe else DQ_HOPPER_STAGES
    halves = (0,)
    if d > 128:
        stages, halves = DQ_HOPPER_WIDE_STAGES, (1, 2)
    return dict(stages=int(TUNE.get("dq_hopper_stages", stages)), pingpong=DQ_HOPPER_PINGPONG.get(d, 0), pipe=pipe,
                halves=halves)


# The dK/dV kernel: MMA warpgroups of 64 keys and their registers by head dim (three at D=64, which needs under 128
# registers; at D=128 the dK and dV accumulators alone take 128)
DKDV_HOPPER_STAGES = 3
DKDV_HOPPER_WARPGROUPS = {64: (3, 160), 128: (2, 240), 192: (2, 240), 256: (2, 240)}
# With three warpgroups on dense batches, each tile's scales loaded a tile ahead (with GQA always: the loop counts the
# group's heads that way)
DKDV_HOPPER_AHEAD = {2: False, 3: True}


def dkdv_warpgroups(d: int) -> dict:
    want = TUNE.get("dkdv_hopper_wgs", DKDV_HOPPER_WARPGROUPS)
    wgs, regs = want.get(d, DKDV_HOPPER_WARPGROUPS[d]) if isinstance(want, dict) else want
    if wgs not in (2, 3):  # 4 spill: the default partition keeps the launch's 96 registers
        raise ValueError(f"dkdv_hopper_wgs: 2 or 3 MMA warpgroups, got {wgs}")
    return dict(warpgroups=int(wgs), regs=int(regs))


def dkdv_hopper(d: int, *, causal: bool, groups: int, padded: bool, window: bool, pins: dict) -> dict:
    """The Gluon dK/dV kernel's options. Its loop variants, by case:
    - peel: the causal diagonal's query tiles before the loop (no mask test inside it): dense causal batches without
      GQA (a packed sequence can have one query tile past a key block; with GQA each head has its diagonal);
    - pairs (two warpgroups): two query tiles per iteration sharing one 128-row dO8 tile, the second skipping dV's
      rescale: dense batches with the full mask, GQA, or the peeled diagonal (a packed sequence's query tiles can be
      odd in number);
    - pipe (two warpgroups, dense, no GQA, one launch): each tile's dK MMA issued with the next tile's S^T and dP^T
      MMAs; under a ptxas of CUDA 13+ only when pinned, then with a fresh dP^T accumulator (fresh_dp);
    - none of them with a sliding window (their loops assume every tile from the diagonal on).
    pins: plan.pinned's dkdv_pairs / dkdv_peel / dkdv_pipe, refused where the loop cannot take them."""
    wgs = dkdv_warpgroups(d)
    n = wgs["warpgroups"]
    for option in ("pairs", "peel", "pipe"):
        if pins.get(f"dkdv_{option}") and window:
            raise ValueError(f"pinned dkdv_{option}: not with a sliding window")
    if pins.get("dkdv_pairs") and padded:
        raise ValueError("pinned dkdv_pairs: not on packed or ragged batches (a sequence's 64-row query tiles can be "
                         "odd in number)")
    if pins.get("dkdv_peel") and (padded or groups > 1):
        raise ValueError("pinned dkdv_peel: dense batches without GQA only")
    peel = bool(pins.get("dkdv_peel", True)) and causal and groups == 1 and not padded and not window
    pairs = (bool(pins.get("dkdv_pairs", not causal or groups > 1 or peel)) and n == 2 and not padded
             and not window)
    ahead = groups > 1 or (DKDV_HOPPER_AHEAD[n] and not padded)
    fits = n == 2 and groups == 1 and not padded and not window and len(dkdv_parts(d)) == 1
    if pins.get("dkdv_pipe") and not fits:
        raise ValueError("pinned dkdv_pipe: dense batches only, two MMA warpgroups (dkdv_hopper_wgs), one query head "
                         "per KV head, dK and dV in one launch (head dims up to 128)")
    from . import toolchain
    fresh_dp = fits and toolchain.sm90_ptxas_major() >= toolchain.PIPE_PTXAS_BELOW
    pipe = fits and bool(pins.get("dkdv_pipe", not fresh_dp))
    return dict(stages=int(TUNE.get("dkdv_hopper_stages", DKDV_HOPPER_STAGES)), pairs=pairs, peel=peel, ahead=ahead,
                pipe=pipe, fresh_dp=pipe and fresh_dp, parts=dkdv_parts(d), **wgs)


# ----------------------------------------------------------------------------------------------------
# The q/k quantization pass with the fused rotation (quantize._quantize_kernel, ROTATE)
# ----------------------------------------------------------------------------------------------------

# Several consecutive 128-row tiles per program, so that R (D x D) is staged in shared memory once and the pipeline
# copies the next tiles in while one is multiplied (3 stages: tile j + 2's copy issued when tile j is stored; 4 spill);
# fewer per program where the grid would leave an SM without one; 8 warps (the fp32 product tile); above D=128 one
# tile per program (R and the pipeline's tiles would not fit in shared memory).
QUANTIZE_ROTATE_TILES = 8
QUANTIZE_ROTATE_PROGRAMS_PER_SM = 1
QUANTIZE_ROTATE_WARPS = 8
QUANTIZE_ROTATE_STAGES = 3
H200_SMS = 132  # the SMs assumed off a GPU (the interpreter): the launches the H200 would make


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def quantize_rotate(tiles: int, d: int, device) -> tuple:
    """(tiles per program, warps, stages) of the rotation's quantization pass over `tiles` tiles at head dim d."""
    if "quantize_rotate" in TUNE:
        per, warps, stages = TUNE["quantize_rotate"]
        if int(per) < 1 or int(warps) not in (4, 8) or int(stages) < 1:
            raise ValueError(f"TUNE['quantize_rotate'] takes (tiles per program >= 1, warps 4 or 8, stages >= 1), "
                             f"got {TUNE['quantize_rotate']}")
        return int(per), int(warps), int(stages)
    if d > 128:
        return 1, QUANTIZE_ROTATE_WARPS, 1
    per, floor = QUANTIZE_ROTATE_TILES, QUANTIZE_ROTATE_PROGRAMS_PER_SM * sm_count(device)
    while per > 1 and tiles < per * floor:
        per //= 2
    return per, QUANTIZE_ROTATE_WARPS, QUANTIZE_ROTATE_STAGES
