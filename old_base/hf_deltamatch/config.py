"""DeltaMatchConfig: the one configuration object of the attention op.

Environment overrides (read at every call, for ablations without code changes):
  HF_DELTAMATCH_PRECISION = fp8 | bf16
  HF_DELTAMATCH_DELTA     = matching | stale
  HF_DELTAMATCH_BACKEND   = auto | triton | reference
"""

from __future__ import annotations

import dataclasses
import os

_CHOICES = {
    "precision": ("fp8", "bf16"),
    "delta": ("matching", "stale"),
    "block": (64, 128),
    "scale_rounding": ("fp32", "pow2"),
    "grad_format": ("e4m3", "e5m2"),
    "backend": ("auto", "triton", "reference"),
}
_ENV = {
    "precision": "HF_DELTAMATCH_PRECISION",
    "delta": "HF_DELTAMATCH_DELTA",
    "backend": "HF_DELTAMATCH_BACKEND",
}


@dataclasses.dataclass(frozen=True)
class DeltaMatchConfig:
    """Numerics of `deltamatch_attention` (see docs/numerics.md for the full contract).

    precision:      "fp8" quantizes all seven attention matmuls to block-scaled FP8; "bf16" runs the same
                    algorithm with operands in the input dtype (for same-kernel comparisons).
    delta:          "matching" computes delta_i = sum_j P_ij dP_ij from the operands the backward really
                    uses (Delta-Matching); "stale" uses dot(dO_i, O_i) like FlashAttention (the failure mode,
                    kept for ablations).
    block:          tokens per quantization tile (and per key tile of the online softmax): 64 or 128.
    scale_rounding: "fp32" keeps scale = amax / fmax; "pow2" rounds it up to a power of two.
    grad_format:    FP8 format of dO and dS: "e4m3" (default) or "e5m2".
    backend:        "auto" (Triton on CUDA, reference elsewhere), "triton" or "reference".
    deterministic:  bit-reproducible gradients. Both backends already are (the Triton backward writes every
                    dQ/dK/dV element once, no atomics: fusing dQ into dK/dV by atomics made backward 2x slower on the H200), so this
                    costs nothing today; it stays so that a future faster non-deterministic path is opt-in.
    """

    precision: str = "fp8"
    delta: str = "matching"
    block: int = 128
    scale_rounding: str = "fp32"
    grad_format: str = "e4m3"
    backend: str = "auto"
    deterministic: bool = False

    def __post_init__(self):
        for field, choices in _CHOICES.items():
            value = getattr(self, field)
            if value not in choices:
                raise ValueError(
                    f"DeltaMatchConfig.{field}={value!r} is not supported; choose one of {list(choices)}."
                )

    def with_env_overrides(self) -> "DeltaMatchConfig":
        """This config with the HF_DELTAMATCH_* environment variables applied (they win over code)."""
        changes = {}
        for field, var in _ENV.items():
            value = os.environ.get(var)
            if value:
                value = value.strip().lower()
                if value not in _CHOICES[field]:
                    raise ValueError(f"{var}={value!r} is not supported; choose one of {list(_CHOICES[field])}.")
                changes[field] = value
        return dataclasses.replace(self, **changes) if changes else self

    def replace(self, **changes) -> "DeltaMatchConfig":
        return dataclasses.replace(self, **changes)
