"""Tiny random transformers models, one per distinct attention pattern the installed transformers ships, for the
differential harness (tests/test_transformers_patterns.py). Built locally (no hub), fp32 weights, eval mode; head
dims 16. Each entry: how to build it and which kind of model it is (what its inputs look like)."""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import _tiny_models as tiny  # noqa: E402

VOCAB = tiny.VOCAB
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0, initializer_range=0.1)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)


def _llama4_chunked():
    """Llama 4's text model: chunked attention (chunks of 8 tokens) on both layers."""
    from transformers import Llama4TextConfig

    return Llama4TextConfig(**{**COMMON, "intermediate_size": 128}, intermediate_size_mlp=128, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, attention_chunk_size=8, num_local_experts=2,
                            interleave_moe_layer_step=1, num_experts_per_tok=1)


def _gemma3_text():
    """Gemma 3: a sliding layer and a full one, query_pre_attn_scalar scaling, no softcapping."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"])


def _gemma3_bidirectional():
    """Gemma 3 as an embedding model (use_bidirectional_attention): a model-defined mask overlay."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True)


def _bert():
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=256, pad_token_id=0,
                      attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0)


def _modernbert():
    """ModernBERT: alternating global and local (bidirectional sliding window) attention."""
    from transformers import ModernBertConfig

    return ModernBertConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, max_position_embeddings=256, pad_token_id=0, local_attention=8,
                            global_attn_every_n_layers=2, attention_dropout=0.0, mlp_dropout=0.0, embedding_dropout=0.0)


def _bart():
    from transformers import BartConfig

    return BartConfig(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0, forced_eos_token_id=None)


def _t5():
    from transformers import T5Config

    return T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
                    eos_token_id=2, decoder_start_token_id=0, dropout_rate=0.0)


def _gemma3_vlm():
    """Gemma 3 with a tiny SigLIP: image tokens attend to each other both ways (bidirectional blocks)."""
    from transformers import Gemma3Config, SiglipVisionConfig

    text = _gemma3_text()
    text.vocab_size = 300
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=32, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                        boi_token_index=297, eoi_token_index=298)


# name: (config builder, kind). Kinds: "causal" (AutoModelForCausalLM), "encoder" (masked LM), "seq2seq", "vlm"
FAMILIES = {
    "llama": (tiny.llama_config, "causal"),  # full causal, MHA
    "qwen3": (tiny.qwen3_config, "causal"),  # GQA
    "qwen3_sliding": (tiny.qwen3_sliding_config, "causal"),  # sliding + full layers
    "mistral": (_mistral, "causal"),  # every layer sliding
    "gemma3_text": (_gemma3_text, "causal"),  # sliding + full, query_pre_attn_scalar
    "llama4_chunked": (_llama4_chunked, "causal"),  # chunked attention
    "qwen3_next": (tiny.qwen3_next_config, "causal"),  # hybrid: Gated DeltaNet + gated attention
    "gpt_oss": (tiny.gpt_oss_config, "causal"),  # sinks, sliding + full
    "deepseek_v3": (tiny.deepseek_v3_config, "causal"),  # MLA
    "gemma3_bidirectional": (_gemma3_bidirectional, "causal"),  # a model-defined overlay
    "bert": (_bert, "encoder"),  # bidirectional with padding
    "modernbert": (_modernbert, "encoder"),  # bidirectional sliding windows
    "bart": (_bart, "seq2seq"),  # encoder, causal decoder, cross-attention
    "t5": (_t5, "seq2seq"),  # relative position bias
    "gemma3_vlm": (_gemma3_vlm, "vlm"),  # image tokens in bidirectional blocks
}


def build(name: str, attn: str, seed: int = 0):
    """Family `name` with attention `attn`, weights from `seed` (identical for every attn), fp32, eval mode."""
    import transformers

    make, kind = FAMILIES[name]
    config = make()
    cls = {"causal": transformers.AutoModelForCausalLM, "encoder": transformers.AutoModelForMaskedLM,
           "seq2seq": transformers.AutoModelForSeq2SeqLM}.get(kind)
    torch.manual_seed(seed)
    if kind == "vlm":
        model = transformers.Gemma3ForConditionalGeneration._from_config(config, attn_implementation=attn,
                                                                           dtype=torch.float32)
    else:
        model = cls.from_config(config, attn_implementation=attn, dtype=torch.float32)
    tiny._perturb_norms(model, seed)
    return model.eval()
