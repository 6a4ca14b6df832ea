"""FP8 helpers shared by the kernels: the tile scale and a cast that is exact under the interpreter too.

On the GPU `x.to(tl.float8e4nv)` is the hardware cvt (round-to-nearest-even, we clamp first so no
saturation is needed). Triton's interpreter rounds fp32->fp8 wrongly (a few % of values land one ulp
off), so when interpreting we first round in software to the fp8 grid (values stay fp32, exactly
representable), after which the interpreter's cast is exact.
"""

import os

import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


@triton.jit
def _round_to_fp8_grid(x, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Round fp32 x (|x| <= fmax) to the nearest-even fp8 value, result in fp32.

    ulp = 2^(max(e, EMIN) - MBITS); adding and subtracting 1.5 * 2^23 * ulp makes the fp32 adder do the
    round-to-nearest-even at that ulp (|x| < 16 ulp, so x + c keeps c's exponent).
    """
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    c = ulp * 12582912.0
    return (x + c) - c


@triton.jit
def to_fp8(x, E5M2: tl.constexpr, INTERP: tl.constexpr):
    """Saturating RNE cast of fp32 to e4m3 (E5M2=False) or e5m2; NaN stays NaN (±inf saturates).

    On the GPU Triton emits `cvt.rn.satfinite.{e4m3,e5m2}x2.f32` (checked in the PTX for sm_90), which
    already saturates and keeps NaN: clamping there would cost two instructions per element in every inner loop.
    The interpreter's clamp (np.fmax) and cast would turn NaN into a number, so there NaN is kept explicitly.
    """
    if E5M2:
        if INTERP:
            y = _round_to_fp8_grid(_clamp_keep_nan(x, 57344.0), 2, -14).to(tl.float8e5)
            return tl.where(x != x, tl.full(x.shape, 0x7F, tl.uint8).to(tl.float8e5, bitcast=True), y)
        return x.to(tl.float8e5)
    else:
        if INTERP:
            y = _round_to_fp8_grid(_clamp_keep_nan(x, 448.0), 3, -6).to(tl.float8e4nv)
            return tl.where(x != x, tl.full(x.shape, 0x7F, tl.uint8).to(tl.float8e4nv, bitcast=True), y)
        return x.to(tl.float8e4nv)


# The smallest normal fp32 value. No tile scale is below it, so 1 / scale is finite (a tile whose amax is a
# subnormal, dS beside an attention sink, would otherwise get 1 / 0 on the GPU, which flushes subnormals).
SCALE_FLOOR = tl.constexpr(1.1754943508222875e-38)
# How far below the largest tile so far an accumulator's units may go (acc_units): 2^-64. An accumulator then
# holds at most 2^64 times 2^25 (128 products of two 448s) times the tiles it adds, far inside fp32's 2^128.
UNITS_SPAN = tl.constexpr(5.421010862427522e-20)


@triton.jit
def _clamp_keep_nan(x, FMAX: tl.constexpr):
    nan = tl.PropagateNan.ALL
    return tl.minimum(tl.maximum(x, -FMAX, propagate_nan=nan), FMAX, propagate_nan=nan)


@triton.jit
def tile_scale(amax, FMAX: tl.constexpr, POW2: tl.constexpr):
    """scale = max(amax / fmax, SCALE_FLOOR), optionally rounded up to a power of two (exactly); 1 for an all-zero
    tile."""
    scale = tl.maximum(amax / FMAX, SCALE_FLOOR)
    if POW2:
        # 2^ceil(log2(s)) by bits: bump the exponent unless the mantissa is already zero.
        bits = scale.to(tl.int32, bitcast=True)
        scale = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def acc_units(c, c_max):
    """The units an MMA accumulator takes before adding a tile whose operand scales multiply to c (it is kept in
    units of the tile it last added, so the MMA accumulates in place), and the running max of c. Normally c itself;
    but never below UNITS_SPAN x the largest c so far, nor below SCALE_FLOOR: a tile 2^64 below an earlier one
    (P of 1e-30 beside an attention sink) would otherwise scale the accumulator past fp32's range, or to inf
    through c == 0. Where the units exceed c, the tile's operand is quantized with the coarser scale
    units / (the other operand's scale): its contribution is below 2^-39 of the largest tile's."""
    c_max = tl.maximum(c_max, c)
    return tl.maximum(tl.maximum(c, c_max * UNITS_SPAN), SCALE_FLOOR), c_max


@triton.jit
def _round_to_bf16_grid(x):
    """fp32 -> nearest-even bf16 value, still fp32 (the interpreter's own bf16 cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_to(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """x.to(dtype) with round-to-nearest-even also under the interpreter (bf16 there truncates)."""
    if INTERP and dtype == tl.bfloat16:
        return _round_to_bf16_grid(x).to(dtype)
    return x.to(dtype)
