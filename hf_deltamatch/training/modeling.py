"""Model construction for the recipes: from a local checkpoint or a config, with the paper's switches.

- attention: `--attn deltamatch_fp8` (+ `--precision`, `--delta`, applied through the library's config),
  or any transformers backend for baselines;
- context extension: RoPE base / scaling overrides on the loaded config;
- memory: activation checkpointing (transformers' own) and a chunked cross-entropy that never materializes
  the full (tokens x vocab) logits;
- optional LoRA (peft) and FP8 linear layers (torchao float8 training, CUDA only);
- hybrids (Gated DeltaNet + attention): without flash-linear-attention, transformers' torch fallback of the
  gated delta rule cannot keep packed documents apart, so those layers run document by document; with it,
  their short convolution is made to restart at packed document starts too (`short_conv.py`).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import ConfigError, TrainConfig, load_config_file, parse_lora
from .short_conv import document_aware

log = logging.getLogger(__name__)

_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


# ---------------------------------------------------------------------------------------------------------
# Attention selection
# ---------------------------------------------------------------------------------------------------------


# --precision ablations: (forward precision, backward precision) of the attention op
SPLIT_PRECISION = {"fp8_fwd": ("fp8", "bf16"), "fp8_bwd": ("bf16", "fp8")}


def backward_numerics(cfg: TrainConfig) -> tuple[str, str]:
    """(precision, delta) of the run's attention backward; other implementations count as bf16 with FlashAttention's
    stale delta."""
    if cfg.attn != "deltamatch_fp8":
        return "bf16", "stale"
    return SPLIT_PRECISION.get(cfg.precision, (cfg.precision, cfg.precision))[1], cfg.delta


class _ValueOf(torch.autograd.Function):
    """Returns `value`; the gradient goes to `carrier` (exactly: no y_b + (y_f - y_b) rounding)."""

    @staticmethod
    def forward(ctx, carrier, value):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def split_precision_attention(forward_precision: str, backward_precision: str, delta: str):
    """A transformers attention function whose output is the op's in `forward_precision` and whose gradient is
    the op's backward in `backward_precision` (that precision's own forward supplies the saved operands, LSE and,
    for stale delta, O). Both forwards run, so it costs one extra forward; it exists to tell forward error from
    backward error."""
    import hf_deltamatch
    from hf_deltamatch.integrations.transformers import deltamatch_attention_forward

    def attention(module, *args, **kwargs):
        saved = hf_deltamatch.get_default_config()
        outs = {}
        try:
            for precision in dict.fromkeys((forward_precision, backward_precision)):
                hf_deltamatch.set_default_config(saved.replace(precision=precision, delta=delta))
                outs[precision] = deltamatch_attention_forward(module, *args, **kwargs)[0]
        finally:
            hf_deltamatch.set_default_config(saved)
        y_f, y_b = outs[forward_precision], outs[backward_precision]
        return _ValueOf.apply(y_b, y_f.detach()), None

    return attention


def setup_attention(cfg: TrainConfig) -> str:
    """Make `cfg.attn` usable and apply --precision/--delta; returns the attn_implementation string."""
    if cfg.attn != "deltamatch_fp8":
        return cfg.attn
    # The env vars are read by the op at every call (and inherited by dataloader workers / launched ranks).
    if cfg.precision in SPLIT_PRECISION:
        os.environ.pop("HF_DELTAMATCH_PRECISION", None)  # the split function sets the precision per call
    else:
        os.environ["HF_DELTAMATCH_PRECISION"] = cfg.precision
    os.environ["HF_DELTAMATCH_DELTA"] = cfg.delta
    try:
        import hf_deltamatch
        import transformers
    except ImportError as e:  # pragma: no cover - environment problem
        raise ConfigError(f"--attn deltamatch_fp8 needs hf_deltamatch importable: {e}")
    precision = SPLIT_PRECISION.get(cfg.precision, (cfg.precision,))[0]
    if hasattr(hf_deltamatch, "set_default_config") and hasattr(hf_deltamatch, "DeltaMatchConfig"):
        hf_deltamatch.set_default_config(hf_deltamatch.DeltaMatchConfig(precision=precision, delta=cfg.delta))
    if hasattr(hf_deltamatch, "register"):
        hf_deltamatch.register()
    if "deltamatch_fp8" not in transformers.AttentionInterface._global_mapping:
        raise ConfigError("attn_implementation 'deltamatch_fp8' is not registered with transformers in this "
                          "checkout of hf_deltamatch (the integration is missing); use --attn sdpa meanwhile.")
    if cfg.precision in SPLIT_PRECISION:
        # its own name (with deltamatch_fp8's mask function), so deltamatch_fp8 itself stays as registered
        from hf_deltamatch.integrations.transformers import deltamatch_mask
        from transformers.masking_utils import AttentionMaskInterface

        name = f"deltamatch_{cfg.precision}"
        transformers.AttentionInterface.register(name, split_precision_attention(*SPLIT_PRECISION[cfg.precision],
                                                                                 cfg.delta))
        AttentionMaskInterface.register(name, deltamatch_mask)
        return name
    return cfg.attn


# ---------------------------------------------------------------------------------------------------------
# Config / model
# ---------------------------------------------------------------------------------------------------------


def _apply_overrides(config, cfg: TrainConfig) -> None:
    """RoPE base / scaling and max positions (context extension), and training-time flags."""
    if cfg.rope_theta is not None or cfg.rope_scaling is not None:
        rope = dict(getattr(config, "rope_parameters", None) or {})
        if cfg.rope_theta is not None:
            rope["rope_theta"] = float(cfg.rope_theta)
        if cfg.rope_scaling is not None:
            rope.update(cfg.rope_scaling)
        rope.setdefault("rope_type", "default")
        config.rope_parameters = rope
        for sub in ("rope_theta",):  # older configs keep it as a top-level attribute too
            if hasattr(config, sub) and cfg.rope_theta is not None:
                setattr(config, sub, float(cfg.rope_theta))
    if cfg.max_position_embeddings is not None:
        config.max_position_embeddings = cfg.max_position_embeddings
    elif getattr(config, "max_position_embeddings", None) and config.max_position_embeddings < cfg.seq_len:
        config.max_position_embeddings = cfg.seq_len
    config.use_cache = False


def build_config(cfg: TrainConfig, tokenizer):
    from transformers import AutoConfig

    if cfg.model is not None:
        config = AutoConfig.from_pretrained(cfg.model)
    else:
        spec = cfg.model_config
        if isinstance(spec, str):
            spec = load_config_file(spec)
        spec = dict(spec)
        model_type = spec.pop("model_type", None)
        if model_type is None:
            raise ConfigError("model_config needs a 'model_type' (e.g. qwen3_5_text for a Gated DeltaNet hybrid).")
        try:
            config = AutoConfig.for_model(model_type, **spec)
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"model_config for {model_type!r} is invalid: {e}")
        config.vocab_size = len(tokenizer)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    _apply_overrides(config, cfg)
    if getattr(config, "vocab_size", 0) < len(tokenizer):
        raise ConfigError(f"model vocab_size {config.vocab_size} < tokenizer size {len(tokenizer)}.")
    if cfg.attn == "deltamatch_fp8":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if head_dim % 16:
            raise ConfigError(f"deltamatch_fp8 needs head_dim % 16 == 0; this model has head_dim {head_dim}.")
    return config


def build_model(cfg: TrainConfig, tokenizer):
    """The causal LM (float32 master weights; bf16 compute comes from autocast)."""
    from .._quiet_imports import import_torchao_float8, import_transformers_modeling

    if cfg.fp8_linear:
        try:  # before transformers imports it, so that torchao's own messages are shown: the run uses it
            import_torchao_float8()
        except ImportError as e:
            raise ConfigError(f"--fp8_linear needs torchao's float8 training: {e}")
    import_transformers_modeling()
    from transformers import AutoModelForCausalLM

    attn = setup_attention(cfg)
    config = build_config(cfg, tokenizer)
    if cfg.model is not None:
        model = AutoModelForCausalLM.from_pretrained(cfg.model, config=config, attn_implementation=attn,
                                                     dtype=torch.float32)
    else:
        torch.manual_seed(cfg.seed)  # same init on every rank and on resume
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_linear = keep_linear_attention_documents_apart(model)
    if n_conv := keep_short_conv_documents_apart(model):
        log.info("Gated DeltaNet short convolutions restart at packed document starts (%d layers)", n_conv)
    if (refusal := fla_hopper_backward_refusal()) and any(type(m).__name__.endswith("GatedDeltaNet")
                                                          for m in model.modules()):
        log.warning(refusal)
    if n_linear:
        _announce_torch_gated_deltanet(n_linear)
    if cfg.fused_norms:
        from .norms import fuse_rms_norms

        n_norms, eager = fuse_rms_norms(model)
        log.info("--fused_norms: %d RMSNorms run through F.rms_norm%s", n_norms,
                 f" ({', '.join(eager)} stay eager)" if eager else "")
    if cfg.fp8_linear:
        convert_linear_to_fp8(model, compile=cfg.compile_fp8_linear)
    if cfg.lora:
        model = apply_lora(model, cfg.lora)
    return model


# ---------------------------------------------------------------------------------------------------------
# Packed sequences through linear-attention layers
# ---------------------------------------------------------------------------------------------------------


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def gdn_backend() -> str:
    """'fla' or 'torch': the chunked gated delta rule that transformers' Qwen3.5 Gated DeltaNet layers call.

    transformers resolves it once, when its modeling module is imported (FLA if `fla.ops.gated_delta_rule`
    imports, else its torch function); this reads the resolved function from the dispatch wrapper."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    try:
        impl = inspect.getclosurevars(modeling_qwen3_5.torch_chunk_gated_delta_rule).nonlocals.get("implementation")
    except TypeError:  # not a Python closure (a hub-kernel wrapper): transformers' own import rule
        impl = None
    if impl is None:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as impl  # noqa: F401
        except Exception:  # noqa: BLE001  (transformers falls back on any import error)
            return "torch"
    return "fla" if getattr(impl, "__module__", "").startswith("fla") else "torch"


def fla_hopper_backward_refusal() -> str | None:
    """Why FLA will refuse the gated delta rule's backward here, or None.

    FLA 0.6 raises in that backward on Hopper with 3.4 <= Triton < 3.7.1 (wrong results, FLA issue #640)
    unless its tilelang kernel can take that piece (tilelang installed, an nvcc for tilelang's JIT)."""
    if not (fla_available() and torch.cuda.is_available()) or torch.cuda.get_device_capability() != (9, 0):
        return None
    import triton

    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3] if x.isdigit())
    if not (3, 4, 0) <= version < (3, 7, 1):
        return None
    try:  # FLA's own rule: tilelang importable, nvcc found, not disabled by FLA_TILELANG=0
        from fla.ops.common.backends.tilelang import CommonTileLangBackend

        tilelang = CommonTileLangBackend.can_use()
    except Exception:  # noqa: BLE001  (another FLA layout)
        tilelang = importlib.util.find_spec("tilelang") is not None
    if tilelang:
        return None
    return (f"flash-linear-attention will refuse the Gated DeltaNet backward on this Hopper GPU with Triton "
            f"{triton.__version__} (FLA issue #640): install tilelang (pip install 'hf-deltamatch[hybrid-hopper]', "
            f"plus a CUDA toolkit's nvcc for its JIT) or Triton >= 3.7.1.")


def keep_linear_attention_documents_apart(model: nn.Module, force: bool = False) -> int:
    """Make Gated DeltaNet layers respect packed document boundaries when only the torch fallback exists.

    With flash-linear-attention, transformers passes `cu_seq_lens_q` to FLA's varlen kernel. The torch
    fallback cannot (transformers 5.2x refuses it; older versions silently mixed documents through the
    recurrent state and the short conv). Here such a layer runs once per document piece of the packed row
    and the outputs are concatenated: exact isolation, at the cost of a Python loop over documents.
    The boundaries come from the layer's own kwargs or, for transformers versions that do not forward them to
    linear-attention layers, from a pre-hook on the backbone (cu_seq_lens_q, else position_ids resets).
    Returns the number of layers wrapped.
    """
    if fla_available() and not force:
        return 0
    layers = [m for m in model.modules()
              if type(m).__name__.endswith("GatedDeltaNet") and not getattr(m, "_hf_dm_per_doc", False)]
    if not layers:
        return 0
    packed: dict = {}
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    backbone.register_forward_pre_hook(_remember_boundaries(packed), with_kwargs=True)
    for module in layers:
        module.forward = _per_document(module.forward, packed)
        module._hf_dm_per_doc = True
    return len(layers)


# transformers' notices (logger below, one per function, at the first call) that a Gated DeltaNet layer runs its torch
# reference code because flash-linear-attention / causal-conv1d is missing: the per-document layers above run exactly
# that code, and `_announce_torch_gated_deltanet` says so once for all of them instead.
_TRANSFORMERS_FALLBACK_LOGGER = "transformers.integrations.hub_kernels"
_GATED_DELTANET_FUNCTIONS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                             "causal_conv1d_update")


class _AnnouncedFallbacks(logging.Filter):
    """Drops transformers' fallback notice for a Gated DeltaNet function; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("is falling back to its reference PyTorch implementation" in msg
                    and any(msg.startswith(f"`{name}`") for name in _GATED_DELTANET_FUNCTIONS))


def _announce_torch_gated_deltanet(n_layers: int) -> None:
    """One notice for the Gated DeltaNet layers that run transformers' torch code per document: information on a
    CPU (FLA and causal-conv1d are CUDA kernels), a warning on a GPU, where installing FLA is the fix."""
    if torch.cuda.is_available():
        log.warning("Gated DeltaNet layers run transformers' torch implementation once per document (%d layers): "
                    "flash-linear-attention is not installed (pip install 'hf-deltamatch[hybrid]')", n_layers)
    else:
        log.info("Gated DeltaNet layers run transformers' torch implementation once per document (%d layers)",
                 n_layers)
    fallback_log = logging.getLogger(_TRANSFORMERS_FALLBACK_LOGGER)
    if not any(isinstance(f, _AnnouncedFallbacks) for f in fallback_log.filters):
        fallback_log.addFilter(_AnnouncedFallbacks())


def keep_short_conv_documents_apart(model: nn.Module, force: bool = False) -> int:
    """Make Gated DeltaNet layers' short convolution restart at packed document starts when FLA runs them.

    transformers passes the packed boundaries to FLA's varlen gated delta rule but runs the layer's
    `causal_conv1d_fn` over the whole row; here the modeling module's function is replaced by one that honours
    them (`short_conv.document_aware`; calls without boundaries are unchanged). Boundaries come from the layer's
    kwargs or, when transformers does not forward them, from the backbone pre-hook, which then also reach the
    gated delta rule. Layers already run per document are left alone. `force` applies it without FLA (tests).
    Returns the number of layers covered.
    """
    if not (fla_available() or force):
        return 0
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")
              and not getattr(m, "_hf_dm_per_doc", False) and not getattr(m, "_hf_dm_conv", False)]
    if not layers:
        return 0
    for module in {sys.modules[type(m).__module__] for m in layers}:
        if not callable(getattr(module, "causal_conv1d_fn", None)):
            raise ConfigError(f"{module.__name__} has no module-level causal_conv1d_fn to make document-aware, so "
                              "its short convolution would mix packed documents: use a transformers whose Gated "
                              "DeltaNet calls one (5.24 does), or uninstall flash-linear-attention (the layers then "
                              "run per document).")
        module.causal_conv1d_fn = document_aware(module.causal_conv1d_fn)
    packed: dict = {}
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    backbone.register_forward_pre_hook(_remember_boundaries(packed), with_kwargs=True)
    for module in layers:
        params = inspect.signature(module.forward).parameters.values()
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            raise ConfigError(f"{type(module).__name__}.forward takes no **kwargs, so packed boundaries cannot "
                              "reach its convolution and gated delta rule: use a transformers whose layers take them "
                              "(5.24 does).")
        module.forward = _with_boundaries(module.forward, packed)
        module._hf_dm_conv = True
    return len(layers)


def _with_boundaries(forward, packed: dict):
    """Adds the pre-hook's boundaries as `cu_seq_lens_q` to a packed (batch 1, uncached) call that lacks them."""
    def forward_with_boundaries(*args, **kwargs):
        cu = packed.get("cu")
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if (kwargs.get("cu_seq_lens_q") is None and kwargs.get("seq_idx") is None and cu is not None
                and hidden.shape[0] == 1 and cache is None and int(cu[-1]) == hidden.shape[1]):
            kwargs["cu_seq_lens_q"] = cu.to(torch.int32)
        return forward(*args, **kwargs)

    return forward_with_boundaries


def _remember_boundaries(packed: dict):
    def hook(module, args, kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        pos = kwargs.get("position_ids")
        if cu is None and pos is not None and pos.ndim == 2 and pos.shape[0] == 1:
            starts = torch.nonzero(pos[0] == 0).flatten()
            if starts.numel() > 1 or (starts.numel() == 1 and starts[0] != 0):
                cu = torch.cat([starts, torch.tensor([pos.shape[1]], device=pos.device)])
                if cu[0] != 0:
                    cu = torch.cat([torch.zeros(1, dtype=cu.dtype, device=cu.device), cu])
        packed["cu"] = cu

    return hook


def _per_document(forward, packed: dict):
    def per_document_forward(*args, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            cu = packed.get("cu")
        for k in _PACKED_KWARGS:
            kwargs.pop(k, None)
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        cache = kwargs.get("cache", kwargs.get("cache_params"))
        if cu is None or hidden.shape[0] != 1 or cache is not None or int(cu[-1]) != hidden.shape[1]:
            return forward(hidden, *rest, **kwargs)
        kwargs["attention_mask"] = None  # a packed row has no padding
        bounds = cu.tolist()
        outs = [forward(hidden[:, s:e], *rest, **kwargs) for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
        return torch.cat(outs, dim=1)

    return per_document_forward


# ---------------------------------------------------------------------------------------------------------
# LoRA and FP8 linears
# ---------------------------------------------------------------------------------------------------------


def apply_lora(model, spec: str):
    from peft import LoraConfig, get_peft_model

    r, alpha, targets = parse_lora(spec)
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in names]
    if missing:
        raise ConfigError(f"--lora targets {missing} match no nn.Linear in this model; available: {sorted(names)}.")
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                                  task_type="CAUSAL_LM"))
    return peft_model


# Distinct Float8Linear shapes a model may have (each one a recompile of the shared forward) before dynamo would give
# up and run the rest eagerly (its default recompile_limit is 8).
FP8_LINEAR_RECOMPILE_LIMIT = 64


def convert_linear_to_fp8(model: nn.Module, compile: bool = False) -> None:
    """torchao float8 training (dynamic tensorwise scaling) for every Linear except the LM head; with `compile`,
    torch.compile on each float8 linear.

    FP8 tensor cores (H100/H200) run the GEMMs. torchao computes each scale and cast as separate eager kernels unless
    compiled, which makes eager FP8 linears slower than bf16 ones (docs/performance.md). Compiling each linear, not
    the model, leaves the attention and Gated DeltaNet kernels outside dynamo. Without CUDA, torch's CPU `_scaled_mm`
    emulates the FP8 GEMMs with the same rounding: slow, but the same numerics, which is what the CPU tests and
    rehearsals need.
    """
    from .._quiet_imports import import_torchao_float8

    try:
        convert_to_float8_training, Float8Linear = import_torchao_float8()
    except ImportError as e:
        raise ConfigError(f"--fp8_linear needs torchao's float8 training: {e}")
    if not torch.cuda.is_available():
        log.warning("--fp8_linear without a CUDA GPU: FP8 GEMMs are emulated on the CPU (slow; for testing).")
    elif not compile:
        log.warning("--fp8_linear runs torchao's float8 linears eagerly, which measured slower than bf16 linears "
                    "(docs/performance.md); --compile_fp8_linear compiles them.")

    def keep(mod: nn.Module, fqn: str) -> bool:
        # FP8 GEMMs need both dims divisible by 16; the LM head stays in bf16 (as DeepSeek-V3 / torchao recipes do)
        return isinstance(mod, nn.Linear) and "lm_head" not in fqn and \
            mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    convert_to_float8_training(model, module_filter_fn=keep)
    if compile:
        import torch._dynamo as dynamo

        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, FP8_LINEAR_RECOMPILE_LIMIT)
        for mod in model.modules():
            if isinstance(mod, Float8Linear):
                mod.compile()


# ---------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------


def causal_lm(model: nn.Module) -> nn.Module:
    """The transformers *ForCausalLM inside a possible peft wrapper."""
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


class CausalLMWithLoss(nn.Module):
    """Wraps the causal LM so the whole loss (possibly chunked) runs inside one forward that DDP/FSDP see.

    forward(**batch) -> (loss mean over predicted tokens, number of predicted tokens).
    With loss_chunk > 0, the LM head + cross-entropy run over chunks of tokens under activation checkpointing,
    so at 64K tokens x a large vocabulary only one chunk of fp32 logits ever exists.
    """

    def __init__(self, model: nn.Module, loss_chunk: int = 0):
        super().__init__()
        self.model = model
        self.loss_chunk = loss_chunk
        lm = causal_lm(model)
        # FSDP auto-wrap reads _no_split_modules; keep only classes this model has (Qwen3.5 lists vision blocks).
        present = {type(m).__name__ for m in lm.modules()}
        self._no_split_modules = [n for n in (getattr(lm, "_no_split_modules", None) or []) if n in present]

    @property
    def lm(self):
        return causal_lm(self.model)

    def forward(self, input_ids, labels, scored=None, **kwargs):
        """`scored` (bool, input_ids' shape; evaluation): positions whose next-token predictions are also summed
        apart; then returns a third value, float64 [CE sum, top-1 correct, count] over them."""
        # Shifted targets: token t predicts labels[t + 1]; the collator put -100 at document starts.
        shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
        n_tokens = (shift != -100).sum()
        kwargs.setdefault("use_cache", False)  # training never needs a KV cache (and packed rows must not get one)
        if self.loss_chunk <= 0:
            out = self.model(input_ids=input_ids, **kwargs)
            logits = out.logits.float()
            loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), shift.view(-1),
                                               ignore_index=-100, reduction="sum")
            if scored is None:
                return loss / n_tokens.clamp(min=1), n_tokens
            return loss / n_tokens.clamp(min=1), n_tokens, _target_stats(logits[scored], shift[scored])
        lm = self.lm
        backbone = getattr(lm, lm.base_model_prefix)
        hidden = backbone(input_ids=input_ids, **kwargs).last_hidden_state
        head = lm.get_output_embeddings()
        target = None
        if scored is not None:  # only the scored positions' logits: the chunked path never holds them all
            target = _target_stats(_chunk_logits(hidden[scored], head.weight), shift[scored])
        total = hidden.new_zeros((), dtype=torch.float32)
        for s in range(0, hidden.shape[1], self.loss_chunk):
            h = hidden[:, s:s + self.loss_chunk]
            y = shift[:, s:s + self.loss_chunk]
            total = total + checkpoint(_chunk_ce, h, head.weight, y, use_reentrant=False)
        if target is None:
            return total / n_tokens.clamp(min=1), n_tokens
        return total / n_tokens.clamp(min=1), n_tokens, target


def _chunk_logits(h, weight):
    return nn.functional.linear(h, weight.to(h.dtype) if not torch.is_autocast_enabled(h.device.type) else weight)


def _chunk_ce(h, weight, y):
    logits = _chunk_logits(h, weight)
    return nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                       reduction="sum")


def _target_stats(logits, y):
    """float64 [CE sum, top-1 correct, count] of (K, V) logits against (K,) targets, -100 left out."""
    keep = y != -100
    logits, y = logits[keep].float(), y[keep]
    ce = nn.functional.cross_entropy(logits, y, reduction="sum") if len(y) else logits.new_zeros(())
    correct = (logits.argmax(dim=-1) == y).sum()
    return torch.stack([ce.double(), correct.double(), torch.tensor(len(y), dtype=torch.float64, device=y.device)])
