"""FP8 NaN and inf in Triton's interpreter as on the GPU.

The interpreter decodes FP8 operands (tl.dot's, and casts to wider floats) bit by bit without their special
values: e4m3's NaN (0x7F, 0xFF) comes out as ±480 and e5m2's inf/NaN as finite numbers when widened to fp32,
where the GPU's MMA and cvt keep them. Tests of non-finite inputs therefore run the interpreter with its decoder
wrapped to map those encodings to NaN/inf (hf_deltamatch.kernels._fp8.to_fp8 already keeps NaN on the way in).
"""

from __future__ import annotations

import contextlib

import numpy as np


def _special_bits(dtype):
    """(NaN bits, +inf bits, sign bit) of a 16/32-bit float type."""
    if dtype.primitive_bitwidth == 32:
        return 0x7FC00000, 0x7F800000, 0x80000000
    if dtype.fp_mantissa_width == 10:  # fp16
        return 0x7E00, 0x7C00, 0x8000
    return 0x7FC0, 0x7F80, 0x8000  # bf16


@contextlib.contextmanager
def fp8_specials_decoded():
    """Within the context, the interpreter decodes FP8 NaN (e4m3, e5m2) and inf (e5m2) to NaN and inf."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_convert_float", None)
    if original is None:
        raise RuntimeError(f"Triton {triton.__version__}'s interpreter has no _convert_float (its FP8 decoder): "
                           "adapt tests/_interpreter_fp8.py to this version.")

    def convert(input, input_dtype, output_dtype, rounding_mode):
        out = original(input, input_dtype, output_dtype, rounding_mode)
        if input_dtype not in (tl.float8e4nv, tl.float8e5) or output_dtype.primitive_bitwidth <= 8:
            return out
        bits = np.asarray(input).view(np.uint8)
        if input_dtype == tl.float8e4nv:
            nan, inf = (bits & 0x7F) == 0x7F, np.zeros(bits.shape, dtype=bool)
        else:
            nan = ((bits & 0x7C) == 0x7C) & ((bits & 0x03) != 0)
            inf = (bits & 0x7F) == 0x7C
        if not (nan.any() or inf.any()):
            return out
        nan_bits, inf_bits, sign_bit = _special_bits(output_dtype)
        out = out.copy()
        out[nan] = nan_bits
        out[inf] = np.where(bits[inf] & 0x80, inf_bits | sign_bit, inf_bits).astype(out.dtype)
        return out

    interpreter._convert_float = convert
    try:
        yield
    finally:
        interpreter._convert_float = original
