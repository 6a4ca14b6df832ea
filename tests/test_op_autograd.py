"""Gradients that are easy to get silently wrong: through the returned LSE, and second derivatives.

The LSE's gradient is held to float64 exact attention's (autograd through a materialized logsumexp): bf16 mode
within 2e-2 (bf16 operands and dS, as the op's own accuracy tests), fp8 within the op's FP8 gradient bound (0.11).
A second derivative through the op is refused with an error, never differentiated through the backward's ops;
so are torch.func's transforms.
"""

import math
import warnings

import pytest
import torch

from hf_deltamatch import DeltaMatchConfig, attention, deltamatch_attention
from hf_deltamatch.diagnostics import visible

BF16 = DeltaMatchConfig(precision="bf16", backend="reference")
FP8 = DeltaMatchConfig(precision="fp8", backend="reference")


def inputs(n=96, hq=4, hkv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    return mk(1, hq, n, d), mk(1, hkv, n, d), mk(1, hkv, n, d), mk(1, hq, n, d), 3 * torch.randn(1, hq, n, generator=g)


def exact_out_lse(q, k, v, sinks=None, causal=True):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~visible(q.shape[2], k.shape[2], causal), float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    return p[..., :v.shape[2]] @ v, lse


def grads(fn, q, k, v, do, dlse, sinks=None):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    extra = [] if sinks is None else [sinks.detach().clone().requires_grad_()]
    out, lse = fn(*leaves, *extra)
    ((out.float() * do.float()).sum() + (lse * dlse).sum()).backward()
    return [t.grad.double() for t in leaves + extra]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("config, bound", [(BF16, 2e-2), (FP8, 0.11)], ids=["bf16", "fp8"])
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_lse_gradient_matches_float64(config, bound, sinks):
    q, k, v, do, dlse = inputs()
    s = torch.tensor([0.5, -1.0, 2.0, 0.0]) if sinks else None
    op = lambda q, k, v, *s_: deltamatch_attention(q, k, v, config=config, return_lse=True,  # noqa: E731
                                                   sinks=s_[0] if s_ else None)
    exact = lambda q, k, v, *s_: exact_out_lse(q.double(), k.double(), v.double(), *(x.double() for x in s_))  # noqa
    got, want = grads(op, q, k, v, do, dlse, s), grads(exact, q, k, v, do, dlse, s)
    without = grads(op, q, k, v, do, torch.zeros_like(dlse), s)
    for name, a, b, c in zip(("dq", "dk", "dv", "dsinks"), got, want, without):
        assert rel(a, b) <= bound, (name, rel(a, b))
        if name in ("dq", "dk"):  # the LSE's share is no rounding error: leaving it out is far off
            assert rel(c, b) > 3 * bound, (name, rel(c, b))


def test_lse_gradient_alone_and_on_the_kernels_backend():
    """A loss of the LSE alone (no gradient reaches out); the Triton backend (here Triton's interpreter) hands the
    backward to the reference, saying so once."""
    q, k, v, _, dlse = inputs(n=64, hq=2, hkv=2)
    cfg = DeltaMatchConfig(precision="bf16", backend="triton")
    attention._warn_once.cache_clear()
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, lse = deltamatch_attention(*leaves, config=cfg, return_lse=True)
        (lse * dlse).sum().backward()
    assert any("returned LSE" in str(w.message) for w in caught)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    (exact_out_lse(*exact)[1] * dlse).sum().backward()
    assert rel(leaves[0].grad, exact[0].grad) <= 2e-2 and rel(leaves[1].grad, exact[1].grad) <= 2e-2
    assert leaves[2].grad is None or leaves[2].grad.abs().max() == 0  # the LSE does not depend on v


def test_lse_gradient_with_smooth_k_raises():
    q, k, v, _, dlse = inputs(n=64)
    q.requires_grad_()
    _, lse = deltamatch_attention(q, k, v, config=BF16.replace(smooth_k=True), return_lse=True)
    with pytest.raises(RuntimeError, match="smooth_k=True"):
        (lse * dlse).sum().backward()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "custom-op"])
def test_second_derivative_raises(compiled):
    q, k, v, do, _ = inputs(n=64)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if compiled:  # the custom op torch.compile traces, called directly
        c = FP8
        out = torch.ops.hf_deltamatch.attention_forward(*leaves, True, 32 ** -0.5, None, None, None, c.precision,
                                                        c.delta, c.block, c.scale_rounding, c.grad_format,
                                                        "reference", c.deterministic)[0]
    else:
        out = deltamatch_attention(*leaves, config=FP8)
    dq, = torch.autograd.grad((out.float() * do.float()).sum(), leaves[0], create_graph=True)
    # the first derivative is the op's as without create_graph
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    deltamatch_attention(*ref, config=FP8).backward(do)
    torch.testing.assert_close(dq, ref[0].grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="no second derivative"):
        (dq.float() ** 2).sum().backward()


@pytest.mark.parametrize("transform", ["grad", "vmap"])
def test_torch_func_transforms_are_refused(transform):
    """torch.func's transforms would need a functorch rule for the kernels' backward: a clear error, not a crash
    deep inside the op."""
    q, k, v, _, _ = inputs(n=32)
    fn = lambda q: deltamatch_attention(q, k, v, config=FP8).float().sum()  # noqa: E731
    call = torch.func.grad(fn) if transform == "grad" else torch.func.vmap(fn)
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        call(q)
