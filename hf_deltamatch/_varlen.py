"""What a packed (variable-length) batch's cu_seqlens say, checked and read on the host once per pair of tensors.

Both backends need the sequences' bounds as host integers (launch grids, the reference's loop), and reading a
device tensor waits for the GPU. Every layer of a model gets the same cu_seqlens tensors, so on CUDA the bounds
are cached by the tensors' identity and version: the first layer reads, the others look up (`TensorCache`). CPU
tensors are read every call (a read costs nothing there), so a tensor changed behind PyTorch's version counter
(through `.data` or a numpy view) is never missed on a CPU; on CUDA pass a new tensor, or change it in place.

Sequences with no token at all (zero queries and zero keys) are dropped from the bounds the backends see: the
transformers integration builds cu_seqlens of a fixed length on the device, without a host read, and pads them
with such empty sequences.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._tensor_cache import TensorCache

# Read every entry up to this length; longer cu_seqlens (the integration's fixed-length ones) are compacted on
# the device first, so that the host reads a few hundred integers, not one per token.
_READ_WHOLE = 4096


class Varlen(NamedTuple):
    """A packed batch's sequences: sequence s holds queries bounds_q[s]:bounds_q[s+1] and keys
    bounds_k[s]:bounds_k[s+1]; together they cover every token."""

    cu_q: torch.Tensor  # int32, contiguous, on the inputs' device: bounds_q
    cu_k: torch.Tensor  # bounds_k (the same tensor as cu_q when `same`)
    bounds_q: tuple
    bounds_k: tuple
    same: bool  # the same sequences for queries and keys (self-attention over one token stream)

    @property
    def nseq(self) -> int:
        return len(self.bounds_q) - 1

    @property
    def max_n(self) -> int:
        return max((b - a for a, b in zip(self.bounds_q, self.bounds_q[1:])), default=0)

    @property
    def max_m(self) -> int:
        return max((b - a for a, b in zip(self.bounds_k, self.bounds_k[1:])), default=0)


_CACHE = TensorCache()


def clear_cache() -> None:
    """Forget the cached bounds (the transformers integration calls this once per forward)."""
    _CACHE.clear()


def check_static(cu_seqlens_q, cu_seqlens_k, device) -> None:
    """The checks that need no read of the values (dtypes, shapes, device): safe to run where torch.compile traces."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of int32 cumulative sequence lengths, got "
                            f"{type(cu).__name__}.")
        if cu.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must hold integers (torch.int32), got {cu.dtype}: cumulative sequence lengths "
                            f"are whole numbers; pass {name}.to(torch.int32).")
        if cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be 1-D with one entry per sequence plus one (starting with 0), got shape "
                             f"{tuple(cu.shape)}.")
        if cu.device != device:
            raise ValueError(f"{name} is on {cu.device} but q is on {device}; pass it on q's device.")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (one entry per sequence plus one), "
                         f"got {cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}.")


def varlen(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n: int, m: int, cover: bool = True) -> Varlen:
    """The checked sequences of cu_seqlens over n queries and m keys (one host read per pair of CUDA tensors).
    cover: the sequences must hold every token (the op's contract); the kernels' own entry points also take
    sequences that leave tokens out at either end (their outputs there are zero)."""
    check_static(cu_seqlens_q, cu_seqlens_k, cu_seqlens_q.device)
    if cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("packed sequences (cu_seqlens) cannot be captured in a CUDA graph: the kernels' launch "
                           "grids need the sequences' lengths on the host. Capture dense batches only, or run packed "
                           "ones eagerly (torch.compile without mode='reduce-overhead').")
    if cu_seqlens_q.device.type == "cpu":
        return _read(cu_seqlens_q, cu_seqlens_k, n, m, cover)
    return _CACHE.get((cu_seqlens_q, cu_seqlens_k), lambda: _read(cu_seqlens_q, cu_seqlens_k, n, m, cover),
                      key=(n, m, cover))


def _read(cu_q: torch.Tensor, cu_k: torch.Tensor, n: int, m: int, cover: bool = True) -> Varlen:
    same = cu_q is cu_k
    both = torch.stack([cu_q.long(), cu_k.long()])  # (2, nseq + 1)
    if both.shape[1] > _READ_WHOLE:  # drop the empty sequences on the device (one read of its count)
        keep = (both.diff(dim=1) != 0).any(0)
        both = torch.cat([both[:, :1], both[:, 1:][:, keep]], dim=1)
    host_q, host_k = both.tolist()
    for name, host, total in (("cu_seqlens_q", host_q, n), ("cu_seqlens_k", host_k, m)):
        if (host[0] != 0 or host[-1] != total) if cover else (host[0] < 0 or host[-1] > total):
            what = "query" if name == "cu_seqlens_q" else "key"
            raise ValueError(f"{name} must start at 0 and end at the number of {what} tokens ({total}), got "
                             f"{host[0]} .. {host[-1]}: every token must belong to a sequence (tokens outside every "
                             "sequence would get no attention and no gradient). Give padding its own sequence, or "
                             "drop it from the tensors.")
        if any(b < a for a, b in zip(host, host[1:])):
            raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {host[:16]}"
                             f"{' ...' if len(host) > 16 else ''}.")
    bounds = [(a, b) for a, b in zip(zip(host_q, host_k), zip(host_q[1:], host_k[1:])) if a != b]
    bq = (host_q[0], *(b[0] for _, b in bounds))
    bk = (host_k[0], *(b[1] for _, b in bounds))
    same = same or bq == bk
    if bq == tuple(host_q) and cu_q.dtype == torch.int32 and cu_q.is_contiguous():
        cq = cu_q
    else:
        cq = _to_device(bq, cu_q.device)
    if same:
        ck = cq
    elif bk == tuple(host_k) and cu_k.dtype == torch.int32 and cu_k.is_contiguous():
        ck = cu_k
    else:
        ck = _to_device(bk, cu_k.device)
    return Varlen(cq, ck, bq, bk, same)


def _to_device(values: tuple, device: torch.device) -> torch.Tensor:
    """int32 host values on `device`; to a GPU from pinned memory, queued behind the work already there (a copy
    from pageable memory would wait for the GPU: a second synchronization per forward)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
