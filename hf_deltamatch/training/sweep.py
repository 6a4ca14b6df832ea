"""Seed sweeps and their noise floor.

`--seeds 0,1,2` on a recipe runs it once per seed into OUTPUT_DIR/seed-N (same data, same validation split:
`--data_seed` stays fixed) and writes OUTPUT_DIR/seeds.json and seeds.md (final validation CE per seed, mean,
standard deviation, range).

    python -m hf_deltamatch.training.sweep RUNS/bf16 RUNS/fp8-matching RUNS/fp8-stale [--baseline bf16]

compares sweeps (each a directory of seed-N runs): mean ± std per mode, the gap of each mode's mean to the
baseline's, and whether that gap exceeds the baseline's seed range (max - min over its seeds), the noise floor
below which a gap says nothing. With 3 seeds that is a floor, not a significance test.

Seed s is the same initialization and data order in every mode, so the table also gives the paired gap: per
seed both modes ran, the mode's CE minus the baseline's, and the mean ± std of those differences. Pairing
removes the seed-to-seed variation the two modes share, so it can show a consistent sign that the gap of means
hides; with 3 seeds it describes the runs, it is not a test, and the verdict stays the floor rule.

The values are each run's final validation CE (summary.json), or with `--step N` its validation CE at eval
step N (metrics.jsonl): runs that stopped at different steps (a time limit) are comparable only at a step
every one of them evaluated, and the table says so when the final values come from different steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

SEED_DIR = "seed-{}"


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2] (distinct non-negative integers)."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r}: give distinct non-negative integers separated by commas, e.g. 0,1,2.")
    return seeds


def run_seeds(cfg, seeds: list[int]) -> list[dict]:
    """Train `cfg` once per seed into output_dir/seed-N (in this process, one after another); returns the
    summaries and writes the sweep's seeds.json / seeds.md."""
    from accelerate.state import AcceleratorState, GradientState

    from .loop import train

    root = Path(cfg.output_dir)
    summaries = []
    for seed in seeds:
        run = dataclasses.replace(cfg, seed=seed, output_dir=str(root / SEED_DIR.format(seed)),
                                  run_name=f"{cfg.name}-seed{seed}")
        # a fresh Accelerator per run; the process group (multi-process launches) is kept
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        summaries.append(train(run))
        if summaries[-1].get("interrupted"):
            break
        first_tokenizer = root / SEED_DIR.format(seeds[0]) / "tokenizer"
        if cfg.tokenizer == "train" and cfg.model is None and first_tokenizer.is_dir():
            # the first seed's BPE (trained on the same split) for the others: identical tokens, no retraining
            cfg = dataclasses.replace(cfg, tokenizer=str(first_tokenizer))
    write_seed_summary(root)
    return summaries


@dataclasses.dataclass
class SeedStats:
    name: str
    seeds: list[int]
    values: list[float]  # validation CE, one per seed: the final one, or at eval step `step`
    stopped_at: list[int] = dataclasses.field(default_factory=list)  # each run's last step (summary.json)
    eval_steps: list[list[int]] = dataclasses.field(default_factory=list)  # each run's eval steps (metrics.jsonl)
    step: int | None = None

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return sum(self.values) / self.n

    @property
    def std(self) -> float:
        """Sample standard deviation (0 for one seed)."""
        if self.n < 2:
            return 0.0
        return math.sqrt(sum((v - self.mean) ** 2 for v in self.values) / (self.n - 1))

    @property
    def spread(self) -> float:
        """Range over seeds (max - min): the noise floor a gap has to exceed."""
        return max(self.values) - min(self.values)


def _evals(run_dir: Path) -> dict[int, float]:
    """Validation CE by eval step from the run's metrics.jsonl ({} without one)."""
    from .plot import read_run

    if not (run_dir / "metrics.jsonl").is_file():
        return {}
    return {int(r["step"]): float(r["val_loss"]) for r in read_run(run_dir)["eval"]}


def read_sweep(sweep_dir: str | Path, name: str | None = None, step: int | None = None) -> SeedStats:
    """Validation CE of every finished seed-N run under `sweep_dir`: the final one, or at eval step `step`."""
    root = Path(sweep_dir)
    stats = SeedStats(name or root.name, [], [], step=step)
    for d in sorted(root.glob(SEED_DIR.format("*")), key=lambda p: int(p.name.split("-")[1])
                    if p.name.split("-")[1].isdigit() else -1):
        summary = d / "summary.json"
        if not d.name.split("-")[1].isdigit() or not summary.is_file():
            continue
        summary = json.loads(summary.read_text())
        evals = _evals(d)
        if step is None:
            val = summary.get("final_val_loss")
            if val is None:
                raise ValueError(f"{d}: the run has no validation CE (set --val_fraction > 0).")
        elif step in evals:
            val = evals[step]
        else:
            raise ValueError(f"{d}: no validation CE at step {step} in its metrics.jsonl; its eval steps: "
                             f"{sorted(evals) or 'none'}. Pick --step among the steps every run evaluated.")
        stats.seeds.append(int(d.name.split("-")[1]))
        stats.values.append(float(val))
        stats.stopped_at.append(int(summary["steps"]))
        stats.eval_steps.append(sorted(evals))
    if not stats.values:
        raise FileNotFoundError(f"{root}: no finished seed-N runs (seed-N/summary.json); run the recipe with --seeds.")
    return stats


def common_eval_step(modes: list[SeedStats]) -> int | None:
    """The largest step at which every run of every mode evaluated (None if there is none)."""
    common = set.intersection(*(set(s) for m in modes for s in m.eval_steps))
    return max(common, default=None)


def write_seed_summary(root: Path) -> SeedStats:
    stats = read_sweep(root)
    record = {"name": stats.name, "seeds": stats.seeds, "final_val_loss": stats.values, "mean": stats.mean,
              "std": stats.std, "spread": stats.spread}
    (root / "seeds.json").write_text(json.dumps(record, indent=1))
    rows = "".join(f"| {s} | {v:.4f} |\n" for s, v in zip(stats.seeds, stats.values))
    (root / "seeds.md").write_text(
        "| seed | final val CE |\n|---|---|\n" + rows
        + f"\nmean {stats.mean:.4f} ± {stats.std:.4f} (std), range {stats.spread:.4f} over {stats.n} seeds\n")
    return stats


def paired_gaps(mode: SeedStats, base: SeedStats) -> dict:
    """Per seed both ran, mode's CE minus base's; their mean and sample std (None without a shared seed)."""
    base_by_seed = dict(zip(base.seeds, base.values))
    shared = [s for s in mode.seeds if s in base_by_seed]
    gaps = [v - base_by_seed[s] for s, v in zip(mode.seeds, mode.values) if s in base_by_seed]
    diff = SeedStats(mode.name, shared, gaps) if gaps else None
    return {"paired_seeds": shared, "paired_gaps": gaps, "paired_mean": diff.mean if diff else None,
            "paired_std": diff.std if diff else None}


def compare(modes: list[SeedStats], baseline: str) -> list[dict]:
    """Per mode: mean, std, range, gap to the baseline's mean, whether |gap| exceeds the baseline's range, and
    the paired per-seed gaps to the baseline."""
    base = next((m for m in modes if m.name == baseline), None)
    if base is None:
        raise ValueError(f"no sweep named {baseline!r} among {[m.name for m in modes]}; pass --baseline NAME.")
    floor = base.spread
    rows = []
    for m in modes:
        gap = m.mean - base.mean
        paired = paired_gaps(m, base) if m is not base else dict.fromkeys(
            ("paired_seeds", "paired_gaps", "paired_mean", "paired_std"))
        rows.append({"mode": m.name, "seeds": m.seeds, "values": m.values, "step": m.step,
                     "stopped_at": m.stopped_at, "mean": m.mean, "std": m.std, "spread": m.spread, "gap": gap,
                     "floor": floor, "beyond_floor": None if m is base else abs(gap) > floor, **paired})
    return rows


def table_markdown(rows: list[dict], baseline: str, common_step: int | None = None) -> str:
    """The comparison table; `common_step` (common_eval_step) is suggested when final values come from runs
    that stopped at different steps."""
    floor, step = rows[0]["floor"], rows[0]["step"]
    which = "final val CE" if step is None else f"val CE at step {step}"
    lines = [f"| mode | seeds | {which} per seed | mean ± std | range | gap to {baseline} | beyond the floor? "
             f"| paired gap per seed | paired gap mean ± std |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "(baseline)" if r["beyond_floor"] is None else ("**yes**" if r["beyond_floor"] else "no")
        if r["paired_gaps"]:
            per_seed = ", ".join(f"{s}: {g:+.4f}" for s, g in zip(r["paired_seeds"], r["paired_gaps"]))
            paired = f"{r['paired_mean']:+.4f} ± {r['paired_std']:.4f}"
        else:
            per_seed = paired = "(baseline)" if r["beyond_floor"] is None else "no shared seed"
        lines.append(f"| {r['mode']} | {len(r['values'])} | "
                     f"{', '.join(f'{v:.4f}' for v in r['values'])} | {r['mean']:.4f} ± {r['std']:.4f} | "
                     f"{r['spread']:.4f} | {r['gap']:+.4f} | {verdict} | {per_seed} | {paired} |")
    source = ("final validation CE (summary.json)" if step is None
              else f"validation CE at eval step {step} (metrics.jsonl)")
    lines.append(f"\nValues: each run's {source}.")
    lines.append(f"Noise floor: the range of {baseline}'s seeds, {floor:.4f} nats. A gap within it is not evidence. "
                 f"Paired gap: per seed, the mode's CE minus {baseline}'s (same initialization and data order); "
                 f"with few seeds it describes the runs, it is not a test.")
    stopped = sorted({s for r in rows for s in r["stopped_at"]})
    if step is None and len(stopped) > 1:
        hint = (f"compare at a common step with --step {common_step}, the largest step every run evaluated"
                if common_step is not None else "no step was evaluated by every run")
        lines.append(f"**The runs stopped at different steps ({', '.join(map(str, stopped))}): their final values "
                     f"are not comparable;** {hint}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltamatch.training.sweep",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="sweep directories (each with seed-N runs); the name is the directory's")
    p.add_argument("--baseline", default="bf16", help="the sweep whose seed range is the noise floor")
    p.add_argument("--step", type=int, help="compare each run's validation CE at this eval step (metrics.jsonl) "
                   "instead of its final one")
    p.add_argument("--table", help="also write the markdown table here")
    p.add_argument("--json", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    try:
        modes = [read_sweep(d, step=a.step) for d in a.sweeps]
        rows = compare(modes, a.baseline)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table_markdown(rows, a.baseline, common_eval_step(modes))
    print(text, end="")
    for path, content in ((a.table, text), (a.json, json.dumps(rows, indent=1))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
