"""The differential harness: every transformers attention pattern either matches eager or raises.

For each model family with a distinct attention pattern (tests/_pattern_models.py) and each kind of input
(padding on either side, all-padding rows, packed rows by position_ids or by cu_seq_lens with one or two rows,
decoding with a KV cache, training), `deltamatch_fp8` in bf16 mode is compared with transformers' own eager
attention on the same weights (fp32 weights: only the op's bf16 rounding of q, k, v, P and dS separates them), or the
call must raise the error listed in UNSUPPORTED. Packed rows given as cu_seq_lens are compared with each document
run alone (eager attention ignores cu_seq_lens).

Tolerances (relative Frobenius error on the real tokens' logits, and on all parameter gradients): bf16 rounds to 8
bits (2^-9 relative), which the softmax and two layers carry to ~5e-3 on these models (measured: logits <= 4.3e-3,
gradients <= 1.1e-2); bounds 1e-2 and 2.5e-2. A wrong mask is no rounding: tokens that see one wrong key move their
logits by more than 0.05 (test_the_comparison_sees_a_wrong_mask).
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

import hf_deltamatch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
import _pattern_models as pm  # noqa: E402

LOGITS_TOL, GRAD_TOL = 1e-2, 2.5e-2

# (family, input) -> the error: what the op cannot run, refused by name (README's integration section lists these)
UNSUPPORTED = {
    ("llama4_chunked", "decode"): "chunked attention over a KV cache",
    **{("gemma3_bidirectional", i): "union of mask patterns" for i in ("plain", "right-pad")},
    **{("modernbert", i): "bidirectional sliding window" for i in ("plain", "right-pad", "all-pad-row")},
    **{("t5", i): "additive position bias" for i in ("plain", "enc-right-pad", "dec-longer", "decode")},
    ("gemma3_vlm", "images"): "union of mask patterns",
}

CAUSAL_INPUTS = ("plain", "left-pad", "right-pad", "all-pad-row", "packed-positions-b1", "packed-positions-b2",
                 "packed-cu-b1", "packed-cu-b2", "packed-cu-only-b2", "decode", "train-plain", "train-left-pad",
                 "train-packed-b2")
# inputs a family cannot take for reasons outside the attention op
NOT_APPLICABLE = {
    # transformers' torch Gated DeltaNet refuses cu_seq_lens (it runs before the attention layer)
    ("qwen3_next", "packed-cu-b1"), ("qwen3_next", "packed-cu-b2"), ("qwen3_next", "packed-cu-only-b2"),
}
INPUTS = {
    "causal": CAUSAL_INPUTS,
    "encoder": ("plain", "right-pad", "all-pad-row"),
    "seq2seq": ("plain", "enc-right-pad", "dec-longer", "decode"),
    "vlm": ("text", "images"),
}
CASES = [(f, i) for f, (_, kind) in pm.FAMILIES.items() for i in INPUTS[kind]
         if (f, i) not in NOT_APPLICABLE and not (f == "gemma3_bidirectional" and i not in ("plain", "right-pad"))]


def ids(b, n, seed=0, vocab=pm.VOCAB):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab - 3, (b, n), generator=g)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def padded(lengths, side, seed=0):
    """Rows of the given lengths padded to the longest on `side`: ids, attention_mask, position_ids (positions of
    the real tokens from 0, as generate() makes them)."""
    L = max(lengths)
    x, mask = torch.zeros(len(lengths), L, dtype=torch.long), torch.zeros(len(lengths), L, dtype=torch.long)
    for r, n in enumerate(lengths):
        sl = slice(0, n) if side == "right" else slice(L - n, L)
        x[r, sl], mask[r, sl] = ids(1, n, seed + r)[0], 1
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    return x, mask, pos


def packed_rows(rows, seed=0):
    """Rows of documents of the given lengths: ids, position_ids restarting at every document."""
    x = torch.cat([torch.cat([ids(1, n, seed + 10 * r + d)[0] for d, n in enumerate(docs)])[None]
                   for r, docs in enumerate(rows)])
    pos = torch.cat([torch.cat([torch.arange(n) for n in docs])[None] for docs in rows])
    return x, pos


# ----------------------------------------------------------------------------------------------------
# One case: the model's outputs (and gradients) on an input, for an attention implementation
# ----------------------------------------------------------------------------------------------------


def grads_of(model):
    return torch.cat([p.grad.flatten() for _, p in sorted(model.named_parameters()) if p.grad is not None])


def run_causal(model, kind):
    """(values to compare: a list of tensors, or ("doc", ...) for the per-document oracle)."""
    if kind == "plain":
        return [model(input_ids=ids(2, 24), use_cache=False).logits]
    if kind in ("left-pad", "right-pad", "all-pad-row"):
        lengths = [24, 17, 9] if kind != "all-pad-row" else [20, 0]
        x, mask, pos = padded(lengths, "left" if kind == "left-pad" else "right")
        logits = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=False).logits
        return [logits[mask.bool()]]
    if kind in ("packed-positions-b1", "packed-positions-b2"):
        rows = [[10, 5, 9]] if kind.endswith("b1") else [[10, 5, 9], [3, 21]]
        x, pos = packed_rows(rows)
        return [model(input_ids=x, position_ids=pos, use_cache=False).logits]
    if kind.startswith("packed-cu"):
        rows = [[10, 5, 9]] if kind.endswith("b1") else [[10, 5, 9], [3, 21]]
        x, pos = packed_rows(rows)
        lengths = [n for docs in rows for n in docs]
        cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
        # "-only": flash-attention's kwargs alone (the model's positions run on through the row, its masks pack
        # nothing), as a collator that returns no position_ids gives them
        positions = {} if "-only" in kind else {"position_ids": pos}
        out = model(input_ids=x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                    max_length_k=max(lengths), use_cache=False, **positions).logits
        return [out.reshape(-1, out.shape[-1])]
    if kind == "decode":  # prefill a left-padded batch, then one token through the KV cache
        x, mask, pos = padded([20, 13], "left")
        out = model(input_ids=x, attention_mask=mask, position_ids=pos, use_cache=True)
        grown = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        step = model(input_ids=ids(2, 1, seed=7), attention_mask=grown,
                     position_ids=pos[:, -1:] + 1, past_key_values=out.past_key_values, use_cache=True)
        return [out.logits[mask.bool()], step.logits]
    if kind.startswith("train-"):
        model.train()
        model.zero_grad(set_to_none=True)
        if kind == "train-plain":
            x = ids(2, 24)
            out = model(input_ids=x, labels=x, use_cache=False)
        elif kind == "train-left-pad":
            x, mask, pos = padded([24, 17, 9], "left")
            # no target predicted from a padding position (the first real token's): what a padding row outputs is
            # undefined (eager's rows of all-masked scores see every key, the op's padding sees only padding)
            first_real = (mask.cumsum(1) == 1) & (mask == 1)
            out = model(input_ids=x, attention_mask=mask, position_ids=pos,
                        labels=x.masked_fill((mask == 0) | first_real, -100), use_cache=False)
            out.loss.backward()
            return [out.logits.detach()[mask.bool()], grads_of(model)]
        else:
            x, pos = packed_rows([[10, 5, 9], [3, 21]])
            out = model(input_ids=x, position_ids=pos, labels=x, use_cache=False)
        out.loss.backward()
        return [out.logits.detach(), grads_of(model)]
    raise AssertionError(kind)


def per_document_oracle(model, kind):
    """Each document alone (the packed cu_seq_lens inputs' ground truth)."""
    rows = [[10, 5, 9]] if kind.endswith("b1") else [[10, 5, 9], [3, 21]]
    x, pos = packed_rows(rows)
    outs = []
    for r, docs in enumerate(rows):
        at = 0
        for n in docs:
            # each document at the positions the packed call gave it: from 0, or where it sits in its row ("-only")
            start = at if "-only" in kind else 0
            outs.append(model(input_ids=x[r, at:at + n][None], position_ids=torch.arange(start, start + n)[None],
                              use_cache=False).logits[0])
            at += n
    return [torch.cat(outs)]


def run_encoder(model, kind):
    if kind == "plain":
        return [model(input_ids=ids(2, 20)).logits]
    lengths = [20, 11] if kind == "right-pad" else [20, 0]
    x, mask, _ = padded(lengths, "right")
    return [model(input_ids=x, attention_mask=mask).logits[mask.bool()]]


def run_seq2seq(model, kind):
    enc_lengths = [12, 12] if kind == "plain" else [12, 7]
    x, mask, _ = padded(enc_lengths, "right")
    dec = ids(2, 20 if kind == "dec-longer" else 7, seed=5)
    if kind == "decode":
        out = model(input_ids=x, attention_mask=mask, decoder_input_ids=dec, use_cache=True)
        step = model(encoder_outputs=(out.encoder_last_hidden_state,), attention_mask=mask,
                     decoder_input_ids=ids(2, 1, seed=9), past_key_values=out.past_key_values, use_cache=True)
        return [out.logits, step.logits]
    return [model(input_ids=x, attention_mask=mask, decoder_input_ids=dec).logits]


def run_vlm(model, kind):
    x = ids(1, 20, vocab=290)
    if kind == "text":
        return [model(input_ids=x, use_cache=False).logits]
    x[0, 5:9] = 299
    return [model(input_ids=x, pixel_values=torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(3)),
                  token_type_ids=(x == 299).long(), use_cache=False).logits]


RUN = {"causal": run_causal, "encoder": run_encoder, "seq2seq": run_seq2seq, "vlm": run_vlm}


@pytest.fixture(autouse=True)
def _bf16_mode():
    hf_deltamatch.set_default_config(hf_deltamatch.get_default_config().replace(precision="bf16"))


@pytest.fixture
def calls(monkeypatch):
    """Counts the op's calls from the integration, so that no comparison passes because the model never used it."""
    from hf_deltamatch.integrations import transformers as integration

    seen = []
    real = integration.deltamatch_attention

    def counting(*a, **kw):
        seen.append(kw.get("cu_seqlens_q") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(integration, "deltamatch_attention", counting)
    return seen


@pytest.mark.parametrize("family, kind", CASES, ids=[f"{f}-{i}" for f, i in CASES])
def test_matches_eager_or_raises(family, kind, calls):
    model_kind = pm.FAMILIES[family][1]
    ours = pm.build(family, "deltamatch_fp8")
    if (family, kind) in UNSUPPORTED:
        with pytest.raises(ValueError, match=UNSUPPORTED[(family, kind)]):
            RUN[model_kind](ours, kind)
        return
    got = RUN[model_kind](ours, kind)
    assert calls, "the model never called deltamatch_attention"
    # (packed rows by position_ids reach it packed where transformers' masks pack them: not gpt-oss's, whose masks
    # ignore position_ids, so that eager attention and the op both let its documents see each other)
    if kind.startswith(("left-pad", "right-pad", "all-pad", "packed-cu", "enc-right-pad", "dec-longer")):
        assert any(calls), "a padded or packed input must reach the op as packed sequences"
    eager = pm.build(family, "eager")
    want = per_document_oracle(eager, kind) if kind.startswith("packed-cu") else RUN[model_kind](eager, kind)
    for i, (a, b) in enumerate(zip(got, want)):
        tol = GRAD_TOL if kind.startswith("train") and i == 1 else LOGITS_TOL
        assert torch.isfinite(a).all()
        assert rel(a, b) <= tol, (i, rel(a, b))


def test_the_comparison_sees_a_wrong_mask(monkeypatch):
    """Running every packed row as one sequence (documents seeing each other) fails the comparison by far."""
    from hf_deltamatch.integrations import masks

    monkeypatch.setattr(masks, "segments", lambda f, b, n, device: torch.zeros(b, n, dtype=torch.int32))
    got = run_causal(pm.build("qwen3", "deltamatch_fp8"), "packed-positions-b2")[0]
    want = run_causal(pm.build("qwen3", "eager"), "packed-positions-b2")[0]
    assert rel(got, want) > 0.05


def test_unsupported_table_is_in_the_readme():
    """README's integration section lists what raises, as this harness checks it."""
    root = os.path.join(os.path.dirname(__file__), "..")
    readme = open(os.path.join(root, "README.md")).read()
    doc = open(os.path.join(root, "docs", "transformers.md")).read()
    for (family, kind), message in UNSUPPORTED.items():
        assert re.search(message, readme), message
        assert f"`{family}`" in doc and re.search(message, doc), (family, message)
