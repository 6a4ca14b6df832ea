"""`attn_implementation="deltamatch_fp8"` in real (tiny, random) transformers models, on CPU.

Models (tests/_tiny_models.py): Llama (MHA), Qwen3 (GQA), Qwen3 with a sliding window, dense Qwen3-Next
(Gated DeltaNet + gated attention), DeepSeek-V3 (MLA: q/k head dim 32, v head dim 16), Kimi Linear
(Kimi Delta Attention + MLA). Every test that runs the op checks, through a spy on the op, that it was
really called (and with what), so no comparison can pass because the model silently fell back to sdpa.

Tolerances (relative Frobenius error of logits / gradients against the same model with sdpa), per model at 1.2x
the error measured on the fixed inputs (MEASURED; tests/_measured.py says why that holds on other CPUs):
- bf16 mode: same algorithm as sdpa, but P and dS are rounded to bf16 before their matmuls (sdpa's own bf16 error
  against fp32 is ~1.5e-2 on these models); measured 2e-3 to 1e-2 forward, <= 1.7e-2 gradients. BF16_FWD_TOL and
  BF16_GRAD_TOL (2e-2, 3e-2) are the general bounds where nothing was measured (other test files).
- fp8 mode: e4m3 keeps 3 mantissa bits (relative rounding 2^-4) on q, k, v, P, dO, dS; 2-4% error per attention
  call, compounded over layers and the LM head: measured 1.4e-2 to 6.6e-2 forward, <= 0.145 on single attention
  projections' gradients (FP8_FWD_TOL, FP8_GRAD_TOL: 0.12, 0.25 in general).
- Packed vs per-sequence, padded vs unpadded, continued from a cache: the op computes each sequence alone, so the
  only differences are the linear layers' fp32 rounding on other batch shapes (and bf16 flips it causes): SAME_TOL.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import hf_deltamatch
from hf_deltamatch.integrations import transformers as integration
from hf_deltamatch.testing import assert_rel_close, rel_err

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
import _tiny_models as tiny  # noqa: E402
from _measured import measured_close  # noqa: E402

ALL_MODELS = list(tiny.CONFIGS)
BF16_FWD_TOL, BF16_GRAD_TOL = 2e-2, 3e-2
FP8_FWD_TOL, FP8_GRAD_TOL = 0.12, 0.25

# Relative errors against the sdpa model measured on these tests' fixed inputs (tests/_measured.py: bound 1.2x):
# logits, all gradients (flattened), the largest over the attention projections' gradients, and the logits of
# greedy decoding's steps against one uncached pass
MEASURED = {
    ("llama", "bf16"): dict(logits=0.0072, grads=0.00999, attn_grads=0.0123),
    ("qwen3", "bf16"): dict(logits=0.00726, grads=0.0123, attn_grads=0.0144, generate=0.00741),
    ("qwen3_sliding", "bf16"): dict(logits=0.00617, grads=0.0107, attn_grads=0.0127),
    ("qwen3_next", "bf16"): dict(logits=0.00198, grads=0.00939, attn_grads=0.00636),
    ("deepseek_v3", "bf16"): dict(logits=0.00967, grads=0.0133, attn_grads=0.0168, generate=0.0103),
    ("kimi_linear", "bf16"): dict(logits=0.00473, grads=0.00925, attn_grads=0.00994, generate=0.00468),
    ("llama", "fp8"): dict(logits=0.0615, grads=0.0922, attn_grads=0.116),
    ("qwen3", "fp8"): dict(logits=0.0638, grads=0.0946, attn_grads=0.139, generate=0.0597),
    ("qwen3_sliding", "fp8"): dict(logits=0.0664, grads=0.095, attn_grads=0.145),
    ("qwen3_next", "fp8"): dict(logits=0.0258, grads=0.0931, attn_grads=0.11),
    ("deepseek_v3", "fp8"): dict(logits=0.0422, grads=0.0557, attn_grads=0.0819, generate=0.0484),
    ("kimi_linear", "fp8"): dict(logits=0.0141, grads=0.0215, attn_grads=0.0507, generate=0.0135),
    ("llama lora", "bf16"): dict(qk_grads=0.0175),
    ("llama lora", "fp8"): dict(qk_grads=0.167),
    ("qwen3 fp32", "bf16"): dict(logits=0.00436),
}
# The same computation on other batch shapes (packed, padded, continued from a cache) in fp32 models, bf16 mode:
# the linear layers' fp32 rounding differs, which flips a rare bf16 rounding where q/k/v are cast for the op
# (2^-8 on one element). Measured <= 2e-7, and 6.2e-5 (Qwen3-Next, left padding: such a flip); a document that
# saw another's tokens would be off by > 5e-2.
SAME_TOL = 5e-4


def set_precision(precision: str) -> None:
    """Switch the op's default config (conftest restores the previous default after each test)."""
    hf_deltamatch.set_default_config(hf_deltamatch.get_default_config().replace(precision=precision))


@pytest.fixture
def spy(monkeypatch):
    """Records every call of the op from the transformers integration (and passes it through)."""
    calls = []
    real = integration.deltamatch_attention

    def wrapped(q, k, v, **kw):
        calls.append(dict(q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape), dtype=q.dtype,
                          causal=kw.get("causal"), window=kw.get("window"),
                          cu_seqlens_q=None if kw.get("cu_seqlens_q") is None else kw["cu_seqlens_q"].tolist(),
                          cu_seqlens_k=None if kw.get("cu_seqlens_k") is None else kw["cu_seqlens_k"].tolist()))
        return real(q, k, v, **kw)

    monkeypatch.setattr(integration, "deltamatch_attention", wrapped)
    return calls


def token_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, tiny.VOCAB, (batch, length), generator=g)


def lm_loss(model, ids, **kw):
    return model(input_ids=ids, labels=ids, **kw).loss


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}


def flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g[n].flatten() for n in sorted(g)])


def attention_param_names(model) -> list[str]:
    """Parameters whose gradient reaches them only through the attention op's dq/dk/dv."""
    keys = ("q_proj", "k_proj", "q_a_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "v_proj")
    return [n for n, _ in model.named_parameters()
            if any(k in n for k in keys) and ".self_attn." in n]


def run_fwd_bwd(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach().float(), grads(model)


# ----------------------------------------------------------------------------------------------------
# Registration
# ----------------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_registers_mask_function_under_the_same_name():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = hf_deltamatch.ATTN_IMPLEMENTATION
    assert name == "deltamatch_fp8"
    hf_deltamatch.register()
    hf_deltamatch.register()
    assert AttentionInterface._global_mapping[name] is integration.deltamatch_attention_forward
    assert AttentionMaskInterface._global_mapping[name] is integration.deltamatch_mask
    assert list(AttentionInterface._global_mapping).count(name) == 1
    # A model built with the name resolves to our function.
    model = tiny.build("llama", "deltamatch_fp8")
    assert model.config._attn_implementation == name


# ----------------------------------------------------------------------------------------------------
# Parity with sdpa: bf16 mode closely, fp8 mode within the FP8 bound
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_MODELS)
def test_bf16_mode_matches_sdpa_forward_and_backward(name, spy):
    set_precision("bf16")
    ids = token_ids(2, 48)
    ref = tiny.build(name, "sdpa")
    ours = tiny.build(name, "deltamatch_fp8")
    ref_logits, ref_grads = run_fwd_bwd(ref, ids)
    logits, our_grads = run_fwd_bwd(ours, ids)

    n_attn = tiny.n_attention_layers(ours.config)
    assert len(spy) == n_attn, f"op called {len(spy)} times, expected once per attention layer ({n_attn})"
    assert all(c["dtype"] == torch.bfloat16 and c["causal"] for c in spy)
    if name == "qwen3_sliding":
        assert [c["window"] for c in spy] == [8, None]
    else:
        assert all(c["window"] is None for c in spy)
    if name in ("deepseek_v3", "kimi_linear"):  # MLA: v head dim differs from q/k head dim, no padding of v
        assert all(c["q_shape"][-1] == 32 and c["v_shape"][-1] == 16 for c in spy)
    if name in ("qwen3", "qwen3_sliding", "qwen3_next"):  # GQA: KV heads are not repeated
        assert all(c["q_shape"][1] == 4 and c["k_shape"][1] == 2 for c in spy)

    measured_close(MEASURED, (name, "bf16"), "logits", ref_logits, logits, "transformers")
    # As accurate as sdpa itself: against the fp32 model, no worse than bf16 sdpa (plus bf16 slack).
    truth = tiny.build(name, "sdpa", dtype=torch.float32)
    with torch.no_grad():
        true_logits = truth(input_ids=ids).logits
    assert rel_err(true_logits, logits) <= 1.5 * rel_err(true_logits, ref_logits) + 5e-3

    assert set(our_grads) == set(ref_grads)
    assert all(torch.isfinite(g).all() for g in our_grads.values())
    measured_close(MEASURED, (name, "bf16"), "grads", flat(ref_grads), flat(our_grads), "transformers")
    attn_params = attention_param_names(ours)
    assert attn_params
    for n in attn_params:  # gradients that exist only through the op's backward (the largest error measured)
        assert our_grads[n].abs().max() > 0, n
        measured_close(MEASURED, (name, "bf16"), "attn_grads", ref_grads[n], our_grads[n], "transformers")


@pytest.mark.parametrize("name", ALL_MODELS)
def test_fp8_mode_within_bound_and_backward_finite(name, spy):
    set_precision("fp8")
    ids = token_ids(2, 48, seed=1)
    ref = tiny.build(name, "sdpa")
    ours = tiny.build(name, "deltamatch_fp8")
    ref_logits, ref_grads = run_fwd_bwd(ref, ids)
    logits, our_grads = run_fwd_bwd(ours, ids)

    assert len(spy) == tiny.n_attention_layers(ours.config)
    err = measured_close(MEASURED, (name, "fp8"), "logits", ref_logits, logits, "transformers")
    # Nonzero: FP8 quantization really happened in the op (an sdpa fallback would give ~0 or bf16-level).
    assert 3e-3 < err, err
    assert all(torch.isfinite(g).all() for g in our_grads.values())
    measured_close(MEASURED, (name, "fp8"), "grads", flat(ref_grads), flat(our_grads), "transformers")
    for n in attention_param_names(ours):
        assert our_grads[n].abs().max() > 0, n
        measured_close(MEASURED, (name, "fp8"), "attn_grads", ref_grads[n], our_grads[n], "transformers")


def test_fp8_differs_from_bf16_mode_and_comparisons_are_sensitive(monkeypatch):
    """The parity tests can fail: fp8 and bf16 modes give different logits, and a wrong mask (non-causal)
    moves the logits far beyond the tolerances."""
    ids = token_ids(2, 48)
    ref = tiny.build("llama", "sdpa")
    ours = tiny.build("llama", "deltamatch_fp8")
    with torch.no_grad():
        ref_logits = ref(input_ids=ids).logits
        set_precision("bf16")
        bf16 = ours(input_ids=ids).logits
        set_precision("fp8")
        fp8 = ours(input_ids=ids).logits
        assert rel_err(bf16, fp8) > 5 * rel_err(ref_logits, bf16)

        real = integration.deltamatch_attention
        monkeypatch.setattr(integration, "deltamatch_attention",
                            lambda q, k, v, **kw: real(q, k, v, **{**kw, "causal": False}))
        broken = ours(input_ids=ids).logits
    assert rel_err(ref_logits, broken) > 3 * FP8_FWD_TOL


def test_sliding_window_comparison_is_sensitive(monkeypatch):
    """Dropping the window (full causal attention on the sliding layer) fails the bf16 parity tolerance."""
    set_precision("bf16")
    ids = token_ids(2, 48)
    with torch.no_grad():
        ref_logits = tiny.build("qwen3_sliding", "sdpa")(input_ids=ids).logits
        ours = tiny.build("qwen3_sliding", "deltamatch_fp8")
        assert rel_err(ref_logits, ours(input_ids=ids).logits) <= BF16_FWD_TOL
        real = integration.deltamatch_attention
        monkeypatch.setattr(integration, "deltamatch_attention",
                            lambda q, k, v, **kw: real(q, k, v, **{**kw, "window": None}))
        no_window = ours(input_ids=ids).logits
    assert rel_err(ref_logits, no_window) > 5 * BF16_FWD_TOL


def test_env_override_selects_precision(monkeypatch, spy):
    ids = token_ids(1, 32)
    ours = tiny.build("llama", "deltamatch_fp8")
    set_precision("fp8")
    with torch.no_grad():
        fp8 = ours(input_ids=ids).logits
        monkeypatch.setenv("HF_DELTAMATCH_PRECISION", "bf16")
        env_bf16 = ours(input_ids=ids).logits
        monkeypatch.delenv("HF_DELTAMATCH_PRECISION")
        set_precision("bf16")
        bf16 = ours(input_ids=ids).logits
    assert torch.equal(env_bf16, bf16)
    assert not torch.equal(fp8, bf16)
    assert len(spy) == 3 * 2


# ----------------------------------------------------------------------------------------------------
# generate(): decode with a KV cache (q_len < kv_len, causal bottom-right)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_MODELS)
def test_generate_greedy_matches_sdpa_in_bf16_mode(name, spy):
    set_precision("bf16")
    prompt = token_ids(1, 24, seed=2)
    kw = dict(max_new_tokens=12, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    ref = tiny.build(name, "sdpa").generate(prompt, **kw)
    out = tiny.build(name, "deltamatch_fp8").generate(prompt, **kw)
    assert out.shape == (1, 24 + 12)
    assert torch.equal(out, ref), f"{out[0, 24:].tolist()} != sdpa {ref[0, 24:].tolist()}"
    n_attn = tiny.n_attention_layers(tiny.CONFIGS[name]())
    assert len(spy) == 12 * n_attn  # prefill + 11 decode steps, each through the op
    decode = spy[n_attn:]
    assert all(c["q_shape"][2] == 1 and c["k_shape"][2] > 1 and c["causal"] for c in decode)
    assert decode[-1]["k_shape"][2] == 24 + 11


@pytest.mark.parametrize("name", ALL_MODELS)
def test_multi_token_continuation_with_cache(name, spy):
    """Several new tokens on top of a KV cache (chunked prefill, assisted decoding): q_len 8 < kv_len 28,
    causal aligned bottom-right, equals the same positions of one uncached pass."""
    set_precision("bf16")
    model = tiny.build(name, "deltamatch_fp8", dtype=torch.float32)
    ids = token_ids(2, 28, seed=9)
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, 20:]
        first = model(input_ids=ids[:, :20], use_cache=True)
        spy.clear()
        cont = model(input_ids=ids[:, 20:], cache=first.past_key_values).logits
    assert len(spy) == tiny.n_attention_layers(model.config)
    # Full layers see the 20 cached keys + 8 new; a sliding layer's cache keeps window - 1 = 7 keys.
    assert all(c["q_shape"][2] == 8 and c["k_shape"][2] == (28 if c["window"] is None else 7 + 8) and c["causal"]
               for c in spy)
    assert_rel_close("continuation logits", full, cont, SAME_TOL)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3", "kimi_linear"])
def test_generate_fp8_mode_matches_sdpa(name, spy):
    """Greedy decoding in fp8 mode (prefill, then q_len 1 against the KV cache): the logits of every step against
    the sdpa model's on the same tokens in one uncached pass, at 1.2x the error measured for this model; the same
    steps in bf16 mode are 3-8x closer (a decode step that read the cache wrongly would be off by far more)."""
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
              return_dict_in_generate=True)
    prompt = token_ids(2, 16, seed=3)
    ours = tiny.build(name, "deltamatch_fp8")
    ref = tiny.build(name, "sdpa")
    for precision in ("fp8", "bf16"):
        set_precision(precision)
        spy.clear()
        gen = ours.generate(prompt, **kw)
        out = gen.sequences
        assert out.shape == (2, 22) and torch.equal(out[:, :16], prompt)
        assert len(spy) == 6 * tiny.n_attention_layers(tiny.CONFIGS[name]())
        steps = torch.stack(gen.logits, dim=1).float()  # (2, 6, vocab): the logits that chose tokens 16..21
        with torch.no_grad():
            want = ref(input_ids=out).logits[:, 15:21].float()
        measured_close(MEASURED, (name, precision), "generate", want, steps, "transformers")


def _left_padded_pair():
    """Prompts of 20 and 12 tokens, and the batch of both with the shorter one left-padded, with its mask."""
    a, b = token_ids(1, 20, seed=4), token_ids(1, 12, seed=5)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 8, dtype=torch.long), b], 1)])
    mask = torch.cat([torch.ones(1, 20), torch.cat([torch.zeros(1, 8), torch.ones(1, 12)], 1)]).long()
    return a, b, batch, mask


def test_generate_with_left_padding_matches_unpadded(spy):
    """Batched generation from left-padded prompts: each row continues as it would alone."""
    set_precision("bf16")
    model = tiny.build("qwen3", "deltamatch_fp8")
    a, b, batch, mask = _left_padded_pair()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(batch, attention_mask=mask, **kw)
    assert any(c["cu_seqlens_k"] is not None for c in spy)  # padding went through varlen
    assert torch.equal(out[0, 20:], model.generate(a, **kw)[0, 20:])
    assert torch.equal(out[1, 20:], model.generate(b, **kw)[0, 12:])


@pytest.mark.parametrize("name", ALL_MODELS)
def test_generate_with_static_cache_matches_sdpa(name, spy):
    """A static cache hands the attention the whole preallocated k/v (empty slots included) and generate()
    drops the all-ones mask: the mask function must say how much of the cache is written."""
    set_precision("bf16")
    prompt = token_ids(1, 24, seed=2)
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    ref = tiny.build(name, "sdpa").generate(prompt, **kw)
    out = tiny.build(name, "deltamatch_fp8").generate(prompt, **kw)
    assert torch.equal(out, ref), f"{out[0, 24:].tolist()} != sdpa {ref[0, 24:].tolist()}"
    n_attn = tiny.n_attention_layers(tiny.CONFIGS[name]())
    assert len(spy) == 10 * n_attn
    full = [c for c in spy if c["window"] is None]
    assert full[0]["k_shape"][2] == 24 and full[-1]["k_shape"][2] == 24 + 9  # only the written slots


def test_generate_static_cache_with_left_padding(spy):
    set_precision("bf16")
    model = tiny.build("qwen3_sliding", "deltamatch_fp8")
    a, b, batch, mask = _left_padded_pair()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static")
    out = model.generate(batch, attention_mask=mask, **kw)
    assert torch.equal(out[0, 20:], model.generate(a, **kw)[0, 20:])
    assert torch.equal(out[1, 20:], model.generate(b, **kw)[0, 12:])


def test_mask_function_leaves_bidirectional_and_dynamic_masks_alone():
    """The static-cache mask is only made for causal masks: a cross-attention (bidirectional) mask with more
    keys than queries, or a dynamic cache whose keys are all written, stays None (nothing to mask)."""
    from transformers.masking_utils import bidirectional_mask_function, causal_mask_function

    m = integration.deltamatch_mask
    bidir, causal = dict(mask_function=bidirectional_mask_function), dict(mask_function=causal_mask_function)
    assert m(2, 5, 9, 0, 0, attention_mask=None, allow_is_bidirectional_skip=True, **bidir) is None
    assert m(2, 1, 9, 8, 0, attention_mask=None, **causal) is None  # dynamic cache: 8 past + 1 new = 9 keys
    static = m(2, 1, 32, torch.tensor(8), 0, attention_mask=None, **causal)  # static cache of 32 slots, 9 written
    assert static.shape == (2, 9) and static.all()
    padded = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    assert torch.equal(m(2, 3, 3, 0, 0, attention_mask=padded, **causal), padded)
    assert m(2, 3, 3, 0, 0, attention_mask=torch.ones(2, 3, dtype=torch.bool), **causal) is None


# ----------------------------------------------------------------------------------------------------
# Padding: left and right padding give the unpadded logits on the valid tokens
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ALL_MODELS)
def test_padding_matches_unpadded(name, side, spy):
    set_precision("bf16")
    model = tiny.build(name, "deltamatch_fp8", dtype=torch.float32)  # fp32 linears: only the op rounds
    lengths = [30, 17, 9]
    seqs = [token_ids(1, n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    L = max(lengths)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    pos = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        sl = slice(0, len(s)) if side == "right" else slice(L - len(s), L)
        ids[i, sl], mask[i, sl], pos[i, sl] = s, 1, torch.arange(len(s))
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        # each row's real tokens, then its padding, as packed sequences
        assert spy[-1]["cu_seqlens_q"] == [0, 30, 30, 47, 60, 69, 90]
        for i, s in enumerate(seqs):
            alone = model(input_ids=s[None]).logits[0]
            valid = padded[i][mask[i].bool()]
            assert_rel_close(f"sequence {i} logits", alone, valid, SAME_TOL)
    assert torch.isfinite(padded).all()


# ----------------------------------------------------------------------------------------------------
# Packed training (DataCollatorWithFlattening) equals per-sequence training
# ----------------------------------------------------------------------------------------------------


PACKABLE = {name: {} for name in tiny.ATTENTION_ONLY}
# Qwen3-Next and Kimi Linear with both layers full attention: their attention modules (gated attention, MLA)
# under packing. With their linear-attention layers, packing fails upstream of the op on CPU: without
# flash-linear-attention the torch fallbacks of Gated DeltaNet / KDA do not keep packed sequences apart
# (Qwen3-Next raises for cu_seq_lens and mixes documents for position_ids; Kimi Linear mixes them).
PACKABLE["qwen3_next_all_attention"] = {"layer_types": ["full_attention"] * 2}
PACKABLE["kimi_linear_all_attention"] = {"layer_types": ["full_attention"] * 2}


@pytest.mark.parametrize("flash_kwargs", [True, False], ids=["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("variant", list(PACKABLE))
def test_packed_training_equals_per_sequence(variant, flash_kwargs, spy):
    from transformers import DataCollatorWithFlattening

    set_precision("bf16")
    name = variant.replace("_all_attention", "")
    model = tiny.build(name, "deltamatch_fp8", dtype=torch.float32, **PACKABLE[variant])
    model.train()
    lengths = [21, 9, 30]
    seqs = [token_ids(1, n, seed=20 + i)[0].tolist() for i, n in enumerate(lengths)]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)([{"input_ids": s} for s in seqs])
    assert batch["input_ids"].shape == (1, sum(lengths))
    packed = model(**batch, use_cache=False)  # transformers packs position_ids only without a KV cache
    packed.loss.backward()
    packed_grads = grads(model)
    packed_calls = list(spy)
    assert len(packed_calls) == tiny.n_attention_layers(model.config)
    # cu_seqlens from position_ids have one entry per token (empty sequences after the documents: no host read)
    assert all(sorted(set(c["cu_seqlens_q"])) == [0, 21, 30, 60] for c in packed_calls)

    model.zero_grad(set_to_none=True)
    n_targets = sum(n - 1 for n in lengths)
    total = 0.0
    per_seq_logits = []
    for s in seqs:
        ids = torch.tensor([s])
        out = model(input_ids=ids, labels=ids)
        per_seq_logits.append(out.logits[0].detach())
        total = total + out.loss * (len(s) - 1) / n_targets  # the packed loss is a mean over all targets
    total.backward()
    assert torch.allclose(packed.loss.detach(), total.detach(), rtol=1e-4, atol=0)
    assert_rel_close("logits", torch.cat(per_seq_logits), packed.logits[0].detach(), SAME_TOL)
    per_seq_grads = grads(model)
    assert all(torch.isfinite(g).all() for g in packed_grads.values())
    assert_rel_close("gradients", flat(per_seq_grads), flat(packed_grads), SAME_TOL)
    for n in attention_param_names(model):
        assert_rel_close(n, per_seq_grads[n], packed_grads[n], SAME_TOL)


def test_gradient_checkpointing_gives_the_same_gradients(spy):
    """Recomputation re-runs the op's forward: the same FP8 quantization, so the same gradients."""
    set_precision("fp8")
    ids = token_ids(2, 40, seed=8)
    model = tiny.build("qwen3", "deltamatch_fp8")
    model.train()
    lm_loss(model, ids).backward()
    plain = grads(model)
    model.zero_grad(set_to_none=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lm_loss(model, ids).backward()
    ckpt = grads(model)
    assert len(spy) == 2 + 2 * 2  # forward, then forward + recomputation with checkpointing
    assert set(plain) == set(ckpt)
    assert all(torch.equal(plain[n], ckpt[n]) for n in plain)


def test_packing_is_not_vacuous(spy):
    """Without boundaries (one long causal sequence) the packed logits differ: the test above would notice."""
    set_precision("bf16")
    model = tiny.build("llama", "deltamatch_fp8", dtype=torch.float32)
    seqs = [token_ids(1, n, seed=20 + i)[0] for i, n in enumerate([21, 9, 30])]
    with torch.no_grad():
        joined = model(input_ids=torch.cat(seqs)[None]).logits[0]
        alone = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
    assert spy[0]["cu_seqlens_q"] is None
    assert rel_err(alone, joined) > 0.05


# ----------------------------------------------------------------------------------------------------
# PEFT LoRA, fp32 models
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_peft_lora_adapter_gradients_flow_through_the_op(precision, spy):
    peft = pytest.importorskip("peft")
    set_precision(precision)
    ids = token_ids(2, 40, seed=6)
    lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0,
                init_lora_weights=False)  # random lora_B, so lora_A of q/k gets a nonzero gradient
    results = {}
    for attn in ("sdpa", "deltamatch_fp8"):
        torch.manual_seed(0)
        base = tiny.build("llama", attn)
        torch.manual_seed(1)
        model = peft.get_peft_model(base, peft.LoraConfig(**lora))
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        adapter = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
        assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
        results[attn] = adapter
    assert len(spy) == 2
    ours, ref = results["deltamatch_fp8"], results["sdpa"]
    assert set(ours) == set(ref) and len(ours) == 2 * 4 * 2
    for n, g in ours.items():
        assert g is not None and torch.isfinite(g).all() and g.abs().max() > 0, n
    qk = [n for n in ours if "q_proj" in n or "k_proj" in n]  # reach q/k only through the op's dq/dk
    for n in qk:
        measured_close(MEASURED, ("llama lora", precision), "qk_grads", ref[n], ours[n], "transformers")
    if precision == "fp8":
        assert any(rel_err(ref[n], ours[n]) > 1e-3 for n in qk)


def test_fp32_model_casts_to_bf16_and_back(spy):
    """An fp32 model (or PEFT's fp32 upcast) is cast to bf16 for the op, like transformers' flash path, and
    the attention output comes back in fp32."""
    set_precision("bf16")
    ids = token_ids(2, 32, seed=7)
    model = tiny.build("qwen3", "deltamatch_fp8", dtype=torch.float32)
    seen = []
    hooks = [m.self_attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
             for m in model.model.layers]
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    for h in hooks:
        h.remove()
    assert [c["dtype"] for c in spy] == [torch.bfloat16] * 2
    assert seen == [torch.float32] * 2 and out.logits.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters()
               if p.grad is not None)
    with torch.no_grad():
        ref = tiny.build("qwen3", "sdpa", dtype=torch.float32)(input_ids=ids).logits
    measured_close(MEASURED, ("qwen3 fp32", "bf16"), "logits", ref, out.logits.detach(), "transformers")


def test_fp32_inputs_under_autocast_use_the_autocast_dtype(spy):
    set_precision("bf16")
    model = tiny.build("llama", "deltamatch_fp8", dtype=torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=token_ids(1, 16)).logits
    assert all(c["dtype"] == torch.bfloat16 for c in spy) and len(spy) == 2
    assert torch.isfinite(logits).all()


# ----------------------------------------------------------------------------------------------------
# Unsupported inputs fail loudly, with a way out in the message
# ----------------------------------------------------------------------------------------------------


def test_attention_dropout_in_training_raises_but_eval_runs():
    model = tiny.build("llama", "deltamatch_fp8", attention_dropout=0.1)
    ids = token_ids(1, 16)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()  # eval: dropout is off, fine
    model.train()
    with pytest.raises(ValueError, match=r"dropout.*attention_dropout.*sdpa"):
        model(input_ids=ids)


def test_softcap_raises():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=50.0,
                          final_logit_softcapping=None, sliding_window=8, pad_token_id=0)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation("deltamatch_fp8")
    with pytest.raises(ValueError, match=r"softcap.*(eager|flex_attention)"):
        model(input_ids=token_ids(1, 16))


def test_head_dim_not_a_multiple_of_16_raises():
    model = tiny.build("llama", "deltamatch_fp8", head_dim=8, num_attention_heads=8, num_key_value_heads=8)
    with pytest.raises(ValueError, match=r"head dim 8 .*multiple of 16.*sdpa"):
        model(input_ids=token_ids(1, 16))


def test_output_attentions_raises():
    model = tiny.build("llama", "deltamatch_fp8")
    with pytest.raises(ValueError, match=r"attention weights.*eager"):
        model(input_ids=token_ids(1, 16), output_attentions=True)


def test_custom_4d_mask_raises():
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    module = torch.nn.Module()
    mask = torch.zeros(1, 1, 8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"4D mask.*sdpa"):
        integration.deltamatch_attention_forward(module, q, q, q, mask)
