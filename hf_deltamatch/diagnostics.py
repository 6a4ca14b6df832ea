"""The paper's point in one minute, on any machine: stale delta breaks softmax's zero-row-sum, matching keeps it.

For one attention problem, compares precision="fp8" with delta="matching" and "stale", precision="bf16", and
fp8-matching with the outlier pre-transforms (qk_rotation="hadamard", smooth_k, both), against float64 exact
attention:
  - dS row-sum residual  ||sum_j dS_ij|| / ||sum_j |dS_ij|||   (exact attention: 0; the invariant)
  - relative error of out, dQ, dK, dV  ||x - exact|| / ||exact||
  - key-gradient drift   ||sum_j dK_j|| / ||dK||             (exact attention: 0, since sum_j dS_ij = 0;
                                                             smooth_k's backward projects it to 0)
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import outliers, reference
from .attention import deltamatch_attention
from .config import DeltaMatchConfig
from .testing import rel_err

PROFILES = ("gaussian", "outliers", "sinks", "qk-outliers", "k-outliers", "k-bias")
# outlier channels of q/k as trained LLMs carry them (issue #29's table, 4 of 128 channels): k and q factors, k bias
_QK_CHANNEL_PROFILES = {"qk-outliers": (20.0, 4.0, 0.0), "k-outliers": (8.0, 1.0, 0.0), "k-bias": (1.0, 1.0, 8.0)}
MODES = (("fp8", "matching"), ("fp8", "stale"), ("bf16", "matching"))
# fp8-matching again with the outlier pre-transforms (DeltaMatchConfig.qk_rotation, smooth_k): rows "+hadamard" etc.
QK_TRANSFORMS = (("hadamard", False), ("none", True), ("hadamard", True))


@dataclasses.dataclass
class Row:
    mode: str
    row_sum_residual: float
    err_out: float
    err_dq: float
    err_dk: float
    err_dv: float
    dk_drift: float


def make_inputs(profile: str, batch=1, heads=2, kv_heads=None, n=1024, d=64, seed=0, dtype=torch.bfloat16,
                device="cpu"):
    """q, k, v, dO for an input profile: gaussian; outliers (a few channels larger: 4x in q/k,
    20x in v, as in LLM activations); sinks (every query attends strongly to the first key, as trained LLMs do);
    outlier channels of q and k, the same d/32 channels in both (4 at d=128): qk-outliers (x20 in k, x4 in q),
    k-outliers (x8 in k), k-bias (+8 on k: a shared offset of every key, what K smoothing removes)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown input profile {profile!r}; choose one of {list(PROFILES)}")
    kv_heads = kv_heads or heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, n, d, generator=g)
    k = torch.randn(batch, kv_heads, n, d, generator=g)
    v = torch.randn(batch, kv_heads, n, d, generator=g)
    do = torch.randn(batch, heads, n, d, generator=g)
    if profile == "outliers":
        channels = torch.randperm(d, generator=g)[: max(1, d // 16)]
        q[..., channels] *= 4.0  # larger q/k outliers make softmax one-hot, where any rounding flips argmax
        k[..., channels] *= 4.0
        v[..., channels] *= 20.0
    elif profile in _QK_CHANNEL_PROFILES:
        k_factor, q_factor, k_bias = _QK_CHANNEL_PROFILES[profile]
        channels = torch.randperm(d, generator=g)[: max(1, d // 32)]
        k[..., channels] = k[..., channels] * k_factor + k_bias
        q[..., channels] *= q_factor
    elif profile == "sinks":
        direction = q.mean(dim=(1, 2), keepdim=True)[:, :, 0]  # (B, 1, d): shared by all queries
        k[:, :, 0] = 3.0 * math.sqrt(d) * direction / direction.norm(dim=-1, keepdim=True)
        q = q + 2.0 * direction / direction.norm(dim=-1, keepdim=True)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v, do))


def visible(n: int, m: int, causal: bool = True, window: int | None = None, device=None) -> torch.Tensor:
    """(n, m) bool: which of a sequence's m keys each of its n queries sees (docs/numerics.md's masks: bottom-right
    causal, then the window)."""
    pos = torch.arange(n, device=device)[:, None] + (m - n)
    cols = torch.arange(m, device=device)[None, :]
    keep = torch.ones(n, m, dtype=torch.bool, device=device)
    if causal:
        keep &= cols <= pos
        if window is not None:
            keep &= cols > pos - window
    return keep


def exact_attention(q, k, v, causal=True, softmax_scale=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    sinks=None):
    """Float64 attention, materialized (small problems only): the ground truth of tests and diagnostics.

    Same conventions as `deltamatch_attention` (bottom-right causal, window, varlen, sinks: a logit column per
    query head in the softmax, with no value row); rows that see no key give 0.
    """
    q, k, v = q.double(), k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if cu_seqlens_q is None:
        segments = [(0, q.shape[2], 0, k.shape[2])]
    else:
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        segments = [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]
    outs = []
    for q0, q1, k0, k1 in segments:
        n, m = q1 - q0, k1 - k0
        s = (q[:, :, q0:q1] @ k[:, :, k0:k1].transpose(-1, -2)) * scale
        s = s.masked_fill(~visible(n, m, causal, window, q.device), float("-inf"))
        if sinks is not None:
            sink = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(s, dim=-1)
        outs.append(torch.nan_to_num(p, nan=0.0) @ v[:, :, k0:k1])
    return torch.cat(outs, dim=2)


def run(profile="gaussian", *, batch=1, heads=2, kv_heads=None, n=1024, d=64, seed=0, causal=True,
        block=128, device="cpu", backend="auto") -> list[Row]:
    q, k, v, do = make_inputs(profile, batch, heads, kv_heads, n, d, seed, device=device)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    exact = exact_attention(*leaves, causal=causal)
    exact.backward(do.double())
    ref_grads = [t.grad for t in leaves]
    rows = []
    modes = [(p, dl, "none", False) for p, dl in MODES] + [("fp8", "matching", *t) for t in QK_TRANSFORMS]
    for precision, delta, rotation, smooth_k in modes:
        config = DeltaMatchConfig(precision=precision, delta=delta, block=block, backend=backend,
                                  qk_rotation=rotation, smooth_k=smooth_k)
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out = deltamatch_attention(qq, kk, vv, causal=causal, config=config)
        out.backward(do)
        # The invariant is measured on dS before quantization, which the reference exposes (on the op's inputs).
        ref_cfg = config.replace(backend="reference")
        qt, kt, _ = outliers.transform_qk(q, k, rotation, smooth_k)
        fwd = reference.forward(qt, kt, v, causal=causal, softmax_scale=1 / math.sqrt(d), window=None,
                                cu_seqlens_q=None, cu_seqlens_k=None, config=ref_cfg)
        *_, row_sums, row_abs = reference.backward(
            do, qt, kt, v, fwd[0], fwd[1], *fwd[2:], causal=causal, softmax_scale=1 / math.sqrt(d), window=None,
            cu_seqlens_q=None, cu_seqlens_k=None, config=ref_cfg, return_row_sums=True)
        drift = (kk.grad.double().sum(dim=2).norm() / kk.grad.double().norm().clamp_min(1e-300)).item()
        mode = f"{precision}-{delta}" if precision == "fp8" else precision
        mode += "+hadamard" * (rotation == "hadamard") + "+smooth_k" * smooth_k
        rows.append(Row(
            mode=mode,
            row_sum_residual=(row_sums.norm() / row_abs.norm().clamp_min(1e-30)).item(),
            err_out=rel_err(exact.detach(), out),
            err_dq=rel_err(ref_grads[0], qq.grad), err_dk=rel_err(ref_grads[1], kk.grad),
            err_dv=rel_err(ref_grads[2], vv.grad),
            dk_drift=drift,
        ))
    exact_drift = (ref_grads[1].sum(dim=2).norm() / ref_grads[1].norm()).item()
    rows.append(Row("exact (fp64)", 0.0, 0.0, 0.0, 0.0, 0.0, exact_drift))
    return rows


def format_table(profile: str, rows: list[Row]) -> str:
    head = (f"profile={profile}\n"
            f"{'mode':<32} {'dS row-sum resid':>16} {'out err':>9} {'dQ err':>9} {'dK err':>9} {'dV err':>9} "
            f"{'sum_j dK_j':>11}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.mode:<32} {r.row_sum_residual:>16.2e} {r.err_out:>9.2e} {r.err_dq:>9.2e} {r.err_dk:>9.2e} "
                     f"{r.err_dv:>9.2e} {r.dk_drift:>11.2e}")
    return "\n".join(lines)
