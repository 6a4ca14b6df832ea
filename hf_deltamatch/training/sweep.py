"""Seed sweeps and their noise floor.

`--seeds 0,1,2` on a recipe runs it once per seed into OUTPUT_DIR/seed-N (same data, same validation split:
`--data_seed` stays fixed) and writes OUTPUT_DIR/seeds.json and seeds.md (final validation CE per seed, mean,
standard deviation, range).

    python -m hf_deltamatch.training.sweep RUNS/bf16 RUNS/fp8-matching RUNS/fp8-stale [--baseline bf16]

compares sweeps (each a directory of seed-N runs): mean ± std per mode, the gap of each mode's mean to the
baseline's, and whether that gap exceeds the baseline's seed range (max - min over its seeds), the noise floor
below which a gap says nothing. With 3 seeds that is a floor, not a significance test.
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
    values: list[float]  # final validation CE, one per seed

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


def read_sweep(sweep_dir: str | Path, name: str | None = None) -> SeedStats:
    """Final validation CE of every finished seed-N run under `sweep_dir`."""
    root = Path(sweep_dir)
    seeds, values = [], []
    for d in sorted(root.glob(SEED_DIR.format("*")), key=lambda p: int(p.name.split("-")[1])
                    if p.name.split("-")[1].isdigit() else -1):
        summary = d / "summary.json"
        if not d.name.split("-")[1].isdigit() or not summary.is_file():
            continue
        val = json.loads(summary.read_text()).get("final_val_loss")
        if val is None:
            raise ValueError(f"{d}: the run has no validation CE (set --val_fraction > 0).")
        seeds.append(int(d.name.split("-")[1]))
        values.append(float(val))
    if not values:
        raise FileNotFoundError(f"{root}: no finished seed-N runs (seed-N/summary.json); run the recipe with --seeds.")
    return SeedStats(name or root.name, seeds, values)


def write_seed_summary(root: Path) -> SeedStats:
    stats = read_sweep(root)
    record = {"name": stats.name, "seeds": stats.seeds, "final_val_loss": stats.values, "mean": stats.mean,
              "std": stats.std, "spread": stats.spread}
    (root / "seeds.json").write_text(json.dumps(record, indent=1))
    rows = "".join(f"| {s} | {v:.4f} |\n" for s, v in zip(stats.seeds, stats.values))
    (root / "seeds.md").write_text(
        "| seed | final val CE |\n|---|---|\n" + rows + f"\nmean {stats.mean:.4f} ± {stats.std:.4f} (std), range {stats.spread:.4f} over {stats.n} seeds\n")
    return stats


def compare(modes: list[SeedStats], baseline: str) -> list[dict]:
    """Per mode: mean, std, range, gap to the baseline's mean, and whether |gap| exceeds the baseline's range."""
    base = next((m for m in modes if m.name == baseline), None)
    if base is None:
        raise ValueError(f"no sweep named {baseline!r} among {[m.name for m in modes]}; pass --baseline NAME.")
    floor = base.spread
    rows = []
    for m in modes:
        gap = m.mean - base.mean
        rows.append({"mode": m.name, "seeds": m.seeds, "values": m.values, "mean": m.mean, "std": m.std,
                     "spread": m.spread, "gap": gap, "floor": floor,
                     "beyond_floor": None if m is base else abs(gap) > floor})
    return rows


def table_markdown(rows: list[dict], baseline: str) -> str:
    floor = rows[0]["floor"]
    lines = [f"| mode | seeds | final val CE per seed | mean ± std | range | gap to {baseline} | beyond the floor? |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        verdict = "(baseline)" if r["beyond_floor"] is None else ("**yes**" if r["beyond_floor"] else "no")
        lines.append(f"| {r['mode']} | {len(r['values'])} | "
                     f"{', '.join(f'{v:.4f}' for v in r['values'])} | {r['mean']:.4f} ± {r['std']:.4f} | "
                     f"{r['spread']:.4f} | {r['gap']:+.4f} | {verdict} |")
    lines.append(f"\nNoise floor: the range of {baseline}'s seeds, {floor:.4f} nats. A gap within it is not evidence.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hf_deltamatch.training.sweep",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweeps", nargs="+", help="sweep directories (each with seed-N runs); the name is the directory's")
    p.add_argument("--baseline", default="bf16", help="the sweep whose seed range is the noise floor")
    p.add_argument("--table", help="also write the markdown table here")
    p.add_argument("--json", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    try:
        rows = compare([read_sweep(d) for d in a.sweeps], a.baseline)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table_markdown(rows, a.baseline)
    print(text, end="")
    for path, content in ((a.table, text), (a.json, json.dumps(rows, indent=1))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(content)
    return 0


if __name__ == "__main__":
    sys.exit(main())
