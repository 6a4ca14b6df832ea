"""`hf-deltamatch plot RUN_DIR...`: loss curves of several runs in one PNG, plus a markdown summary table.

Reads each run's metrics.jsonl (written by the training loop): train loss (EMA-smoothed) and validation CE
against tokens seen, and a bottom panel with the difference to the first run (the paper's way of showing
FP8-vs-BF16 gaps). Runs trained with --attn_stats also get OUT_attn.png: per attention layer, sink mass, the dS
row-sum residual and max |logit| against steps (training/attn_stats.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_run(run_dir: str | Path) -> dict:
    p = Path(run_dir)
    path = p / "metrics.jsonl" if p.is_dir() else p
    if not path.is_file() or path.name != "metrics.jsonl":
        raise FileNotFoundError(f"{run_dir}: no metrics.jsonl (is it a run directory of recipes/pretrain.py?)")
    recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    summary = {}
    if (path.parent / "summary.json").is_file():
        summary = json.loads((path.parent / "summary.json").read_text())
    name = summary.get("name") or path.parent.name
    return {
        "name": name,
        "train": [r for r in recs if r.get("kind") == "train"],
        "eval": [r for r in recs if r.get("kind") == "eval"],
        "attn": [r for r in recs if r.get("kind") == "attn"],
        "summary": summary,
    }


def _ema(xs, alpha):
    out, m = [], None
    for x in xs:
        m = x if m is None else alpha * m + (1 - alpha) * x
        out.append(m)
    return out


def plot_runs(runs: list[dict], out: Path, smooth: float = 0.8, x: str = "tokens", title: str | None = None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the gap panel compares runs with the first: with one run there is nothing to draw there
    if len(runs) > 1:
        fig, (ax, ax_d) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    else:
        fig, ax = plt.subplots(figsize=(8, 5))
        ax_d = None
    base = None
    for i, run in enumerate(runs):
        color = f"C{i}"
        tr = [r for r in run["train"] if r.get("loss") is not None]
        if tr:
            xs = [r[x] for r in tr]
            ys = _ema([r["loss"] for r in tr], smooth)
            ax.plot(xs, ys, color=color, lw=1.4, label=f"{run['name']} train")
        ev = run["eval"]
        if ev:
            ax.plot([r[x] for r in ev], [r["val_loss"] for r in ev], "o--", color=color, ms=3.5, lw=1,
                    label=f"{run['name']} val")
        if tr:
            if base is None:
                base = dict(zip(xs, ys))
                base_name = run["name"]
            else:
                common = [(xx, yy - base[xx]) for xx, yy in zip(xs, ys) if xx in base]
                if common:
                    ax_d.plot([c[0] for c in common], [c[1] for c in common], color=color, lw=1.2,
                              label=f"{run['name']} - {base_name}")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(title or "training loss (EMA %.2f) and validation CE" % smooth)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    xlabel = "tokens" if x == "tokens" else "optimizer step"
    if ax_d is None:
        ax.set_xlabel(xlabel)
    else:
        ax_d.axhline(0, color="k", lw=0.8)
        ax_d.set_ylabel("train loss gap")
        ax_d.set_xlabel(xlabel)
        ax_d.grid(alpha=0.3)
        if ax_d.lines[1:]:
            ax_d.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


ATTN_PANELS = (("sink_mass", "sink mass (first token)", "linear"),
               ("ds_residual", "dS row-sum residual (relative)", "log"),
               ("max_abs_logit", "max |logit|", "linear"))


def plot_attn_stats(runs: list[dict], out: Path, x: str = "step"):
    """One panel per statistic; a line per (run, layer); the title counts non-finite entries seen."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(ATTN_PANELS), 1, figsize=(10, 8), sharex=True)
    styles = ("-", "--", ":", "-.")
    for i, run in enumerate(runs):
        layers = sorted({r["layer"] for r in run["attn"]})
        for j, layer in enumerate(layers):
            recs = [r for r in run["attn"] if r["layer"] == layer]
            for ax, (key, _, _) in zip(axes, ATTN_PANELS):
                pts = [(r[x], r[key]) for r in recs if r.get(key) is not None]
                # one legend entry per run (its colour); layers differ by line style, named in the title
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[j % len(styles)], color=f"C{i}", lw=1.2,
                        marker="o", ms=2.5, label=run["name"] if j == 0 else None)
    for ax, (_, label, scale) in zip(axes, ATTN_PANELS):
        ax.set_ylabel(label, fontsize=9)
        ax.set_yscale(scale)
        ax.grid(alpha=0.3, which="both")
    # outside the panels: with many runs an inside legend hides the curves
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("tokens" if x == "tokens" else "optimizer step")
    bad = sum(r.get("nonfinite", 0) for run in runs for r in run["attn"])
    axes[0].set_title(f"attention per layer (line style: layer, {' '.join(styles)} repeating; one head per "
                      f"sample); non-finite entries seen: {bad}", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _loss_at(train: list[dict], step: int, window: int = 5):
    """Mean train loss over the last `window` records at or before `step` (runs stopped by a time limit end at
    different steps; this compares them at the same one)."""
    recs = [r["loss"] for r in train if r["step"] <= step and r.get("loss") is not None][-window:]
    return sum(recs) / len(recs) if recs else None


def table_markdown(runs: list[dict]) -> str:
    # the last step every run logged (time-limited runs stop at different steps)
    step_sets = [{r["step"] for r in run["train"]} for run in runs if run["train"]]
    common = max(set.intersection(*step_sets), default=0) if step_sets else 0
    if not common and step_sets:  # different logging steps: fall back to the shortest run's last step
        common = min(max(st) for st in step_sets)
    rows = ["| run | attn | precision | delta | steps | tokens | first loss | final train loss | final val CE "
            f"| train loss @ step {common} | tokens/s | peak mem GiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        s, tr, ev = run["summary"], run["train"], run["eval"]

        def f(v, fmt):
            return fmt.format(v) if isinstance(v, (int, float)) else "—"

        tps = [r["tokens_per_s"] for r in tr[1:]] or [r["tokens_per_s"] for r in tr]
        rows.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            run["name"], s.get("attn", "—"), s.get("precision", "—") if s.get("attn") == "deltamatch_fp8" else "—",
            s.get("delta", "—") if s.get("attn") == "deltamatch_fp8" else "—",
            tr[-1]["step"] if tr else "—", f(tr[-1]["tokens"] if tr else None, "{:,}"),
            f(tr[0]["loss"] if tr else None, "{:.4f}"), f(tr[-1]["loss"] if tr else None, "{:.4f}"),
            f(ev[-1]["val_loss"] if ev else None, "{:.4f}"), f(_loss_at(tr, common), "{:.4f}"),
            f(sum(tps) / len(tps) if tps else None, "{:,.0f}"),
            f(max((r["mem_gb"] for r in tr), default=None), "{:.1f}")))
    return "\n".join(rows) + "\n"


def plot_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hf-deltamatch plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories (each with metrics.jsonl)")
    p.add_argument("-o", "--out", default="loss_curves.png", help="PNG to write")
    p.add_argument("--table", help="also write a markdown summary table here")
    p.add_argument("--x", choices=("tokens", "step"), default="tokens")
    p.add_argument("--smooth", type=float, default=0.8, help="EMA factor for train loss (0 = raw)")
    p.add_argument("--title")
    a = p.parse_args(argv)
    try:
        runs = [read_run(r) for r in a.runs]
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not any(r["train"] for r in runs):
        print("error: no training records in any of the runs", file=sys.stderr)
        return 2
    plot_runs(runs, Path(a.out), smooth=a.smooth, x=a.x, title=a.title)
    print(f"wrote {a.out}")
    if any(r["attn"] for r in runs):
        attn_png = Path(a.out).with_name(Path(a.out).stem + "_attn.png")
        plot_attn_stats(runs, attn_png, x=a.x)
        print(f"wrote {attn_png}")
    if a.table:
        Path(a.table).parent.mkdir(parents=True, exist_ok=True)
        Path(a.table).write_text(table_markdown(runs))
        print(f"wrote {a.table}")
    return 0


if __name__ == "__main__":
    sys.exit(plot_main(sys.argv[1:]))
