"""kernels/_descriptors.py: TMA descriptors checked once per signature are the descriptors Triton builds."""

import gc
import weakref

import pytest
import torch

pytest.importorskip("triton")
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from hf_deltamatch.kernels._descriptors import _fields, descriptor  # noqa: E402


def _gluon_class():
    try:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor

        from hf_deltamatch.kernels._gluon import _layout
    except ImportError:
        pytest.skip("no Gluon in this Triton")
    return GluonDescriptor, _layout((128, 128))


def test_same_fields_as_triton_builds():
    x = torch.zeros(2, 4, 256, 128, dtype=torch.float8_e4m3fn)
    args = ((2 * 4 * 256, 128), (128, 1), (128, 64))
    for _ in range(2):  # the first call checks, the second copies
        d = descriptor(TensorDescriptor, x, *args)
        want = TensorDescriptor(x, *[list(a) for a in args])
        assert type(d) is TensorDescriptor and vars(d) == vars(want) and d.base is x
    cls, layout = _gluon_class()
    d = descriptor(cls, x, (2 * 4 * 256, 128), (128, 1), (128, 128), layout)
    assert vars(d) == vars(cls(x, [2 * 4 * 256, 128], [128, 1], [128, 128], layout))


def test_what_triton_refuses_is_refused():
    """A bad signature raises on its first use and every later one (nothing is cached for it); a misaligned base
    raises though its signature was checked with an aligned one."""
    x = torch.zeros(4096, dtype=torch.float8_e4m3fn)
    for _ in range(2):
        with pytest.raises(AssertionError, match="16-byte aligned"):
            descriptor(TensorDescriptor, x.view(32, 128), (32, 128), (136 // 2 + 1, 1), (16, 64))
    descriptor(TensorDescriptor, x[:1024].view(8, 128), (8, 128), (128, 1), (8, 64))
    with pytest.raises(AssertionError, match="base must be 16-byte aligned"):
        descriptor(TensorDescriptor, x[1:1025].view(8, 128), (8, 128), (128, 1), (8, 64))


def test_the_cache_keeps_no_tensor_alive():
    x = torch.zeros(8, 128, dtype=torch.float8_e4m3fn)
    descriptor(TensorDescriptor, x, (8, 128), (128, 1), (8, 32))
    assert _fields(TensorDescriptor, x.dtype, (8, 128), (128, 1), (8, 32), None)["base"] is None
    ref = weakref.ref(x)
    del x
    gc.collect()
    assert ref() is None
