"""Which kernel runs for an input and how it is launched: block sizes, warps and stages, TMA or pointer loads, scale
reads, and the Gluon kernels' options. Each default is the faster choice measured on the H200 with Triton 3.6
(docs/kernels.md has the measurements, and the alternatives measured slower); TUNE overrides the launch configs and
switches below for tuning runs.
"""

import functools
import logging
import os
import re
import subprocess
import warnings

from ._fp8 import INTERPRET

# Launch-config overrides for tuning runs (benchmarks/kernel_breakdown.py --variants, benchmarks/sm90_registers.py),
# empty in normal use; docs/kernels.md tables every key. Triton kernels: "fwd" / "dq" (BLOCK_M, warps, stages),
# "dkdv" (warps, stages), f"{k}_maxnreg" (ptxas register cap), "fwd_tma" / "dq_tma", "dkdv_lse2", "dkdv_p256".
# Gluon kernels: "fwd_hopper" / "dq_hopper" / "dkdv_hopper" (on / off), their "_stages", "dkdv_hopper_wgs"
# ((warpgroups, registers) or {head dim: that}), "dkdv_hopper_pairs" / "_peel", "hopper_packed" (the Gluon kernels
# on packed batches), "hopper_ragged" (on dense batches of N not a multiple of 128), "hopper_window" (on causal
# sliding windows), "hopper_fwd_wide" (the Gluon forward at FWD_HOPPER_WIDE_DIMS), "hopper_dkdv_wide" (the Gluon
# dK/dV kernel at DKDV_HOPPER_WIDE_DIMS) and "hopper_dq_wide" (the Gluon dQ kernel at DQ_HOPPER_WIDE_DIMS). The q/k
# quantization pass with the fused rotation: "quantize_rotate" ((tiles per program, warps, stages)). Each is read where
# its default is defined below.
TUNE: dict = {}
TUNE_KEYS = ({"fwd", "dq", "dkdv", "fwd_tma", "dq_tma", "dkdv_lse2", "dkdv_p256", "dkdv_hopper", "dkdv_hopper_stages",
              "dkdv_hopper_pairs", "dkdv_hopper_peel", "dq_hopper", "dq_hopper_stages",
              "fwd_hopper", "fwd_hopper_stages", "dkdv_hopper_wgs", "dkdv_hopper_pipe", "hopper_packed",
              "hopper_ragged", "hopper_window", "hopper_fwd_wide", "hopper_dkdv_wide", "hopper_dq_wide",
              "quantize_rotate"}
             | {f"{k}_maxnreg" for k in ("fwd", "dq", "dkdv")})


def _check_tune():
    """A misspelt TUNE key would silently time the defaults: refuse it."""
    unknown = set(TUNE) - TUNE_KEYS
    if unknown:
        raise KeyError(f"unknown kernels.TUNE keys {sorted(unknown)}; known: {sorted(TUNE_KEYS)}")


def _fwd_launch_cfg(dqk: int, dv: int, fp8: bool):
    """(BLOCK_M, num_warps, num_stages) of the forward, by head dim."""
    if "fwd" in TUNE:
        return TUNE["fwd"]
    d = max(dqk, dv)
    if d <= 128:  # (64, 4, 3): 0.82x the time of (128, 8, 3), 0.78x of (64, 4, 2) at D=128
        return 64, 4, 3
    # D=256: two warpgroups split the head dim; 3 stages 0.87x the time of 2. bf16 tiles are twice the bytes: 1 stage
    # keeps shared memory within the SM's 227 KB (3 stages: 416 KB)
    return (64, 8, 3) if fp8 else (64, 8, 1)


# The head dims at which each kernel reads its FP8 tiles through TMA tensor descriptors by default: the forward
# 0.89-0.94x the time at D 64/128, the dQ kernel 0.90x at D=128 (1.02x at D=64). The dK/dV kernel reads through
# pointers (TMA loads measured 1.05-1.20x its time).
TMA_HEAD_DIMS = {"fwd": (64, 128), "dq": (128,)}


def _use_tma(kernel: str, fp8: bool, dqk: int, dv: int, starts_aligned: bool = True) -> bool:
    """Whether `kernel` ("fwd" or "dq") reads its FP8 tiles through TMA tensor descriptors. fp8 only
    (q8, k8, v8, dO8 and their token-major copies are contiguous buffers of ours, so 2-D descriptors over
    them are valid; bf16 inputs may have any strides); by default at the head dims of TMA_HEAD_DIMS, or at
    any head dim <= 128 (True) / never (False) with TUNE[f"{kernel}_tma"]. Token-major tiles start at a
    sequence's first token in the innermost dimension: the H200 faulted (illegal instruction) on a varlen
    batch whose starts were not multiples of 16 tokens, and the interpreter rejects them too, so such
    batches (starts_aligned=False, from _seq_info) take the pointer path."""
    d = max(dqk, dv)
    want = TUNE.get(f"{kernel}_tma", d in TMA_HEAD_DIMS[kernel])
    return fp8 and bool(want) and d <= 128 and starts_aligned


# How the loops read their per-tile scales. Left alone, Triton 3.6 keeps each loop's accumulating MMA in flight across
# the back edge, turns the in-loop scale loads into cp.async copies, and ptxas then serializes every wgmma of the
# kernel. Reading the scales through inline PTX (forward._scale) keeps the MMAs in flight unserialized: the forward
# 0.97x the time at D=128 (1.18x at D=64), dQ 0.96x of waiting on each MMA inside the iteration, dK/dV 0.90x at
# D=128 causal (1.04x on the full mask). Triton 3.9 does not serialize these loops.
ASM_SCALES_HEAD_DIMS = {"fwd": (128,), "dq": (64, 128), "dkdv": (128,)}
ASM_SCALES_CAUSAL_ONLY = ("dkdv",)


def _asm_scales(kernel: str, d: int, causal: bool = True) -> bool:
    """Whether `kernel` reads its per-tile scales in the loop through inline PTX (ASM_SCALES_HEAD_DIMS and
    ASM_SCALES_CAUSAL_ONLY); never under the interpreter, which has no PTX."""
    return not INTERPRET and d in ASM_SCALES_HEAD_DIMS[kernel] and (causal or kernel not in ASM_SCALES_CAUSAL_ONLY)


# Head dims at which the correction pass multiplies each key tile's row sums of P * dP by the tile's dP scale instead
# of scaling every dP first (the same delta up to fp32 rounding; 385 -> 321 instructions per tile at D=128): the dQ
# kernel 0.97x the time at D=128 (1.01x at D=64, and in the Gluon dQ kernel at D=64 1.02x, so not at D=64).
SCALE_AFTER_SUM_HEAD_DIMS = (128, 256)


def _scale_after_sum(d: int) -> bool:
    """Whether the dQ kernel's correction pass scales row sums rather than each dP, at head dim d = max(Dqk, Dv)
    (SCALE_AFTER_SUM_HEAD_DIMS)."""
    return d in SCALE_AFTER_SUM_HEAD_DIMS


# Head dims at which the dK/dV kernel reads the dQ kernel's LSE2 = LSE * log2(e) (minus the shift below) instead of
# converting the LSE itself, and at which its exp2 yields P * 256 directly, the shift 8 subtracted in LSE2 (one FMUL
# per score less; dS^T comes out times 256, undone exactly in the per-tile scale): together 0.97x the dK/dV kernel's
# time at D=128 causal, 0.95x at D=64.
# At 192 (MLA's Dqk; max(Dqk, Dv) names the case) they are what the Gluon dK/dV kernel reads (DKDV_HOPPER_WIDE_DIMS).
DKDV_LSE2_HEAD_DIMS = (64, 128, 192, 256)
DKDV_P256_HEAD_DIMS = (64, 128, 192, 256)


def _dkdv_lse2(d: int) -> bool:
    """Whether the dQ kernel writes LSE2 for the dK/dV kernel to read (DKDV_LSE2_HEAD_DIMS or TUNE["dkdv_lse2"])."""
    return bool(TUNE.get("dkdv_lse2", d in DKDV_LSE2_HEAD_DIMS))


def _dkdv_p_shift(d: int, fp8: bool) -> int:
    """The dK/dV kernel's exponent shift: 8 where its exp2 yields P * 256 (fp8 only; DKDV_P256_HEAD_DIMS or
    TUNE["dkdv_p256"]), else 0."""
    return 8 if fp8 and TUNE.get("dkdv_p256", d in DKDV_P256_HEAD_DIMS) else 0


# Head dims at which the dQ kernel writes each dS tile's scale (one fp32 per DS_TILE_Q x block tile) and the dK/dV
# kernel reads it instead of finding the tile's absmax itself (the same scale up to fp32 rounding, without the absmax's
# shuffles and two CTA barriers per tile): dK/dV 0.87x the time at D=64 causal (0.80x with the 64-key programs of
# DKDV_BLOCK_N), 0.96-0.99x at D=128; not with GQA at D=128 (1.02x), nor at D=256 (the dQ kernel's store 1.10x).
DKDV_DS_SCALES_HEAD_DIMS = (64, 128)
DKDV_DS_SCALES_GQA_HEAD_DIMS = (64,)


def _dkdv_ds_scales(d: int, fp8: bool, gqa: bool = False) -> bool:
    """Whether the dK/dV kernel reads the dQ kernel's dS tile scales (fp8 only; DKDV_DS_SCALES_HEAD_DIMS, with GQA
    DKDV_DS_SCALES_GQA_HEAD_DIMS)."""
    return fp8 and d in (DKDV_DS_SCALES_GQA_HEAD_DIMS if gqa else DKDV_DS_SCALES_HEAD_DIMS)


# Keys per dK/dV program by head dim, where the dQ kernel's dS scales are read (_dkdv_ds_scales) and so a program
# may cover part of a dS tile: 64 keys are one warpgroup's wgmma rows, a program of 4 warps, two per SM that share
# no barrier (one's softmax can run under the other's MMAs): at D=64 causal, with the dS scales, dK/dV 0.80x the
# time of its own-absmax 128-key programs (0.87x with 128-key ones); at D=128 1.29x. Elsewhere the block (one dS
# tile's keys).
DKDV_BLOCK_N = {64: 64}


def _dkdv_block_n(block: int, d: int, ds_scales: bool) -> int:
    """Keys per program of the dK/dV kernel at head dim d: the block (one dS tile's keys), or with the dQ
    kernel's dS scales DKDV_BLOCK_N's divisor of it: a program then covers part of each dS tile, whose scale it
    reads, so the quantization is the block's either way."""
    return min(block, DKDV_BLOCK_N.get(d, block)) if ds_scales else block


# Head dims at which dK/dV and dQ (with the correction pass) come from the Gluon kernels (dkdv_hopper.py,
# dq_hopper.py) wherever they apply (_hopper_case): against the Triton kernels, dK/dV 0.72x the time at D=128 causal
# (0.77x full, 0.63x GQA, 0.84x at D=64), dQ 0.88x at D=128 causal (0.90x full, 0.98x at D=64).
DKDV_HOPPER_HEAD_DIMS = (64, 128)
DKDV_HOPPER_STAGES = 3
# MMA warpgroups per program (64 keys each) and their registers, by head dim: three at D=64, where the kernel needs
# under 128 registers (0.85x the time dense causal, 0.77x packed); at D=128 the dK and dV accumulators alone take 128
DKDV_HOPPER_WARPGROUPS = {64: (3, 160), 128: (2, 240), 192: (2, 240), 256: (2, 240)}
# With two warpgroups (D=128), the query tiles in pairs that share their 128-row dO8 quantization tile: the second
# skips dV's rescale (c / c' = 1 up to the division's rounding; dV then differs from the single-tile loop's by up to
# 1.4e-3, slightly closer to the reference): 0.95x the time on the full mask, 0.94x with GQA; dense causal without
# GQA only with the diagonal peeled (DKDV_HOPPER_PEEL; 0.98x, either alone slower). Never on packed batches: a
# sequence's query tiles can be odd in number there.
DKDV_HOPPER_PAIRS = True
# The causal diagonal's query tiles before the loop (no mask test inside it), on dense causal batches without GQA;
# and with three warpgroups (D=64) on dense batches the tiles' scales loaded a tile ahead (DKDV_HOPPER_AHEAD, always
# with GQA): D=64 0.96x the time causal, 0.83x full. Not on packed batches (1.00-1.02x), nor ahead at D=128 without
# GQA (1.03-1.07x).
DKDV_HOPPER_PEEL = {2: True, 3: True}  # by MMA warpgroups
# With two warpgroups on dense batches without GQA, each tile's dK MMA issued with the next tile's S^T and dP^T MMAs,
# to run under that tile's exponentials (dQ, dK, dV bit-identical): 0.89x the time on the full mask, 0.92x causal;
# not with GQA (1.02x, spills), nor with three warpgroups (1.08x causal, 1.27x full; dkdv_hopper.py has no such loop).
# Not by default with a ptxas of CUDA 13 or later (Triton 3.9 assembles sm_90 with its CUDA 13.4 `ptxas-blackwell`,
# 3.6 and 3.7 with CUDA 12.8's `ptxas`: _sm90_ptxas_major): that ptxas moved half of the fp8 conversions of the
# carried dS^T past the dP^T MMA that reuses their registers as its accumulator, so dK's MMA read the new tile's dP^T
# (dK wrong by 16x-1e6x on the H200), and serialized every wgmma (docs/kernels.md, "ptxas 13 and the pipelined dK
# MMA"). There TUNE["dkdv_hopper_pipe"] may switch it on with dP^T's MMA into a fresh accumulator (dkdv_hopper.pipe_mode
# 2: right operands, no serialized wgmma, 120-144 bytes of spills at D=128; not yet timed). Triton 3.9 without it
# ran 8K causal within 3.6's spread across calls.
DKDV_HOPPER_PIPE = True
DKDV_HOPPER_PIPE_PTXAS_BELOW = 13
DKDV_HOPPER_AHEAD = {2: False, 3: True}  # by MMA warpgroups, dense batches without GQA
DQ_HOPPER_HEAD_DIMS = (64, 128)
DQ_HOPPER_STAGES = 3
# The two MMA warpgroups take turns to issue their S and dP MMAs (FA3's ping-pong, _gluon.wait_turn), so that one's
# exponentials run under the other's MMAs, by head dim (1 on, 0 off): D=128 0.96x the time, D=64 1.03x. Turns that
# include the dQ MMA gained nothing at D=128; in the dK/dV kernel turns were slower (1.02-1.05x).
DQ_HOPPER_PINGPONG = {128: 1}
# Head dims at which the dQ kernel's second pass is pipelined on the full mask: each tile's dQ MMA issued with the
# next tile's S and dP MMAs, so that it runs under that tile's exponentials: 0.97x the time at D=128 and D=64. Not
# under causal masks (1.03-1.08x, either order of the tiles).
DQ_HOPPER_PIPE_FULL = (64, 128)
# The ring's stages by head dim where the pass is pipelined: 4 at D=64 (0.97x the time of 3; 4 stages are slower
# without the pipeline and at D=128)
DQ_HOPPER_PIPE_STAGES = {64: 4}
# Always two MMA warpgroups (64 queries each): three spill with the full 128-key tile (1.07x the time at D=64), and
# with the second pass in 64-key halves (no spills) were no faster (docs/kernels.md)
DQ_HOPPER_WARPGROUPS = 2


# Whether the Gluon kernels take packed (varlen) batches (kernels.segments: each sequence at rows starting at
# multiples of 128): causal self-attention, one batch row (a sliding window: HOPPER_WINDOW), forward and backward
# alike. On a packed batch the Triton kernels are far slower than on a dense one: the Gluon forward 0.64x their time,
# dQ 0.45x.
HOPPER_PACKED = True


def sm90_ptxas() -> str:
    """The path of the ptxas that Triton runs for sm_90 (its bundled one, or TRITON_PTXAS_PATH /
    TRITON_PTXAS_BLACKWELL_PATH)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path


@functools.lru_cache(maxsize=None)
def _sm90_ptxas_major() -> int:
    """The CUDA major version of sm90_ptxas()."""
    out = subprocess.run([sm90_ptxas(), "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.", out)
    if not found:
        raise RuntimeError(f"cannot read the CUDA version of ptxas from {out!r}")
    return int(found.group(1))


# The Triton versions with which the Gluon kernels passed their GPU tests (tests/test_kernels_gpu.py on the H200,
# benchmarks/triton_versions.sh; benchmarks/results/2026-12-03-h200-triton371-pass/ has 3.7.1's run), as release
# prefixes: "3.6" is any 3.6.x, "3.7.1" that release only (3.7.0, torch 2.12's, was never run: FLA refuses it on
# Hopper). With any other Triton the Triton kernels run instead (_gluon_triton_ok), unless HF_DELTAMATCH_GLUON=1.
GLUON_TRITON_VERSIONS = ("3.6", "3.7.1", "3.9")
GLUON_ENV = "HF_DELTAMATCH_GLUON"
_warned_gluon_version = False


def listed_triton(version: str, listed=GLUON_TRITON_VERSIONS) -> str | None:
    """The entry of `listed` (release prefixes) that Triton `version` belongs to ("3.6" holds 3.6.0 and
    3.6.1+git..., not 3.60.0; "3.7.1" holds 3.7.1 only), or None."""
    parts = version.split("+")[0].split(".")
    return next((v for v in listed if parts[:len(v.split("."))] == v.split(".")), None)


def _tested_text() -> str:
    """GLUON_TRITON_VERSIONS for a message: 3.6.x, 3.7.1, 3.9.x."""
    return ", ".join(v + ".x" if v.count(".") == 1 else v for v in GLUON_TRITON_VERSIONS)


def _gluon_triton_ok(warn: bool = True) -> bool:
    """Whether the installed Triton may run the Gluon kernels: a version of GLUON_TRITON_VERSIONS, or any with
    HF_DELTAMATCH_GLUON=1 (for testing an untested version); otherwise (and with `warn`) a warning, once per
    process, says which versions are tested and how to get the Gluon kernels. HF_DELTAMATCH_GLUON=0 keeps them off
    everywhere."""
    global _warned_gluon_version
    import triton
    want = os.environ.get(GLUON_ENV, "")
    if want not in ("", "0", "1"):
        raise ValueError(f"{GLUON_ENV}={want!r}: use 1 (the Gluon kernels on any Triton version) or 0 (never)")
    if want:
        return want == "1"
    if listed_triton(triton.__version__):
        return True
    if warn and not _warned_gluon_version:
        _warned_gluon_version = True
        warnings.warn(f"hf_deltamatch: the Gluon (sm_90) kernels are tested with Triton {_tested_text()}, not "
                      f"{triton.__version__}: the plain Triton kernels run instead (slower). Install a tested Triton "
                      f"for the fast path, or set {GLUON_ENV}=1 to run the Gluon kernels on this version anyway.",
                      RuntimeWarning, stacklevel=3)
    return False


def _hopper_case(**case) -> bool:
    """Whether the input is the Gluon kernels' case (_hopper_why_not says nothing against it)."""
    return _hopper_why_not(**case) is None


def _hopper_why_not(*, fp8: bool, e4m3: bool, dqk: int, dv: int, block: int, varlen: bool, window, n: int, m: int,
                    device, lse2_in: bool, p_shift: int, packed: bool = False, causal: bool = False,
                    wide: str | None = None) -> str | None:
    """None where the input is the Gluon kernels' case, else why not (one phrase, for the dispatch log): fp8 e4m3,
    Dqk = Dv in 64/128, block 128, no window (or a causal one with HOPPER_WINDOW or TUNE["hopper_window"]; `window`
    is None under the full mask, which ignores it), and N = M a multiple of 128, or N = M otherwise (HOPPER_RAGGED or
    TUNE["hopper_ragged"]; under the full mask HOPPER_RAGGED_FULL too), or a packed batch they take (packed: varlen,
    causal, cu_seqlens_q = cu_seqlens_k, B = 1; and HOPPER_PACKED or TUNE["hopper_packed"]); an sm_90 GPU, a tested
    Triton (_gluon_triton_ok), the dQ kernel's LSE2 with P * 256. The Triton version is asked last: its warning comes
    only for inputs the Gluon kernels would otherwise take. wide: "forward", "dkdv" or "dq", a kernel that also takes
    the head dims of its _WIDE dims (FWD_HOPPER_WIDE_DIMS, ...) where _wide_why_not allows."""
    if INTERPRET:
        return "TRITON_INTERPRET=1 (Gluon has no interpreter)"
    if not fp8:
        return "precision='bf16'"
    if not e4m3:
        return "e5m2 gradients"
    if dqk != dv or dqk not in (64, 128):
        if not (wide and (dqk, dv) in _WIDE[wide][0]):
            return f"head dims Dqk={dqk}, Dv={dv} (Dqk = Dv in 64, 128 only)"
        why = _wide_why_not(wide, dqk=dqk, dv=dv, varlen=varlen, window=window, n=n)
        if why:
            return why
    if block != 128:
        return f"block={block} (128 only)"
    if window is not None and not TUNE.get("hopper_window", HOPPER_WINDOW):
        return "a sliding window (launch.HOPPER_WINDOW / TUNE['hopper_window'] off)"
    if varlen and not packed:
        return "a varlen batch other than causal self-attention in one batch row (cu_seqlens_q = cu_seqlens_k)"
    if varlen and not TUNE.get("hopper_packed", HOPPER_PACKED):
        return "packed batches switched off (TUNE['hopper_packed'])"
    # no lengths in the phrases: the dispatch log keys on them, one line per kind of input, not per length
    if not varlen and (n != m or n == 0):
        return "N != M or N = 0 (N = M > 0 only)"
    if not varlen and n % 128 and not (causal or HOPPER_RAGGED_FULL):
        return "N not a multiple of 128 under the full mask (HOPPER_RAGGED_FULL off)"
    if not varlen and n % 128 and not TUNE.get("hopper_ragged", HOPPER_RAGGED):
        return "N not a multiple of 128 (launch.HOPPER_RAGGED / TUNE['hopper_ragged'] off)"
    if not (lse2_in and p_shift == 8):
        return "the dK/dV kernel's LSE2 or P * 256 switched off (TUNE['dkdv_lse2'] / ['dkdv_p256'])"
    if device.type != "cuda":
        return f"device {device.type}"
    import torch
    capability = torch.cuda.get_device_capability(device)
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (sm_90 only)"
    if not _gluon_triton_ok():
        import triton
        return f"Triton {triton.__version__} (tested: {_tested_text()}; {GLUON_ENV}=1 overrides)"
    return None


# The head dims (Dqk, Dv) beyond 64 and 128 at which the Gluon forward (fwd_hopper.py) runs, on dense batches of
# N = M a multiple of 128, without a window, with the Triton dQ and dK/dV kernels after it (they read the same saved
# q8, k8, v8, scales and LSE as after the Triton forward): Qwen3-Next / Gemma 3's 256 (two MMA warpgroups,
# fwd_hopper.WIDE_WARPGROUPS) and MLA's 192/128 (three, as at D=128). On by default (HOPPER_FWD_WIDE; TUNE
# ["hopper_fwd_wide"] overrides): tests/test_kernels_gpu.py::test_fwd_hopper_wide passed on the H200 with Triton 3.6
# and 3.9, and the forward takes 0.72x the Triton forward's time at B2 H8 N8192 D256 causal (0.956 vs 1.326 ms, SDPA
# cuDNN 0.940) and 0.43x for MLA (1.061 vs 2.451 ms, cuDNN 1.248).
FWD_HOPPER_WIDE_DIMS = ((256, 256), (192, 128))
HOPPER_FWD_WIDE = True
# The same head dims for the Gluon dK/dV kernel, after either dQ kernel (both write the dS tile scales and LSE2
# it reads): two launches, dV alone then dK alone (_dkdv_parts: a warpgroup cannot hold both 64 x 256 accumulators,
# nor MLA's 64 x 256 (Dqk 192 in a power-of-two box) and 64 x 128), two MMA warpgroups of 240 registers each.
# On the H200 (Triton 3.6, causal, B2 N8192): 1.377 vs 2.421 ms for the Triton dK/dV kernels at D=256 H8 (0.57x),
# 2.316 vs 4.572 for MLA at H16 (0.51x); tests/test_kernels_gpu.py::test_dkdv_hopper_wide passed.
# TUNE["hopper_dkdv_wide"] (or TUNE["dkdv_hopper"]) = False turns it off.
DKDV_HOPPER_WIDE_DIMS = ((256, 256), (192, 128))
HOPPER_DKDV_WIDE = True
# The same head dims for the Gluon dQ kernel: dQ's columns in two launches (dq_hopper's HALF 1 and 2), each warpgroup
# holding S and dP of a 128-key tile (64 registers each, as at D = 128) and 64 x 128 of dQ (64), where all of dQ
# would take 128 (256 in all, over the 240 a warpgroup has); the second launch recomputes S, dP and dS for its half
# but not the correction pass, whose delta it reads. Shared memory at D = 256 with 2 stages: 224 KB of the SM's 227
# (3 stages for MLA: 246128 B, out of shared memory). On the H200 (Triton 3.6, causal, B2 N8192): 1.593 vs 2.597 ms
# for the Triton dQ kernel at D=256 H8 (0.61x), 2.744 vs 4.022 for MLA at H16 (0.68x);
# tests/test_kernels_gpu.py::test_dq_hopper_wide passed. TUNE["hopper_dq_wide"] = False turns it off.
DQ_HOPPER_WIDE_DIMS = DKDV_HOPPER_WIDE_DIMS
HOPPER_DQ_WIDE = True
DQ_HOPPER_WIDE_STAGES = 2
# Per Gluon kernel that takes wide head dims: (its dims, its TUNE key, its module switch, its name in the dispatch log)
_WIDE = {"forward": (FWD_HOPPER_WIDE_DIMS, "hopper_fwd_wide", "HOPPER_FWD_WIDE", "the Gluon forward"),
         "dkdv": (DKDV_HOPPER_WIDE_DIMS, "hopper_dkdv_wide", "HOPPER_DKDV_WIDE", "the Gluon dK/dV kernel"),
         "dq": (DQ_HOPPER_WIDE_DIMS, "hopper_dq_wide", "HOPPER_DQ_WIDE", "the Gluon dQ kernel")}
# Registers of each of the two MMA warpgroups at Dv = 256: O (128 per thread), S (64) and P8 (16) at once
FWD_HOPPER_WIDE_REGS = 240
FWD_HOPPER_WIDE_STAGES = 2


def _wide_why_not(kernel: str, *, dqk: int, dv: int, varlen: bool, window, n: int) -> str | None:
    """_hopper_why_not's verdict at the wide dims of `kernel` (a key of _WIDE): None, or why not."""
    dims = f"head dims Dqk={dqk}, Dv={dv}"
    _, key, flag, name = _WIDE[kernel]
    if not TUNE.get(key, globals()[flag]):
        return f"{dims}: {name} there is off (launch.{flag} / TUNE['{key}'])"
    if varlen:
        return f"a varlen batch at {dims} ({name} there: dense batches only)"
    if window is not None:
        return f"a sliding window at {dims} ({name} there: none)"
    if n % 128:
        return f"N not a multiple of 128 at {dims} ({name} there: whole 128-token tiles only)"
    return None


# Whether the Gluon kernels take dense batches whose N (= M) is not a multiple of 128 ("ragged"): they run the packed
# batches' variant of the kernels (VARLEN) with each head as one sequence of N tokens in its rows rounded up to 128
# (quantize.TAIL_ROWS), which the dense fp8 copies have already (zeros past N), so q8, k8, v8 and dO8 are not copied;
# the per-row scales and LSE go to that layout (ops._backward_padded). Causal masks hide the padded keys; under the
# full mask (HOPPER_RAGGED_FULL) the forward and dQ kernels mask the last key tile past N (VARLEN without CAUSAL, a
# variant no packed batch takes) and the dQ kernel's pass 2 is not pipelined (_dq_hopper_cfg). On the H200 at B2 H16
# N8000 D128 causal it takes fwd+bwd from 4.79 ms (the Triton kernels) to 3.79 ms (docs/kernels.md);
# TUNE["hopper_ragged"] = False turns it off.
HOPPER_RAGGED = True
HOPPER_RAGGED_FULL = True

# Whether the Gluon kernels take causal sliding windows (HAS_WINDOW in fwd_hopper, dq_hopper, dkdv_hopper): each
# program's loop starts at the first key tile its first query's window reaches (the forward and dQ kernels) or ends at
# the last query tile whose window holds its last key (dK/dV), the tiles cut by the window's edge masked, each
# warpgroup's tiles outside its rows' windows released unread; on dense batches (any N, as above) and packed ones.
# The dK/dV kernel runs without pairs, the peeled diagonal and the pipelined dK MMA there (_dkdv_hopper_cfg). On:
# tests/test_kernels_gpu.py's window tests passed on the H200 (Triton 3.6 and 3.7.1), and at B2 H16 N8192 D128 the
# three Gluon kernels take 0.81-0.85x the Triton kernels' GPU time from W = 128 to 4096 (forward 0.85-0.90x, backward
# 0.80-0.84x; kernel_breakdown, 2026-12-03, two calls); fwd+bwd under autograd 3.160 vs 3.790 ms at W = 4096 (Flex
# 3.850) and 2.118 vs 2.248 at W = 128, where the host's time per call bounds both (Flex 0.629). TUNE["hopper_window"]
# = False turns it off.
HOPPER_WINDOW = True

# The dispatch log (issue #32): one DEBUG line per distinct case on the "hf_deltamatch" logger, naming the kernels a
# call takes and, where they are not the Gluon ones, why
log = logging.getLogger("hf_deltamatch")
_LOGGED: set = set()


def log_dispatch(step: str, kernels: str, case: str, why: str | None = None) -> None:
    """Log, once per distinct (step, kernels, case, why), that `step` ("forward" / "backward") of an input described
    by `case` runs `kernels`, and why not the Gluon ones (`why`). Nothing is recorded while DEBUG is off for the
    logger, so turning it on later still logs every case."""
    key = (step, kernels, case, why)
    if key in _LOGGED or not log.isEnabledFor(logging.DEBUG):
        return
    _LOGGED.add(key)
    log.debug("kernels %s: %s for %s%s", step, kernels, case, f" (not Gluon: {why})" if why else "")


# Head dims at which the forward comes from fwd_hopper's Gluon kernel where it applies (_hopper_case): 0.95-0.98x
# the Triton forward's time at D=128, 0.95x at D=64 (three warpgroups, fwd_hopper.WARPGROUPS). FA3's schedule (tile
# j-1's PV issued with tile j's QK^T, the warpgroups taking turns) was slower under causal masks (1.10x).
FWD_HOPPER_HEAD_DIMS = (64, 128)
FWD_HOPPER_STAGES = 2
# Registers of each of the forward's three MMA warpgroups: S, O and P8 fit in 160 without spills. The dQ kernel
# spills with three warpgroups and keeps two (DQ_HOPPER_WARPGROUPS).
FWD_HOPPER_REGS = 160


def _fwd_hopper(d: int, *, fp8: bool, dqk: int, dv: int, block: int, varlen: bool, window, n: int, m: int,
                device, packed: bool = False, causal: bool = False) -> bool:
    """Whether the forward comes from fwd_hopper's Gluon kernel: FWD_HOPPER_HEAD_DIMS, a packed batch
    (HOPPER_PACKED), FWD_HOPPER_WIDE_DIMS (where HOPPER_FWD_WIDE is on: _wide_why_not) or TUNE["fwd_hopper"], and
    the input is the Gluon kernels' case (_hopper_case; the forward always quantizes to e4m3 and has no LSE2)."""
    wide = (dqk, dv) in FWD_HOPPER_WIDE_DIMS  # where _hopper_why_not asks HOPPER_FWD_WIDE
    return bool(TUNE.get("fwd_hopper", d in FWD_HOPPER_HEAD_DIMS or varlen or wide)) and _hopper_case(
        **_fwd_case(fp8=fp8, dqk=dqk, dv=dv, block=block, varlen=varlen, window=window, n=n, m=m, device=device,
                    packed=packed, causal=causal))


def _fwd_case(**case) -> dict:
    """_hopper_case's input for the forward (_fwd_hopper's arguments): e4m3, the dQ kernel's LSE2 and P * 256,
    which the forward does not use, and the forward's own head dims (wide: FWD_HOPPER_WIDE_DIMS)."""
    return dict(case, e4m3=True, lse2_in=True, p_shift=8, wide="forward")


def _dkdv_hopper(d: int, **case) -> bool:
    """Whether dK/dV comes from dkdv_hopper's Gluon kernel: DKDV_HOPPER_HEAD_DIMS, DKDV_HOPPER_WIDE_DIMS (where
    HOPPER_DKDV_WIDE is on: _wide_why_not) or TUNE["dkdv_hopper"], and the input is its case (_hopper_case)."""
    wide = (case["dqk"], case["dv"]) in DKDV_HOPPER_WIDE_DIMS
    return bool(TUNE.get("dkdv_hopper", d in DKDV_HOPPER_HEAD_DIMS or wide)) and _hopper_case(**case, wide="dkdv")


def _dkdv_warpgroups(d: int) -> dict:
    """(warpgroups, registers) of the Gluon dK/dV kernel at head dim d: DKDV_HOPPER_WARPGROUPS or
    TUNE["dkdv_hopper_wgs"], a pair or {head dim: pair}."""
    want = TUNE.get("dkdv_hopper_wgs", DKDV_HOPPER_WARPGROUPS)
    wgs, regs = want.get(d, DKDV_HOPPER_WARPGROUPS[d]) if isinstance(want, dict) else want
    if wgs not in (2, 3):  # 4 spill: the default partition keeps the launch's 96 registers
        raise ValueError(f"dkdv_hopper_wgs: 2 or 3 MMA warpgroups, got {wgs}")
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


def _dkdv_hopper_cfg(d: int, *, causal: bool, groups: int, packed: bool, window: bool = False) -> dict:
    """dkdv_hopper.dkdv_hopper's options at head dim d for the case (causal, GQA groups, a packed batch, a sliding
    window: then no pairs, peel or pipelined dK MMA, whose loops assume every tile from the diagonal on):
    DKDV_HOPPER_* or TUNE["dkdv_hopper_<option>"]. Pairs only with two warpgroups; the scales a tile ahead always
    with GQA (the loop counts the group's heads that way), else on dense batches by warpgroups (DKDV_HOPPER_AHEAD);
    the pipelined dK MMA with two warpgroups on dense batches without GQA (DKDV_HOPPER_PIPE), not under a ptxas of
    CUDA 13+ unless TUNE["dkdv_hopper_pipe"] asks, and then with a fresh dP^T accumulator (fresh_dp); the launches
    (parts: _dkdv_parts, dV and dK apart above D = 128, and then no pipelined dK MMA)."""
    wgs = _dkdv_warpgroups(d)
    n = wgs["warpgroups"]
    if window and any(TUNE.get(f"dkdv_hopper_{k}") for k in ("pairs", "peel", "pipe")):
        raise ValueError("dkdv_hopper_pairs / _peel / _pipe: not with a sliding window; leave them unset")
    peel = _dkdv_hopper_peel(causal=causal, groups=groups, packed=packed, warpgroups=n) and not window
    pairs = _dkdv_hopper_pairs(causal=causal, groups=groups, packed=packed, peel=peel) and n == 2 and not window
    ahead = groups > 1 or (DKDV_HOPPER_AHEAD[n] and not packed)
    fits = n == 2 and groups == 1 and not packed and not window and len(_dkdv_parts(d)) == 1
    fresh_dp = _sm90_ptxas_major() >= DKDV_HOPPER_PIPE_PTXAS_BELOW
    pipe = fits and bool(TUNE.get("dkdv_hopper_pipe", DKDV_HOPPER_PIPE and not fresh_dp))
    if TUNE.get("dkdv_hopper_pipe") and not fits:
        raise ValueError("dkdv_hopper_pipe: dense batches only, two MMA warpgroups (dkdv_hopper_wgs), one query head "
                         "per KV head, dK and dV in one launch (head dims up to 128)")
    return dict(stages=int(TUNE.get("dkdv_hopper_stages", DKDV_HOPPER_STAGES)), pairs=pairs, peel=peel, ahead=ahead,
                pipe=pipe, fresh_dp=pipe and fresh_dp, parts=_dkdv_parts(d), **wgs)


def _fwd_hopper_cfg(dv: int) -> dict:
    """fwd_hopper.fwd_hopper's options at head dim Dv: FWD_HOPPER_STAGES (or TUNE["fwd_hopper_stages"]),
    FWD_HOPPER_REGS and fwd_hopper.WARPGROUPS; at Dv = 256 FWD_HOPPER_WIDE_STAGES, FWD_HOPPER_WIDE_REGS and
    fwd_hopper.WIDE_WARPGROUPS."""
    from .fwd_hopper import WARPGROUPS, WIDE_WARPGROUPS
    if dv > 128:
        return dict(stages=int(TUNE.get("fwd_hopper_stages", FWD_HOPPER_WIDE_STAGES)), regs=FWD_HOPPER_WIDE_REGS,
                    warpgroups=WIDE_WARPGROUPS)
    return dict(stages=int(TUNE.get("fwd_hopper_stages", FWD_HOPPER_STAGES)), regs=FWD_HOPPER_REGS,
                warpgroups=WARPGROUPS)


def _dq_hopper_cfg(d: int, causal: bool, padded: bool = False) -> dict:
    """dq_hopper.dq_hopper's options at head dim d = max(Dqk, Dv): DQ_HOPPER_STAGES (DQ_HOPPER_PIPE_STAGES when
    pipelined, DQ_HOPPER_WIDE_STAGES above D = 128, or TUNE["dq_hopper_stages"]), DQ_HOPPER_PINGPONG, and
    DQ_HOPPER_PIPE_FULL without a causal mask, except on the padded layout (packed, ragged: `padded`), whose last key
    tile the pipelined pass would not mask; the launches (halves: dQ's columns in two above D = 128)."""
    pipe = d in DQ_HOPPER_PIPE_FULL and not causal and not padded
    stages = DQ_HOPPER_PIPE_STAGES.get(d, DQ_HOPPER_STAGES) if pipe else DQ_HOPPER_STAGES
    halves = (0,)
    if d > 128:
        stages, halves = DQ_HOPPER_WIDE_STAGES, (1, 2)
    return dict(stages=int(TUNE.get("dq_hopper_stages", stages)), pingpong=DQ_HOPPER_PINGPONG.get(d, 0), pipe=pipe,
                halves=halves)


def _dq_hopper(d: int, *, stale: bool, **case) -> bool:
    """Whether dQ and the correction pass come from dq_hopper's Gluon kernel: DQ_HOPPER_HEAD_DIMS, a packed
    batch (HOPPER_PACKED), DQ_HOPPER_WIDE_DIMS (where HOPPER_DQ_WIDE is on: _wide_why_not) or TUNE["dq_hopper"], the
    matching delta, and the input is its case (_hopper_case)."""
    wide = (case["dqk"], case["dv"]) in DQ_HOPPER_WIDE_DIMS
    return (bool(TUNE.get("dq_hopper", d in DQ_HOPPER_HEAD_DIMS or case["varlen"] or wide)) and not stale
            and _hopper_case(**case, wide="dq"))


# How many heads each kernel's grid hands out together under a causal mask, tile-major within the group
# (forward._grid_ids; 1 is head by head, as with any other mask, whose tiles all carry the same work). Causal tiles
# differ in work up to N / BLOCK-fold: head by head, the last head's heaviest tile starts near the end and runs alone,
# while too large a group spreads the reads over more heads' K/V or q/dO than the L2 holds. Groups: forward and dQ
# 0.95x the time, dK/dV 0.99x (0.86x with GQA); all heads at once 1.06x (dQ); on the full mask groups 1.01-1.04x.
HEAD_GROUP_CAUSAL = {"fwd": 4, "dq": 8, "dkdv": 4}


def _grid(kernel: str, tiles: int, heads: int, nseq: int, causal: bool):
    """(grid, n_tiles, head_group) of `kernel` over `tiles` tiles x `heads` (batch x head) x `nseq` sequences;
    the head group from HEAD_GROUP_CAUSAL (causal) or 1."""
    group = HEAD_GROUP_CAUSAL[kernel] if causal else 1
    return (tiles * heads, 1, nseq), tiles, min(group, max(heads, 1))


# The q/k quantization pass with the fused rotation (quantize._quantize_kernel, ROTATE): at most this many 128-row
# tiles per program, its warps and its software pipeline's stages. One tile per program reloads R (D x D, as many bytes
# as the bf16 tile) from L2 and restages it in shared memory for every tile, and at 217 registers x 8 warps one
# program fills an SM, with nothing to overlap its loads with: on the H200 the forward grew by 94 us over the q and k
# passes at B2 H16 N8192 D128 (a plain pass: about 37 us). Several tiles per program stage R once, and the
# compiler's pipeline copies tiles into shared memory asynchronously (cp.async), the tensor cores reading them there:
# with 3 stages it issues tile j + 2's copy when tile j is stored, so each copy has a whole tile's work to hide behind
# (2 stages would issue tile j + 1's only then, and wait for it at once; 4 spill). Fewer tiles per program where the
# grid would leave fewer than QUANTIZE_ROTATE_PROGRAMS_PER_SM programs per SM. Chosen from the sm_90 SASS, not yet
# timed: `benchmarks/qk_transforms_breakdown.py --variants` compares tiles per program on the GPU in one call.
QUANTIZE_ROTATE_TILES = 8
QUANTIZE_ROTATE_PROGRAMS_PER_SM = 1
QUANTIZE_ROTATE_WARPS = 8  # the fp32 product tile: 128 x 128 fp32 is 128 registers per thread with 4 warps
QUANTIZE_ROTATE_STAGES = 3
H200_SMS = 132  # the SMs assumed off a GPU (the interpreter): the launches the H200 would make


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _quantize_rotate_cfg(tiles: int, d: int, device) -> tuple:
    """(tiles per program, warps, stages) of the rotation's quantization pass over `tiles` tiles in all at head dim
    d: QUANTIZE_ROTATE_TILES halved until the grid has QUANTIZE_ROTATE_PROGRAMS_PER_SM programs per SM, or
    TUNE["quantize_rotate"] ((1, 8, 1) is one tile per program). Above D=128 one tile per program: R and the
    pipeline's tiles would need 352 KB of shared memory at D=256 (the SM has 227 KB)."""
    if "quantize_rotate" in TUNE:
        per, warps, stages = TUNE["quantize_rotate"]
        if int(per) < 1 or int(warps) not in (4, 8) or int(stages) < 1:
            raise ValueError(f"TUNE['quantize_rotate'] takes (tiles per program >= 1, warps 4 or 8, stages >= 1), "
                             f"got {TUNE['quantize_rotate']}")
        return int(per), int(warps), int(stages)
    if d > 128:
        return 1, QUANTIZE_ROTATE_WARPS, 1
    per, floor = QUANTIZE_ROTATE_TILES, QUANTIZE_ROTATE_PROGRAMS_PER_SM * _sm_count(device)
    while per > 1 and tiles < per * floor:
        per //= 2
    return per, QUANTIZE_ROTATE_WARPS, QUANTIZE_ROTATE_STAGES


# Above this head dim dK and dV come from two launches of the dK/dV kernel (dV alone: S^T and P^T dO; dK alone: S^T,
# dP^T and dS^T q) instead of one: one fp32 accumulator of BLOCK_N x D per program instead of two, for one more
# matmul. At D=256 two accumulators spill 2.2 KB per thread: split 0.25x the time; at D=128 split 1.42x.
DKDV_SPLIT_ABOVE = 128


def _dkdv_parts(d: int) -> tuple:
    """The dK/dV kernel's launches at head dim d, as its PART constant: (0,) both at once, or (1, 2) dV then dK
    (d > DKDV_SPLIT_ABOVE)."""
    return (1, 2) if d > DKDV_SPLIT_ABOVE else (0,)


def _maxnreg(kernel: str) -> dict:
    """Launch kwargs capping registers per thread for `kernel` ("fwd", "dq", "dkdv"), if tuning asks for it."""
    cap = TUNE.get(f"{kernel}_maxnreg")
    return {"maxnreg": cap} if cap else {}


def _bwd_launch_cfg(dqk: int, dv: int, fp8: bool, kv_n: int = 128, block: int = 128):
    """(dq BLOCK_M, dq warps, dq stages, dkdv warps, dkdv stages); kv_n: the dK/dV program's keys
    (_dkdv_block_n), 64 of them one warpgroup (4 warps) where fewer than the block."""
    d = max(dqk, dv)
    if d <= 64:  # dq (64, 4, 3) 0.88x the time of 2 stages; dK/dV (8, 3) 0.86x of (8, 2)
        base = (64, 4, 3, 8, 3)
    elif d <= 128:  # dq (64, 4, 2) 0.84x of (128, 8, 2), 0.80x of 3 stages; dK/dV (8, 3) 0.93x of (8, 2)
        base = (64, 4, 2, 8, 3)
    else:  # D=256: dq (128, 8, 1) 0.74x of (64, 8, 2); split dK/dV (8, 2) 0.92x of (8, 1); bf16: configs within
        # the SM's 227 KB of shared memory (untimed)
        base = (128, 8, 1, 8, 2) if fp8 else (64, 8, 1, 8, 1)
    if kv_n < block and kv_n <= 64:
        base = (*base[:3], 4, base[4])
    return (*TUNE.get("dq", base[:3]), *TUNE.get("dkdv", base[3:]))
