"""The model's RMSNorms through torch's `F.rms_norm` (`--fused_norms`).

transformers' RMSNorms run eagerly in fp32: upcast, pow, mean, rsqrt, one or two multiplies and a downcast, each a
kernel that reads and writes the whole activation, each saved for backward, all of it twice under checkpointing: with
the Gated DeltaNet's fp32 gating, a visible part of the 1.7B hybrid's step (docs/performance.md).
`F.rms_norm` computes the same thing as one ATen op (`_fused_rms_norm` and its backward on CUDA; a composite of the
same math on CPU). On that step it measured within the steps' spread of the eager norms, so it is off by default;
whether the fused kernel is what ran there has not been profiled.

Which fused forward stands in for a norm class is decided by measurement, not by name: for each class the candidates
below run beside the class's own forward on random inputs (fp32 and bf16, random weights), and the first that
agrees to fp32 / bf16 rounding replaces it on every instance. A class none reproduces keeps its eager forward, and
`fuse_rms_norms` names it. So a transformers release that changes a norm's arithmetic is never silently swapped.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


def _eps(m: nn.Module) -> float:
    return float(getattr(m, "variance_epsilon", getattr(m, "eps", 1e-6)))


def _zero_centered(self, x):
    """Gemma / Qwen3.5 / Qwen3-Next: (x_normed * (1 + w)) in fp32, cast back to x's dtype."""
    return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), _eps(self)).type_as(x)


def _weight_after_cast(self, x):
    """Llama / Qwen3: w * x_normed.to(x.dtype); in fp32 (the recipes' residual stream) one op with the weight."""
    if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), self.weight, _eps(self))
    return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, _eps(self)).to(x.dtype)


def _gated_silu(self, x, gate):
    """Qwen3.5 / Qwen3-Next Gated DeltaNet output norm: (w * x_normed.to(x.dtype)) * silu(gate) in fp32, cast back."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, _eps(self)).to(x.dtype)
    return (self.weight * normed * F.silu(gate.float())).to(x.dtype)


CANDIDATES = {1: (_zero_centered, _weight_after_cast), 2: (_gated_silu,)}  # by the forward's tensor inputs


def _n_inputs(m: nn.Module) -> int:
    """The forward's required tensor arguments (optional ones, e.g. a residual, keep their defaults)."""
    params = [p for p in inspect.signature(type(m).forward).parameters.values()
              if p.name != "self" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(params)


def _agrees(m: nn.Module, candidate, n_inputs: int) -> bool:
    """Whether `candidate` reproduces the class's forward on a probe copy (random weight, fp32 and bf16 inputs, and
    their gradients), to a few units of each dtype's rounding."""
    probe = copy.deepcopy(m).float().cpu()
    gen = torch.Generator().manual_seed(0)
    d = probe.weight.shape[-1]
    with torch.no_grad():
        probe.weight.copy_(torch.randn(probe.weight.shape, generator=gen) * 0.5)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        inputs = [(torch.randn(3, 5, d, generator=gen) * 3).to(dtype) for _ in range(n_inputs)]
        outs = []
        for fn in (type(probe).forward, candidate):
            xs = [t.clone().requires_grad_() for t in inputs]
            probe.zero_grad(set_to_none=True)
            y = fn(probe, *xs)
            y.float().pow(2).sum().backward()
            outs.append((y.detach(), [t.grad.float() for t in xs], probe.weight.grad.clone()))
        (y0, g0, w0), (y1, g1, w1) = outs
        if y0.dtype != y1.dtype or y0.shape != y1.shape:
            return False
        y0, y1 = y0.float(), y1.float()
        for a, b in [(y0, y1), *zip(g0, g1), (w0, w1)]:
            if not torch.allclose(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item())):
                return False
    return True


def _candidate_for(m: nn.Module):
    """The first candidate that reproduces m's class's forward, or None (also when the probe itself fails)."""
    k = _n_inputs(m)
    for c in CANDIDATES.get(k, ()):
        try:
            if _agrees(m, c, k):
                return c
        except Exception as e:  # noqa: BLE001  (a forward the CPU probe cannot run: leave the class eager)
            log.debug("--fused_norms: probing %s with %s failed: %s", type(m).__name__, c.__name__, e)
    return None


def fuse_rms_norms(model: nn.Module) -> tuple[int, list[str]]:
    """Replace the forward of every transformers RMSNorm (a module of transformers whose class name ends in RMSNorm
    or RMSNormGated and that holds one weight vector; other libraries' norms, e.g. flash-linear-attention's fused
    ones, are left as they are) by the F.rms_norm candidate that reproduces it. Returns (instances replaced, names
    of the classes left eager)."""
    chosen: dict[type, object] = {}
    left: list[str] = []
    n = 0
    for m in model.modules():
        cls = type(m)
        name = cls.__name__
        if not (name.endswith("RMSNorm") or name.endswith("RMSNormGated")) or \
                not cls.__module__.startswith("transformers."):
            continue
        if not isinstance(getattr(m, "weight", None), torch.Tensor) or m.weight.dim() != 1:
            continue
        if cls not in chosen:
            chosen[cls] = _candidate_for(m)
            if chosen[cls] is None:
                left.append(name)
                log.warning("--fused_norms: no fused form reproduces %s; it stays eager", name)
        if chosen[cls] is not None:
            m.forward = types.MethodType(chosen[cls], m)
            n += 1
    return n, left
