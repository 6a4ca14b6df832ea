"""Packing keeps documents apart: blocks, the collator's layout, and packed vs per-document forwards."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from _recipe_helpers import TINY_MODEL
from hf_deltamatch.training.data import PackedCollator, pack_token_lists
from hf_deltamatch.training.modeling import CausalLMWithLoss, keep_linear_attention_documents_apart


def test_pack_token_lists_exact_blocks_and_boundaries():
    docs = [list(range(100, 100 + n)) for n in (5, 17, 3, 40, 9, 1, 30)]
    out = pack_token_lists(docs, seq_len=16)
    flat = [t for d in docs for t in d]
    assert all(len(b) == 16 for b in out["input_ids"])
    assert [t for b in out["input_ids"] for t in b] == flat[: 16 * len(out["input_ids"])]
    assert all(sum(l) == 16 for l in out["doc_lens"])
    # piece boundaries are exactly the document boundaries (plus block edges)
    doc_ends = set(torch.tensor([len(d) for d in docs]).cumsum(0).tolist())
    pos = 0
    for lens in out["doc_lens"]:
        for n in lens[:-1]:
            pos += n
            assert pos in doc_ends
        pos += lens[-1]


def test_collator_matches_flash_attention_varlen_layout():
    blocks = [{"input_ids": [1, 2, 3, 4, 5, 6], "doc_lens": [2, 4]},
              {"input_ids": [7, 8, 9, 10, 11, 12], "doc_lens": [6]}]
    b = PackedCollator()(blocks)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    assert b["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    assert b["labels"].tolist() == [[-100, 2, -100, 4, 5, 6, -100, 8, 9, 10, 11, 12]]
    assert b["cu_seq_lens_q"].tolist() == [0, 2, 6, 12] and b["cu_seq_lens_q"].dtype == torch.int32
    assert b["cu_seq_lens_k"].tolist() == [0, 2, 6, 12]
    assert b["max_length_q"] == 6 and b["max_length_k"] == 6
    with pytest.raises(ValueError, match="doc_lens"):
        PackedCollator()([{"input_ids": [1, 2, 3], "doc_lens": [2]}])


def _model(attn: str, seed: int = 0):
    spec = dict(TINY_MODEL)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=97, **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)
    keep_linear_attention_documents_apart(model, force=True)
    return model.eval()


def _deltamatch_ready() -> bool:
    try:
        import hf_deltamatch  # noqa: F401
    except Exception:
        return False
    return "deltamatch_fp8" in AttentionInterface._global_mapping


ATTNS = ["sdpa", "eager", pytest.param("deltamatch_fp8", marks=pytest.mark.skipif(
    not _deltamatch_ready(), reason="deltamatch_fp8 not registered in this checkout"))]


@pytest.mark.parametrize("attn", ATTNS)
def test_packed_forward_equals_per_document_forward(attn, monkeypatch):
    """Logits of each document in a packed row == logits of that document run alone (hybrid: GDN + GQA)."""
    if attn == "deltamatch_fp8":
        # bf16 mode: same tiling/varlen code as fp8 without quantization noise, so equality is tight.
        monkeypatch.setenv("HF_DELTAMATCH_PRECISION", "bf16")
    model = _model(attn)
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in (37, 64, 5, 150)]
    blocks = [{"input_ids": torch.cat(docs[:2]).tolist() + docs[2].tolist()[:3], "doc_lens": [37, 64, 3]},
              {"input_ids": docs[2].tolist()[3:] + docs[3].tolist()[:102], "doc_lens": [2, 102]}]
    batch = PackedCollator()(blocks)
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        pieces = [docs[0], docs[1], docs[2][:3], docs[2][3:], docs[3][:102]]
        alone = torch.cat([model(input_ids=p[None], use_cache=False).logits[0] for p in pieces])
    # the op computes each document alone, so as for sdpa and eager only the fp32 linear layers' rounding on other
    # shapes differs (max |difference| measured 2.4e-7 sdpa, 3.6e-7 deltamatch_fp8, logits up to 1.5)
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
    # and the row is not trivially equal to an unpacked forward (documents WOULD interact without boundaries)
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
    assert (leaky[40:] - alone[40:]).abs().max() > 1e-3


def test_packed_kwargs_reach_the_attention_function():
    """cu_seq_lens/max_length kwargs from model(**batch) arrive in the attention function (varlen path)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen = []

    def spy(module, q, k, v, attention_mask, **kwargs):
        seen.append({k_: kwargs.get(k_) for k_ in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
        return sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)

    AttentionInterface.register("recipe_spy", spy)
    from transformers import AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionMaskInterface.register("recipe_spy", sdpa_mask)
    model = _model("recipe_spy")
    batch = PackedCollator()([{"input_ids": list(range(1, 21)), "doc_lens": [7, 13]}])
    with torch.no_grad():
        CausalLMWithLoss(model)(**batch)
    assert seen, "the attention function was never called"
    assert seen[0]["cu_seq_lens_q"].tolist() == [0, 7, 20] and seen[0]["max_length_k"] == 13


def test_linear_attention_boundaries_from_position_ids_alone():
    """Transformers versions that do not forward cu_seq_lens to Gated DeltaNet: position_ids resets suffice."""
    model = _model("sdpa")
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in (23, 41)]
    batch = PackedCollator()([{"input_ids": torch.cat(docs).tolist(), "doc_lens": [23, 41]}])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)


def test_qwen3_next_made_dense_keeps_documents_apart():
    """The other hybrid family: Qwen3-Next with every MLP dense (mlp_only_layers = all layers)."""
    config = AutoConfig.for_model(
        "qwen3_next", vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, mlp_only_layers=[0, 1], num_experts=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    assert keep_linear_attention_documents_apart(model, force=True) == 1
    assert not any("Sparse" in type(m).__name__ or "Experts" in type(m).__name__ for m in model.modules())
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 97, (n,), generator=g) for n in (30, 50)]
    batch = PackedCollator()([{"input_ids": torch.cat(docs).tolist(), "doc_lens": [30, 50]}])
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=2e-5, rtol=1e-4)
