"""hf_deltamatch.kernels against the reference backend (same contract), on the CPU under TRITON_INTERPRET=1
(tests/conftest.py sets it before triton is imported) or on a GPU when there is one.

Same contract => agreement to fp32 rounding plus rare FP8 rounding flips (docs/numerics.md): relative
Frobenius error <= 1e-3 for out, dq, dk, dv; the quantized q8/k8/v8 and their scales bit-identical.
Shapes are small (N <= 256): each interpreted launch costs ~0.1-0.5 s.
"""

import importlib

import pytest
import torch

from hf_deltamatch import reference as R
from hf_deltamatch.config import DeltaMatchConfig
from hf_deltamatch.testing import assert_rel_close

K = pytest.importorskip("hf_deltamatch.kernels")
from hf_deltamatch.kernels import launch as KL, ops as KO  # noqa: E402
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# On a GPU the FP8 MMA accumulates with reduced precision (tests/test_kernels_gpu.py); the interpreter is exact.
TOL = 1e-3 if DEV == "cpu" else 1e-2


def _run(B=1, Hq=2, Hkv=1, N=128, M=None, Dqk=64, Dv=None, causal=True, window=None, cu=None,
         dtype=torch.bfloat16, seed=0, check_saved=True, row_sums=True, **cfg):
    M = M if M is not None else N
    Dv = Dv or Dqk
    config = DeltaMatchConfig(**cfg)
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(DEV)  # noqa: E731
    q, k, v, do = mk(B, Hq, N, Dqk), mk(B, Hkv, M, Dqk), mk(B, Hkv, M, Dv), mk(B, Hq, N, Dv)
    cuq = cuk = None
    if cu is not None:
        cuq = torch.tensor(cu[0], dtype=torch.int32, device=DEV)
        cuk = torch.tensor(cu[1], dtype=torch.int32, device=DEV)
    kw = dict(causal=causal, softmax_scale=Dqk ** -0.5, window=window, cu_seqlens_q=cuq, cu_seqlens_k=cuk,
              config=config)
    assert K.supports(q, k, v, window, config) is None
    fk = K.forward(q, k, v, **kw)
    fr = R.forward(q, k, v, **kw)
    assert fk[0].dtype == q.dtype and fk[0].shape == fr[0].shape
    assert_rel_close("out", fr[0], fk[0], TOL)
    fin = torch.isfinite(fr[1])
    assert torch.equal(torch.isfinite(fk[1]), fin)
    if fin.any():
        assert (fk[1][fin] - fr[1][fin]).abs().max().item() <= (1e-4 if DEV == "cpu" else 1e-2)
    if config.precision == "fp8" and check_saved:
        toks = [slice(None)] if cu is None else [slice(a, b) for a, b in zip(cu[0][:-1], cu[0][1:])]
        for t in toks:  # tokens outside every sequence are unspecified
            assert torch.equal(fk[2][:, :, t].float(), fr[2][:, :, t].float())
            assert torch.equal(fk[5][:, :, t], fr[5][:, :, t])
        # rows of D contiguous elements; the kernels' may sit in heads padded to quantize.TAIL_ROWS rows
        assert fk[4].shape == fr[4].shape and fk[4].stride()[2:] == fr[4].stride()[2:]
    else:
        for t in fk[2:]:
            assert t.numel() == 0 or config.precision == "fp8"
    # both backwards from the same saved tensors (the reference's)
    gk = K.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw, return_row_sums=row_sums)
    gr = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw, return_row_sums=True)
    for name, a, b in zip(("dq", "dk", "dv"), gk, gr):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.isfinite(a).all()
        assert_rel_close(name, b, a, TOL)
    if not row_sums:
        return None
    # the invariant sum_j dS_ij = 0 before quantization (row sums relative to |dS| row sums)
    rs, ra = gk[3], gk[4]
    assert_rel_close("sum_j |dS_ij|", gr[4], ra, TOL)
    resid = (rs.norm() / ra.norm().clamp_min(1e-30)).item()
    return resid


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_dense(causal, precision):
    _run(N=192, causal=causal, precision=precision)


@pytest.mark.parametrize("N,M", [(100, 230), (230, 100), (1, 130), (129, 129)])
def test_causal_bottom_right_and_tails(N, M):
    """N < M (bottom-right aligned), N > M (leading rows see no key: zeros, -inf LSE), ragged tails."""
    _run(N=N, M=M, causal=True)


@pytest.mark.parametrize("block", [64, 128])
def test_sliding_window(block):
    _run(N=256, window=50, block=block)


def test_window_bf16_fp16_inputs():
    _run(N=200, M=220, window=70, precision="bf16", dtype=torch.float16)


@pytest.mark.parametrize("Hq,Hkv", [(4, 2), (4, 1)])
def test_gqa_mqa(Hq, Hkv):
    _run(Hq=Hq, Hkv=Hkv, N=130, Dqk=32)


def test_dqk_ne_dv():
    _run(N=80, Dqk=48, Dv=32)  # padded to 64/32 inside


def test_mla_192_128():
    _run(N=64, Hq=1, Dqk=192, Dv=128, causal=True)


def test_head_dim_128_block64_fp16():
    _run(N=130, Dqk=128, block=64, dtype=torch.float16)


@pytest.mark.parametrize("precision", ["fp8", "bf16"])
def test_varlen(precision):
    cu = [0, 70, 71, 200, 260]
    _run(N=260, cu=(cu, cu), Hq=2, Hkv=1, precision=precision)


def test_varlen_window_distinct_k_lengths():
    _run(N=200, M=240, cu=([0, 60, 200], [0, 100, 240]), window=40, block=64)


def test_stale_and_invariant():
    """Matching keeps sum_j dS_ij at fp32 rounding; stale does not."""
    kw = dict(N=192, causal=True, seed=3)
    matching = _run(delta="matching", **kw)
    stale = _run(delta="stale", **kw)
    assert matching <= 1e-5
    assert stale > 10 * matching


def test_stale_bf16():
    _run(N=100, causal=False, delta="stale", precision="bf16")


def test_e5m2_pow2():
    _run(N=160, grad_format="e5m2", scale_rounding="pow2")


def test_deterministic_flag():
    """deterministic=True costs nothing because the kernels already are (config.py): both settings give the same
    bits, run to run, and those bits are the contract's (the reference's, to TOL)."""
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 96, 32).to(torch.bfloat16).to(DEV) for _ in range(4))
    runs = []
    for det in (False, True, True):
        cfg = DeltaMatchConfig(deterministic=det)
        kw = dict(causal=True, softmax_scale=32 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=cfg)
        f = K.forward(q, k, v, **kw)
        runs.append((f[0], f[1], *K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)))
    for run in runs[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], run):
            assert torch.equal(a, b), name
    fr = R.forward(q, k, v, **kw)
    gr = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (runs[0][0], *runs[0][2:]), (fr[0], *gr)):
        assert_rel_close(name, b, a, TOL)


def test_non_contiguous_inputs():
    """(B, H, S, D) views of (B, S, H, D) tensors, as transformers passes them."""
    g = torch.Generator().manual_seed(1)
    base = [torch.randn(2, 96, 2, 32, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4)]
    q, k, v, do = (t.transpose(1, 2) for t in base)
    cfg = DeltaMatchConfig()
    kw = dict(causal=True, softmax_scale=32 ** -0.5, window=None, cu_seqlens_q=None, cu_seqlens_k=None, config=cfg)
    fk, fr = K.forward(q, k, v, **kw), R.forward(q, k, v, **kw)
    assert_rel_close("out", fr[0], fk[0], TOL)
    gk = K.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    gr = R.backward(do, q, k, v, fr[0], fr[1], *fr[2:], **kw)
    for name, a, b in zip(("dq", "dk", "dv"), gk, gr):
        assert_rel_close(name, b, a, TOL)


def test_supports_reasons():
    cfg = DeltaMatchConfig()
    mk = lambda *s, dt=torch.bfloat16: torch.zeros(*s, dtype=dt, device=DEV)  # noqa: E731
    assert K.supports(mk(1, 2, 8, 64), mk(1, 1, 8, 64), mk(1, 1, 8, 64), None, cfg) is None
    assert "head dim" in K.supports(mk(1, 2, 8, 72), mk(1, 1, 8, 72), mk(1, 1, 8, 72), None, cfg)
    assert "head dim" in K.supports(mk(1, 2, 8, 512), mk(1, 1, 8, 512), mk(1, 1, 8, 512), None, cfg)
    assert "float16" in K.supports(mk(1, 2, 8, 64, dt=torch.float32), mk(1, 1, 8, 64, dt=torch.float32),
                                   mk(1, 1, 8, 64, dt=torch.float32), None, cfg)
    assert "multiple" in K.supports(mk(1, 3, 8, 64), mk(1, 2, 8, 64), mk(1, 2, 8, 64), None, cfg)


def test_dq_block_of_two_ds_tiles():
    """The dQ/correction kernel over 128-row blocks (two 64-row dS tiles, one scale each): a tuning option."""
    K.TUNE["dq"] = (128, 8, 2)
    try:
        _run(N=200, M=230, block=64)
        _run(N=150, causal=False)
    finally:
        K.TUNE.clear()


def test_tma_and_pointer_paths_agree():
    """fp8 kernels read their tiles through TMA descriptors where they can (dense batches and varlen batches
    whose sequence starts are multiples of 16, head dims <= 128) and through masked pointer loads elsewhere.
    Both against the reference, and bit-identical to each other (the same products in the same order)."""
    assert KL._use_tma("fwd", True, 128, 128) and not KL._use_tma("dq", False, 128, 128)
    assert not KL._use_tma("fwd", True, 192, 128)
    assert not KL._use_tma("fwd", True, 64, 64, starts_aligned=False)
    z = torch.zeros(1, 1, 300, 64)
    cu = torch.tensor([0, 96, 160, 300], dtype=torch.int32)
    info = KO._seq_info(z, z, cu, cu)  # (nseq, max_n, max_m, cu_q, cu_k, starts_aligned, packing)
    assert info[:3] == (3, 140, 140) and info[5] is True
    assert KO._seq_info(z, z, cu, cu + torch.tensor([0, 1, 0, 0], dtype=torch.int32))[5] is False
    assert KO._seq_info(z, z, None, None)[5] is True
    cases = [dict(N=200, M=230), dict(N=130, causal=False, Hq=4, Hkv=2),
             dict(N=300, M=320, cu=([0, 96, 160, 280], [0, 128, 176, 300]), window=50)]
    K.TUNE.update(fwd_tma=True, dq_tma=True)  # both kernels' TMA paths, at D=64 too
    try:
        for case in cases:
            _run(**case, row_sums=False)
        tma = _fwd_bwd_tma_vs_pointers()
    finally:
        K.TUNE.clear()
    for a, b in zip(*tma):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cu", [None, [0, 70, 71, 200]])
def test_token_major_copy_fused_or_separate(monkeypatch, cu):
    """quantize(transposed=True) writes the token-major copy in its own kernel (Triton 3.6) or through
    token_major() (other versions: Triton 3.9 compiled the fused store wrongly for sm_90): the same bytes,
    the same token-major layout."""
    Q = importlib.import_module("hf_deltamatch.kernels.quantize")  # the module (the package exports the function)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(1, 2, 200, 64, generator=g).to(torch.bfloat16).to(DEV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(Q, "FUSED_TOKEN_MAJOR", fused)
        outs.append(Q.quantize(x, 64, cu_seqlens=cu_t, max_len=None if cu is None else 129, transposed=True))
    (y1, yt1, s1), (y2, yt2, s2) = outs
    assert torch.equal(y1.float(), y2.float()) and torch.equal(s1, s2)
    assert torch.equal(yt1.float(), yt2.float()) and torch.equal(yt1.float(), y1.float())
    assert yt1.stride() == yt2.stride() and yt2.stride(2) == 1


def test_token_major_k_order():
    """token_major(k_order=True), the Gluon kernels' B operands (_gluon.fp8_operand): each group of 32 tokens in
    k_order()'s order, a permutation that pairs each thread's accumulator columns (2q, 2q+1, 8+2q, 9+2q, ...) with
    its fp8 operand's K values (4q .. 4q+3, 16+4q .. 19+4q)."""
    Q = importlib.import_module("hf_deltamatch.kernels.quantize")
    pos = Q.k_order(64)
    assert sorted(pos.tolist()) == list(range(64)) and pos[32:].tolist() == (pos[:32] + 32).tolist()
    for q in range(4):  # thread q's accumulator columns land on its operand's K values, in order
        cols = [8 * g + 2 * q + e for g in range(4) for e in range(2)]
        assert pos[cols].tolist() == [4 * q + i for i in range(4)] + [16 + 4 * q + i for i in range(4)]
    g = torch.Generator().manual_seed(7)
    x8 = torch.randn(2, 3, 96, 64, generator=g).to(torch.float8_e4m3fn).to(DEV)
    yt = Q.token_major(x8, k_order=True)
    assert yt.stride(2) == 1
    want = torch.empty_like(x8.float())
    want[:, :, Q.k_order(96).tolist()] = x8.float()
    assert torch.equal(yt.float(), want)
    with pytest.raises(ValueError, match="groups of 32"):
        Q.token_major(x8[:, :, :40], k_order=True)


@pytest.mark.parametrize("fused", [True, False])
def test_quantize_k_order(monkeypatch, fused):
    """quantize(transposed=True, k_order=True), the Gluon forward's V: the row-major copy and the scales as
    without k_order, the token-major copy in k_order() (written by the quantize kernel itself or by
    token_major)."""
    Q = importlib.import_module("hf_deltamatch.kernels.quantize")
    monkeypatch.setattr(Q, "FUSED_TOKEN_MAJOR", fused)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, 2, 192, 64, generator=g).to(torch.bfloat16).to(DEV)
    y, yt, s = Q.quantize(x, 64, transposed=True, k_order=True)
    y0, _, s0 = Q.quantize(x, 64)
    assert torch.equal(y.float(), y0.float()) and torch.equal(s, s0)
    want = torch.empty_like(y0.float())
    want[:, :, Q.k_order(192).tolist()] = y0.float()
    assert torch.equal(yt.float(), want) and yt.stride(2) == 1
    with pytest.raises(ValueError, match="groups of 32"):
        Q.quantize(x[:, :, :100], 64, transposed=True, k_order=True)


def test_correction_pass_scale_after_sum(monkeypatch):
    """The correction pass scaling each key tile's row sums of P * dP by the tile's dP scale instead of every dP
    (launch.SCALE_AFTER_SUM_HEAD_DIMS, D 128 and 256; here at the interpreter's D=64): the same contract, and the
    invariant still at fp32 rounding."""
    monkeypatch.setattr(KL, "SCALE_AFTER_SUM_HEAD_DIMS", (64,))
    try:
        resid = _run(N=256, causal=True, seed=3)
        _run(N=200, M=230, causal=False, Hq=4, Hkv=2, block=64, row_sums=False)
        K.TUNE["dq"] = (128, 8, 2)  # per-row dP scales (two dS tiles per block)
        _run(N=200, causal=True, row_sums=False)
    finally:
        K.TUNE.clear()
    assert resid <= 1e-5


@pytest.mark.parametrize("tune", [dict(dkdv_lse2=True, dkdv_p256=True), dict(dkdv_p256=True)])
def test_dkdv_lse2_and_p256(tune):
    """The dK/dV kernel reading the dQ kernel's LSE2 and/or taking P * 256 straight from exp2 (TUNE dkdv_lse2,
    dkdv_p256): the same contract in every mode that reaches the changed code (stale, bf16, window, varlen,
    pow2 scales, e5m2)."""
    K.TUNE.update(tune)
    try:
        _run(N=256, causal=True, seed=3)
        _run(N=200, M=230, causal=False, Hq=4, Hkv=2, block=64, row_sums=False, delta="stale")
        _run(N=200, M=220, window=70, precision="bf16", row_sums=False)
        cu = [0, 70, 71, 200, 260]
        _run(N=260, cu=(cu, cu), row_sums=False, grad_format="e5m2", scale_rounding="pow2")
    finally:
        K.TUNE.clear()


@pytest.mark.parametrize("group", [2, 3, 100])
def test_head_groups(monkeypatch, group):
    """Each kernel's causal grid handing out heads in groups (launch.HEAD_GROUP_CAUSAL, set to `group` here; 3
    leaves a partial last group, 100 means all heads at once): the same results, dense with GQA and varlen. The
    full mask hands them out one by one."""
    for kernel in KL.HEAD_GROUP_CAUSAL:
        monkeypatch.setitem(KL.HEAD_GROUP_CAUSAL, kernel, group)
    assert KL._grid("dkdv", 5, 4, 2, True) == ((20, 1, 2), 5, min(group, 4))
    assert KL._grid("dq", 5, 16, 1, False)[2] == 1
    _run(N=200, M=230, causal=True, Hq=4, Hkv=2, row_sums=False)
    if group == 3:
        cu = [0, 70, 71, 200, 260]
        _run(N=260, cu=(cu, cu), Hq=4, row_sums=False)


def test_dkdv_split_into_dv_and_dk_launches(monkeypatch):
    """dV and dK from two launches of the dK/dV kernel (above launch.DKDV_SPLIT_ABOVE = 128; here at the
    interpreter's D=64): the same contract in fp8 and bf16, with GQA, varlen, a window and the stale delta."""
    monkeypatch.setattr(KL, "DKDV_SPLIT_ABOVE", 32)
    assert KL._dkdv_parts(64) == (1, 2)
    _run(N=200, M=230, causal=True, Hq=4, Hkv=2, row_sums=False)
    _run(N=200, M=220, window=70, precision="bf16", row_sums=False)
    cu = [0, 70, 71, 200, 260]
    _run(N=260, cu=(cu, cu), row_sums=False, delta="stale", causal=False)


def _fwd_bwd_tma_vs_pointers():
    """(forward out, lse, dq, dk, dv) with the TUNE in force, and the same with pointer loads everywhere."""
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 150, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4))
    kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())

    def fwd_bwd():
        f = K.forward(q, k, v, **kw)
        return (*f[:2], *K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw))

    tma = fwd_bwd()
    saved = dict(K.TUNE)
    K.TUNE.update(fwd_tma=False, dq_tma=False)
    try:
        ptr = fwd_bwd()
        _run(N=150, row_sums=False)  # the pointer paths against the reference
    finally:
        K.TUNE.clear()
        K.TUNE.update(saved)
    return tma, ptr



def test_backward_non_contiguous_saved_tensors_take_pointer_path():
    """The backward's descriptors assume forward()'s contiguous q8/k8/v8; strided ones must still be right."""
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, 2, 130, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4))
    kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    f = R.forward(q, k, v, **kw)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in f[2:5]]  # same values, (B, N, H, D) storage
    assert not strided[0].is_contiguous()
    K.TUNE.update(dq_tma=True)
    try:
        want = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
        got = K.backward(do, q, k, v, f[0], f[1], *strided, *f[5:], **kw)
    finally:
        K.TUNE.clear()
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["reference", "kernels"])
def test_saved_fp8_zero_outside_sequences(backend):
    """docs/numerics.md: varlen tokens outside every sequence are stored as 0 with scale 1 (TMA tiles read them)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 300, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(3))
    cu = torch.tensor([0, 96, 160, 272], dtype=torch.int32, device=DEV)
    f = (R if backend == "reference" else K).forward(
        q, k, v, causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=cu, cu_seqlens_k=cu,
        config=DeltaMatchConfig())
    for t in f[2:5]:
        assert not t[:, :, 272:].float().any() and t[:, :, :272].float().any()
    for t in f[5:8]:
        assert torch.equal(t[:, :, 272:], torch.ones_like(t[:, :, 272:]))


def test_untested_triton_versions_are_named():
    """Triton versions the GPU tests have not passed with get a warning that says what to run instead."""
    assert all(KO._untested_triton(v) is None for v in ("3.6.0", "3.7.1", "3.9.1"))
    assert "3.10.0" in KO._untested_triton("3.10.0")
    msg = KO._untested_triton("3.7.0")  # 3.7.1 passed; 3.7.0 never ran
    assert "3.7.0" in msg and "pytest -m gpu" in msg and "backend='reference'" in msg


def test_unknown_tune_key_is_refused():
    """A misspelt launch-config override would time the defaults under the wrong name."""
    q = torch.zeros(1, 1, 16, 64, dtype=torch.bfloat16, device=DEV)
    kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    K.TUNE.update(bwd_tma=False)
    try:
        with pytest.raises(KeyError, match="bwd_tma"):
            K.forward(q, q, q, **kw)
    finally:
        K.TUNE.clear()
    K.forward(q, q, q, **kw)


@pytest.mark.parametrize("dq_cfg", [None, (128, 8, 2)])
def test_dkdv_reads_the_dq_kernels_ds_scales(monkeypatch, dq_cfg):
    """The dK/dV kernel taking each dS tile's scale from the dQ kernel instead of its own absmax (at D=64 with and
    without GQA, launch.DKDV_DS_SCALES_*; off here by emptying those tables, as at D=256): the same contract with
    GQA, a window, varlen (unaligned starts, a one-token sequence), the stale delta, 128-row dQ blocks (two dS
    tiles per block, the second past a sequence's end), dK/dV programs of 64 keys, fewer than a 128-key dS tile
    (launch.DKDV_BLOCK_N), and dK equal to the dK/dV kernel's own-absmax dK up to fp32 rounding (a misplaced
    scale changes the fp8 rounding by percents)."""
    cu = [0, 70, 71, 200, 260]
    runs = [dict(N=200, M=230, causal=True, Hq=4, Hkv=2), dict(N=200, M=220, window=70, block=64),
            dict(N=260, cu=(cu, cu), delta="stale", causal=False), dict(N=260, cu=(cu, cu), Hq=2, Hkv=1)]
    for kw in runs:
        grads = []
        for on in (True, False):
            for table in ("DKDV_DS_SCALES_HEAD_DIMS", "DKDV_DS_SCALES_GQA_HEAD_DIMS"):
                monkeypatch.setattr(KL, table, (64,) if on else ())
            K.TUNE.update({"dq": dq_cfg} if dq_cfg else {})
            try:
                assert KL._dkdv_block_n(kw.get("block", 128), 64, on) == (64 if on else kw.get("block", 128))
                _run(row_sums=False, **kw)
                g = torch.Generator().manual_seed(1)
                B, Hq, Hkv, N = 1, kw.get("Hq", 2), kw.get("Hkv", 1), kw["N"]
                M = kw.get("M", N)
                mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16).to(DEV)  # noqa: E731
                q, k, v, do = mk(B, Hq, N, 64), mk(B, Hkv, M, 64), mk(B, Hkv, M, 64), mk(B, Hq, N, 64)
                cuq = None if "cu" not in kw else torch.tensor(kw["cu"][0], dtype=torch.int32, device=DEV)
                args = dict(causal=kw.get("causal", True), softmax_scale=0.125, window=kw.get("window"),
                            cu_seqlens_q=cuq, cu_seqlens_k=cuq,
                            config=DeltaMatchConfig(block=kw.get("block", 128), delta=kw.get("delta", "matching")))
                saved = R.forward(q, k, v, **args)
                grads.append(K.backward(do, q, k, v, saved[0], saved[1], *saved[2:], **args))
            finally:
                K.TUNE.clear()
        for name, a, b in zip(("dq", "dk", "dv"), *grads):
            assert_rel_close(f"{name} {kw}", b, a, 1e-5)


def test_gluon_kernels_by_head_dim(monkeypatch):
    """Which Gluon kernels take the Gluon kernels' case (launch._hopper_case, forced true here: it needs an sm_90
    GPU), by head dim: the forward, dQ and dK/dV at D 64 and 128, dense and packed batches (the Gluon forward at
    D=64 on dense batches too: 0.95x the Triton forward's time)."""
    from hf_deltamatch.kernels import launch
    monkeypatch.setattr(launch, "_hopper_case", lambda **case: True)
    for d, varlen, want in ((128, False, (True, True, True)), (64, False, (True, True, True)),
                            (64, True, (True, True, True))):
        case = dict(fp8=True, dqk=d, dv=d, block=128, varlen=varlen, window=None, n=1024, m=1024,
                    device=torch.device("cpu"), packed=varlen)
        got = (launch._fwd_hopper(d, **case), launch._dq_hopper(d, stale=False, **case),
               launch._dkdv_hopper(d, **case))
        assert got == want, (d, varlen, got)
        assert not launch._dq_hopper(d, stale=True, **case)  # the Gluon dQ kernel has no stale delta


def test_gluon_triton_version_gate(monkeypatch):
    """The Gluon kernels run with a Triton of launch.GLUON_TRITON_VERSIONS only (the versions their GPU tests passed
    with): with another, an otherwise Gluon case (sm_90, fp8) takes the Triton kernels and one warning per process
    names the tested versions and HF_DELTAMATCH_GLUON=1, which runs them anyway; HF_DELTAMATCH_GLUON=0 keeps them
    off; any other value is an error. The capability and device are faked: the gate is host logic."""
    import types
    import warnings

    import triton

    from hf_deltamatch.kernels import launch
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(launch, "_warned_gluon_version", False)
    monkeypatch.delenv(launch.GLUON_ENV, raising=False)
    case = dict(fp8=True, dqk=128, dv=128, block=128, varlen=False, window=None, n=1024, m=1024,
                device=types.SimpleNamespace(type="cuda"))

    def gluon():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bwd = dict(case, e4m3=True, lse2_in=True, p_shift=8)
            got = (launch._fwd_hopper(128, **case), launch._dq_hopper(128, stale=False, **bwd),
                   launch._dkdv_hopper(128, **bwd))
        return got, [str(w.message) for w in caught]

    monkeypatch.setattr(triton, "__version__", launch.GLUON_TRITON_VERSIONS[0] + ".0")
    assert gluon() == ((True, True, True), [])
    monkeypatch.setattr(triton, "__version__", "99.1.0")
    got, msgs = gluon()
    assert got == (False, False, False) and len(msgs) == 1, msgs
    assert "99.1.0" in msgs[0] and launch.GLUON_TRITON_VERSIONS[0] in msgs[0] and "HF_DELTAMATCH_GLUON=1" in msgs[0]
    assert gluon() == ((False, False, False), [])  # once per process
    monkeypatch.setattr(triton, "__version__", launch.GLUON_TRITON_VERSIONS[0] + "0.1")  # major.minor, not a prefix
    assert gluon() == ((False, False, False), [])
    monkeypatch.setenv(launch.GLUON_ENV, "1")
    assert gluon() == ((True, True, True), [])
    monkeypatch.setattr(triton, "__version__", launch.GLUON_TRITON_VERSIONS[0] + ".0")
    monkeypatch.setenv(launch.GLUON_ENV, "0")
    assert gluon() == ((False, False, False), [])
    monkeypatch.setenv(launch.GLUON_ENV, "yes")
    with pytest.raises(ValueError, match="HF_DELTAMATCH_GLUON"):
        launch._fwd_hopper(128, **case)
    monkeypatch.delenv(launch.GLUON_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert gluon() == ((False, False, False), [])  # not sm_90: no Gluon kernel, no warning


def test_listed_triton_release_prefixes():
    """A release entry ("3.7.1") holds that release only, a minor one ("3.6") every release of it: the Triton
    versions the Gluon kernels (launch.GLUON_TRITON_VERSIONS) and the Triton kernels (ops.GPU_TESTED_TRITON) were
    GPU-tested with."""
    from hf_deltamatch.kernels import launch

    assert [launch.listed_triton(v) for v in ("3.6.0", "3.6.1+git1234", "3.60.0", "3.7.0", "3.7.1", "3.7.10",
                                              "3.9.0", "3.8.0")] == ["3.6", "3.6", None, None, "3.7.1", None,
                                                                     "3.9", None]
    assert launch.listed_triton("3.9.0", ("3.6",)) is None and launch.listed_triton("3.6.2", ("3.6",)) == "3.6"


def _fake_sm90(monkeypatch):
    """The Gluon kernels' host checks as on an H200 with a tested Triton, on this CPU machine: no interpreter, sm_90,
    the first of launch.GLUON_TRITON_VERSIONS, the opt-out variable unset (the dispatch is host logic)."""
    import triton

    monkeypatch.setattr(KL, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(triton, "__version__", KL.GLUON_TRITON_VERSIONS[0] + ".0")
    monkeypatch.delenv(KL.GLUON_ENV, raising=False)


def test_gluon_case_and_why_not(monkeypatch):
    """launch._hopper_why_not, the one predicate behind the Gluon kernels' dispatch (_hopper_case) and the dispatch
    log: None for their case, else the first reason against it. Dense batches of N = M not a multiple of 128
    ("ragged", launch.HOPPER_RAGGED) take them, causal or (HOPPER_RAGGED_FULL) under the full mask; TUNE
    ["hopper_ragged"] switches that off. (A causal window is no reason against them: test_gluon_window_dispatch.) The
    capability, device and Triton version are faked: the predicate is host logic (tests/test_kernels_gpu.py::
    test_hopper_ragged runs the kernels)."""
    import types

    _fake_sm90(monkeypatch)
    base = dict(fp8=True, e4m3=True, dqk=128, dv=128, block=128, varlen=False, window=None, n=8000, m=8000,
                device=types.SimpleNamespace(type="cuda"), lse2_in=True, p_shift=8, causal=True)

    def why(**change):
        return KL._hopper_why_not(**{**base, **change})

    assert KL.HOPPER_RAGGED  # on by default (GPU-tested: tests/test_kernels_gpu.py::test_hopper_ragged)
    monkeypatch.setattr(KL, "HOPPER_RAGGED", False)
    assert "HOPPER_RAGGED" in why() and why(n=8192, m=8192) is None
    monkeypatch.setattr(KL, "HOPPER_RAGGED", True)

    for n in (8000, 1000, 200, 129, 8192):
        for causal in (True, False):
            assert why(n=n, m=n, causal=causal) is None and KL._hopper_case(**{**base, "n": n, "m": n,
                                                                                "causal": causal})
    monkeypatch.setattr(KL, "HOPPER_RAGGED_FULL", False)
    assert why(n=8192, m=8192, causal=False) is None and why() is None
    assert "full mask" in why(causal=False) and not KL._hopper_case(**{**base, "causal": False})
    monkeypatch.setattr(KL, "HOPPER_RAGGED_FULL", True)
    # the padded layout's dQ kernel masks its last key tile in the plain pass 2 only: never the pipelined one
    assert KL._dq_hopper_cfg(128, False)["pipe"] and not KL._dq_hopper_cfg(128, False, padded=True)["pipe"]
    for change, phrase in ((dict(fp8=False), "bf16"), (dict(e4m3=False), "e5m2"), (dict(dqk=256, dv=256), "Dqk=256"),
                           (dict(dv=64), "Dv=64"), (dict(block=64), "block=64"), (dict(m=8192), "N != M"), (dict(varlen=True), "varlen"),
                           (dict(lse2_in=False), "LSE2"), (dict(device=types.SimpleNamespace(type="cpu")), "cpu")):
        got = why(**change)
        assert got is not None and phrase in got, (change, got)
    assert why(varlen=True, packed=True) is None
    K.TUNE["hopper_ragged"] = False
    try:
        assert "hopper_ragged" in why() and why(n=8192, m=8192) is None
    finally:
        K.TUNE.clear()
    # each kernel's own switch on top: the forward, dQ (matching delta only) and dK/dV all take a ragged batch
    fwd = {k: base[k] for k in ("fp8", "dqk", "dv", "block", "varlen", "window", "n", "m", "device", "causal")}
    assert KL._fwd_hopper(128, **fwd) and KL._dq_hopper(128, stale=False, **base) and KL._dkdv_hopper(128, **base)
    assert not KL._dq_hopper(128, stale=True, **base)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "10.0" in why()
    monkeypatch.setattr(KL, "INTERPRET", True)
    assert "TRITON_INTERPRET" in why()


def test_gluon_forward_wide_dims_dispatch(monkeypatch):
    """The Gluon forward at D=256 and MLA's Dqk=192 / Dv=128 (launch.FWD_HOPPER_WIDE_DIMS): on by default
    (HOPPER_FWD_WIDE); TUNE["hopper_fwd_wide"] = False turns it off with the dispatch log's reason; on dense batches
    of N = M a multiple of 128, causal or full, GQA or not, and nowhere else (varlen, window, ragged N, N != M, bf16, other head dims:
    each with its reason). A kernel's case without its wide-dims entry (launch._WIDE) declines these dims, and the
    forward's launch config is two warpgroups of 240 registers at Dv = 256, the D=128 one at Dv = 128. Host logic
    with the capability and Triton version faked (tests/test_kernels_gpu.py::test_fwd_hopper_wide runs the kernel)."""
    import types

    _fake_sm90(monkeypatch)
    dev = types.SimpleNamespace(type="cuda")
    fwd = dict(fp8=True, block=128, varlen=False, window=None, n=8192, m=8192, device=dev, causal=True)
    bwd = dict(fwd, e4m3=True, lse2_in=True, p_shift=8)

    def on(dqk, dv, **change):
        return KL._fwd_hopper(max(dqk, dv), **{**fwd, "dqk": dqk, "dv": dv, **change})

    def why(dqk, dv, **change):
        return KL._hopper_why_not(**KL._fwd_case(**{**fwd, "dqk": dqk, "dv": dv, **change}))

    assert KL.HOPPER_FWD_WIDE  # on: its GPU tests passed on the H200 (Triton 3.6 and 3.9)
    try:
        K.TUNE["hopper_fwd_wide"] = False
        for dqk, dv in KL.FWD_HOPPER_WIDE_DIMS:
            assert not on(dqk, dv) and "HOPPER_FWD_WIDE" in why(dqk, dv), why(dqk, dv)
        assert on(128, 128) and on(64, 64)  # the D 64 / 128 dispatch as before
        del K.TUNE["hopper_fwd_wide"]
        for dqk, dv in KL.FWD_HOPPER_WIDE_DIMS:
            for causal in (True, False):
                for n in (128, 2048, 8192):
                    assert on(dqk, dv, causal=causal, n=n, m=n) and why(dqk, dv, causal=causal, n=n, m=n) is None
            for change, phrase in ((dict(varlen=True, packed=True), "varlen"), (dict(window=512), "window"),
                                   (dict(n=8000, m=8000), "multiple of 128"), (dict(m=4096), "N != M"),
                                   (dict(fp8=False), "bf16"), (dict(device=types.SimpleNamespace(type="cpu")), "cpu")):
                got = why(dqk, dv, **change)
                assert got is not None and phrase in got and not on(dqk, dv, **change), (change, got)
            # the backward kernels take them through their own entries (test_gluon_dq_wide_dims_dispatch,
            # test_gluon_dkdv_wide_dims_dispatch)
            assert f"Dqk={dqk}, Dv={dv}" in KL._hopper_why_not(**{**bwd, "dqk": dqk, "dv": dv})
        for dqk, dv in ((256, 128), (192, 192), (128, 256), (96, 96)):  # no other head dims
            assert not on(dqk, dv) and "Dqk = Dv in 64, 128 only" in why(dqk, dv)
        K.TUNE["fwd_hopper"] = False  # the forward's own switch still turns it off
        assert not on(256, 256)
    finally:
        K.TUNE.clear()
    monkeypatch.setattr(KL, "HOPPER_FWD_WIDE", False)
    assert not on(256, 256) and not on(192, 128)
    monkeypatch.setattr(KL, "HOPPER_FWD_WIDE", True)
    assert on(256, 256) and on(192, 128)
    from hf_deltamatch.kernels import fwd_hopper
    assert KL._fwd_hopper_cfg(256) == dict(stages=KL.FWD_HOPPER_WIDE_STAGES, regs=KL.FWD_HOPPER_WIDE_REGS,
                                           warpgroups=fwd_hopper.WIDE_WARPGROUPS) and fwd_hopper.WIDE_WARPGROUPS == 2
    assert KL._fwd_hopper_cfg(128) == KL._fwd_hopper_cfg(64) == dict(
        stages=KL.FWD_HOPPER_STAGES, regs=KL.FWD_HOPPER_REGS, warpgroups=fwd_hopper.WARPGROUPS)



def test_gluon_dq_wide_dims_dispatch(monkeypatch):
    """The Gluon dQ kernel at D=256 and MLA's Dqk=192 / Dv=128 (launch.DQ_HOPPER_WIDE_DIMS): on by default
    (HOPPER_DQ_WIDE) for dense batches of N a multiple of 128 (not varlen, windows, ragged N, the stale delta);
    TUNE["hopper_dq_wide"] = False turns it off, with the dispatch log's reason; its launch config:
    dQ's columns in two launches (halves (1, 2)), DQ_HOPPER_WIDE_STAGES, no pipelined pass 2, even on the full mask.
    Host logic with the capability and Triton version faked (tests/test_kernels_gpu.py::test_dq_hopper_wide runs it)."""
    import types

    _fake_sm90(monkeypatch)
    dev = types.SimpleNamespace(type="cuda")
    case = dict(fp8=True, e4m3=True, block=128, varlen=False, window=None, n=8192, m=8192, device=dev, causal=True,
                lse2_in=True, p_shift=8)

    def on(dqk, dv, stale=False, **change):
        return KL._dq_hopper(max(dqk, dv), stale=stale, **{**case, "dqk": dqk, "dv": dv, **change})

    assert KL.HOPPER_DQ_WIDE
    try:
        for dqk, dv in KL.DQ_HOPPER_WIDE_DIMS:
            d = max(dqk, dv)
            assert KL._hopper_why_not(**{**case, "dqk": dqk, "dv": dv}, wide="dq") is None
            for causal in (True, False):
                assert on(dqk, dv, causal=causal)
                cfg = KL._dq_hopper_cfg(d, causal)
                assert (cfg["halves"], cfg["pipe"], cfg["stages"]) == ((1, 2), False, KL.DQ_HOPPER_WIDE_STAGES), cfg
            for change in (dict(varlen=True, packed=True), dict(window=512), dict(n=8000, m=8000), dict(fp8=False)):
                assert not on(dqk, dv, **change), change
            assert not on(dqk, dv, stale=True)
            K.TUNE["hopper_dq_wide"] = False
            assert not on(dqk, dv)
            assert "HOPPER_DQ_WIDE" in KL._hopper_why_not(**{**case, "dqk": dqk, "dv": dv}, wide="dq")
            K.TUNE.clear()
        assert KL._dq_hopper_cfg(128, False)["halves"] == (0,) and KL._dq_hopper_cfg(128, False)["pipe"]
    finally:
        K.TUNE.clear()


def test_gluon_dkdv_wide_dims_dispatch(monkeypatch):
    """The Gluon dK/dV kernel at D=256 and MLA's Dqk=192 / Dv=128 (launch.DKDV_HOPPER_WIDE_DIMS, HOPPER_DKDV_WIDE):
    on by default after either dQ kernel, on dense batches of N = M a multiple of 128 (causal or full, GQA or not);
    TUNE["hopper_dkdv_wide"] = False or TUNE["dkdv_hopper"] = False turns it off, the first with the dispatch log's
    reason; varlen, windows, ragged N decline with theirs. Its launch config: two warpgroups of 240 registers, dV and
    dK in two launches (parts (1, 2)), never the pipelined dK MMA (one launch only), even under a CUDA 12 ptxas; and
    the dQ kernel writes what it reads, LSE2 with P * 256 and the dS tile scales. Host logic with the capability and
    Triton version faked (tests/test_kernels_gpu.py::test_dkdv_hopper_wide runs the kernel)."""
    import types

    _fake_sm90(monkeypatch)
    monkeypatch.setattr(KL, "_sm90_ptxas_major", lambda: 12)
    dev = types.SimpleNamespace(type="cuda")
    case = dict(fp8=True, e4m3=True, block=128, varlen=False, window=None, n=8192, m=8192, device=dev, causal=True,
                lse2_in=True, p_shift=8)

    def on(dqk, dv, **change):
        return KL._dkdv_hopper(max(dqk, dv), **{**case, "dqk": dqk, "dv": dv, **change})

    def why(dqk, dv, **change):
        return KL._hopper_why_not(**{**case, "dqk": dqk, "dv": dv, **change}, wide="dkdv")

    assert KL.HOPPER_DKDV_WIDE
    try:
        for dqk, dv in KL.DKDV_HOPPER_WIDE_DIMS:
            d = max(dqk, dv)
            assert KL._dkdv_lse2(d) and KL._dkdv_p_shift(d, True) == 8  # what the Gluon kernel reads
            # dQ: the Gluon kernel by default, the Triton one without it; both write the dS scales and LSE2
            assert KL._dq_hopper(d, stale=False, **{**case, "dqk": dqk, "dv": dv})
            for causal in (True, False):
                for n in (128, 8192):
                    assert on(dqk, dv, causal=causal, n=n, m=n) and why(dqk, dv, causal=causal, n=n, m=n) is None
            for change, phrase in ((dict(varlen=True, packed=True), "varlen"), (dict(window=512), "window"),
                                   (dict(n=8000, m=8000), "multiple of 128"), (dict(fp8=False), "bf16")):
                got = why(dqk, dv, **change)
                assert got is not None and phrase in got and not on(dqk, dv, **change), (change, got)
            for groups in (1, 4):
                cfg = KL._dkdv_hopper_cfg(d, causal=True, groups=groups, packed=False)
                assert (cfg["warpgroups"], cfg["regs"], cfg["parts"], cfg["pipe"]) == (2, 240, (1, 2), False), cfg
            K.TUNE["hopper_dkdv_wide"] = False
            assert not on(dqk, dv) and "HOPPER_DKDV_WIDE" in why(dqk, dv)
            K.TUNE["hopper_dkdv_wide"] = True
            K.TUNE["dkdv_hopper"] = False
            assert not on(dqk, dv)
            K.TUNE.clear()
            with pytest.raises(ValueError, match="one launch"):
                K.TUNE["dkdv_hopper_pipe"] = True
                KL._dkdv_hopper_cfg(d, causal=True, groups=1, packed=False)
            K.TUNE.clear()
        assert KL._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)["parts"] == (0,)
        for dqk, dv in ((256, 128), (192, 192), (96, 96)):  # no other head dims
            assert not on(dqk, dv) and "Dqk = Dv in 64, 128 only" in why(dqk, dv)
    finally:
        K.TUNE.clear()

def test_dispatch_log_once_per_case(monkeypatch, caplog):
    """The dispatch log (issue #32): kernels.forward and kernels.backward say at DEBUG, on the "hf_deltamatch"
    logger, which kernels a call takes and why not the Gluon ones, once per distinct case (a second call of the same
    case, or another N of the same kind, logs nothing; another mask does); nothing while DEBUG is off, and the
    case still logs once it is on."""
    import logging

    monkeypatch.setattr(KL, "_LOGGED", set())
    g = torch.Generator().manual_seed(0)

    def call(N, causal=True):
        q, k, v, do = (torch.randn(1, 1, N, 16, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4))
        kw = dict(causal=causal, softmax_scale=0.25, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = K.forward(q, k, v, **kw)
        K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "hf_deltamatch"]

    with caplog.at_level(logging.INFO, logger="hf_deltamatch"):
        call(72)
    assert lines() == []
    with caplog.at_level(logging.DEBUG, logger="hf_deltamatch"):
        call(72)
        call(72)
        call(40)  # another N not a multiple of 128: the same case
        assert len(lines()) == 2, lines()
        fwd, bwd = lines()
        assert fwd.startswith("kernels forward: Triton for fp8 D=16/16, causal, a dense batch, N = M not a multiple "
                              "of 128 (not Gluon: "), fwd
        assert bwd.startswith("kernels backward: dQ Triton, dK/dV Triton for fp8 D=16/16, causal"), bwd
        if DEV == "cpu":  # the interpreter is asked first
            assert "TRITON_INTERPRET=1" in fwd and "TRITON_INTERPRET=1" in bwd
        call(72, causal=False)
        assert len(lines()) == 4 and "full mask" in lines()[2], lines()


def test_sm90_ptxas_major_reads_the_version():
    """launch._sm90_ptxas_major: the CUDA major version of the ptxas Triton runs for sm_90 (CUDA 12 with Triton 3.6
    and 3.7, 13 with 3.9), which decides the dK/dV kernel's pipelined MMA (DKDV_HOPPER_PIPE)."""
    from hf_deltamatch.kernels import launch
    try:
        major = launch._sm90_ptxas_major()
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"this Triton install lacks a runnable ptxas: {e}")
    assert major >= 12


def test_dkdv_hopper_pairs_by_case():
    """The Gluon dK/dV kernel takes its query tiles in pairs (launch.DKDV_HOPPER_PAIRS) on dense batches, where
    that paid on the H200: with the full mask, GQA, and dense causal attention without GQA together with the
    diagonal's peel (alone, pairs were slower there); TUNE decides either way on dense batches. Never on packed
    batches (a sequence's tiles can be odd in number): asking for it there is an error."""
    from hf_deltamatch.kernels import launch
    for causal, groups, packed, want in ((False, 1, False, True), (True, 4, False, True), (True, 1, False, True),
                                         (True, 1, True, False), (True, 4, True, False)):
        cfg = launch._dkdv_hopper_cfg(128, causal=causal, groups=groups, packed=packed)
        assert cfg["pairs"] == want and cfg["peel"] == (causal and groups == 1 and not packed)
    K.TUNE["dkdv_hopper_peel"] = False
    try:
        assert not launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)["pairs"]
    finally:
        K.TUNE.clear()
    for on in (True, False):
        K.TUNE["dkdv_hopper_pairs"] = on
        try:
            assert launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)["pairs"] == on
            assert launch._dkdv_hopper_cfg(128, causal=False, groups=4, packed=False)["pairs"] == on
            if on:
                with pytest.raises(ValueError, match="packed"):
                    launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=True)
            else:
                assert not launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=True)["pairs"]
        finally:
            K.TUNE.clear()


def test_dkdv_hopper_peel_and_ahead_by_case():
    """The dK/dV kernel's diagonal peel applies to dense causal batches without GQA only, by default by its number
    of MMA warpgroups (DKDV_HOPPER_PEEL; asking for it on a packed batch or with GQA is an error, on the full mask
    it is moot), and with GQA the scales are always loaded a tile ahead (the loop counts the group's heads that
    way), else on dense batches by warpgroups (DKDV_HOPPER_AHEAD)."""
    from hf_deltamatch.kernels import launch
    for d in (64, 128):
        wgs = launch.DKDV_HOPPER_WARPGROUPS[d][0]
        for causal, groups, packed in ((True, 1, False), (True, 4, False), (False, 1, False), (True, 1, True)):
            cfg = launch._dkdv_hopper_cfg(d, causal=causal, groups=groups, packed=packed)
            assert cfg["peel"] == (launch.DKDV_HOPPER_PEEL[wgs] and causal and groups == 1 and not packed)
            assert cfg["ahead"] == (groups > 1 or (launch.DKDV_HOPPER_AHEAD[wgs] and not packed))
    K.TUNE.update(dkdv_hopper_peel=True)
    try:
        for wgs in ((2, 240), (3, 160)):
            K.TUNE["dkdv_hopper_wgs"] = wgs
            cfg = launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)
            assert cfg["peel"] and cfg["pairs"] == (wgs[0] == 2) and cfg["ahead"] == launch.DKDV_HOPPER_AHEAD[wgs[0]]
            assert not launch._dkdv_hopper_cfg(128, causal=False, groups=1, packed=False)["peel"]
        for groups, packed in ((4, False), (1, True)):
            with pytest.raises(ValueError, match="dkdv_hopper_peel"):
                launch._dkdv_hopper_cfg(128, causal=True, groups=groups, packed=packed)
        K.TUNE.update(dkdv_hopper_peel=False)
        assert launch._dkdv_hopper_cfg(128, causal=True, groups=4, packed=False)["ahead"]
    finally:
        K.TUNE.clear()


@pytest.mark.parametrize("ptxas", [12, 13])
def test_dkdv_hopper_pipe_by_case(monkeypatch, ptxas):
    """The dK/dV kernel's pipelined dK MMA (DKDV_HOPPER_PIPE): with two warpgroups (D=128, or D=64 with TUNE
    dkdv_hopper_wgs) on dense batches without GQA, causal or not; never on packed batches, with GQA, nor with three
    warpgroups (D=64, or D=128 with TUNE dkdv_hopper_wgs). Where Triton's sm_90 ptxas is CUDA 13 or later (it
    miscompiled the pipelined MMA's operand) it is off by default, and TUNE dkdv_hopper_pipe switches on the form
    with a fresh dP^T accumulator (fresh_dp); asking for it where it does not fit is an error."""
    from hf_deltamatch.kernels import launch
    from hf_deltamatch.kernels.dkdv_hopper import pipe_mode
    monkeypatch.setattr(launch, "_sm90_ptxas_major", lambda: ptxas)
    if ptxas >= launch.DKDV_HOPPER_PIPE_PTXAS_BELOW:
        for d, causal in ((128, True), (128, False), (64, True)):
            cfg = launch._dkdv_hopper_cfg(d, causal=causal, groups=1, packed=False)
            assert not cfg["pipe"] and not cfg["fresh_dp"] and pipe_mode(cfg["pipe"], cfg["fresh_dp"]) == 0
        K.TUNE.update(dkdv_hopper_pipe=True)
        try:
            cfg = launch._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)
            assert cfg["pipe"] and cfg["fresh_dp"] and pipe_mode(cfg["pipe"], cfg["fresh_dp"]) == 2
        finally:
            K.TUNE.clear()
        return
    for d, causal, groups, packed in ((128, True, 1, False), (128, False, 1, False), (128, True, 4, False),
                                      (128, True, 1, True), (64, True, 1, False), (64, False, 1, False)):
        cfg = launch._dkdv_hopper_cfg(d, causal=causal, groups=groups, packed=packed)
        want = cfg["warpgroups"] == 2 and groups == 1 and not packed
        assert cfg["pipe"] == want and not cfg["fresh_dp"], (d, causal, groups, packed)
        assert pipe_mode(cfg["pipe"], cfg["fresh_dp"]) == int(want)
    for wgs, want in (((2, 240), True), ((3, 160), False)):
        K.TUNE["dkdv_hopper_wgs"] = wgs
        try:
            for d in (64, 128):
                assert launch._dkdv_hopper_cfg(d, causal=True, groups=1, packed=False)["pipe"] == want
                assert not launch._dkdv_hopper_cfg(d, causal=True, groups=4, packed=False)["pipe"]
                assert not launch._dkdv_hopper_cfg(d, causal=True, groups=1, packed=True)["pipe"]
        finally:
            K.TUNE.clear()
    K.TUNE.update(dkdv_hopper_pipe=True)
    try:
        for d, groups, packed in ((128, 4, False), (128, 1, True), (64, 1, False)):
            with pytest.raises(ValueError, match="dkdv_hopper_pipe"):
                launch._dkdv_hopper_cfg(d, causal=True, groups=groups, packed=packed)
    finally:
        K.TUNE.clear()


def test_dq_hopper_pipe_option():
    """The dQ kernel's pipelined second pass: by head dim on the full mask only (DQ_HOPPER_PIPE_FULL), with its ring
    depth (DQ_HOPPER_PIPE_STAGES) unless TUNE dq_hopper_stages sets one."""
    from hf_deltamatch.kernels import launch
    for d in (64, 128):
        for causal in (True, False):
            cfg = launch._dq_hopper_cfg(d, causal)
            assert cfg["pipe"] == (d in launch.DQ_HOPPER_PIPE_FULL and not causal)
            assert cfg["pingpong"] == launch.DQ_HOPPER_PINGPONG.get(d, 0)
            assert cfg["stages"] == (launch.DQ_HOPPER_PIPE_STAGES.get(d, launch.DQ_HOPPER_STAGES) if cfg["pipe"]
                                     else launch.DQ_HOPPER_STAGES)
    K.TUNE.update(dq_hopper_stages=2)
    try:
        assert launch._dq_hopper_cfg(64, False) == dict(stages=2, pingpong=launch.DQ_HOPPER_PINGPONG.get(64, 0),
                                                        pipe=True, halves=(0,))
    finally:
        K.TUNE.clear()


def test_gluon_kernels_only_where_they_apply():
    """The Gluon kernels (dkdv_hopper.py, dq_hopper.py, fwd_hopper.py; TUNE dkdv_hopper, dq_hopper, fwd_hopper)
    run only on an sm_90 GPU with Triton 3.6 and only for their case; anywhere else (the interpreter here, a
    varlen batch, D=256, ...) the request falls back to the Triton kernels, with the same results. Their own
    numerics are held to the reference on the H200 (tests/test_kernels_gpu.py::test_*_hopper_kernel)."""
    ok = dict(fp8=True, e4m3=True, dqk=128, dv=128, block=128, varlen=False, window=None, n=256, m=256,
              device=torch.device("cpu"), lse2_in=True, p_shift=8)
    K.TUNE.update(dkdv_hopper=True, dq_hopper=True, fwd_hopper=True)
    try:
        assert not KL._dkdv_hopper(128, **ok)  # no sm_90 GPU (and the interpreter)
        assert not KL._dq_hopper(128, stale=False, **ok)
        assert not KL._fwd_hopper(128, **{k_: ok[k_] for k_ in ("fp8", "dqk", "dv", "block", "varlen", "window",
                                                                "n", "m", "device")})
        g = torch.Generator().manual_seed(5)
        q, k, v, do = (torch.randn(1, 2, 128, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4))
        kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = K.forward(q, k, v, **kw)
        got = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
    finally:
        K.TUNE.clear()
    want = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_gluon_window_dispatch(monkeypatch):
    """A causal sliding window on the Gluon kernels (launch.HOPPER_WINDOW, on by default since their GPU tests
    passed on the H200: tests/test_kernels_gpu.py::test_hopper_window): off (TUNE["hopper_window"] = False),
    _hopper_why_not names the switch; on, a window is no reason against them on dense batches (any N) or packed ones,
    while every other condition still holds; the dK/dV kernel's options drop the pairs, the peeled diagonal and the
    pipelined dK MMA for it, and refuse them when asked for. The full mask has no window (ops passes None)."""
    import types

    _fake_sm90(monkeypatch)
    base = dict(fp8=True, e4m3=True, dqk=128, dv=128, block=128, varlen=False, window=1024, n=8192, m=8192,
                device=types.SimpleNamespace(type="cuda"), lse2_in=True, p_shift=8, causal=True)

    def why(**change):
        return KL._hopper_why_not(**{**base, **change})

    assert KL.HOPPER_WINDOW
    K.TUNE["hopper_window"] = False
    assert "sliding window" in why() and "hopper_window" in why() and why(window=None) is None
    assert "sliding window" in why(varlen=True, packed=True)
    K.TUNE.clear()
    monkeypatch.setattr(KL, "HOPPER_WINDOW", False)
    assert "sliding window" in why() and "HOPPER_WINDOW" in why()
    K.TUNE["hopper_window"] = True
    try:
        for n in (8192, 8000, 200):
            for window in (1, 128, 1000, 4096, 100000):
                assert why(n=n, m=n, window=window) is None
        assert why(varlen=True, packed=True) is None
        for change, phrase in ((dict(block=64), "block=64"), (dict(dqk=256, dv=256), "Dqk=256"),
                               (dict(m=4096), "N != M"), (dict(varlen=True), "varlen"), (dict(e4m3=False), "e5m2")):
            assert phrase in why(**change), change
        fwd = {k: base[k] for k in ("fp8", "dqk", "dv", "block", "varlen", "window", "n", "m", "device", "causal")}
        assert KL._fwd_hopper(128, **fwd) and KL._dq_hopper(128, stale=False, **base) and KL._dkdv_hopper(128, **base)
    finally:
        K.TUNE.clear()
    monkeypatch.setattr(KL, "HOPPER_WINDOW", True)
    assert why() is None
    for d in (64, 128):
        for groups in (1, 4):
            for packed in (False, True):
                plain = KL._dkdv_hopper_cfg(d, causal=True, groups=groups, packed=packed)
                cfg = KL._dkdv_hopper_cfg(d, causal=True, groups=groups, packed=packed, window=True)
                assert not (cfg["pairs"] or cfg["peel"] or cfg["pipe"]), (d, groups, packed, cfg)
                assert {k: v for k, v in cfg.items() if k not in ("pairs", "peel", "pipe", "fresh_dp")} == \
                    {k: v for k, v in plain.items() if k not in ("pairs", "peel", "pipe", "fresh_dp")}
    assert KL._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False)["peel"]  # what the window turns off
    for key in ("dkdv_hopper_pairs", "dkdv_hopper_peel", "dkdv_hopper_pipe"):
        K.TUNE[key] = True
        try:
            with pytest.raises(ValueError, match="sliding window"):
                KL._dkdv_hopper_cfg(128, causal=True, groups=1, packed=False, window=True)
        finally:
            K.TUNE.clear()
