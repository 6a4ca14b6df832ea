#!/usr/bin/env python
"""Where the outlier transforms' cost goes (qk_rotation / smooth_k on the fp8 Triton path; docs/numerics.md,
"Outlier channels"): per-kernel GPU time of one fwd+bwd with each transform against plain fp8-matching, from
torch.profiler, and the fwd+bwd totals from triton.testing.do_bench (median, L2 flushed).

  python benchmarks/qk_transforms_breakdown.py [--shape B2-H16-KV16-N8192-D128] [--top 12]
  python benchmarks/qk_transforms_breakdown.py --variants "{'quantize_rotate': (1, 8, 1)};{}" --rounds 2
                                                             # launch configs (kernels.TUNE) compared in one call
  python benchmarks/qk_transforms_breakdown.py --dry-run     # CPU (Triton interpreter), tiny shape: the code path

--variants: semicolon-separated dicts of plan pins and kernels.TUNE launch shapes ("{}": the defaults); each times every
config, its own fp8-matching base included, and --rounds alternates them (A, B, A, B) so that drift shows as
round-to-round spread. The rotation's quantization pass: TUNE "quantize_rotate" = (tiles per program, warps, stages);
(1, 8, 1) launches it one tile per program.

benchmarks/attention.py --qk-transforms is the cost figure of record; this script names the kernels behind it.
"""

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = {"fp8-matching": {}, "+hadamard": dict(qk_rotation="hadamard"), "+smooth_k": dict(smooth_k=True),
           "+both": dict(qk_rotation="hadamard", smooth_k=True)}


def parse_shape(text):
    m = re.fullmatch(r"B(\d+)-H(\d+)-KV(\d+)-N(\d+)-D(\d+)", text)
    if not m:
        raise SystemExit(f"--shape {text!r}: expected B<b>-H<hq>-KV<hkv>-N<n>-D<d>, e.g. B2-H16-KV16-N8192-D128")
    return tuple(int(x) for x in m.groups())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="B2-H16-KV16-N8192-D128", help="causal self-attention, bf16 inputs")
    p.add_argument("--top", type=int, default=12, help="kernels listed per config")
    p.add_argument("--variants", default="{}",
                   help="semicolon-separated dicts of plan pins and kernels.TUNE launch shapes, each timed on every "
                        "config")
    p.add_argument("--rounds", type=int, default=1, help="times the variants alternate")
    p.add_argument("--dry-run", action="store_true", help="CPU, Triton interpreter, B1-H2-KV1-N128-D64; no timings")
    args = p.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        args.shape = "B1-H2-KV1-N128-D64"
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    import torch

    from hf_deltamatch.kernels.plan import variant

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device; on a CPU machine run with --dry-run (code path only)", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    b, hq, hkv, n, d = parse_shape(args.shape)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(*s, generator=g, device=device, dtype=torch.bfloat16)
                   for s in ((b, hq, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, hq, n, d)))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    variants = [spec.strip() for spec in args.variants.split(";") if spec.strip()] or ["{}"]
    runs = []  # (round, variant, {config: (total ms or None, {kernel: ms})})
    for rnd in range(args.rounds):
        for var in variants:
            with variant(eval(var)):  # noqa: S307  (our own command line)
                runs.append((rnd, var, time_configs(q, k, v, do, args.dry_run)))
    if args.dry_run:
        return 0
    for rnd, var, results in runs:
        report(f"round {rnd + 1}, TUNE {var}: shape {args.shape} causal; fwd+bwd ms (do_bench median), cost vs "
               f"fp8-matching", results, args.top)
    if len(runs) > 1:
        summary(variants, runs)
    return 0


def summary(variants, runs):
    """Each variant's fwd+bwd per config and round, and its cost against that round's fp8-matching."""
    print("summary: fwd+bwd ms per round (cost vs the same round and variant's fp8-matching)")
    for var in variants:
        for name in CONFIGS:
            cells = [f"{res[name][0]:.3f} ({(res[name][0] / res['fp8-matching'][0] - 1) * 100:+.1f} %)"
                     for _, spec, res in runs if spec == var]
            print(f"  {var:32s} {name:14s} " + "  ".join(cells))


def time_configs(q, k, v, do, dry_run):
    """{config: (fwd+bwd ms, {kernel: ms per fwd+bwd})} for CONFIGS under the current kernels.TUNE; dry run: ran
    once each, no timings."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hf_deltamatch import DeltaMatchConfig, deltamatch_attention

    results = {}
    for name, opts in CONFIGS.items():
        cfg = DeltaMatchConfig(backend="triton", **opts)

        def step():
            out = deltamatch_attention(q, k, v, causal=True, config=cfg)
            torch.autograd.grad(out, (q, k, v), do)

        step()
        if dry_run:
            results[name] = (None, {})
            print(f"{name}: ran", flush=True)
            continue
        from triton.testing import do_bench
        total = do_bench(step, warmup=25, rep=200)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per_kernel = {}
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                per_kernel[e.key] = t / 5 / 1000.0  # ms per fwd+bwd
        results[name] = (total, per_kernel)
    return results


def report(title, results, top):
    base_total, base = results["fp8-matching"]
    print(title)
    for name, (total, kernels) in results.items():
        print(f"\n{name}: {total:.3f} ms ({(total / base_total - 1) * 100:+.1f} %)")
        if name == "fp8-matching":
            continue
        # the kernels whose time changed: the transforms' own work, and the quantization pass's growth
        delta = {kname: t - base.get(kname, 0.0) for kname, t in kernels.items()}
        delta.update({kname: -t for kname, t in base.items() if kname not in kernels})
        for kname, dt in sorted(delta.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"  {dt * 1000:+8.1f} us  {kname[:100]}")
    print(flush=True)


if __name__ == "__main__":
    sys.exit(main())
