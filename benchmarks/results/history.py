#!/usr/bin/env python
"""Append benchmark runs to history.csv: one row per (preset or model, implementation, metric) of a run.

    python benchmarks/results/history.py RESULT_FILE...          # append one run's rows
    python benchmarks/results/history.py --seed CHECKOUT_ROOT     # rebuild from every run under CHECKOUT_ROOT's results

Reads what the benchmarks write:
- `benchmarks/attention.py`: its JSON, or its markdown report where no JSON was kept (the report is also what the
  script prints, so a log of a run holds it). Rows: every op's fwd+bwd ms per shape (`fwdbwd_ms`), and with
  `--cuda-graph` the graph replay's (`graph_fwdbwd_ms`).
- `benchmarks/train_throughput.py`: its JSON. Rows: tokens/s per configuration (`tokens_per_s`). From a suite's
  `train_step.json` (issue #45's schema) also the peak memory (`peak_gib`), per model, N x batch (and "packed") and
  implementation (attention, linears, eager or compiled); its `-detail.json` repeats those runs and is not read.

`ratio` is the row's value over its baseline's, the same metric in the same run (files given in one call are one
run): for ms a time ratio (< 1 = faster), for tokens/s a throughput ratio (> 1 = faster). The baseline is SDPA
cuDNN BF16 (attention.py's ratio base) where it ran on that shape, else Flex (windows); for a training step, `sdpa`
with bf16 linears and eager norms, else `torch_varlen` (FlashAttention-2 varlen); in a train_step.json, each row's
`ratio_base` of the same model, shape, packing, linears and compilation (for peak_gib the ratio is of memory, < 1 =
less). `baseline` names it.
`commit` is the one the result file records, `+dirty` where the tree had uncommitted changes. Rows already in the CSV
(same date, GPU, preset or model, implementation and metric: the same run read from another copy) are not added
again, and a markdown report of a run whose JSON was read is skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CSV_PATH = Path(__file__).resolve().parent / "history.csv"
COLUMNS = ["date", "commit", "gpu", "torch", "triton", "preset_or_model", "implementation", "metric", "value",
           "ratio", "baseline", "source"]
ATTENTION_BASES = ("sdpa-cudnn", "flex")
# train_throughput.py's --settings: the recipe model each names
TRAIN_SETTINGS = {"8k": "hybrid-1p7b 8k", "64k": "hybrid-1p7b 64k"}


def _date(text: str) -> str:
    return text.replace(" UTC", "").replace("T", " ").rstrip("Z")[:16]


def _commit(env: dict) -> str:
    commit = (env.get("git_commit") or "")[:7]
    return commit + ("+dirty" if env.get("git_dirty") and commit else "")


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.4f}" if base else ""


def _row(run: dict, preset: str, impl: str, metric: str, value: float, ratio: str, baseline: str) -> dict:
    return {**run, "preset_or_model": preset, "implementation": impl, "metric": metric,
            "value": f"{value:.6g}", "ratio": ratio, "baseline": baseline}


# ---- attention.py --------------------------------------------------------------------------------------------


def attention_json(report: dict) -> tuple[dict, list[tuple[str, str, dict]]]:
    """(run fields, [(shape, op, {metric: value})]) of an attention.py JSON report."""
    env, meta = report.get("environment", {}), report.get("meta", {})
    run = {"date": _date(meta.get("date", "")), "commit": _commit(env), "gpu": env.get("gpu", ""),
           "torch": env.get("torch", ""), "triton": env.get("triton", "")}
    tune = meta.get("tune") or {}
    suffix = f" [TUNE {json.dumps(tune, sort_keys=True)}]" if tune else ""
    cells = []
    for shape in report.get("shapes", []):
        name = f"{shape['name']}: {shape['label']}" if shape.get("label") else shape["name"]
        for op, res in shape.get("ops", {}).items():
            if res.get("status") != "ok":
                continue
            values = {m: res[m] for m in ("fwdbwd_ms", "graph_fwdbwd_ms") if isinstance(res.get(m), (int, float))}
            cells.append((name, op + suffix if op.startswith("dm-") else op, values))
    return run, cells


_MD_DATE = re.compile(r"^# Attention benchmark: .*\((\d{4}-\d\d-\d\d \d\d:\d\d) UTC\)", re.M)
_MD_GPU = re.compile(r"^- GPU: (.+?) \(", re.M)
_MD_VERSIONS = re.compile(r"^- torch (\S+) .*?, triton (\S+?),.*?commit ([0-9a-f]+)( \(uncommitted changes\))?",
                          re.M)
_MD_LABEL = re.compile(r"^\| (\w[\w-]*): (B\d[^|]*?) \|", re.M)


def attention_markdown(text: str) -> tuple[dict, list[tuple[str, str, dict]]]:
    """The same from attention.py's markdown report (its per-op table), e.g. inside a log of the run."""
    date, gpu, versions = _MD_DATE.search(text), _MD_GPU.search(text), _MD_VERSIONS.search(text)
    if not (date and versions):
        raise ValueError("not an attention.py report (no header)")
    run = {"date": date.group(1), "commit": versions.group(3)[:7] + ("+dirty" if versions.group(4) else ""),
           "gpu": gpu.group(1) if gpu else "", "torch": versions.group(1), "triton": versions.group(2)}
    labels = {m.group(1): m.group(2).strip() for m in _MD_LABEL.finditer(text)}
    body = text[text.index("## Per op"):]
    cells = []
    for line in body.splitlines()[4:]:
        if not line.startswith("| "):
            break
        cols = [c.strip() for c in line.strip("|").split("|")]
        shape, op, fwdbwd = cols[0], cols[1], cols[4]
        m = re.match(r"([\d.]+) \(", fwdbwd)
        if m:
            name = f"{shape}: {labels[shape]}" if shape in labels else shape
            cells.append((name, op, {"fwdbwd_ms": float(m.group(1))}))
    return run, cells


def attention_rows(run: dict, cells: list, source: str) -> list[dict]:
    rows = []
    for name, op, values in cells:
        ops = {o: v for n, o, v in cells if n == name}
        base = next((b for b in ATTENTION_BASES if b in ops), "")
        for metric, value in values.items():
            rows.append(_row({**run, "source": source}, name, op, metric, value,
                             _ratio(value, ops.get(base, {}).get(metric)), base))
    return rows


# ---- train_throughput.py -------------------------------------------------------------------------------------


def train_runs(report: dict) -> tuple[dict, list[dict]]:
    env, meta = report.get("environment", {}), report.get("meta", {})
    run = {"date": _date(meta.get("date", "")), "commit": _commit(env), "gpu": env.get("gpu", ""),
           "torch": env.get("torch", ""), "triton": env.get("triton", "")}
    fp8_flag = "--fp8-linear" in (meta.get("argv") or [])
    out = []
    for r in report.get("runs", []):
        if r.get("status") != "ok" or not isinstance(r.get("tokens_per_s"), (int, float)):
            continue
        setting = str(r.get("setting", ""))
        model = TRAIN_SETTINGS.get(setting, Path(setting).stem if setting.endswith((".yaml", ".yml")) else setting)
        linears = r.get("linears") or ("fp8" if fp8_flag else "bf16")
        norms = r.get("norms") or "eager"
        out.append({"model": model, "attn": r["attn"], "linears": linears, "norms": norms,
                    "tokens_per_s": r["tokens_per_s"]})
    return run, out


def step_rows(report: dict, source: str) -> list[dict]:
    """Rows of a train_step.json ({"meta", "rows"}: train_throughput.py --suite or --step-json)."""
    meta = report.get("meta", {})
    commit = str(meta.get("commit") or "")
    run = {"date": _date(meta.get("date", "")), "gpu": meta.get("gpu", ""), "torch": meta.get("torch", ""),
           "triton": meta.get("triton", ""), "source": source,
           "commit": commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")}
    ok = [r for r in report.get("rows", []) if r.get("status", "ok") == "ok"
          and isinstance(r.get("tokens_per_s"), (int, float))]

    def shape(r):
        return f"{r['model']} {r['seq_len']}x{r['batch']}" + (" packed" if r.get("packed") else "")

    def impl(r):
        return f"{r['attn']}, {r['linears']} linears, {'compiled' if r.get('compiled') else 'eager'}"

    rows = []
    for r in ok:
        base = next((b for b in ok if shape(b) == shape(r) and b["linears"] == r["linears"]
                     and bool(b.get("compiled")) == bool(r.get("compiled"))
                     and b["attn"] == r.get("ratio_base", "sdpa")), None)
        for metric in ("tokens_per_s", "peak_gib"):
            if isinstance(r.get(metric), (int, float)):
                rows.append(_row(run, shape(r), impl(r), metric, r[metric],
                                 _ratio(r[metric], base.get(metric) if base else None), impl(base) if base else ""))
    return rows


def _train_impl(r: dict) -> str:
    return f"{r['attn']}, {r['linears']} linears" + (", fused norms" if r["norms"] == "fused" else "")


def train_rows(runs: list[tuple[dict, dict, str]]) -> list[dict]:
    """`runs`: (run fields, configuration, source) of every file of one call; baselines are found among them."""
    rows = []
    for run, r, source in runs:
        same = [x for _, x, _ in runs if x["model"] == r["model"]]
        base = next((x for attn in ("sdpa", "torch_varlen") for x in same
                     if x["attn"] == attn and x["linears"] == "bf16" and x["norms"] == "eager"), None)
        rows.append(_row({**run, "source": source}, r["model"], _train_impl(r), "tokens_per_s", r["tokens_per_s"],
                         _ratio(r["tokens_per_s"], base["tokens_per_s"] if base else None),
                         _train_impl(base) if base else ""))
    return rows


# ---- files -----------------------------------------------------------------------------------------------------


def rows_of_run(paths: list[Path], root: Path, seen_dates: set[str]) -> list[dict]:
    """Rows of the result files of one run. Markdown reports of a run whose JSON is among them (or was read
    before: `seen_dates`) are skipped."""
    attention, train, markdown, steps = [], [], [], []
    for path in paths:
        source = str(path.resolve().relative_to(root)) if path.resolve().is_relative_to(root) else str(path)
        if path.suffix == ".json":
            report = json.loads(path.read_text())
            if report.get("meta", {}).get("step_json"):
                continue  # a train_step.json's -detail.json: its runs are that file's rows
            if isinstance(report.get("rows"), list):
                steps += step_rows(report, source)
            elif "shapes" in report:
                run, cells = attention_json(report)
                attention.append((run, cells, source))
                seen_dates.add(run["date"])
            elif "runs" in report and "environment" in report:
                run, configs = train_runs(report)
                train += [(run, c, source) for c in configs]
        else:
            markdown.append((path, source))
    for path, source in markdown:
        text = path.read_text(errors="replace")
        if "# Attention benchmark" not in text:
            continue
        run, cells = attention_markdown(text)
        if run["date"] not in seen_dates:
            attention.append((run, cells, source))
            seen_dates.add(run["date"])
    rows = []
    for run, cells, source in attention:
        rows += attention_rows(run, cells, source)
    return rows + train_rows(train) + steps


def read_csv(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _key(row: dict) -> tuple:
    return tuple(row[c] for c in ("date", "gpu", "preset_or_model", "implementation", "metric"))


def append(rows: list[dict], path: Path) -> int:
    known = {_key(r) for r in read_csv(path)}
    new = [r for r in rows if _key(r) not in known]
    fresh = not path.is_file()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        if fresh:
            writer.writeheader()
        writer.writerows(new)
    return len(new)


def seed_runs(root: Path) -> list[list[Path]]:
    """The benchmark result files under root's benchmarks/results, grouped into runs (a folder and the commit its
    files record), oldest first. Logs count when they hold an attention.py report."""
    results = root / "benchmarks" / "results"
    groups: dict[tuple[str, str], list[Path]] = {}
    for path in sorted(results.rglob("*")):
        if path.suffix not in (".json", ".md", ".log") or path.name == "README.md" or "current" in path.parts:
            continue
        text = path.read_text(errors="replace")
        if path.suffix == ".json":
            try:
                report = json.loads(text)
            except json.JSONDecodeError:
                continue
            if not isinstance(report, dict) or report.get("meta", {}).get("step_json") or not (
                    "shapes" in report or ("runs" in report and "environment" in report)
                    or isinstance(report.get("rows"), list)):
                continue
            if isinstance(report.get("rows"), list):  # a train_step.json
                date, commit = _date(report["meta"].get("date", "")), str(report["meta"].get("commit"))[:7]
            else:
                date, commit = _date(report["meta"].get("date", "")), _commit(report["environment"])
        elif "# Attention benchmark" in text:
            run, _ = attention_markdown(text)
            date, commit = run["date"], run["commit"]
        else:
            continue
        groups.setdefault((str(path.parent), commit), []).append((date, path))
    ordered = sorted(groups.values(), key=lambda files: min(d for d, _ in files))
    return [[p for _, p in sorted(files)] for files in ordered]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="result files of one run")
    parser.add_argument("--seed", type=Path, metavar="CHECKOUT_ROOT",
                        help="read every run under CHECKOUT_ROOT/benchmarks/results (e.g. an older commit's archive)")
    parser.add_argument("--csv", type=Path, default=CSV_PATH)
    parser.add_argument("--commit", help="record this commit instead of the files' own")
    args = parser.parse_args(argv)
    if not args.files and not args.seed:
        parser.error("give result files, or --seed")
    seen: set[str] = set()
    added = 0
    runs = seed_runs(args.seed.resolve()) if args.seed else [args.files]
    root = args.seed.resolve() if args.seed else ROOT
    for files in runs:
        rows = rows_of_run(files, root, seen)
        if args.commit:
            rows = [{**r, "commit": args.commit} for r in rows]
        added += append(rows, args.csv)
    print(f"{added} rows appended to {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
