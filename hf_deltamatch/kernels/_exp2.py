"""exp2 of a score tile shared between the MUFU unit and the FMA pipe.

Per 64 x 128 FP8 score tile the exponentials alone (8192 at 16 per clock per SM) take as long as the tile's
two QGMMAs, while the FMA pipe has room (benchmarks/NOTES.md, "exp2 on the FMA pipe"). `exp2_tile` computes
a fraction 1/POLY of the tile's elements with a polynomial on the FMA pipe instead (FlashAttention-4 offloads
exponentials to the FMA units the same way on Blackwell), the rest with `tl.exp2` (MUFU.EX2).

Accuracy: degree-5 polynomial of the reduced argument, relative error <= 2e-7 (below), about what MUFU.EX2
(ex2.approx.ftz.f32) itself gives, so P stays the contract's fp32 P (docs/numerics.md). Arguments below -125 give 2^-125 instead of 0: use it only on tiles without masked
(-inf) scores. Both passes of the dQ kernel split the same tile the same way, so the correction pass sums
exactly the P that dS uses.

The split follows the MMA accumulator layout (a thread holds column pairs, and rows r and r + 8 of each
16-row group): every split and join below keeps each element in its thread (sm_90 SASS: no added shuffles
or shared-memory round trips).
"""

import triton
import triton.language as tl

# 2^f on [-0.5, 0.5] = 1 + f * (C1 + f * (C2 + ...)), degree 5, fitted for relative error with the constant
# term exactly 1 (fp32 cannot hold a finer one near 1): relative error <= 1.9e-7, mean -1.9e-8 (a sixth of
# an fp32 ulp) over uniform arguments, measured in fp32 Horner arithmetic
_C5 = tl.constexpr(0.0013265408364603708)
_C4 = tl.constexpr(0.009671512851452978)
_C3 = tl.constexpr(0.0555073139832481)
_C2 = tl.constexpr(0.2402224208325788)
_C1 = tl.constexpr(0.6931469793818505)


@triton.jit
def exp2_poly(x):
    """2^x on the FMA pipe: x = n + f with n = round(x) (the 1.5 * 2^23 trick puts n in t's low mantissa
    bits), 2^f by the polynomial, n added to its exponent field. x is clamped at -125 (normal results only)."""
    x = tl.maximum(x, -125.0)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = _C5 * f + _C4
    p = p * f + _C3
    p = p * f + _C2
    p = p * f + _C1
    p = p * f + 1.0
    bits = p.to(tl.int32, bitcast=True) + (t.to(tl.int32, bitcast=True) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _pairs(x, R: tl.constexpr, C: tl.constexpr):
    """(even columns, odd columns) of an (R, C) tile, each (R, C // 2)."""
    return tl.split(tl.reshape(x, (R, C // 2, 2)))


@triton.jit
def _unpairs(a, b, R: tl.constexpr, C: tl.constexpr):
    return tl.reshape(tl.join(a, b), (R, C))


@triton.jit
def _row_halves(x, R: tl.constexpr, C: tl.constexpr):
    """(rows 0-7, rows 8-15) of every 16-row group of an (R, C) tile, each (R // 2, C)."""
    a, b = tl.split(tl.permute(tl.reshape(x, (R // 16, 2, 8, C)), (0, 2, 3, 1)))
    return tl.reshape(a, (R // 2, C)), tl.reshape(b, (R // 2, C))


@triton.jit
def _unrow_halves(a, b, R: tl.constexpr, C: tl.constexpr):
    y = tl.join(tl.reshape(a, (R // 16, 8, C)), tl.reshape(b, (R // 16, 8, C)))
    return tl.reshape(tl.permute(y, (0, 3, 1, 2)), (R, C))


@triton.jit
def _col_groups(x, R: tl.constexpr, C: tl.constexpr):
    """(even, odd) 8-column groups of an (R, C) tile, each (R, C // 2)."""
    a, b = tl.split(tl.permute(tl.reshape(x, (R, C // 16, 2, 8)), (0, 1, 3, 2)))
    return tl.reshape(a, (R, C // 2)), tl.reshape(b, (R, C // 2))


@triton.jit
def _uncol_groups(a, b, R: tl.constexpr, C: tl.constexpr):
    y = tl.join(tl.reshape(a, (R, C // 16, 8)), tl.reshape(b, (R, C // 16, 8)))
    return tl.reshape(tl.permute(y, (0, 1, 3, 2)), (R, C))


@triton.jit
def exp2_tile(x, R: tl.constexpr, C: tl.constexpr, POLY: tl.constexpr):
    """exp2 of an (R, C) fp32 tile (R a multiple of 16, C of 16), 1/POLY of it (POLY 0 = none, 2, 4 or 8) by
    exp2_poly: the odd columns (2), of rows 8-15 of each 16-row group (4), of the odd 8-column groups (8)."""
    if POLY == 0:
        return tl.exp2(x)
    elif POLY == 2:
        a, b = _pairs(x, R, C)
        return _unpairs(tl.exp2(a), exp2_poly(b), R, C)
    elif POLY == 4:
        lo, hi = _row_halves(x, R, C)
        a, b = _pairs(hi, R // 2, C)
        return _unrow_halves(tl.exp2(lo), _unpairs(tl.exp2(a), exp2_poly(b), R // 2, C), R, C)
    else:
        tl.static_assert(POLY == 8, "POLY must be 0, 2, 4 or 8")
        lo, hi = _row_halves(x, R, C)
        g0, g1 = _col_groups(hi, R // 2, C)
        a, b = _pairs(g1, R // 2, C // 2)
        g1 = _unpairs(tl.exp2(a), exp2_poly(b), R // 2, C // 2)
        return _unrow_halves(tl.exp2(lo), _uncol_groups(tl.exp2(g0), g1, R // 2, C), R, C)
