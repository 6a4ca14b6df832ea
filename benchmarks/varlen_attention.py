"""The packed-batch baseline of the training benchmarks: FlashAttention-2's varlen kernel as torch ships it
(`torch.nn.attention.varlen.varlen_attn`, CUDA, torch >= 2.10), registered for transformers as "torch_varlen".

transformers' `sdpa` has no varlen path: on a packed row (several documents, position_ids restarting) it builds a
block-causal mask and runs a masked kernel over the whole row, which is not what a packed-training user runs. The
`flash_attention_2` implementation needs the flash-attn package. This one takes the packed row's `cu_seq_lens_q/k`
(DataCollatorWithFlattening's kwargs, the recipes' PackedCollator) or cuts the row at its position_ids restarts, and
calls varlen_attn once for the row: the fair baseline for `deltamatch_fp8` on the recipes' input.

    import varlen_attention; varlen_attention.register()    # then attn_implementation="torch_varlen"
"""

from __future__ import annotations

import inspect

import torch

NAME = "torch_varlen"


def _varlen_attn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        raise RuntimeError(f"attn_implementation={NAME!r} needs torch.nn.attention.varlen (torch >= 2.10): {e}") from e
    return varlen_attn


def _half_dtype(module, query) -> torch.dtype:
    """The 16-bit dtype FlashAttention-2 runs in: the query's; for fp32 inputs (the model's rotary embedding or
    norms upcast under autocast) autocast's dtype, else the module's 16-bit weights' (transformers' flash-attention
    integration does the same)."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    weight = next((p for p in module.parameters() if p.dtype in (torch.float16, torch.bfloat16)), None)
    if weight is None:
        raise ValueError(f"{NAME} runs FlashAttention-2, which takes fp16 or bf16: got {query.dtype} inputs outside "
                         "autocast and no 16-bit weights; run under torch.autocast(dtype=torch.bfloat16) or cast the "
                         "model to bf16.")
    return weight.dtype


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: query (B, Hq, S, D), key/value (B, Hkv, S, D); returns
    (out (B, S, Hq, Dv), None)."""
    from hf_deltamatch.integrations.transformers import _packed_from_position_ids

    if dropout and module.training:
        raise ValueError(f"{NAME} has no attention dropout (got {dropout}); set the model's attention_dropout to 0.")
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise ValueError(f"{NAME} supports neither logit soft-capping nor attention sinks.")
    if attention_mask is not None:
        raise ValueError(f"{NAME} takes packed rows or unpadded batches, not a padding mask: pack the batch "
                         "(DataCollatorWithFlattening) or use attn_implementation='sdpa'.")
    if query.device.type != "cuda":
        raise ValueError(f"{NAME} runs FlashAttention-2 through torch, which needs a CUDA device (got "
                         f"{query.device.type}).")
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    if key.shape[2] != S:
        raise ValueError(f"{NAME} is self-attention over one packed row (got {S} queries and {key.shape[2]} keys).")
    cu, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if cu is None:
        cu = _packed_from_position_ids(kwargs.get("position_ids"), B, S)
        longest = None
    if cu is None:  # B whole sequences
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=query.device)
        longest = S
    cu = cu.to(device=query.device, dtype=torch.int32)
    if longest is None:
        longest = int((cu[1:] - cu[:-1]).max())
    causal = bool(getattr(module, "is_causal", True))
    window = (sliding_window - 1 if sliding_window else -1, 0) if causal else (-1, -1)
    dtype = _half_dtype(module, query)
    flat = lambda x: x.transpose(1, 2).reshape(B * S, x.shape[1], x.shape[3]).to(dtype)  # noqa: E731  (B*S, H, D)
    q, k, v = flat(query), flat(key), flat(value)
    attn = _varlen_attn()
    gqa = {}
    if Hq != Hkv:
        if "enable_gqa" in inspect.signature(attn).parameters:
            gqa = {"enable_gqa": True}
        else:
            k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    out = attn(q, k, v, cu, cu, int(longest), int(longest), scale=scaling, window_size=window, **gqa)
    return out.reshape(B, S, Hq, out.shape[-1]), None


def register() -> None:
    """Registers the attention function, and flash-attention's mask function (no 4D mask is built)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
