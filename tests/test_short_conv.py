"""Gated DeltaNet's short convolution keeps packed documents apart (hf_deltamatch/training/short_conv.py).

The oracle is transformers' own torch `causal_conv1d_fn` run on each document alone. Tolerances:
- float64: 1e-12 (the recomputed positions sum the same K products in another order);
- bf16: one bf16 rounding of the output (rtol 2^-7), against the per-document conv in bf16; against the float64
  reference 2^-7 relative to the output scale, the inputs' own bf16 rounding included.
End to end, flash-linear-attention (absent on CPU) is stood in for by its contract, the varlen gated delta rule:
transformers' torch rule run on each document of `cu_seqlens`, so the conv is the only thing that could mix them.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next

from _recipe_helpers import TINY_MODEL
from hf_deltamatch.training.data import PackedCollator
from hf_deltamatch.training.modeling import keep_short_conv_documents_apart
from hf_deltamatch.training.short_conv import (boundaries_from_seq_idx, describe, document_aware,
                                               packed_causal_conv1d, seq_idx_from_boundaries)

sys.path.insert(0, os.path.dirname(__file__))
import _tiny_models as tiny  # noqa: E402

TORCH_CONV = modeling_qwen3_5.causal_conv1d_fn.__wrapped__  # transformers' torch fallback itself
WIDTH = 4
# documents of length 1, 2, K - 1, K, long, an empty one, and a short one last
LENGTHS = {"mixed": [5, 1, 2, 3, 4, 0, 40, 2], "short_first": [1, 1, 3, 57], "one_doc": [37]}


def _cu(lengths):
    return torch.tensor([0, *lengths]).cumsum(0)


def _per_document(x, weight, bias, lengths, activation):
    cu = _cu(lengths).tolist()
    return torch.cat([TORCH_CONV(x[:, :, s:e], weight, bias, activation) for s, e in zip(cu[:-1], cu[1:]) if e > s],
                     dim=-1)


def _inputs(n_tokens, dtype, channels=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, n_tokens, channels, generator=g).transpose(1, 2)  # channel-last, as the layers pass it
    weight, bias = torch.randn(channels, WIDTH, generator=g), torch.randn(channels, generator=g)
    return x.to(dtype), weight.to(dtype), bias.to(dtype)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_packed_conv_equals_per_document_conv_float64(lengths, activation):
    x, w, b = _inputs(sum(lengths), torch.float64)
    out = packed_causal_conv1d(x, w, b, _cu(lengths), activation)
    torch.testing.assert_close(out, _per_document(x, w, b, lengths, activation), atol=1e-12, rtol=1e-12)
    out_no_bias = packed_causal_conv1d(x, w, None, _cu(lengths), activation)
    torch.testing.assert_close(out_no_bias, _per_document(x, w, None, lengths, activation), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_packed_conv_equals_per_document_conv_bf16(lengths):
    x, w, b = _inputs(sum(lengths), torch.bfloat16)
    out = packed_causal_conv1d(x, w, b, _cu(lengths), "silu")
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _per_document(x, w, b, lengths, "silu"), atol=1e-2, rtol=2 ** -7)
    ref = _per_document(x.double(), w.double(), b.double(), lengths, "silu")
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2 ** -7, err


def test_bf16_autocast_recomputes_on_the_conv_operands():
    """Under autocast the conv runs on bf16 operands from fp32 weights; the recomputed positions do the same."""
    lengths = [3, 1, 20, 2, 6]
    x, w, b = _inputs(sum(lengths), torch.float32)
    x = x.to(torch.bfloat16)  # the in-projection's output under autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = packed_causal_conv1d(x, w, b, _cu(lengths), "silu")
        alone = _per_document(x, w, b, lengths, "silu")
    assert out.dtype == alone.dtype == torch.bfloat16
    torch.testing.assert_close(out, alone, atol=1e-2, rtol=2 ** -7)


@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_packed_conv_gradient_equals_per_document_gradient(lengths):
    x, w, b = _inputs(sum(lengths), torch.float64, seed=1)
    grad_out = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (lambda *a: packed_causal_conv1d(*a, _cu(lengths), "silu"),
               lambda *a: _per_document(*a, lengths, "silu")):
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        grads.append(torch.autograd.grad(fn(*leaves), leaves, grad_out))
    for name, packed, alone in zip(("x", "weight", "bias"), *grads):
        torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-12, msg=lambda m: f"d{name}: {m}")


def test_calls_without_boundaries_are_the_original_function_bit_for_bit():
    wrapped = document_aware(modeling_qwen3_5.causal_conv1d_fn)
    assert document_aware(wrapped) is wrapped  # idempotent
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = _inputs(50, dtype)
        for kwargs in ({}, {"position_ids": torch.arange(50)[None]}):
            assert torch.equal(wrapped(x, w, b, activation="silu", **kwargs),
                               modeling_qwen3_5.causal_conv1d_fn(x, w, b, activation="silu", **kwargs))


def test_wrapped_function_takes_boundaries_from_cu_seq_lens_or_seq_idx():
    lengths = [7, 2, 30]
    x, w, b = _inputs(sum(lengths), torch.float64)
    wrapped = document_aware(modeling_qwen3_5.causal_conv1d_fn)
    alone = _per_document(x, w, b, lengths, "silu")
    cu = _cu(lengths).to(torch.int32)
    torch.testing.assert_close(wrapped(x, w, b, activation="silu", cu_seq_lens_q=cu, max_length_q=30), alone,
                               atol=1e-12, rtol=1e-12)
    seq_idx = seq_idx_from_boundaries(cu)
    assert seq_idx.tolist() == [[0] * 7 + [1] * 2 + [2] * 30] and seq_idx.dtype == torch.int32
    assert boundaries_from_seq_idx(seq_idx).tolist() == cu.tolist()
    # transformers' own wrapper refuses seq_idx without causal-conv1d; the document-aware one uses it
    torch.testing.assert_close(wrapped(x, w, b, activation="silu", seq_idx=seq_idx), alone, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="packed"):
        modeling_qwen3_5.causal_conv1d_fn(x, w, b, activation="silu", seq_idx=seq_idx)


def test_bad_boundaries_raise():
    x, w, b = _inputs(10, torch.float32)
    wrapped = document_aware(modeling_qwen3_5.causal_conv1d_fn)
    with pytest.raises(ValueError, match="batch 2"):
        wrapped(x.expand(2, -1, -1), w, b, activation="silu", cu_seq_lens_q=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match="row length 10"):
        wrapped(x, w, b, activation="silu", cu_seq_lens_q=torch.tensor([0, 4, 9]))


def test_describe_says_what_runs():
    assert describe(modeling_qwen3_5.causal_conv1d_fn) == \
        "torch conv1d over the whole packed row (not restarted at document starts)"
    from hf_deltamatch.training import short_conv

    expect = ("flash-linear-attention's Triton causal_conv1d with cu_seqlens on CUDA" if short_conv.fla_causal_conv1d()
              else "torch conv1d, restarted at every packed document start")
    assert describe(document_aware(modeling_qwen3_5.causal_conv1d_fn)).startswith(expect)


# ---------------------------------------------------------------------------------------------------------
# End to end: tiny hybrids whose gated delta rule keeps documents apart the way FLA's varlen kernel does
# ---------------------------------------------------------------------------------------------------------


def _varlen_rule(torch_rule):
    """The contract of FLA's chunk_gated_delta_rule(cu_seqlens=...): the rule restarted at every document."""
    def rule(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        if cu_seqlens is None:
            return torch_rule(query, key, value, g, beta, **kwargs)
        cu = cu_seqlens.tolist()
        outs = [torch_rule(query[:, s:e], key[:, s:e], value[:, s:e], g[:, s:e], beta[:, s:e], **kwargs)[0]
                for s, e in zip(cu[:-1], cu[1:]) if e > s]
        return torch.cat(outs, dim=1), None

    return rule


def _qwen3_5():
    spec = dict(TINY_MODEL)
    return AutoConfig.for_model(spec.pop("model_type"), vocab_size=97, **spec)


FAMILIES = {"qwen3_5": (_qwen3_5, modeling_qwen3_5),
            "qwen3_next": (lambda: tiny.qwen3_next_config(vocab_size=97), modeling_qwen3_next)}


@pytest.fixture(params=FAMILIES.values(), ids=FAMILIES.keys())
def hybrid(request, monkeypatch):
    """(model with FLA's varlen rule standing in, its modeling module); the module's functions restored after."""
    make_config, module = request.param
    monkeypatch.setattr(module, "causal_conv1d_fn", module.causal_conv1d_fn)  # restored at teardown
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule",
                        _varlen_rule(module.torch_chunk_gated_delta_rule.__wrapped__))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(), attn_implementation="sdpa", dtype=torch.float32)
    tiny._perturb_norms(model, 0)
    return model.eval(), module


def _docs(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=g) for n in lengths]


def _packed_logits(model, docs, position_ids_only=False):
    batch = PackedCollator()([{"input_ids": torch.cat(docs).tolist(), "doc_lens": [len(d) for d in docs]}])
    keys = ("input_ids", "position_ids") if position_ids_only else [k for k in batch if k != "labels"]
    device = next(model.parameters()).device
    with torch.no_grad():
        return model(**{k: batch[k].to(device) if torch.is_tensor(batch[k]) else batch[k] for k in keys},
                     use_cache=False).logits[0]


def test_packed_hybrid_equals_per_document_only_with_the_conv_made_document_aware(hybrid):
    model, module = hybrid
    docs = _docs([9, 1, 2, 3, 25])
    with torch.no_grad():
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    leaky = _packed_logits(model, docs)
    assert (leaky[9:] - alone[9:]).abs().max() > 1e-3  # the whole-row conv mixes documents (the bug)
    assert keep_short_conv_documents_apart(model, force=True) == 1
    assert getattr(module.causal_conv1d_fn, "_hf_dm_documents", False)
    # fp32 through the layers in other matmul shapes (one 40-token row vs five documents): 4e-5 apart on an AMD EPYC
    # for qwen3_next (logits up to 5.9), 7e-7 for qwen3_5; the leak this catches is 0.35-9
    torch.testing.assert_close(_packed_logits(model, docs), alone, atol=1e-4, rtol=1e-4)
    # transformers versions that forward no boundaries to the layer: the backbone pre-hook supplies them
    torch.testing.assert_close(_packed_logits(model, docs, position_ids_only=True), alone, atol=1e-4, rtol=1e-4)
    assert keep_short_conv_documents_apart(model, force=True) == 0  # already covered


def test_perturbing_one_document_leaves_the_next_documents_conv_unchanged(hybrid, monkeypatch):
    model, module = hybrid
    keep_short_conv_documents_apart(model, force=True)
    seen = []
    patched = module.causal_conv1d_fn

    def record(*args, **kwargs):
        out = patched(*args, **kwargs)
        seen.append(out.detach().clone())
        return out

    monkeypatch.setattr(module, "causal_conv1d_fn", record)
    docs = _docs([12, 2, 20])
    other = [torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(9)), docs[1], docs[2]]
    _packed_logits(model, docs)
    _packed_logits(model, other)
    first, second = seen
    assert not torch.equal(first[:, :, :12], second[:, :, :12])  # document 1 did change
    assert torch.equal(first[:, :, 12:], second[:, :, 12:])  # documents 2 and 3: not a bit moved


def test_benchmark_script_runs(capsys):
    from _scripts import ROOT, script_module

    with script_module(ROOT / "benchmarks" / "short_conv.py", "bench_short_conv") as bench:
        bench.main(["--channels", "16", "--tokens", "64", "--docs", "5", "--device", "cpu", "--reps", "1"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["mode"] for r in rows] == ["forward", "forward_backward"]
    assert all(r["plain_ms"] > 0 and r["per_document_ms"] > 0 for r in rows)


def test_no_gradient_crosses_a_document_boundary(hybrid):
    """Backward through the patched layer: document 2's logits have exactly zero gradient on document 1's inputs
    (without the patch, the conv's taps carry one)."""
    model, _ = hybrid
    docs = _docs([10, 3, 15])
    batch = PackedCollator()([{"input_ids": torch.cat(docs).tolist(), "doc_lens": [10, 3, 15]}])
    kwargs = {k: v for k, v in batch.items() if k not in ("labels", "input_ids")}

    def grad_on_first_document():
        embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_()
        model(inputs_embeds=embeds, **kwargs, use_cache=False).logits[0, 10:].sum().backward()
        return embeds.grad[0, :10]

    assert grad_on_first_document().abs().max() > 0  # the leak, backward
    keep_short_conv_documents_apart(model, force=True)
    assert torch.count_nonzero(grad_on_first_document()) == 0


# ---------------------------------------------------------------------------------------------------------
# GPU: the real flash-linear-attention layer, and the causal-conv1d kernel's seq_idx where installed
# ---------------------------------------------------------------------------------------------------------


def _fla_resolved() -> bool:
    from hf_deltamatch.training.modeling import fla_available, gdn_backend

    return torch.cuda.is_available() and fla_available() and gdn_backend() == "fla"


@pytest.mark.gpu
@pytest.mark.skipif(not _fla_resolved(), reason="needs CUDA and flash-linear-attention resolved by transformers")
def test_real_fla_layer_keeps_packed_documents_apart(monkeypatch):
    """The FLA-run Qwen3.5 hybrid as the recipe runs it (fp32 weights, bf16 autocast; FLA refuses fp32): packed ==
    per-document logits once the conv is document-aware, and changing document 1 leaves the others' logits alone.
    Tolerance 6e-2 on logits of scale ~3: bf16 rounding of GEMMs of other shapes (measured on CPU with the torch
    rule standing in for FLA: 4e-3; on the H200 with FLA up to 0.047 in 2 of 19982 logits, 3 bf16 steps at that
    scale; the leak it catches: 0.66)."""
    monkeypatch.setattr(modeling_qwen3_5, "causal_conv1d_fn", modeling_qwen3_5.causal_conv1d_fn)
    spec = dict(TINY_MODEL, linear_key_head_dim=64, linear_value_head_dim=64, hidden_size=128)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=97, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    tiny._perturb_norms(model, 0)
    model = model.cuda().eval()
    docs = _docs([70, 1, 2, 3, 130])
    other = [torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(9)), *docs[1:]]
    tol = dict(atol=6e-2, rtol=3e-2)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        alone = torch.cat([model(input_ids=d[None].cuda(), use_cache=False).logits[0] for d in docs]).float()
        leaky = _packed_logits(model, docs).float()
        assert keep_short_conv_documents_apart(model) == 1
        packed = _packed_logits(model, docs).float()
        changed = _packed_logits(model, other).float()
    torch.testing.assert_close(packed, alone, **tol)
    assert (leaky[70:] - alone[70:]).abs().max() > 5 * tol["atol"]  # without it, the leak shows
    torch.testing.assert_close(changed[70:], packed[70:], **tol)
    assert (changed[:70] - packed[:70]).abs().max() > 5 * tol["atol"]  # document 1 did change


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_causal_conv1d_kernel_with_seq_idx_matches_exact_per_document_conv():
    """Where transformers resolved the causal-conv1d CUDA kernel, packed calls get seq_idx; its output must
    equal the exact per-document conv (bf16 output rounding: rtol 2^-7)."""
    wrapped = document_aware(modeling_qwen3_5.causal_conv1d_fn)
    if wrapped._hf_dm_kind != "causal_conv1d":
        pytest.skip("transformers did not resolve the causal-conv1d kernel (package not installed)")
    lengths = [5, 1, 2, 3, 300, 17]
    x, w, b = (t.cuda() for t in _inputs(sum(lengths), torch.bfloat16, channels=256))
    out = wrapped(x, w, b, activation="silu", cu_seq_lens_q=_cu(lengths).to(torch.int32).cuda())
    torch.testing.assert_close(out, packed_causal_conv1d(x, w, b, _cu(lengths).cuda(), "silu"), atol=1e-2,
                               rtol=2 ** -7)


# ---------------------------------------------------------------------------------------------------------
# flash-linear-attention's Triton conv: packed calls on CUDA where FLA is installed (short_conv.USE_FLA_CONV)


def _fla_conv_single_config():
    """FLA's Triton causal conv with one config per autotuned kernel (the interpreter cannot autotune), or skip."""
    pytest.importorskip("einops")
    fla_conv = pytest.importorskip("fla.modules.causal_conv1d.ops")
    from triton.runtime.autotuner import Autotuner, Heuristics

    if os.environ.get("TRITON_INTERPRET") == "1":
        for name in dir(fla_conv):
            obj = getattr(fla_conv, name)
            while isinstance(obj, (Autotuner, Heuristics)):
                if isinstance(obj, Autotuner):
                    obj.configs = obj.configs[:1]
                obj = obj.fn
    return fla_conv.causal_conv1d


def test_packed_calls_on_cuda_take_fla_conv_in_place(monkeypatch):
    """Where FLA applies (CUDA, FLA installed, USE_FLA_CONV), a packed call goes to FLA's conv with the layer's
    channel-last activations read in place (no transpose copy), int32 cu_seqlens and the activation, and returns a
    transposed view of FLA's channel-last output (the layer's transpose back is then free); calls without
    boundaries stay the original function's. FLA is stood in for by the exact packed conv in its layout."""
    from hf_deltamatch.training import short_conv

    calls = []

    def fake_fla(x, weight, bias, activation=None, cu_seqlens=None):
        calls.append((x, cu_seqlens, activation))
        out = packed_causal_conv1d(x.transpose(1, 2), weight, bias, cu_seqlens, activation)
        return out.transpose(1, 2).contiguous(), None  # FLA's layout: channel-last

    monkeypatch.setattr(short_conv, "fla_causal_conv1d", lambda: fake_fla)
    monkeypatch.setattr(short_conv, "_fla_applies", lambda x: short_conv.USE_FLA_CONV)
    lengths = [5, 1, 2, 3, 40]
    x, w, b = _inputs(sum(lengths), torch.float64)
    wrapped = document_aware(modeling_qwen3_5.causal_conv1d_fn)
    out = wrapped(x, w, b, activation="silu", cu_seq_lens_q=_cu(lengths))
    torch.testing.assert_close(out, _per_document(x, w, b, lengths, "silu"), atol=1e-12, rtol=1e-12)
    (xin, cu, act), = calls
    assert xin.is_contiguous() and xin.data_ptr() == x.data_ptr() and xin.shape == (1, sum(lengths), 24)
    assert cu.dtype == torch.int32 and cu.tolist() == _cu(lengths).tolist() and act == "silu"
    assert out.transpose(1, 2).is_contiguous()
    assert torch.equal(wrapped(x, w, b, activation="silu"), modeling_qwen3_5.causal_conv1d_fn(x, w, b, "silu"))
    assert len(calls) == 1  # no boundaries: the original function
    with pytest.raises(ValueError, match="silu or no activation"):
        wrapped(x, w, b, activation="gelu", cu_seq_lens_q=_cu(lengths))
    with pytest.raises(ValueError, match="row length"):
        wrapped(x, w, b, activation="silu", cu_seq_lens_q=torch.tensor([0, 4, 9]))
    monkeypatch.setattr(short_conv, "USE_FLA_CONV", False)  # switched off: the torch conv
    torch.testing.assert_close(wrapped(x, w, b, activation="silu", cu_seq_lens_q=_cu(lengths)), out,
                               atol=1e-12, rtol=1e-12)
    assert len(calls) == 1


@pytest.mark.parametrize("activation", ["silu", None])
def test_fla_conv_equals_exact_packed_conv_with_gradients(activation):
    """FLA's Triton causal conv (the interpreter on CPU, the kernel on CUDA) against packed_causal_conv1d in fp32,
    documents of 1, K - 1 and longer, forward and the gradients of x, weight and bias: 1e-5 (fp32 sums of 4
    products in another order; measured ≤ 8e-6)."""
    fla_conv = _fla_conv_single_config()
    from hf_deltamatch.training import short_conv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    lengths = [50, 1, 3, 76, 70]
    x, w, b = (t.to(device).requires_grad_() for t in _inputs(sum(lengths), torch.float32, channels=64))
    cu = _cu(lengths).to(device)
    try:
        short_conv.fla_causal_conv1d, saved = (lambda: fla_conv), short_conv.fla_causal_conv1d
        got = short_conv.fla_packed_causal_conv1d(x, w, b, cu, activation)
    finally:
        short_conv.fla_causal_conv1d = saved
    ref = packed_causal_conv1d(x, w, b, cu, activation)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(got, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_conv_under_autocast_matches_the_torch_conv_on_gpu():
    """As the recipes run it (bf16 activations, fp32 weights, bf16 autocast): FLA's conv against the torch packed
    conv, output and gradients within bf16 rounding: each output within 2^-7 of its own size plus 2^-7 of its terms'
    (sum |w| |x| + |b|: autocast hands the torch conv bf16 weights, FLA keeps them fp32, so where the taps cancel
    the difference is a share of the terms, not of the output: rtol 2^-6 alone failed 27 of 2.1M outputs on the
    H200, by up to 0.031); 2e-2 relative on gradients, which the two sum over T in different orders and precisions
    (in the interpreter at 64 channels: 1 ulp on the output, 0.5 % on the gradients)."""
    fla_conv = _fla_conv_single_config()
    from hf_deltamatch.training import short_conv

    lengths = [5, 1, 2, 3, 3000, 17, 1100]
    x, w, b = _inputs(sum(lengths), torch.float32, channels=512)
    x = x.cuda().bfloat16().requires_grad_()
    w, b = w.cuda().requires_grad_(), b.cuda().requires_grad_()
    cu = _cu(lengths).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = short_conv.fla_packed_causal_conv1d(x, w, b, cu, "silu")
        ref = packed_causal_conv1d(x, w, b, cu, "silu")
    assert got.dtype == ref.dtype == torch.bfloat16 and fla_conv is not None
    terms = packed_causal_conv1d(x.detach().float().abs(), w.detach().abs(), b.detach().abs(), cu)
    diff = (got.float() - ref.float()).abs()
    assert (diff <= 2 ** -7 * (terms + ref.float().abs()) + 1e-3).all(), diff.max()
    g = torch.randn_like(ref)
    for a, r in zip(torch.autograd.grad(got, (x, w, b), g), torch.autograd.grad(ref, (x, w, b), g)):
        assert ((a.float() - r.float()).norm() / r.float().norm()).item() < 2e-2
