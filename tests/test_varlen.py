"""cu_seqlens: checked where they are read (hf_deltamatch._varlen), with errors that say what to pass instead; read
once per pair of CUDA tensors; empty sequences dropped before the backends see them."""

import pytest
import torch

from hf_deltamatch import DeltaMatchConfig, deltamatch_attention
from hf_deltamatch import _varlen

CFG = DeltaMatchConfig(precision="bf16", backend="reference")


def qkv(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, n, 16, generator=g).to(torch.bfloat16) for _ in range(3)]


def attend(cu_q, cu_k=None, n=60, **kw):
    q, k, v = qkv(n)
    return deltamatch_attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q if cu_k is None else cu_k, config=CFG,
                                **kw)


def cu(*xs, dtype=torch.int32):
    return torch.tensor(xs, dtype=dtype)


@pytest.mark.parametrize("bad, error, match", [
    (cu(10, 40, 60), ValueError, "must start at 0 and end at the number of query tokens"),
    (cu(0, 40, 50), ValueError, "must start at 0 and end at"),
    (cu(0, 40, 20, 60), ValueError, "non-decreasing"),
    (cu(0, -5, 60), ValueError, "non-decreasing"),
    (torch.tensor([0.0, 30.0, 60.0]), TypeError, "must hold integers"),
    (torch.tensor([[0, 30, 60]], dtype=torch.int32), ValueError, "must be 1-D"),
    (torch.tensor([0, 30, 60], dtype=torch.int32, device="meta"), ValueError, "is on meta but q is on cpu"),
    ([0, 30.5, 60], TypeError, "whole numbers"),
], ids=["tokens-before-first", "tokens-after-last", "decreasing", "negative", "float", "2-d", "other-device",
        "float-list"])
def test_bad_cu_seqlens_raise_what_to_do(bad, error, match):
    with pytest.raises(error, match=match):
        attend(bad)


def test_other_bad_arguments_raise():
    with pytest.raises(ValueError, match="same length"):
        attend(cu(0, 30, 60), cu(0, 60))
    with pytest.raises(ValueError, match="pass both"):
        q, k, v = qkv()
        deltamatch_attention(q, k, v, cu_seqlens_q=cu(0, 60), config=CFG)
    with pytest.raises(TypeError, match="whole number of keys"):
        q, k, v = qkv()
        deltamatch_attention(q, k, v, window=4.5, config=CFG)
    with pytest.raises(TypeError, match="whole number of keys"):
        deltamatch_attention(q, k, v, window=True, config=CFG)


def test_a_list_is_the_tensor_and_int64_is_int32():
    ref = attend(cu(0, 25, 60))
    torch.testing.assert_close(attend([0, 25, 60]), ref, rtol=0, atol=0)
    torch.testing.assert_close(attend(cu(0, 25, 60, dtype=torch.int64)), ref, rtol=0, atol=0)


def test_empty_sequences_are_dropped_and_change_nothing():
    ref = attend(cu(0, 25, 60))
    torch.testing.assert_close(attend(cu(0, 0, 25, 25, 25, 60, 60)), ref, rtol=0, atol=0)
    vl = _varlen.varlen(cu(0, 0, 25, 25, 60, 60), cu(0, 0, 25, 25, 60, 60), 60, 60)
    assert vl.bounds_q == (0, 25, 60) and vl.same and vl.cu_q is vl.cu_k and vl.cu_q.tolist() == [0, 25, 60]
    # a sequence with keys but no queries stays (its keys belong to it)
    vl = _varlen.varlen(cu(0, 0, 10), cu(0, 5, 12), 10, 12)
    assert vl.bounds_q == (0, 0, 10) and vl.bounds_k == (0, 5, 12) and not vl.same


def test_long_cu_seqlens_are_compacted_before_the_host_reads_them():
    """The integration's fixed-length cu_seqlens (one entry per token, empty sequences after the real ones)."""
    n = 6000
    bounds = torch.full((n + 1,), n, dtype=torch.int32)
    bounds[:4] = torch.tensor([0, 1000, 1500, 4000])
    vl = _varlen.varlen(bounds, bounds, n, n)
    assert vl.bounds_q == (0, 1000, 1500, 4000, n) and vl.nseq == 4 and vl.max_n == 2500


def test_cpu_cu_seqlens_are_read_every_call():
    """A change behind the version counter (through .data) is seen on a CPU, where a read costs nothing."""
    c = cu(0, 30, 60)
    attend(c)
    c.data[1] = 70
    with pytest.raises(ValueError, match="non-decreasing"):
        attend(c)


@pytest.mark.gpu
def test_cuda_cu_seqlens_are_read_once_per_tensor():
    _varlen.clear_cache()
    reads = []
    real = _varlen._read

    def counting(*a):
        reads.append(1)
        return real(*a)

    c = cu(0, 30, 60).cuda()
    q, k, v = (t.cuda() for t in qkv())
    try:
        _varlen._read = counting
        for _ in range(3):
            deltamatch_attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, config=CFG)
        assert len(reads) == 1
        c[1] = 20  # in place: a new version, read again
        deltamatch_attention(q, k, v, cu_seqlens_q=c, cu_seqlens_k=c, config=CFG)
        assert len(reads) == 2
    finally:
        _varlen._read = real
