"""Host side of the Triton kernels: sequence info, allocation, quantization passes and the launches of the forward,
dQ and dK/dV kernels (Triton or Gluon, as plan.py chooses). The package's entry points (forward, backward,
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

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from .. import _varlen
from .._tensor_cache import TensorCache
from . import configs
from . import plan as P
from . import toolchain
from ._descriptors import descriptor
from ._fp8 import FP8_MAX, INTERPRET
from .backward import _bwd_dkdv_kernel, _bwd_dq_kernel
from .forward import _fwd_kernel
from .quantize import TAIL_ROWS, _fill_outside, quantize, quantize_padded, token_major
from .segments import ROW_ALIGN, Segments, pad, padded_layout

__all__ = ["backward", "forward", "supports"]

DS_TILE_Q = P.DS_TILE_Q


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


def _varlen_of(q, k, cu_seqlens_q, cu_seqlens_k, varlen):
    """The op's reading of cu_seqlens (hf_deltamatch._varlen), read here for a direct call (where tokens may lie
    outside every sequence); None for a dense batch."""
    if cu_seqlens_q is None:
        return None
    if varlen is None:
        varlen = _varlen.varlen(cu_seqlens_q, cu_seqlens_k, q.shape[2], k.shape[2], cover=False)
    return varlen


def sequences(q, k, cu_seqlens_q=None, cu_seqlens_k=None):
    """(the checked cu_seqlens, hf_deltamatch._varlen.Varlen, or None for a dense batch; the launches' plan.Seqs) of
    q (B, Hq, N, D) over k (B, Hkv, M, D): what forward() and backward() launch by."""
    vl = _varlen_of(q, k, cu_seqlens_q, cu_seqlens_k, None)
    return vl, (P.dense_seqs(q.shape[2], k.shape[2]) if vl is None else P.varlen_seqs(vl))


def _quantize_segments(cu_seqlens, packing, block):
    """quantize's `segments` for a packed self-attention batch (its padded layout: one program per 128-token tile),
    else None (the grid then covers the longest sequence's tiles for every sequence)."""
    return _layout(cu_seqlens, packing) if packing is not None and block == ROW_ALIGN else None


@functools.lru_cache(maxsize=64)
def _dense_layout(n: int, device) -> Segments:
    """The padded layout in which the Gluon kernels take a dense batch of N = n tokens per head, n not a multiple of
    128: each head one sequence at row 0 of its rows rounded up to 128, the layout that the
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


def _desc(x, tokens: int, dims: int):
    """TMA descriptor over a 2-D view of x (B, H, N, D), boxes of `tokens` x `dims` elements: (B*H*R, D) for
    our row-major tensors (R = N, or N rounded up to quantize.TAIL_ROWS with zero rows: a tile past a head's
    end reads zeros; the kernels count rows by the head stride), (B*H*D, N) for a token-major view of
    (B, H, D, N16) storage (boxes then `dims` x `tokens`, read transposed by _tile; TMA fills zeros past N)."""
    B, H, N, D = x.shape
    if x.stride(2) == 1:  # token-major
        return descriptor(TensorDescriptor, x, (B * H * D, N), (x.stride(3), 1), (dims, tokens))
    return descriptor(TensorDescriptor, x, (B * H * (x.stride(1) // D), D), (D, 1), (tokens, dims))


def _tma_rows(t, varlen: bool) -> bool:
    """Whether _desc's row-major view covers t (B, H, N, D): rows of D contiguous elements, R rows per head, the
    heads one after another; and, on a dense batch, R the head's tiles rounded up to quantize.TAIL_ROWS (zeros
    past N, so a tile past a head's end never reads the next head). A varlen batch's tiles stay inside its
    sequences (plan.Seqs.whole_tiles)."""
    B, H, N, D = t.shape
    rows = t.stride(1) // max(D, 1)
    heads_in_order = B == 1 or t.stride(0) == H * rows * D
    return (t.stride(3) == 1 and t.stride(2) == D and t.stride(1) == rows * D and heads_in_order
            and (varlen or rows >= -(-N // TAIL_ROWS) * TAIL_ROWS))


def _s4(t):
    return t.stride() if t is not None else (0, 0, 0, 0)


def forward(q, k, v, *, causal, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, config, qk_transform=None,
            varlen=None):
    """reference.forward's results, by the Plan of the input (plan.py). qk_transform (fp8 only): outliers.fused_args'
    (r_q, r_k, k_means), applied to q and k by their quantization pass (the saved q8, k8 are those of q', k').
    varlen: the op's reading of cu_seqlens (hf_deltamatch._varlen)."""
    B, Hq, N, dqk = q.shape
    _, Hkv, M, dv = v.shape
    fp8 = config.precision == "fp8"
    T = config.block
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dqk)
    if qk_transform is not None and not fp8:
        raise ValueError("qk_transform is applied by the fp8 quantization pass; with precision='bf16' transform q and "
                         "k first (outliers.transform_qk).")
    r_q, r_k, k_means = qk_transform if qk_transform is not None else (None, None, None)
    qt, kt = dict(rotation=r_q), dict(rotation=r_k, means=k_means)
    if q.is_cuda and not INTERPRET:
        toolchain.warn_untested_triton()
    vl = _varlen_of(q, k, cu_seqlens_q, cu_seqlens_k, varlen)
    plan = P.select(P.case_of(q, k, v, causal=causal, window=window, config=config, varlen=vl))
    if P.log.isEnabledFor(logging.DEBUG):
        P.log_plan(plan, "forward")
    f, case, seqs = plan.forward, plan.case, plan.case.seqs
    cu_seqlens_q, cu_seqlens_k = (vl.cu_q, vl.cu_k) if vl is not None else (None, None)
    varlen, hopper = case.varlen, f.kernel == "gluon"
    seg = _quantize_segments(cu_seqlens_q, seqs.packing, T)
    qkw = dict(block=T, rounding=config.scale_rounding, max_len=seqs.max_n, cu_seqlens=cu_seqlens_q, segments=seg)
    kvw = dict(block=T, rounding=config.scale_rounding, max_len=seqs.max_m, cu_seqlens=cu_seqlens_k, segments=seg)
    if fp8 and f.layout == "packed":
        # a packed batch: quantized once into the packed tensors the backward keeps and into the padded layout
        # that the Gluon forward reads (segments.py; cu_seqlens_k is cu_seqlens_q there), its V token-major
        pw = dict(segments=seg, rounding=config.scale_rounding)
        (q8, sq), (q8p, _, sqp) = quantize_padded(q, **qt, **pw)
        (k8, sk), (k8p, _, skp) = quantize_padded(k, **kt, **pw)
        (v8, sv), (_, v8tp, svp) = quantize_padded(v, row_major=False, token_major=True, **pw)
    elif fp8:
        q8, _, sq = quantize(q, **qt, **qkw)
        k8, _, sk = quantize(k, **kt, **kvw)
        if f.layout == "ragged":  # V straight into the padded layout, token-major in k_order (N need not be a
            # multiple of 32); the saved v8 is the row-major copy's first N rows, as quantize() makes it
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
    if out.numel() == 0 or seqs.nseq == 0:
        if not varlen:
            lse.fill_(float("-inf"))
            out.zero_()
        return out, lse, q8, k8, v8, sq, sk, sv
    if hopper:
        from .fwd_hopper import fwd_hopper
        # a packed batch: its padded layout (segments.py); out and lse stay packed. Ragged: q8, k8 are in it already
        if f.layout == "packed":
            ops = (q8p, k8p, v8tp, sqp, skp, svp)
        elif f.layout == "ragged":
            ops = (_padded_view(q8), _padded_view(k8), v8t, pad(sq, seg, 1.0), pad(sk, seg, 1.0), svp)
        else:
            ops = (q8, k8, v8t, sq, sk, sv)
        fwd_hopper(*ops, out, lse, causal=causal, softmax_scale=softmax_scale, grid=f.grid, n_tiles=f.n_tiles,
                   head_group=f.head_group, segments=seg, window=case.window, **f.launch)
        return out, lse, q8, k8, v8, sq, sk, sv
    lc = f.launch
    tma, BLOCK_M = lc["tma"], lc["block_m"]
    bdqk, bdv = configs.pow2(dqk), configs.pow2(dv)
    if tma:  # 2-D views of the contiguous q8, k8 and token-major v8 storage (B, Hkv, Dv, M)
        qa, ka, va = _desc(q8, BLOCK_M, bdqk), _desc(k8, T, bdqk), _desc(v8t, T, bdv)
    dummy = lse
    _fwd_kernel[f.grid](
        qa, ka, va, sq if fp8 else dummy, sk if fp8 else dummy, sv if fp8 else dummy, out, lse,
        cu_seqlens_q, cu_seqlens_k,
        *_s4(q8 if tma else qa), *_s4(k8 if tma else ka), *_s4(v8t if tma else va), *out.stride(),
        Hq, Hkv, N, M, float(softmax_scale), int(window) if window is not None else 0, f.n_tiles, f.head_group,
        GROUPS=Hq // Hkv, DQK=dqk, DV=dv, BLOCK_M=BLOCK_M, BLOCK_N=T,
        BLOCK_DQK=bdqk, BLOCK_DV=bdv,
        CAUSAL=bool(causal), HAS_WINDOW=bool(causal) and window is not None, VARLEN=varlen, FP8=fp8,
        INTERP=INTERPRET, TMA=tma, ASM_SCALES=lc["asm_scales"],
        num_warps=lc["warps"], num_stages=lc["stages"], **_cap(lc),
    )
    return out, lse, q8, k8, v8, sq, sk, sv


def _cap(launch: dict) -> dict:
    return {"maxnreg": launch["maxnreg"]} if "maxnreg" in launch else {}


def _saved_layouts(q8, k8, v8, varlen: bool, padded: bool) -> tuple:
    """(the Gluon kernels read the saved q8, k8, v8: contiguous, or a ragged batch's heads padded as quantize()
    makes them (_padded_view); the Triton kernels' TMA descriptors cover k8 and v8 (_tma_rows))."""
    gluon = all(_tma_rows(t, False) if padded and not varlen else t.is_contiguous() for t in (q8, k8, v8))
    tma = all(_tma_rows(t, varlen) for t in (k8, v8))
    return gluon, tma


def backward(do, q, k, v, out, lse, q8, k8, v8, q_scale, k_scale, v_scale, *, causal, softmax_scale, window,
             cu_seqlens_q, cu_seqlens_k, config, return_row_sums: bool = False, return_delta: bool = False,
             varlen=None, dlse=None):
    """(dq, dk, dv), then the row sums if asked, then delta (B, Hq, N) fp32 if asked (reference.backward's), by the
    Plan of the input. dlse (a gradient of the LSE) is not taken: the op runs reference.backward for it."""
    if dlse is not None:
        raise ValueError("the Triton kernels take no LSE gradient (dlse); reference.backward folds it into dS")
    fp8 = config.precision == "fp8"
    stale = config.delta == "stale"
    T = config.block
    dtype = do.dtype
    qs, ks, vs = (q8, k8, v8) if fp8 else (q, k, v)
    B, Hq, N, dqk = qs.shape
    _, Hkv, M, dv = vs.shape
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(dqk)
    if stale and out is None:
        raise ValueError("delta='stale' needs the forward output.")
    vl = _varlen_of(qs, ks, cu_seqlens_q, cu_seqlens_k, varlen)
    saved = _saved_layouts(q8, k8, v8, vl is not None, vl is not None or N % ROW_ALIGN != 0) if fp8 else (True, True)
    plan = P.select(P.case_of(qs, ks, vs, causal=causal, window=window, config=config, varlen=vl,
                              row_sums=return_row_sums, saved_gluon=saved[0], saved_tma=saved[1]))
    if P.log.isEnabledFor(logging.DEBUG):
        P.log_plan(plan, "backward")
    b, case, seqs = plan.backward, plan.case, plan.case.seqs
    cu_seqlens_q, cu_seqlens_k = (vl.cu_q, vl.cu_k) if vl is not None else (None, None)
    varlen, nseq, max_n, max_m, packing = case.varlen, seqs.nseq, seqs.max_n, seqs.max_m, seqs.packing
    hopper, hopper_dq = b.dkdv == "gluon", b.dq == "gluon"
    lse2_in, p_shift, ds_scales = b.lse2, b.p_shift, b.ds_scales
    lse = lse.contiguous()
    dev = do.device
    # the dQ kernels write delta for every query row of a dense batch; a varlen one's rows outside every sequence
    # stay 0 (the Triton dK/dV kernel's tiles read them)
    delta = (torch.zeros if varlen else torch.empty)((B, Hq, N), dtype=torch.float32, device=dev)
    lse2 = torch.empty((B, Hq, N), dtype=torch.float32, device=dev) if lse2_in else delta  # written by dQ
    rs = torch.zeros((B, Hq, N), dtype=torch.float32, device=dev) if return_row_sums else delta
    ra = torch.zeros((B, Hq, N), dtype=torch.float32, device=dev) if return_row_sums else delta
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

    def _ret(delta=delta):
        return (dq, dk, dv_, *((rs, ra) if return_row_sums else ()), *((delta,) if return_delta else ()))

    if B * Hq == 0 or nseq == 0 or (N == 0 and M == 0):
        return _ret(delta.zero_())
    if b.padded:
        seg = _layout(cu_seqlens_q, packing) if varlen else _dense_layout(N, dev)
        delta_p = _backward_padded(do, q8, k8, v8, q_scale, k_scale, v_scale, lse, dq, dk, dv_, seg, b,
                                   softmax_scale=softmax_scale, config=config, dense=not varlen,
                                   causal=bool(causal), window=case.window)
        if return_delta:
            _unpad_rows(delta_p, seg, delta)
        return _ret()
    # one scale per dS tile (DS_TILE_Q queries x T keys), written by the dQ kernel for the dK/dV kernel; rows per
    # head: backward._dss_row's bound N // DS_TILE_Q + nseq. Ones: a tile the dQ kernel skips is all masked, and 1
    # is what tile_scale gives an all-zero tile.
    dss_tq, dss_tk = b.dss_shape
    dss = torch.ones((B * Hq, dss_tq, dss_tk), dtype=torch.float32, device=dev) if ds_scales else delta
    # Token-major copies are made right before the kernel that reads them and dropped after it (k8t for the dQ
    # kernel, q8t for the dK/dV kernel), but for dO8's, written by dO's quantization pass: at most two 1-byte
    # copies are alive at once.
    k8t = q8t = do8t = None
    if fp8:
        do8, do8t, sdo = quantize(do, T, config.grad_format, config.scale_rounding, cu_seqlens_q, max_n,
                                  transposed=M > 0 and max_m > 0, k_order=hopper,
                                  segments=_quantize_segments(cu_seqlens_q, packing, T))
        sq, sk, sv = q_scale, k_scale, v_scale
        doa = do8
    else:
        doa = do
        sq = sk = sv = sdo = delta  # unused
    bdqk, bdv = configs.pow2(dqk), configs.pow2(dv)
    common = dict(DQK=dqk, BLOCK_DQK=bdqk, BLOCK_DV=bdv,
                  CAUSAL=bool(causal), HAS_WINDOW=bool(causal) and window is not None, VARLEN=varlen, FP8=fp8,
                  FMAX=FP8_MAX[config.grad_format], E5M2=config.grad_format == "e5m2",
                  POW2=config.scale_rounding == "pow2", INTERP=INTERPRET)
    win = int(window) if window is not None else 0
    dql, kvl = b.dq_launch, b.dkdv_launch
    if N > 0 and max_n > 0:
        ka, kta, va = ks, ks, vs
        if fp8:
            k8t = kta = token_major(k8, k_order=hopper_dq)  # the Gluon kernels' B operands: fp8_operand
        grid, n_tiles, head_group = b.dq_grid
        if hopper_dq:
            from .dq_hopper import dq_hopper
            dq_hopper(q8, k8, k8t, v8, do8, sq, sk, sv, sdo, lse, dq, delta, lse2, dss, rs, ra, causal=causal,
                      softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, grid=grid, n_tiles=n_tiles,
                      head_group=head_group, scale_after_sum=b.scale_after_sum, fmax=FP8_MAX["e4m3"],
                      pow2=config.scale_rounding == "pow2", row_sums=return_row_sums, window=case.window, **dql)
        else:
            dq_m, dq_tma = dql["block_m"], dql["tma"]
            if dq_tma:  # 2-D views: k8 and v8 (B*Hkv*M, D), k8 token-major (B*Hkv*Dqk, M)
                ka, kta, va = _desc(k8, T, bdqk), _desc(k8t, T, bdqk), _desc(v8, T, bdv)
            o_arg = out if stale else do
            _bwd_dq_kernel[grid](
                qs, ka, kta, va, doa, sq, sk, sv, sdo, lse, do, o_arg, dq, delta, lse2, rs, ra, dss,
                cu_seqlens_q, cu_seqlens_k,
                *qs.stride(), *ks.stride(), *_s4(k8t if k8t is not None else ks), *vs.stride(), *doa.stride(),
                *do.stride(),
                *o_arg.stride(), *dq.stride(),
                Hq, Hkv, N, M, float(softmax_scale), win, n_tiles, head_group, dss_tq, dss_tk,
                GROUPS=Hq // Hkv, DV=dv, BLOCK_M=dq_m, BLOCK_N=T, STALE=stale, ROW_SUMS=return_row_sums,
                DS_Q=DS_TILE_Q, ONE_TILE=dq_m == DS_TILE_Q, TMA=dq_tma, ASM_SCALES=dql["asm_scales"],
                SCALE_AFTER_SUM=b.scale_after_sum, LSE2_OUT=lse2_in,
                P_SHIFT=p_shift, DSS_OUT=ds_scales, num_warps=dql["warps"], num_stages=dql["stages"], **common,
                **_cap(dql),
            )
    k8t = ka = kta = va = None  # noqa: F841  (freed before the dK/dV kernel's copies are made)
    if M > 0 and max_m > 0:
        qt, dot = qs, doa
        if fp8:
            q8t = qt = token_major(q8, k_order=hopper)
            dot = do8t
        grid, n_tiles, head_group = b.dkdv_grid
        if hopper:
            from .dkdv_hopper import dkdv_hopper
            dkdv_hopper(q8, q8t, k8, v8, do8, do8t, sq, sk, sv, sdo, lse2, delta, dss, dk, dv_, causal=causal,
                        softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, grid=grid, n_tiles=n_tiles,
                        head_group=head_group, window=case.window, **kvl)
            return _ret()
        for part in kvl["parts"]:
            _bwd_dkdv_kernel[grid](
                qs, qt, ks, vs, doa, dot,
                sq, sk, sv, sdo, lse2 if lse2_in else lse, delta, dss, dk, dv_, cu_seqlens_q, cu_seqlens_k,
                *qs.stride(), *_s4(q8t if fp8 else qs), *ks.stride(),
                *vs.stride(), *doa.stride(), *_s4(do8t if fp8 else doa), *dk.stride(), *dv_.stride(),
                Hq, Hkv, N, M, float(softmax_scale), win, n_tiles, head_group, dss_tq, dss_tk,
                # a dS quantization tile is DS_TILE_Q queries x the block's keys (the contract): a key tile smaller
                # than the block (kv_n) reads the tile's scale from the dQ kernel (configs.dkdv_block_n)
                GROUPS=Hq // Hkv, DV_=dv, BLOCK_M=DS_TILE_Q, BLOCK_N=b.kv_n, DS_K=T,
                ASM_SCALES=kvl["asm_scales"], LSE2_IN=lse2_in, P_SHIFT=p_shift, PART=part,
                DSS_IN=ds_scales,
                num_warps=kvl["warps"], num_stages=kvl["stages"], **common, **_cap(kvl),
            )
    return _ret()


def _unpad_rows(x, seg, out):
    """A row array (B, H, seg.npad) of the padded layout back to the packed rows of out (B, H, N), in place:
    segments.pad's inverse (the token of each padded row, as padded_layout maps them; other rows untouched)."""
    tokens = torch.arange(seg.first, seg.last, device=x.device, dtype=torch.int32)
    s = torch.searchsorted(seg.cu[1:], tokens, right=True)
    out[:, :, seg.first:seg.last] = x.index_select(2, (seg.pcu[s] + tokens - seg.cu[s]).long())
    return out


def _backward_padded(do, q8, k8, v8, sq, sk, sv, lse, dq, dk, dv, seg, b, *, softmax_scale, config, dense=False,
                     causal=True, window=None):
    """The backward of a packed batch (causal), or of a ragged dense one (`dense`: seg is its _dense_layout; causal
    or not), through the Gluon kernels (the plan `b` chose them): every input copied into seg's padded layout
    (segments.py: LSE padded with -inf, so a padded row's P is 0; dO quantized straight into it) but a dense batch's
    q8, k8, v8, which are in it already (_padded_view); dq, dk, dv written to their packed rows. LSE2, delta and the
    dS scales stay in the padded layout between the two kernels. window: a causal sliding window."""
    from .dkdv_hopper import dkdv_hopper
    from .dq_hopper import dq_hopper
    B, Hq = q8.shape[:2]
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
    dss_tq, dss_tk = b.dss_shape
    dss = torch.ones((B * Hq, dss_tq, dss_tk), **rows)
    common = dict(causal=causal, softmax_scale=softmax_scale, dss_tq=dss_tq, dss_tk=dss_tk, segments=seg, window=window)
    grid, n_tiles, head_group = b.dq_grid
    dq_hopper(q8, k8, k8t, v8, do8, sq, sk, sv, sdo, lse, dq, delta, lse2, dss, delta, delta, grid=grid,
              n_tiles=n_tiles, head_group=head_group, scale_after_sum=b.scale_after_sum, fmax=FP8_MAX["e4m3"],
              pow2=config.scale_rounding == "pow2", row_sums=False, **common, **b.dq_launch)
    del k8t
    q8t = token_major(q8_, k_order=True, src=seg.src)
    grid, n_tiles, head_group = b.dkdv_grid
    dkdv_hopper(q8, q8t, k8, v8, do8, do8t, sq, sk, sv, sdo, lse2, delta, dss, dk, dv, grid=grid, n_tiles=n_tiles,
                head_group=head_group, **common, **b.dkdv_launch)
    return delta  # padded, as the kernels used it
