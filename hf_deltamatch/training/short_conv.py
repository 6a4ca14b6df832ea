"""Gated DeltaNet's short causal convolution on packed rows, restarted at every document start.

transformers' Qwen3.5 / Qwen3-Next Gated DeltaNet layers hand the packed row's boundaries (`cu_seq_lens_q`) to
flash-linear-attention's varlen gated delta rule, but call their depthwise causal conv (`causal_conv1d_fn`, the
torch fallback being F.conv1d with left padding) on the whole row, so a document's first kernel_size - 1 outputs
read the previous document's last tokens. `packed_causal_conv1d` is that conv computed exactly per document;
`document_aware` wraps a modeling module's `causal_conv1d_fn` so that calls carrying boundaries get a conv that
restarts at them, while every other call goes to the original function untouched. Which one, in order:
- the causal-conv1d CUDA kernel with `seq_idx` (its own reset), where transformers resolved that kernel;
- on CUDA with flash-linear-attention installed (the hybrids' fast path needs it anyway), FLA's Triton
  `causal_conv1d` with `cu_seqlens` (`USE_FLA_CONV`). It reads the layer's channel-last activations in place,
  where torch's depthwise conv needs them transposed and runs a generic kernel: on the H200 at 64K tokens that
  conv was 8 % of the hybrid's training step;
- `packed_causal_conv1d` (torch; CPU, or neither of the above).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Packed calls on CUDA take flash-linear-attention's Triton causal conv where FLA is installed (module docstring)
USE_FLA_CONV = True


def packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         cu_seqlens: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """transformers' torch `causal_conv1d_fn`, restarted at every document start of a packed row.

    Args:
        x: (B, C, T); the packed documents along T, the same for every row of B.
        weight: (C, K) depthwise taps; bias: (C,) or None.
        cu_seqlens: (n_docs + 1,) document offsets, 0 first and T last (empty documents allowed).
        activation: a transformers activation name, or None.
    Returns:
        (B, C, T) in x's dtype: output t of document [s, e) sums only taps on x[max(s, t - K + 1) .. t].

    The conv runs over the whole row as the fallback does; only outputs within K - 1 of a document start (other
    than the row's first) read across a boundary, and those are recomputed with the crossing taps dropped, in
    the conv's own operand dtype with an fp32 (fp64 for fp64) sum, and written back out of place.
    """
    channels, seq_len, width = x.shape[1], x.shape[-1], weight.shape[-1]
    _check_boundaries(cu_seqlens, seq_len)
    xw = x.to(weight.dtype)
    out = F.conv1d(xw, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)[:, :, :seq_len]
    pos, start = _positions_after_starts(cu_seqlens.to(device=x.device, dtype=torch.long), width)
    if pos.numel():
        taps = pos[:, None] - (width - 1) + torch.arange(width, device=x.device)  # (n, K) source index per tap
        keep = taps >= start[:, None]  # a tap before the position's own document start reads another document
        conv_dtype = out.dtype  # autocast may have run the conv in bf16: recompute on the same operands
        acc = torch.float64 if conv_dtype == torch.float64 else torch.float32
        window = xw[:, :, taps.clamp(min=0)].to(conv_dtype).to(acc)  # (B, C, n, K)
        taps_w = weight.to(conv_dtype).to(acc)[:, None, :] * keep  # (C, n, K)
        fixed = (window * taps_w).sum(-1)
        if bias is not None:
            fixed = fixed + bias.to(conv_dtype).to(acc)[:, None]
        out = out.index_copy(2, pos, fixed.to(conv_dtype))
    if activation is not None:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def _check_boundaries(cu_seqlens: torch.Tensor, seq_len: int) -> None:
    if cu_seqlens.ndim != 1 or cu_seqlens[[0, -1]].tolist() != [0, seq_len]:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {seq_len}; got {cu_seqlens.tolist()} "
                         "(packed rows come as batch 1 from a flattening collator, with boundaries that cover them).")


def _positions_after_starts(cu: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions within width - 1 of a document start other than 0, each with its own document's start."""
    starts, ends = cu[1:-1], cu[2:]
    pos = starts[:, None] + torch.arange(width - 1, device=cu.device)  # (n_docs - 1, K - 1)
    inside = pos < ends[:, None]  # a document shorter than K - 1 stops at its own end
    return pos[inside], starts[:, None].expand_as(pos)[inside]


def boundaries_from_seq_idx(seq_idx: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of a (1, T) row of document ids (a new document wherever the id changes)."""
    row = seq_idx[0]
    starts = torch.nonzero(row[1:] != row[:-1]).flatten() + 1
    zero, end = starts.new_zeros(1), starts.new_full((1,), row.numel())
    return torch.cat([zero, starts, end])


def seq_idx_from_boundaries(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, T) int32 document ids: the causal-conv1d kernel restarts wherever the id changes."""
    cu = cu_seqlens.to(torch.long)
    ids = torch.arange(cu.numel() - 1, device=cu.device, dtype=torch.int32)
    return torch.repeat_interleave(ids, cu[1:] - cu[:-1])[None]


def resolved_implementation(fn):
    """The function behind transformers' `use_kernel_func_from_hub_with_fallback` wrapper `fn`: the torch
    fallback itself, the causal-conv1d kernel, or whatever else transformers picked (None if `fn` is not that
    wrapper)."""
    try:
        return inspect.getclosurevars(fn).nonlocals.get("implementation")
    except TypeError:  # not a Python function
        return None


def _kind(fn) -> str:
    impl = resolved_implementation(fn)
    if impl is not None and impl is getattr(fn, "__wrapped__", None):
        return "torch"
    if impl is not None and getattr(impl, "__module__", "").split(".")[0] == "causal_conv1d":
        return "causal_conv1d"
    return "other"


def fla_causal_conv1d():
    """flash-linear-attention's Triton `causal_conv1d` (x (B, T, D), weight (D, W), cu_seqlens), or None where FLA
    is not installed."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError:
        return None
    return causal_conv1d


def _fla_applies(x: torch.Tensor) -> bool:
    return USE_FLA_CONV and x.is_cuda and fla_causal_conv1d() is not None


def fla_packed_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             cu_seqlens: torch.Tensor, activation: str | None = None) -> torch.Tensor:
    """`packed_causal_conv1d`'s contract through FLA's Triton conv: x (1, C, T) as the layers pass it (a transpose of
    channel-last activations, read in place), output (1, C, T) in x's dtype, a transposed view of FLA's channel-last
    output (so the layer's transpose back is free). FLA takes `silu`/`swish` or no activation."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"FLA's causal conv applies silu or no activation, not {activation!r}: set "
                         "hf_deltamatch.training.short_conv.USE_FLA_CONV = False for the torch conv.")
    seq_len = x.shape[-1]
    _check_boundaries(cu_seqlens, seq_len)
    out, _ = fla_causal_conv1d()(x.transpose(1, 2), weight, bias, activation=activation,
                                 cu_seqlens=cu_seqlens.to(device=x.device, dtype=torch.int32))
    return out.to(x.dtype).transpose(1, 2)


def document_aware(original):
    """`original` (a modeling module's `causal_conv1d_fn`) made to restart at packed document starts.

    A call carrying `cu_seq_lens_q` (or `seq_idx`) with batch 1 gets the causal-conv1d kernel with `seq_idx` when
    that is what transformers resolved, else FLA's Triton conv on CUDA (`fla_packed_causal_conv1d`, where FLA is
    installed), else `packed_causal_conv1d`; any other call is `original`'s, unchanged.
    """
    if getattr(original, "_hf_dm_documents", False):
        return original
    kind = _kind(original)
    impl = resolved_implementation(original)
    if kind == "other":
        log.warning("causal_conv1d_fn resolves to %r, which may not keep packed documents apart; packed calls use "
                    "FLA's Triton conv (CUDA) or the exact torch per-document convolution instead",
                    impl if impl is not None else original)

    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu, seq_idx = kwargs.get("cu_seq_lens_q"), kwargs.get("seq_idx")
        if cu is None and seq_idx is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed boundaries (cu_seq_lens_q / seq_idx) with batch {hidden_states.shape[0]}: a "
                             "packed batch is one row (DataCollatorWithFlattening / PackedCollator layout).")
        if cu is None:
            cu = boundaries_from_seq_idx(seq_idx)
        if kind == "causal_conv1d":
            seq_idx = seq_idx if seq_idx is not None else seq_idx_from_boundaries(cu)
            return impl(hidden_states, weight, bias, seq_idx=seq_idx.to(torch.int32), activation=activation)
        if _fla_applies(hidden_states):
            return fla_packed_causal_conv1d(hidden_states, weight, bias, cu, activation)
        return packed_causal_conv1d(hidden_states, weight, bias, cu, activation)

    causal_conv1d_fn._hf_dm_documents = True
    causal_conv1d_fn._hf_dm_kind = kind
    return causal_conv1d_fn


def implementation_name(fn) -> str:
    """What a modeling module's `causal_conv1d_fn` (patched or not) runs: "torch conv1d" or the kernel's name."""
    base = fn.__wrapped__ if getattr(fn, "_hf_dm_documents", False) else fn
    if _kind(base) == "torch":
        return "torch conv1d"
    impl = resolved_implementation(base) or base
    return f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', impl)}"


def describe(fn) -> str:
    """One line on what a modeling module's `causal_conv1d_fn` does with packed rows (for run reports)."""
    name = implementation_name(fn)
    if not getattr(fn, "_hf_dm_documents", False):
        return f"{name} over the whole packed row (not restarted at document starts)"
    if fn._hf_dm_kind == "causal_conv1d":
        return f"{name} with seq_idx (restarted at every packed document start)"
    if USE_FLA_CONV and fla_causal_conv1d() is not None:
        return ("flash-linear-attention's Triton causal_conv1d with cu_seqlens on CUDA (restarted at every packed "
                "document start); torch conv1d with an exact per-document recompute elsewhere")
    return "torch conv1d, restarted at every packed document start (exact per-document recompute)"
