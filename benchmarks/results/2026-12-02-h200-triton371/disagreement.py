"""Which kernel strays at test_hopper_ragged[129-64-full]: Gluon dK/dV variants vs the Triton kernels vs the
reference backend (fp32 products of the same fp8 operands) vs float64. From the repository root, on the GPU:
    python benchmarks/results/2026-12-02-h200-triton371/disagreement.py"""
import sys

import torch

sys.path.insert(0, "tests")
from test_kernels_gpu import KO, R, _exact, _fwd_bwd_under, _inputs, _rel  # noqa: E402
from hf_deltamatch.config import DeltaMatchConfig  # noqa: E402

real_cfg = KO._dkdv_hopper_cfg


def forced(**over):
    def cfg(*a, **k):
        c = real_cfg(*a, **k)
        c.update(over)
        return c
    return cfg


def worst(a, b, n=4):
    rows = (a.float() - b.float()).abs().amax(-1)
    flat = rows.flatten()
    top = flat.topk(min(n, flat.numel())).indices
    return [(tuple(int(x) for x in torch.unravel_index(w, rows.shape)), f"{flat[w]:.3g}") for w in top]


for N, D, Hq, Hkv, causal in ((129, 64, 4, 4, False), (129, 128, 4, 4, False), (200, 64, 4, 4, False),
                              (129, 64, 4, 2, False), (129, 64, 4, 4, True), (256, 64, 4, 4, False)):
    q, k, v, do = _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=11)
    kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    runs = {}
    variants = [("triton", dict(hopper_ragged=False), None), ("gluon", dict(hopper_ragged=True), None),
                ("gluon-wg2", dict(hopper_ragged=True, dkdv_hopper_wgs=(2, 240)), None),
                ("gluon-wg3", dict(hopper_ragged=True, dkdv_hopper_wgs=(3, 160)), None),
                ("gluon-ahead", dict(hopper_ragged=True), dict(ahead=True))]
    for name, tune, over in variants:
        if over:
            KO._dkdv_hopper_cfg = forced(**over)
        try:
            runs[name] = _fwd_bwd_under(tune, q, k, v, do, kw)
        except Exception as e:  # noqa: BLE001
            print(f"N{N} D{D} {name}: {type(e).__name__}: {str(e)[:200]}")
        finally:
            KO._dkdv_hopper_cfg = real_cfg
    fr = R.forward(q, k, v, **kw)
    ref = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)  # the contract's reference (same fp8 operands)
    o64, g64 = _exact(q, k, v, do, causal)
    tag = f"N{N} D{D} H{Hq}/{Hkv} {'causal' if causal else 'full'}"
    for name, (f, g) in runs.items():
        print(f"{tag} {name:12s} vs triton dq/dk/dv", [f"{_rel(a, b):.3g}" for a, b in zip(g[:3], runs['triton'][1][:3])],
              "vs ref", [f"{_rel(a, b):.3g}" for a, b in zip(g[:3], ref)],
              "vs f64", [f"{_rel(a, b):.3g}" for a, b in zip(g[:3], g64)], flush=True)
        if name != "triton" and _rel(g[2], runs["triton"][1][2]) > 1e-4:
            print("   dv worst rows vs triton (b, h, key)", worst(g[2], runs["triton"][1][2]),
                  "| vs ref", worst(g[2], ref[2]), "| triton vs ref", worst(runs["triton"][1][2], ref[2]), flush=True)
print("done")
