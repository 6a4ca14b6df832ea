"""Host side of the Triton kernels: sequence info, allocation, quantization passes and the launches of the forward,
dQ and dK/dV kernels (Triton or Gluon, as launch.py chooses). The package's entry points (forward, backward,
supports) are these functions; hf_deltamatch.kernels exports them.

Saved tensors: q8/k8/v8 are plain contiguous (B, H, N, D) float8_e4m3fn tensors (row-major, same strides
as torch.empty), scales contiguous (B, H, N) fp32. The token-major copies the FP8 matmuls want (v for the
forward's P @ V; q, k, dO for the backward) are made on the fly and never saved, with token rows padded to
16 bytes so that TMA tensor descriptors can cover them.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from ._fp8 import FP8_MAX, INTERPRET
from .backward import _bwd_dkdv_kernel, _bwd_dq_kernel
from .forward import _fwd_kernel
from .launch import (
    _asm_scales, _bwd_launch_cfg, _check_tune, _fwd_launch_cfg, _maxnreg, _scale_after_sum,
    _dkdv_block_n, _dkdv_ds_scales, _dkdv_hopper, _dkdv_lse2, _dkdv_p_shift, _dkdv_parts,
    DQ_HOPPER_WARPGROUPS, _dkdv_hopper_cfg, _dq_hopper, _dq_hopper_cfg, _fwd_case, _fwd_hopper, _fwd_hopper_cfg,
    _grid, _hopper_why_not, _use_tma, listed_triton, log, log_dispatch,
)
from .quantize import TAIL_ROWS, _fill_outside, quantize, quantize_padded, token_major
from .. import _varlen
from .._tensor_cache import TensorCache
from .segments import ROW_ALIGN, Segments, pad, padded_layout

__all__ = ["backward", "forward", "supports"]

DS_TILE_Q = 64  # query rows per dS quantization tile (hf_deltamatch.reference.DS_TILE_Q)

# Triton versions tests/test_kernels_gpu.py passed with on the H200, as release prefixes (launch.listed_triton:
# "3.7.1" is that release only). Triton 3.9 computes wrong fp8 forward outputs unless quantize.FUSED_TOKEN_MAJOR
# works around it. Any other version gets a warning on its first CUDA launch. The Gluon kernels (fwd_hopper,
# dq_hopper, dkdv_hopper) have their own list, launch.GLUON_TRITON_VERSIONS: elsewhere the Triton kernels run
# everywhere.
GPU_TESTED_TRITON = ("3.6", "3.7.1", "3.9")


def _untested_triton(version: str) -> str | None:
    """None for a Triton version the GPU tests passed with, else the warning's text."""
    if listed_triton(version, GPU_TESTED_TRITON):
        return None
    return (f"hf_deltamatch's Triton kernels passed their GPU tests with Triton {', '.join(GPU_TESTED_TRITON)}, "
            f"not yet with {version} (Triton 3.9 once compiled one of them wrongly): run "
            "`pytest -m gpu tests/test_kernels_gpu.py` on this GPU before training, or use backend='reference'.")


@functools.cache
def _warn_untested_triton():
    msg = _untested_triton(triton.__version__)
    if msg:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def supports(q, k, v, window, config) -> str | None:
    """None if the Triton kernels run this input, else why not (one line)."""
    if not (q.is_cuda or INTERPRET):
        return "the Triton kernels need a CUDA device (or TRITON_INTERPRET=1)"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v must all be bfloat16 or float16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (B, H, N, D)"
    dqk, dv = q.shape[-1], v.shape[-1]
    for name, d in (("Dqk", dqk), ("Dv", dv)):
        if d % 16 or d < 16 or d > 256:
            return f"head dim {name}={d} is not supported (multiples of 16 up to 256)"
    if k.shape[-1] != dqk:
        return f"q and k head dims differ ({dqk} vs {k.shape[-1]})"
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        return f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]}, v {v.shape[1]})"
    if config.block not in (64, 128):
        return f"block={config.block} is not supported (64 or 128)"
    if window is not None and window < 1:
        return f"window={window} must be >= 1"
    return None


# the padded layouts of packed batches, per cu_seqlens tensor (a model's layers share their cu_seqlens)
_LAYOUTS = TensorCache()


def _layout(cu_seqlens, packing):
    """segments.padded_layout of a packed batch (cu_seqlens as _seq_info returned it), from _LAYOUTS."""
    return _LAYOUTS.get((cu_seqlens,), lambda: padded_layout(cu_seqlens, *packing))


def _seq_info(q, k, cu_seqlens_q, cu_seqlens_k, varlen=None):
    """(nseq, max_n, max_m, cu_seqlens_q, cu_seqlens_k, starts_aligned, packing) of the launch grids, the
    cu_seqlens as contiguous int32 for the kernels; dense batches are one 'sequence' per batch row.
    starts_aligned: every sequence starts at a multiple of 16 tokens (_use_tma). packing: for a varlen batch whose
    query and key sequences are the same (self-attention), (first token, end token, rows of the padded layout)
    for segments.padded_layout, else None. varlen: the op's reading of cu_seqlens (hf_deltamatch._varlen, one host
    read per pair of tensors), read here if not given; none for a dense batch."""
    return _seq_facts(q, k, cu_seqlens_q, cu_seqlens_k, varlen)[:7]


def _seq_facts(q, k, cu_seqlens_q, cu_seqlens_k, varlen=None):
    """_seq_info's tuple and, last, (rq64, rk64, rq128, rk128): the largest query / key sequence length modulo 64
    and 128 (_whole_tiles)."""
    if cu_seqlens_q is None:
        n, m = q.shape[2], k.shape[2]
        return 1, n, m, None, None, True, None, (n % 64, m % 64, n % 128, m % 128)
    if varlen is None:  # a direct call (the op reads them itself): tokens may lie outside every sequence
        varlen = _varlen.varlen(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], cover=False)
    return _LAUNCH_FACTS.get((varlen.cu_q, varlen.cu_k), lambda: _launch_facts(varlen),
                             key=(varlen.bounds_q, varlen.bounds_k))


_LAUNCH_FACTS = TensorCache()


def _launch_facts(varlen):
    """_seq_facts of a varlen batch from its bounds (host integers: no device read)."""
    bq, bk = varlen.bounds_q, varlen.bounds_k
    nseq = varlen.nseq
    if nseq < 1:
        return 0, 0, 0, varlen.cu_q, varlen.cu_k, True, None, (0, 0, 0, 0)
    lq = [b - a for a, b in zip(bq, bq[1:])]
    lk = [b - a for a, b in zip(bk, bk[1:])]
    aligned = all(x % 16 == 0 for x in bq[:-1]) and all(x % 16 == 0 for x in bk[:-1])
    npad = sum(-(-x // ROW_ALIGN) * ROW_ALIGN for x in lq)
    packing = (bq[0], bq[-1], npad) if varlen.same else None
    rems = (max(x % 64 for x in lq), max(x % 64 for x in lk), max(x % 128 for x in lq), max(x % 128 for x in lk))
    return nseq, max(lq), max(lk), varlen.cu_q, varlen.cu_k, aligned, packing, rems


def _whole_tiles(rems, queries: int = 0, keys: int = 0) -> bool:
    """Whether every query sequence is whole `queries`-token tiles and every key sequence whole `keys`-token ones
    (0: either). On a varlen batch a TMA tile past a sequence's end reads the next sequence's tokens: masked
    scores give them P = 0, but a NaN there would reach the MMAs as 0 x NaN (docs/numerics.md, "Non-finite
    inputs"), so the kernels whose products take such rows unmasked (the forward's V, the dQ kernel's V and K^T)
    read them through TMA only where no tile crosses a sequence's end. (A dense batch's heads end in zero rows
    instead: _tma_rows.)"""
    rq, rk = {64: rems[0], 128: rems[2]}, {64: rems[1], 128: rems[3]}
    return (not queries or rq[queries] == 0) and (not keys or rk[keys] == 0)


def _quantize_segments(cu_seqlens, packing, block):
    """quantize's `segments` for a packed self-attention batch (its padded layout: one program per 128-token tile),
    else None (the grid then covers the longest sequence's tiles for every sequence)."""
    return _layout(cu_seqlens, packing) if packing is not None and block == ROW_ALIGN else None


def _packed(packing, B: int, causal: bool) -> bool:
    """Whether a varlen batch is one the Gluon kernels can take padded (launch._hopper_case's `packed`): the same
    query and key sequences (_seq_info's packing) with a token, one batch row, causal (a sliding window is
    launch._hopper_why_not's to judge)."""
    return packing is not None and packing[2] > 0 and B == 1 and bool(causal)


@functools.lru_cache(maxsize=64)
def _dense_layout(n: int, device) -> Segments:
    """The padded layout in which the Gluon kernels take a dense batch of N = n tokens per head, n not a multiple of
    128 (launch.HOPPER_RAGGED): each head one sequence at row 0 of its rows rounded up to 128, the layout that the
    dense fp8 copies have already (quantize.TAIL_ROWS: zeros past n). Cached per (n, device): no host sync."""
    cu = torch.tensor([0, n], dtype=torch.int32, device=device)
    return padded_layout(cu, 0, n, -(-n // ROW_ALIGN) * ROW_ALIGN)


def _padded_view(x8):
    """A dense fp8 copy (B, H, N, D) as the (B, H, R, D) view of its storage's rows (R = N rounded up to
    quantize.TAIL_ROWS, zeros past N: _tma_rows): segments.pad's result for _dense_layout, without a copy."""
    B, H, N, D = x8.shape
    if not _tma_rows(x8, False):
        raise ValueError("_padded_view: the fp8 copy's heads are not padded to quantize.TAIL_ROWS rows (ops._tma_rows)")
    return x8.as_strided((B, H, x8.stride(1) // D, D), x8.stride())


def _case_text(fp8, dqk, dv, causal, window, varlen, packed, n, m) -> str:
    """The dispatch log's description of an input (launch.log_dispatch): what the kernels' choice depends on, the
    sequence length only as whether it is a multiple of 128, so that a run logs a few lines, not one per length."""
    if varlen:
        layout = "a packed causal batch" if packed else "a varlen batch"
    elif n != m:
        layout = "a dense batch, N != M"
    else:
        layout = f"a dense batch, N = M {'a' if n % 128 == 0 else 'not a'} multiple of 128"
    mask = ("causal" + (" + window" if window is not None else "")) if causal else "full mask"
    return f"{'fp8' if fp8 else 'bf16'} D={dqk}/{dv}, {mask}, {layout}"


def _desc(x, tokens: int, dims: int):
    """TMA descriptor over a 2-D view of x (B, H, N, D), boxes of `tokens` x `dims` elements: (B*H*R, D) for
    our row-major tensors (R = N, or N rounded up to quantize.TAIL_ROWS with zero rows: a tile past a head's
    end reads zeros; the kernels count rows by the head stride), (B*H*D, N) for a token-major view of
    (B, H, D, N16) storage (boxes then `dims` x `tokens`, read transposed by _tile; TMA fills zeros past N)."""
    B, H, N, D = x.shape
    if x.stride(2) == 1:  # token-major
        return TensorDescriptor(x, [B * H * D, N], [x.stride(3), 1], [dims, tokens])
    return TensorDescriptor(x, [B * H * (x.stride(1) // D), D], [D, 1], [tokens, dims])


def _tma_rows(t, varlen: bool) -> bool:
    """Whether _desc's row-major view covers t (B, H, N, D): rows of D contiguous elements, R rows per head, the
    heads one after another; and, on a dense batch, R the head's tiles rounded up to quantize.TAIL_ROWS (zeros
    past N, so a tile past a head's end never reads the next head). A varlen batch's tiles stay inside its
    sequences (_whole_tiles)."""
    B, H, N, D = t.shape
    rows = t.stride(1) // max(D, 1)
    heads_in_order = B == 1 or t.stride(0) == H * rows * D
    return (t.stride(3) == 1 and t.stride(2) == D and t.stride(1) == rows * D and heads_in_order
            and (varlen or rows >= -(-N // TAIL_ROWS) * TAIL_ROWS))


def _s4(t):
    return t.stride() if t is not None else (0, 0, 0, 0)


def forward(q, k, v, *, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, config, qk_transform=None,
            varlen=None):
    """reference.forward's results. qk_transform (fp8 only): outliers.fused_args' (r_q, r_k, k_means), applied to
    q and k by their quantization pass (the saved q8, k8 are those of q', k'). varlen: the op's reading of
    cu_seqlens (hf_deltamatch._varlen)."""
    seqs = varlen
    B, Hq, N, dqk = q.shape
    _, Hkv, M, dv = v.shape
    fp8 = config.precision == "fp8"
    T = config.block
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dqk)
    varlen = cu_seqlens_q is not None
    if qk_transform is not None and not fp8:
        raise ValueError("qk_transform is applied by the fp8 quantization pass; with precision='bf16' transform q and "
                         "k first (outliers.transform_qk).")
    r_q, r_k, k_means = qk_transform if qk_transform is not None else (None, None, None)
    qt, kt = dict(rotation=r_q), dict(rotation=r_k, means=k_means)
    _check_tune()
    if q.is_cuda and not INTERPRET:
        _warn_untested_triton()
    nseq, max_n, max_m, cu_seqlens_q, cu_seqlens_k, aligned, packing, rems = _seq_facts(q, k, cu_seqlens_q,
                                                                                        cu_seqlens_k, seqs)
    seg = _quantize_segments(cu_seqlens_q, packing, T)
    qkw = dict(block=T, rounding=config.scale_rounding, max_len=max_n, cu_seqlens=cu_seqlens_q, segments=seg)
    kvw = dict(block=T, rounding=config.scale_rounding, max_len=max_m, cu_seqlens=cu_seqlens_k, segments=seg)
    d = max(dqk, dv)
    packed = _packed(packing, B, causal)
    case = dict(fp8=fp8, dqk=dqk, dv=dv, block=T, varlen=varlen, window=window if causal else None, n=N, m=M,
                device=q.device, packed=packed, causal=bool(causal))
    hopper = fp8 and _fwd_hopper(d, **case)
    # a dense batch of N = M not a multiple of 128 (launch.HOPPER_RAGGED): the Gluon kernels' packed variant, each head
    # one sequence in the rows the fp8 copies have (_dense_layout)
    ragged = hopper and not varlen and N % ROW_ALIGN != 0
    if log.isEnabledFor(logging.DEBUG):
        log_dispatch("forward", "Gluon" if hopper else "Triton", _case_text(fp8, dqk, dv, causal, window, varlen,
                                                                             packed, N, M),
                     None if hopper else _hopper_why_not(**_fwd_case(**case)) or "switched off (kernels.TUNE)")
    if fp8 and hopper and varlen:
        # a packed batch: quantized once into the packed tensors the backward keeps and into the padded layout
        # that the Gluon forward reads (segments.py; cu_seqlens_k is cu_seqlens_q there), its V token-major
        pw = dict(segments=seg, rounding=config.scale_rounding)
        (q8, sq), (q8p, _, sqp) = quantize_padded(q, **qt, **pw)
        (k8, sk), (k8p, _, skp) = quantize_padded(k, **kt, **pw)
        (v8, sv), (_, v8tp, svp) = quantize_padded(v, row_major=False, token_major=True, **pw)
    elif fp8:
        q8, _, sq = quantize(q, **qt, **qkw)
        k8, _, sk = quantize(k, **kt, **kvw)
        if ragged:  # V straight into the padded layout, token-major in k_order (N need not be a multiple of 32); the
            # saved v8 is the row-major copy's first N rows, as quantize() makes it, its scales contiguous
            seg = _dense_layout(N, q.device)
            _, (v8p, v8tp, svp) = quantize_padded(v, seg, rounding=config.scale_rounding, packed=False,
                                                  token_major=True)
            v8, v8t, sv = v8p[:, :, :N], v8tp, svp[:, :, :N].contiguous()
        else:
            # the Gluon forward's V: keys in k_order (its P8 is the score accumulator as is: _gluon.fp8_operand)
            v8, v8t, sv = quantize(v, transposed=True, k_order=hopper, **kvw)
        qa, ka, va = q8, k8, v8t  # the forward reads V token-major (K-major B operand of P8 @ V)
    else:
        q8, k8, v8 = (q.new_empty(0, dtype=torch.float8_e4m3fn) for _ in range(3))
        sq, sk, sv = (q.new_empty(0, dtype=torch.float32) for _ in range(3))
        qa, ka, va = q, k, v
    # varlen: zeros (LSE -inf) for the tokens outside every sequence; the Gluon forward writes every token of a
    # packed batch's sequences, so only the rows outside them are filled there
    alloc = torch.zeros if varlen and not hopper else torch.empty
    out = alloc((B, Hq, N, dv), dtype=q.dtype, device=q.device)
    lse = torch.full((B, Hq, N), float("-inf"), dtype=torch.float32, device=q.device) if varlen and not hopper \
        else torch.empty((B, Hq, N), dtype=torch.float32, device=q.device)
    if varlen and hopper:
        _fill_outside(out, seg, 0.0)
        _fill_outside(lse, seg, float("-inf"))
    if out.numel() == 0 or nseq == 0:
        if not varlen:
            lse.fill_(float("-inf"))
            out.zero_()
        return out, lse, q8, k8, v8, sq, sk, sv
    if hopper:
        from .fwd_hopper import fwd_hopper
        cfg = _fwd_hopper_cfg(dv)  # MLA's Dqk=192 / Dv=128 and Dv=256 too (launch.FWD_HOPPER_WIDE_DIMS)
        # a packed batch: its padded layout (segments.py); out and lse stay packed. Ragged: q8, k8 are in it already
        if varlen:
            ops = (q8p, k8p, v8tp, sqp, skp, svp)
        elif ragged:
            ops = (_padded_view(q8), _padded_view(k8), v8t, pad(sq, seg, 1.0), pad(sk, seg, 1.0), svp)
        else:
            ops = (q8, k8, v8t, sq, sk, sv)
        grid, n_tiles, head_group = _grid("fwd", _blocks(max_n if varlen else N, cfg["warpgroups"]), B * Hq, nseq,
                                          bool(causal))
        fwd_hopper(*ops, out, lse, causal=causal, softmax_scale=softmax_scale, grid=grid, n_tiles=n_tiles,
                   head_group=head_group, segments=seg, window=case["window"], **cfg)
        return out, lse, q8, k8, v8, sq, sk, sv
    # dense: V's token-major tiles end at the head's end (TMA fills zeros past it)
    tma = _use_tma("fwd", fp8, dqk, dv, aligned and (not varlen or _whole_tiles(rems, keys=T)))
    BLOCK_M, warps, stages = _fwd_launch_cfg(dqk, dv, fp8)
    bdqk, bdv = triton.next_power_of_2(dqk), triton.next_power_of_2(dv)
    if tma:  # 2-D views of the contiguous q8, k8 and token-major v8 storage (B, Hkv, Dv, M)
        qa, ka, va = _desc(q8, BLOCK_M, bdqk), _desc(k8, T, bdqk), _desc(v8t, T, bdv)
    dummy = lse
    grid, n_tiles, head_group = _grid("fwd", triton.cdiv(max(max_n, 1), BLOCK_M), B * Hq, nseq, bool(causal))
    _fwd_kernel[grid](
        qa, ka, va, sq if fp8 else dummy, sk if fp8 else dummy, sv if fp8 else dummy, out, lse,
        cu_seqlens_q, cu_seqlens_k,
        *_s4(q8 if tma else qa), *_s4(k8 if tma else ka), *_s4(v8t if tma else va), *out.stride(),
        Hq, Hkv, N, M, float(softmax_scale), int(window) if window is not None else 0, n_tiles, head_group,
        GROUPS=Hq // Hkv, DQK=dqk, DV=dv, BLOCK_M=BLOCK_M, BLOCK_N=T,
        BLOCK_DQK=bdqk, BLOCK_DV=bdv,
        CAUSAL=bool(causal), HAS_WINDOW=bool(causal) and window is not None, VARLEN=varlen, FP8=fp8,
        INTERP=INTERPRET, TMA=tma, ASM_SCALES=_asm_scales("fwd", d),
        num_warps=warps, num_stages=stages, **_maxnreg("fwd"),
    )
    return out, lse, q8, k8, v8, sq, sk, sv


def backward(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, *, causal, softmax_scale, window,
             cu_seqlens_q, cu_seqlens_k, config, return_row_sums: bool = False, return_delta: bool = False,
             varlen=None, dlse=None):
    """(dq, dk, dv), then the row sums if asked, then delta (B, Hq, N) fp32 if asked (reference.backward's).
    dlse (a gradient of the LSE) is not taken: the op runs reference.backward for it."""
    if dlse is not None:
        raise ValueError("the Triton kernels take no LSE gradient (dlse); reference.backward folds it into dS")
    seqs = varlen
    fp8 = config.precision == "fp8"
    stale = config.delta == "stale"
    T = config.block
    dtype = do.dtype
    qs, ks, vs = (q8, k8, v8) if fp8 else (q, k, v)
    B, Hq, N, dqk = qs.shape
    _, Hkv, M, dv = vs.shape
    d = max(dqk, dv)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dqk)
    varlen = cu_seqlens_q is not None
    _check_tune()
    nseq, max_n, max_m, cu_seqlens_q, cu_seqlens_k, aligned, packing, rems = _seq_facts(qs, ks, cu_seqlens_q,
                                                                                        cu_seqlens_k, seqs)
    if stale and out is None:
        raise ValueError("delta='stale' needs the forward output.")
    lse = lse.contiguous()
    dev = do.device
    # the dQ kernels write delta for every query row of a dense batch; a varlen one's rows outside every sequence
    # stay 0 (the Triton dK/dV kernel's tiles read them)
    delta = (torch.zeros if varlen else torch.empty)((B, Hq, N), dtype=torch.float32, device=dev)
    lse2_in, p_shift = _dkdv_lse2(d), _dkdv_p_shift(d, fp8)
    lse2 = torch.empty((B, Hq, N), dtype=torch.float32, device=dev) if lse2_in else delta  # written by dQ
    rs = torch.zeros((B, Hq, N), dtype=torch.float32, device=dev) if return_row_sums else delta
    ra = torch.zeros((B, Hq, N), dtype=torch.float32, device=dev) if return_row_sums else delta
    # the Gluon kernels (dkdv_hopper, dq_hopper) where they apply; both take the dS scales from the dQ kernel
    case = dict(fp8=fp8, e4m3=config.grad_format == "e4m3", dqk=dqk, dv=dv, block=T, varlen=varlen,
                window=window if causal else None, n=N, m=M, device=do.device, lse2_in=lse2_in, p_shift=p_shift,
                packed=_packed(packing, B, causal), causal=bool(causal))
    # packed and ragged batches (N % 128 != 0: launch.HOPPER_RAGGED) take the kernels' padded layout
    padded = varlen or N % ROW_ALIGN != 0
    # the saved q8, k8, v8 as quantize() makes them: contiguous, or with a ragged batch's heads padded (_padded_view)
    case_ok = fp8 and all(_tma_rows(t, False) if padded and not varlen else t.is_contiguous() for t in (q8, k8, v8))
    hopper = case_ok and _dkdv_hopper(d, **case)
    hopper_dq = case_ok and _dq_hopper(d, stale=stale, **case)
    # padded, the two kernels hand each other padded rows: both or neither; and not with the invariant's row sums
    # (the dQ kernel would write them padded)
    if padded and not (hopper and hopper_dq and not return_row_sums):
        hopper = hopper_dq = False
    if log.isEnabledFor(logging.DEBUG):
        why = None
        if not (hopper and hopper_dq):
            why = _hopper_why_not(**case) or (
                "the saved q8, k8, v8 are not the kernels' layout (quantize's: contiguous, heads padded to 128 rows)"
                if not case_ok else "delta='stale' (the Gluon dQ kernel computes the matching delta)" if stale
                else "the invariant's row sums asked (return_row_sums)" if padded and return_row_sums
                else "switched off (kernels.TUNE)")
        log_dispatch("backward", f"dQ {'Gluon' if hopper_dq else 'Triton'}, dK/dV {'Gluon' if hopper else 'Triton'}",
                     _case_text(fp8, dqk, dv, causal, window, varlen, case["packed"], N, M), why)
    # varlen: zeros for the tokens outside every sequence (and the keys a Triton dK/dV program skips); the Gluon
    # kernels write every token of a packed batch's sequences, so only the rows outside them are zeroed there
    packed_gluon = varlen and hopper and fp8
    alloc = torch.zeros if varlen and not packed_gluon else torch.empty
    dq = alloc((B, Hq, N, dqk), dtype=dtype, device=dev)
    dk = (torch.zeros if N == 0 else alloc)((B, Hkv, M, dqk), dtype=dtype, device=dev)
    dv_ = (torch.zeros if N == 0 else alloc)((B, Hkv, M, dv), dtype=dtype, device=dev)
    if packed_gluon:
        for t in (dq, dk, dv_):
            _fill_outside(t, _layout(cu_seqlens_q, packing), 0.0)
    ds_scales = (_dkdv_ds_scales(d, fp8, Hq != Hkv) or hopper or hopper_dq) and N > 0 and M > 0
    kv_n = _dkdv_block_n(T, d, ds_scales)
    # one scale per dS tile (DS_TILE_Q queries x T keys), written by the dQ kernel for the dK/dV kernel; rows per
    # head: backward._dss_row's bound N // DS_TILE_Q + nseq. Ones: a tile the dQ kernel skips is all masked, and 1
    # is what tile_scale gives an all-zero tile.
    dss_tq, dss_tk = (N // DS_TILE_Q + nseq, triton.cdiv(max_m, T)) if ds_scales else (0, 0)
    dss = torch.ones((B * Hq, dss_tq, dss_tk), dtype=torch.float32, device=dev) if ds_scales else delta

    def _ret(delta=delta):
        return (dq, dk, dv_, *((rs, ra) if return_row_sums else ()), *((delta,) if return_delta else ()))

    if B * Hq == 0 or nseq == 0 or (N == 0 and M == 0):
        return _ret(delta.zero_())
    # Token-major copies are made right before the kernel that reads them and dropped after it (k8t for the dQ
    # kernel, q8t for the dK/dV kernel), but for dO8's, written by dO's quantization pass: at most two 1-byte
    # copies are alive at once.
    k8t = q8t = do8t = None
    if fp8 and padded and hopper:
        seg = _layout(cu_seqlens_q, packing) if varlen else _dense_layout(N, dev)
        delta_p = _backward_padded(do, q8, k8, v8, q_scale, k_scale, v_scale, lse, dq, dk, dv_, seg,
                                   softmax_scale=softmax_scale, config=config, max_n=max_n, nseq=nseq,
                                   dense=not varlen, causal=bool(causal), window=case["window"])
        if return_delta:
            _unpad_rows(delta_p, seg, delta)
        return _ret()
    if fp8:
        do8, do8t, sdo = quantize(do, T, config.grad_format, config.scale_rounding, cu_seqlens_q, max_n,
                                  transposed=M > 0 and max_m > 0, k_order=hopper,
                                  segments=_quantize_segments(cu_seqlens_q, packing, T))
        sq, sk, sv = q_scale, k_scale, v_scale
        doa = do8
    else:
        doa = do
        sq = sk = sv = sdo = delta  # unused
    dq_m, dq_w, dq_s, kv_w, kv_s = _bwd_launch_cfg(dqk, dv, fp8, kv_n, T)
    bdqk, bdv = triton.next_power_of_2(dqk), triton.next_power_of_2(dv)
    common = dict(DQK=dqk, BLOCK_DQK=bdqk, BLOCK_DV=bdv,
                  CAUSAL=bool(causal), HAS_WINDOW=bool(causal) and window is not None, VARLEN=varlen, FP8=fp8,
                  FMAX=FP8_MAX[config.grad_format], E5M2=config.grad_format == "e5m2",
                  POW2=config.scale_rounding == "pow2", INTERP=INTERPRET)
    win = int(window) if window is not None else 0
    # the descriptors below assume the saved k8/v8 are row-major as quantize() makes them (_desc); on a varlen batch
    # a tile past a sequence's end reads the next one's tokens, so there only whole tiles (_whole_tiles)
    aligned = aligned and fp8 and all(_tma_rows(t, varlen) for t in (k8, v8))
    dq_tma = _use_tma("dq", fp8, dqk, dv, aligned and (not varlen or _whole_tiles(rems, keys=T)))
    if N > 0 and max_n > 0:
        ka, kta, va = ks, ks, vs
        if fp8:
            k8t = kta = token_major(k8, k_order=hopper_dq)  # the Gluon kernels' B operands: fp8_operand
        if hopper_dq:
            from .dq_hopper import dq_hopper
            grid, n_tiles, head_group = _grid("dq", _blocks(N, DQ_HOPPER_WARPGROUPS), B * Hq, nseq, bool(causal))
            dq_hopper(q8, k8, k8t, v8, do8, sq, sk, sv, sdo, lse, dq, delta, lse2, dss, rs, ra, causal=causal,
                      softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, grid=grid, n_tiles=n_tiles,
                      head_group=head_group, scale_after_sum=_scale_after_sum(d), fmax=FP8_MAX["e4m3"],
                      pow2=config.scale_rounding == "pow2", row_sums=return_row_sums, window=case["window"],
                      **_dq_hopper_cfg(d, bool(causal)))
        else:
            if dq_tma:  # 2-D views: k8 and v8 (B*Hkv*M, D), k8 token-major (B*Hkv*Dqk, M)
                ka, kta, va = _desc(k8, T, bdqk), _desc(k8t, T, bdqk), _desc(v8, T, bdv)
            o_arg = out if stale else do
            grid, n_tiles, head_group = _grid("dq", triton.cdiv(max_n, dq_m), B * Hq, nseq, bool(causal))
            _bwd_dq_kernel[grid](
                qs, ka, kta, va, doa, sq, sk, sv, sdo, lse, do, o_arg, dq, delta, lse2, rs, ra, dss,
                cu_seqlens_q, cu_seqlens_k,
                *qs.stride(), *ks.stride(), *_s4(k8t if k8t is not None else ks), *vs.stride(), *doa.stride(),
                *do.stride(),
                *o_arg.stride(), *dq.stride(),
                Hq, Hkv, N, M, float(softmax_scale), win, n_tiles, head_group, dss_tq, dss_tk,
                GROUPS=Hq // Hkv, DV=dv, BLOCK_M=dq_m, BLOCK_N=T, STALE=stale, ROW_SUMS=return_row_sums,
                DS_Q=DS_TILE_Q, ONE_TILE=dq_m == DS_TILE_Q, TMA=dq_tma, ASM_SCALES=_asm_scales("dq", d),
                SCALE_AFTER_SUM=_scale_after_sum(d), LSE2_OUT=lse2_in,
                P_SHIFT=p_shift, DSS_OUT=ds_scales, num_warps=dq_w, num_stages=dq_s, **common, **_maxnreg("dq"),
            )
    k8t = ka = kta = va = None  # noqa: F841  (freed before the dK/dV kernel's copies are made)
    if M > 0 and max_m > 0:
        qt, dot = qs, doa
        if fp8:
            q8t = qt = token_major(q8, k_order=hopper)
            dot = do8t
        if hopper:
            from .dkdv_hopper import dkdv_hopper
            cfg = _dkdv_hopper_cfg(d, causal=bool(causal), groups=Hq // Hkv, packed=False,
                                   window=case["window"] is not None)
            grid, n_tiles, head_group = _grid("dkdv", _blocks(M, cfg["warpgroups"]), B * Hkv, nseq, bool(causal))
            dkdv_hopper(q8, q8t, k8, v8, do8, do8t, sq, sk, sv, sdo, lse2, delta, dss, dk, dv_, causal=causal,
                        softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, grid=grid, n_tiles=n_tiles,
                        head_group=head_group, window=case["window"], **cfg)
            return _ret()
        grid, n_tiles, head_group = _grid("dkdv", triton.cdiv(max_m, kv_n), B * Hkv, nseq, bool(causal))
        for part in _dkdv_parts(d):
            _bwd_dkdv_kernel[grid](
                qs, qt, ks, vs, doa, dot,
                sq, sk, sv, sdo, lse2 if lse2_in else lse, delta, dss, dk, dv_, cu_seqlens_q, cu_seqlens_k,
                *qs.stride(), *_s4(q8t if fp8 else qs), *ks.stride(),
                *vs.stride(), *doa.stride(), *_s4(do8t if fp8 else doa), *dk.stride(), *dv_.stride(),
                Hq, Hkv, N, M, float(softmax_scale), win, n_tiles, head_group, dss_tq, dss_tk,
                # a dS quantization tile is DS_TILE_Q queries x the block's keys (the contract): a key tile smaller
                # than the block (kv_n) reads the tile's scale from the dQ kernel (launch._dkdv_block_n)
                GROUPS=Hq // Hkv, DV_=dv, BLOCK_M=DS_TILE_Q, BLOCK_N=kv_n, DS_K=T,
                ASM_SCALES=_asm_scales("dkdv", d, bool(causal)), LSE2_IN=lse2_in, P_SHIFT=p_shift, PART=part,
                DSS_IN=ds_scales,
                num_warps=kv_w, num_stages=kv_s, **common, **_maxnreg("dkdv"),
            )
    return _ret()


def _unpad_rows(x, seg, out):
    """A row array (B, H, seg.npad) of the padded layout back to the packed rows of out (B, H, N), in place:
    segments.pad's inverse (the token of each padded row, as padded_layout maps them; other rows untouched)."""
    tokens = torch.arange(seg.first, seg.last, device=x.device, dtype=torch.int32)
    s = torch.searchsorted(seg.cu[1:], tokens, right=True)
    out[:, :, seg.first:seg.last] = x.index_select(2, (seg.pcu[s] + tokens - seg.cu[s]).long())
    return out


def _blocks(n, warpgroups):
    """A Gluon kernel's programs over n rows (queries or keys): 64 per MMA warpgroup."""
    return triton.cdiv(max(n, 1), 64 * warpgroups)


def _backward_padded(do, q8, k8, v8, sq, sk, sv, lse, dq, dk, dv, seg, *, softmax_scale, config, max_n, nseq,
                     dense=False, causal=True, window=None):
    """The backward of a packed batch (causal), or of a ragged dense one (`dense`: seg is its _dense_layout; causal
    or not), through the Gluon kernels (backward() checked the case): every input copied into seg's padded layout
    (segments.py: LSE padded with -inf, so a padded row's P is 0; dO quantized straight into it) but a dense batch's
    q8, k8, v8, which are in it already (_padded_view); dq, dk, dv written to their packed rows. LSE2, delta and the
    dS scales stay in the padded layout between the two kernels. window: a causal sliding window
    (launch.HOPPER_WINDOW)."""
    from .dkdv_hopper import dkdv_hopper
    from .dq_hopper import dq_hopper
    B, Hq, _, D = q8.shape
    Hkv = k8.shape[1]
    # dO8 token-major is alive from here, k8t only for the dQ kernel and q8t only for the dK/dV one: two 1-byte
    # token-major copies at a time, as in backward()
    _, (do8, do8t, sdo) = quantize_padded(do, seg, config.grad_format, config.scale_rounding, packed=False,
                                          token_major=True)
    k8t = token_major(k8, k_order=True, src=seg.src)  # padded straight from the packed tensors
    q8_ = q8
    q8, k8, v8 = (_padded_view(x) if dense else pad(x, seg) for x in (q8, k8, v8))
    sq, sk, sv = (pad(s, seg, 1.0) for s in (sq, sk, sv))
    lse = pad(lse, seg, float("-inf"))
    rows = dict(dtype=torch.float32, device=q8.device)
    delta, lse2 = torch.empty((B, Hq, seg.npad), **rows), torch.empty((B, Hq, seg.npad), **rows)
    dss_tq, dss_tk = seg.npad // DS_TILE_Q, seg.npad // config.block
    dss = torch.ones((B * Hq, dss_tq, dss_tk), **rows)
    common = dict(causal=causal, softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, segments=seg, window=window)
    grid, n_tiles, head_group = _grid("dq", _blocks(max_n, DQ_HOPPER_WARPGROUPS), B * Hq, nseq, causal)
    dq_hopper(q8, k8, k8t, v8, do8, sq, sk, sv, sdo, lse, dq, delta, lse2, dss, delta, delta, grid=grid,
              n_tiles=n_tiles, head_group=head_group, scale_after_sum=_scale_after_sum(D), fmax=FP8_MAX["e4m3"],
              pow2=config.scale_rounding == "pow2", row_sums=False, **common,
              **_dq_hopper_cfg(D, causal, padded=True))
    del k8t
    q8t = token_major(q8_, k_order=True, src=seg.src)
    cfg = _dkdv_hopper_cfg(D, causal=causal, groups=Hq // Hkv, packed=True, window=window is not None)
    grid, n_tiles, head_group = _grid("dkdv", _blocks(max_n, cfg["warpgroups"]), B * Hkv, nseq, causal)
    dkdv_hopper(q8, q8t, k8, v8, do8, do8t, sq, sk, sv, sdo, lse2, delta, dss, dk, dv, grid=grid, n_tiles=n_tiles,
                head_group=head_group, **common, **cfg)
    return delta  # padded, as the kernels used it
