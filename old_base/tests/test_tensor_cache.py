"""_tensor_cache.TensorCache: what is read of cu_seqlens on the host, computed once per tensor, not per layer."""

import torch

from hf_deltamatch._tensor_cache import TensorCache


def test_found_again_by_identity_and_version_only():
    cache, calls = TensorCache(size=2), []

    def compute(t):
        calls.append(1)
        return t.tolist()

    a = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert cache.get((a,), lambda: compute(a)) == [0, 3, 7]
    assert cache.get((a,), lambda: compute(a)) == [0, 3, 7] and len(calls) == 1
    b = a.clone()  # equal values, another tensor: computed (the cache never reads values to compare)
    cache.get((b,), lambda: compute(b))
    assert len(calls) == 2
    a[2] = 9  # in place: the version changes
    assert cache.get((a,), lambda: compute(a)) == [0, 3, 9] and len(calls) == 3
    for t in (torch.tensor([1]), torch.tensor([2])):  # size 2: a is evicted, and recomputed
        cache.get((t,), lambda: compute(t))
    cache.get((a,), lambda: compute(a))
    assert len(calls) == 6
    with torch.inference_mode():  # no version counter: computed every time, never an error
        c = torch.tensor([0, 1])
        cache.get((c,), lambda: compute(c))
        cache.get((c,), lambda: compute(c))
    assert len(calls) == 8


def test_attention_checks_cu_seqlens_once_per_tensor(monkeypatch):
    """deltamatch_attention's cu_seqlens checks (one host read) run again only for other or changed tensors, and
    still refuse bad ones."""
    import pytest

    from hf_deltamatch import attention as A
    from hf_deltamatch.attention import deltamatch_attention
    from hf_deltamatch.config import DeltaMatchConfig
    cfg = DeltaMatchConfig(backend="reference")
    A._CU_FACTS.clear()
    q = torch.randn(1, 2, 10, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    for _ in range(2):
        deltamatch_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, config=cfg)
    assert len(A._CU_FACTS._entries) == 1
    cu[1] = 12  # decreasing now: the check sees the change
    with pytest.raises(ValueError, match="non-decreasing"):
        deltamatch_attention(q, q, q, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, config=cfg)
    with pytest.raises(ValueError, match="end at"):
        short = torch.tensor([0, 4, 9], dtype=torch.int32)
        deltamatch_attention(q, q, q, causal=True, cu_seqlens_q=short, cu_seqlens_k=short, config=cfg)
