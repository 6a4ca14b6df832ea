"""Triton kernels (Hopper) implementing docs/numerics.md; the same entry points as hf_deltamatch.reference.

forward(...)  -> (out, lse, q8, k8, v8, q_scale, k_scale, v_scale)
backward(...) -> (dq, dk, dv)
supports(q, k, v, window, config) -> None, or a one-line reason the kernels cannot run this input.

The host code is ops.py; launch.py chooses the kernel and its launch configuration for each input, and its TUNE
dict overrides those choices for tuning runs (docs/kernels.md lists the keys). Kernels: forward.py, backward.py
and quantize.py (Triton, every supported input), fwd_hopper.py, dq_hopper.py and dkdv_hopper.py (Gluon, the
common fp8 case on sm_90 with Triton 3.6).
"""

from .launch import TUNE
from .ops import backward, forward, supports

__all__ = ["TUNE", "backward", "forward", "supports"]
