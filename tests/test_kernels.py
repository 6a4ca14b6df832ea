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
from hf_deltamatch import _varlen  # noqa: E402
from hf_deltamatch.kernels import configs as C  # noqa: E402
from hf_deltamatch.kernels import plan as P  # noqa: E402

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
    assert C.use_tma("fwd", True, 128, 128) and not C.use_tma("dq", False, 128, 128)
    assert not C.use_tma("fwd", True, 192, 128)
    assert not C.use_tma("fwd", True, 64, 64, starts_aligned=False)
    cu = torch.tensor([0, 96, 160, 300], dtype=torch.int32)
    seqs = P.varlen_seqs(_varlen.varlen(cu, cu, 300, 300))
    assert (seqs.nseq, seqs.max_n, seqs.max_m, seqs.aligned) == (3, 140, 140, True)
    other = cu + torch.tensor([0, 1, 0, 0], dtype=torch.int32)
    assert not P.varlen_seqs(_varlen.varlen(cu, other, 300, 300)).aligned
    assert P.dense_seqs(300, 300).aligned
    cases = [dict(N=200, M=230), dict(N=130, causal=False, Hq=4, Hkv=2),
             dict(N=300, M=320, cu=([0, 96, 160, 280], [0, 128, 176, 300]), window=50)]
    with P.pinned(fwd_tma=True, dq_tma=True):  # both kernels' TMA paths, at D=64 too
        for case in cases:
            _run(**case, row_sums=False)
        tma = _fwd_bwd_tma_vs_pointers()
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
    (configs.SCALE_AFTER_SUM_HEAD_DIMS, D 128 and 256; here at the interpreter's D=64): the same contract, and the
    invariant still at fp32 rounding."""
    monkeypatch.setattr(C, "SCALE_AFTER_SUM_HEAD_DIMS", (64,))
    try:
        resid = _run(N=256, causal=True, seed=3)
        _run(N=200, M=230, causal=False, Hq=4, Hkv=2, block=64, row_sums=False)
        K.TUNE["dq"] = (128, 8, 2)  # per-row dP scales (two dS tiles per block)
        _run(N=200, causal=True, row_sums=False)
    finally:
        K.TUNE.clear()
    assert resid <= 1e-5


@pytest.mark.parametrize("pins", [dict(lse2=False, p256=False), dict(lse2=False, p256=True),
                                  dict(lse2=True, p256=False)], ids=["neither", "p256", "lse2"])
def test_dkdv_lse2_and_p256(pins):
    """The dK/dV kernel reading the dQ kernel's LSE2 and/or taking P * 256 straight from exp2 (on at every head dim
    the Gluon kernels take, configs.DKDV_LSE2_HEAD_DIMS; the alternatives pinned here): the same contract in every
    mode that reaches the changed code (stale, bf16, window, varlen, pow2 scales, e5m2)."""
    with P.pinned(**pins):
        _run(N=256, causal=True, seed=3)
        _run(N=200, M=230, causal=False, Hq=4, Hkv=2, block=64, row_sums=False, delta="stale")
        _run(N=200, M=220, window=70, precision="bf16", row_sums=False)
        cu = [0, 70, 71, 200, 260]
        _run(N=260, cu=(cu, cu), row_sums=False, grad_format="e5m2", scale_rounding="pow2")


@pytest.mark.parametrize("group", [2, 3, 100])
def test_head_groups(monkeypatch, group):
    """Each kernel's causal grid handing out heads in groups (configs.HEAD_GROUP_CAUSAL, set to `group` here; 3
    leaves a partial last group, 100 means all heads at once): the same results, dense with GQA and varlen. The
    full mask hands them out one by one."""
    for kernel in C.HEAD_GROUP_CAUSAL:
        monkeypatch.setitem(C.HEAD_GROUP_CAUSAL, kernel, group)
    assert C.grid("dkdv", 5, 4, 2, True) == ((20, 1, 2), 5, min(group, 4))
    assert C.grid("dq", 5, 16, 1, False)[2] == 1
    _run(N=200, M=230, causal=True, Hq=4, Hkv=2, row_sums=False)
    if group == 3:
        cu = [0, 70, 71, 200, 260]
        _run(N=260, cu=(cu, cu), Hq=4, row_sums=False)


def test_dkdv_split_into_dv_and_dk_launches(monkeypatch):
    """dV and dK from two launches of the dK/dV kernel (above configs.DKDV_SPLIT_ABOVE = 128; here at the
    interpreter's D=64): the same contract in fp8 and bf16, with GQA, varlen, a window and the stale delta."""
    monkeypatch.setattr(C, "DKDV_SPLIT_ABOVE", 32)
    assert C.dkdv_parts(64) == (1, 2)
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
    with P.pinned(fwd_tma=False, dq_tma=False):
        ptr = fwd_bwd()
        _run(N=150, row_sums=False)  # the pointer paths against the reference
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
    with P.pinned(dq_tma=True):
        want = K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
        got = K.backward(do, q, k, v, f[0], f[1], *strided, *f[5:], **kw)
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
    without GQA, configs.DKDV_DS_SCALES_*; off here by emptying those tables, as at D=256): the same contract with
    GQA, a window, varlen (unaligned starts, a one-token sequence), the stale delta, 128-row dQ blocks (two dS
    tiles per block, the second past a sequence's end), dK/dV programs of 64 keys, fewer than a 128-key dS tile
    (configs.DKDV_BLOCK_N), and dK equal to the dK/dV kernel's own-absmax dK up to fp32 rounding (a misplaced
    scale changes the fp8 rounding by percents)."""
    cu = [0, 70, 71, 200, 260]
    runs = [dict(N=200, M=230, causal=True, Hq=4, Hkv=2), dict(N=200, M=220, window=70, block=64),
            dict(N=260, cu=(cu, cu), delta="stale", causal=False), dict(N=260, cu=(cu, cu), Hq=2, Hkv=1)]
    for kw in runs:
        grads = []
        for on in (True, False):
            for table in ("DKDV_DS_SCALES_HEAD_DIMS", "DKDV_DS_SCALES_GQA_HEAD_DIMS"):
                monkeypatch.setattr(C, table, (64,) if on else ())
            P.select.cache_clear()  # the plans cached with the other tables
            K.TUNE.update({"dq": dq_cfg} if dq_cfg else {})
            try:
                assert C.dkdv_block_n(kw.get("block", 128), 64, on) == (64 if on else kw.get("block", 128))
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


def test_gluon_kernels_only_where_they_apply():
    """The Gluon kernels run only on an sm_90 GPU, never in the interpreter: pinning them where they cannot run is
    an error that says why, not a silent fall back (their numerics: tests/test_kernels_gpu.py on the H200; which
    inputs take them: tests/test_plan.py)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(3))
    kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())
    if DEV == "cpu":
        with P.pinned(fwd_kernel="gluon"), pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            K.forward(q, k, v, **kw)
