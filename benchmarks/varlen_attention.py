"""The packed-batch baseline of the training benchmarks: FlashAttention-2's varlen kernel as torch ships it
(`torch.nn.attention.varlen.varlen_attn`, CUDA, torch >= 2.10), registered for transformers as "torch_varlen".

transformers' `sdpa` has no varlen path: on a packed row (several documents, position_ids restarting) it builds a
block-causal mask and runs a masked kernel over the whole row, which is not what a packed-training user runs. The
`flash_attention_2` implementation needs the flash-attn package. This one takes the packed row's `cu_seq_lens_q/k`
(DataCollatorWithFlattening's kwargs, the recipes' PackedCollator) or cuts the row at its position_ids restarts, and
calls varlen_attn once for the row: the fair baseline for `deltamatch_fp8` on the recipes' input.

Sliding windows are FlashAttention-2's own (`window_size`). Learnable attention sinks (gpt-oss's `s_aux`, which
transformers runs without sdpa) are exact too, through the kernel's log-sum-exp (`SinkAttention`): with sink s_h, the
output is out * w, w = sigmoid(lse - s_h), and the backward is FlashAttention-2's own, given w * dY as the output
gradient and Y = w * out as the output (its rowsum(dO * O) term then carries the LSE's gradient exactly).

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


def packed_cu_seqlens(position_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor | None:
    """int32 cu_seqlens of one row holding several documents whose position_ids restart at 0, else None (one
    document, possibly a chunk continuing at a later position)."""
    if position_ids is None or batch != 1 or length == 1 or position_ids.shape[-1] != length:
        return None
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten()
    if len(starts) == 0 or (len(starts) == 1 and int(starts[0]) == 0):
        return None
    if int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    return torch.cat([starts, starts.new_tensor([length])]).to(torch.int32)


class FlashKernels:
    """FlashAttention-2 varlen forward and backward as ATen ops (what torch.nn.attention.varlen calls), with the
    softmax log-sum-exp the sinks need. Positions 2 and 3 of the forward's outputs (the RNG state and its companion,
    named differently across torch versions) go back to the backward as they came. A left window runs as
    torch.nn.attention.varlen runs it: not causal, window (W - 1, 0)."""

    def __init__(self, cu: torch.Tensor, longest: int, causal: bool, scale: float | None, window: tuple[int, int]):
        self.cu, self.longest, self.scale, self.window = cu, longest, scale, window
        self.causal = causal and window[0] < 0

    def forward(self, q, k, v):
        res = torch.ops.aten._flash_attention_forward(
            q, k, v, self.cu, self.cu, self.longest, self.longest, 0.0, self.causal, False, scale=self.scale,
            window_size_left=self.window[0], window_size_right=self.window[1])
        return res[0], res[1], (res[2], res[3])  # out (T, Hq, D); lse (Hq, T) fp32

    def backward(self, grad, q, k, v, out, lse, state):
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, self.cu, self.cu, self.longest, self.longest, 0.0, self.causal, state[0],
            state[1], scale=self.scale, window_size_left=self.window[0], window_size_right=self.window[1])


class SinkAttention(torch.autograd.Function):
    """Attention with one learnable sink logit per query head, from a kernel pair (`kernels(cu, longest, causal,
    scale, window)`, FlashKernels' interface) that returns the log-sum-exp and computes the backward FlashAttention's
    way (dS = P * (dO V^T - rowsum(dO * O))).

    Y = w * out with w = sigmoid(lse - s): the sink joins each row's softmax denominator with no value. Its
    gradient: d out = w * dY, d lse = rowsum(dY * out) * w (1 - w), d s = -sum over rows of the same. The LSE's
    gradient adds d lse * P to dS, so dS = P * (w dY V^T - w rowsum(dY * out) + w (1 - w) rowsum(dY * out))
    = P * (w dY V^T - rowsum(w dY * Y)): the kernel's backward with grad w * dY and output Y. q, k, v: (T, H, D);
    sinks: (Hq,); cu: int32 cu_seqlens; the rest constants (a traced graph keeps them)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, longest, causal, scale, window, kernels=FlashKernels):
        out, lse, state = kernels(cu, longest, causal, scale, window).forward(q, k, v)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"{NAME}: the kernel's log-sum-exp has shape {tuple(lse.shape)}, not (heads, tokens) "
                               f"{(q.shape[1], q.shape[0])}: this torch's FlashAttention-2 lays it out otherwise")
        acc = torch.promote_types(out.dtype, torch.float32)
        w = torch.sigmoid(lse.to(acc) - sinks.to(acc)[:, None]).transpose(0, 1)[..., None]  # (T, Hq, 1)
        y = (out.to(acc) * w).to(out.dtype)
        ctx.save_for_backward(q, k, v, y, lse, w, cu, *state)
        ctx.params, ctx.kernels, ctx.sinks_dtype = (longest, causal, scale, window), kernels, sinks.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        q, k, v, y, lse, w, cu, *state = ctx.saved_tensors
        g = grad.to(w.dtype)
        d_sinks = -((g * y.to(w.dtype)).sum(-1, keepdim=True) * (1 - w)).sum((0, 2))
        dq, dk, dv = ctx.kernels(cu, *ctx.params).backward((g * w).to(grad.dtype), q, k, v, y, lse, state)
        return dq, dk, dv, d_sinks.to(ctx.sinks_dtype), None, None, None, None, None, None


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                             sliding_window=None, softcap=None, **kwargs):
    """transformers' attention-function signature: query (B, Hq, S, D), key/value (B, Hkv, S, D); returns
    (out (B, S, Hq, Dv), None)."""
    if dropout and module.training:
        raise ValueError(f"{NAME} has no attention dropout (got {dropout}); set the model's attention_dropout to 0.")
    if softcap is not None:
        raise ValueError(f"{NAME} does not support logit soft-capping.")
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
        cu = packed_cu_seqlens(kwargs.get("position_ids"), B, S)
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
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # FlashAttention-2 takes GQA as it is
        out = SinkAttention.apply(q, k, v, sinks, cu, int(longest), causal, scaling, window)
        return out.reshape(B, S, Hq, out.shape[-1]), None
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
