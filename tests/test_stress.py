"""The kernels on the inputs trained models produce (tests/_stress.py's classes): finite wherever the reference is,
as close to it as on gaussian inputs, and as accurate against float64 exact attention as the contract itself.

Bounds:
  - finite: every output and gradient of the kernels is finite wherever the reference's is (the reference is
    finite on every class here: docs/numerics.md, "What stays finite").
  - kernels vs reference (same contract): relative error <= 2e-3 in the interpreter (fp32 rounding and rare FP8
    rounding flips) and <= 2e-2 on the GPU (QGMMA accumulates FP8 products with ~14 mantissa bits), measured
    against the FP8 error scale where the true gradient cancels (a sink's P near 1 leaves dS near 0: _stress.err).
  - both vs float64: the kernels' error at most 1.25x the reference's + 0.02: the contract's own FP8 error
    (percent-level, tens of percent on outlier channels) is not the kernels' to reduce, only not to add to.
The interpreter cases are small (N <= 256); tests marked gpu run the same classes at 2K-8K and up to 64K.
"""

import pytest
import torch

import _stress as S

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytest.importorskip("triton")


def _check(case, tol_kr):
    ker = S.run(case, "triton")
    ref = S.run(case, "reference")
    if case.cu_seqlens is None and case.q.shape[2] > 2048:
        want, scales = S.exact_chunked(case)
    else:
        want, scales = S.exact(case)
    row = {}
    for name, x, r, e, sc in zip(("out", "dq", "dk", "dv"), ker, ref, want or [None] * 4, scales):
        assert torch.isfinite(r).all(), f"{case.name}: the reference's {name} is not finite"
        bad = ~torch.isfinite(x)
        assert not bad.any(), f"{case.name}: {int(bad.sum())} non-finite {name} (first at {bad.nonzero()[0].tolist()})"
        row[name] = S.err(x, r, sc)
        if e is not None:
            row[name + "_exact"] = (S.err(x, e, sc), S.err(r, e, sc))
    print(case.name, tuple(case.q.shape), {k: (f"{v:.2e}" if isinstance(v, float) else f"{v[0]:.2e}/{v[1]:.2e}")
                                          for k, v in row.items()})
    for name in ("out", "dq", "dk", "dv"):
        got, contract = row[name + "_exact"]
        # FP8 rounding flips between two summation orders grow with the contract's own FP8 error (outlier
        # channels: 17-60 % against float64, kernels and reference up to 0.12x that apart on the GPU)
        assert row[name] <= max(tol_kr, 0.15 * contract), (case.name, name, row)
        assert got <= 1.25 * contract + 0.02, (case.name, name, row)


# in CI: one of each kind of trouble (the GPU test runs every class)
CPU_CLASSES = ("gaussian", "sink-moderate", "sink-90", "sink-outliers", "logits-80", "do-1e4", "do-1e-6",
               "masked-rows", "packed-1tok", "e5m2-sink")


@pytest.mark.parametrize("kind", CPU_CLASSES)
def test_stress_interpreter(kind):
    if DEV == "cuda":
        pytest.skip("the GPU runs test_stress_gpu")
    _check(S.make_case(kind, N=256, D=64), 2e-3)


@pytest.mark.parametrize("shape", [dict(Hq=4, Hkv=2, N=200), dict(Hq=2, N=128, D=32)], ids=["gqa-n200", "d32"])
def test_stress_interpreter_shapes(shape):
    """Off-tile lengths and GQA on the extreme sink (its P underflows fp32 for most keys)."""
    if DEV == "cuda":
        pytest.skip("the GPU runs test_stress_gpu")
    _check(S.make_case("sink-90", **shape), 2e-3)


GPU_SHAPES = {
    "d128": dict(B=1, Hq=4, N=2048, D=128),
    "d64": dict(B=1, Hq=4, N=2048, D=64),
    "d256": dict(B=1, Hq=2, N=2048, D=256),
    "gqa": dict(B=1, Hq=8, Hkv=2, N=2048, D=128),
    "n8000": dict(B=1, Hq=2, N=8000, D=128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("kind", S.CLASSES)
def test_stress_gpu(kind, shape):
    _check(S.make_case(kind, device="cuda", **GPU_SHAPES[shape]), 2e-2)


@pytest.mark.gpu
def test_sink_with_outliers_at_8k():
    """The reported case: B=1, H=8, N=8192, D=128, outlier channels (k x20, q x4) and a sink of margin 40: dQ held
    inf (rows ~6200) before the accumulators' units were floored (_fp8.acc_units)."""
    _check(S.make_case("sink-outliers", B=1, Hq=8, N=8192, D=128, device="cuda"), 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gaussian", "sink-90", "sink-outliers"])
def test_stress_gpu_64k(kind):
    """64K tokens, one head. Kernels and reference 5e-2 apart: QGMMA's reduced-precision accumulation over a
    thousand key (query) tiles shows at this length (gaussian dK 4.2e-2); against float64 the 1.25x bound holds."""
    _check(S.make_case(kind, B=1, Hq=1, N=65536, D=128, device="cuda"), 5e-2)
