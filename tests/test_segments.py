"""kernels/segments.py: the padded layout in which the Gluon kernels take packed (varlen) batches. Plain torch, so
it runs on the CPU; the kernels that read it are tested on the GPU (tests/test_kernels_gpu.py::test_hopper_packed)."""

import pytest
import torch

pytest.importorskip("hf_deltamatch.kernels")
from hf_deltamatch.kernels import ops as KO  # noqa: E402
from hf_deltamatch.kernels import segments as S  # noqa: E402


def test_padded_layout_rows():
    """Each sequence at a multiple of 128 rows, in order; empty sequences are dropped before the kernels see them
    (hf_deltamatch._varlen); tokens outside every sequence (before cu[0], from cu[-1] on) have no row."""
    cu = torch.tensor([3, 8, 8, 143, 303], dtype=torch.int32)  # lengths 5, 0, 135, 160
    z = torch.zeros(1, 1, 320, 16)
    vl, seqs = KO.sequences(z, z, cu, cu)
    nseq, max_n, cu_q, packing = seqs.nseq, seqs.max_n, vl.cu_q, seqs.packing
    assert (nseq, max_n, packing) == (3, 160, (3, 303, 128 + 256 + 256))
    assert cu_q.tolist() == [3, 8, 143, 303]
    seg = S.padded_layout(cu_q, *packing)
    assert seg.pcu.tolist() == [0, 128, 384, 640]
    assert S.padded_layout(cu, *packing).pcu.tolist() == [0, 128, 128, 384, 640]  # an empty one takes no rows
    src = [-1] * 640  # the packed token of each padded row: tokens 3..7 at 0.., 8..142 at 128.., 143..302 at 384..
    src[0:5], src[128:263], src[384:544] = range(3, 8), range(8, 143), range(143, 303)
    assert seg.src.tolist() == src and seg.npad == 640
    # quantize's tile list: each 128-token tile's first row and end, in the packed batch
    assert seg.tiles.tolist() == [3, 8, 136, 143, 271] + [8, 136, 143, 271, 303]
    # a key sequence that differs from the query one: no packing (the Gluon kernels need self-attention)
    other = cu.clone()
    other[2] += 1
    assert KO.sequences(z, z, cu, other)[1].packing is None


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32, torch.bfloat16])
def test_pad_copies_every_token_and_fills_the_rest(dtype):
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 70, 70, 300], dtype=torch.int32)
    N = 310  # tokens 300 .. 309 belong to no sequence
    z = torch.zeros(1, 1, N, 16)
    seg = S.padded_layout(cu, *KO.sequences(z, z, cu, cu)[1].packing)
    assert seg.npad == 128 + 256
    x = torch.randn(1, 3, N, 16, generator=g).to(dtype)
    y = S.pad(x, seg)
    assert y.shape == (1, 3, 384, 16) and y.dtype == dtype
    assert torch.equal(y[:, :, :70].float(), x[:, :, :70].float())
    assert torch.equal(y[:, :, 128:358].float(), x[:, :, 70:300].float())
    assert not y[:, :, 70:128].float().any() and not y[:, :, 358:].float().any()
    if dtype == torch.float32:  # row arrays (scales, LSE): any fill
        r = S.pad(x[..., 0], seg, float("-inf"))
        assert torch.equal(r[:, :, 128:358], x[:, :, 70:300, 0]) and (r[:, :, 70:128] == float("-inf")).all()
    with pytest.raises(ValueError, match="zeros"):
        S.pad(x, seg, 1.0)
    # the token-major padded copy (the Gluon kernels' B operands) straight from the packed tensor
    from hf_deltamatch.kernels.quantize import token_major
    for k_order in (False, True):
        assert torch.equal(token_major(x, k_order, src=seg.src).float(), token_major(y, k_order).float())


def test_quantize_by_tile_list_equals_the_sequence_grid():
    """quantize(segments=...) (one program per tile of a packed batch, only the rows outside every sequence filled
    beforehand) writes what the grid over the longest sequence's tiles x the sequences writes: the same bytes,
    scales, and zeros (scale 1) outside every sequence, before the first one and after the last."""
    from hf_deltamatch.kernels.quantize import quantize
    g = torch.Generator().manual_seed(1)
    cu = torch.tensor([3, 5, 5, 140, 300], dtype=torch.int32)
    x = torch.randn(1, 2, 310, 64, generator=g).to(torch.bfloat16)
    z = torch.zeros(1, 1, 310, 16)
    seg = S.padded_layout(cu, *KO.sequences(z, z, cu, cu)[1].packing)
    a = quantize(x, 128, cu_seqlens=cu, max_len=160, transposed=True)
    b = quantize(x, 128, cu_seqlens=cu, max_len=160, transposed=True, segments=seg)
    for u, v in zip(a, b):
        assert torch.equal(u.float(), v.float())
    assert not a[0][:, :, :3].float().any() and not a[0][:, :, 300:].float().any()
    assert (a[2][:, :, :3] == 1).all() and (a[2][:, :, 300:] == 1).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused-token-major", "token-major-copy"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_padded_equals_quantize_then_pad(fmt, fused, monkeypatch):
    """quantize_padded (the Gluon kernels' packed operands in one pass) writes the bytes that quantize followed by
    the padding copies writes: packed (the tensors the backward keeps), padded row-major, padded token-major in
    k_order, and the padded scales (1 in the rows of no token); the token-major copy written by the quantizing
    kernel itself or copied from the padded row-major one (quantize.FUSED_PADDED_TOKEN_MAJOR: by Triton version)."""
    from hf_deltamatch.kernels import quantize as Q
    from hf_deltamatch.kernels.quantize import quantize, quantize_padded, token_major
    monkeypatch.setattr(Q, "FUSED_PADDED_TOKEN_MAJOR", fused)
    g = torch.Generator().manual_seed(2)
    cu = torch.tensor([3, 8, 8, 143, 303], dtype=torch.int32)  # lengths 5, 0, 135, 160; tokens outside on both ends
    x = torch.randn(1, 2, 310, 64, generator=g).to(torch.bfloat16) * 3
    z = torch.zeros(1, 1, 310, 16)
    seg = S.padded_layout(cu, *KO.sequences(z, z, cu, cu)[1].packing)
    y, _, scale = quantize(x, 128, fmt, cu_seqlens=cu, max_len=160)
    want = (S.pad(y, seg), token_major(y, k_order=True, src=seg.src), S.pad(scale, seg, 1.0))
    (py_, ps_), got = quantize_padded(x, seg, fmt, row_major=True, token_major=True)
    assert torch.equal(py_.float(), y.float()) and torch.equal(ps_, scale)
    for u, v in zip(got, want):
        assert u.shape == v.shape and torch.equal(u.float(), v.float())
    assert got[1].stride(2) == 1  # token-major storage, as the TMA descriptors read it
    (none_y, none_s), (py, pyt, ps) = quantize_padded(x, seg, fmt, packed=False)  # the backward's dO: padded only
    assert none_y is None and none_s is None and pyt is None
    (_, _), (no_py, pyt_only, _) = quantize_padded(x, seg, fmt, packed=False, row_major=False, token_major=True)
    assert no_py is None and torch.equal(pyt_only.float(), want[1].float()) and pyt_only.stride(2) == 1
    assert torch.equal(py.float(), want[0].float()) and torch.equal(ps, want[2])
    with pytest.raises(ValueError, match="128-token tiles"):
        quantize_padded(x, seg._replace(tiles=seg.tiles[:2]), fmt)
    with pytest.raises(ValueError, match="at least one"):
        quantize_padded(x, seg, fmt, packed=False, row_major=False)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-token-major", "token-major-copy"])
@pytest.mark.parametrize("N", [200, 129, 100])
def test_dense_ragged_batch_is_its_own_padded_layout(N, fused, monkeypatch):
    """A dense batch whose N is not a multiple of 128 takes the Gluon kernels' packed variant (the plan's ragged layout)
    with each head one sequence of N tokens (ops._dense_layout) in the rows quantize() gives it (N rounded up to
    128, zeros past N): _padded_view of q8, k8, v8 and dO8 is, without a copy, what segments.pad makes of them, and
    quantize_padded (the forward's V, the backward's dO; B > 1 here, where packed batches have B = 1) writes the bytes
    and scales quantize() writes, token-major in k_order over the padded rows (N need not be a multiple of 32), the
    token-major copy fused or not (quantize.FUSED_PADDED_TOKEN_MAJOR)."""
    from hf_deltamatch.kernels import quantize as Q
    from hf_deltamatch.kernels.quantize import quantize, quantize_padded, token_major
    monkeypatch.setattr(Q, "FUSED_PADDED_TOKEN_MAJOR", fused)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, N, 64, generator=g).to(torch.bfloat16) * 3
    seg = KO._dense_layout(N, x.device)
    npad = -(-N // 128) * 128
    assert seg.npad == npad and seg.cu.tolist() == [0, N] and seg.pcu.tolist() == [0, npad]
    assert KO._dense_layout(N, x.device) is seg  # cached: no tensors made per call
    y, _, scale = quantize(x, 128)
    view = KO._padded_view(y)
    assert view.shape == (2, 3, npad, 64) and view.data_ptr() == y.data_ptr()
    assert torch.equal(view.float(), S.pad(y, seg).float()) and not view[:, :, N:].float().any()
    (none_y, none_s), (py, pyt, ps) = quantize_padded(x, seg, packed=False, token_major=True)
    assert none_y is None and none_s is None
    assert torch.equal(py.float(), view.float())
    assert torch.equal(pyt.float(), token_major(view, k_order=True).float()) and pyt.stride(2) == 1
    assert torch.equal(ps, S.pad(scale, seg, 1.0)) and torch.equal(ps[:, :, :N], scale)
    assert (ps[:, :, N:] == 1).all()
    with pytest.raises(ValueError, match="TAIL_ROWS"):
        KO._padded_view(y.contiguous())
