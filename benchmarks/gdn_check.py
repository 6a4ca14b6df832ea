#!/usr/bin/env python
"""Gated DeltaNet: flash-linear-attention's chunk kernel against transformers' torch implementation.

The hybrid's linear-attention layers (Qwen3.5 / Qwen3-Next Gated DeltaNet) call `chunk_gated_delta_rule`:
FLA's kernel when `fla` imports, else transformers' `torch_chunk_gated_delta_rule`. This script calls both
the way the layer does: q, k, v in bf16 after the short conv's SiLU, beta = sigmoid(b) in bf16,
g = -exp(A_log) * softplus(a + dt_bias) in fp32, use_qk_l2norm_in_kernel=True, scale = K^-0.5, and
`cu_seqlens` for packed rows. It reports, per case:
  - the relative error ||x - ref|| / ||ref|| of the output and of dq, dk, dv, dg, dbeta: FLA against torch, and
    both against a float64 per-token recurrence (the definition, no chunking);
  - packed rows (several documents of uneven lengths in one row): FLA varlen against torch run once per
    document, and an isolation check: perturbing one document's inputs must leave every other document's
    output and gradients bit-unchanged;
  - fwd+bwd time and peak memory of both (CUDA only).
Writes <out>/gdn-check-<date>-<gpu>.json and .md, and prints the markdown.

  python benchmarks/gdn_check.py --out /tmp/gdn                  # GPU: B2 H16 D128 at 2K/8K, timing at 8K/64K
  python benchmarks/gdn_check.py --device cpu --batch 1 --heads 2 --dim 32 --lengths 192 --time-lengths 192
                                                                 # CPU: the torch and float64 parts only

FLA's Triton kernels need a GPU, so on CPU its rows are recorded as skipped.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attention as attention_bench  # noqa: E402  (benchmarks/attention.py: time_ms, environment)

TENSORS = ("o", "dq", "dk", "dv", "dg", "dbeta")
# FLA multiplies bf16 operands on tensor cores (8-bit mantissa) inside 64-token chunks, and the gradients sum
# many such products; transformers' torch path computes in fp32. Percent-level differences are expected,
# errors of order 1 (wrong math) or NaN are not. The float64 recurrence is the ground truth.
TOL = 5e-2
# Per-document lengths of a packed row, as fractions of the row: uneven and not multiples of the chunk (64).
DOC_FRACTIONS = (0.067, 0.3125, 0.1226, 0.3804)


# ----------------------------------------------------------------------------------------------------
# The implementations
# ----------------------------------------------------------------------------------------------------


def torch_gdn_fn():
    """transformers' torch chunked gated delta rule, the function beneath the FLA dispatch wrapper."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def fla_gdn_fn(device):
    """(FLA's chunk_gated_delta_rule, None) or (None, why not)."""
    if device.type != "cuda":
        return None, "FLA's Triton kernels need a CUDA GPU"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as exc:  # noqa: BLE001
        return None, f"flash-linear-attention not importable: {attention_bench._one_line(exc, 300)}"
    return chunk_gated_delta_rule, None


def call_torch(fn, q, k, v, g, beta, cu_seqlens=None):
    """transformers' torch path; packed rows run once per document (it cannot keep documents apart itself)."""
    if v.shape[2] != q.shape[2]:  # grouped values: each q/k head serves HV // H value heads (as transformers does)
        q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    if cu_seqlens is None:
        return fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)[0]
    bounds = cu_seqlens.tolist()
    return torch.cat([fn(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                         use_qk_l2norm_in_kernel=True)[0] for s, e in zip(bounds[:-1], bounds[1:])], dim=1)


def call_fla(fn, q, k, v, g, beta, cu_seqlens=None):
    """FLA with the arguments transformers' Qwen3.5 layer passes (cu_seqlens = the collator's int32 cu_seq_lens_q)."""
    return fn(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
              cu_seqlens=cu_seqlens)[0]


def _recurrence(state, q, k, v, g, beta):
    """A run of tokens of the float64 recurrence: (state after the run, outputs (B, T, HV, V))."""
    outs = []
    for i in range(q.shape[1]):
        state = state * g[:, i].exp()[..., None, None]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhkv,bhk->bhv", state, k[:, i]))
        state = state + k[:, i, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, i]))
    return state, torch.stack(outs, dim=1)


def gdn_float64(q, k, v, g, beta, cu_seqlens=None, block=64):
    """The gated delta rule token by token in float64 (per document when cu_seqlens is given):
    S_t = a_t S_{t-1} + k_t beta_t (v_t - a_t S_{t-1}^T k_t)^T,  o_t = S_t^T (q_t / sqrt(K)),  a_t = exp(g_t),
    with q and k L2-normalized as x / sqrt(sum x^2 + 1e-6) (transformers' and FLA's l2norm).
    Runs of `block` tokens are checkpointed: backward keeps one state per run instead of several per token."""
    from torch.utils.checkpoint import checkpoint

    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    if v.shape[2] != q.shape[2]:
        q = q.repeat_interleave(v.shape[2] // q.shape[2], dim=2)
        k = k.repeat_interleave(v.shape[2] // k.shape[2], dim=2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    b, t, h, dk = k.shape
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else [0, t]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        state = q.new_zeros(b, h, dk, v.shape[-1])
        for a in range(s, e, block):
            z = min(a + block, e)
            state, o = checkpoint(_recurrence, state, q[:, a:z], k[:, a:z], v[:, a:z], g[:, a:z], beta[:, a:z],
                                  use_reentrant=False)
            outs.append(o)
    return torch.cat(outs, dim=1)


# ----------------------------------------------------------------------------------------------------
# Inputs, autograd, errors
# ----------------------------------------------------------------------------------------------------


def layer_inputs(batch, length, heads, v_heads, dim, seed, device):
    """Inputs distributed as a freshly initialized Qwen3.5 Gated DeltaNet layer produces them."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    q, k = (F.silu(randn(batch, length, heads, dim)).bfloat16() for _ in range(2))
    v = F.silu(randn(batch, length, v_heads, dim)).bfloat16()
    beta = torch.sigmoid(randn(batch, length, v_heads)).bfloat16()
    a_decay = torch.rand(v_heads, generator=gen, device=device) * (16 - 0.01) + 0.01  # A = exp(A_log) ~ U(0.01, 16)
    g = -a_decay * F.softplus(randn(batch, length, v_heads) + 1.0)  # dt_bias = 1 at init
    do = randn(batch, length, v_heads, dim).bfloat16()
    return {"q": q, "k": k, "v": v, "g": g.float(), "beta": beta}, do


def forward_backward(call, inputs, do, cu_seqlens=None, dtype=None):
    """{'o': output, 'dq': ..., 'dbeta': ...} of call(**inputs) with upstream gradient do; `dtype` upcasts the
    inputs first (the float64 reference: its gradients must not be rounded back to the inputs' bf16)."""
    leaves = {n: x.detach().to(dtype or x.dtype, copy=True).requires_grad_(True) for n, x in inputs.items()}
    out = call(**leaves, cu_seqlens=cu_seqlens)
    out.backward(do.to(out.dtype))
    res = {"o": out.detach()}
    res.update({f"d{n}": leaves[n].grad for n in inputs})
    return res


def errors(res, ref) -> dict:
    from hf_deltamatch.testing import rel_err

    return {t: rel_err(ref[t], res[t]) for t in TENSORS}


def packed_bounds(length: int, device) -> torch.Tensor:
    """cu_seqlens (int32, as the packing collator makes it) of len(DOC_FRACTIONS) + 1 uneven documents."""
    lens = [max(1, int(f * length)) for f in DOC_FRACTIONS]
    lens.append(length - sum(lens))
    if min(lens) < 1:
        raise ValueError(f"a packed row of {length} tokens is too short for {len(lens)} documents")
    return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)


def perturb_document(inputs, cu_seqlens, doc: int, seed: int):
    """A copy of the inputs with document `doc`'s tokens changed (gates kept <= 0)."""
    s, e = cu_seqlens[doc].item(), cu_seqlens[doc + 1].item()
    gen = torch.Generator(device=inputs["q"].device).manual_seed(seed + 7919)
    out = {n: x.clone() for n, x in inputs.items()}
    for n in ("q", "k", "v"):
        piece = out[n][:, s:e].float()
        out[n][:, s:e] = (piece + 0.5 * torch.randn(piece.shape, generator=gen, device=piece.device)).to(out[n].dtype)
    out["beta"][:, s:e] = torch.rand(out["beta"][:, s:e].shape, generator=gen,
                                     device=out["beta"].device).to(out["beta"].dtype)
    out["g"][:, s:e] = out["g"][:, s:e] * 0.5 - 0.05
    return out


def isolation(call, inputs, do, cu_seqlens, seed) -> dict:
    """Perturb the middle document; every other document's output and gradients must not change at all.

    Runs the unperturbed case twice first: if the kernel is not bit-deterministic run to run, the allowed change
    is that run-to-run difference (recorded), not zero."""
    base = forward_backward(call, inputs, do, cu_seqlens)
    again = forward_backward(call, inputs, do, cu_seqlens)
    noise = max((base[t].float() - again[t].float()).abs().max().item() for t in TENSORS)
    doc = (len(cu_seqlens) - 1) // 2
    moved = forward_backward(call, perturb_document(inputs, cu_seqlens, doc, seed), do, cu_seqlens)
    s, e = cu_seqlens[doc].item(), cu_seqlens[doc + 1].item()
    outside = torch.ones(inputs["q"].shape[1], dtype=torch.bool, device=inputs["q"].device)
    outside[s:e] = False
    leak = max((moved[t][:, outside].float() - base[t][:, outside].float()).abs().max().item() for t in TENSORS)
    inside = min((moved[t][:, ~outside].float() - base[t][:, ~outside].float()).abs().max().item() for t in TENSORS)
    return {"perturbed_doc": doc, "deterministic": noise == 0.0, "run_to_run_max_abs": noise,
            "other_docs_max_abs_change": leak, "perturbed_doc_min_change": inside,
            "ok": leak <= noise and inside > 0.0}


# ----------------------------------------------------------------------------------------------------
# Cases
# ----------------------------------------------------------------------------------------------------


def _label(batch, length, heads, v_heads, dim, packed=False):
    hv = f"/{v_heads}" if v_heads != heads else ""
    return f"B{batch}-H{heads}{hv}-T{length}-D{dim}" + ("-packed" if packed else "")


def correctness_case(args, device, length, packed, fla, torch_fn, log) -> dict:
    batch = 1 if packed else args.batch
    inputs, do = layer_inputs(batch, length, args.heads, args.v_heads, args.dim, args.seed, device)
    cu = packed_bounds(length, device) if packed else None
    case = {"case": _label(batch, length, args.heads, args.v_heads, args.dim, packed), "packed": packed,
            "doc_lens": (cu[1:] - cu[:-1]).tolist() if packed else None, "errors": {}, "status": "ok"}
    log(f"correctness {case['case']}")
    ref_torch = forward_backward(lambda **kw: call_torch(torch_fn, **kw), inputs, do, cu)
    ref64 = None
    if length <= args.float64_max_len:
        ref64 = forward_backward(gdn_float64, inputs, do, cu, dtype=torch.float64)
        case["errors"]["torch_vs_float64"] = errors(ref_torch, ref64)
    else:
        case["float64"] = f"skipped: T={length} over --float64-max-len {args.float64_max_len}"
    if fla[0] is None:
        case["fla"] = f"skipped: {fla[1]}"
    else:
        fla_res = forward_backward(lambda **kw: call_fla(fla[0], **kw), inputs, do, cu)
        case["errors"]["fla_vs_torch"] = errors(fla_res, ref_torch)
        if ref64 is not None:
            case["errors"]["fla_vs_float64"] = errors(fla_res, ref64)
        if packed:
            case["isolation"] = isolation(lambda **kw: call_fla(fla[0], **kw), inputs, do, cu, args.seed)
    if packed and fla[0] is None:  # the torch per-document path's isolation (trivially by construction) still runs
        case["isolation_torch"] = isolation(lambda **kw: call_torch(torch_fn, **kw), inputs, do, cu, args.seed)
    worst = [v for errs in case["errors"].values() for v in errs.values()]
    bad = [v for v in worst if not (math.isfinite(v) and v <= TOL)]
    iso = case.get("isolation") or case.get("isolation_torch")
    if bad or (iso is not None and not iso["ok"]):
        case["status"] = "FAILED"
    return case


def timing_case(args, device, length, fla, torch_fn, log) -> dict:
    inputs, do = layer_inputs(args.batch, length, args.heads, args.v_heads, args.dim, args.seed, device)
    row = {"case": _label(args.batch, length, args.heads, args.v_heads, args.dim)}
    bench_args = SimpleNamespace(warmup=args.warmup, rep=args.rep, min_reps=args.min_reps)
    impls = [("torch", lambda **kw: call_torch(torch_fn, **kw))]
    if fla[0] is not None:
        impls.insert(0, ("fla", lambda **kw: call_fla(fla[0], **kw)))
    else:
        row["fla"] = f"skipped: {fla[1]}"
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()}

    def fwd_bwd(call):  # gradients returned, not accumulated: no copies or adds inside the timing
        out = call(**leaves)
        return torch.autograd.grad(out, list(leaves.values()), do)

    for name, call in impls:
        log(f"timing {row['case']} {name}")
        try:
            fwd_bwd(call)  # compiles (Triton autotune, tilelang JIT) outside the timing
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            row[f"{name}_ms"] = attention_bench.time_ms(lambda: fwd_bwd(call), device, bench_args)
            if device.type == "cuda":
                row[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except Exception as exc:  # noqa: BLE001  (an OOM of the torch path at 64K is a result, not a crash)
            row[f"{name}_error"] = attention_bench._one_line(exc)
            log(traceback.format_exc())
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "fla_ms" in row and "torch_ms" in row:
        row["speedup"] = row["torch_ms"] / row["fla_ms"]
    row["tokens_per_s_fla"] = args.batch * length / row["fla_ms"] * 1e3 if "fla_ms" in row else None
    return row


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def _fmt(x, spec=".2e"):
    return format(x, spec) if isinstance(x, (int, float)) and math.isfinite(x) else "—"


def report_md(report) -> str:
    env, meta = report["environment"], report["meta"]
    lines = [f"# Gated DeltaNet: FLA vs transformers' torch ({meta['date']})", "",
             f"GPU {env.get('gpu')}, torch {env.get('torch')}, triton {env.get('triton')}, "
             f"transformers {meta['transformers']}, fla {meta['fla']}, tilelang {meta['tilelang']}, "
             f"commit {env.get('git_commit')}. transformers dispatches to: **{meta['transformers_gdn_backend']}**.",
             f"Command: `python benchmarks/gdn_check.py {' '.join(meta['argv'])}`", "",
             f"Relative error ||x - ref|| / ||ref||; pass <= {TOL} and finite (bf16 operands in FLA's chunk "
             "matmuls give percent-level differences; wrong math gives O(1)).", "",
             "| case | compared | " + " | ".join(TENSORS) + " |", "|---|---|" + "---|" * len(TENSORS)]
    for case in report["correctness"]:
        for pair, errs in case["errors"].items():
            lines.append(f"| {case['case']} | {pair.replace('_', ' ')} | "
                         + " | ".join(_fmt(errs.get(t)) for t in TENSORS) + " |")
        for key in ("fla", "float64", "error"):
            if key in case:
                lines.append(f"| {case['case']} | {key}: {case[key]} |" + " |" * len(TENSORS))
    lines += ["", "Packed rows: perturb the middle document, compare the others' output and gradients "
              "(max abs change; must be 0, or within the kernel's own run-to-run difference).", "",
              "| case | impl | doc lens | deterministic | other docs' change | perturbed doc's change | ok |",
              "|---|---|---|---|---|---|---|"]
    for case in report["correctness"]:
        for key, impl in (("isolation", "fla"), ("isolation_torch", "torch per doc")):
            iso = case.get(key)
            if iso:
                lines.append(f"| {case['case']} | {impl} | {case['doc_lens']} | {iso['deterministic']} | "
                             f"{_fmt(iso['other_docs_max_abs_change'])} | {_fmt(iso['perturbed_doc_min_change'])} | "
                             f"{'yes' if iso['ok'] else '**NO**'} |")
    lines += ["", "fwd+bwd (ms, median; peak GiB above the inputs):", "",
              "| case | FLA ms | torch ms | torch / FLA | FLA peak GiB | torch peak GiB | FLA tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for row in report["timing"]:
        lines.append(f"| {row['case']} | {_fmt(row.get('fla_ms'), '.2f')} | {_fmt(row.get('torch_ms'), '.2f')} | "
                     f"{_fmt(row.get('speedup'), '.1f')} | {_fmt(row.get('fla_peak_gib'), '.2f')} | "
                     f"{_fmt(row.get('torch_peak_gib'), '.2f')} | {_fmt(row.get('tokens_per_s_fla'), '.3g')} |")
        for key in ("fla", "fla_error", "torch_error"):
            if key in row:
                lines.append(f"| {row['case']} | {key}: {row[key]} | | | | | |")
    failed = [c["case"] for c in report["correctness"] if c["status"] != "ok"]
    lines += ["", f"**Correctness: {'FAILED ' + ', '.join(failed) if failed else 'all checks pass'}.**", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16, help="q/k heads")
    p.add_argument("--v-heads", type=int, default=None, help="value heads (GVA when > --heads; default = --heads)")
    p.add_argument("--dim", type=int, default=128, help="head dim (K = V)")
    p.add_argument("--lengths", default="2048,8192", help="correctness: sequence lengths (each dense and packed)")
    p.add_argument("--layouts", default="dense,packed",
                   help="correctness layouts: dense (B rows of one sequence) and/or packed (one row of documents)")
    p.add_argument("--time-lengths", default="8192,65536", help="fwd+bwd timing lengths ('' = none)")
    p.add_argument("--float64-max-len", type=int, default=8192,
                   help="longest T for the float64 recurrence (a Python loop over tokens: ~1 s per 1K tokens)")
    p.add_argument("--warmup", type=float, default=25.0, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=float, default=100.0, help="do_bench repetition time, ms")
    p.add_argument("--min-reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.v_heads = args.v_heads or args.heads
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if not layouts or not set(layouts) <= {"dense", "packed"}:
        p.error(f"--layouts {args.layouts!r}: dense, packed or dense,packed")
    args.layouts = layouts
    if args.v_heads % args.heads:
        p.error(f"--v-heads {args.v_heads} must be a multiple of --heads {args.heads}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - started:7.1f} s] {msg}", file=sys.stderr, flush=True)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; on CPU run with --device cpu (torch and float64 parts only).", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    # FLA autotunes its kernels for each new shape: keep the results on disk for the next process
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    from hf_deltamatch.training.modeling import gdn_backend

    torch_fn = torch_gdn_fn()
    fla = fla_gdn_fn(device)
    now = datetime.datetime.now(datetime.timezone.utc)
    env = attention_bench.environment(device)
    report = {"meta": {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "argv": sys.argv[1:] if argv is None else argv,
                       **{name: attention_bench.package_version(name) for name in ("transformers", "fla", "tilelang")},
                       "transformers_gdn_backend": gdn_backend(),
                       "tolerance": TOL, "args": vars(args)},
              "environment": env, "correctness": [], "timing": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gdn-check-{now.strftime('%Y-%m-%d-%H%M')}-{attention_bench.slug(env['gpu'])}"

    def write():
        stem.with_suffix(".json").write_text(json.dumps(attention_bench._sanitize(report), indent=1))
        stem.with_suffix(".md").write_text(report_md(report))

    for length in [int(x) for x in args.lengths.split(",") if x.strip()]:
        for packed in [layout == "packed" for layout in args.layouts]:
            try:
                report["correctness"].append(correctness_case(args, device, length, packed, fla, torch_fn, log))
            except Exception as exc:  # noqa: BLE001
                log(traceback.format_exc())
                report["correctness"].append({"case": _label(args.batch, length, args.heads, args.v_heads, args.dim,
                                                             packed), "status": "FAILED", "errors": {},
                                              "error": attention_bench._one_line(exc)})
            write()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for length in [int(x) for x in args.time_lengths.split(",") if x.strip()]:
        report["timing"].append(timing_case(args, device, length, fla, torch_fn, log))
        write()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write()
    print(report_md(report))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0 if all(c["status"] == "ok" for c in report["correctness"]) else 1


if __name__ == "__main__":
    sys.exit(main())
