"""TMA descriptors built without checking again what does not change between calls.

Triton checks a descriptor's shape, strides, block and layout each time one is built, host time on every launch
(the Gluon kernels take five or six descriptors each); a training step builds the same ones layer after layer. Each
(class, dtype, shape, strides, block, layout) is checked once, on an empty tensor of the dtype, and later descriptors
take its fields with their own base, whose 16-byte alignment is still checked (a misaligned base goes through
Triton's constructor, which raises).
"""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=1024)
def _fields(cls, dtype, shape: tuple, strides: tuple, block: tuple, layout) -> dict:
    extra = () if layout is None else (layout,)
    checked = cls(torch.empty(0, dtype=dtype), list(shape), list(strides), list(block), *extra)
    return dict(vars(checked), base=None)


def descriptor(cls, x, shape, strides, block, layout=None):
    """cls(x, shape, strides, block[, layout]) (triton.tools.tensor_descriptor's or Gluon's TensorDescriptor),
    checked once per signature."""
    if x.data_ptr() % 16:
        return cls(x, list(shape), list(strides), list(block), *(() if layout is None else (layout,)))
    d = object.__new__(cls)
    d.__dict__.update(_fields(cls, x.dtype, tuple(shape), tuple(strides), tuple(block), layout))
    d.base = x
    return d
