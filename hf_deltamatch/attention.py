"""`deltamatch_attention`: the one public op. Validation, backend dispatch, autograd, torch.compile support.

Under `torch.compile` the op is a `torch.library` custom op with a registered autograd formula, so the compiler
traces it as one node (no graph break). Eager calls take a plain `torch.autograd.Function` around the same
forward and backward, without the custom op's Python dispatch and zero-filled gradients: host time that a training
step pays per layer (docs/kernels.md, "Host time").
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from typing import Optional

import torch

from . import _varlen, debug, outliers, reference
from .config import DeltaMatchConfig

_default_config = DeltaMatchConfig()
_MAX_HEAD_DIM = 256


def set_default_config(config: DeltaMatchConfig) -> None:
    """The config used when a call passes none (e.g. from transformers models)."""
    global _default_config
    if not isinstance(config, DeltaMatchConfig):
        raise TypeError(f"expected a DeltaMatchConfig, got {type(config).__name__}")
    _default_config = config


def get_default_config() -> DeltaMatchConfig:
    return _default_config


def _triton_usable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(config: DeltaMatchConfig, device: torch.device) -> str:
    """'triton' or 'reference' for this call (config.backend after env overrides)."""
    if config.backend == "reference":
        return "reference"
    if config.backend == "triton":
        if not _triton_usable():
            raise RuntimeError("backend='triton' needs the `triton` package: pip install 'hf-deltamatch[triton]'.")
        if device.type != "cuda":
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    f"backend='triton' on a {device.type} tensor needs TRITON_INTERPRET=1 (set before importing "
                    "hf_deltamatch) to run the kernels in Triton's interpreter; or use backend='reference'."
                )
        return "triton"
    return "triton" if device.type == "cuda" and _triton_usable() else "reference"


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _backend_module(name: str):
    if name == "triton":
        from . import kernels

        return kernels
    return reference


def _check_inputs(q, k, v, causal, window, cu_seqlens_q, cu_seqlens_k):
    """Shapes, dtypes, devices and arguments: nothing that reads a tensor's values, so that torch.compile traces it.
    The values of cu_seqlens are checked where they are read, once per tensor (_varlen)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, tokens, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}. For packed sequences use batch 1 with cu_seqlens_q/cu_seqlens_k."
        )
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(
            f"deltamatch_attention takes bf16 or fp16 inputs, got {q.dtype}; cast q/k/v (e.g. .to(torch.bfloat16)) "
            "or run the model under torch.autocast."
        )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}.")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device.")
    B, Hq, N, Dqk = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not match q {tuple(q.shape)}.")
    if k.shape[3] != Dqk:
        raise ValueError(f"q and k head dims differ ({Dqk} vs {k.shape[3]}).")
    if Hq % k.shape[1] != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({k.shape[1]}) for GQA/MQA.")
    for name, d in (("q/k", Dqk), ("v", v.shape[3])):
        if d % 16 != 0 or d > _MAX_HEAD_DIM:
            raise ValueError(
                f"{name} head dim {d} is not supported: FP8 tensor cores need a multiple of 16 up to "
                f"{_MAX_HEAD_DIM}. Use attn_implementation='sdpa' (or 'eager') for this model."
            )
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be a whole number of keys (an int), got {window!r}.")
        if not causal:
            raise ValueError("window (sliding-window attention) is supported with causal=True only.")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys a query sees, itself included); got {window}.")
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither.")
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be 1 (sequences concatenated on the token axis); "
                             f"got {B}.")
        _varlen.check_static(cu_seqlens_q, cu_seqlens_k, q.device)


def _as_cu_seqlens(cu, device):
    """cu_seqlens given as a list or tuple of ints: the int32 tensor the op takes."""
    if isinstance(cu, (list, tuple)):
        if not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in cu):
            raise TypeError(f"cu_seqlens must hold whole numbers, got {list(cu)[:8]}.")
        return torch.tensor(cu, dtype=torch.int32, device=device)
    return cu


def _check_sinks(sinks, q):
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor of shape ({q.shape[1]},) (one logit per query head), "
                        f"got {type(sinks).__name__}.")
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape ({q.shape[1]},) (one logit per query head), got "
                         f"{tuple(sinks.shape)}.")
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be float32 (the softmax runs in fp32), got {sinks.dtype}: pass sinks.float() "
                        "(differentiable, the gradient reaches the original parameter).")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}; move them to q's device.")


# ----------------------------------------------------------------------------------------------------
# The custom op: forward and backward as opaque nodes, autograd registered between them
# ----------------------------------------------------------------------------------------------------


_CONFIG_ARGS = ("precision", "delta", "block", "scale_rounding", "grad_format", "backend", "deterministic")


def _config_from_args(precision, delta, block, scale_rounding, grad_format, backend, deterministic):
    return DeltaMatchConfig(precision=precision, delta=delta, block=block, scale_rounding=scale_rounding,
                            grad_format=grad_format, backend=backend, deterministic=deterministic)


@torch.library.custom_op("hf_deltamatch::attention_forward", mutates_args=())
def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
    window: Optional[int], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    precision: str, delta: str, block: int, scale_rounding: str, grad_format: str, backend: str,
    deterministic: bool, sinks: Optional[torch.Tensor] = None, r_q: Optional[torch.Tensor] = None,
    r_k: Optional[torch.Tensor] = None, k_means: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    return _forward_impl(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, precision, delta, block,
                         scale_rounding, grad_format, backend, deterministic, sinks, r_q, r_k, k_means)


def _forward_impl(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, precision, delta, block,
                  scale_rounding, grad_format, backend, deterministic, sinks=None, r_q=None, r_k=None, k_means=None):
    """r_q, r_k, k_means: outliers.fused_args' transforms, which the fp8 Triton forward applies to q and k itself."""
    config = _config_from_args(precision, delta, block, scale_rounding, grad_format, backend, deterministic)
    fused = {"qk_transform": (r_q, r_k, k_means)} if _fused(r_q, r_k, k_means) else {}
    vl = _read_varlen(q, k, cu_seqlens_q, cu_seqlens_k)
    out, lse, *saved = _backend_module(backend).forward(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, config=config, **_cu_args(vl), **fused)
    if sinks is not None:  # after the kernels: out and LSE of the softmax with the sink (docs/numerics.md)
        out, lse = reference.apply_sinks(out, lse, sinks)
    return (out, lse, *saved)


def _read_varlen(q, k, cu_seqlens_q, cu_seqlens_k):
    """The checked sequences of a packed batch (_varlen: its values read once per pair of tensors), else None.
    Here, inside the op, so that torch.compile never traces a read of cu_seqlens."""
    if cu_seqlens_q is None:
        return None
    return _varlen.varlen(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2])


def _cu_args(vl):
    if vl is None:
        return dict(cu_seqlens_q=None, cu_seqlens_k=None, varlen=None)
    return dict(cu_seqlens_q=vl.cu_q, cu_seqlens_k=vl.cu_k, varlen=vl)


def _fused(*transforms) -> bool:
    return any(t is not None and t is not False for t in transforms)


@_attention_forward.register_fake
def _(q, k, v, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, precision, delta, block,
      scale_rounding, grad_format, backend, deterministic, sinks=None, r_q=None, r_k=None, k_means=None):
    B, Hq, N, _ = q.shape
    out = q.new_empty(B, Hq, N, v.shape[-1])
    lse = q.new_empty(B, Hq, N, dtype=torch.float32)
    if precision == "fp8":
        f8 = torch.float8_e4m3fn
        saved = (q.new_empty(q.shape, dtype=f8), k.new_empty(k.shape, dtype=f8), v.new_empty(v.shape, dtype=f8),
                 q.new_empty(q.shape[:-1], dtype=torch.float32), k.new_empty(k.shape[:-1], dtype=torch.float32),
                 v.new_empty(v.shape[:-1], dtype=torch.float32))
    else:
        empty8, empty32 = q.new_empty(0, dtype=torch.float8_e4m3fn), q.new_empty(0, dtype=torch.float32)
        saved = (empty8, empty8.clone(), empty8.clone(), empty32, empty32.clone(), empty32.clone())
    return (out, lse, *saved)


@torch.library.custom_op("hf_deltamatch::attention_backward", mutates_args=())
def _attention_backward(
    do: torch.Tensor, q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: Optional[torch.Tensor],
    out: Optional[torch.Tensor], lse: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
    q_scale: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, causal: bool, softmax_scale: float,
    window: Optional[int], cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor],
    precision: str, delta: str, block: int, scale_rounding: str, grad_format: str, backend: str,
    deterministic: bool, sinks: Optional[torch.Tensor] = None, r_q: Optional[torch.Tensor] = None,
    r_k: Optional[torch.Tensor] = None, smooth_k: bool = False, dlse: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward_impl(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, causal, softmax_scale, window,
                          cu_seqlens_q, cu_seqlens_k, precision, delta, block, scale_rounding, grad_format, backend,
                          deterministic, sinks, r_q, r_k, smooth_k, dlse)


def _backward_impl(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, causal, softmax_scale, window,
                   cu_seqlens_q, cu_seqlens_k, precision, delta, block, scale_rounding, grad_format, backend,
                   deterministic, sinks=None, r_q=None, r_k=None, smooth_k=False, dlse=None):
    """(dq, dk, dv, d sinks): with sinks, lse (and out) are the sink-aware ones the forward returned, and d sinks
    comes from the delta the backend formed dS with; without, d sinks is empty. r_q, r_k, smooth_k: the transforms
    the forward fused, whose backward maps the op's dq', dk' to dq, dk (kernels/transform.py). dlse: the gradient
    of the returned LSE, which the backend folds into dS (docs/numerics.md, "The LSE's gradient")."""
    config = _config_from_args(precision, delta, block, scale_rounding, grad_format, backend, deterministic)
    qs, ks = (q8, k8) if precision == "fp8" else (q, k)
    vl = _read_varlen(qs, ks, cu_seqlens_q, cu_seqlens_k)
    extra = {} if dlse is None else {"dlse": dlse}
    grads = _backend_module(backend).backward(
        do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, causal=causal, softmax_scale=softmax_scale,
        window=window, config=config, return_delta=sinks is not None, **_cu_args(vl), **extra)
    if _fused(r_q, r_k, smooth_k):
        from .kernels.transform import transform_grads

        grads = (*transform_grads(grads[0], grads[1], r_q, r_k, smooth_k, cu_seqlens_k), *grads[2:])
    if sinks is None:
        return (*grads, lse.new_empty(0))
    dq, dk, dv, delta_rows = grads
    return dq, dk, dv, reference.sinks_grad(lse, delta_rows, sinks)


@_attention_backward.register_fake
def _(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, causal, softmax_scale, window,
      cu_seqlens_q, cu_seqlens_k, precision, delta, block, scale_rounding, grad_format, backend, deterministic,
      sinks=None, r_q=None, r_k=None, smooth_k=False, dlse=None):
    qs, ks, vs = (q8, k8, v8) if precision == "fp8" else (q, k, v)
    dsinks = lse.new_empty(0) if sinks is None else sinks.new_empty(sinks.shape)
    return (do.new_empty(qs.shape), do.new_empty(ks.shape), do.new_empty(vs.shape), dsinks)


_NON_TENSOR_ARGS = ("causal", "softmax_scale", "window", "cu_seqlens_q", "cu_seqlens_k", "precision", "delta",
                    "block", "scale_rounding", "grad_format", "backend", "deterministic")


def _setup_context(ctx, inputs, output):
    q, k, v, *rest = inputs
    ctx.args = dict(zip(_NON_TENSOR_ARGS, rest))
    ctx.n_inputs = len(inputs)  # sinks (last) may be left out of a custom op call
    at = 3 + len(_NON_TENSOR_ARGS)
    sinks = inputs[at] if len(inputs) > at else None
    ctx.sinks_grad = sinks is not None and ctx.needs_input_grad[at]  # needs the backward's delta
    r_q, r_k, k_means = (tuple(inputs[at + 1:at + 4]) + (None,) * 3)[:3]  # the fused transforms, if any
    ctx.smooth_k = k_means is not None
    ctx.out_shape, ctx.out_dtype = tuple(q.shape[:3]) + (v.shape[3],), q.dtype
    out, lse, q8, k8, v8, sq, sk, sv = output
    # out and lse carry gradients (lse's folds into dS); the saved operands do not
    ctx.mark_non_differentiable(q8, k8, v8, sq, sk, sv)
    # no zero-filled gradients for the outputs without one (a fill kernel each per backward)
    ctx.set_materialize_grads(False)
    fp8 = ctx.args["precision"] == "fp8"
    stale = ctx.args["delta"] == "stale"
    # fp8 mode keeps only the quantized operands (half the bytes of bf16 q/k/v); O only for stale delta.
    ctx.save_for_backward(None if fp8 else q, None if fp8 else k, None if fp8 else v, out if stale else None,
                          lse, q8, k8, v8, sq, sk, sv, sinks if ctx.sinks_grad else None, r_q, r_k)
    ctx.check_call = debug.describe_call(
        q, k, v, causal=ctx.args["causal"], window=ctx.args["window"], cu_seqlens_q=ctx.args["cu_seqlens_q"],
        config=_config_from_args(**{a: ctx.args[a] for a in _CONFIG_ARGS})) if debug.enabled() else None


def _backward(ctx, grad_out, grad_lse=None, *_unused_grads, backward_op=_attention_backward):
    if grad_out is None and grad_lse is None:  # neither out nor lse took part in the loss
        return (None,) * ctx.n_inputs
    q, k, v, out, lse, q8, k8, v8, sq, sk, sv, sinks, r_q, r_k = ctx.saved_tensors
    a = ctx.args
    backend = a["backend"]
    if grad_lse is not None and backend == "triton":
        # the kernels form delta inside the dQ kernel; the reference backward takes the same saved operands
        _warn_once("deltamatch_fp8: a gradient through the returned LSE is computed by the PyTorch reference "
                   "backward (same numerics, slower than the Triton kernels).")
        backend = "reference"
    do = grad_out.contiguous() if grad_out is not None else lse.new_zeros(ctx.out_shape, dtype=ctx.out_dtype)
    with torch.no_grad():  # the backward is not differentiable again (see _no_second_derivative)
        dq, dk, dv, dsinks = backward_op(
            do, q, k, v, out, lse, q8, k8, v8, sq, sk, sv, a["causal"], a["softmax_scale"],
            a["window"], a["cu_seqlens_q"], a["cu_seqlens_k"], a["precision"], a["delta"], a["block"],
            a["scale_rounding"], a["grad_format"], backend, a["deterministic"], sinks, r_q, r_k, ctx.smooth_k,
            None if grad_lse is None else grad_lse.float().contiguous())
    if getattr(ctx, "check_call", None) is not None:
        debug.check(ctx.check_call, "backward", {"dq": dq, "dk": dk, "dv": dv}, do)
    grads = (dq, dk, dv, dsinks if ctx.sinks_grad else None)
    if torch.is_grad_enabled():  # backward(create_graph=True)
        grads = _no_second_derivative(grads)
    return (grads[:3] + (None,) * len(_NON_TENSOR_ARGS) + grads[3:] + (None,) * 3)[:ctx.n_inputs]


_SECOND_DERIVATIVE = (b"deltamatch_attention has no second derivative: its backward (FP8 quantization, Delta-Matching) "
                      b"is not differentiable again. Keep attention out of the double backward (e.g. detach its "
                      b"output where create_graph=True is needed), or use attn_implementation='eager'.")


def _no_second_derivative(grads):
    """The gradients as outputs of a node that raises when differentiated (backward(create_graph=True), then a
    gradient of them): a clear error instead of the autograd graph of the backward's own ops."""
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    err = torch._C._functions.DelayedError(_SECOND_DERIVATIVE, len(present))
    flagged = iter(err(*[g.detach().requires_grad_() for g in present]))
    return tuple(None if g is None else next(flagged) for g in grads)


torch.library.register_autograd("hf_deltamatch::attention_forward", _backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom op's forward, setup and backward without torch.library's dispatch (eager calls). Its forward takes
    ctx itself: with a separate setup_context, Function.apply binds the forward's signature through inspect on every
    call, host time that a training step pays per layer."""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        output = _forward_impl(q, k, v, *args)
        _setup_context(ctx, (q, k, v, *args), output)
        return output

    @staticmethod
    def backward(ctx, grad_out, grad_lse, *unused):
        return _backward(ctx, grad_out, grad_lse, *unused, backward_op=_backward_impl)


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def deltamatch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    window: int | None = None,
    config: DeltaMatchConfig | None = None,
    return_lse: bool = False,
    sinks: torch.Tensor | None = None,
):
    """FP8 attention with Delta-Matching backward (docs/numerics.md is the exact contract).

    q (B, Hq, N, Dqk), k (B, Hkv, M, Dqk), v (B, Hkv, M, Dv) in bf16/fp16; returns (B, Hq, N, Dv) in the
    input dtype (and the fp32 log-sum-exp (B, Hq, N) if `return_lse`). GQA/MQA: Hq a multiple of Hkv.
    causal:        bottom-right aligned when N < M (as flash-attention).
    cu_seqlens_*:  packed sequences (B must be 1): int32 cumulative lengths (a tensor on q's device, or a list),
                   from 0 to the number of tokens; sequences never see each other; empty sequences are allowed.
    max_seqlen_*:  accepted for flash-attention compatibility and not used (computed from cu_seqlens).
    window:        sliding window with causal: each query sees its `window` most recent keys, itself included.
    config:        DeltaMatchConfig (default: `set_default_config`'s, then HF_DELTAMATCH_* env overrides).
    sinks:         learnable attention sinks (gpt-oss `s_aux`): fp32 (Hq,), one logit per query head, in the units
                   of softmax_scale * q.k, joining every softmax denominator with no value row; differentiable.
                   The returned LSE then includes the sink.
    return_lse:    also return the LSE; a gradient through it is folded into dS (docs/numerics.md).
    """
    compiling = torch.compiler.is_compiling()
    if not compiling and torch._C._are_functorch_transforms_active():
        raise NotImplementedError("deltamatch_attention does not run under torch.func transforms (grad, vjp, vmap): "
                                  "its backward is a custom kernel pass. Use torch.autograd (loss.backward(), "
                                  "torch.autograd.grad) instead.")
    config = (config or _default_config).with_env_overrides()
    cu_seqlens_q, cu_seqlens_k = _as_cu_seqlens(cu_seqlens_q, q.device), _as_cu_seqlens(cu_seqlens_k, q.device)
    _check_inputs(q, k, v, causal, window, cu_seqlens_q, cu_seqlens_k)
    if sinks is not None:
        _check_sinks(sinks, q)
    if softmax_scale is None:
        d = q.shape[-1]  # a SymInt under torch.compile's dynamic shapes: no math.sqrt, no check (positive)
        softmax_scale = 1.0 / math.sqrt(d) if isinstance(d, int) else 1.0 / d ** 0.5
    elif isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}.")
    elif not (math.isfinite(softmax_scale) and softmax_scale > 0):
        # the kernels take the row max on unscaled scores (max(qk) * scale == max(qk * scale) needs scale > 0)
        raise ValueError(f"softmax_scale must be a finite number > 0 (got {softmax_scale}); scale q instead.")
    backend = resolve_backend(config, q.device)
    if backend == "triton":
        from . import kernels

        reason = kernels.supports(q, k, v, window, config)
        if reason is not None:
            if config.backend == "triton":
                raise ValueError(f"the Triton kernels do not support this input: {reason}. "
                                 "Use DeltaMatchConfig(backend='reference') or HF_DELTAMATCH_BACKEND=reference.")
            # Same contract, same result, only slower: say so once rather than fail a training run.
            _warn_once(f"deltamatch_fp8: Triton kernels do not support this input ({reason}); using the PyTorch "
                       "reference backend (same numerics, slower).")
            backend = "reference"
    key_means = None
    q_in, k_in = q, k
    qk = ()
    if config.smooth_k and sinks is not None:
        # smoothing lowers query i's scores by softmax_scale * q_i . mean(k), a sink's logit would need the same
        raise ValueError("smooth_k=True is not supported with attention sinks (the sink logit would have to move "
                         "with each query's scores); use qk_rotation='hadamard' alone, or smooth_k=False.")
    if config.qk_rotation != "none" or config.smooth_k:  # exact pre-transforms against outlier channels
        if backend == "triton" and config.precision == "fp8":  # applied by the quantization pass (kernels/transform.py)
            *qk, key_means = outliers.fused_args(q, k, config.qk_rotation, config.smooth_k, cu_seqlens_k)
        else:
            q, k, key_means = outliers.transform_qk(q, k, config.qk_rotation, config.smooth_k, cu_seqlens_k)
    # torch.compile traces the custom op; eager calls take the same code without its dispatch (module docstring)
    op = _attention_forward if compiling else _EagerAttention.apply
    out, lse, *_ = op(
        q, k, v, bool(causal), float(softmax_scale), window, cu_seqlens_q, cu_seqlens_k, config.precision,
        config.delta, config.block, config.scale_rounding, config.grad_format, backend, config.deterministic, sinks,
        *qk)
    if debug.enabled():
        call = debug.describe_call(q_in, k_in, v, causal=causal, window=window, cu_seqlens_q=cu_seqlens_q,
                                   config=config)
        debug.check(call, "forward", {"out": out})
    if return_lse and key_means is not None:  # smoothing lowered every score of query i by the same amount
        q_op = outliers.rotate_queries(q, qk[0]) if qk else q  # the q' the op's scores came from
        lse = lse + outliers.lse_shift(q_op, key_means, softmax_scale, cu_seqlens_q)
        if lse.requires_grad:
            lse.register_hook(_no_lse_grad_with_smoothing)
    return (out, lse) if return_lse else out


def _no_lse_grad_with_smoothing(grad):
    raise RuntimeError("a gradient through the LSE of deltamatch_attention(return_lse=True) is not supported with "
                       "smooth_k=True (the LSE's shift by the key means is added outside the op, without a "
                       "gradient); use smooth_k=False where the LSE enters the loss.")
