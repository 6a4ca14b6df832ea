"""_tensor_cache.TensorCache: what is read of cu_seqlens on the host, computed once per tensor, not per layer
(hf_deltamatch._varlen uses it for CUDA tensors: tests/test_varlen.py)."""

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
    cache.get((a,), lambda: compute(a), key=(5,))  # another key: computed
    assert len(calls) == 9
