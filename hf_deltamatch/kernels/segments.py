"""Packed (varlen) batches for the Gluon kernels: every sequence moved to rows that start at a multiple of 128.

The Gluon kernels (fwd_hopper.py, dq_hopper.py, dkdv_hopper.py) read 128-key and 64-query tiles through TMA and
their token-major B operands in groups of 32 tokens (quantize.k_order), all counted from a sequence's first token,
and TMA reads a token-major tile only from a 16-byte aligned start. A packed batch's sequences start anywhere, so
the fp8 operands go to a padded layout (q, k, v and dO quantized straight into it, quantize.quantize_padded; the
saved q8, k8, v8 copied with pad and token_major(src=...)): sequence s at rows pcu[s] .. pcu[s] + len_s, pcu[s] a
multiple of 128, the rows after it up to the next multiple of 128 zero. Per-row scales are padded with 1 and LSE
with -inf, so a padded query row has P = 0 everywhere (no NaN, no contribution); the kernels write their outputs
straight to the packed rows. The quantization tiles are the packed batch's (quantize with cu_seqlens): the same
bytes and scales as the Triton kernels read.
"""

from typing import NamedTuple

import torch

from .quantize import pad_tokens

ROW_ALIGN = 128  # a key tile (_gluon.KEYS_PER_PROGRAM), a multiple of the 32-token k_order groups and of 64 queries


class Segments(NamedTuple):
    cu: torch.Tensor  # int32 (nseq + 1,): cu_seqlens, the packed rows
    pcu: torch.Tensor  # int32 (nseq + 1,): each sequence's first row in the padded layout, and the total at the end
    src: torch.Tensor  # int32 (npad,): the packed token of each padded row, -1 for the rows of no token
    tiles: torch.Tensor  # int32 (2 * npad / 128,): each 128-token tile's first packed row, then its end
    npad: int  # rows per head of the padded layout
    first: int  # cu[0] and cu[-1]: the packed rows before first and from last on belong to no sequence
    last: int
    gather: torch.Tensor  # int64 (npad,): src with 0 for -1, and
    no_token: torch.Tensor  # bool (npad,): src < 0, for pad's index_select of row arrays (made once per layout)


def padded_rows(lengths: torch.Tensor) -> torch.Tensor:
    """Rows of each sequence in the padded layout: its length rounded up to ROW_ALIGN."""
    return (lengths + (ROW_ALIGN - 1)) // ROW_ALIGN * ROW_ALIGN


def padded_layout(cu_seqlens: torch.Tensor, first: int, last: int, npad: int) -> Segments:
    """The padded layout of the packed batch cu_seqlens (int32, contiguous): first = cu_seqlens[0] and last =
    cu_seqlens[-1] (the tokens outside [first, last) belong to no sequence) and npad, its host-side values
    (ops._seq_info reads them with the batch's one host sync)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    pcu = torch.zeros_like(cu_seqlens)
    pcu[1:] = torch.cumsum(padded_rows(lengths), 0)
    tokens = torch.arange(first, last, device=cu_seqlens.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens[1:], tokens, right=True)  # empty sequences are skipped
    rows = (pcu[seq] + (tokens - cu_seqlens[seq])).long()  # the padded row of each token
    src = torch.full((npad,), -1, dtype=torch.int32, device=cu_seqlens.device).index_copy_(0, rows, tokens)
    # a sequence's padded rows are at the end of its last tile: every tile starts at a token
    by_tile = src.view(-1, ROW_ALIGN)
    tiles = torch.cat([by_tile[:, 0], by_tile[:, 0] + (by_tile >= 0).sum(1, dtype=torch.int32)])
    return Segments(cu_seqlens, pcu, src, tiles, npad, first, last, src.clamp(min=0).long(), src < 0)


def pad(x: torch.Tensor, seg: Segments, fill: float = 0.0) -> torch.Tensor:
    """x packed -> padded: operands (B=1, H, N, D) -> (1, H, seg.npad, D) row-major, zeros in the rows of no token
    (one copy kernel, quantize.pad_tokens, rather than torch's slower index_copy);
    row arrays (B, H, N) -> (B, H, seg.npad) with `fill` there. Token-major padded copies: quantize.token_major
    with src=seg.src."""
    if x.dim() == 4:
        if fill != 0.0:
            raise ValueError("operands are padded with zeros")
        return pad_tokens(x, seg.src)
    return x.index_select(2, seg.gather).masked_fill_(seg.no_token, fill)
