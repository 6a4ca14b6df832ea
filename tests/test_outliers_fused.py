"""The outlier transforms fused into the fp8 Triton path (kernels/quantize.py, kernels/transform.py) against
outliers.py's torch transforms (docs/numerics.md, "Outlier channels").

Tolerances:
  - Quantization pass: q8, k8 and the tile scales are bit-identical to quantizing outliers.transform_qk's q', k'.
    Both round the same values at the same points (the centering: an fp32 difference of two input-dtype values,
    rounded once; the rotation: exact products, fp32 accumulation, rounded once). Only the rotation's fp32 summation
    order differs; on gaussian inputs it changes no rounded element (checked bit for bit here), and where channels
    span ~20 binades (the outlier profiles) it moves about one element in 10^4 by one bf16 ulp (2^-8 relative),
    which flips the e4m3 rounding of a few of those: at most one e4m3 ulp, on at most 1e-3 of the elements.
  - Backward pass (C(dk') R_k^T): the same, bounded by one ulp of the input dtype, bit-identical on gaussian inputs.
  - Through the op: the fused Triton path and the reference (torch transforms) compute the same contract: 1e-3
    relative (tests/test_kernels.py's kernels-vs-reference bound); against float64 autograd through the unfused
    transforms, test_attention.py's fp8 bounds (8% out, 11% gradients).
"""

import pytest
import torch
from test_attention import BOUND, make, run_exact, run_op

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention, diagnostics, outliers
from hf_deltamatch.testing import rel_err

kernels = pytest.importorskip("hf_deltamatch.kernels")
from hf_deltamatch.kernels import ops  # noqa: E402
from hf_deltamatch.kernels.quantize import quantize, quantize_padded  # noqa: E402
from hf_deltamatch.kernels.transform import center_rotate_, transform_grads  # noqa: E402

OPTIONS = {"hadamard": dict(qk_rotation="hadamard"), "smooth_k": dict(smooth_k=True),
           "both": dict(qk_rotation="hadamard", smooth_k=True)}
CU = [0, 70, 71, 200, 271]  # a one-token sequence; the last ends past a 128-token tile
LAYOUTS = ["dense", "varlen", "tiles", "padded"]


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _keys(n, d, dtype=torch.bfloat16, seed=0, heads=2, profile=None):
    if profile is not None:
        q, k, _, _ = diagnostics.make_inputs(profile, heads=heads, n=n, d=d, seed=seed, dtype=dtype)
        return q, k
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n, d, generator=g).to(dtype)
    k = (torch.randn(1, heads, n, d, generator=g) * 2 + torch.randn(d, generator=g) * 3).to(dtype)  # a key offset
    return q, k


def _assert_fp8_close(got, want, max_share):
    """got, want e4m3: equal, or at most one e4m3 ulp apart (1/8 relative) on at most max_share of the elements."""
    a, b = got.float(), want.float()
    diff = a != b
    assert diff.float().mean().item() <= max_share, diff.float().mean().item()
    assert ((a - b).abs() <= b.abs() / 8 + 2.0 ** -9)[diff].all()


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_quantization_pass_is_bit_identical_to_the_unfused_transform(option, layout):
    """q8, k8 and scales from the fused pass vs quantize(outliers.transform_qk's q', k'), for each layout the
    forward quantizes in: a dense batch (block 64), a varlen one (one program per sequence x tile), a packed one by
    its tile list (segments.py) and straight into the Gluon kernels' padded layout."""
    _check_quantization_pass(option, layout)


@pytest.mark.parametrize("option", ["hadamard", "both"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rotation_pass_with_several_tiles_per_program(option, layout, monkeypatch):
    """The rotation's launch with 3 tiles per program (configs.QUANTIZE_ROTATE_TILES; the H200's launches at small
    shapes take 1): R loaded once, the tiles in a loop; the last program's tiles run past the head's (dense: 5 tiles
    of 64), the sequence's (varlen: 2 of 128) or the list's end (tiles, padded: 5 listed). The padded layout without
    its token-major copy, which keeps one tile per program (quantize._launch)."""
    monkeypatch.setitem(kernels.TUNE, "quantize_rotate", (3, 8, 3))
    _check_quantization_pass(option, layout, token_major=False)


def test_rotation_launch_config(monkeypatch):
    """Tiles per program: QUANTIZE_ROTATE_TILES where the grid keeps a program per SM (B2 H16 N8192: 2048 tiles of
    128 over the H200's 132 SMs), fewer below, one on a small batch and above D=128; TUNE overrides, and a bad
    override is refused."""
    from hf_deltamatch.kernels import configs

    assert configs.quantize_rotate(2048, 128, "cpu") == (8, 8, 3)
    assert configs.quantize_rotate(600, 128, "cpu") == (4, 8, 3)
    assert configs.quantize_rotate(256, 128, "cpu")[0] == 1
    assert configs.quantize_rotate(2048, 256, "cpu") == (1, 8, 1)  # R and 3 tiles would not fit shared memory
    monkeypatch.setitem(kernels.TUNE, "quantize_rotate", (1, 8, 1))
    assert configs.quantize_rotate(2048, 128, "cpu") == (1, 8, 1)
    monkeypatch.setitem(kernels.TUNE, "quantize_rotate", (0, 8, 3))
    with pytest.raises(ValueError, match="tiles per program"):
        configs.quantize_rotate(2048, 128, "cpu")


def _check_quantization_pass(option, layout, token_major=True):
    """token_major: the padded layout's token-major copy too (its launches take one tile per program)."""
    opts = OPTIONS[option]
    rotation, smooth = opts.get("qk_rotation", "none"), opts.get("smooth_k", False)
    n = CU[-1]
    q, k = _keys(n, 64, dtype=torch.float16 if layout == "varlen" else torch.bfloat16)
    cu = None if layout == "dense" else torch.tensor(CU, dtype=torch.int32)
    r_q, r_k, means, key_means = outliers.fused_args(q, k, rotation, smooth, cu)
    q_ref, k_ref, key_means_ref = outliers.transform_qk(q, k, rotation, smooth, cu)
    assert (key_means is None) == (key_means_ref is None)
    if key_means is not None:
        assert torch.equal(key_means, key_means_ref)
    for x, x_ref, kw in ((q, q_ref, dict(rotation=r_q)), (k, k_ref, dict(rotation=r_k, means=means))):
        if layout == "padded":
            seg = ops._quantize_segments(*_packing(q, cu), 128)
            got = quantize_padded(x, seg, token_major=token_major, **kw)
            want = quantize_padded(x_ref, seg, token_major=token_major)
            got, want = (*got[0], *got[1]), (*want[0], *want[1])
        else:
            seg = ops._quantize_segments(*_packing(q, cu), 128) if layout == "tiles" else None
            block = 64 if layout == "dense" else 128
            got = quantize(x, block, cu_seqlens=cu, max_len=130, segments=seg, **kw)
            want = quantize(x_ref, block, cu_seqlens=cu, max_len=130, segments=seg)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _packing(q, cu):
    """(cu_seqlens, packing) as ops.forward hands them to _quantize_segments (None, None for a dense batch)."""
    if cu is None:
        return None, None
    vl, seqs = ops.sequences(q, q, cu, cu)
    return vl.cu_q, seqs.packing


@pytest.mark.parametrize("profile", ["qk-outliers", "k-bias"])
def test_quantization_pass_on_outlier_channels(profile):
    """Channels ~20 binades apart: the rotation's summation order may differ from torch's (module docstring)."""
    q, k = _keys(256, 128, profile=profile)
    r_q, r_k, means, _ = outliers.fused_args(q, k, "hadamard", True)
    q_ref, k_ref, _ = outliers.transform_qk(q, k, "hadamard", True)
    for x, x_ref, kw in ((q, q_ref, dict(rotation=r_q)), (k, k_ref, dict(rotation=r_k, means=means))):
        y, _, s = quantize(x, 128, **kw)
        y_ref, _, s_ref = quantize(x_ref, 128)
        assert torch.equal(s, s_ref)  # the amax sets the scale: an element one bf16 ulp off is not the amax here
        _assert_fp8_close(y, y_ref, 1e-3)


def _unfused_backward(dk, r_k, cu):
    """outliers._TransformQK.backward on dk (its torch ops: the reference the fused pass matches)."""
    k = torch.zeros_like(dk, requires_grad=True)
    _, k2, _ = outliers.transform_qk(k[:, :1], k, "hadamard" if r_k is not None else "none", True, cu)
    return torch.autograd.grad(k2, k, dk)[0]


@pytest.mark.parametrize("rotate", [False, True], ids=["center", "center+rotate"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_pass_matches_the_unfused_vjp(rotate, packed, dtype):
    """center_rotate_ (one pass after the means) vs the autograd backward of outliers.transform_qk; with a token
    before the first sequence and one after the last (mean 0: only rotated), and an empty sequence."""
    g = torch.Generator().manual_seed(3)
    d = 48  # Hadamard blocks 32 + 16: a head dim that is not a power of two
    dk = (torch.randn(2 if not packed else 1, 3, 150, d, generator=g) + 1.0).to(dtype)
    cu = torch.tensor([1, 60, 60, 149], dtype=torch.int32) if packed else None
    r_k = outliers.rotation_matrices(d, "cpu", dtype)[1] if rotate else None
    want = _unfused_backward(dk, r_k, cu)
    got = center_rotate_(dk.clone(), outliers.key_means(dk, cu), r_k, cu)
    assert torch.equal(got, want)
    # transform_grads: dq' R_q^T by torch's matmul, as the unfused backward
    r_q = outliers.rotation_matrices(d, "cpu", dtype)[0]
    dq = torch.randn(1, 3, 20, d, generator=g).to(dtype)
    dq_got, dk_got = transform_grads(dq, dk.clone(), r_q, r_k, True, cu)
    assert torch.equal(dq_got, dq @ r_q.T) and torch.equal(dk_got, want)


def test_backward_pass_on_a_wide_range_is_within_one_ulp():
    g = torch.Generator().manual_seed(4)
    dk = (torch.randn(1, 2, 128, 128, generator=g) * torch.logspace(-3, 3, 128)[torch.randperm(128, generator=g)])
    dk = dk.bfloat16()
    r_k = outliers.rotation_matrices(128, "cpu", torch.bfloat16)[1]
    want = _unfused_backward(dk, r_k, None).float()
    got = center_rotate_(dk.clone(), outliers.key_means(dk), r_k).float()
    ulp = 2.0 ** (torch.frexp(want)[1].float() - 8)  # one bf16 ulp of each element
    assert ((got - want).abs() <= ulp).all()


FUSED_CASES = {
    "causal-gqa": dict(make=(1, 4, 2, 150, 150, 64, 64), kw=dict(causal=True)),
    "window": dict(make=(1, 2, 2, 200, 200, 32, 32), kw=dict(causal=True, window=70)),
    "packed-gqa": dict(make=(1, 2, 1, 150, 150, 32, 32), cu=[0, 60, 61, 150], kw=dict(causal=True)),
}
# every transform on one case, both (the kernels' CENTER and ROTATE together) on the others
FUSED_RUNS = [("causal-gqa", o) for o in OPTIONS] + [("window", "both"), ("packed-gqa", "smooth_k"),
                                                      ("packed-gqa", "both")]


def _fused_case(name, seed=2):
    c = FUSED_CASES[name]
    q, k, v, do = make(*c["make"], seed=seed)
    k = (k.float() + 1.5).to(k.dtype)  # a shared key offset (what smoothing removes; its LSE shift is then large)
    kw = dict(c["kw"])
    if "cu" in c:
        kw["cu_seqlens_q"] = kw["cu_seqlens_k"] = torch.tensor(c["cu"], dtype=torch.int32)
    return q, k, v, do, kw


def _count_unfused(monkeypatch):
    calls = []
    real = outliers.transform_qk
    monkeypatch.setattr(outliers, "transform_qk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _run_unfused_triton(q, k, v, do, cfg, **kw):
    """The op on the Triton kernels with outliers.transform_qk's torch transforms around it (autograd's backward):
    what the fused path replaces. Returns out, dq, dk, dv and the LSE of the original problem."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    q2, k2, key_means = outliers.transform_qk(q, k, cfg.qk_rotation, cfg.smooth_k, kw.get("cu_seqlens_k"))
    plain = cfg.replace(backend="triton", qk_rotation="none", smooth_k=False)
    out, lse = deltamatch_attention(q2, k2, v, config=plain, return_lse=True, **kw)
    out.backward(do)
    if key_means is not None:
        lse = lse + outliers.lse_shift(q2.detach(), key_means, q.shape[-1] ** -0.5, kw.get("cu_seqlens_q"))
    return out.detach(), q.grad, k.grad, v.grad, lse


@pytest.mark.parametrize("case, option", FUSED_RUNS)
def test_fused_op_gradients(case, option, monkeypatch):
    """The whole op with the transforms fused (Triton, fp8) vs the same kernels with outliers.py's torch transforms
    around them: bit-identical out, LSE and gradients (module docstring); and vs float64 autograd through the
    unfused transforms (fp8 bounds). tests/test_outliers.py holds the kernels to the reference backend."""
    q, k, v, do, kw = _fused_case(case)
    cfg = DeltaMatchConfig(backend="triton", **OPTIONS[option])
    unfused = _count_unfused(monkeypatch)
    got = run_op(q, k, v, do, cfg, **kw)
    lse = deltamatch_attention(q, k, v, config=cfg, return_lse=True, **kw)[1]
    assert not unfused  # the quantization pass applied them
    want = _run_unfused_triton(q, k, v, do, cfg, **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv", "lse"), (*got, lse), want):
        assert torch.isfinite(a).any() and torch.equal(a, b), name

    def transformed_exact(q, k, v):
        q2, k2, _ = outliers.transform_qk(q, k, cfg.qk_rotation, cfg.smooth_k, kw.get("cu_seqlens_k"))
        return diagnostics.exact_attention(q2, k2, v, **kw)

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64 = transformed_exact(q64, k64, v64)
    exact = (out64.detach(), *torch.autograd.grad(out64, (q64, k64, v64), do.double()))
    fwd, bwd = BOUND["fp8"]
    assert rel_err(exact[0], got[0]) < fwd
    for name, x, w in zip("qkv", got[1:], exact[1:]):
        assert rel_err(w, x) < bwd, f"d{name}"


def test_fused_op_against_float64_without_transform():
    """Exact in real arithmetic: the fused op's gradients are the untransformed problem's, to fp8 accuracy."""
    q, k, v, do, kw = _fused_case("causal-gqa", seed=5)
    got = run_op(q, k, v, do, DeltaMatchConfig(backend="triton", qk_rotation="hadamard", smooth_k=True), **kw)
    want = run_exact(q, k, v, do, **kw)
    fwd, bwd = BOUND["fp8"]
    assert rel_err(want[0], got[0]) < fwd
    for name, x, w in zip("qkv", got[1:], want[1:]):
        assert rel_err(w, x) < bwd, f"d{name}"


def test_sinks_with_the_fused_rotation(monkeypatch):
    """Sinks join the softmax after the kernels; the rotation leaves every score, hence the sinks, unchanged."""
    q, k, v, do = make(1, 4, 2, 130, 130, 32, 32, seed=7)
    sinks = torch.linspace(-1.0, 3.0, 4)
    unfused = _count_unfused(monkeypatch)
    grads = {}
    for backend in ("triton", "reference"):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        s = sinks.clone().requires_grad_()
        cfg = DeltaMatchConfig(backend=backend, qk_rotation="hadamard")
        out = deltamatch_attention(qq, kk, vv, causal=True, sinks=s, config=cfg)
        out.backward(do)
        grads[backend] = (out.detach(), qq.grad, kk.grad, vv.grad, s.grad)
        if backend == "triton":
            assert not unfused
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), grads["triton"], grads["reference"]):
        assert rel_err(b.double(), a) <= 1e-3, name


def test_bf16_precision_keeps_the_torch_transforms(monkeypatch):
    """precision='bf16' has no quantization pass to fuse into: the transforms run as torch ops around the op."""
    q, k, v, do = make(1, 2, 2, 64, 64, 32, 32)
    cfg = DeltaMatchConfig(precision="bf16", qk_rotation="hadamard", smooth_k=True)
    unfused = _count_unfused(monkeypatch)
    got = run_op(q, k, v, do, cfg.replace(backend="triton"))
    assert unfused
    want = run_op(q, k, v, do, cfg.replace(backend="reference"))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert rel_err(b.double(), a) <= 1e-3, name


def test_kernels_reject_a_transform_they_cannot_apply():
    q, k, v, _ = make(1, 2, 2, 64, 64, 32, 32)
    r_q, r_k = outliers.rotation_matrices(32, "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="precision='bf16'"):
        kernels.forward(q, k, v, causal=True, softmax_scale=None, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                        config=DeltaMatchConfig(precision="bf16"), qk_transform=(r_q, r_k, None))
    with pytest.raises(ValueError, match="rotation must be"):
        quantize(q, 64, rotation=r_q.float())
    with pytest.raises(ValueError, match="means must be"):
        quantize(k, 64, means=outliers.key_means(k)[:, :1])
    with pytest.raises(ValueError, match="means must be"):
        center_rotate_(k.clone(), outliers.key_means(k).float())


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_rotation_tiles_per_program_on_the_gpu(packed, monkeypatch):
    """The rotating quantization pass at the benchmark's shape (B=2 or packed, H=16, N=8192, D=128; 2048 tiles of
    128) launched with several tiles per program (the default, 8, and a ragged 3 with 2 and 4 pipeline stages) gives
    the bytes and scales of one tile per program: each tile's MMA, reduction and cast are the same instructions, only
    the loads are scheduled differently. Both transforms (CENTER and ROTATE) on the keys."""
    cu = torch.tensor([0, 3000, 3001, 6500, 8192], dtype=torch.int32, device="cuda") if packed else None
    q, k, _, _ = diagnostics.make_inputs("qk-outliers", batch=1 if packed else 2, heads=16, n=8192, d=128,
                                         device="cuda")
    r_q, r_k, means, _ = outliers.fused_args(q, k, "hadamard", True, cu)
    vl, seqs = ops.sequences(q, k, cu, cu)
    cu_q = vl.cu_q if vl is not None else None
    seg = ops._quantize_segments(cu_q, seqs.packing, 128) if packed else None

    def run():
        got = []
        for x, kw in ((q, dict(rotation=r_q)), (k, dict(rotation=r_k, means=means))):
            got += quantize(x, 128, cu_seqlens=cu_q, max_len=seqs.max_n, segments=seg, **kw)
            if packed:
                got += [t for pair in quantize_padded(x, seg, **kw) for t in pair]
        return [t for t in got if t is not None]

    monkeypatch.setitem(kernels.TUNE, "quantize_rotate", (1, 8, 1))
    want = run()
    for cfg in (None, (3, 8, 2), (8, 8, 4)):
        if cfg is None:
            monkeypatch.delitem(kernels.TUNE, "quantize_rotate")
        else:
            monkeypatch.setitem(kernels.TUNE, "quantize_rotate", cfg)
        for a, b in zip(run(), want, strict=True):
            assert torch.equal(_bits(a), _bits(b)), cfg


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_fused_transforms_on_the_gpu(packed):
    """At a training shape (B=2 or packed, H=8 over 4 KV heads, N=4096, D=128, causal) on the GPU, qk_rotation and
    smooth_k together:
      - the quantization pass vs quantize(outliers.transform_qk's q', k') on the outlier profile (the tensor cores'
        fp32 summation order against cuBLAS's: the module docstring's one-e4m3-ulp bound), and the backward pass
        vs the unfused VJP (one bf16 ulp);
      - the op, fused vs the same kernels with the torch transforms around them (1e-2: q8/k8 equal but for those
        rare one-ulp flips, the kernels otherwise the same), and vs float64 exact attention (fp8 bounds), on
        gaussian inputs with a shared key offset."""
    cu = torch.tensor([0, 1000, 1001, 2900, 4096], dtype=torch.int32, device="cuda") if packed else None
    q, k, v, do = diagnostics.make_inputs("qk-outliers", batch=1 if packed else 2, heads=8, kv_heads=4, n=4096,
                                          d=128, device="cuda")
    r_q, r_k, means, _ = outliers.fused_args(q, k, "hadamard", True, cu)
    q_ref, k_ref, _ = outliers.transform_qk(q, k, "hadamard", True, cu)
    vl, seqs = ops.sequences(q, k, cu, cu)
    cu_q = vl.cu_q if vl is not None else None
    seg = ops._quantize_segments(cu_q, seqs.packing, 128) if packed else None
    for x, x_ref, kw in ((q, q_ref, dict(rotation=r_q)), (k, k_ref, dict(rotation=r_k, means=means))):
        y, _, s = quantize(x, 128, cu_seqlens=cu_q, max_len=seqs.max_n, segments=seg, **kw)
        y_ref, _, s_ref = quantize(x_ref, 128, cu_seqlens=cu_q, max_len=seqs.max_n, segments=seg)
        _assert_fp8_close(y, y_ref, 1e-3)
        torch.testing.assert_close(s, s_ref, rtol=2.0 ** -8, atol=0)
        if packed:
            (y, s), _ = quantize_padded(x, seg, **kw)
            (y_ref, s_ref), _ = quantize_padded(x_ref, seg)
            _assert_fp8_close(y, y_ref, 1e-3)
    want = _unfused_backward(k, r_k, cu).float()
    got = center_rotate_(k.clone(), outliers.key_means(k, cu), r_k, cu).float()
    assert ((got - want).abs() <= 2.0 ** (torch.frexp(want)[1].float() - 8)).all()

    q, k, v, do = (t.cuda() for t in make(1 if packed else 2, 8, 4, 4096, 4096, 128, 128, seed=1))
    k = (k.float() + 1.5).to(k.dtype)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu) if packed else dict(causal=True)
    cfg = DeltaMatchConfig(backend="triton", qk_rotation="hadamard", smooth_k=True)
    got = run_op(q, k, v, do, cfg, **kw)
    unfused = _run_unfused_triton(q, k, v, do, cfg, **kw)
    exact = run_exact(q, k, v, do, **kw)
    for name, a, b, e in zip(("out", "dq", "dk", "dv"), got, unfused, exact):
        assert torch.isfinite(a).all(), name
        assert rel_err(b.double(), a) <= 1e-2, name
        assert rel_err(e, a) < (BOUND["fp8"][0] if name == "out" else BOUND["fp8"][1]), name


def test_torch_compile_traces_the_fused_path():
    """Under torch.compile the custom op takes the transforms as tensor arguments: no graph break, the eager
    result bit for bit."""
    q, k, v, do = make(1, 2, 1, 64, 64, 32, 32)
    cfg = DeltaMatchConfig(backend="triton", qk_rotation="hadamard", smooth_k=True)
    eager = run_op(q, k, v, do, cfg, causal=True)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v):
        return deltamatch_attention(q, k, v, config=cfg, causal=True)

    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = f(qq, kk, vv)
    out.backward(do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), eager, (out, qq.grad, kk.grad, vv.grad)):
        assert torch.equal(a, b), name
