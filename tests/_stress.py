"""Input classes for the stress tests (tests/test_stress.py): the shapes attention takes in trained models.

Each case is q, k, v, dO (bf16) plus the call's masks and config. The classes follow issue-style reports of where
FP8 attention kernels break: attention sinks (a key that every query attends to, with logit margins up to where
the other keys' P underflows fp32), per-channel outliers in q/k, logits near fp32's exp range, huge and tiny
upstream gradients, fully masked rows, packed batches with 1-token documents, lengths off the 128-token tile.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from hf_deltamatch.config import DeltaMatchConfig


@dataclasses.dataclass
class Case:
    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    causal: bool = True
    cu_seqlens: torch.Tensor | None = None
    config: DeltaMatchConfig = dataclasses.field(default_factory=DeltaMatchConfig)

    def kwargs(self):
        return dict(causal=self.causal, cu_seqlens_q=self.cu_seqlens, cu_seqlens_k=self.cu_seqlens)


CLASSES = ("gaussian", "sink-moderate", "sink-60", "sink-90", "sink-100", "outliers-scale", "outliers-bias",
           "sink-outliers", "logits-80", "do-1e4", "do-1e-6", "masked-rows", "packed-1tok", "e5m2-sink")


def make_case(kind: str, *, B=1, Hq=2, Hkv=None, N=256, D=64, device="cpu", seed=0) -> Case:
    """One input class at a size. Sinks: key 0 gets the score margin (in softmax units) over a typical key for
    every query; 'sink-moderate' puts about half the attention mass on it; at 90 the other keys' P is ~1e-39 (an
    fp32 subnormal), at 100 it underflows to 0."""
    Hkv = Hkv or Hq
    M = N
    causal = True
    cu = None
    config = DeltaMatchConfig()
    if kind == "masked-rows":  # bottom-right causal with N > M: the first N - M queries see no key
        M = N // 2
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, N, D, generator=g)
    k = torch.randn(B, Hkv, M, D, generator=g)
    v = torch.randn(B, Hkv, M, D, generator=g)
    do = torch.randn(B, Hq, N, D, generator=g)
    scale = D ** -0.5
    sink = {"sink-moderate": math.log(N) + 0.5, "sink-60": 60.0, "sink-90": 90.0, "sink-100": 100.0, "e5m2-sink": 60.0,
            "sink-outliers": 40.0}.get(kind)
    if kind in ("outliers-scale", "sink-outliers"):  # a few channels carry most of q/k's magnitude (4 channels)
        ch = torch.randperm(D - 1, generator=g)[:4] + 1  # not channel 0, the sink's
        k[..., ch] *= 20.0
        q[..., ch] *= 4.0
    if sink is not None:
        # q_i = noise + a u and k_0 = b u, a * b * scale = margin: every query scores key 0 `margin` above the rest
        u = torch.zeros(D)
        u[0] = 1.0
        a = 4.0
        q[..., 0] = a
        k[..., 0] = 0.0
        k[:, :, 0, 0] = sink / (a * scale)
        if kind == "e5m2-sink":
            config = DeltaMatchConfig(grad_format="e5m2")
    elif kind == "outliers-bias":  # a constant offset on 4 channels of k (shifts each query's scores)
        ch = torch.randperm(D, generator=g)[:4]
        k[..., ch] += 8.0
    elif kind == "logits-80":  # scores up to ~80 in magnitude: exp(80) is 5.5e34, near fp32's 3.4e38
        s = (q[0, 0, :256] @ k[0, 0].T).abs().amax().item() * scale  # the largest score, near enough
        f = math.sqrt(80.0 / s)
        q, k = q * f, k * f
    elif kind == "do-1e4":
        do = do * 1e4
    elif kind == "do-1e-6":
        do = do * 1e-6
    elif kind == "packed-1tok":  # documents of 1 token beside long ones, boundaries on and off tile edges
        assert B == 1
        cuts = sorted({0, 1, 2, N // 2, N // 2 + 1, N - 3, N})
        cu = torch.tensor(cuts, dtype=torch.int32)
    elif kind not in ("gaussian", "masked-rows", "outliers-scale"):
        raise ValueError(f"unknown input class {kind!r}; one of {CLASSES}")
    q, k, v, do = (t.to(torch.bfloat16).to(device) for t in (q, k, v, do))
    return Case(kind, q, k, v, do, causal, cu.to(device) if cu is not None else None, config)


def run(case: Case, backend: str):
    """out, dq, dk, dv of deltamatch_attention on the case through `backend`."""
    from hf_deltamatch import deltamatch_attention

    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = deltamatch_attention(q, k, v, config=case.config.replace(backend=backend), **case.kwargs())
    out.backward(case.do)
    return out.detach(), q.grad, k.grad, v.grad


def exact(case: Case):
    """out, dq, dk, dv of float64 exact attention (materialized: small cases only) and the FP8 error scales of
    each (float64): |P| |V| for out, scale A|K| for dq, scale A^T|Q| for dk, P^T |dO| for dv, A_ij = P_ij |dO_i o
    V_j|. Rounding the operands to e4m3 moves each product by ~2^-4 of these, however much the true gradient
    cancels (a sink's P close to 1 leaves dS, and so dQ, near 0): errors are measured against them."""
    from hf_deltamatch.diagnostics import exact_attention, visible

    q, k, v = (t.detach().double().requires_grad_() for t in (case.q, case.k, case.v))
    do = case.do.double()
    out = exact_attention(q, k, v, **case.kwargs())
    out.backward(do)
    g = q.shape[1] // k.shape[1]
    kk, vv = k.detach().repeat_interleave(g, 1), v.detach().repeat_interleave(g, 1)
    n, m, scale = q.shape[2], k.shape[2], q.shape[-1] ** -0.5
    if case.cu_seqlens is None:
        segments = [(0, n, 0, m)]
    else:
        c = case.cu_seqlens.tolist()
        segments = [(c[i], c[i + 1], c[i], c[i + 1]) for i in range(len(c) - 1)]
    scales = [torch.zeros_like(t) for t in (out, q, kk, vv)]
    for q0, q1, k0, k1 in segments:
        qs, ks, vs, dos = q.detach()[:, :, q0:q1], kk[:, :, k0:k1], vv[:, :, k0:k1], do[:, :, q0:q1]
        s = qs @ ks.transpose(-1, -2) * scale
        keep = visible(q1 - q0, k1 - k0, case.causal, device=s.device)
        p = torch.nan_to_num(torch.softmax(s.masked_fill(~keep, float("-inf")), -1))
        a = p * (dos.square() @ vs.square().transpose(-1, -2)).sqrt() * scale
        scales[0][:, :, q0:q1] = p @ vs.abs()
        scales[1][:, :, q0:q1] = a @ ks.abs()
        scales[2][:, :, k0:k1] = a.transpose(-1, -2) @ qs.abs()
        scales[3][:, :, k0:k1] = p.transpose(-1, -2) @ dos.abs()
    sum_group = lambda t: t.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
    scales[2], scales[3] = sum_group(scales[2]), sum_group(scales[3])
    return (out.detach(), q.grad, k.grad, v.grad), scales


def exact_chunked(case: Case, rows: int = 2048):
    """exact() for a dense batch of any length: float64, `rows` queries at a time (no N x M matrix), the same
    outputs and scales. Bottom-right causal as the op."""
    q, k, v, do = (t.double() for t in (case.q, case.k, case.v, case.do))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    n, m, scale = q.shape[2], k.shape[2], q.shape[-1] ** -0.5
    out, dq = torch.zeros_like(q), torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    sc = [torch.zeros_like(t) for t in (out, q, k, v)]
    cols = torch.arange(m, device=q.device)[None, :]
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        qs, dos = q[:, :, r0:r1], do[:, :, r0:r1]
        s = qs @ k.transpose(-1, -2) * scale
        if case.causal:
            pos = torch.arange(r0, r1, device=q.device)[:, None] + (m - n)
            s = s.masked_fill(cols > pos, float("-inf"))
        p = torch.nan_to_num(torch.softmax(s, -1))
        del s
        o = p @ v
        dp = dos @ v.transpose(-1, -2)
        ds = p * (dp - (dos * o).sum(-1, keepdim=True))
        del dp
        out[:, :, r0:r1], dq[:, :, r0:r1] = o, ds @ k * scale
        dk += ds.transpose(-1, -2) @ qs * scale
        dv += p.transpose(-1, -2) @ dos
        del ds
        a = p * (dos.square() @ v.square().transpose(-1, -2)).sqrt() * scale
        sc[0][:, :, r0:r1], sc[1][:, :, r0:r1] = p @ v.abs(), a @ k.abs()
        sc[2] += a.transpose(-1, -2) @ qs.abs()
        sc[3] += p.transpose(-1, -2) @ dos.abs()
        del a, p
    sum_group = lambda t: t.unflatten(1, (case.k.shape[1], g)).sum(2)  # noqa: E731
    return (out, dq, sum_group(dk), sum_group(dv)), [sc[0], sc[1], sum_group(sc[2]), sum_group(sc[3])]


def err(x, ref, scale=None) -> float:
    """||x - ref|| relative to ||ref||, or to ||scale|| / 20 where ref cancels below that (exact()'s scales)."""
    x, ref = x.double(), ref.double()
    den = ref.norm()
    if scale is not None:
        den = torch.maximum(den, scale.double().norm() / 20)
    return ((x - ref).norm() / den.clamp_min(1e-300)).item()
