"""Non-finite inputs (docs/numerics.md, "Non-finite inputs"): a NaN or ±inf in q, k, v or dO makes exactly the
outputs and gradients the rule names non-finite, and leaves every other one finite and bit-identical to a clean
run. Reference and Triton kernels (the interpreter on the CPU, small N), fp8 and bf16, matching and stale delta,
dense causal and full, a sliding window, a packed batch, GQA; the GPU tests at the Gluon kernels' shapes (fp8
e4m3, D=128, N 256/512, causal, full, a causal packed batch) and the Triton kernels' (with a key tail and a window).

Each case is two runs of deltamatch_attention's forward and backward: a clean one and one with the same inputs
but a few elements poisoned. For every output the rule gives two masks: `must` (non-finite) and `may` (the
kernels' tiles may spread a NaN there: 0 x NaN inside an MMA over a 128-query x 128-key tile pair). Asserted:
must -> non-finite, outside may -> finite and equal to the clean run bit for bit.

Bit-identity outside `may` needs the poisoned element not to set a tile's scale, so the clean run holds 0 where
the poisoned one holds the non-finite value (a tile's scale comes from its finite values), and for a poisoned q
or dO row the clean run's whole q/dO row is 0: the dS row is then 0 in the clean run and NaN in the other, so
the dS tile's scale (absmax over its finite entries) is the same in both and the tile's other rows' dQ too.
(With natural values there, those rows' dQ may differ by one FP8 rounding: docs/numerics.md.)
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_deltamatch import deltamatch_attention
from hf_deltamatch.config import DeltaMatchConfig

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# NaN and inf in the interpreter's numpy arithmetic are what these tests feed it
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning",
                                        "ignore:All-NaN slice encountered:RuntimeWarning")


@pytest.fixture(autouse=True, scope="module")
def _fp8_specials():
    """The interpreter's FP8 decoder with NaN/inf, as the GPU (tests/_interpreter_fp8.py); nothing on a GPU."""
    if DEV == "cuda":
        yield
        return
    from _interpreter_fp8 import fp8_specials_decoded

    with fp8_specials_decoded():
        yield
Q_BLOCK = 128  # query rows a kernel program (or reference step) may treat together: one key range for all
NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------------------------------------------
# Shapes, runs
# ----------------------------------------------------------------------------------------------------------------


class Case:
    """Inputs of one layout: dense (B rows of N tokens) or packed (B = 1, cu_seqlens), and its masks."""

    def __init__(self, B, Hq, Hkv, N, D, causal, cu=None, window=None, block=128, seed=0, device=DEV):
        self.B, self.Hq, self.Hkv, self.N, self.D = B, Hq, Hkv, N, D
        self.causal, self.cu, self.window, self.block = causal, cu, window, block
        self.device = device
        g = torch.Generator().manual_seed(seed)
        mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
        self.q, self.k, self.v, self.do = mk(B, Hq, N, D), mk(B, Hkv, N, D), mk(B, Hkv, N, D), mk(B, Hq, N, D)
        segs = [(0, N)] if cu is None else list(zip(cu[:-1], cu[1:]))
        vis = torch.zeros(N, N, dtype=torch.bool)  # query token x key token, every sequence on the diagonal
        cov = torch.zeros(N, N, dtype=torch.bool)
        for a, b in segs:
            n = b - a
            i = torch.arange(n)
            v = i[None, :] <= i[:, None] if causal else torch.ones(n, n, dtype=torch.bool)
            if window is not None:
                v &= i[None, :] > i[:, None] - window
            vis[a:b, a:b] = v
            # tile pairs (Q_BLOCK queries x `block` keys, counted from the sequence start) with a visible pair
            bi, bj = i // Q_BLOCK, i // block
            pairs = torch.zeros(int(bi[-1]) + 1, int(bj[-1]) + 1, dtype=torch.bool)
            pairs.index_put_((bi[:, None].expand(n, n)[v], bj[None, :].expand(n, n)[v]), torch.tensor(True))
            cov[a:b, a:b] = pairs[bi[:, None], bj[None, :]]
        self.vis, self.cov = vis, cov

    def run(self, q, k, v, do, backend, precision, delta="matching"):
        cfg = DeltaMatchConfig(precision=precision, backend=backend, delta=delta)
        q, k, v = (t.to(self.device).requires_grad_() for t in (q, k, v))
        cu = None if self.cu is None else torch.tensor(self.cu, dtype=torch.int32, device=self.device)
        out, lse = deltamatch_attention(q, k, v, causal=self.causal, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                        window=self.window, config=cfg, return_lse=True)
        out.backward(do.to(self.device))
        return {name: t.detach().cpu() for name, t in
                (("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def _empty_masks(c: Case):
    z = lambda *s: torch.zeros(*s, dtype=torch.bool)  # noqa: E731
    shapes = {"out": (c.B, c.Hq, c.N, c.D), "lse": (c.B, c.Hq, c.N), "dq": (c.B, c.Hq, c.N, c.D),
              "dk": (c.B, c.Hkv, c.N, c.D), "dv": (c.B, c.Hkv, c.N, c.D)}
    return {n: z(*s) for n, s in shapes.items()}, {n: z(*s) for n, s in shapes.items()}


def _clean(c: Case, spots):
    """The inputs of the clean run: zeros at every spot of every tensor, whole q and dO rows at q/dO spots."""
    clean = {n: getattr(c, n).clone() for n in ("q", "k", "v", "do")}
    for tensor, where in spots.items():
        for b, h, t, d, _ in where:
            if tensor in ("q", "do"):
                clean["q"][b, h, t] = clean["do"][b, h, t] = 0.0  # the clean dS row 0 (module docstring)
            else:
                clean[tensor][b, h, t, d] = 0.0
    return clean


def _poison(c: Case, tensor: str, spots, precision: str):
    """(clean inputs, poisoned inputs, must, may) for the layout's spots {tensor: [(b, head, token, dim, value)]},
    poisoning those of `tensor` (q, k, v or do; head is a query head for q/do, a KV head for k/v)."""
    clean = _clean(c, spots)
    spots = spots[tensor]
    must, may = _empty_masks(c)
    G = c.Hq // c.Hkv
    vis, cov = c.vis, c.cov
    bad = {n: x.clone() for n, x in clean.items()}
    for b, h, t, d, value in spots:
        bad[tensor][b, h, t, d] = value
    for b, h, t, d, value in spots:
        if tensor in ("q", "do"):
            hk, heads = h // G, [h]
        else:
            hk, heads = h, list(range(h * G, (h + 1) * G))
        for hq in heads:
            if tensor == "q":  # the query's row: out, lse, dq; the keys it sees: dk, dv
                for m in (must, may):
                    m["out"][b, hq, t] = m["lse"][b, hq, t] = m["dq"][b, hq, t] = True
                must["dk"][b, hk, vis[t]] = must["dv"][b, hk, vis[t]] = True
                may["dk"][b, hk, cov[t]] = may["dv"][b, hk, cov[t]] = True
            elif tensor == "do":  # dq of the row; dk of the keys it sees, dv's column d of them
                must["dq"][b, hq, t] = may["dq"][b, hq, t] = True
                must["dk"][b, hk, vis[t]] = True
                may["dk"][b, hk, cov[t]] = True
                must["dv"][b, hk, vis[t], d] = True
                may["dv"][b, hk, cov[t], d] = True
            elif tensor == "k":
                rows = vis[:, t].clone()  # the queries whose softmax sees the key: their rows turn NaN
                may_rows = rows.clone()
                if precision == "bf16" and abs(value) == INF:
                    # bf16 keeps ±inf: a score of exactly -inf is a weight 0 (exact attention), +inf/NaN poison
                    s = bad["q"][b, hq].double() @ bad["k"][b, hk, t].double()
                    rows &= s != -INF
                for m, r in ((must, rows), (may, may_rows)):
                    m["out"][b, hq, r] = m["lse"][b, hq, r] = True
                must["dq"][b, hq, rows] = True
                must["dq"][b, hq, vis[:, t], d] = True  # a weight-0 key: dS_ij = 0, and 0 * inf in dS @ K
                may["dq"][b, hq, cov[:, t] | vis[:, t]] = True
                must["dk"][b, hk, vis[rows].any(0)] = must["dv"][b, hk, vis[rows].any(0)] = True
                may["dk"][b, hk, cov[may_rows].any(0)] = may["dv"][b, hk, cov[may_rows].any(0)] = True
            elif tensor == "v":  # out's column d of the queries that see it; dP's column j: dq, dk of those rows
                rows, may_rows = vis[:, t], cov[:, t]
                must["out"][b, hq, rows, d] = True
                may["out"][b, hq, may_rows, d] = True
                must["dq"][b, hq, rows] = True
                may["dq"][b, hq, may_rows] = True
                must["dk"][b, hk, vis[rows].any(0)] = True
                may["dk"][b, hk, cov[may_rows].any(0)] = True
    return clean, bad, must, may


def _check(clean_out, bad_out, must, may, what):
    """must -> non-finite; outside may -> finite and bit-identical to the clean run (NaN-aware)."""
    for name in ("out", "lse", "dq", "dk", "dv"):
        a, b = clean_out[name], bad_out[name]
        assert torch.isfinite(a).all(), (what, name, "clean run")
        fin = torch.isfinite(b)
        missed = must[name] & fin
        assert not missed.any(), (what, name, "finite where the rule says non-finite", missed.nonzero()[:8].tolist())
        spread = ~may[name] & ~fin
        assert not spread.any(), (what, name, "non-finite outside the rule", spread.nonzero()[:8].tolist())
        keep = ~may[name]
        diff = keep & (a != b)
        assert not diff.any(), (what, name, "changed outside the rule", diff.nonzero()[:8].tolist(),
                                (a[diff] - b[diff]).abs().max().item() if diff.any() else 0)
        assert (~may[name]).float().mean() >= 0.2, (what, name, "the rule leaves too little to check")


@functools.lru_cache(maxsize=None)
def _clean_run(layout, backend, precision, delta):
    c = _case(layout)
    clean = _clean(c, _SPOTS[layout])
    return c.run(clean["q"], clean["k"], clean["v"], clean["do"], backend, precision, delta)


def _check_case(layout, backend, precision, tensor, delta="matching"):
    c = _case(layout)
    clean, bad, must, may = _poison(c, tensor, _SPOTS[layout], precision)
    base = _clean_run(layout, backend, precision, delta)
    out = c.run(bad["q"], bad["k"], bad["v"], bad["do"], backend, precision, delta)
    _check(base, out, must, may, (layout, backend, precision, tensor, delta))


# ----------------------------------------------------------------------------------------------------------------
# CPU (reference, and the Triton kernels in the interpreter): N = 256, 2 tiles per sequence (block 128)
# ----------------------------------------------------------------------------------------------------------------

# B=2 (dense) or a packed batch of sequences [0, 112), [112, 256) (starts multiples of 16: the forward's TMA path);
# Hq=4 over Hkv=2 (GQA: each KV head read by 2 query heads). D=64: the head dim at which the Triton forward reads its
# FP8 tiles through TMA descriptors (they read past a sequence's end).
_LAYOUTS = {
    "causal": dict(B=2, Hq=4, Hkv=2, N=256, D=64, causal=True),
    "full": dict(B=2, Hq=4, Hkv=2, N=256, D=64, causal=False),
    "packed": dict(B=1, Hq=4, Hkv=2, N=256, D=64, causal=True, cu=(0, 112, 256)),
    "window": dict(B=2, Hq=4, Hkv=2, N=256, D=64, causal=True, window=100),  # rows 227.. do not see key 127
}
# (b, head, token, dim, value): a tile's first (0, 128) and last (127) token, inside a tile (70, 200), the packed
# boundary (111 | 112); q/dO heads are query heads, k/v heads KV heads (both query heads of the group read them).
# Full attention spreads a NaN over the whole sequence (see `may`): its spots leave one KV head of each batch clean.
_QDO = [(0, 0, 0, 3, NAN), (0, 1, 127, 5, INF), (1, 2, 128, 0, -INF), (1, 3, 200, 63, NAN)]
_KV = [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 1, 128, 0, -INF)]
_QDO_FULL = [(0, 0, 0, 3, NAN), (0, 1, 127, 5, INF), (1, 0, 128, 0, -INF), (1, 1, 200, 63, NAN)]
_KV_FULL = [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 0, 128, 0, -INF)]
_PACKED_QDO = [(0, 0, 111, 3, NAN), (0, 1, 112, 5, INF), (0, 3, 230, 7, -INF)]
_PACKED_KV = [(0, 0, 111, 3, INF), (0, 1, 112, 5, NAN), (0, 1, 240, 1, -INF)]
_SPOTS = {lay: {"q": qdo, "do": qdo, "k": kv, "v": kv} for lay, qdo, kv in (
    ("causal", _QDO, _KV), ("full", _QDO_FULL, _KV_FULL), ("packed", _PACKED_QDO, _PACKED_KV),
    ("window", _QDO, _KV))}


@functools.lru_cache(maxsize=None)
def _case(layout):
    return Case(**_LAYOUTS[layout])


@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["causal", "full", "packed", "window"])
def test_reference(layout, precision, tensor):
    _check_case(layout, "reference", precision, tensor)


# Each interpreted case is two forward + backward runs (~40 s on 2 CPU cores), so CI takes fp8 on the causal and
# packed layouts (every tensor) and one tensor each elsewhere; test_reference covers every combination, and the
# GPU tests below every kernel path.
INTERPRETER_CASES = [*((lay, "fp8", t) for lay in ("causal", "packed") for t in ("q", "k", "v", "do")),
                     ("full", "fp8", "k"), ("causal", "bf16", "q"), ("full", "bf16", "v"), ("packed", "bf16", "do")]


@pytest.mark.slow
@pytest.mark.skipif(DEV == "cuda", reason="on a GPU, test_gpu_* below run the kernels")
@pytest.mark.parametrize("layout,precision,tensor", INTERPRETER_CASES)
def test_triton_interpreter(layout, precision, tensor):
    _check_case(layout, "triton", precision, tensor)


@pytest.mark.slow
@pytest.mark.skipif(DEV == "cuda", reason="on a GPU, test_gpu_* below run the kernels")
@pytest.mark.parametrize("tensor", ["k", "do"])
def test_triton_interpreter_window(tensor):
    _check_case("window", "triton", "fp8", tensor)


@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.slow)])
def test_stale_delta(backend, tensor):
    """delta="stale" (dot(dO_i, O_i)): NaN where out or dO is, the same rule."""
    if backend == "triton" and DEV == "cuda":
        pytest.skip("the GPU tests below run the kernels")
    _check_case("causal", backend, "fp8", tensor, delta="stale")


def test_tma_only_where_no_tile_crosses_a_sequence_end():
    """On a varlen batch a TMA tile past a sequence's end reads the next sequence's tokens, where a NaN would reach
    the MMAs as 0 x NaN: the kernels read it through TMA only where every sequence is whole tiles (Seqs.whole_tiles)."""
    from hf_deltamatch.kernels import ops as K

    z = torch.zeros(1, 1, 256, 64)
    cu = lambda *c: torch.tensor(c, dtype=torch.int32)  # noqa: E731
    cut = K.sequences(z, z, cu(0, 112, 256), cu(0, 112, 256))[1]
    assert not cut.whole_tiles(keys=128) and not cut.whole_tiles(queries=64)
    whole = K.sequences(z, z, cu(0, 128, 256), cu(0, 64, 256))[1]
    assert whole.whole_tiles(queries=128) and whole.whole_tiles(keys=64)
    assert not whole.whole_tiles(keys=128)
    assert not K.sequences(z[:, :, :200], z)[1].whole_tiles(queries=64)
    assert K.sequences(z[:, :, :192], z)[1].whole_tiles(queries=64, keys=128)


@pytest.mark.parametrize("tensor", ["q", "v"])
def test_dense_tail_tiles_read_zeros_not_the_next_head(tensor):
    """Dense N = 200 (a tail tile): q8/k8/v8/dO8 heads padded to quantize.TAIL_ROWS rows of zeros, so the TMA
    tiles that read past a head's end (the forward's and the dQ kernel's TMA paths forced on) see zeros, not the
    next head's tokens: a NaN in head 1's first tokens leaves head 0's outputs and gradients finite and
    bit-identical to a clean run. (v: the dQ kernel's V tiles, where a NaN would reach dP, then dS; q: the
    forward's q tiles.)"""
    from hf_deltamatch import kernels as K
    from hf_deltamatch.kernels import ops as KO

    g = torch.Generator().manual_seed(4)
    q, k, v, do = (torch.randn(1, 2, 200, 64, generator=g).to(torch.bfloat16).to(DEV) for _ in range(4))
    kw = dict(causal=True, softmax_scale=0.125, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
              config=DeltaMatchConfig())

    def run(q, v):
        f = K.forward(q, k, v, **kw)
        return (*f[:2], *K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)), f[2:5]

    with K.pinned(fwd_tma=True, dq_tma=True):
        clean, saved = run(q, v)
        poisoned = {"q": q.clone(), "v": v.clone()}
        poisoned[tensor][0, 1, 10, 3] = NAN
        bad, _ = run(poisoned["q"], poisoned["v"])
    for a, b in zip(clean, bad):
        assert torch.equal(a[:, 0], b[:, 0]) and torch.isfinite(a[:, 0]).all()
    assert not torch.isfinite(bad[2][:, 1]).all()  # dq of head 1
    for t in saved:  # q8, k8, v8: each head 256 rows, the last 56 zeros
        assert t.stride(1) == 256 * 64 and not t.as_strided((1, 2, 56, 64), t.stride(), 200 * 64).float().any()
        assert KO._tma_rows(t, varlen=False)
    assert not KO._tma_rows(q.contiguous(), varlen=False)  # 200 rows a head: a tile past it would read head 1


def test_quantization_keeps_non_finite_and_tile_mates():
    """q8 of a tile with a NaN, +inf and -inf: those three NaN in FP8 (e4m3 has no inf), the tile's scale and its
    other tokens the same as with zeros there (reference and kernels' quantization pass, bit for bit)."""
    from hf_deltamatch import reference as R

    x = torch.randn(1, 2, 200, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    bad = x.clone()
    spots = [(0, 0, 0, 0), (0, 0, 127, 63), (0, 1, 150, 9)]
    for (b, h, t, d), value in zip(spots, (NAN, INF, -INF)):
        x[b, h, t, d] = 0.0
        bad[b, h, t, d] = value
    is_bad = torch.zeros(x.shape, dtype=torch.bool)
    for b, h, t, d in spots:
        is_bad[b, h, t, d] = True
    from hf_deltamatch.kernels.quantize import quantize

    results = [R.quantize_tokens(t, 128) for t in (x, bad)]
    results += [(y.cpu(), s.cpu()) for y, _, s in (quantize(t.to(DEV), 128) for t in (x, bad))]
    for (c8, cs), (b8, bs) in zip(results[::2], results[1::2]):
        assert torch.equal(cs, bs) and torch.isfinite(bs).all()
        assert b8.float()[is_bad].isnan().all()
        assert torch.equal(c8.float()[~is_bad], b8.float()[~is_bad])
    # the kernels' pass and the reference: the same bytes, NaN included
    assert torch.equal(results[0][0].view(torch.uint8), results[2][0].view(torch.uint8))
    assert torch.equal(results[1][0].view(torch.uint8), results[3][0].view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# GPU (H200): the Gluon kernels' shapes (fp8 e4m3, D=128, N a multiple of 128, causal, full, a causal packed batch,
# causal and full tails) and the Triton kernels on the same and on tails; `pytest -m gpu tests/test_nonfinite.py`
# ----------------------------------------------------------------------------------------------------------------

_GPU_LAYOUTS = {
    "causal256": dict(B=2, Hq=4, Hkv=2, N=256, D=128, causal=True),
    "full256": dict(B=2, Hq=4, Hkv=2, N=256, D=128, causal=False),
    "causal512": dict(B=1, Hq=4, Hkv=2, N=512, D=128, causal=True),
    "full512": dict(B=1, Hq=4, Hkv=2, N=512, D=128, causal=False),
    "packed512": dict(B=1, Hq=4, Hkv=2, N=512, D=128, causal=True, cu=(0, 208, 336, 512)),
    # N not a multiple of 128: the last key tile reads past each head's end, into the zero rows its fp8 copies are
    # padded with (the Gluon kernels: their packed variant, the plan's ragged layout)
    "tail200": dict(B=2, Hq=4, Hkv=2, N=200, D=128, causal=True),
    "full200": dict(B=2, Hq=4, Hkv=2, N=200, D=128, causal=False),
    "window256": dict(B=2, Hq=4, Hkv=2, N=256, D=128, causal=True, window=100),  # Triton only
}
# As on the CPU: a causal or full sequence spreads a NaN in k or v over (nearly) all of it, so each layout's spots
# leave a KV head (and its query heads) clean somewhere. tail200's k[0, 1, 10] is in the rows after KV head 0's
# end that its tail tile would read without the padding rows (a NaN there must not reach head 0).
_GPU_QDO_B2 = [(0, 0, 0, 3, NAN), (0, 1, 127, 5, INF), (1, 2, 128, 0, -INF), (1, 3, 190, 127, NAN)]
_GPU_QDO_B1 = [(0, 0, 0, 3, NAN), (0, 1, 127, 5, INF), (0, 0, 128, 0, -INF), (0, 1, 400, 127, NAN)]
_GPU_KV_B1 = [(0, 0, 127, 3, NAN), (0, 0, 256, 5, INF), (0, 0, 511, 0, -INF)]
_GPU_SPOTS = {
    "causal256": (_GPU_QDO_B2, [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 1, 128, 0, -INF)]),
    "full256": ([(0, 0, 0, 3, NAN), (0, 1, 127, 5, INF), (1, 0, 128, 0, -INF), (1, 1, 190, 127, NAN)],
                [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 0, 128, 0, -INF)]),
    "causal512": (_GPU_QDO_B1, _GPU_KV_B1),
    "full512": (_GPU_QDO_B1, _GPU_KV_B1),
    "packed512": ([(0, 0, 207, 3, NAN), (0, 1, 208, 5, INF), (0, 0, 335, 0, -INF), (0, 1, 336, 127, NAN)],
                  [(0, 0, 207, 3, INF), (0, 0, 208, 5, NAN), (0, 0, 336, 0, -INF), (0, 0, 511, 9, NAN)]),
    "tail200": (_GPU_QDO_B2, [(0, 0, 127, 3, NAN), (0, 1, 10, 5, INF), (0, 1, 70, 0, -INF)]),
    "full200": (_GPU_QDO_B2, [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 0, 128, 0, -INF)]),
    "window256": (_GPU_QDO_B2, [(0, 0, 127, 3, NAN), (1, 0, 70, 5, INF), (1, 1, 128, 0, -INF)]),
}


def _gpu_spots(layout):
    qdo, kv = _GPU_SPOTS[layout]
    return {"q": qdo, "do": qdo, "k": kv, "v": kv}


def _gpu_check(layout, kernels, precision, tensor):
    from hf_deltamatch import kernels as K

    c = Case(**_GPU_LAYOUTS[layout], device="cuda")
    clean, bad, must, may = _poison(c, tensor, _gpu_spots(layout), precision)
    try:
        with K.pinned(fwd_kernel=kernels, dq_kernel=kernels, dkdv_kernel=kernels):
            base = c.run(clean["q"], clean["k"], clean["v"], clean["do"], "triton", precision)
            out = c.run(bad["q"], bad["k"], bad["v"], bad["do"], "triton", precision)
    except ValueError as e:  # the Gluon kernels run only where the plan says (kernels/plan.py)
        if kernels == "gluon" and "does not take this input" in str(e):
            pytest.skip(f"the Gluon kernels do not take this input on this GPU/Triton: {e}")
        raise
    _check(base, out, must, may, (layout, kernels, precision, tensor))


@pytest.mark.gpu
@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
@pytest.mark.parametrize("layout", ["causal256", "full256", "causal512", "full512", "packed512", "tail200",
                                    "full200"])
def test_gpu_gluon(layout, tensor):
    _gpu_check(layout, "gluon", "fp8", tensor)


@pytest.mark.gpu
@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
@pytest.mark.parametrize("precision", ["fp8", "bf16"])
@pytest.mark.parametrize("layout", ["causal256", "full256", "packed512", "tail200", "full200", "window256"])
def test_gpu_triton(layout, precision, tensor):
    _gpu_check(layout, "triton", precision, tensor)


@pytest.mark.gpu
@pytest.mark.parametrize("tensor", ["q", "k", "v", "do"])
def test_gpu_reference_on_cuda(tensor):
    """The reference backend on the GPU (torch's CUDA max and casts) follows the same rule."""
    c = Case(**_GPU_LAYOUTS["causal256"], device="cuda")
    clean, bad, must, may = _poison(c, tensor, _gpu_spots("causal256"), "fp8")
    _check(c.run(*(clean[n] for n in ("q", "k", "v", "do")), "reference", "fp8"),
           c.run(*(bad[n] for n in ("q", "k", "v", "do")), "reference", "fp8"), must, may, ("ref-cuda", tensor))
