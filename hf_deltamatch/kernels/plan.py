"""Which kernels run for an input, and how they launch: a Case of host-visible facts -> select(case) -> Plan.

A Case holds everything the choice depends on: shapes, dtypes and the config, the sequences' layout (host integers
read once per batch: hf_deltamatch._varlen), the device and the toolchain (toolchain.py), never a tensor's values.
select() is cached per Case, so a layer's call after the first finds its Plan: the kernels, their layouts, launch
configurations and grids, and why not the Gluon kernels where they do not run, decided by the same code that gives
the reason. ops.forward and ops.backward execute a Plan; nothing else chooses a kernel.

  hf-deltamatch plan --shape 2,16,8192,128 [--hkv 4] [--full] [--window 1024] [--packed 3000,5192]
                     [--precision bf16] [--delta stale] [--here]
prints the Plan for a shape, as on an H200 with Triton 3.6 (and its CUDA 12 ptxas) unless --here (this machine).

An A/B run pins a choice (pinned(fwd_kernel="triton"), PINS): the kernels (fwd_kernel, dq_kernel, dkdv_kernel:
"gluon" or "triton"), the Gluon dK/dV kernel's loop variants (dkdv_pairs, dkdv_peel, dkdv_pipe) and the Triton
kernels' TMA reads (fwd_tma, dq_tma) and LSE2 / P * 256 (lse2, p256); a pin the input cannot take raises.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from typing import NamedTuple

from . import configs as C
from . import toolchain

DS_TILE_Q = 64  # query rows per dS quantization tile (hf_deltamatch.reference.DS_TILE_Q)

# Decide as on an H200 (sm_90, whatever the tensors' device) for tools that record launches on a CPU
# (benchmarks/launch_trace.py, benchmarks/sm90_registers.py); never set in normal use.
SIMULATE_SM90 = False

PINS: dict = {}
PIN_CHOICES = {"fwd_kernel": ("gluon", "triton"), "dq_kernel": ("gluon", "triton"),
               "dkdv_kernel": ("gluon", "triton"), "dkdv_pairs": (True, False), "dkdv_peel": (True, False),
               "dkdv_pipe": (True, False),
               "fwd_tma": (True, False), "dq_tma": (True, False), "lse2": (True, False), "p256": (True, False)}


def check_pins(pins: dict) -> None:
    for key, value in pins.items():
        if key not in PIN_CHOICES:
            raise KeyError(f"unknown plan pin {key!r}; known: {sorted(PIN_CHOICES)}")
        if value not in PIN_CHOICES[key]:
            raise ValueError(f"plan pin {key}={value!r}: choose one of {PIN_CHOICES[key]}")


@contextlib.contextmanager
def pinned(**choices):
    """Pin plan choices for the calls inside (PIN_CHOICES); the previous pins come back after."""
    check_pins(choices)
    saved = dict(PINS)
    PINS.update(choices)
    try:
        yield
    finally:
        PINS.clear()
        PINS.update(saved)


@contextlib.contextmanager
def variant(settings: dict):
    """Run the calls inside with `settings`, plan pins (PIN_CHOICES) and kernels.TUNE launch shapes
    (configs.TUNE_KEYS) in one dict, as the benchmarks' --variants give them; both come back after."""
    settings = dict(settings)
    unknown = set(settings) - set(PIN_CHOICES) - C.TUNE_KEYS
    if unknown:
        raise KeyError(f"unknown variant keys {sorted(unknown)}; plan pins: {sorted(PIN_CHOICES)}, launch shapes "
                       f"(kernels.TUNE): {sorted(C.TUNE_KEYS)}")
    saved = dict(C.TUNE)
    C.TUNE.update({k: v for k, v in settings.items() if k in C.TUNE_KEYS})
    try:
        with pinned(**{k: v for k, v in settings.items() if k in PIN_CHOICES}):
            yield
    finally:
        C.TUNE.clear()
        C.TUNE.update(saved)


log = logging.getLogger("hf_deltamatch")


# ----------------------------------------------------------------------------------------------------
# The Case
# ----------------------------------------------------------------------------------------------------


class Seqs(NamedTuple):
    """A batch's sequences as the launches need them: a dense batch is one sequence per (batch row, head)."""

    nseq: int
    max_n: int
    max_m: int
    aligned: bool  # every sequence starts at a multiple of 16 tokens (TMA reads of token-major tiles)
    packing: tuple | None  # the same query and key sequences: (first token, end token, rows of the padded layout)
    rems: tuple  # the longest query / key sequence modulo 64 and 128: (rq64, rk64, rq128, rk128)

    def whole_tiles(self, queries: int = 0, keys: int = 0) -> bool:
        """Every query sequence whole `queries`-token tiles and every key sequence whole `keys`-token ones (0:
        either): on a varlen batch a TMA tile past a sequence's end would read the next sequence's tokens, where a
        NaN reaches the MMAs as 0 x NaN (docs/numerics.md, "Non-finite inputs")."""
        rq, rk = {64: self.rems[0], 128: self.rems[2]}, {64: self.rems[1], 128: self.rems[3]}
        return (not queries or rq[queries] == 0) and (not keys or rk[keys] == 0)


def dense_seqs(n: int, m: int) -> Seqs:
    return Seqs(1, n, m, True, None, (n % 64, m % 64, n % 128, m % 128))


def varlen_seqs(varlen) -> Seqs:
    """The Seqs of a packed batch from its bounds (hf_deltamatch._varlen.Varlen: host integers, no device read)."""
    return _varlen_seqs(varlen.bounds_q, varlen.bounds_k, varlen.same)


@functools.lru_cache(maxsize=64)
def _varlen_seqs(bq: tuple, bk: tuple, same: bool) -> Seqs:
    if len(bq) < 2:
        return Seqs(0, 0, 0, True, None, (0, 0, 0, 0))
    lq = [b - a for a, b in zip(bq, bq[1:])]
    lk = [b - a for a, b in zip(bk, bk[1:])]
    aligned = all(x % 16 == 0 for x in bq[:-1]) and all(x % 16 == 0 for x in bk[:-1])
    npad = sum(-(-x // C.ROW_ALIGN) * C.ROW_ALIGN for x in lq)
    rems = (max(x % 64 for x in lq), max(x % 64 for x in lk), max(x % 128 for x in lq), max(x % 128 for x in lk))
    return Seqs(len(bq) - 1, max(lq), max(lk), aligned, (bq[0], bq[-1], npad) if same else None, rems)


@dataclasses.dataclass(frozen=True)
class Case:
    """What the choice of kernels and launches depends on (hashable: select's cache key)."""

    fp8: bool
    e4m3: bool  # dO and dS in e4m3 (else e5m2)
    pow2: bool  # power-of-two scales
    stale: bool  # delta="stale"
    block: int
    dqk: int
    dv: int
    batch: int
    hq: int
    hkv: int
    n: int
    m: int
    causal: bool
    window: int | None  # a causal sliding window (None under the full mask)
    varlen: bool
    seqs: Seqs
    device: str  # "cuda", "cpu", ...
    capability: tuple | None  # the CUDA device's compute capability
    interpret: bool  # TRITON_INTERPRET=1: the Triton kernels in the interpreter, no Gluon
    toolchain: toolchain.Toolchain
    row_sums: bool = False  # the backward also returns the invariant's row sums (diagnostics)
    saved_gluon: bool = True  # the saved q8, k8, v8 are in the layout the Gluon kernels read (quantize's)
    saved_tma: bool = True  # ... and k8, v8 in the one the Triton kernels' TMA descriptors cover
    pins: tuple = ()
    tune: tuple = ()

    @property
    def d(self) -> int:
        return max(self.dqk, self.dv)

    @property
    def groups(self) -> int:
        return self.hq // self.hkv

    @property
    def packed(self) -> bool:
        """A varlen batch the Gluon kernels take padded: the same query and key sequences, with a token, one batch
        row, causal."""
        p = self.seqs.packing
        return self.varlen and p is not None and p[2] > 0 and self.batch == 1 and self.causal

    @property
    def ragged(self) -> bool:
        """A dense batch of N not a multiple of 128 (the Gluon kernels take it in the packed batches' layout)."""
        return not self.varlen and self.n % C.ROW_ALIGN != 0


def case_of(q, k, v, *, causal, window, config, varlen=None, row_sums: bool = False, saved_gluon: bool = True,
            saved_tma: bool = True) -> Case:
    """The Case of a call: q (B, Hq, N, Dqk), k (B, Hkv, M, Dqk), v (B, Hkv, M, Dv) or their fp8 copies (shapes and
    device only); varlen: a packed batch's hf_deltamatch._varlen.Varlen, None for a dense one."""
    from ._fp8 import INTERPRET

    B, hq, n, dqk = q.shape
    hkv, m, dv = k.shape[1], k.shape[2], v.shape[3]
    device, capability = _device(q.device)
    seqs = dense_seqs(n, m) if varlen is None else varlen_seqs(varlen)
    return Case(config.precision == "fp8", config.grad_format == "e4m3", config.scale_rounding == "pow2",
                config.delta == "stale", config.block, dqk, dv, B, hq, hkv, n, m, bool(causal),
                int(window) if causal and window is not None else None, varlen is not None, seqs, device,
                capability, INTERPRET and not SIMULATE_SM90, toolchain.current(), row_sums, saved_gluon, saved_tma,
                tuple(sorted(PINS.items())), C.tune_key())


def _device(device) -> tuple:
    if SIMULATE_SM90:
        return "cuda", (9, 0)
    if device.type != "cuda":
        return device.type, None
    return "cuda", _capability(device.index)


@functools.lru_cache(maxsize=None)
def _capability(index):
    import torch

    return tuple(torch.cuda.get_device_capability(index))


# ----------------------------------------------------------------------------------------------------
# The Plan
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Forward:
    kernel: str  # "gluon" | "triton"
    layout: str  # "dense", "ragged" (Gluon: a dense batch in the padded layout), "packed" (Gluon), "varlen" (Triton)
    why_not_gluon: str | None
    grid: tuple
    n_tiles: int
    head_group: int
    launch: dict  # the kernel's launch options (Triton: block_m, warps, stages, tma, asm_scales, maxnreg; Gluon: its)


@dataclasses.dataclass(frozen=True)
class Backward:
    dq: str  # "gluon" | "triton"
    dkdv: str
    padded: bool  # both Gluon kernels on the padded layout (packed and ragged batches)
    why_not_gluon: str | None
    lse2: bool  # the dQ kernel writes LSE2 for the dK/dV kernel
    p_shift: int  # the dK/dV kernel's exp2 yields P * 2^p_shift
    ds_scales: bool  # the dQ kernel writes each dS tile's scale for the dK/dV kernel
    dss_shape: tuple  # (tiles of 64 queries, tiles of `block` keys) per (batch, head) of those scales
    kv_n: int  # keys per Triton dK/dV program
    scale_after_sum: bool
    dq_grid: tuple
    dkdv_grid: tuple
    dq_launch: dict
    dkdv_launch: dict


@dataclasses.dataclass(frozen=True)
class Plan:
    case: Case
    forward: Forward
    backward: Backward


@functools.lru_cache(maxsize=512)
def select(case: Case) -> Plan:
    """The Plan of a Case (cached: selection reads no tensor, synchronizes nothing, allocates nothing)."""
    C.check_tune()
    check_pins(dict(case.pins))
    return Plan(case, _forward(case), _backward(case))


def _pin(case: Case, key: str, default):
    return dict(case.pins).get(key, default)


def gluon_why_not(case: Case, kernel: str, lse2: bool = True, p_shift: int = 8) -> str | None:
    """None where `kernel` ("forward", "dq", "dkdv") of the Gluon kernels takes the input, else why not (one phrase,
    without lengths: the dispatch log keys on it, one line per kind of input). The Triton release is asked last, so
    that its warning comes only for inputs the Gluon kernels would otherwise take."""
    if case.interpret:
        return "TRITON_INTERPRET=1 (Gluon has no interpreter)"
    if not case.fp8:
        return "precision='bf16'"
    if kernel != "forward" and not case.e4m3:
        return "e5m2 gradients"
    dims = f"head dims Dqk={case.dqk}, Dv={case.dv}"
    if case.dqk != case.dv or case.dqk not in C.GLUON_HEAD_DIMS:
        if (case.dqk, case.dv) not in C.GLUON_WIDE_DIMS:
            return f"{dims} (Dqk = Dv in 64, 128 only)"
        if case.varlen:
            return f"a varlen batch at {dims} (dense batches only there)"
        if case.window is not None:
            return f"a sliding window at {dims} (none there)"
        if case.n % 128:
            return f"N not a multiple of 128 at {dims} (whole 128-token tiles only there)"
    if case.block != 128:
        return f"block={case.block} (128 only)"
    if case.varlen and not case.packed:
        return "a varlen batch other than causal self-attention in one batch row (cu_seqlens_q = cu_seqlens_k)"
    if not case.varlen and (case.n != case.m or case.n == 0):
        return "N != M or N = 0 (N = M > 0 only)"
    if kernel != "forward" and not (lse2 and p_shift == 8):
        return "the dK/dV kernel's LSE2 or P * 256 pinned off"
    if case.device != "cuda":
        return f"device {case.device}"
    if case.capability != (9, 0):
        return f"compute capability {case.capability[0]}.{case.capability[1]} (sm_90 only)"
    if not case.toolchain.gluon:
        if case.toolchain.release is None and not case.toolchain.gluon:
            toolchain.warn_untested_gluon()
        return (f"Triton {case.toolchain.version} (tested: {toolchain.tested_text()}; {toolchain.GLUON_ENV}=1 "
                "overrides)")
    return None


def _choose(case: Case, key: str, why: str | None) -> tuple:
    """(kernel, why not Gluon) of a pass, with its pin: "gluon" where the input cannot take it raises."""
    want = _pin(case, key, None)
    if want == "gluon" and why is not None:
        raise ValueError(f"plan pinned {key}='gluon', but the Gluon kernel does not take this input: {why}")
    if want == "triton":
        return "triton", f"pinned {key}='triton'"
    return ("gluon", None) if why is None else ("triton", why)


def _forward(case: Case) -> Forward:
    s = case.seqs
    kernel, why = _choose(case, "fwd_kernel", gluon_why_not(case, "forward"))
    if kernel == "gluon":
        cfg = C.fwd_hopper(case.dv)
        grid = C.grid("fwd", _blocks(s.max_n if case.varlen else case.n, cfg["warpgroups"]), case.batch * case.hq,
                      s.nseq, case.causal)
        layout = "packed" if case.varlen else "ragged" if case.ragged else "dense"
        return Forward("gluon", layout, None, *grid, cfg)
    tma = _pin(case, "fwd_tma", None)
    aligned = s.aligned and (not case.varlen or s.whole_tiles(keys=case.block))
    tma = C.use_tma("fwd", case.fp8, case.dqk, case.dv, aligned) if tma is None else \
        tma and case.fp8 and case.d <= 128 and aligned
    block_m, warps, stages = C.fwd_launch(case.dqk, case.dv, case.fp8)
    grid = C.grid("fwd", math.ceil(max(s.max_n, 1) / block_m), case.batch * case.hq, s.nseq, case.causal)
    launch = dict(block_m=block_m, warps=warps, stages=stages, tma=tma,
                  asm_scales=C.asm_scales("fwd", case.d, True, case.interpret), **C.maxnreg("fwd"))
    return Forward("triton", "varlen" if case.varlen else "dense", why, *grid, launch)


def _backward(case: Case) -> Backward:
    s, d = case.seqs, case.d
    lse2 = bool(_pin(case, "lse2", d in C.DKDV_LSE2_HEAD_DIMS))
    p_shift = 8 if case.fp8 and _pin(case, "p256", d in C.DKDV_P256_HEAD_DIMS) else 0
    padded = case.varlen or case.n % C.ROW_ALIGN != 0
    saved = case.fp8 and case.saved_gluon
    why_dkdv = gluon_why_not(case, "dkdv", lse2, p_shift)
    why_dq = gluon_why_not(case, "dq", lse2, p_shift)
    if why_dkdv is None and not saved:
        why_dkdv = "the saved q8, k8, v8 are not the kernels' layout (quantize's: contiguous, heads padded to 128 rows)"
    if why_dq is None and not saved:
        why_dq = why_dkdv
    if why_dq is None and case.stale:
        why_dq = "delta='stale' (the Gluon dQ kernel computes the matching delta)"
    dkdv, why_dkdv = _choose(case, "dkdv_kernel", why_dkdv)
    dq, why_dq = _choose(case, "dq_kernel", why_dq)
    if padded and not (dq == dkdv == "gluon" and not case.row_sums):
        # padded, the two kernels hand each other padded rows: both or neither; and not with the invariant's row sums
        # (the dQ kernel would write them padded)
        if dq == dkdv == "gluon":
            why_dq = why_dkdv = "the invariant's row sums asked (return_row_sums)"
        elif "gluon" in (dq, dkdv):
            if "gluon" in (_pin(case, "dq_kernel", None), _pin(case, "dkdv_kernel", None)):
                raise ValueError("plan pins: on a packed or ragged batch the two Gluon backward kernels run together "
                                 "or not at all")
        why_dq = why_dq or why_dkdv
        why_dkdv = why_dkdv or why_dq
        dq = dkdv = "triton"
    why = None if dq == dkdv == "gluon" else (why_dkdv or why_dq)
    gluon_padded = padded and dkdv == "gluon"
    ds_scales = (C.dkdv_ds_scales(d, case.fp8, case.groups > 1) or "gluon" in (dq, dkdv)) and case.n > 0 \
        and case.m > 0
    kv_n = C.dkdv_block_n(case.block, d, ds_scales)
    if gluon_padded:
        npad = s.packing[2] if case.varlen else -(-case.n // C.ROW_ALIGN) * C.ROW_ALIGN
        dss_shape = (npad // DS_TILE_Q, npad // case.block)
    elif ds_scales:
        dss_shape = (case.n // DS_TILE_Q + s.nseq, math.ceil(s.max_m / case.block))
    else:
        dss_shape = (0, 0)
    heads_q, heads_kv = case.batch * case.hq, case.batch * case.hkv
    window = case.window is not None
    if dq == "gluon":
        dq_launch = C.dq_hopper(d, case.causal, padded)
        rows = s.max_n if padded else case.n
        dq_grid = C.grid("dq", _blocks(rows, C.DQ_HOPPER_WARPGROUPS), heads_q, s.nseq, case.causal)
    if dkdv == "gluon":
        dkdv_launch = C.dkdv_hopper(d, causal=case.causal, groups=case.groups, padded=padded, window=window,
                                    pins=dict(case.pins))
        rows = s.max_n if padded else case.m
        dkdv_grid = C.grid("dkdv", _blocks(rows, dkdv_launch["warpgroups"]), heads_kv, s.nseq, case.causal)
    dq_m, dq_w, dq_s, kv_w, kv_s = C.bwd_launch(case.dqk, case.dv, case.fp8, kv_n, case.block)
    if dq == "triton":
        aligned = s.aligned and case.fp8 and case.saved_tma and (not case.varlen or s.whole_tiles(keys=case.block))
        tma = _pin(case, "dq_tma", None)
        tma = C.use_tma("dq", case.fp8, case.dqk, case.dv, aligned) if tma is None else \
            tma and case.fp8 and d <= 128 and aligned
        dq_launch = dict(block_m=dq_m, warps=dq_w, stages=dq_s, tma=tma,
                         asm_scales=C.asm_scales("dq", d, True, case.interpret), **C.maxnreg("dq"))
        dq_grid = C.grid("dq", math.ceil(s.max_n / dq_m) if s.max_n else 0, heads_q, s.nseq, case.causal)
    if dkdv == "triton":
        dkdv_launch = dict(warps=kv_w, stages=kv_s, parts=C.dkdv_parts(d),
                           asm_scales=C.asm_scales("dkdv", d, case.causal, case.interpret), **C.maxnreg("dkdv"))
        dkdv_grid = C.grid("dkdv", math.ceil(s.max_m / kv_n) if s.max_m else 0, heads_kv, s.nseq, case.causal)
    return Backward(dq, dkdv, gluon_padded, why, lse2, p_shift, ds_scales, dss_shape, kv_n,
                    d in C.SCALE_AFTER_SUM_HEAD_DIMS, dq_grid, dkdv_grid, dq_launch, dkdv_launch)


def _blocks(n: int, warpgroups: int) -> int:
    """A Gluon kernel's programs over n rows (queries or keys): 64 per MMA warpgroup."""
    return math.ceil(max(n, 1) / (64 * warpgroups))


# ----------------------------------------------------------------------------------------------------
# What a plan says: the dispatch log and the CLI
# ----------------------------------------------------------------------------------------------------


def case_text(case: Case) -> str:
    """An input as the choice sees it, the sequence length only as whether it is a multiple of 128 (the dispatch log
    writes a few lines per run, not one per length)."""
    if case.varlen:
        layout = "a packed causal batch" if case.packed else "a varlen batch"
    elif case.n != case.m:
        layout = "a dense batch, N != M"
    else:
        layout = f"a dense batch, N = M {'a' if case.n % 128 == 0 else 'not a'} multiple of 128"
    mask = ("causal" + (" + window" if case.window is not None else "")) if case.causal else "full mask"
    return f"{'fp8' if case.fp8 else 'bf16'} D={case.dqk}/{case.dv}, {mask}, {layout}"


_LOGGED: set = set()


def log_plan(plan: Plan, step: str) -> None:
    """One DEBUG line per distinct (step, kernels, input, reason) on the "hf_deltamatch" logger (the caller checks
    log.isEnabledFor(DEBUG): nothing is recorded while it is off, so turning it on later still logs every case)."""
    if step == "forward":
        kernels, why = plan.forward.kernel.capitalize() if plan.forward.kernel == "triton" else "Gluon", \
            plan.forward.why_not_gluon
    else:
        b = plan.backward
        kernels = f"dQ {_name(b.dq)}, dK/dV {_name(b.dkdv)}"
        why = b.why_not_gluon
    key = (step, kernels, case_text(plan.case), why)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    log.debug("kernels %s: %s for %s%s", step, kernels, key[2], f" (not Gluon: {why})" if why else "")


def _name(kernel: str) -> str:
    return "Gluon" if kernel == "gluon" else "Triton"


def describe(plan: Plan) -> str:
    """The plan in a few lines (the CLI's output)."""
    f, b = plan.forward, plan.backward
    lines = [f"input: {case_text(plan.case)} (B={plan.case.batch}, Hq={plan.case.hq}, Hkv={plan.case.hkv}, "
             f"N={plan.case.n}, M={plan.case.m}, block {plan.case.block}, Triton {plan.case.toolchain.version})",
             f"forward: {_name(f.kernel)}, {f.layout} layout, {_grid((f.grid, f.n_tiles, f.head_group))}, {f.launch}"]
    if f.why_not_gluon:
        lines.append(f"  not Gluon: {f.why_not_gluon}")
    lines.append(f"backward: dQ {_name(b.dq)} ({_grid(b.dq_grid)}, {b.dq_launch}), dK/dV {_name(b.dkdv)} "
                 f"({_grid(b.dkdv_grid)}, {b.dkdv_launch}){', padded layout' if b.padded else ''}")
    lines.append(f"  LSE2 {b.lse2}, P * 2^{b.p_shift}, dS tile scales {b.ds_scales} {b.dss_shape}, "
                 f"dK/dV keys per program {b.kv_n}")
    if b.why_not_gluon:
        lines.append(f"  not Gluon: {b.why_not_gluon}")
    return "\n".join(lines)


def _grid(g: tuple) -> str:
    grid, tiles, group = g
    return f"grid {grid} ({tiles} tiles per head, heads in groups of {group})"


def main(argv=None) -> int:
    import argparse

    import torch

    from ..config import DeltaMatchConfig

    p = argparse.ArgumentParser(prog="hf-deltamatch plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, help="B,Hq,N,D (D = Dqk = Dv unless --dv)")
    p.add_argument("--hkv", type=int, help="KV heads (default Hq)")
    p.add_argument("--dv", type=int)
    p.add_argument("--m", type=int, help="keys per sequence (default N)")
    p.add_argument("--full", action="store_true", help="the full mask (default causal)")
    p.add_argument("--window", type=int)
    p.add_argument("--packed", help="packed sequence lengths, comma-separated (B must be 1; they sum to N)")
    p.add_argument("--precision", default="fp8", choices=["fp8", "bf16"])
    p.add_argument("--delta", default="matching", choices=["matching", "stale"])
    p.add_argument("--grad-format", default="e4m3", choices=["e4m3", "e5m2"])
    p.add_argument("--block", type=int, default=128, choices=[64, 128])
    p.add_argument("--here", action="store_true", help="this machine's device and Triton (default: an H200)")
    args = p.parse_args(argv)
    B, hq, n, d = (int(x) for x in args.shape.split(","))
    meta = torch.device("meta")
    q = torch.empty(B, hq, n, d, device=meta)
    k = torch.empty(B, args.hkv or hq, args.m or n, d, device=meta)
    v = torch.empty(B, args.hkv or hq, args.m or n, args.dv or d, device=meta)
    config = DeltaMatchConfig(precision=args.precision, delta=args.delta, grad_format=args.grad_format,
                              block=args.block)
    varlen = None
    if args.packed:
        from .._varlen import Varlen

        lengths = [int(x) for x in args.packed.split(",")]
        if B != 1 or sum(lengths) != n:
            raise SystemExit("--packed: B must be 1 and the lengths must sum to N")
        bounds = tuple([0] + [sum(lengths[:i + 1]) for i in range(len(lengths))])
        cu = torch.tensor(bounds, dtype=torch.int32, device=meta)
        varlen = Varlen(cu, cu, bounds, bounds, True)
    global SIMULATE_SM90
    saved = SIMULATE_SM90, toolchain.current, toolchain.sm90_ptxas_major
    if not args.here:
        SIMULATE_SM90 = True
        toolchain.current = lambda: toolchain._toolchain("3.6.0", "")
        toolchain.sm90_ptxas_major = lambda: 12  # Triton 3.6's ptxas (CUDA 12.8)
    try:
        case = case_of(q, k, v, causal=not args.full, window=args.window, config=config, varlen=varlen)
        print(describe(select(case)))
    finally:
        SIMULATE_SM90, toolchain.current, toolchain.sm90_ptxas_major = saved
        select.cache_clear()
    return 0
