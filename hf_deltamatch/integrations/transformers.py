"""`attn_implementation="deltamatch_fp8"` for transformers models.

Registers an attention function and, under the same name, a mask function (masks.py): transformers builds the masks
through the function registered for the model's attention implementation, and without one it would drop padding
masks silently. The attention function runs what the mask says:

  no mask               dense rows (or packed rows given as flash-attention's `cu_seq_lens_*` kwargs)
  padding (bool)        each row's real tokens moved to the front and run as packed sequences (a row's queries
                        with its real keys, and the padding as a sequence of its own), then moved back
  segments (int32)      packed documents or chunks, each a sequence, in place

The layout of a mask (gather indices, cu_seqlens) is built on the device with shapes fixed by the input's, so no
step reads a device value on the host; in eager mode it is built once per forward (every layer gets the same mask
tensor) and looked up by the others. The sequences' bounds, which the kernels' launch grids need, are then read
once per forward by the op (hf_deltamatch._varlen).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import debug
from .._tensor_cache import TensorCache
from ..attention import deltamatch_attention
from .masks import deltamatch_mask

NAME = "deltamatch_fp8"

__all__ = ["NAME", "deltamatch_attention_forward", "deltamatch_mask", "register"]


def _target_dtype(query: torch.Tensor, module: torch.nn.Module) -> torch.dtype:
    """The half-precision dtype fp32 inputs (PEFT upcasting, fp32 models) are cast to, as transformers'
    flash path does: the autocast dtype, else the model's half-precision weights' dtype, else bf16."""
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
    config_dtype = getattr(getattr(module, "config", None), "dtype", None)
    if config_dtype in (torch.bfloat16, torch.float16):
        return config_dtype
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in (torch.bfloat16, torch.float16):
            return layer.weight.dtype
    return torch.bfloat16


def _check_unsupported(module, dropout, softcap, kwargs):
    if dropout and module.training:
        raise ValueError(
            f"deltamatch_fp8 has no attention dropout (got dropout={dropout} in training). Set the model "
            "config's attention_dropout to 0.0, or use attn_implementation='sdpa'."
        )
    if softcap is not None:
        raise ValueError(
            "deltamatch_fp8 does not support attention logit softcapping (softcap). Use attn_implementation="
            "'eager' or 'flex_attention' for this model."
        )
    if kwargs.get("sinks") is not None:
        raise ValueError(
            "deltamatch_fp8 supports learnable per-head attention sinks (passed as s_aux, as gpt-oss does), not "
            "the per-token sinks passed as `sinks`. Use attn_implementation='eager' for this model."
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError("deltamatch_fp8 does not support an additive position bias; use attn_implementation='sdpa'.")
    if kwargs.get("output_attentions"):
        raise ValueError("deltamatch_fp8 never materializes attention weights; use attn_implementation='eager' "
                         "for output_attentions=True.")


# ----------------------------------------------------------------------------------------------------
# Layouts: a mask as packed sequences, built on the device with fixed shapes
# ----------------------------------------------------------------------------------------------------


class _Layout(NamedTuple):
    """Packed sequences over the B * S queries and B * KV keys of a batch, flattened row by row."""

    q_index: torch.Tensor | None  # (B * S,) int64: the flat query row at each packed position (None: in order)
    k_index: torch.Tensor | None  # (B * KV,) likewise for keys (the same tensor as q_index for self-attention)
    q_back: torch.Tensor | None  # the packed position of each flat query row (q_index's inverse)
    cu_q: torch.Tensor  # int32 cumulative sequence lengths (the same tensor as cu_k for self-attention)
    cu_k: torch.Tensor


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.flatten().cumsum(0, dtype=torch.int32), (1, 0))


def _real_first(real: torch.Tensor) -> torch.Tensor:
    """(B * L,) int64: flat token indices of each row's real tokens in order, then its padding (a stable sort)."""
    B, L = real.shape
    order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)
    return (order + torch.arange(B, device=real.device)[:, None] * L).flatten()


def _assert_contiguous(real: torch.Tensor, why: str) -> None:
    """Every row's real tokens form one run (left or right padding, no holes); checked on the device, without a
    host read: a violation stops the run (a device-side assertion on CUDA) with this message."""
    L = real.shape[1]
    idx = torch.arange(L, device=real.device)
    n = real.sum(1)
    span = torch.where(real, idx, -1).amax(1) - torch.where(real, idx, L).amin(1) + 1
    torch._assert_async(((n == 0) | (span == n)).all(),
                        f"deltamatch_fp8: {why} needs each row's padding at its start or end, not between real tokens "
                        "(attention_mask has a hole); use attn_implementation='sdpa' for such masks.")


def _padding_layout(real: torch.Tensor, S: int, causal: bool, window: int | None) -> _Layout:
    """A 2D padding mask (B, KV) as two sequences per row: the real tokens, then the padding (its own sequence).
    Causal: the queries are the last S key positions (the real ones are the last real keys: bottom-right causal);
    otherwise (bidirectional, cross-attention) every query sees the row's real keys and the padding sequence has no
    queries."""
    B, KV = real.shape
    if window is not None:  # a window counts positions; packing the real tokens together would shorten it at a hole
        _assert_contiguous(real, "a sliding window over a padded batch")
    n_k = real.sum(1, dtype=torch.int32)
    k_index = _real_first(real)
    cu_k = _cu(torch.stack([n_k, KV - n_k], 1))
    if not causal:
        full = torch.full_like(n_k, S)
        return _Layout(None, k_index, None, _cu(torch.stack([full, full - S], 1)), cu_k)
    if S == KV:
        return _Layout(k_index, k_index, torch.argsort(k_index), cu_k, cu_k)
    real_q = real[:, KV - S:]
    n_q = real_q.sum(1, dtype=torch.int32)
    q_index = _real_first(real_q)
    return _Layout(q_index, k_index, torch.argsort(q_index), _cu(torch.stack([n_q, S - n_q], 1)), cu_k)


def _segment_layout(seg: torch.Tensor) -> _Layout:
    """Segment ids (B, N), -1 for padding (masks.py), as packed sequences in place: one per run of equal ids (a
    row's leading or trailing padding is a run of its own). cu_seqlens have B * N + 1 entries, the unused ones
    empty sequences at the end (the op drops them), so that their shape does not depend on the data."""
    B, N = seg.shape
    _assert_contiguous(seg >= 0, "packed documents or chunked attention with padding")
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    T = B * N
    pos = torch.arange(T, dtype=torch.int32, device=seg.device)
    starts = torch.sort(torch.where(start.flatten(), pos, T)).values
    cu = torch.cat([starts, starts.new_full((1,), T)])
    return _Layout(None, None, None, cu, cu)


def _layer_type(module) -> str | None:
    types = getattr(getattr(module, "config", None), "layer_types", None)
    idx = getattr(module, "layer_idx", None)
    return types[idx] if types is not None and idx is not None and idx < len(types) else None


def _by_documents(seg: torch.Tensor, cu: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """Segments (B, N) split further where flash-attention's cu_seq_lens start a document (over the B * N tokens,
    row after row). Chunked attention (chunk: its size) counts its chunks from each document's start, as transformers
    does for documents packed by position_ids (the mask's own chunks count from the row's start)."""
    B, N = seg.shape
    tokens = torch.arange(B * N, device=seg.device)
    cu = cu.to(device=seg.device, dtype=torch.int64)
    which = torch.searchsorted(cu, tokens, right=True) - 1
    doc = which.view(B, N)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | ((seg[:, 1:] < 0) != (seg[:, :-1] < 0))
    if chunk is None:
        start[:, 1:] |= seg[:, 1:] != seg[:, :-1]
    else:
        start |= ((tokens - cu[which.clamp(0, cu.numel() - 1)]) % chunk == 0).view(B, N)
    return torch.where(seg < 0, -1, start.cumsum(1, dtype=torch.int32) - 1)


_LAYOUTS = TensorCache(size=8)


def _layout(mask: torch.Tensor, S: int, KV: int, causal: bool, window: int | None) -> _Layout:
    def build():
        if mask.dtype == torch.bool:
            return _padding_layout(mask, S, causal, window)
        if not causal or S != KV:
            raise ValueError("deltamatch_fp8: segment masks (packed documents, chunks) are causal self-attention; got "
                             f"causal={causal}, {S} queries over {KV} keys.")
        return _segment_layout(mask)

    if torch.compiler.is_compiling():  # traced: computed in the graph (no Python-side cache)
        return build()
    return _LAYOUTS.get((mask,), build, key=(S, KV, causal, window))


def _pack(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """(B, H, L, D) -> (1, H, B * L, D): rows flattened in order, or taken in `index` order."""
    B, H, L, D = x.shape
    if index is None:
        return x if B == 1 else x.transpose(0, 1).reshape(1, H, B * L, D)
    return x.transpose(0, 1).reshape(H, B * L, D).index_select(1, index)[None]


def _unpack(out: torch.Tensor, back: torch.Tensor | None, B: int, S: int) -> torch.Tensor:
    """(1, H, B * S, Dv) packed -> (B, S, H, Dv), the layout transformers expects back."""
    rows = out[0] if back is None else out[0].index_select(1, back)
    return rows.transpose(0, 1).reshape(B, S, out.shape[1], out.shape[3])


# ----------------------------------------------------------------------------------------------------
# The attention function
# ----------------------------------------------------------------------------------------------------


def deltamatch_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: (B, H, S, D) in, (B, S, H, Dv) out, KV heads not repeated."""
    _check_unsupported(module, dropout, softcap, kwargs)
    if debug.enabled():  # HF_DELTAMATCH_CHECK_FINITE: its errors name the layer
        debug.set_layer(f"layer {getattr(module, 'layer_idx', '?')} ({type(module).__name__})")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if getattr(getattr(module, "config", None), "is_causal", True) is False and is_causal is None:
        causal = False  # a decoder-only model's bidirectional mode (its config's is_causal)
    in_dtype = query.dtype
    if in_dtype == torch.float32:
        dtype = _target_dtype(query, module)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if value.dtype != query.dtype or key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    # learnable attention sinks (gpt-oss and others pass them as s_aux): fp32 for the op, the cast differentiable
    sinks = kwargs.get("s_aux")
    sinks = sinks.float() if sinks is not None else None
    if sliding_window is not None and not causal:
        raise ValueError("deltamatch_fp8 supports sliding windows on causal attention only.")
    window = sliding_window
    B, H, S, _ = query.shape
    KV = key.shape[2]

    def attn(q, k, v, **kw):
        return deltamatch_attention(q, k, v, causal=causal, softmax_scale=scaling, window=window, sinks=sinks, **kw)

    mask = attention_mask
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2):
        raise ValueError(
            f"deltamatch_fp8 takes the masks of its registered mask function (2D), got "
            f"{type(mask).__name__ if not isinstance(mask, torch.Tensor) else f'a {mask.dim()}D mask'}. Custom 4D "
            "masks are not supported: use attn_implementation='sdpa'."
        )
    if mask is not None and mask.dtype == torch.bool and mask.shape[1] < KV:
        # a static cache: only the first mask-length slots hold keys, the rest are empty preallocated slots
        KV = mask.shape[1]
        key, value = key[:, :, :KV], value[:, :, :KV]
    # packed rows from DataCollatorWithFlattening & co.: cu_seq_lens over the batch's rows, one after another
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if (cu_q is None) != (cu_k is None):
        raise ValueError("deltamatch_fp8: pass both cu_seq_lens_q and cu_seq_lens_k, or neither.")
    if mask is None:
        if cu_q is None:
            return attn(query, key, value).transpose(1, 2).to(in_dtype), None
        out = attn(_pack(query, None), _pack(key, None), _pack(value, None), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        return _unpack(out, None, B, S).to(in_dtype), None
    if cu_q is not None:
        if mask.dtype == torch.bool:
            raise ValueError("deltamatch_fp8 got both a padding mask and flash-attention's cu_seq_lens_*: pass one "
                             "(packed rows need no padding).")
        if cu_q is not cu_k and (cu_q.shape != cu_k.shape or S != KV):
            raise ValueError("deltamatch_fp8: cu_seq_lens_q and cu_seq_lens_k must describe the same documents here "
                             "(self-attention over packed rows).")
        chunk = getattr(module.config, "attention_chunk_size", None) if _layer_type(module) == "chunked_attention" \
            else None
        mask = _by_documents(mask, cu_q, chunk)
    lay = _layout(mask, S, KV, causal, window)
    out = attn(_pack(query, lay.q_index), _pack(key, lay.k_index), _pack(value, lay.k_index),
               cu_seqlens_q=lay.cu_q, cu_seqlens_k=lay.cu_k)
    return _unpack(out, lay.q_back, B, S).to(in_dtype), None


def register() -> None:
    """Register the attention and mask functions under `deltamatch_fp8` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, deltamatch_attention_forward)
    AttentionMaskInterface.register(NAME, deltamatch_mask)
