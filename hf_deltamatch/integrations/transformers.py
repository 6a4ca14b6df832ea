"""`attn_implementation="deltamatch_fp8"` for transformers models.

Registers an attention function and, under the same name, a mask function: transformers builds the mask
through the function registered for the model's attention implementation, and without one it would drop
padding masks silently. The mask function is transformers' flash-attention one (a 2D padding mask, or
None when nothing is padded), because the op, like flash-attention, takes padding as varlen sequences; plus
one case transformers only handles for names containing "flash": with a static cache, `generate()` drops an
all-ones mask, and the key/value tensors are the whole preallocated cache. Our mask function then returns a
mask as long as the filled part, and the attention function reads only those keys (as `_upad_input` does).
"""

from __future__ import annotations

import torch

from .. import debug
from ..attention import deltamatch_attention

NAME = "deltamatch_fp8"


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


def _cu_seqlens(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _packed_from_position_ids(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens when one row holds several documents whose position_ids restart at 0, else None."""
    if position_ids is None or batch != 1 or length == 1 or position_ids.shape[-1] != length:
        return None
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten()
    if len(starts) == 0 or (len(starts) == 1 and starts[0] == 0):
        return None  # one document (possibly a chunk continuing at a later position)
    if starts[0] != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    bounds = torch.cat([starts, starts.new_tensor([length])])
    return bounds.to(torch.int32)


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
    in_dtype = query.dtype
    if in_dtype == torch.float32:
        dtype = _target_dtype(query, module)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if value.dtype != query.dtype or key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    # learnable attention sinks (gpt-oss and others pass them as s_aux): fp32 for the op, the cast differentiable
    sinks = kwargs.get("s_aux")
    sinks = sinks.float() if sinks is not None else None
    window = sliding_window if causal and sliding_window is not None else None
    if sliding_window is not None and not causal:
        raise ValueError("deltamatch_fp8 supports sliding windows on causal attention only.")
    B, H, S, _ = query.shape
    kv_len = key.shape[2]
    attn = lambda q, k, v, **kw: deltamatch_attention(q, k, v, causal=causal, softmax_scale=scaling,  # noqa: E731
                                                      window=window, sinks=sinks, **kw)

    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"deltamatch_fp8 takes a 2D padding mask (from its registered mask function), got a "
            f"{attention_mask.dim()}D mask. Custom 4D masks are not supported: use attn_implementation='sdpa'."
        )
    if attention_mask is not None and attention_mask.shape[1] < kv_len:
        # Static cache: only the first mask-length slots hold keys, the rest are empty preallocated slots.
        kv_len = attention_mask.shape[1]
        key, value = key[:, :, :kv_len], value[:, :, :kv_len]

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:  # packed batch from DataCollatorWithFlattening & co.
        flat = lambda x: x.transpose(0, 1).reshape(1, x.shape[1], -1, x.shape[-1]) if x.shape[0] > 1 else x  # noqa
        out = attn(flat(query), flat(key), flat(value), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        out = out.reshape(out.shape[1], B, S, -1).transpose(0, 1) if B > 1 else out
    elif attention_mask is not None:  # padding: unpad into varlen sequences, scatter back
        key_mask = attention_mask[:, -kv_len:].bool()
        query_mask = key_mask[:, -S:]
        q_idx, k_idx = query_mask.flatten().nonzero().flatten(), key_mask.flatten().nonzero().flatten()
        gather = lambda x, idx: x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])[idx].transpose(0, 1)[None]  # noqa
        out_packed = attn(gather(query, q_idx), gather(key, k_idx), gather(value, k_idx),
                          cu_seqlens_q=_cu_seqlens(query_mask.sum(1)), cu_seqlens_k=_cu_seqlens(key_mask.sum(1)))
        out = out_packed.new_zeros(B * S, H, value.shape[-1])
        out[q_idx] = out_packed[0].transpose(0, 1)
        return out.reshape(B, S, H, -1).to(in_dtype), None
    else:
        cu = _packed_from_position_ids(kwargs.get("position_ids"), B, S) if S == kv_len else None
        if cu is not None:
            out = attn(query, key, value, cu_seqlens_q=cu, cu_seqlens_k=cu)
        else:
            out = attn(query, key, value)
    return out.transpose(1, 2).to(in_dtype), None


def deltamatch_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers mask function: flash-attention's 2D padding mask (None without padding), and for causal
    masks over a static cache, whose key tensors are longer than what has been written, an all-True mask of
    the written length (the keys past the last query are empty, and causally invisible anyway)."""
    from transformers.masking_utils import flash_attention_mask

    mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                **kwargs)
    if mask is None and "allow_is_bidirectional_skip" not in kwargs:  # only bidirectional masks pass this kwarg
        written = int(q_offset) + q_length - int(kv_offset)
        if written < kv_length:
            mask = torch.ones(batch_size, written, dtype=torch.bool, device=kwargs.get("device"))
    return mask


def register() -> None:
    """Register the attention and mask functions under `deltamatch_fp8` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, deltamatch_attention_forward)
    AttentionMaskInterface.register(NAME, deltamatch_mask)
