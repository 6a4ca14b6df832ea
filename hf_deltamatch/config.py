"""DeltaMatchConfig: the one configuration object of the attention op.

Environment overrides (read at every call, for ablations without code changes):
  HF_DELTAMATCH_PRECISION = fp8 | bf16
  HF_DELTAMATCH_DELTA     = matching | stale
  HF_DELTAMATCH_BACKEND   = auto | triton | reference
  HF_DELTAMATCH_QK_ROTATION = none | hadamard
  HF_DELTAMATCH_SMOOTH_K  = 0 | 1 (also false | true)
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
    "qk_rotation": ("none", "hadamard"),
}
_ENV = {
    "precision": "HF_DELTAMATCH_PRECISION",
    "delta": "HF_DELTAMATCH_DELTA",
    "backend": "HF_DELTAMATCH_BACKEND",
    "qk_rotation": "HF_DELTAMATCH_QK_ROTATION",
}
_BOOL_ENV = {"smooth_k": "HF_DELTAMATCH_SMOOTH_K"}
_BOOL_VALUES = {"1": True, "true": True, "0": False, "false": False}


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
                    dQ/dK/dV element once, no atomics: a dQ fused into dK/dV by atomics was slower,
                    docs/kernels.md), so this costs nothing today; it stays so that a future faster
                    non-deterministic path is opt-in.
    qk_rotation:    "hadamard" rotates q and k by one fixed orthogonal matrix over the head dim (random signs
                    times a Hadamard matrix) before quantization: scores unchanged in exact arithmetic, outlier
                    channels spread over all channels; "none" (default). docs/numerics.md, "Outlier channels".
    smooth_k:       subtract from k its mean over the keys of each sequence before quantization (softmax is
                    shift-invariant per query); removes a shared bias of the keys from their FP8 tiles.
    """

    precision: str = "fp8"
    delta: str = "matching"
    block: int = 128
    scale_rounding: str = "fp32"
    grad_format: str = "e4m3"
    backend: str = "auto"
    deterministic: bool = False
    qk_rotation: str = "none"
    smooth_k: bool = False

    def __post_init__(self):
        for field, choices in _CHOICES.items():
            value = getattr(self, field)
            if value not in choices:
                raise ValueError(
                    f"DeltaMatchConfig.{field}={value!r} is not supported; choose one of {list(choices)}."
                )
        if not isinstance(self.smooth_k, bool):
            raise ValueError(f"DeltaMatchConfig.smooth_k must be True or False, got {self.smooth_k!r}.")

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
        for field, var in _BOOL_ENV.items():
            value = os.environ.get(var)
            if value:
                if value.strip().lower() not in _BOOL_VALUES:
                    raise ValueError(f"{var}={value!r} is not supported; use 1/0 or true/false.")
                changes[field] = _BOOL_VALUES[value.strip().lower()]
        return dataclasses.replace(self, **changes) if changes else self

    def replace(self, **changes) -> "DeltaMatchConfig":
        return dataclasses.replace(self, **changes)
