"""tests/_exact_attention.py: the GPU tests' float64 ground truth, checked on the CPU."""

import pytest
import torch

from _exact_attention import exact_attention


@pytest.mark.parametrize("dv", [8, 6], ids=["dqk=dv", "mla"])
@pytest.mark.parametrize("mask", [None, "window"])
@pytest.mark.parametrize("causal", [True, False])
def test_exact_per_head_equals_the_whole_batch(causal, mask, dv):
    """exact_attention, run a (batch, head) at a time, against SDPA's float64 math over the whole batch with k, v
    repeated for GQA (what it replaced): the same out and gradients to float64 rounding, with Dv = Dqk and with
    MLA's Dv < Dqk. Runs on the CPU too."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, h, 40, d, generator=g).to(dev) for h, d in ((4, 8), (2, 8), (2, dv), (4, dv)))
    m = torch.ones(40, 40, dtype=torch.bool, device=dev).tril() & ~torch.ones(40, 40, dtype=torch.bool,
                                                                             device=dev).tril(-9) if mask else None
    o, grads = exact_attention(q, k, v, do, causal, m)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1),
                                                            attn_mask=m, is_causal=causal and m is None)
    want.backward(do.double())
    for a, b in zip((o, *grads), (want, qd.grad, kd.grad, vd.grad)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
