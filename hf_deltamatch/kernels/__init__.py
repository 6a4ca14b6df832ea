"""Triton and Gluon kernels (Hopper) implementing docs/numerics.md; the same entry points as hf_deltamatch.reference.

forward(...)  -> (out, lse, q8, k8, v8, q_scale, k_scale, v_scale)
backward(...) -> (dq, dk, dv)
supports(q, k, v, window, config) -> None, or a one-line reason the kernels cannot run this input.

plan.py decides which kernels run for an input and how they launch (a Case -> select -> Plan; configs.py holds the
launch tables and TUNE, toolchain.py what each Triton release was found to do); ops.py executes the Plan. Kernels:
forward.py, backward.py and quantize.py (Triton: every supported input), fwd_hopper.py, dq_hopper.py and
dkdv_hopper.py (Gluon: the common fp8 case on sm_90).
"""

import os

# The kernels are tuned and tested with fused multiply-adds (the scale and LSE2 in one FFMA per score, the folded dS
# scale): Triton 3.9 warns while TRITON_DEFAULT_FP_FUSION is unset and 3.10 turns fusion off by default. On unless
# the user chose (docs/knobs.md).
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from .configs import TUNE  # noqa: E402
from .ops import backward, forward, supports  # noqa: E402
from .plan import PINS, pinned  # noqa: E402

__all__ = ["PINS", "TUNE", "backward", "forward", "pinned", "supports"]
