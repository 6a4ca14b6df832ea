"""GPU tests of attention sinks (docs/numerics.md "Attention sinks") at real sizes: the kernels, with the sinks
applied around them, against the reference backend on the same inputs (dense, sliding window, packed batches), and
the delta the kernels return for d sinks, the packed Gluon path's (mapped back from its padded rows) included.
Run on the H200: `pytest -m gpu tests/test_sinks_gpu.py`.

Tolerances as tests/test_kernels_gpu.py (Hopper's FP8 MMA accumulates with ~14 mantissa bits): 1e-2 relative for
out, dq, dk, dv in fp8 mode, 2e-3 in bf16 mode; LSE to 1e-2 absolute. d sinks = -sum_i P_i,sink * delta_i sums terms
of both signs: its difference is bounded relative to sum_i |P_i,sink * delta_i| (the reference's), at the same 1e-2
(2e-3 in bf16 mode).
"""

import math
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention  # noqa: E402
from hf_deltamatch import reference as R  # noqa: E402
from hf_deltamatch.testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _gluon import skip_unless_gluon_triton  # noqa: E402

if torch.cuda.is_available():
    from hf_deltamatch import kernels as K

FP8_TOL, BF16_TOL = 1e-2, 2e-3


def _inputs(B, Hq, Hkv, N, D, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16)  # noqa: E731
    sinks = math.log(N) - 1.0 + 2.0 * torch.randn(Hq, device="cuda", generator=g)
    return mk(B, Hq, N, D), mk(B, Hkv, N, D), mk(B, Hkv, N, D), mk(B, Hq, N, D), sinks


def _op(q, k, v, do, sinks, config, **kw):
    q, k, v, s = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    out, lse = deltamatch_attention(q, k, v, sinks=s, config=config, return_lse=True, **kw)
    out.backward(do)
    return out.detach(), lse, q.grad, k.grad, v.grad, s.grad


CASES = {
    "d64 causal gqa": dict(shape=(2, 8, 2, 2048, 64), causal=True),
    "d128 causal": dict(shape=(1, 4, 4, 4096, 128), causal=True),
    "d128 full": dict(shape=(1, 4, 4, 2048, 128), causal=False),
    "d64 window 128 (gpt-oss)": dict(shape=(1, 8, 2, 4096, 64), causal=True, window=128),
    "d64 causal bf16": dict(shape=(1, 8, 2, 2048, 64), causal=True, precision="bf16"),
    "d128 causal stale": dict(shape=(1, 4, 4, 2048, 128), causal=True, delta="stale"),
    "packed d64 gqa": dict(shape=(1, 8, 2, 4096, 64), causal=True, cu=[0, 1000, 1001, 3000, 4096]),
    "packed d128 short docs": dict(shape=(1, 4, 4, 2720, 128), causal=True, cu=[0, 64, 64, 192, 1301, 2600, 2720]),
    "packed d64 window": dict(shape=(1, 8, 2, 4096, 64), causal=True, window=128, cu=[0, 1000, 1001, 3000, 4096]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_reference_with_sinks(case):
    c = dict(CASES[case])
    q, k, v, do, sinks = _inputs(*c.pop("shape"))
    kw = dict(causal=c.pop("causal"), window=c.pop("window", None))
    if "cu" in c:
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = torch.tensor(c.pop("cu"), dtype=torch.int32, device="cuda")
    got = _op(q, k, v, do, sinks, DeltaMatchConfig(backend="triton", **c), **kw)
    want = _op(q, k, v, do, sinks, DeltaMatchConfig(backend="reference", **c), **kw)
    tol = BF16_TOL if c.get("precision") == "bf16" else FP8_TOL
    errs = {name: rel_err(b, a) for name, a, b in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:5],
                                                   want[:1] + want[2:5])}
    fin = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(got[1]), fin)
    errs["lse"] = (got[1][fin] - want[1][fin]).abs().max().item()
    # d sinks against the scale of its terms, sum_i |P_i,sink * delta_i|, from the reference's LSE and delta
    scale = _sink_terms(q, k, v, do, sinks, DeltaMatchConfig(**c), kw)
    errs["dsinks"] = ((got[5] - want[5]).abs() / scale).max().item()
    print(f"SINKS {case}:", {n: float(f"{e:.3g}") for n, e in errs.items()})
    assert all(torch.isfinite(t).all() for t in got[2:])
    assert max(errs[n] for n in ("out", "dq", "dk", "dv", "dsinks")) <= tol, errs
    assert errs["lse"] <= 1e-2, errs


def _sink_terms(q, k, v, do, sinks, config, kw):
    args = dict(softmax_scale=q.shape[-1] ** -0.5, cu_seqlens_q=kw.get("cu_seqlens_q"),
                cu_seqlens_k=kw.get("cu_seqlens_k"), causal=kw["causal"], window=kw["window"], config=config)
    out, lse, *saved = R.forward(q, k, v, **args)
    out, lse = R.apply_sinks(out, lse, sinks)
    delta = R.backward(do, q, k, v, out, lse, *saved, **args, return_delta=True)[-1]
    return (torch.exp(sinks.view(1, -1, 1) - lse) * delta).abs().sum(dim=(0, 2))


@pytest.mark.parametrize("D", [64, 128])
def test_packed_gluon_delta_is_the_triton_one(D, monkeypatch):
    """kernels.backward(return_delta=True) on a packed batch: the Gluon kernels keep delta in their padded layout
    and return it mapped back to the packed rows (_unpad_rows); the Triton kernels (hopper_packed off) keep it
    packed. The two agree to the Gluon-vs-Triton backward tolerance, rows outside every sequence are 0, and both
    match the reference's delta."""
    skip_unless_gluon_triton()
    q, k, v, do, sinks = _inputs(1, 4, 2, 2720, D, seed=3)
    cu = torch.tensor([0, 64, 64, 192, 1301, 2600], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=DeltaMatchConfig())
    out, lse, *saved = K.forward(q, k, v, **kw)
    out, lse = R.apply_sinks(out, lse, sinks)
    with K.pinned(dq_kernel="gluon", dkdv_kernel="gluon"):  # the Gluon path really runs (or the pin raises)
        gluon = K.backward(do, q, k, v, out, lse, *saved, **kw, return_delta=True)[-1]
    with K.pinned(dq_kernel="triton", dkdv_kernel="triton"):
        triton_ = K.backward(do, q, k, v, out, lse, *saved, **kw, return_delta=True)[-1]
    ref = R.backward(do, q, k, v, out, lse, *saved, **kw, return_delta=True)[-1]
    print(f"PACKED DELTA D{D}: gluon vs triton {rel_err(triton_, gluon):.3g}, vs reference {rel_err(ref, gluon):.3g}")
    assert rel_err(triton_, gluon) < 1e-3 and rel_err(ref, gluon) < FP8_TOL
    assert not gluon[:, :, 2600:].any()
