"""GPU tests of hf_deltamatch.kernels at real sizes: agreement with the reference backend (same contract),
accuracy against exact attention, and the Delta-Matching invariant at 8K/32K. Run on the H200."""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

from hf_deltamatch import reference as R  # noqa: E402
from hf_deltamatch.config import DeltaMatchConfig  # noqa: E402
from hf_deltamatch.testing import rel_err  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _exact_attention import exact_attention as _exact  # noqa: E402
from _gluon import skip_unless_gluon_triton  # noqa: E402

if torch.cuda.is_available():
    from hf_deltamatch import kernels as K
    from hf_deltamatch.kernels import configs as C
    from hf_deltamatch.kernels import ops as KO
    from hf_deltamatch.kernels import plan as P


def _inputs(B, Hq, Hkv, N, M, Dqk, Dv, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.float32, generator=g).to(dtype)  # noqa: E731
    return mk(B, Hq, N, Dqk), mk(B, Hkv, M, Dqk), mk(B, Hkv, M, Dv), mk(B, Hq, N, Dv)


# Hopper's FP8 MMA (QGMMA) does not accumulate in full fp32 (products are summed with ~14 mantissa bits,
# DeepSeek-V3 tech report 3.3.2), so on the GPU the fp8 kernels agree with the fp32 reference to a few 1e-3
# rather than the interpreter's 1e-5 (tests/test_kernels.py); bf16 mode (HGMMA, fp32 accumulation) stays tight.
FP8_TOL, BF16_TOL = 1e-2, 2e-3

# The Triton kernels on every pass, where the Gluon ones are the default
TRITON = dict(fwd_kernel="triton", dq_kernel="triton", dkdv_kernel="triton")


def _variant(settings=None, **more):
    """plan.variant of `settings` and `more` in one dict: plan pins (a kernel pinned "gluon" raises where the Gluon
    kernel cannot take the input, so that a comparison never falls back to Triton) and kernels.TUNE launch shapes,
    both restored after."""
    return P.variant({**(settings or {}), **more})


def _plan(q, k, v, kw):
    """The Plan of K.forward / K.backward on these inputs (kw: their keyword arguments), with the pins in force."""
    vl = KO.sequences(q, k, kw["cu_seqlens_q"], kw["cu_seqlens_k"])[0]
    return P.select(P.case_of(q, k, v, causal=kw["causal"], window=kw["window"], config=kw["config"], varlen=vl))


def _compare(B=1, Hq=4, Hkv=4, N=2048, M=None, Dqk=128, Dv=None, causal=True, window=None, cu=None,
             dtype=torch.bfloat16, tol=None, **cfg):
    M = M or N
    Dv = Dv or Dqk
    config = DeltaMatchConfig(**cfg)
    tol = tol or (FP8_TOL if config.precision == "fp8" else BF16_TOL)
    q, k, v, do = _inputs(B, Hq, Hkv, N, M, Dqk, Dv, dtype)
    cuq = cuk = None
    if cu is not None:
        cuq = cuk = torch.tensor(cu, dtype=torch.int32, device="cuda")
    kw = dict(causal=causal, softmax_scale=Dqk ** -0.5, window=window, cu_seqlens_q=cuq, cu_seqlens_k=cuk,
              config=config)
    assert K.supports(q, k, v, window, config) is None
    fk = K.forward(q, k, v, **kw)
    fr = R.forward(q, k, v, **kw)
    errs = {"out": rel_err(fr[0], fk[0])}
    fin = torch.isfinite(fr[1])
    assert torch.equal(torch.isfinite(fk[1]), fin)
    errs["lse"] = (fk[1][fin] - fr[1][fin]).abs().max().item() if fin.any() else 0.0
    if config.precision == "fp8":
        for i, name in ((2, "q8"), (3, "k8"), (4, "v8")):
            errs[name + "_mismatch"] = (fk[i].float() != fr[i].float()).float().mean().item()
        # v8 saved row-major, like the reference (the kernels' heads may be padded to quantize.TAIL_ROWS rows)
        assert fk[4].stride()[2:] == fr[4].stride()[2:]
    # the backward from the SAME saved tensors (the reference's), so only the backward is compared
    gk = K.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    gr = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    for name, a, b in zip(("dq", "dk", "dv"), gk, gr):
        assert torch.isfinite(a).all(), name
        errs[name] = rel_err(b, a)
    # and from the kernels' own saved tensors (their layout: padded heads, TMA where it applies)
    for name, a, b in zip(("dq_own", "dk_own", "dv_own"), K.backward(do, q, k, v, fk[0], fk[1], *fk[2:], **kw), gr):
        assert torch.isfinite(a).all(), name
        errs[name] = rel_err(b, a)
    print(f"ERRS {config.precision}-{config.delta} B{B} H{Hq}/{Hkv} N{N} M{M} D{Dqk}/{Dv} causal={causal} "
          f"window={window} varlen={cu is not None} block={config.block}:",
          {k_: float(f"{v_:.3g}") for k_, v_ in errs.items()})
    for name in ("out", "dq", "dk", "dv", "dq_own", "dk_own", "dv_own"):
        assert errs[name] <= tol, (name, errs)
    assert errs["lse"] < (1e-2 if config.precision == "fp8" else 1e-4)
    return errs


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_dense_fp8(D, causal):
    _compare(B=2, Hq=4, Hkv=4, N=2048, Dqk=D, causal=causal)


@pytest.mark.parametrize("precision,delta", [("bf16", "matching"), ("fp8", "stale"), ("bf16", "stale")])
def test_modes(precision, delta):
    _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128, precision=precision, delta=delta)


def test_gqa_fp16_block64_tails():
    _compare(B=2, Hq=8, Hkv=2, N=1000, M=1500, Dqk=128, dtype=torch.float16, block=64)


def test_mla_dims_window():
    _compare(B=1, Hq=4, Hkv=1, N=3000, Dqk=192, Dv=128, window=700)


@pytest.mark.parametrize("window", [None, 300])
def test_varlen(window):
    _compare(B=1, Hq=4, Hkv=2, N=4096, Dqk=128, cu=[0, 1000, 1001, 3000, 4096], window=window)


def test_varlen_tma_aligned_starts():
    """Sequence starts that are multiples of 16 tokens: the kernels read through TMA descriptors (others take
    the pointer path, tests/test_kernels.py), tokens past the last sequence included (their q8/k8/v8 are
    unspecified, so the *_mismatch figures printed for this case count them)."""
    cu = torch.tensor([0, 1024, 1040, 3008], dtype=torch.int32, device="cuda")
    z = torch.empty(1, 1, 4096, 8, device="cuda")
    assert KO.sequences(z, z, cu, cu)[1].aligned
    assert C.use_tma("fwd", True, 128, 128) and C.use_tma("dq", True, 128, 128)
    _compare(B=1, Hq=4, Hkv=2, N=4096, Dqk=128, cu=[0, 1024, 1040, 3008], window=None)


def test_tma_equals_pointer_paths_on_tail_tiles():
    """Dense N = 4000 (not whole 128-token tiles): TMA tiles past a head's end read the zero rows the heads of q8,
    k8, v8 are padded with (ops._tma_rows); the same bits as the pointer loads. The Triton kernels (the Gluon ones
    take this batch by default: test_hopper_ragged)."""
    q, k, v, do = _inputs(2, 8, 2, 4000, 4000, 128, 128, torch.bfloat16)
    kw = dict(causal=True, softmax_scale=128 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    runs = []
    for on in (True, False):
        with _variant(fwd_tma=on, dq_tma=on, **TRITON):
            f = K.forward(q, k, v, **kw)
            runs.append((*f[:2], *K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)))
    for a, b in zip(*runs):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_tma_equals_pointer_paths(monkeypatch):
    q, k, v, do = _inputs(2, 8, 2, 4096, 4096, 128, 128, torch.bfloat16)
    kw = dict(causal=True, softmax_scale=128 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())

    def fwd_bwd():
        f = K.forward(q, k, v, **kw)
        return (*f[:2], *K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw))

    tma = dict(fwd_tma=True, dq_tma=True)
    runs = {}
    for name, tune in {"tma": tma, "pointers": dict(fwd_tma=False, dq_tma=False),
                       "tma, scale loads flipped": tma}.items():
        if name == "tma, scale loads flipped":  # how the loops read their scales changes no bit (D=128: inline PTX)
            assert all(C.asm_scales(k, 128, True, False) for k in C.ASM_SCALES_HEAD_DIMS)
            monkeypatch.setattr(C, "ASM_SCALES_HEAD_DIMS", {k: () for k in C.ASM_SCALES_HEAD_DIMS})
            P.select.cache_clear()
        # the Triton kernels, not the Gluon ones at D=128
        with _variant(tune, dkdv_kernel="triton", dq_kernel="triton"):
            runs[name] = fwd_bwd()
    monkeypatch.undo()
    for name in ("pointers", "tma, scale loads flipped"):
        for a, b in zip(runs["tma"], runs[name]):
            assert torch.equal(a, b), name
    P.select.cache_clear()
    with _variant(dkdv_kernel="triton", dq_kernel="triton"):  # and the Triton kernels against the reference at D=128
        _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)


def test_e5m2_pow2():
    _compare(B=1, Hq=2, Hkv=2, N=2048, Dqk=128, grad_format="e5m2", scale_rounding="pow2")


def test_non_contiguous_bshd():
    """transformers hands (B, H, S, D) views of (B, S, H, D) tensors."""
    B, N, H, D = 2, 1024, 4, 128
    cfg = DeltaMatchConfig()
    base = [torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q, k, v, do = (t.transpose(1, 2) for t in base)
    kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None, config=cfg)
    fk, fr = K.forward(q, k, v, **kw), R.forward(q, k, v, **kw)
    assert rel_err(fr[0], fk[0]) < FP8_TOL
    gk = K.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    gr = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    for a, b in zip(gk, gr):
        assert rel_err(b, a) < FP8_TOL


def test_against_exact_attention():
    B, H, N, D = 1, 4, 2048, 128
    q, k, v, do = _inputs(B, H, H, N, N, D, D, torch.bfloat16, seed=3)
    for prec, tol_f, tol_b in (("fp8", 5e-2, 1e-1), ("bf16", 1e-2, 1e-2)):
        cfg = DeltaMatchConfig(precision=prec)
        kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=cfg)
        f = K.forward(q, k, v, **kw)
        g = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True)
        o.backward(do.double())
        print("EXACT", prec, "out", rel_err(o, f[0]), [rel_err(b, a) for a, b in zip(g, (qd.grad, kd.grad, vd.grad))])
        assert rel_err(o, f[0]) < tol_f
        for a, b in zip(g, (qd.grad, kd.grad, vd.grad)):
            assert rel_err(b, a) < tol_b, (prec, rel_err(b, a))


@pytest.mark.parametrize("N", [8192, 32768])
def test_invariant_residual(N):
    """sum_j dS_ij = 0 up to fp32 rounding with matching; orders of magnitude off with stale."""
    res = _invariant(N)
    assert res["matching"] <= 1e-5
    assert res["stale"] > 100 * res["matching"]


def test_correction_pass_scale_after_sum(monkeypatch):
    """The correction pass scaling row sums instead of every dP (configs.SCALE_AFTER_SUM_HEAD_DIMS; D=64 added
    here): the same tolerances, the invariant at 8K still at fp32 rounding."""
    monkeypatch.setattr(C, "SCALE_AFTER_SUM_HEAD_DIMS", (64, 128, 256))
    _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)
    _compare(B=1, Hq=4, Hkv=4, N=2048, Dqk=64, causal=False)
    res = _invariant(8192)
    assert res["matching"] <= 1e-5


def test_dkdv_lse2_and_p256():
    """The dK/dV kernel reading the dQ kernel's LSE2 and taking P * 256 straight from exp2 (pinned lse2, p256, as
    by default at these head dims): the same tolerances, full and causal, D 64, 128 and 256, GQA, and the stale
    delta."""
    with _variant(lse2=True, p256=True):
        _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)
        _compare(B=1, Hq=4, Hkv=4, N=2048, Dqk=64, causal=False)
        _compare(B=1, Hq=2, Hkv=2, N=1024, Dqk=256)
        _compare(B=1, Hq=4, Hkv=4, N=2048, Dqk=128, delta="stale")


@pytest.mark.parametrize("stages,wgs64", [(2, {64: (2, 240)}), (3, {64: (2, 240)}), (3, {64: (3, 160)})],
                         ids=["s2-wg2", "s3-wg2", "s3-wg3"])
def test_dkdv_hopper_kernel(stages, wgs64):
    """The Gluon dK/dV kernel (dkdv_hopper.py, pinned dkdv_kernel="gluon") against the reference (the same tolerances)
    and against _bwd_dkdv_kernel reading the same dS tile scales (the same arithmetic: only the MMAs' issue
    order differs), causal and full, D 64 and 128, GQA; dQ is untouched. At D=64 with programs of two or three
    warpgroups (`wgs64`; three: 192 keys, which do not divide N at 1024 or 1280)."""
    skip_unless_gluon_triton()
    opts = dict(dkdv_hopper_stages=stages, dkdv_hopper_wgs=wgs64)
    with _variant(dkdv_kernel="gluon", dq_kernel="triton", **opts):
        _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)
        _compare(B=2, Hq=2, Hkv=2, N=1024, Dqk=64, causal=False)
        _compare(B=1, Hq=4, Hkv=2, N=1280, Dqk=64)
    for errs in _gluon_vs_triton(dict(dkdv_kernel="gluon", dq_kernel="triton"), opts, seed=3):
        # dQ: the same Triton kernel; dV 3e-3: the query tiles in pairs (the plan's dkdv pairs) skip a rescale
        # the Triton kernel makes (test_dkdv_hopper_loop_variants)
        assert errs[0] == 0.0 and errs[1] < 1e-3 and errs[2] < 3e-3, errs


def _gluon_vs_triton(gluon, opts, seed):
    """[(dq, dk, dv) relative errors] of the backward with the Gluon kernel(s) `gluon` pins (_variant), against the
    Triton kernels reading the same dS scales, from the same saved tensors: causal GQA and the full mask at D=128,
    causal and full at D=64, also at N that the forward's three warpgroups (192 queries) do not divide."""
    out = []
    for B, Hq, Hkv, N, D, causal in ((2, 4, 2, 2048, 128, True), (1, 4, 4, 1024, 128, False),
                                     (1, 4, 4, 1024, 64, True), (2, 4, 2, 1280, 64, True),
                                     (1, 2, 2, 1152, 64, False)):
        q, k, v, do = _inputs(B, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=seed)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = K.forward(q, k, v, **kw)
        grads = {}
        for name, tune in (("triton", dict(dkdv_kernel="triton", dq_kernel="triton")), ("gluon", gluon)):
            mp = pytest.MonkeyPatch()
            try:
                # the Triton dK/dV kernel reads the dQ kernel's dS scales, with GQA at D=128 too
                mp.setattr(C, "DKDV_DS_SCALES_GQA_HEAD_DIMS", C.DKDV_DS_SCALES_HEAD_DIMS)
                P.select.cache_clear()
                with _variant(tune, **opts):  # pinned: the Gluon run cannot fall back to Triton
                    b = _plan(q, k, v, kw).backward
                    assert ("gluon" in (b.dq, b.dkdv)) == (name == "gluon")
                    grads[name] = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
            finally:
                mp.undo()
                P.select.cache_clear()
        errs = [rel_err(b, a) for a, b in zip(grads["gluon"], grads["triton"])]
        print("GLUON vs TRITON", gluon, B, Hq, Hkv, N, D, causal, opts, errs)
        out.append(errs)
    return out


@pytest.mark.parametrize("stages,pingpong", [(2, 0), (3, 0), (3, 1), (4, 0)])
def test_dq_hopper_kernel(monkeypatch, stages, pingpong):
    """The Gluon dQ kernel with the correction pass (dq_hopper.py, pinned dq_kernel="gluon"), alone and with the Gluon
    dK/dV kernel, against the reference (the same tolerances) and against _bwd_dq_kernel (the same arithmetic;
    the dK/dV kernel reads the delta, LSE2 and dS scales it writes), causal and full, D 64 and 128, GQA, pow2
    scales; the invariant at 8K (D=128) and 2K (D=64). `pingpong`: the warpgroups take turns to issue their S and
    dP MMAs (1) or not (0), at both head dims (configs.DQ_HOPPER_PINGPONG set here)."""
    skip_unless_gluon_triton()
    monkeypatch.setattr(C, "DQ_HOPPER_PINGPONG", {64: pingpong, 128: pingpong})
    opts = dict(dq_hopper_stages=stages)
    with _variant(dq_kernel="gluon", dkdv_kernel="triton", **opts):
        _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)
        _compare(B=2, Hq=2, Hkv=2, N=1024, Dqk=64, causal=False, scale_rounding="pow2")
    with _variant(dq_kernel="gluon", dkdv_kernel="gluon", **opts):
        _compare(B=1, Hq=4, Hkv=4, N=2048, Dqk=128, causal=False)
        _compare(B=1, Hq=4, Hkv=2, N=1280, Dqk=64)
        # matching only: the Gluon dQ kernel computes the matching delta (a stale run cannot be pinned to it)
        res = _invariant(8192, deltas=("matching", ))
        res64 = _invariant(2048, D=64, deltas=("matching", ))
    assert res["matching"] <= 1e-5 and res64["matching"] <= 1e-5
    for errs in _gluon_vs_triton(dict(dq_kernel="gluon", dkdv_kernel="triton"), opts, seed=4):
        assert max(errs) < 1e-3, errs


def test_dkdv_hopper_loop_variants(monkeypatch):
    """The Gluon dK/dV kernel's loop variants against its plain loop (single tiles, the diagonal's mask tested per
    tile, the scales loaded in the tile) on the same saved tensors: query tiles in pairs (pinned dkdv_pairs:
    the second tile of each 128-row dO8 quantization tile skips dv's rescale, whose factor c / c' is 1 up to the
    division's rounding), the causal diagonal peeled off the loop (dkdv_peel) and the scales loaded a tile
    ahead (configs.DKDV_HOPPER_AHEAD, set here). dQ is untouched by all; the peel and the loads ahead change no
    value (dK, dV bit-identical); pairs change dV by < 3e-3 and leave dK, dV as close to the reference backward
    (fp32 products) as the plain loop. Dense causal MHA and GQA, the full mask, D 128 and 64 (two warpgroups,
    128-key programs; the peel and the loads ahead with three too).
    Not packed batches: pairs and the peel are refused there (odd query-tile counts break pairs). The differences
    are printed."""
    skip_unless_gluon_triton()
    pairs, peel, ahead = dict(dkdv_pairs=True), dict(dkdv_peel=True), dict(ahead=True)
    no_pipe = dict(dkdv_pipe=False)  # the pipelined dK MMA: test_dkdv_hopper_pipe
    causal_mha = [pairs, peel, ahead, {**pairs, **peel}, {**pairs, **ahead}, {**pairs, **peel, **ahead}]
    two, three = {64: (2, 240)}, {64: (3, 160)}  # D=64's MMA warpgroups (the last 192-key block of 1280 keys has
    # a warpgroup past the keys)
    cases = [((2, 4, 4, 2048, 128, True), two, causal_mha), ((2, 4, 2, 2048, 128, True), two, [pairs]),
             ((1, 4, 4, 1024, 128, False), two, [pairs, ahead]),
             ((2, 4, 4, 1280, 64, True), two, [pairs, peel, {**pairs, **peel}]),
             ((2, 4, 4, 1280, 64, True), three, [peel, ahead, {**peel, **ahead}]),
             ((1, 2, 2, 1152, 64, True), three, [peel]), ((2, 4, 4, 1280, 64, False), three, [ahead]),
             ((2, 4, 2, 1280, 64, True), two, [pairs]), ((1, 2, 2, 1152, 64, False), two, [pairs])]
    for (B, Hq, Hkv, N, D, causal), wgs, variants in cases:
        q, k, v, do = _inputs(B, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=11)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = R.forward(q, k, v, **kw)  # the saved tensors every backward pass starts from
        ref = R.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

        def run(variant):
            variant = dict(variant)
            ahead = variant.pop("ahead", False)
            monkeypatch.setattr(C, "DKDV_HOPPER_AHEAD", {2: ahead, 3: ahead})
            P.select.cache_clear()
            with _variant({"dkdv_pairs": False, "dkdv_peel": False, "dkdv_hopper_wgs": wgs, **no_pipe,
                         **variant}):
                return K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

        plain = run({})
        to_ref_plain = [rel_err(b, a) for a, b in zip(plain, ref)]
        for variant in variants:
            grads = run(variant)
            between = [rel_err(b, a) for a, b in zip(grads, plain)]
            to_ref = [rel_err(b, a) for a, b in zip(grads, ref)]
            print("DKDV LOOP", (B, Hq, Hkv, N, D, causal), wgs, sorted(variant), "between", between,
                  "vs reference: plain", to_ref_plain, "variant", to_ref)
            if variant.get("dkdv_pairs"):
                assert between[0] == 0.0 and between[1] == 0.0 and between[2] < 3e-3, between
                for e_var, e_plain in zip(to_ref[1:], to_ref_plain[1:]):
                    assert e_var < 1.1 * e_plain + 1e-4, (to_ref, to_ref_plain)
            else:
                assert between == [0.0, 0.0, 0.0], between


def test_dkdv_hopper_pipe():
    """The Gluon dK/dV kernel with each tile's dK MMA issued under the next tile's exponentials
    (the plan's dkdv pipe: two warpgroups, dense batches without GQA) against its plain loop on the same saved
    tensors: the same operations in the same order, so dQ, dK and dV are bit-identical. D=128: the full mask, with
    a ring of 4 stages too, and the causal mask (the diagonal's peel and pairs before and in the pipeline); D=64
    with two warpgroups (TUNE dkdv_hopper_wgs), causal with and without the peel, and the full mask. Where the sm_90
    ptxas is CUDA 13+ (Triton 3.9) the piped loop is the form with a fresh dP^T accumulator (configs.dkdv_hopper;
    the other form's dK was wrong there)."""
    skip_unless_gluon_triton()
    two = dict(dkdv_hopper_wgs=(2, 240))
    for (B, Hq, Hkv, N, D, causal), opts in (((1, 4, 4, 1024, 128, False), {}),
                                             ((1, 4, 4, 1024, 128, False), dict(dkdv_hopper_stages=4)),
                                             ((2, 4, 4, 2048, 128, True), {}), ((2, 4, 4, 1280, 64, True), two),
                                             ((2, 4, 4, 1280, 64, True), dict(dkdv_peel=False, **two)),
                                             ((1, 4, 4, 1280, 64, False), two)):
        q, k, v, do = _inputs(B, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=17)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = R.forward(q, k, v, **kw)

        def run(pipe):
            with _variant(opts, dkdv_pipe=pipe):
                assert _plan(q, k, v, kw).backward.dkdv_launch["pipe"] == pipe
                return K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

        plain, piped = run(False), run(True)
        between = [rel_err(b, a) for a, b in zip(piped, plain)]
        print("DKDV PIPE", (B, Hq, Hkv, N, D, causal), opts, "between", between)
        assert all(torch.isfinite(t).all() for t in piped)
        assert all(torch.equal(a, b) for a, b in zip(piped, plain)), between


def test_dq_hopper_pipe(monkeypatch):
    """The Gluon dQ kernel's pipelined second pass (configs.DQ_HOPPER_PIPE_FULL, the full mask: each tile's dQ MMA
    issued with the next tile's S and dP) against its plain loop on the same saved tensors: the same tiles in the
    same order, the same rescales between them, so dQ, dK and dV are bit-identical. MHA and GQA, D 128 (with and
    without the ping-pong) and 64 (and 3 ring stages), one key tile."""
    skip_unless_gluon_triton()
    cases = [((1, 4, 4, 1024, 128, False), {}), ((2, 4, 2, 2048, 128, False), {}),
             ((1, 4, 4, 1024, 128, False), dict(pingpong=0)), ((1, 4, 4, 1024, 64, False), {}),
             ((2, 4, 4, 1280, 64, False), dict(dq_hopper_stages=3)), ((1, 2, 2, 128, 128, False), {})]
    for (B, Hq, Hkv, N, D, causal), opts in cases:
        q, k, v, do = _inputs(B, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=13)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = R.forward(q, k, v, **kw)  # the saved tensors every backward pass starts from
        ref = R.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
        tune = dict(opts)
        if "pingpong" in tune:
            monkeypatch.setitem(C.DQ_HOPPER_PINGPONG, D, tune.pop("pingpong"))

        def run(pipe):
            monkeypatch.setattr(C, "DQ_HOPPER_PIPE_FULL", (64, 128) if pipe else ())
            P.select.cache_clear()
            with _variant(dq_kernel="gluon", **tune):
                assert _plan(q, k, v, kw).backward.dq_launch["pipe"] == pipe
                return K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

        plain, piped = run(False), run(True)
        monkeypatch.undo()
        between = [rel_err(b, a) for a, b in zip(piped, plain)]
        to_ref = [[rel_err(b, a) for a, b in zip(g, ref)] for g in (plain, piped)]
        print("DQ PIPE", (B, Hq, Hkv, N, D, causal), opts, "between", between, "vs reference: plain, pipe", to_ref)
        assert all(torch.isfinite(t).all() for t in piped)
        assert all(torch.equal(a, b) for a, b in zip(piped, plain)), between


@pytest.mark.parametrize("D,tune", [(128, {}), (64, {}), (64, dict(dkdv_hopper_wgs=(2, 240))),
                                    (128, dict(dkdv_hopper_wgs=(3, 160)))],
                         ids=["d128", "d64", "d64-dkdv-wg2", "d128-dkdv-wg3"])
@pytest.mark.parametrize("cu", [[0, 1000, 1001, 3000, 4096], [0, 64, 64, 192, 1301, 2720]])
def test_hopper_packed(cu, D, tune):
    """The Gluon kernels on packed batches (kernels/segments.py: each sequence padded to a multiple of 128 rows,
    outputs to the packed rows) against the Triton kernels on the same inputs and saved tensors (the forward bit
    for bit, as on dense batches; the backward within the dense Gluon tests' 1e-3), and against the reference.
    Sequences of 1, 64 and 128 tokens, an empty one, and (second case) tokens after the last sequence, whose
    outputs stay 0 (LSE -inf); GQA and MHA; D=128 and D=64 (where packed batches take the Gluon forward and dQ
    kernels that dense ones do not), and with the other choice of two or three warpgroups for dK/dV (`tune`)."""
    skip_unless_gluon_triton()
    N = 4096
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    end = cu[-1]
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do = _inputs(1, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=7)
        kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                  config=DeltaMatchConfig())
        runs = {}
        for name, opts in (("gluon", tune), ("triton", TRITON)):
            with _variant(opts):  # the Gluon run must take the Gluon kernels, or the comparison proves nothing
                p, want = _plan(q, k, v, kw), "gluon" if name == "gluon" else "triton"
                assert (p.forward.kernel, p.backward.dq, p.backward.dkdv) == (want,) * 3, p
                f = K.forward(q, k, v, **kw)
                runs[name] = (f, K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw))
        (fg, gg), (ft, gt) = runs["gluon"], runs["triton"]
        print("GLUON PACKED FWD vs TRITON", cu, Hq, Hkv, rel_err(ft[0][:, :, :end], fg[0][:, :, :end]),
              (fg[1][:, :, :end] - ft[1][:, :, :end]).abs().max().item())
        assert torch.equal(fg[0], ft[0]) and torch.equal(fg[1], ft[1]), "forward"
        for a, b in zip(fg[2:], ft[2:]):  # the saved tensors: the same quantization
            assert torch.equal(a.float(), b.float())
        errs = [rel_err(b[:, :, :end], a[:, :, :end]) for a, b in zip(gg, gt)]
        print("GLUON PACKED vs TRITON", cu, Hq, Hkv, errs)
        assert max(errs) < 1e-3, errs
        for t in (*fg[:1], *gg):
            assert torch.isfinite(t).all() and not t[:, :, end:].float().any()
        assert (fg[1][:, :, end:] == float("-inf")).all()
    with _variant(tune):
        _compare(B=1, Hq=4, Hkv=2, N=N, Dqk=D, cu=cu)  # the Gluon path against the reference


def _fwd_bwd_under(tune, q, k, v, do, kw, **bwd_kw):
    """K.forward then K.backward on the same inputs with `tune` (_variant) for the call only: (forward results,
    backward results)."""
    with _variant(tune):
        f = K.forward(q, k, v, **kw)
        return f, K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw, **bwd_kw)


def _gluon_launches(monkeypatch, windows=None):
    """The Gluon kernels' launches from here on, as [(launcher, its segments argument)]: their host launchers are
    wrapped and called through (ops.py imports them at each call), so a test sees which kernels really ran. windows:
    a list that gets each launch's window argument."""
    from hf_deltamatch.kernels import dkdv_hopper, dq_hopper, fwd_hopper
    calls = []
    for mod, name in ((fwd_hopper, "fwd_hopper"), (dq_hopper, "dq_hopper"), (dkdv_hopper, "dkdv_hopper")):
        def launch(*args, _real=getattr(mod, name), _name=name, **kwargs):
            calls.append((_name, kwargs.get("segments")))
            if windows is not None:
                windows.append(kwargs.get("window"))
            return _real(*args, **kwargs)
        monkeypatch.setattr(mod, name, launch)
    return calls


def _row_diffs(a, b):
    """The largest |a - b| of each row: over D for gradients (B, H, N, D); each element of delta (B, H, N)."""
    diff = (a.float() - b.float()).abs()
    return diff.amax(dim=-1) if diff.dim() == 4 else diff


def _isolated_rows(rows):
    """Whether two kernels' gradients (or deltas), whose per-row differences are `rows` (_row_diffs), differ in at
    most 1 row in 256 (2 at least). The two kernels compute P and dS in fp32 in different orders (LSE2 and delta come
    from different dQ kernels on the dense and the padded layouts), so a score within an fp32 rounding of an fp8
    boundary can round to the neighbouring fp8 value in one of them: its row moves by one fp8 step of that product
    (e4m3: 1/8 relative), which at small N is more than 1e-3 of the whole gradient's norm. On the H200 at N = 129,
    D = 64, full mask, MHA, dV differed in 1 row of 1032 (1.8e-3), where the Triton kernel was the one off the
    reference backend (3.3e-3 against the Gluon kernel's 2.7e-3; gpu-tests.md in benchmarks/results/current/). A
    masking or indexing fault moves many rows."""
    differ = int((rows > 0).sum())
    print(f"  {differ} of {rows.numel()} rows differ")
    return differ <= max(2, rows.numel() // 256)


def _check_gluon_vs_triton(runs, what, tag, exact, lse_finite=False, same_strides=False, capped=True, dv_tol=1e-3):
    """A Gluon run against a Triton run on the same inputs ({"gluon"/"triton": (forward results, backward results)}):
    the forward within 1e-3 (LSE 1e-4), the saved tensors bit for bit (and their strides with `same_strides`), the
    backward's results within 1e-3 (dV: dv_tol) or apart in isolated rows only (_isolated_rows), all finite (LSE too
    with `lse_finite`); against exact float64 attention (`exact`: _exact's out and gradients) within 5 % + 1e-3 of
    the Triton kernels' error, and with `capped` under 1e-1 (out) / 2e-1 (gradients)."""
    (fg, gg), (ft, gt) = runs["gluon"], runs["triton"]
    err, lse_err = rel_err(ft[0], fg[0]), (fg[1] - ft[1]).abs().max().item()
    errs = [rel_err(b, a) for a, b in zip(gg, gt)]
    print(f"GLUON {what} vs TRITON {tag}: out {err:.3g} lse {lse_err:.3g} dq/dk/dv" + "/delta" * (len(errs) > 3),
          [float(f"{e:.3g}") for e in errs])
    # where a result disagrees beyond 1e-3: its per-row differences, and for a gradient its worst rows
    names = ("dq", "dk", "dv", "delta")
    rows = {name: _row_diffs(a, b) for name, e, a, b in zip(names, errs, gg, gt) if e >= 1e-3}
    for name, b in zip(names[:3], gt):
        if name in rows:
            flat, ref_rows = rows[name].flatten(), b.float().flatten(0, -2)
            print(f"  {name}: worst rows (index over {tuple(rows[name].shape)}, max abs diff, row norm):",
                  [(tuple(int(x) for x in torch.unravel_index(w, rows[name].shape)), float(f"{flat[w]:.3g}"),
                    float(f"{ref_rows[w].norm():.3g}")) for w in flat.topk(min(4, flat.numel())).indices])
    # both against float64 before any assertion: where the two kernels disagree, this says which one strayed
    o, grads = exact
    errs_exact = {name: [rel_err(o, f_[0])] + [rel_err(b, a) for a, b in zip(g_[:3], grads)]
                  for name, (f_, g_) in runs.items()}
    print(f"{what} vs EXACT {tag}: out/dq/dk/dv",
          {name: [float(f"{e:.3g}") for e in errs_] for name, errs_ in errs_exact.items()})
    assert err < 1e-3 and lse_err < 1e-4, (err, lse_err)
    for a, b in zip(fg[2:], ft[2:]):  # q8, k8, v8 and their scales: the same quantization
        assert a.shape == b.shape and torch.equal(a.float(), b.float())
        assert not same_strides or a.stride() == b.stride()
    for name, e in zip(names, errs):
        assert e < (dv_tol if name == "dv" else 1e-3) or _isolated_rows(rows[name]), (name, errs)
    for t in (*fg[:2 if lse_finite else 1], *gg):
        assert torch.isfinite(t).all()
    for eg, et in zip(errs_exact["gluon"], errs_exact["triton"]):
        assert eg <= 1.05 * et + 1e-3, errs_exact
    if capped:
        assert errs_exact["gluon"][0] < 1e-1 and max(errs_exact["gluon"][1:]) < 2e-1, errs_exact


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("N", [8000, 1000, 200, 129])
def test_hopper_ragged(N, D, causal, monkeypatch):
    """Dense batches whose N is not a multiple of 128 on the Gluon kernels (the plan's ragged layout: their packed
    variant, each head one sequence in the rows the fp8 copies are padded to, ops._dense_layout; under the full mask
    the forward and dQ kernels mask the last key tile past N), B = 2 (a TMA tile past a head's end reads its zero
    rows, not the next head), GQA and MHA, causal and full:
      - the Gluon forward, dQ and dK/dV kernels really launch, with the dense layout; with the Triton kernels pinned
        none;
      - against the Triton kernels on the same inputs: the forward within the dense Gluon forward's 1e-3 (LSE 1e-4),
        the saved tensors bit for bit, the backward and the returned delta within the packed test's 1e-3 (or apart in
        isolated rows: _isolated_rows), all finite;
      - against the reference backend (_compare: FP8_TOL, the Gluon tests' tolerance; 2e-2 at N = 8000, below) and
        exact float64 attention:
        there the FP8 quantization dominates (test_against_exact_attention measured 4.7e-2 on out, 5-6e-2 on the
        gradients at N = 2048), the same for both kernels, so the Gluon kernels' errors must stay within 5 % + 1e-3
        of the Triton kernels' (the two differ by < 1e-3, checked above; a masking fault adds tens of percent), and
        under that test's 5e-2 / 1e-1 doubled."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    npad = -(-N // 128) * 128
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do = _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=11)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        runs = {}
        for name, opts in (("gluon", {}), ("triton", TRITON)):
            calls.clear()
            runs[name] = _fwd_bwd_under(opts, q, k, v, do, kw, return_delta=True)
            if name == "gluon":  # the comparison proves nothing unless the Gluon kernels ran
                assert [c for c, _ in calls] == ["fwd_hopper", "dq_hopper", "dkdv_hopper"], calls
                for _, seg in calls:
                    assert seg.cu.tolist() == [0, N] and seg.pcu.tolist() == [0, npad] and seg.npad == npad
            else:
                assert calls == [], calls
        _check_gluon_vs_triton(runs, "RAGGED", f"N{N} D{D} H{Hq}/{Hkv} {'causal' if causal else 'full'}",
                               _exact(q, k, v, do, causal), lse_finite=True)
    calls.clear()
    # the default dispatch (the plan's ragged layout): the Gluon path (its own saved tensors) vs the reference. The
    # dK/dV sums run over N queries through QGMMA's ~14-bit accumulation, so the kernels' distance to the fp32
    # reference grows with N: dK 1.06e-2 at N = 8000 on the H200 (the Triton kernels on the reference's saved
    # tensors; 6e-3 at N = 1000), hence 2e-2 there. Both stay 6.4e-2 from float64 (checked above).
    _compare(B=2, Hq=4, Hkv=2, N=N, Dqk=D, causal=causal, tol=2e-2 if N > 4096 else None)
    assert [c for c, _ in calls].count("dkdv_hopper") == 1, calls  # the reference's saved q8..: not padded, Triton


def test_hopper_ragged_fallbacks(monkeypatch):
    """What a ragged dense batch does where the Gluon backward does not take it, each against the reference: the
    stale delta the Gluon forward and the Triton backward (the padded layout passes LSE2 and delta between the two
    Gluon kernels: both or neither); the invariant's row sums the Triton backward."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    _compare(B=2, Hq=4, Hkv=2, N=1000, Dqk=128, delta="stale")
    assert {c for c, _ in calls} == {"fwd_hopper"}, calls
    calls.clear()
    q, k, v, do = _inputs(1, 4, 4, 1000, 1000, 128, 128, torch.bfloat16, seed=4)
    kw = dict(causal=True, softmax_scale=128 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    f = K.forward(q, k, v, **kw)
    *grads, rs, ra = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw, return_row_sums=True)
    assert [c for c, _ in calls] == ["fwd_hopper"], calls
    ref = R.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
    assert all(rel_err(b, a) < FP8_TOL for a, b in zip(grads, ref))
    assert (rs.norm() / ra.norm()).item() <= 1e-5  # the Delta-Matching invariant


@pytest.mark.parametrize("stages", [2, 3])
def test_fwd_hopper_kernel(stages):
    """The Gluon forward (fwd_hopper.py, pinned fwd_kernel="gluon"; the default at D 64 and 128) against the
    reference (the same tolerances) and against _fwd_kernel on the same inputs (the same arithmetic): causal
    GQA and the full mask at D=128 and D=64, programs of three warpgroups (192 queries, which do not divide N, so
    the last block's rows past N are masked), rings of `stages` stages."""
    skip_unless_gluon_triton()
    tune = dict(fwd_kernel="gluon", fwd_hopper_stages=stages)
    with _variant(tune):
        _compare(B=1, Hq=4, Hkv=2, N=2048, Dqk=128)
        _compare(B=2, Hq=2, Hkv=2, N=1024, Dqk=64, causal=False)
    for B, Hq, Hkv, N, D, causal in ((2, 4, 2, 2048, 128, True), (1, 4, 4, 1024, 128, False),
                                     (1, 2, 2, 1280, 128, True), (1, 4, 4, 1024, 64, True),
                                     (2, 4, 2, 1280, 64, True), (1, 2, 2, 1152, 64, False)):
        q, k, v, _ = _inputs(B, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=5)
        kw = dict(causal=causal, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        outs = {}
        for name, on in (("triton", False), ("gluon", True)):
            # pinned: the Gluon run cannot fall back to Triton
            with _variant(tune, fwd_kernel="gluon" if on else "triton"):
                assert (_plan(q, k, v, kw).forward.kernel == "gluon") == on
                outs[name] = K.forward(q, k, v, **kw)
        err = rel_err(outs["triton"][0], outs["gluon"][0])
        lse_err = (outs["gluon"][1] - outs["triton"][1]).abs().max().item()
        print("GLUON FWD vs TRITON", B, Hq, Hkv, N, D, causal, stages, err, lse_err)
        assert err < 1e-3 and lse_err < 1e-4, (err, lse_err)
        for a, b in zip(outs["gluon"][2:], outs["triton"][2:]):  # the saved q8, k8, v8 and scales
            assert torch.equal(a, b)


@pytest.mark.parametrize("N", [2048, 8192])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=["d256", "mla"])
def test_fwd_hopper_wide(dims, causal, N, monkeypatch):
    """The Gluon forward at D=256 and MLA's Dqk=192 / Dv=128 (configs.GLUON_WIDE_DIMS, on
    by default) on dense batches, GQA and MHA, causal and full, with the Triton backward (pinned:
    test_dkdv_hopper_wide covers the Gluon dK/dV kernel there):
      - pinned Gluon, the Gluon forward launches and the backward runs the Triton dQ and dK/dV kernels; pinned
        Triton, nothing Gluon runs;
      - against the Triton forward on the same inputs: out within 1e-3 and LSE 1e-4 (test_fwd_hopper_kernel's bounds:
        the same 128-key steps and roundings), the saved q8, k8, v8 and scales bit for bit, so the Triton backward
        from either forward's saved tensors agrees within 1e-3 (it reads LSE, which differs by < 1e-4);
      - against exact float64 attention: the Gluon path's out and gradients within 5 % + 1e-3 of the Triton path's
        errors (the FP8 quantization dominates both, and is the same), and against the reference backend (_compare)
        within FP8_TOL, 2e-2 at N = 8192 (the QGMMA accumulation over N queries: test_hopper_ragged)."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    triton_bwd = dict(dq_kernel="triton", dkdv_kernel="triton")  # the Triton backward after either forward
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do, kw, tag = _wide_case(dims, causal, N, Hq, Hkv, seed=13)
        runs, launched = _runs_under(calls, dict(gluon=dict(triton_bwd, fwd_kernel="gluon"),
                                                 triton=dict(triton_bwd, fwd_kernel="triton")), q, k, v, do, kw)
        # the comparison proves nothing unless the Gluon forward ran (dense: no segments), and only it
        assert launched == dict(gluon=[("fwd_hopper", None)], triton=[]), launched
        _check_gluon_vs_triton(runs, "WIDE FWD", tag, _exact(q, k, v, do, causal), lse_finite=True, same_strides=True,
                               capped=False)
    calls.clear()
    # the Gluon forward's own saved tensors through the Triton backward, against the reference
    with _variant(triton_bwd, fwd_kernel="gluon"):
        _compare_wide(dims, causal, N)
    assert [c for c, _ in calls] == ["fwd_hopper"], calls


def _wide_case(dims, causal, N, Hq, Hkv, seed):
    """(q, k, v, do, the kernels' keyword arguments, a tag) of a dense causal or full batch at head dims `dims`
    ((Dqk, Dv)) and N tokens: B = 2 up to N = 2048, else 1."""
    Dqk, Dv = dims
    q, k, v, do = _inputs(2 if N <= 2048 else 1, Hq, Hkv, N, N, Dqk, Dv, torch.bfloat16, seed=seed)
    kw = dict(causal=causal, softmax_scale=Dqk ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    return q, k, v, do, kw, f"N{N} D{Dqk}/{Dv} H{Hq}/{Hkv} {'causal' if causal else 'full'}"


def _compare_wide(dims, causal, N):
    """_compare at head dims `dims` ((Dqk, Dv)), GQA 4/2, _wide_case's batch size, within 2e-2 at N > 4096 (the
    QGMMA accumulation over N queries: test_hopper_ragged)."""
    _compare(B=2 if N <= 2048 else 1, Hq=4, Hkv=2, N=N, Dqk=dims[0], Dv=dims[1], causal=causal,
             tol=2e-2 if N > 4096 else None)


def _runs_under(calls, tunes, q, k, v, do, kw, **bwd_kw):
    """({name: _fwd_bwd_under(tunes[name], ...)}, {name: the Gluon launches of that run, as _gluon_launches' `calls`
    records them})."""
    runs, launched = {}, {}
    for name, tune in tunes.items():
        calls.clear()
        runs[name] = _fwd_bwd_under(tune, q, k, v, do, kw, **bwd_kw)
        launched[name] = list(calls)
    return runs, launched


@pytest.mark.parametrize("N", [2048, 8192])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=["d256", "mla"])
def test_dkdv_hopper_wide(dims, causal, N, monkeypatch):
    """The Gluon dK/dV kernel at D=256 and MLA's Dqk=192 / Dv=128 (configs.GLUON_WIDE_DIMS: dV and dK in two
    launches) after the Triton dQ kernel (pinned: test_dq_hopper_wide runs it after the Gluon one) on
    dense batches, GQA and MHA, causal and full:
      - the Gluon forward and dK/dV kernels launch, and with the Triton dK/dV kernel pinned only the forward;
      - against the Triton dK/dV kernel on the same inputs and forward: the forward and dQ identical (the same
        kernels), dK within 1e-3 or apart in isolated rows (_check_gluon_vs_triton: the Triton kernel finds each dS
        tile's scale itself at these dims, the Gluon one reads the dQ kernel's, equal up to fp32 rounding), dV within
        3e-3 where the query tiles go in pairs (configs.dkdv_hopper's pairs: the second skips dV's rescale; on the H200
        2.4e-3 at N = 8192, the Gluon dV as close to float64 as the Triton one) and 1e-3 without them;
      - against exact float64 attention within 5 % + 1e-3 of the Triton kernels' errors, and against the reference
        backend (_compare) within FP8_TOL, 2e-2 at N = 8192."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    triton_dq = dict(dq_kernel="triton")
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do, kw, tag = _wide_case(dims, causal, N, Hq, Hkv, seed=19)
        unpaired = dict(triton_dq, dkdv_pairs=False, dkdv_peel=False)
        runs, launched = _runs_under(calls, dict(gluon=triton_dq, unpaired=unpaired,
                                                 triton=dict(triton_dq, dkdv_kernel="triton")), q, k, v, do, kw)
        for name in runs:
            assert launched[name] == [("fwd_hopper", None)] + ([("dkdv_hopper", None)] if name != "triton" else []), \
                launched
        assert torch.equal(runs["gluon"][1][0], runs["triton"][1][0])  # dQ: the same Triton kernel
        exact = _exact(q, k, v, do, causal)
        _check_gluon_vs_triton(dict(gluon=runs["gluon"], triton=runs["triton"]), "WIDE DKDV", tag, exact,
                               lse_finite=True, same_strides=True, capped=False, dv_tol=3e-3)
        _check_gluon_vs_triton(dict(gluon=runs["unpaired"], triton=runs["triton"]), "WIDE DKDV UNPAIRED", tag, exact,
                               lse_finite=True, same_strides=True, capped=False)
    calls.clear()
    with _variant(triton_dq):
        _compare_wide(dims, causal, N)
    # one forward, then backwards from the reference's saved tensors and from the kernels' own
    assert [c for c, _ in calls] == ["fwd_hopper", "dkdv_hopper", "dkdv_hopper"], calls


@pytest.mark.parametrize("N", [2048, 8192])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=["d256", "mla"])
def test_dq_hopper_wide(dims, causal, N, monkeypatch):
    """The Gluon dQ kernel at D=256 and MLA's Dqk=192 / Dv=128 (configs.GLUON_WIDE_DIMS: dQ's
    columns in two launches, the second reading the first's delta) on dense batches, GQA and MHA, causal and full:
      - by default the Gluon forward, dQ and dK/dV kernels launch, with the Triton dQ kernel pinned the forward and
        dK/dV only;
      - against the Triton dQ kernel on the same inputs and forward (_check_gluon_vs_triton): dQ, dK, dV and delta
        within 1e-3 or apart in isolated rows: the same 128-key steps and roundings, in another order (dK and dV come
        from the same Gluon kernel in both runs, with the dS scales and LSE2 of either dQ kernel);
      - against exact float64 attention within 5 % + 1e-3 of the Triton kernels' errors, and against the reference
        backend (_compare) within FP8_TOL, 2e-2 at N = 8192."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do, kw, tag = _wide_case(dims, causal, N, Hq, Hkv, seed=23)
        runs, launched = _runs_under(calls, dict(gluon={}, triton=dict(dq_kernel="triton")),
                                     q, k, v, do, kw, return_delta=True)
        assert {name: [c for c, _ in got] for name, got in launched.items()} == dict(
            gluon=["fwd_hopper", "dq_hopper", "dkdv_hopper"], triton=["fwd_hopper", "dkdv_hopper"]), launched
        _check_gluon_vs_triton(runs, "WIDE DQ", tag, _exact(q, k, v, do, causal), lse_finite=True, same_strides=True,
                               capped=False)
    calls.clear()
    _compare_wide(dims, causal, N)
    assert [c for c, _ in calls] == ["fwd_hopper", "dq_hopper", "dkdv_hopper", "dq_hopper", "dkdv_hopper"], calls


def test_fwd_hopper_wide_stages(monkeypatch):
    """At D=256 a ring of three stages fits the SM's shared memory too (229664 of its 232448 bytes; launch keeps
    FWD_HOPPER_WIDE_STAGES = 2 until timed): the same output and LSE bit for bit (the ring's depth changes no
    arithmetic), causal with GQA."""
    skip_unless_gluon_triton()
    calls = _gluon_launches(monkeypatch)
    q, k, v, _ = _inputs(1, 4, 2, 2048, 2048, 256, 256, torch.bfloat16, seed=17)
    kw = dict(causal=True, softmax_scale=256 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    outs = []
    for stages in (2, 3):
        with _variant(fwd_kernel="gluon", fwd_hopper_stages=stages):
            outs.append(K.forward(q, k, v, **kw)[:2])
    assert [c for c, _ in calls] == ["fwd_hopper"] * 2, calls
    assert all(torch.isfinite(t).all() for t in outs[0])
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("dkdv", [(8, 1), (8, 2)])
def test_head_dim_256_configs_and_split_dkdv(dkdv):
    """D > 128 with the launch configs timed on the H200 and dK/dV split into a dV and a dK launch
    (configs.DKDV_SPLIT_ABOVE): the same tolerances, causal and full, GQA, MLA's 192/128, and the stale delta."""
    assert C.dkdv_parts(192) == C.dkdv_parts(256) == (1, 2)
    with _variant(fwd=(64, 8, 3), dq=(128, 8, 1), dkdv=dkdv, fwd_kernel="triton", dq_kernel="triton",
                dkdv_kernel="triton"):  # the Triton kernels, or these configs go unused
        _compare(B=1, Hq=2, Hkv=2, N=1024, Dqk=256)
        _compare(B=1, Hq=4, Hkv=2, N=1500, Dqk=256, causal=False)
        _compare(B=1, Hq=4, Hkv=1, N=1000, Dqk=192, Dv=128, delta="stale")


def test_head_dim_256_bf16_mode():
    """bf16 mode at D=256 (and MLA's 192/128) with its own launch configs: bf16 tiles take twice the shared
    memory of fp8 ones."""
    _compare(B=1, Hq=2, Hkv=2, N=1024, Dqk=256, precision="bf16")
    _compare(B=1, Hq=4, Hkv=1, N=1000, Dqk=192, Dv=128, precision="bf16", causal=False)


def _invariant(N, D=128, deltas=("matching", "stale")):
    """{delta mode: ||sum_j dS_ij|| / ||sum_j |dS_ij||| over rows} at N keys, head dim D, causal."""
    B, H = 1, 2
    q, k, v, do = _inputs(B, H, H, N, N, D, D, torch.bfloat16, seed=1)
    res = {}
    for delta in deltas:
        cfg = DeltaMatchConfig(delta=delta)
        kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=cfg)
        f = K.forward(q, k, v, **kw)
        *_, rs, ra = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw, return_row_sums=True)
        # aggregate over rows: a row with one visible key has dS ~ 1e-7 * dP and |rs| = ra trivially
        res[delta] = (rs.norm() / ra.norm().clamp_min(1e-30)).item()
    print("INVARIANT", N, dict(K.TUNE), res)
    return res


def test_long_65536_runs():
    B, H, N, D = 1, 4, 65536, 128
    q, k, v, do = _inputs(B, H, H, N, N, D, D, torch.bfloat16, seed=2)
    kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    f = K.forward(q, k, v, **kw)
    g = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
    assert all(torch.isfinite(t).all() for t in (f[0], *g))


def test_tokens_outside_sequences_are_zero_and_tma_matches_pointers():
    """Saved q8/k8/v8 hold 0 outside every sequence in both backends (docs/numerics.md): the TMA tiles that run
    past a sequence's end read them (uninitialized memory there once made dQ NaN on the H200). The TMA paths
    then agree bit for bit with the pointer loads, from either backend's saved tensors."""
    g = torch.Generator(device="cpu").manual_seed(5)
    N, D = 3000, 128
    q, k, v, do = (torch.randn(1, 4, N, D, generator=g).to(torch.bfloat16).to("cuda") for _ in range(4))
    cu = torch.tensor([0, 1024, 1040, 2720], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, softmax_scale=D ** -0.5, window=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=DeltaMatchConfig())
    for backend in (R, K):
        f = backend.forward(q, k, v, **kw)
        for t in f[2:5]:
            assert not t[:, :, 2720:].float().any()
        results = []
        for tma in (True, False):
            # the Triton kernels' two paths (the Gluon ones take packed batches by default: test_hopper_packed)
            with _variant(fwd_tma=tma, dq_tma=tma, **TRITON):
                assert KO.sequences(q, k, cu, cu)[1].aligned
                out = K.forward(q, k, v, **kw)[:2]
                grads = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
            results.append([out[0][:, :, :2720], out[1][:, :, :2720], *grads])
        for a, b in zip(*results):
            assert torch.isfinite(a).all() and torch.equal(a, b)


def _window_mask(N, window, cu=None):
    """The boolean (N, N) mask of a causal sliding window (True: seen): key j for query i when i - window < j <= i,
    and with `cu` (packed sequences) j in i's sequence; tokens outside every sequence see themselves only."""
    i = torch.arange(N, device="cuda")
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)
    if cu is not None:
        seq = torch.bucketize(i, torch.tensor(cu[1:], device="cuda"), right=True)
        seq[i >= cu[-1]] = -1 - i[i >= cu[-1]]
        mask &= seq[None, :] == seq[:, None]
    return mask


def _gluon_vs_triton_window(q, k, v, do, kw, window, calls, windows):
    """The Gluon kernels against the Triton kernels (pinned) on the same inputs, forward and
    backward (with delta): ({name: (forward results, backward results)}, the Gluon run's launches). The Gluon run
    must launch the three Gluon kernels, each given the window; the Triton run none."""
    runs, launched = {}, []
    for name, on in (("gluon", True), ("triton", False)):
        calls.clear()
        windows.clear()
        runs[name] = _fwd_bwd_under({} if on else TRITON, q, k, v, do, kw, return_delta=True)
        if on:  # the comparison proves nothing unless the Gluon kernels ran, windowed
            assert [c for c, _ in calls] == ["fwd_hopper", "dq_hopper", "dkdv_hopper"], calls
            assert windows == [window] * 3, windows
            launched = list(calls)
        else:
            assert calls == [], calls
    return runs, launched


@pytest.mark.parametrize("window", [128, 1000, 4096])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("N", [8192, 8000])
def test_hopper_window(N, D, window, monkeypatch):
    """Causal sliding windows on the Gluon kernels (HAS_WINDOW in
    fwd_hopper, dq_hopper, dkdv_hopper) at N = 8192 and a ragged N = 8000 (their padded variant), D 128 and 64, GQA
    and MHA, B = 2; windows of 128 (gpt-oss: shorter than a forward program's 192 queries), 1000 (edges mid-tile) and
    4096 (Mistral):
      - with the switch on, the Gluon forward, dQ and dK/dV kernels launch, each given the window; off, none;
      - Gluon against Triton and both against exact float64 attention with the window's mask: _check_gluon_vs_triton
        (test_hopper_ragged's bounds);
      - the switch on through _compare (the kernels' own saved tensors and the reference's) against the reference
        backend, 2e-2 (test_hopper_ragged's bound at N > 4096: QGMMA's accumulation over N queries)."""
    skip_unless_gluon_triton()
    windows = []
    calls = _gluon_launches(monkeypatch, windows)
    mask = _window_mask(N, window)
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do = _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=13)
        kw = dict(causal=True, softmax_scale=D ** -0.5, window=window, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        runs, launched = _gluon_vs_triton_window(q, k, v, do, kw, window, calls, windows)
        for _, seg in launched:  # N = 8000: the dense layout of the padded variant (ops._dense_layout)
            if N % 128:
                assert seg.cu.tolist() == [0, N] and seg.pcu.tolist() == [0, -(-N // 128) * 128], seg
            else:
                assert seg is None, seg
        _check_gluon_vs_triton(runs, "WINDOW", f"N{N} D{D} H{Hq}/{Hkv} window {window}",
                               _exact(q, k, v, do, True, mask))
    calls.clear()
    windows.clear()
    with _variant():
        _compare(B=2, Hq=4, Hkv=2, N=N, Dqk=D, window=window, tol=2e-2)
    assert [c for c, _ in calls].count("fwd_hopper") == 1 and "dkdv_hopper" in [c for c, _ in calls], calls
    assert windows == [window] * len(calls), windows


@pytest.mark.parametrize("window", [128, 4096])
@pytest.mark.parametrize("N", [8192, 8000])
def test_hopper_window_backward_after_triton_forward(N, window, monkeypatch):
    """The Triton forward with the Gluon backward on a causal window (the Triton forward pinned: the
    pairing docs/kernels.md proposes for large windows, whose Gluon forward is the slower one): only dq_hopper and
    dkdv_hopper launch, each given the window, and the result agrees with the reference backend as the all-Gluon
    path does (test_hopper_window's bound), D=128, GQA 4/2, N = 8192 and the padded variant's N = 8000."""
    skip_unless_gluon_triton()
    windows = []
    calls = _gluon_launches(monkeypatch, windows)
    with _variant(fwd_kernel="triton"):
        _compare(B=2, Hq=4, Hkv=2, N=N, Dqk=128, window=window, tol=2e-2)
    assert "fwd_hopper" not in [c for c, _ in calls] and {"dq_hopper", "dkdv_hopper"} <= {c for c, _ in calls}, calls
    assert windows == [window] * len(calls), windows


@pytest.mark.parametrize("window", [128, 300])
@pytest.mark.parametrize("D", [128, 64])
def test_hopper_window_packed(D, window, monkeypatch):
    """Causal sliding windows on the Gluon kernels' packed batches (kernels/segments.py):
    sequences of 1000, 1 (each window restarts at its sequence's start), 1999 and 1096 tokens, GQA and MHA, D 128 and
    64: _gluon_vs_triton_window and _check_gluon_vs_triton (exact attention with the window's mask inside each
    sequence), then the switch on through _compare against the reference backend."""
    skip_unless_gluon_triton()
    windows = []
    calls = _gluon_launches(monkeypatch, windows)
    N, cu = 4096, [0, 1000, 1001, 3000, 4096]
    cu_t = torch.tensor(cu, dtype=torch.int32, device="cuda")
    mask = _window_mask(N, window, cu)
    for Hq, Hkv in ((4, 2), (4, 4)):
        q, k, v, do = _inputs(1, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=17)
        kw = dict(causal=True, softmax_scale=D ** -0.5, window=window, cu_seqlens_q=cu_t, cu_seqlens_k=cu_t,
                  config=DeltaMatchConfig())
        runs, launched = _gluon_vs_triton_window(q, k, v, do, kw, window, calls, windows)
        assert all(seg is not None for _, seg in launched), launched  # the packed batches' padded layout
        _check_gluon_vs_triton(runs, "WINDOW", f"packed D{D} H{Hq}/{Hkv} window {window}",
                               _exact(q, k, v, do, True, mask))
    with _variant():
        _compare(B=1, Hq=4, Hkv=2, N=N, Dqk=D, cu=cu, window=window)


@pytest.mark.parametrize("case", ["d128-gqa", "window128", "d256", "ragged1000"])
def test_cuda_graph_capture(case, monkeypatch):
    """deltamatch_attention's forward + backward captured into a CUDA graph (as torch.compile's reduce-overhead or a
    training loop's graphs do; benchmarks/attention.py --cuda-graph times it): every path a dense batch takes, the
    Gluon kernels at D=128 with GQA, a causal sliding window, D=256 (dQ in two launches) and the padded layout of a
    ragged N, captures with no host sync; the replay gives the eager call's output and gradients bit for bit, on the
    captured inputs and after new values are copied into them (nothing computed on the host at capture time is
    reused)."""
    skip_unless_gluon_triton()
    from hf_deltamatch import deltamatch_attention
    calls = _gluon_launches(monkeypatch)
    Hq, Hkv, N, D, window = {
        "d128-gqa": (4, 2, 2048, 128, None), "window128": (4, 4, 2048, 128, 128), "d256": (4, 2, 2048, 256, None),
        "ragged1000": (4, 2, 1000, 128, None)}[case]
    leaves = [t.requires_grad_() for t in _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=29)[:3]]
    do = _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=30)[3]

    def fwd_bwd():  # detached: an autograd graph kept alive across the capture holds the leaves' AccumulateGrad
        # nodes on the stream that made them, which the capture may not depend on (cudaErrorStreamCaptureImplicit)
        out = deltamatch_attention(*leaves, causal=True, window=window)
        return tuple(t.detach() for t in (out, *torch.autograd.grad(out, leaves, do)))

    eager = fwd_bwd()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fwd_bwd()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    calls.clear()
    with torch.cuda.graph(graph):
        static = fwd_bwd()
    assert [c for c, _ in calls] == ["fwd_hopper", "dq_hopper", "dkdv_hopper"], calls  # the Gluon path was captured
    graph.replay()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "dq", "dk", "dv"), static, eager):
        assert torch.equal(got, want), (case, name, rel_err(want, got))
    fresh = _inputs(2, Hq, Hkv, N, N, D, D, torch.bfloat16, seed=31)[:3]
    with torch.no_grad():
        for leaf, new in zip(leaves, fresh):
            leaf.copy_(new)
    graph.replay()
    eager = fwd_bwd()
    torch.cuda.synchronize()
    for name, got, want in zip(("out", "dq", "dk", "dv"), static, eager):
        assert torch.equal(got, want), (case, name, "new inputs", rel_err(want, got))
