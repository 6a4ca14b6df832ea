"""Triton kernels (Hopper) implementing docs/numerics.md; the same entry points as hf_deltamatch.reference.

forward(...)  -> (out, lse, q8, k8, v8, q_scale, k_scale, v_scale)
backward(...) -> (dq, dk, dv)
supports(q, k, v, window, config) -> None, or a one-line reason the kernels cannot run this input.

The host code is ops.py; launch.py chooses the kernel and its launch configuration for each input, and its TUNE
dict overrides those choices for tuning runs (docs/kernels.md lists the keys). Kernels: forward.py, backward.py
and quantize.py (Triton, every supported input), fwd_hopper.py, dq_hopper.py and dkdv_hopper.py (Gluon, the
common fp8 case on sm_90 with a Triton of launch.GLUON_TRITON_VERSIONS).
"""

import os

# The kernels are tuned and tested with fused multiply-adds (the scale and LSE2 in one FFMA per score, the folded dS
# scale): Triton 3.9 warns while TRITON_DEFAULT_FP_FUSION is unset and 3.10 turns fusion off by default. On unless
# the user chose (docs/kernels.md, Knobs).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .launch import TUNE  # noqa: E402
from .ops import backward, forward, supports  # noqa: E402

__all__ = ["TUNE", "backward", "forward", "supports"]
