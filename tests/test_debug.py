"""HF_DELTAMATCH_CHECK_FINITE (hf_deltamatch/debug.py): off by default; on, the first non-finite attention output
or gradient raises, naming the tensor, the layer, and whether the inputs were already non-finite."""

import pytest
import torch

import _tiny_models as T
from hf_deltamatch import DeltaMatchConfig, deltamatch_attention, reference
from hf_deltamatch.debug import ENV, NonFiniteError

CFG = DeltaMatchConfig(backend="reference")


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 64, 32, generator=g).to(torch.bfloat16).requires_grad_() for _ in range(3)]


def test_off_by_default_nan_passes_through(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    q, k, v = _qkv()
    out = deltamatch_attention(q, k, v, config=CFG)
    out.backward(torch.full_like(out, float("nan")))
    assert torch.isnan(q.grad).any()


def test_nonfinite_grad_out_is_reported_as_upstream(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    q, k, v = _qkv()
    out = deltamatch_attention(q, k, v, config=CFG)
    do = torch.randn_like(out)
    do[0, 1, 5, 3] = float("inf")
    with pytest.raises(NonFiniteError, match=r"dq of deltamatch_attention \(backward\).*dO .*non-finite.*upstream"):
        out.backward(do)


def test_nonfinite_v_fails_the_forward(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    q, k, v = _qkv()
    with torch.no_grad():
        v[0, 0, 10, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"out of deltamatch_attention \(forward\).*v [0-9.e+-]+ \(1 non-finite\)"
                                              r".*upstream"):
        deltamatch_attention(q, k, v, config=CFG)


def test_fault_in_attention_names_the_tensor_and_blames_attention(monkeypatch):
    """A backward that returns an inf in dK from finite inputs (injected): dq is checked first and is clean."""
    monkeypatch.setenv(ENV, "1")
    real = reference.backward

    def broken(*args, **kw):
        dq, dk, dv = real(*args, **kw)
        dk = dk.clone()
        dk[0, 1, 7, 2] = float("inf")
        return dq, dk, dv

    monkeypatch.setattr(reference, "backward", broken)
    q, k, v = _qkv()
    out = deltamatch_attention(q, k, v, config=CFG)
    with pytest.raises(NonFiniteError, match=r"dk .*1 non-finite values \(first at \[0, 1, 7, 2\]; nan 0, \+inf 1, "
                                              r"-inf 0\).*every input is finite"):
        out.backward(torch.randn_like(out))


def test_transformers_layer_is_named(monkeypatch):
    monkeypatch.setenv(ENV, "1")
    model = T.build("llama", "deltamatch_fp8", dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight[0, 0] = float("nan")
    ids = torch.randint(3, T.VOCAB, (1, 24))
    with pytest.raises(NonFiniteError, match=r"in layer 1 \(LlamaAttention\) \(forward\)"):
        model(ids)


def test_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(ENV, "maybe")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="set it to 1"):
        deltamatch_attention(q, k, v, config=CFG)
