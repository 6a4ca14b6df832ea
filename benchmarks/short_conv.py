#!/usr/bin/env python
"""Cost of restarting Gated DeltaNet's short convolution at packed document starts.

  python benchmarks/short_conv.py [--channels 8192] [--tokens 8192] [--docs 8] [--dtype bf16] [--device cuda]

Times transformers' torch `causal_conv1d_fn` (F.conv1d over the whole row, then SiLU) against
`training.short_conv.packed_causal_conv1d` (the same conv, then an exact recompute of each document's first
kernel_size - 1 outputs) on one packed row of equal-length documents, forward and forward + backward, input in the
layers' channel-last layout. The two take turns call by call; prints per mode one JSON line with the fastest
of --reps calls of each (the overhead is their ratio) and the medians.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: E402

from hf_deltamatch.training.short_conv import packed_causal_conv1d  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed_ms(fns, reps, device):
    """Per function, the fastest and the median of `reps` timed calls, the functions taking turns call by call
    (so load from other processes hits both alike) after one warm-up call each."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:
                times[name].append((time.perf_counter() - t) * 1e3)
    return {name: (min(ts), statistics.median(ts)) for name, ts in times.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--docs", type=int, default=8)
    p.add_argument("--width", type=int, default=4)
    p.add_argument("--dtype", choices=DTYPES, default="fp32")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    plain = modeling_qwen3_5.causal_conv1d_fn.__wrapped__  # transformers' torch fallback
    x = torch.randn(1, args.tokens, args.channels, device=device, dtype=dtype).transpose(1, 2)
    weight = torch.randn(args.channels, args.width, device=device, dtype=dtype)
    cu = torch.linspace(0, args.tokens, args.docs + 1, device=device).round().long()
    grad = torch.randn(x.shape, device=device, dtype=dtype)
    fns = {"plain": lambda x_, w_: plain(x_, w_, None, "silu"),
           "per_document": lambda x_, w_: packed_causal_conv1d(x_, w_, None, cu, "silu")}
    row = dict(device=str(device), dtype=args.dtype, channels=args.channels, tokens=args.tokens, docs=args.docs,
               width=args.width)
    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()

    def forward(fn):
        with torch.no_grad():
            fn(x, weight)

    def forward_backward(fn):
        torch.autograd.grad(fn(xg, wg), (xg, wg), grad)

    for mode in (forward, forward_backward):
        ms = timed_ms({name: (lambda fn=fn: mode(fn)) for name, fn in fns.items()}, args.reps, device)
        (plain_min, plain_med), (doc_min, doc_med) = ms["plain"], ms["per_document"]
        print(json.dumps(dict(row, mode=mode.__name__, threads=torch.get_num_threads(), plain_ms=round(plain_min, 2),
                              per_document_ms=round(doc_min, 2), overhead=round(doc_min / plain_min - 1, 4),
                              plain_median_ms=round(plain_med, 2), per_document_median_ms=round(doc_med, 2))),
              flush=True)


if __name__ == "__main__":
    main()
