"""`hf-deltamatch`: check (the invariant demo), plot (training runs), eval (lm-eval + RULER), card (model cards), plan
(the kernels' plan for a shape)."""

from __future__ import annotations

import argparse
import sys
import time


def check_main(argv: list[str]) -> int:
    from . import diagnostics

    parser = argparse.ArgumentParser(
        prog="hf-deltamatch check",
        description="Show, on one attention problem, that stale delta breaks softmax's zero-row-sum invariant "
                    "and Delta-Matching keeps it (fp8 matching vs fp8 stale vs bf16, against float64 exact).")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block", type=int, default=128, choices=(64, 128))
    parser.add_argument("--profile", default="all", choices=(*diagnostics.PROFILES, "all"))
    parser.add_argument("--full", action="store_true", help="bidirectional attention instead of causal")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--backend", default="auto", choices=("auto", "triton", "reference"))
    parser.add_argument("--model", help="a local transformers causal LM: measure on its real activations (with "
                                        "--data; --seq-len, --batch, --block, --device, --backend apply)")
    parser.add_argument("--data", help="with --model: a .txt or .jsonl ('text' field) file of text to run")
    parser.add_argument("--out", help="with --model: directory for fidelity.json and fidelity.png "
                                      "(default fidelity-MODELNAME)")
    parser.add_argument("--qk-transforms", action="store_true",
                        help="with --model: also fp8-matching with the outlier transforms (Hadamard rotation of q and "
                             "k, K smoothing, both): do they help on this model's q and k?")
    args = parser.parse_args(argv)
    if args.model or args.data:
        from . import fidelity
        from ._quiet_imports import import_transformers_modeling

        import_transformers_modeling()

        return fidelity.check_main(args)
    profiles = diagnostics.PROFILES if args.profile == "all" else (args.profile,)
    print(f"hf-deltamatch check: B={args.batch} H={args.heads} N={args.seq_len} D={args.head_dim} "
          f"{'full' if args.full else 'causal'} block={args.block} seed={args.seed} device={args.device}")
    print("columns: dS row-sum residual ||sum_j dS_ij||/||sum_j |dS_ij|||; relative errors vs float64 exact "
          "attention; ||sum_j dK_j||/||dK|| (0 for exact attention)\n")
    for profile in profiles:
        start = time.time()
        rows = diagnostics.run(profile, batch=args.batch, heads=args.heads, kv_heads=args.kv_heads,
                               n=args.seq_len, d=args.head_dim, seed=args.seed, causal=not args.full,
                               block=args.block, device=args.device, backend=args.backend)
        print(diagnostics.format_table(profile, rows))
        print(f"({time.time() - start:.1f}s)\n")
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _lazy(module: str, func: str, extra: str):
    def call(argv: list[str]) -> int:
        import importlib

        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            print(f"this command needs the '{extra}' extra: pip install 'hf-deltamatch[{extra}]' ({e})",
                  file=sys.stderr)
            return 2
        return getattr(mod, func)(argv)

    return call


COMMANDS = {
    "check": (check_main, "fp8 matching vs stale vs bf16 against float64 exact attention (the invariant demo)"),
    "plot": (_lazy("hf_deltamatch.training.plot", "plot_main", "train"), "loss curves of training runs (PNG)"),
    "eval": (_lazy("hf_deltamatch.eval.cli", "eval_main", "eval"), "lm-eval / RULER with deltamatch_fp8"),
    "card": (_lazy("hf_deltamatch.eval.cli", "card_main", "eval"), "write a Hugging Face model card for a run"),
    "plan": (_lazy("hf_deltamatch.kernels.plan", "main", "triton"), "which kernels run for a shape, how they launch"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: hf-deltamatch COMMAND [ARGS]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<7} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]][0](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
