#!/usr/bin/env python
"""Every kernel launch the package makes for a set of inputs, recorded on any machine (no GPU, no kernel runs).

  python benchmarks/launch_trace.py --write FILE     # record the default cases' launches
  python benchmarks/launch_trace.py --check FILE     # exit 1, with the differences, if today's differ

For each case of `cases()` (the inputs of sm90_registers.py --hash: D 64/128/256 and MLA, causal, full and windowed
masks, GQA, dense N = 8192 and ragged N = 8000, packed and other varlen batches, fp8 and bf16, e5m2, block 64, matching
and stale delta), ops.forward then ops.backward run on CPU stand-ins with the Gluon kernels' conditions (an sm_90
device, Triton 3.6) answered as on the H200, and each JIT launch is caught before it reaches a device: the kernel, a
hash of its code and of the JIT functions it calls (comments and line numbers aside), its grid, warps, stages and
constexprs, and every other argument's dtype, shape and strides (or value). Two trees whose lines agree launch the same
compiled kernels on the same data layouts, so a refactor of the host code that keeps them equal needs no new GPU run:
tests/test_launch_trace.py holds today's launches to tests/gpu_tested_launches.txt, the record of the tree whose GPU
tests last passed on the H200.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernels' launches, not the interpreter's

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def cases() -> dict:
    """{name: input}: every default plan's inputs (no pins, no tuning overrides)."""
    out = {}
    for d in (64, 128):
        for causal in (True, False):
            for hq, hkv in ((4, 4), (16, 4)):
                for n in (8192, 8000):
                    for precision in ("fp8", "bf16"):
                        for delta in ("matching", "stale"):
                            if precision == "bf16" and (n == 8192 or hq != hkv):
                                continue
                            mask = "causal" if causal else "full"
                            out[f"d{d}-{mask}-h{hq}:{hkv}-n{n}-{precision}-{delta}"] = dict(
                                d=d, causal=causal, hq=hq, hkv=hkv, n=n, precision=precision, delta=delta)
        for hq, hkv in ((4, 4), (16, 4)):
            for delta in ("matching", "stale"):
                out[f"d{d}-packed-h{hq}:{hkv}-{delta}"] = dict(d=d, causal=True, hq=hq, hkv=hkv, n=8000,
                                                                varlen=(3000, 4000, 1000), delta=delta)
            for n in (8192, 8000):
                out[f"d{d}-window-h{hq}:{hkv}-n{n}"] = dict(d=d, causal=True, hq=hq, hkv=hkv, n=n, window=1024)
        out[f"d{d}-window-packed"] = dict(d=d, causal=True, hq=4, hkv=4, n=8000, varlen=(3000, 4000, 1000),
                                          window=1024)
        out[f"d{d}-varlen-unaligned"] = dict(d=d, causal=True, hq=4, hkv=4, n=8000, varlen=(3001, 3999, 1000))
        out[f"d{d}-varlen-full"] = dict(d=d, causal=False, hq=4, hkv=4, n=8000, varlen=(3000, 4000, 1000))
        out[f"d{d}-e5m2"] = dict(d=d, causal=True, hq=4, hkv=4, n=8192, grad_format="e5m2")
        out[f"d{d}-block64"] = dict(d=d, causal=True, hq=4, hkv=4, n=8192, block=64)
        out[f"d{d}-cross"] = dict(d=d, causal=False, hq=4, hkv=4, n=1000, m=3000)
    for causal in (True, False):
        mask = "causal" if causal else "full"
        for precision in ("fp8", "bf16"):
            out[f"d256-{mask}-{precision}"] = dict(d=256, causal=causal, hq=4, hkv=4, n=8192, precision=precision)
        out[f"d256-{mask}-h16:4"] = dict(d=256, causal=causal, hq=16, hkv=4, n=8192)
        out[f"mla-192:128-{mask}"] = dict(d=192, dv=128, causal=causal, hq=4, hkv=4, n=8192)
    out["d128-gqa-full-stale"] = dict(d=128, causal=False, hq=16, hkv=4, n=8192, delta="stale")
    out["d128-rotation"] = dict(d=128, causal=True, hq=4, hkv=4, n=8192, qk_rotation="hadamard")
    out["d128-smooth-k-packed"] = dict(d=128, causal=True, hq=4, hkv=4, n=8000, varlen=(3000, 4000, 1000),
                                       smooth_k=True)
    return out


@contextlib.contextmanager
def _as_on_the_h200():
    """Gluon's conditions answered as on the H200 (sm_90, Triton 3.6.0, CUDA 12.8's ptxas), and every JIT launch
    recorded into the yielded list instead of run."""
    import importlib

    launches = []

    def run(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, grid, kwargs))

    saved_run, saved_cap, saved_version = JITFunction.run, torch.cuda.get_device_capability, triton.__version__
    JITFunction.run = run
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    triton.__version__ = "3.6.0"
    undo = []
    try:
        KL = importlib.import_module("hf_deltamatch.kernels.launch")  # the trees before plan.py
    except ImportError:
        KL = None
    if KL is not None:
        ptxas, hopper_case = KL._sm90_ptxas_major, KL._hopper_case
        KL._sm90_ptxas_major = lambda: 12
        KL._hopper_case = lambda **kw: hopper_case(**{**kw, "device": torch.device("cuda")})
        undo.append(lambda: (setattr(KL, "_sm90_ptxas_major", ptxas), setattr(KL, "_hopper_case", hopper_case)))
    else:
        from hf_deltamatch.kernels import plan, toolchain

        ptxas, current = toolchain.sm90_ptxas_major, toolchain.current
        toolchain.sm90_ptxas_major = lambda: 12
        toolchain.current = lambda: toolchain._toolchain("3.6.0", "")
        plan.SIMULATE_SM90 = True
        plan.select.cache_clear()
        undo.append(lambda: (setattr(toolchain, "sm90_ptxas_major", ptxas), setattr(toolchain, "current", current),
                             setattr(plan, "SIMULATE_SM90", False), plan.select.cache_clear()))
    # the quantization pass's token-major stores as Triton 3.6 has them (fused: toolchain.RELEASES), read at import
    Q = importlib.import_module("hf_deltamatch.kernels.quantize")
    fused = Q.FUSED_TOKEN_MAJOR, Q.FUSED_PADDED_TOKEN_MAJOR
    Q.FUSED_TOKEN_MAJOR = Q.FUSED_PADDED_TOKEN_MAJOR = True
    undo.append(lambda: (setattr(Q, "FUSED_TOKEN_MAJOR", fused[0]), setattr(Q, "FUSED_PADDED_TOKEN_MAJOR", fused[1])))
    try:
        yield launches
    finally:
        JITFunction.run, torch.cuda.get_device_capability, triton.__version__ = saved_run, saved_cap, saved_version
        for u in undo:
            u()


def _code_key(fn, seen=None) -> str:
    """A hash of a JIT function's code and of every JIT function it calls, without comments, docstrings, the
    messages of static asserts or line numbers (Triton's own cache key counts the line a function starts at, which
    moves with any edit above it)."""
    import ast
    import hashlib
    import textwrap

    seen = {} if seen is None else seen
    if fn in seen:
        return seen[fn]
    seen[fn] = "recursion"
    tree = ast.parse(textwrap.dedent(fn.src))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "static_assert":
            node.args, node.keywords = node.args[:1], []  # its message
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    parts = [ast.dump(tree)]
    for name in sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
                       | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}):
        dep = fn.__globals__.get(name)
        if dep is not None and hasattr(dep, "src") and dep is not fn:
            parts.append(name + ":" + _code_key(dep, seen))
    seen[fn] = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return seen[fn]


def _arg(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}/{list(x.stride())}"
    if type(x).__name__ == "TensorDescriptor":
        return f"desc({_arg(x.base)},shape={list(x.shape)},strides={list(x.strides)},block={list(x.block_shape)})"
    if isinstance(x, float):
        return repr(float(x))
    return repr(x)


def record(case: dict) -> list[tuple]:
    """[(kernel, constexprs, launch options, grid, other arguments)] of ops.forward then ops.backward for `case`
    (cases(); its "pins", if any: plan.variant's settings)."""
    from hf_deltamatch import outliers
    from hf_deltamatch.config import DeltaMatchConfig
    from hf_deltamatch.kernels import ops as KO

    d, dv, n = case["d"], case.get("dv", case["d"]), case["n"]
    m = case.get("m", n)
    B = 1 if "varlen" in case else 2
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, case["hq"], n, d, generator=g).to(torch.bfloat16)
    k = torch.randn(B, case["hkv"], m, d, generator=g).to(torch.bfloat16)
    v = torch.randn(B, case["hkv"], m, dv, generator=g).to(torch.bfloat16)
    cu = None
    if "varlen" in case:
        cu = torch.cumsum(torch.tensor((0, *case["varlen"])), 0).to(torch.int32)
    config = DeltaMatchConfig(precision=case.get("precision", "fp8"), delta=case.get("delta", "matching"),
                              block=case.get("block", 128), grad_format=case.get("grad_format", "e4m3"))
    kw = dict(causal=case["causal"], softmax_scale=None, window=case.get("window"), cu_seqlens_q=cu, cu_seqlens_k=cu,
              config=config)
    extra = {}
    if case.get("qk_rotation") or case.get("smooth_k"):
        r_q, r_k, means, _ = outliers.fused_args(q, k, case.get("qk_rotation", "none"), case.get("smooth_k", False),
                                                 cu)
        extra = dict(qk_transform=(r_q, r_k, means))
    pins = contextlib.nullcontext()
    if case.get("pins"):
        from hf_deltamatch.kernels import plan

        pins = plan.variant(case["pins"])
    with _as_on_the_h200() as launches, pins:
        out, lse, q8, k8, v8, sq, sk, sv = KO.forward(q, k, v, **kw, **extra)
        KO.backward(torch.zeros_like(out), q, k, v, out, lse, q8, k8, v8, sq, sk, sv, **kw)
    out = []
    for fn, args, grid, kwargs in launches:
        opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "num_ctas") if k in kwargs}
        named = dict(zip(fn.arg_names, args))
        named.update(kwargs)
        constexprs = {a: named[a] for a in fn.arg_names if fn.params[fn.arg_names.index(a)].is_constexpr}
        rest = {a: v for a, v in named.items() if a not in constexprs}
        out.append((fn, constexprs, opts, grid, rest))
    return out


def trace(case: dict) -> list[str]:
    """One line per launch of ops.forward then ops.backward for `case` (cases())."""
    lines = []
    for fn, constexprs, opts, grid, rest in record(case):
        grid = grid if isinstance(grid, tuple) else "callable"
        lines.append(f"{fn.__name__} code={_code_key(fn)} grid={grid} {dict(sorted(opts.items()))} "
                     f"constexprs={dict(sorted(constexprs.items()))} "
                     f"args={ {a: _arg(v) for a, v in rest.items()} }")
    return lines


def trace_all() -> list[str]:
    lines = []
    for name, case in cases().items():
        lines.append(f"# {name}")
        lines.extend(trace(case))
    return lines


def _tree() -> str:
    """This checkout's commit, and whether the package differs from it."""
    import subprocess

    def git(*a):
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short=7", "HEAD") or "an unknown tree"
    return head + (" with local changes" if git("status", "--porcelain", "hf_deltamatch") else "")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    args = p.parse_args()
    lines = trace_all()
    if args.write:
        Path(args.write).write_text(f"# the launches of {_tree()}, recorded with triton {triton.__version__}\n"
                                    + "\n".join(lines) + "\n")
        return
    recorded = Path(args.check).read_text().splitlines()[1:]
    diff = list(difflib.unified_diff(recorded, lines, "recorded", "today", lineterm="", n=1))
    print("\n".join(diff) if diff else "every launch as recorded")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
