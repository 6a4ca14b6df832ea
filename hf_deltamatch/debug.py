"""HF_DELTAMATCH_CHECK_FINITE=1: find the attention call where a run first went NaN or inf.

With the variable set, every `deltamatch_attention` call checks its output (forward) and its dQ, dK, dV (backward)
and raises `NonFiniteError` at the first non-finite value, naming the layer (transformers models: its index), the
shapes, masks and config, which tensor went non-finite, and the inputs' absmax, so that a blow-up upstream (inputs
already non-finite or huge) is told apart from one in attention. It costs one host sync per tensor, so it is for
debugging; unset (the default), a call reads one environment variable and does nothing else. Not under
torch.compile (the checks would break the graph): run the failing step eagerly.
"""

from __future__ import annotations

import contextvars
import os

import torch

ENV = "HF_DELTAMATCH_CHECK_FINITE"

# The layer the next attention call belongs to (set by the transformers integration; None for direct calls)
_LAYER: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_deltamatch_layer", default=None)


class NonFiniteError(FloatingPointError):
    """An attention output or gradient held NaN or inf (HF_DELTAMATCH_CHECK_FINITE)."""


def enabled() -> bool:
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return not torch.compiler.is_compiling()
    raise ValueError(f"{ENV}={value!r}: set it to 1 to check every attention call for NaN/inf, or unset it.")


def set_layer(name: str | None) -> None:
    """Name the layer of the attention calls that follow (e.g. 'layer 5 (Qwen3Attention)')."""
    _LAYER.set(name)


def _absmax(t: torch.Tensor) -> str:
    finite = torch.isfinite(t)
    amax = t[finite].abs().max().item() if finite.any() else float("nan")
    return f"{amax:.3g}" + ("" if bool(finite.all()) else f" ({int((~finite).sum())} non-finite)")


def describe_call(q, k, v, *, causal, window, cu_seqlens_q, config) -> dict:
    """What an error message needs to know of a call, taken at its forward (the backward no longer has q, k, v)."""
    return dict(
        layer=_LAYER.get(), shapes=f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} {q.dtype}",
        masks=f"causal={causal}, window={window}, packed={cu_seqlens_q is not None}", config=config,
        absmax=f"q {_absmax(q)}, k {_absmax(k)}, v {_absmax(v)}",
        inputs_finite=all(bool(torch.isfinite(t).all()) for t in (q, k, v)),
    )


def check(call: dict, stage: str, tensors: dict[str, torch.Tensor], grad_out: torch.Tensor | None = None) -> None:
    """Raise NonFiniteError at the first of `tensors` (in order) holding NaN or inf."""
    for name, t in tensors.items():
        bad = ~torch.isfinite(t)
        if not bad.any():
            continue
        first = bad.nonzero()[0].tolist()
        counts = f"nan {int(torch.isnan(t).sum())}, +inf {int((t == float('inf')).sum())}, " \
                 f"-inf {int((t == float('-inf')).sum())}"
        absmax = call["absmax"] + (f", dO {_absmax(grad_out)}" if grad_out is not None else "")
        upstream = not call["inputs_finite"] or (grad_out is not None and not bool(torch.isfinite(grad_out).all()))
        verdict = ("an input was already non-finite: the blow-up is upstream of attention" if upstream else
                   "every input is finite, so attention produced it: please report this message; "
                   "DeltaMatchConfig(backend='reference') computes the same contract in PyTorch meanwhile")
        where = f" in {call['layer']}" if call["layer"] else ""
        raise NonFiniteError(
            f"{ENV}: {name} of deltamatch_attention{where} ({stage}) holds {int(bad.sum())} non-finite values "
            f"(first at {first}; {counts}); {call['shapes']}, {call['masks']}, {call['config']}; "
            f"inputs' absmax: {absmax}; {verdict}.")
