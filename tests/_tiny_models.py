"""Tiny, randomly initialized transformers models for the integration tests (no hub downloads).

Every model: hidden 64, 2 layers, vocab 256, attention head dims that are multiples of 16. The hybrid
models (Qwen3-Next, Kimi Linear) mix one linear-attention layer (torch fallback on CPU) with one full
attention layer, which is the only layer that goes through `deltamatch_fp8`.
"""

from __future__ import annotations

import torch

VOCAB = 256
HIDDEN = 64


def _common(model_defaults: dict, overrides: dict) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                tie_word_embeddings=False, attention_dropout=0.0, initializer_range=0.1)
    base.update(model_defaults)
    base.update(overrides)
    return base


def llama_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**_common(dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16), kw))


def qwen3_config(**kw):
    """GQA: 4 query heads share 2 KV heads."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16), kw))


def qwen3_sliding_config(**kw):
    """Qwen3 with a sliding window of 8 tokens on the first layer, full attention on the second."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common(dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      use_sliding_window=True, sliding_window=8, max_window_layers=1,
                                      layer_types=["sliding_attention", "full_attention"]), kw))


def qwen3_next_config(**kw):
    """Dense Qwen3-Next: num_experts=0 gives every layer the dense MLP; layer 0 Gated DeltaNet, layer 1 attention."""
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_common(dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=0, num_experts_per_tok=1,
        layer_types=["linear_attention", "full_attention"], linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4), kw))


def deepseek_v3_config(**kw):
    """MLA: q/k head dim 16 (nope) + 16 (rope) = 32, v head dim 16; dense (first_k_dense_replace = layers)."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**_common(dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, moe_intermediate_size=32), kw))


def kimi_linear_config(**kw):
    """Kimi Linear: layer 0 Kimi Delta Attention (torch fallback), layer 1 MLA (q/k 32, v 16); dense MLPs."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**_common(dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16, layer_types=["linear_attention", "full_attention"],
        mlp_layer_types=["dense", "dense"], linear_head_dim=16, linear_num_heads=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32), kw))


def gpt_oss_config(**kw):
    """gpt-oss: learnable attention sinks (s_aux), layer 0 a sliding window of 8 tokens, layer 1 full attention;
    GQA 4/2; a mixture of 4 experts, 2 per token."""
    from transformers import GptOssConfig

    return GptOssConfig(**_common(dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], num_local_experts=2, num_experts_per_tok=2,
        intermediate_size=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}), kw))


CONFIGS = {
    "llama": llama_config,
    "qwen3": qwen3_config,
    "qwen3_sliding": qwen3_sliding_config,
    "qwen3_next": qwen3_next_config,
    "deepseek_v3": deepseek_v3_config,
    "kimi_linear": kimi_linear_config,
}

# Models transformers runs without sdpa (compared with attn_implementation="eager"): attention sinks.
EAGER_CONFIGS = {"gpt_oss": gpt_oss_config}

# Models whose every token mixer is softmax attention (packing and padding are the attention's job alone).
ATTENTION_ONLY = ("llama", "qwen3", "qwen3_sliding", "deepseek_v3")


def n_attention_layers(config) -> int:
    """Layers that call the attention function (the others are linear attention)."""
    types = getattr(config, "layer_types", None)
    if not types:
        return config.num_hidden_layers
    return sum(t != "linear_attention" for t in types)


def build(name: str, attn: str, dtype=torch.bfloat16, seed: int = 0, **config_overrides):
    """The model `name` with weights from `seed` (identical for every `attn`), in eval mode."""
    from transformers import AutoModelForCausalLM

    config = {**CONFIGS, **EAGER_CONFIGS}[name](**config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    _perturb_norms(model, seed)
    return model.to(dtype).eval()


def _perturb_norms(model, seed):
    """Random init leaves some weights (norms, zero-initialized gates) at constants; give them spread so a
    wrong attention output cannot hide behind a degenerate layer. Attention sinks (initialized near 0) get a
    spread of logits, so that each takes from a few percent to most of a row's weight."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".sinks"):
                p.copy_(1.0 + 1.5 * torch.randn(p.shape, generator=g))
