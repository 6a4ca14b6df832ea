"""Exact attention in float64, the GPU tests' ground truth (tests/test_kernels_gpu.py)."""

import torch


def exact_attention(q, k, v, do, causal, mask=None):
    """Exact attention in float64 (SDPA's math on the GPU): out and (dq, dk, dv), GQA by summing each KV head's
    gradients over its query heads. mask: a boolean (N, M) mask (True: seen) instead of `causal`'s. One (batch,
    query head) at a time: at N = 8192 each whole-batch (B2 H4) float64 N x N matrix is 4 GiB, and SDPA's math keeps
    several, most of the ~18 GiB a test process peaked at; that capped how many processes fit on one GPU
    (triton_versions.sh)."""
    B, Hq = q.shape[:2]
    groups = Hq // k.shape[1]
    o = torch.empty(do.shape, dtype=torch.float64, device=q.device)  # (B, Hq, N, Dv): MLA's Dv differs from Dqk
    dq = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float64, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float64, device=v.device)
    for b in range(B):
        for h in range(Hq):
            qd, kd, vd = (t.double().requires_grad_() for t in (q[b, h], k[b, h // groups], v[b, h // groups]))
            oh = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask,
                                                                  is_causal=causal and mask is None)
            oh.backward(do[b, h].double())
            o[b, h], dq[b, h] = oh.detach(), qd.grad
            dk[b, h // groups] += kd.grad
            dv[b, h // groups] += vd.grad
    return o, (dq, dk, dv)
