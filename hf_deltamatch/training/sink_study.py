"""Analysis of the sinks-task study (recipes/sinks_study.sh): attention modes trained on a task where sinks form.

    python -m hf_deltamatch.training.sink_study RUNS_DIR --out OUT_DIR [--fidelity FID_DIR] [--baseline bf16]

RUNS_DIR holds one directory per mode (bf16, fp8-matching, fp8-stale, ...), each with the seed-N runs of the recipe
(`--seeds`) on a generated task (`data: bigram_backcopy`) trained with `--attn_stats`. Per run:
  val_loss           final validation CE over all tokens of the fixed validation set
  val_acc            final top-1 accuracy of the task's targets (the copies after the triggers)
  max_sink_mass      largest sink mass the monitor recorded, over steps and layers
  final_ds_residual  the dS row-sum residual at the last monitored step, in the layer where it is largest
Writes into OUT_DIR:
  summary.json     {"modes": {MODE: {"val_loss": [per seed], "val_acc": [...], "max_sink_mass": [...],
                    "final_ds_residual": [...]}, ...}, "steps": N, "conclusion": "..."}; seeds in ascending order
  results.md       per mode mean ± std and range of each value, its gap to the baseline's mean against the noise
                   floor, how long sinks held, and with --fidelity the `hf-deltamatch check --model` errors of the
                   final checkpoints per layer (FID_DIR/MODE/seed-N/fidelity.json)
  sink_mass.png, ds_residual.png (per layer, against steps), val.png (validation CE and accuracy against steps):
  mean over seeds, the band their range
The noise floor of a value is the baseline's seed range (max - min); for the accuracy at least one target of the
validation set (1 / val_targets), its resolution. A gap counts only beyond it; with 3 seeds that is a floor, not a
significance test (hf_deltamatch/training/sweep.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .plot import read_run
from .sweep import SEED_DIR

METRICS = ("val_loss", "val_acc", "max_sink_mass", "final_ds_residual")
STRONG_SINK = 0.9  # the sink mass above which the study calls a sink strong


class StudyError(ValueError):
    """The runs cannot be analysed as they are (missing, unfinished, or not comparable)."""


# ---------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------


def _seed_dirs(mode_dir: Path) -> list[Path]:
    dirs = [d for d in mode_dir.glob(SEED_DIR.format("*")) if d.is_dir() and d.name.split("-", 1)[1].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name.split("-", 1)[1]))


def read_seed(run_dir: Path) -> dict:
    """One run's values (METRICS), its curves and its step count."""
    if not (run_dir / "summary.json").is_file():
        raise StudyError(f"{run_dir}: no summary.json, the run did not finish; run the study again (it resumes).")
    run = read_run(run_dir)
    evals = [r for r in run["eval"] if "val_acc" in r]
    if not evals:
        raise StudyError(f"{run_dir}: no validation accuracy in metrics.jsonl; the study needs a generated task "
                         "(data: bigram_backcopy) and a validation set.")
    attn = [r for r in run["attn"] if r.get("sink_mass") is not None]
    if not attn:
        raise StudyError(f"{run_dir}: no attention statistics in metrics.jsonl; train with --attn_stats N.")
    last = max(r["step"] for r in attn)
    residuals = [r["ds_residual"] for r in attn if r["step"] == last]
    by_step: dict[int, float] = {}
    for r in attn:
        by_step[r["step"]] = max(by_step.get(r["step"], 0.0), r["sink_mass"])
    return {
        "seed": int(run_dir.name.split("-", 1)[1]),
        "steps": int(run["summary"]["steps"]),
        "val_loss": evals[-1]["val_loss"],
        "val_acc": evals[-1]["val_acc"],
        "val_targets": evals[-1].get("val_targets"),
        "max_sink_mass": max(r["sink_mass"] for r in attn),
        # None where the captured operands were non-finite (the monitor then measures no residual)
        "final_ds_residual": None if any(x is None for x in residuals) else max(residuals),
        "strong_sink_share": sum(v >= STRONG_SINK for v in by_step.values()) / len(by_step),
        "first_strong_step": min((s for s, v in by_step.items() if v >= STRONG_SINK), default=None),
        "evals": evals,
        "attn": attn,
    }


def read_study(runs_dir: str | Path, modes: list[str] | None = None) -> dict[str, list[dict]]:
    """{mode: [read_seed of each seed-N run]} for the mode directories under runs_dir (in `modes` order)."""
    root = Path(runs_dir)
    if modes is None:
        modes = sorted(d.name for d in root.iterdir() if d.is_dir() and _seed_dirs(d)) if root.is_dir() else []
    if not modes:
        raise StudyError(f"{root}: no mode directories with seed-N runs (e.g. {root}/bf16/seed-0).")
    study = {}
    for mode in modes:
        seeds = _seed_dirs(root / mode)
        if not seeds:
            raise StudyError(f"{root / mode}: no seed-N runs.")
        study[mode] = [read_seed(d) for d in seeds]
    steps = {r["steps"] for runs in study.values() for r in runs}
    if len(steps) != 1:
        where = ", ".join(f"{m}/seed-{r['seed']}: {r['steps']}" for m, runs in study.items() for r in runs)
        raise StudyError(f"the runs stopped at different steps ({where}); their final values are not comparable. "
                         "Finish them (run the study again: it resumes) before the analysis.")
    return study


# ---------------------------------------------------------------------------------------------------------
# Statistics and the conclusion
# ---------------------------------------------------------------------------------------------------------


def _stats(values: list[float | None]) -> dict | None:
    xs = [v for v in values if v is not None and math.isfinite(v)]
    if not xs:
        return None
    mean = sum(xs) / len(xs)
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return {"n": len(xs), "mean": mean, "std": std, "min": min(xs), "max": max(xs), "range": max(xs) - min(xs)}


def summary(study: dict[str, list[dict]]) -> dict:
    """The summary.json record without its conclusion."""
    return {"modes": {mode: {m: [r[m] for r in runs] for m in METRICS} for mode, runs in study.items()},
            "steps": next(iter(study.values()))[0]["steps"]}


def compare(study: dict[str, list[dict]], baseline: str) -> dict:
    """Per value (val_loss, val_acc) and mode: stats, gap to the baseline's mean, floor, beyond the floor."""
    if baseline not in study:
        raise StudyError(f"no mode named {baseline!r} among {list(study)}; pass --baseline MODE.")
    base = study[baseline]
    targets = [r["val_targets"] for r in base if r.get("val_targets")]
    floors = {"val_loss": _stats([r["val_loss"] for r in base])["range"],
              "val_acc": max(_stats([r["val_acc"] for r in base])["range"], 1 / min(targets) if targets else 0.0)}
    out = {}
    for key in ("val_loss", "val_acc"):
        base_mean = _stats([r[key] for r in base])["mean"]
        rows = {}
        for mode, runs in study.items():
            st = _stats([r[key] for r in runs])
            gap = st["mean"] - base_mean
            rows[mode] = {**st, "gap": gap, "floor": floors[key],
                          "beyond": None if mode == baseline else abs(gap) > floors[key]}
        out[key] = rows
    return out


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "n/a" if x is None else format(x, spec)


def conclusion(study: dict[str, list[dict]], baseline: str) -> str:
    """The study's conclusion in words, computed from the values and their noise floors."""
    cmp = compare(study, baseline)
    counts = sorted({len(r) for r in study.values()})
    n_seeds = counts[0]
    seeds = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    parts = [f"{summary(study)['steps']} steps, {seeds} seeds per mode, baseline {baseline}."]
    sink = {m: _stats([r["max_sink_mass"] for r in runs]) for m, runs in study.items()}
    share = {m: _stats([r["strong_sink_share"] for r in runs]) for m, runs in study.items()}
    parts.append("Sinks: max sink mass " + "; ".join(
        f"{m} {sink[m]['mean']:.3f} (min {sink[m]['min']:.3f}), >= {STRONG_SINK} on {share[m]['mean']:.0%} of the "
        f"monitored steps" for m in study) + ".")
    weak = [m for m in study if sink[m]["min"] < STRONG_SINK]
    if weak:
        parts.append(f"Caveat: some seeds of {', '.join(weak)} never reached a sink mass of {STRONG_SINK}, so the "
                     "study's premise (strong sinks for much of training) does not hold for them.")
    res = {m: _stats([r["final_ds_residual"] for r in runs]) for m, runs in study.items()}
    parts.append("Final dS row-sum residual (worst layer): " + "; ".join(
        f"{m} {_fmt(res[m]['mean'] if res[m] else None, '.2e')}" for m in study) + ".")
    verdicts = []
    for key, name, worse in (("val_loss", "validation loss", 1), ("val_acc", "task accuracy", -1)):
        rows = cmp[key]
        b = rows[baseline]
        text = [f"{name.capitalize()}: {baseline} {b['mean']:.4f} ± {b['std']:.4f} (noise floor {b['floor']:.4f})"]
        for m, r in rows.items():
            if m == baseline:
                continue
            direction = "worse" if r["gap"] * worse > 0 else "better"
            text.append(f"{m} {r['mean']:.4f} ± {r['std']:.4f}, gap {r['gap']:+.4f} "
                        f"({'beyond the floor, ' + direction if r['beyond'] else 'within the floor'})")
            if r["beyond"]:
                verdicts.append(f"{m} is {direction} than {baseline} in {name} by {abs(r['gap']):.4f}, beyond "
                                f"{baseline}'s seed spread ({r['floor']:.4f})")
        parts.append("; ".join(text) + ".")
    if verdicts:
        parts.append("Verdict: " + "; ".join(verdicts) + ".")
    else:
        parts.append(f"Verdict: no mode differs from {baseline} beyond {baseline}'s seed spread in validation loss "
                     "or task accuracy.")
    if n_seeds < 3:
        parts.append(f"With {n_seeds} seed(s) per mode the floor is barely a measurement.")
    return " ".join(parts)


# ---------------------------------------------------------------------------------------------------------
# Fidelity of the final checkpoints (hf-deltamatch check --model)
# ---------------------------------------------------------------------------------------------------------

FIDELITY_MODES = ("fp8-matching", "fp8-stale", "bf16")


def fidelity_table(fid_dir: str | Path, modes: list[str]) -> str:
    """Per trained mode and layer: sink mass and dQ/dK errors against float64 of each attention numerics, mean ±
    std over the seeds' final checkpoints."""
    root = Path(fid_dir)
    lines = ["| trained as | layer | checkpoints | sink mass | " + " | ".join(
        f"{g} err {m}" for g in ("dQ", "dK") for m in FIDELITY_MODES) + " | dS residual fp8-stale |",
        "|---|---|---|---|" + "---|" * (2 * len(FIDELITY_MODES) + 1)]
    found = False
    for mode in modes:
        reports = [json.loads(p.read_text()) for p in sorted((root / mode).glob("seed-*/fidelity.json"))]
        if not reports:
            continue
        found = True
        for i, layer in enumerate(reports[0]["layers"]):
            rows = [rep["layers"][i] for rep in reports]

            def cell(get):
                st = _stats([get(r) for r in rows])
                return "n/a" if st is None else f"{st['mean']:.4g} ± {st['std']:.2g}"

            errors = " | ".join(cell(lambda r, g=g, m=m: r["modes"][m][g])
                                for g in ("err_dq", "err_dk") for m in FIDELITY_MODES)
            lines.append(f"| {mode} | {layer['layer']} | {len(rows)} | {cell(lambda r: r['sink_mass'])} | {errors} | "
                         f"{cell(lambda r: r['modes']['fp8-stale']['ds_residual'])} |")
    if not found:
        raise StudyError(f"{root}: no MODE/seed-N/fidelity.json (hf-deltamatch check --model ... --out).")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------


def _band(ax, runs: list[dict], series, color: str, label: str, log: bool = False) -> list[float]:
    """Mean over seeds at the steps all of them have, and the min-max band; returns the values drawn."""
    curves = [dict(series(r)) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    steps = [s for s in steps if all(curves[i][s] is not None for i in range(len(curves)))]
    if not steps:
        return []
    vals = [[c[s] for c in curves] for s in steps]
    mean = [math.exp(sum(math.log(max(x, 1e-300)) for x in v) / len(v)) if log else sum(v) / len(v) for v in vals]
    ax.plot(steps, mean, color=color, lw=1.4, label=label)
    if any(min(v) < max(v) for v in vals):  # (one seed, or seeds that agree: no band)
        ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=color, alpha=0.2, lw=0)
    return [x for v in vals for x in v if not log or x > 0]


def plot_study(study: dict[str, list[dict]], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({r["layer"] for runs in study.values() for run in runs for r in run["attn"]})
    written = []
    for key, ylabel, log, name in (("sink_mass", "sink mass (attention on <bos>)", False, "sink_mass.png"),
                                   ("ds_residual", "dS row-sum residual (relative)", True, "ds_residual.png")):
        fig, axes = plt.subplots(len(layers), 1, figsize=(9, 2.6 * len(layers) + 0.6), sharex=True, squeeze=False)
        for ax, layer in zip(axes[:, 0], layers):
            ys = []
            for i, (mode, runs) in enumerate(study.items()):
                ys += _band(ax, runs, lambda run: [(r["step"], r[key]) for r in run["attn"] if r["layer"] == layer],
                            f"C{i}", mode, log=log)
            ax.set_ylabel(f"layer {layer}", fontsize=9)
            if log:
                lo, hi = min(ys, default=1.0), max(ys, default=1.0)
                ax.set_ylim(lo / 2, hi * 2)  # explicit: matplotlib cannot autoscale an axis of one value
                ax.set_yscale("log")
            else:
                ax.set_ylim(-0.02, 1.02)
                ax.axhline(STRONG_SINK, color="k", lw=0.6, ls=":")
            ax.grid(alpha=0.3, which="both")
        axes[0, 0].legend(fontsize=8)
        axes[0, 0].set_title(f"{ylabel}: {'geometric ' if log else ''}mean over seeds, band min-max", fontsize=9)
        axes[-1, 0].set_xlabel("optimizer step")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for ax, (key, ylabel) in zip(axes, (("val_loss", "validation CE (all tokens)"),
                                        ("val_acc", "task accuracy (copy targets)"))):
        for i, (mode, runs) in enumerate(study.items()):
            _band(ax, runs, lambda run: [(r["step"], r[key]) for r in run["evals"]], f"C{i}", mode)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[0].set_title("validation on the fixed set: mean over seeds, band min-max", fontsize=9)
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(out / "val.png", dpi=110)
    plt.close(fig)
    written.append(out / "val.png")
    return written


# ---------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------


def results_markdown(study: dict[str, list[dict]], baseline: str, fidelity: str | None = None) -> str:
    cmp = compare(study, baseline)
    lines = ["| mode | seeds | val CE mean ± std | range | gap | beyond floor | val acc mean ± std | range | gap "
             "| beyond floor | max sink mass | steps with sink >= 0.9 | first step >= 0.9 | final dS residual |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, runs in study.items():
        lo, ac = cmp["val_loss"][mode], cmp["val_acc"][mode]
        sink, share = _stats([r["max_sink_mass"] for r in runs]), _stats([r["strong_sink_share"] for r in runs])
        res = _stats([r["final_ds_residual"] for r in runs])
        first = [r["first_strong_step"] for r in runs]

        def verdict(r):
            return "(baseline)" if r["beyond"] is None else ("**yes**" if r["beyond"] else "no")

        lines.append(
            f"| {mode} | {', '.join(str(r['seed']) for r in runs)} | {lo['mean']:.4f} ± {lo['std']:.4f} | "
            f"{lo['range']:.4f} | {lo['gap']:+.4f} | {verdict(lo)} | {ac['mean']:.4f} ± {ac['std']:.4f} | "
            f"{ac['range']:.4f} | {ac['gap']:+.4f} | {verdict(ac)} | {sink['mean']:.3f} ± {sink['std']:.3f} | "
            f"{share['mean']:.0%} | {', '.join('never' if f is None else str(f) for f in first)} | "
            f"{_fmt(res['mean'] if res else None, '.2e')} |")
    floor = cmp["val_loss"][baseline]["floor"], cmp["val_acc"][baseline]["floor"]
    text = ["| mode | seed | val CE | val acc | max sink mass | final dS residual |", "|---|---|---|---|---|---|"]
    for mode, runs in study.items():
        for r in runs:
            text.append(f"| {mode} | {r['seed']} | {r['val_loss']:.4f} | {r['val_acc']:.4f} | "
                        f"{r['max_sink_mass']:.3f} | {_fmt(r['final_ds_residual'], '.2e')} |")
    out = ["## Per mode", "", *lines, "",
           f"Noise floors: {baseline}'s seed range, {floor[0]:.4f} nats of validation CE and {floor[1]:.4f} of "
           "accuracy (at least one target of the validation set). A gap within its floor is not evidence. Sink mass: "
           "the monitor's, on one batch row every --attn_stats steps (training/attn_stats.py); final dS residual: "
           "its last measurement, worst layer.", "", "## Per run", "", *text, ""]
    if fidelity:
        out += ["## Gradient fidelity of the final checkpoints (hf-deltamatch check --model)", "",
                "Errors are relative (Frobenius) against float64 exact attention on the model's own activations on "
                "validation sequences; mean ± std over the seeds' checkpoints.", "", fidelity]
    out += ["## Plots", "", "![sink mass](sink_mass.png)", "", "![dS residual](ds_residual.png)", "",
            "![validation](val.png)", ""]
    return "\n".join(out)


def analyse(runs_dir, out_dir, baseline: str = "bf16", fidelity_dir=None, modes: list[str] | None = None) -> dict:
    """Read the study, write summary.json, results.md and the plots; returns the summary."""
    study = read_study(runs_dir, modes)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {**summary(study), "conclusion": conclusion(study, baseline)}
    fid = fidelity_table(fidelity_dir, list(study)) if fidelity_dir is not None else None
    plot_study(study, out)
    (out / "summary.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / "results.md").write_text(f"# Sinks-task study\n\n{record['conclusion']}\n\n"
                                    + results_markdown(study, baseline, fid))
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltamatch.training.sink_study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", help="directory of mode directories, each with seed-N runs")
    p.add_argument("--out", required=True, help="where summary.json, results.md and the plots go")
    p.add_argument("--baseline", default="bf16", help="the mode whose seed range is the noise floor")
    p.add_argument("--modes", help="modes in order, comma-separated (default: every mode directory, sorted)")
    p.add_argument("--fidelity", help="directory of MODE/seed-N/fidelity.json from hf-deltamatch check --model")
    a = p.parse_args(argv)
    try:
        record = analyse(a.runs, a.out, a.baseline, a.fidelity, a.modes.split(",") if a.modes else None)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(record["conclusion"])
    print(f"wrote {Path(a.out) / 'summary.json'}, results.md, sink_mass.png, ds_residual.png, val.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
