"""torch.compile(fullgraph=True) traces every supported call of the op, static and dynamic shapes, with the same bits
as eager: a data-dependent read (cu_seqlens' values, a host-side check) would break the graph and fail here."""

import pytest
import torch

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention

CFG = DeltaMatchConfig(precision="fp8", backend="reference")

CALLS = {
    "causal": dict(),
    "full": dict(causal=False),
    "window": dict(window=24),
    "gqa": dict(hkv=1),
    "mla": dict(dv=16),
    "sinks": dict(sinks=True),
    "packed": dict(cu=[0, 20, 21, 64]),
    "packed-empty-seqs": dict(cu=[0, 0, 30, 30, 64, 64]),
    "lse": dict(return_lse=True),
    "rotation": dict(config=CFG.replace(qk_rotation="hadamard")),
    "bf16": dict(config=CFG.replace(precision="bf16")),
}


def run(fn, n=64, hq=2, hkv=2, d=32, dv=32, causal=True, window=None, sinks=False, cu=None, return_lse=False,
        config=CFG):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(1, hq, n, d), mk(1, hkv, n, d), mk(1, hkv, n, dv)
    s = torch.linspace(-1, 1, hq).requires_grad_() if sinks else None
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    out = fn(q, k, v, s, cu_t, causal, window, return_lse, config)
    out, lse = out if return_lse else (out, None)
    loss = out.float().square().sum() + (0 if lse is None else lse.sum())
    loss.backward()
    return [out.detach()] + [t.grad for t in (q, k, v, s) if t is not None]


def op(q, k, v, s, cu, causal, window, return_lse, config):
    return deltamatch_attention(q, k, v, causal=causal, window=window, sinks=s, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                return_lse=return_lse, config=config)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("call", list(CALLS))
def test_fullgraph_traces_and_matches_eager(call, dynamic):
    torch._dynamo.reset()
    eager = run(op, **CALLS[call])
    compiled = run(torch.compile(op, backend="aot_eager", fullgraph=True, dynamic=dynamic), **CALLS[call])
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("inputs", ["plain", "padded", "packed-positions", "packed-cu"])
def test_model_traces_whole_and_matches_eager(inputs):
    """A transformers model's forward and backward under torch.compile(fullgraph=True): the mask function and the
    layouts trace (no closure reads, no host reads), with eager's results (tests/test_transformers_patterns.py)."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    import _pattern_models as pm
    from test_transformers_patterns import ids, packed_rows, padded

    import hf_deltamatch

    hf_deltamatch.set_default_config(hf_deltamatch.get_default_config().replace(precision="bf16"))
    torch._dynamo.reset()
    if inputs == "plain":
        kw = dict(input_ids=ids(2, 24))
    elif inputs == "padded":
        x, mask, pos = padded([24, 17, 9], "left")
        kw = dict(input_ids=x, attention_mask=mask, position_ids=pos)
    else:
        x, pos = packed_rows([[10, 5, 9], [3, 21]])
        kw = dict(input_ids=x, position_ids=pos)
        if inputs == "packed-cu":
            cu = torch.tensor([0, 10, 15, 24, 27, 48], dtype=torch.int32)
            kw = dict(input_ids=x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=21, max_length_k=21)
    model = pm.build("qwen3", "deltamatch_fp8")

    def forward(**kw):
        return model(**kw, use_cache=False).logits

    def step(fwd, **kw):
        model.zero_grad(set_to_none=True)
        logits = fwd(**kw)
        logits.float().square().mean().backward()  # through the compiled graph's backward
        return [logits.detach()] + [p.grad for _, p in sorted(model.named_parameters())]

    eager = step(forward, **kw)
    compiled = step(torch.compile(forward, backend="aot_eager", fullgraph=True), **kw)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
