#!/usr/bin/env python
"""Registers and spills of the kernels compiled for sm_90 (H100/H200), on any machine: no GPU needed.

  python benchmarks/sm90_registers.py [--kernels fwd,dq,dkdv] [--d 128] [--variants "{'fwd': (128, 4, 3)}"] [--loops]
  python benchmarks/sm90_registers.py --kernels quantize,quantize_rotate,quantize_center,quantize_both,center_rotate
                                      # the q/k quantization pass without / with the fused outlier transforms

Compiles with `triton.compile` for target cuda:90 and reads the cubin's resource usage with the cuobjdump that
ships inside triton. Spills are the first thing to look at before spending GPU time on a launch config: a
config that spills hundreds of bytes per thread ran 2-3x slower on the H200 (docs/kernels.md). Pointer
and stride arguments are marked divisible by 16, as the launcher does for our tensors; without it loads
compile to byte accesses and nothing pipelines.

--hash FILE records, for every default plan of the package (launch_trace.cases(): Triton and Gluon forward, dQ and
dK/dV; D 64, 128, 256 and MLA's 192/128; causal, full and windowed masks; GQA; dense N = 8192 and N = 8000 (ragged:
the Gluon kernels' padded variant); packed and other varlen batches; fp8 and bf16; e5m2 gradients; block 64;
matching and stale delta), and after them the Triton kernels pinned where the Gluon ones are the default (cases named
*-triton*), the kernels ops.forward and ops.backward launch and a hash of each one's sm_90 SASS, one line per (case,
kernel): a refactor of the kernels or of plan.py that leaves every default alone leaves the hashes unchanged (compare
the first six columns, `cut -d' ' -f1-6`; the constexprs after them name the kernels' options). The launches are
recorded from ops.py itself (launch_trace.record: no kernel runs), with the Gluon kernels' conditions (an sm_90
device, Triton 3.6) answered as on the H200.

--loops adds, per innermost loop of the SASS (a backward branch's body: about one per key- or query-tile range,
though ptxas may lay a masked loop out as two overlapping ones), the instructions one warp issues per iteration
by kind: the H200 runs showed these loops limited by their instruction streams rather than by the tensor cores
or the MUFU (docs/kernels.md), so this count is the figure to lower.

--operands (the Gluon dK/dV kernel, `--kernels hopper`) follows each query tile's registers through the SASS from
its S^T and dP^T MMAs to the operands of its dV and dK MMAs (mma_operands) and checks them (check_dkdv_operands):
dV's from S^T alone (P8), dK's from S^T and dP^T (dS8) or, with the pipelined dK MMA, from neither (the previous
tile's dS8). ptxas of CUDA 13 fails this check on the pipelined variant (docs/kernels.md); --dkdv-pipe on compiles
that variant (dkdv_hopper.pipe_mode 1) whatever the plan would choose, --dkdv-pipe fresh the one with a fresh dP^T
accumulator (2), --dkdv-pipe off neither.
"""

import argparse
import hashlib
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_deltamatch.kernels import configs as C
from hf_deltamatch.kernels import ops as KO
from hf_deltamatch.kernels import plan, toolchain
from hf_deltamatch.kernels.backward import _bwd_dkdv_kernel, _bwd_dq_kernel
from hf_deltamatch.kernels.forward import _fwd_kernel
from hf_deltamatch.kernels.quantize import _quantize_kernel
from hf_deltamatch.kernels.transform import _center_rotate_kernel

FP32_PTRS = {"SQ", "SK", "SV", "SDO", "LSE", "DELTA", "LSE2", "RS", "RA", "DSS"}
I32_PTRS = {"CUQ", "CUK"}
FP8_PTRS = {"Q", "QT", "K", "KT", "V", "DO", "DOT"}
OUT_PTRS = {"O", "DQ", "DK", "DV", "DOHP"}
FLOATS = {"softmax_scale"}


def signature(fn, constexprs):
    sig, attrs = {}, {}
    descs = {}  # TMA tensor descriptors: (rows, cols) of each tile
    if constexprs.get("TMA"):
        bm, bn, bd, bv = (constexprs[x] for x in ("BLOCK_M", "BLOCK_N", "BLOCK_DQK", "BLOCK_DV"))
        descs = {"_fwd_kernel": {"Q": (bm, bd), "K": (bn, bd), "V": (bv, bn)},
                 "_bwd_dq_kernel": {"K": (bn, bd), "KT": (bd, bn), "V": (bn, bv)}}[fn.__name__]
    marked = set(strides(fn, constexprs)[1])  # the non-unit strides
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in descs:
            sig[name] = "tensordesc<fp8e4nv[%d, %d]>" % descs[name]
            continue
        if name in FP8_PTRS:
            sig[name] = "*fp8e4nv" if constexprs.get("FP8") else "*bf16"
        elif name in FP32_PTRS:
            sig[name] = "*fp32"
        elif name in I32_PTRS:
            sig[name] = "*i32"
        elif name in OUT_PTRS:
            sig[name] = "*bf16"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
        # pointers and strides (but the unit strides, specialized away in usage()) are multiples of 16, and so
        # are the sequence lengths of the benchmarks' launches (N = M = 8192; Triton marks such ints itself)
        if sig[name].startswith("*") or name in marked or name in ("N", "M"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def strides(fn, constexprs):
    """(the stride arguments that are 1 at every launch, the others). The last dim's stride is 1, except in the
    fp8 backward's token-major copies (KT, QT, DOT: (B, H, D, N) storage seen as (B, H, N, D)), whose token
    stride is 1 and head-dim stride the token count padded to 16 (quantize.token_major)."""
    names = [a for a in fn.arg_names if re.fullmatch(r"(s|kt|qt|dt)[a-z]*[bhnd]", a) and a != "softmax_scale"
             and a not in constexprs]
    token_major = {"ktn", "qtn", "dtn"} if constexprs.get("FP8") else set()
    unit = {a for a in names if a in token_major or (a.endswith("d") and a[:-1] + "n" not in token_major)}
    return unit, [a for a in names if a not in unit]


def gluon_signature(fn, constexprs, d, dqk=None):
    """(signature, attrs) of one of the Gluon kernels (kernels/*_hopper.py) at head dim d: TMA descriptors by their
    boxes (a program's queries, keys or one query tile, by d, or d by them) and shared layouts; fp32 pointers for
    the scale and row arrays; the outputs bf16. dqk: the forward's q and k head dim where it is not d (MLA; d is
    then Dv, the forward's HEAD_D)."""
    dqk = 1 << ((dqk or d) - 1).bit_length()  # fwd_hopper's boxes: Dqk rounded up to a power of two
    from hf_deltamatch.kernels import _gluon as H

    def desc(rows, cols):
        return f"tensordesc<fp8e4nv[{rows}, {cols}],{H._layout((rows, cols))!r}>"
    n, m = H.KEYS_PER_PROGRAM, H.QUERIES_PER_TILE
    qb = m if fn.__name__ == "_fwd_hopper_kernel" else 2 * m  # q's box per load: a warpgroup's rows, or dQ's program
    kb = n if constexprs.get("WGS", 2) == 2 else 64  # the dK/dV kernel's k and v boxes per load
    dv = constexprs.get("HEAD_DV", d)  # the dK/dV and dQ kernels' Dv (their HEAD_D: Dqk's box)
    cols = constexprs.get("DQ_COLS", d)  # the dQ kernel's columns of dQ per launch
    boxes = {  # per kernel: descriptor -> box
        "_bwd_dkdv_hopper_kernel": {"k_desc": (kb, d), "v_desc": (kb, dv), "q_desc": (m, d), "do_desc": (m, dv),
                                    "qt_desc": (d, m), "dot_desc": (dv, m)},
        "_bwd_dq_hopper_kernel": {"q_desc": (qb, d), "do_desc": (qb, dv), "k_desc": (n, d), "v_desc": (n, dv),
                                  "kt_desc": (cols, n)},
        "_fwd_hopper_kernel": {"q_desc": (qb, dqk), "k_desc": (n, dqk), "vt_desc": (d, n)},
    }[fn.__name__]
    sig = {}
    for a in fn.arg_names:
        if a in constexprs:
            sig[a] = "constexpr"
        elif a in boxes:
            sig[a] = desc(*boxes[a])
        elif a in ("lse_desc", "delta_desc"):
            sig[a] = f"tensordesc<fp32[{m}],{H.ROW_LAYOUT.value!r}>"
        elif a in ("O", "DQ", "DK", "DV"):
            sig[a] = "*bf16"
        elif a in ("CU", "PCU"):  # a packed batch's cu_seqlens and padded starts (kernels.segments)
            sig[a] = "*i32"
        elif a == "softmax_scale":
            sig[a] = "fp32"
        elif a.isupper() and a not in ("N", "N_OUT"):
            sig[a] = "*fp32"
        else:
            sig[a] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a][0] == "*" or a == "N"}
    return sig, attrs


def pass_signature(fn):
    """(signature, attrs) of the quantization pass or the transforms' backward pass (kernels/quantize.py,
    kernels/transform.py) on bf16 input: fp8 outputs, fp32 scales, int32 sequence arrays; the head-dim strides 1."""
    kinds = {"X": "*bf16", "R": "*bf16", "MEAN": "*bf16", "Y": "*fp8e4nv", "YT": "*fp8e4nv", "PY": "*fp8e4nv",
             "PYT": "*fp8e4nv", "S": "*fp32", "PS": "*fp32", "CU": "*i32", "SEQ": "*i32"}
    sig = {a: kinds.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a][0] == "*" or a in ("N", "sxb", "sxh", "sxn", "syb", "syh", "syn")}
    return sig, {a for a in fn.arg_names if a in ("sxd", "syd", "std")}, attrs


def usage(fn, constexprs, warps, stages, maxnreg=None, ptxas_log=True, dqk=None):
    """The kernel's sm_90 resource usage, SASS and PTX; ptxas_log=False skips ptxas's second run for its verdict
    on the wgmma pipeline ("serialized" then reads "no"). dqk: the Gluon forward's q and k head dim (gluon_signature;
    its HEAD_D is Dv)."""
    if fn in (_quantize_kernel, _center_rotate_kernel):
        sig, unit, attrs = pass_signature(fn)
        sig.update({a: "constexpr" for a in constexprs})
        sig.update({a: "constexpr" for a in unit})
        src = ASTSource(fn=fn, signature=sig, constexprs={**constexprs, **{a: 1 for a in unit}}, attrs=attrs)
    elif fn.__name__.endswith("_hopper_kernel"):
        from triton.experimental.gluon._runtime import GluonASTSource
        sig, attrs = gluon_signature(fn, constexprs, constexprs["HEAD_D"], dqk)
        src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    else:
        sig, attrs = signature(fn, constexprs)
        for name in strides(fn, constexprs)[0]:  # Triton specializes 1-valued ints as constants
            sig[name] = "constexpr"
            constexprs = {**constexprs, name: 1}
        src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        res = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True).stdout
    # ptxas's own verdict on the wgmma pipeline: C7510-C7520 "wgmma.mma_async instructions are serialized due to
    # ..." means it waits after every wgmma (Triton does not show ptxas's info lines); the ptxas Triton ran (3.9:
    # CUDA 13's ptxas-blackwell, whose PTX version the bundled CUDA 12 ptxas refuses)
    log = ""
    if ptxas_log:
        with tempfile.NamedTemporaryFile(suffix=".ptx", mode="w") as f:
            f.write(c.asm["ptx"])
            f.flush()
            log = subprocess.run([toolchain.sm90_ptxas(), "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                                 capture_output=True, text=True).stderr
    serialized = re.findall(r"serialized due to ([^']*?) in the function", log)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    mma = sorted(set(re.findall(r"[QH]GMMA\.[\w.]+", sass)))
    # the instructions without their addresses: equal hashes = a refactor that changed no instruction
    body = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", line.split(";")[0]).strip()
                     for line in sass.splitlines() if "/*" in line and ";" in line)
    return dict(regs=int(regs.group(1)) if regs else None, spill_bytes=int(stack.group(1)) if stack else None,
                smem=c.metadata.shared, mma=mma, serialized="; ".join(serialized) or "no", loops=loops(sass),
                sass_md5=hashlib.md5(body.encode()).hexdigest()[:12], sass=body, ptx=c.asm["ptx"])


# opcode -> the report's column (the rest count as "other": integer, uniform-datapath, predicate, branch ops)
KINDS = {"MUFU": "mufu", "FFMA": "fp32", "FMUL": "fp32", "FADD": "fp32", "FMNMX": "fp32", "FSEL": "fp32",
         "FSETP": "fp32", "QGMMA": "mma", "HGMMA": "mma", "SHFL": "shfl", "F2FP": "cvt", "LDL": "spill",
         "STL": "spill", "LDG": "mem", "STG": "mem", "LDS": "mem", "STS": "mem", "LDSM": "mem", "LDGSTS": "mem"}


def loops(sass):
    """[(start address, {kind: count})] for the innermost loops of a cuobjdump -sass listing: the bodies between
    a backward branch's target and the branch (outer loops, which contain another, are left out)."""
    ins = [(int(a, 16), re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0])
           for a, i in re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+([^;]*);", sass, re.M)]
    spans = []
    for a, i in re.findall(r"^\s+/\*([0-9a-f]+)\*/\s+([^;]*);", sass, re.M):
        m = re.search(r"BRA\s+(?:\S+\s+)?0x([0-9a-f]+)", i)
        if m and 0 < int(a, 16) - int(m.group(1), 16):
            spans.append((int(m.group(1), 16), int(a, 16)))
    inner = [(lo, hi) for lo, hi in spans if hi - lo > 0x100  # busy-wait loops (try-wait on a barrier) are tiny
             and not any((lo, hi) != (l2, h2) and lo <= l2 and h2 <= hi and h2 - l2 > 0x100 for l2, h2 in spans)]
    out = []
    for lo, hi in sorted(set(inner)):
        counts = {"all": 0}
        for a, op in ins:
            if lo <= a <= hi:
                counts["all"] += 1
                kind = KINDS.get(op, "other")
                counts[kind] = counts.get(kind, 0) + 1
        out.append((lo, counts))
    return out


def _operands(ins):
    """(opcode, [operands]) of one SASS instruction (its predicate dropped), operands without .reuse/-/|x|."""
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins.strip())
    op = ins.split()[0] if ins else ""
    return op, [re.sub(r"\.reuse|^-|^\||\|$", "", a.strip()) for a in ins[len(op):].split(",") if a.strip()]


def mma_operands(sass, chunks=2):
    """[tile] of a Gluon dK/dV kernel's SASS (cuobjdump -sass, or usage()'s "sass"): from each MMA into a fresh
    accumulator (C = RZ: S^T, dP^T) on, the register-A MMAs (P8 dO8, dS8 q8) of the tile, `chunks` k-steps per
    accumulator (a 64-row query tile: two of k32). A tile is [(line, accumulator, A register, tags)]: the tags of
    the values the A operand's four registers derive from: "M0", "M1".. the tile's fresh MMAs in issue order,
    "old" a register defined before the tile's first MMA (a value carried into the tile), "mem" a load. Straight
    data flow: branches are not followed (predicated instructions keep their old value's tags as well)."""
    lines = [ln.split(";")[0].strip() for ln in sass.splitlines()]
    lines = [re.sub(r"^/\*[0-9a-f]+\*/\s*", "", ln) for ln in lines]
    tiles, i = [], 0
    while i < len(lines):
        op, args = _operands(lines[i])
        if not (op.startswith(("QGMMA", "HGMMA")) and len(args) > 2 and args[1].startswith("gdesc")
                and args[2] == "RZ"):
            i += 1
            continue
        regs, fresh, tile = {}, 0, []
        j = i
        while j < len(lines) and len(tile) < 2 * chunks:
            op, args = _operands(lines[j])
            pred = lines[j].startswith("@")
            if op.startswith(("QGMMA", "HGMMA")):
                acc = int(args[0][1:])
                if args[1].startswith("gdesc"):
                    if args[2] == "RZ":  # a fresh accumulator: 64 x n / 128 threads values per thread
                        n = int(re.search(r"64x(\d+)x", op).group(1))
                        for k in range(n // 2):
                            regs[f"R{acc + k}"] = frozenset([f"M{fresh}"])
                        fresh += 1
                else:
                    a = int(args[1][1:])
                    tags = frozenset().union(*(regs.get(f"R{a + r}", frozenset(["old"])) for r in range(4)))
                    tile.append((j + 1, f"R{acc}", f"R{a}", tags))
            elif args and re.fullmatch(r"R\d+", args[0]) and not op.startswith(
                    ("ST", "BAR", "WARPGROUP", "SYNCS", "BRA", "RED", "ATOM")):
                if op.startswith("LD"):
                    src = frozenset(["mem"])
                    width = 2 if ".64" in op else 4 if ".128" in op else 1
                else:
                    src = frozenset().union(*(regs.get(x, frozenset(["old"])) for x in args[1:]
                                              if re.fullmatch(r"R\d+", x)))
                    width = 2 if op.startswith(("IMAD.WIDE", "DADD", "DMUL", "DFMA")) else 1
                if pred:
                    src |= regs.get(args[0], frozenset(["old"]))
                for w in range(width):
                    regs[f"R{int(args[0][1:]) + w}"] = src
            j += 1
        if fresh >= 2 and len(tile) == 2 * chunks:
            tiles.append(tile)
        i = j if j > i else i + 1
    return tiles


def operand_kind(tags):
    """What a register-A MMA of a dK/dV tile multiplies, from its operand's tags (mma_operands): "P8" (the tile's
    S^T), "dS8" (its S^T and dP^T), "carried" (neither: a value from before the tile), or "wrong" (dP^T without
    S^T, or a third MMA's result)."""
    m = {t for t in tags if t.startswith("M")}
    return {frozenset(): "carried", frozenset({"M0"}): "P8", frozenset({"M0", "M1"}): "dS8"}.get(frozenset(m), "wrong")


def check_dkdv_operands(tiles, pipe):
    """Problems (strings; none: the operands are right) of mma_operands' tiles of the dK/dV kernel: in every tile one
    accumulator (dV) takes P8 in each k-step and the other (dK) dS8 in each, or with the pipelined dK MMA (`pipe`)
    the previous tile's dS8 (carried)."""
    if not tiles:
        return ["no dK/dV tile found in the SASS"]
    want = sorted(["P8", "carried" if pipe else "dS8"])
    problems = []
    for tile in tiles:
        kinds = {}
        for line, acc, a, tags in tile:
            kinds.setdefault(acc, set()).add(operand_kind(tags))
        got = sorted("/".join(sorted(k)) for k in kinds.values())
        if got != want:
            problems.append(f"tile at SASS line {tile[0][0]}: operands {got}, want {want}: "
                            + "; ".join(f"{acc} += {a}{sorted(tags)}" for _, acc, a, tags in tile))
    return problems


def common(d, fp8, causal, groups=1):
    return dict(DQK=d, BLOCK_DQK=d, BLOCK_DV=d, CAUSAL=causal, HAS_WINDOW=False, VARLEN=False, FP8=fp8,
                INTERP=False, GROUPS=groups)


KERNELS = {"_fwd_kernel": "fwd", "_bwd_dq_kernel": "dq", "_bwd_dkdv_kernel": "dkdv", "_fwd_hopper_kernel": "hopper_fwd",
           "_bwd_dq_hopper_kernel": "hopper_dq", "_bwd_dkdv_hopper_kernel": "hopper"}


def default_cases():
    """{name: ops.forward / ops.backward inputs} of the --hash cases: launch_trace.cases() (every default plan), then
    the Triton kernels where the Gluon ones are the default, pinned (the case's "pins": plan.variant's settings):
    sliding windows, and the forward and dQ kernels at D=256 and MLA's 192/128."""
    cases = dict(_launch_trace().cases())
    triton = dict(fwd_kernel="triton", dq_kernel="triton", dkdv_kernel="triton")
    for d in (64, 128):
        cases[f"d{d}-window-triton"] = dict(d=d, causal=True, hq=4, hkv=4, n=8192, window=1024, pins=triton)
    for mask in ("causal", "full"):
        cases[f"d256-{mask}-triton-fwd-dq"] = dict(d=256, causal=mask == "causal", hq=4, hkv=4, n=8192,
                                                   pins=dict(fwd_kernel="triton", dq_kernel="triton"))
    cases["mla-192:128-triton-fwd-dq"] = dict(d=192, dv=128, causal=True, hq=4, hkv=4, n=8192,
                                              pins=dict(fwd_kernel="triton", dq_kernel="triton"))
    return cases


def record_launches(case):
    """[(kernel function, constexprs, warps, stages, maxnreg)] that ops.forward then ops.backward launch for `case`
    (default_cases), with kernels.TUNE as it stands and the case's pins on top, as on the H200 (sm_90, Triton 3.6):
    launch_trace.record, which catches every launch before it reaches a device."""
    return [(fn, cx, opts.get("num_warps", 4), opts.get("num_stages", 3), opts.get("maxnreg"))
            for fn, cx, opts, _, _ in _launch_trace().record(case) if fn.__name__ in KERNELS]


def _launch_trace():
    """benchmarks/launch_trace.py, beside this script (imported when needed: it clears TRITON_INTERPRET)."""
    import importlib
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        return importlib.import_module("launch_trace")
    finally:
        sys.path.pop(0)


def hash_defaults(path):
    """--hash: every default_cases() launch's kernel, constexprs and SASS hash into `path`, one line each (each
    distinct kernel compiled once)."""
    if KO.INTERPRET:
        raise SystemExit("--hash compiles for sm_90: unset TRITON_INTERPRET")
    compiled = {}
    with open(path, "w") as f:
        for name, case in default_cases().items():
            for fn, cx, warps, stages, maxnreg in record_launches(case):
                # Dqk: the Gluon forward's HEAD_D is Dv, its q and k boxes (not constexprs) are Dqk wide
                key = (fn.__name__, tuple(sorted(cx.items())), warps, stages, maxnreg, case["d"])
                if key not in compiled:
                    compiled[key] = usage(fn, dict(cx), warps, stages, maxnreg, ptxas_log=False,
                                          dqk=case["d"])["sass_md5"]
                    print(f"{name:32s} {KERNELS[fn.__name__]:10s} sass={compiled[key]} (compiled)", flush=True)
                f.write(f"{name} {KERNELS[fn.__name__]} warps={warps} stages={stages} maxnreg={maxnreg} "
                        f"sass={compiled[key]} {dict(sorted(cx.items()))}\n")
                f.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", default="fwd,dq,dkdv")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--dv", type=int, help="V's head dim where it is not --d (MLA: --d 192 --dv 128); the Gluon "
                                          "forward and dK/dV kernels (hopper_fwd, hopper) only")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--full", action="store_true", help="the full mask instead of causal")
    p.add_argument("--groups", type=int, default=1, help="query heads per KV head (GQA)")
    p.add_argument("--window", action="store_true", help="the Gluon kernels' sliding-window variant (HAS_WINDOW, "
                                                         "causal)")
    p.add_argument("--varlen", action="store_true", help="the Gluon kernels' packed-batch variant (causal; with "
                                                          "--full the ragged dense batches' full-mask one)")
    p.add_argument("--dump", help="a folder to write each kernel's SASS (addresses stripped) and PTX to, "
                                  "<kernel>.sass / .ptx")
    p.add_argument("--variants", default="{}",
                   help="semicolon-separated dicts of plan pins and kernels.TUNE launch shapes (plan.variant)")
    p.add_argument("--loops", action="store_true", help="instructions per loop iteration, by kind (per warp)")
    p.add_argument("--operands", action="store_true",
                   help="the Gluon dK/dV kernel (hopper): check its MMAs' operands tile by tile (check_dkdv_operands)")
    p.add_argument("--part", type=int, choices=(0, 1, 2), help="the Gluon dK/dV kernel's PART (0 both, 1 dV alone, 2 "
                   "dK alone) and the Gluon dQ kernel's HALF (0 all of dQ's columns, 1 the first half with the "
                   "correction pass, 2 the second); default: the plan's last (2 above D = 128)")
    p.add_argument("--dkdv-pipe", choices=("on", "fresh", "off"),
                   help="the Gluon dK/dV kernel's pipelined dK MMA (dkdv_hopper.pipe_mode 1), with a fresh dP^T "
                        "accumulator (2), or off, whatever the plan would choose")
    p.add_argument("--hash", metavar="FILE", help="write every default path's kernels and their SASS hashes to FILE "
                                                  "(the module docstring); the other options are ignored")
    args = p.parse_args()
    if args.hash:
        hash_defaults(args.hash)
        return
    for var in args.variants.split(";"):
        with plan.variant(eval(var)):  # noqa: S307  (our own command line)
            report(args, var)


def report(args, var):
    """One line per kernel of --kernels compiled with the launch configuration the package would use (the
    --variants entry `var` in force), with --loops / --operands / --dump's extras."""
    fp8 = not args.bf16
    causal = not args.full
    c = common(args.d, fp8, causal, args.groups)
    fm, fw, fs = C.fwd_launch(args.d, args.d, fp8)
    kv_n = C.dkdv_block_n(args.block, args.d, C.dkdv_ds_scales(args.d, fp8, args.groups > 1))
    dm, dw, ds, kw, ks = C.bwd_launch(args.d, args.d, fp8, kv_n, args.block)
    bwd = dict(FMAX=448.0, E5M2=False, POW2=False)
    wait = {k: dict(ASM_SCALES=C.asm_scales(k, args.d, causal, interpret=False)) for k in ("fwd", "dq", "dkdv")}
    wait["dq"]["SCALE_AFTER_SUM"] = args.d in C.SCALE_AFTER_SUM_HEAD_DIMS
    lse2 = args.d in C.DKDV_LSE2_HEAD_DIMS
    shift = 8 if fp8 and args.d in C.DKDV_P256_HEAD_DIMS else 0
    wait["dq"].update(LSE2_OUT=lse2, P_SHIFT=shift)
    dss = C.dkdv_ds_scales(args.d, fp8, args.groups > 1)
    wait["dq"]["DSS_OUT"] = dss
    wait["dkdv"].update(LSE2_IN=lse2, P_SHIFT=shift, PART=C.dkdv_parts(args.d)[-1], DSS_IN=dss)
    jobs = {
        "fwd": (_fwd_kernel, dict(c, DV=args.d, BLOCK_M=fm, BLOCK_N=args.block,
                                  TMA=C.use_tma("fwd", fp8, args.d, args.d), **wait["fwd"]), fw, fs),
        "dq": (_bwd_dq_kernel, dict(c, **bwd, DV=args.d, BLOCK_M=dm, BLOCK_N=args.block, STALE=False,
                                    ROW_SUMS=False, DS_Q=KO.DS_TILE_Q, ONE_TILE=dm == KO.DS_TILE_Q,
                                    TMA=C.use_tma("dq", fp8, args.d, args.d), **wait["dq"]), dw, ds),
        "dkdv": (_bwd_dkdv_kernel, dict(c, **bwd, DV_=args.d, BLOCK_M=KO.DS_TILE_Q,
                                        BLOCK_N=kv_n, DS_K=args.block, **wait["dkdv"]), kw, ks),
    }
    # the q/k quantization pass of a dense batch (row-major copy and scales), plain and with the fused outlier
    # transforms (kernels/transform.py), with the launcher's warps; the transforms' backward pass over dk
    bd = 1 << (args.d - 1).bit_length()
    quant = dict(D=args.d, BLOCK_T=args.block, BLOCK_D=bd, FMAX=448.0, E5M2=False, POW2=False, WRITE_Y=True,
                 WRITE_YT=False, VARLEN=False, INTERP=False, K_ORDER=False, TILES=False, WRITE_S=True,
                 WRITE_PY=False, WRITE_PYT=False)
    # the rotation's tiles per program, warps and stages as launched at n8192c (B2 H16 N8192: 2048 tiles), H200
    per, rot_warps, rot_stages = C.quantize_rotate(2 * 16 * 8192 // args.block, args.d, "cpu")
    for name, center, rotate in (("quantize", False, False), ("quantize_rotate", False, True),
                                 ("quantize_center", True, False), ("quantize_both", True, True)):
        cx = dict(quant, CENTER=center, ROTATE=rotate, PER_PROGRAM=per if rotate else 1)
        jobs[name] = (_quantize_kernel, cx, rot_warps if rotate else 8 if args.d > 128 else 4,
                      rot_stages if rotate else 1)
    jobs["center_rotate"] = (_center_rotate_kernel, dict(D=args.d, BLOCK_T=64, BLOCK_D=bd, VARLEN=False,
                                                         ROTATE=True, INTERP=False), 4, 1)
    if "hopper" in args.kernels.split(","):  # Gluon, Triton 3.6's API (dkdv_hopper.py): 4 warps + workers
        from hf_deltamatch.kernels.dkdv_hopper import _bwd_dkdv_hopper_kernel, pipe_mode
        dv = args.dv or args.d
        cfg = C.dkdv_hopper(max(args.d, dv), causal=causal, groups=args.groups, padded=args.varlen,
                            window=args.window, pins=dict(plan.PINS))
        if args.dkdv_pipe:
            cfg["pipe"], cfg["fresh_dp"] = args.dkdv_pipe != "off", args.dkdv_pipe == "fresh"
        # dV alone (PART 1) and dK alone (2) above D = 128: --part picks one, else the heavier (dK)
        jobs["hopper"] = (_bwd_dkdv_hopper_kernel, dict(GROUPS=args.groups, HEAD_D=1 << (args.d - 1).bit_length(),
                                                        HEAD_DV=dv, DQK=args.d,
                                                        PART=args.part if args.part is not None
                                                        else cfg["parts"][-1], CAUSAL=causal,
                                                        STAGES=cfg["stages"],
                                                        VARLEN=args.varlen, WGS=cfg["warpgroups"],
                                                        REGS=cfg["regs"],
                                                        PAIRS=cfg["pairs"], PEEL=cfg["peel"],
                                                        AHEAD=cfg["ahead"],
                                                        PIPE=pipe_mode(cfg["pipe"], cfg["fresh_dp"]),
                                                        HAS_WINDOW=args.window), 4, 1)
    if "hopper_dq" in args.kernels.split(","):  # Gluon (dq_hopper.py)
        from hf_deltamatch.kernels.dq_hopper import _bwd_dq_hopper_kernel
        dv = args.dv or args.d
        cfg = C.dq_hopper(max(args.d, dv), causal, padded=args.varlen)
        box = 1 << (args.d - 1).bit_length()
        half = args.part if args.part is not None else cfg["halves"][-1]  # --part: the column half (0: all)
        jobs["hopper_dq"] = (_bwd_dq_hopper_kernel, dict(
            GROUPS=args.groups, HEAD_D=box, CAUSAL=causal, STAGES=cfg["stages"],
            SCALE_AFTER_SUM=max(args.d, dv) in C.SCALE_AFTER_SUM_HEAD_DIMS, FMAX=448.0, POW2=False, ROW_SUMS=False,
            VARLEN=args.varlen, PINGPONG=cfg["pingpong"], PIPE=cfg["pipe"], HAS_WINDOW=args.window, DQK=args.d,
            HEAD_DV=dv, DQ_COLS=box if half == 0 else box // 2, HALF=half), 4, 1)
    if "hopper_fwd" in args.kernels.split(","):  # Gluon (fwd_hopper.py); HEAD_D is Dv
        from hf_deltamatch.kernels.fwd_hopper import _fwd_hopper_kernel
        dv = args.dv or args.d
        cfg = C.fwd_hopper(dv)
        jobs["hopper_fwd"] = (_fwd_hopper_kernel, dict(GROUPS=args.groups, HEAD_D=dv, CAUSAL=causal,
                                                       STAGES=cfg["stages"], VARLEN=args.varlen,
                                                       REGS=cfg["regs"], NWG=cfg["warpgroups"],
                                                       HAS_WINDOW=args.window), 4, 1)
    for name in args.kernels.split(","):
        fn, cx, w, s = jobs[name]
        u = usage(fn, cx, w, s, C.maxnreg(name).get("maxnreg"), dqk=args.d)
        print(f"{var:40s} {name:5s} warps={w:2d} stages={s} regs={u['regs']} spill={u['spill_bytes']}B "
              f"smem={u['smem']} {' '.join(u['mma'])} wgmma serialized: {u['serialized']} sass={u['sass_md5']} "
              f"instructions={u['sass'].count(chr(10)) + 1}",
              flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            for ext in ("sass", "ptx"):
                with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                    f.write(u[ext])
        if args.operands and name == "hopper":
            tiles = mma_operands(u["sass"])
            for tile in tiles:
                print(f"{'':46s} tile @{tile[0][0]}: " + ", ".join(
                    f"{acc} += {operand_kind(tags)}" for _, acc, _, tags in tile), flush=True)
            problems = check_dkdv_operands(tiles, jobs["hopper"][1]["PIPE"] > 0)
            print(f"{'':46s} operands: " + ("ok" if not problems else "WRONG\n" + "\n".join(problems)),
                  flush=True)
        if args.loops:
            for lo, counts in u["loops"]:
                print(f"{'':46s} loop @{lo:#07x}: " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)


if __name__ == "__main__":
    main()
