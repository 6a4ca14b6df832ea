"""benchmarks/results/history.py: the rows it reads from the benchmarks' result files, and history.csv itself."""

from __future__ import annotations

import csv
import importlib.util
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def history():
    spec = importlib.util.spec_from_file_location("history", RESULTS / "history.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _find(rows, date, preset, impl, metric="fwdbwd_ms"):
    return next(r for r in rows if r["date"] == date and r["preset_or_model"].startswith(preset)
                and r["implementation"] == impl and r["metric"] == metric)


def test_current_runs_give_the_quoted_ratios(history, tmp_path):
    """The figures README and docs quote, recomputed from current/'s files; appending them again adds nothing."""
    out = tmp_path / "h.csv"
    current = RESULTS / "current"
    assert history.main([str(p) for p in sorted(current.glob("attention-*.json"))] + ["--csv", str(out)]) == 0
    assert history.main([str(current / "attention-2026-12-03-1232-nvidia-h200.md"), "--csv", str(out)]) == 0
    assert history.main([str(p) for p in sorted(current.glob("train-throughput-2026-12-03-074*.json"))]
                        + ["--csv", str(out)]) == 0
    rows = _rows(out)
    assert list(rows[0]) == history.COLUMNS
    n8192c = _find(rows, "2026-12-03 12:31", "n8192c", "dm-fp8-matching")
    assert n8192c["baseline"] == "sdpa-cudnn" and round(float(n8192c["ratio"]), 2) == 0.97
    assert n8192c["gpu"] == "NVIDIA H200" and n8192c["triton"] == "3.6.0" and n8192c["date"] == "2026-12-03 12:31"
    # from the markdown report (that run kept no JSON)
    w4096 = _find(rows, "2026-12-03 12:32", "window4096", "dm-fp8-matching")
    assert w4096["baseline"] == "flex" and round(float(w4096["ratio"]), 2) == 0.81
    graphed = _find(rows, "2026-12-03 12:50", "window128", "dm-fp8-matching", "graph_fwdbwd_ms")
    assert round(float(graphed["ratio"]), 2) == 1.36
    step = _find(rows, "2026-12-03 07:43", "hybrid-1p7b 64k", "deltamatch_fp8, fp8-compiled linears",
                 "tokens_per_s")
    assert step["baseline"] == "sdpa, bf16 linears" and round(float(step["ratio"]), 3) == 1.103
    n = len(rows)
    assert history.main([str(p) for p in sorted(current.glob("*.json"))] + ["--csv", str(out)]) == 0
    assert len(_rows(out)) > n  # the 8K runs' rows (kernel breakdowns and the GDN check are not read) ...
    again = len(_rows(out))
    assert history.main([str(p) for p in sorted(current.glob("*.json"))] + ["--csv", str(out)]) == 0
    assert len(_rows(out)) == again  # ... and nothing twice


def test_a_markdown_report_of_a_json_run_is_skipped(history, tmp_path):
    current = RESULTS / "current"
    out = tmp_path / "h.csv"
    history.main([str(current / "attention-2026-12-03-1251-nvidia-h200.json"),
                  str(current / "attention-2026-12-03-1251-nvidia-h200.md"), "--csv", str(out)])
    sources = {r["source"] for r in _rows(out)}
    assert sources == {"benchmarks/results/current/attention-2026-12-03-1251-nvidia-h200.json"}


def test_seed_reads_a_results_tree(history, tmp_path):
    root = tmp_path / "checkout"
    shutil.copytree(RESULTS / "current", root / "benchmarks" / "results" / "run")
    out = tmp_path / "h.csv"
    assert history.main(["--seed", str(root), "--csv", str(out)]) == 0
    rows = _rows(out)
    assert rows and all(r["source"].startswith("benchmarks/results/run/") for r in rows)
    assert {r["metric"] for r in rows} == {"fwdbwd_ms", "graph_fwdbwd_ms", "tokens_per_s"}


def test_history_csv_is_complete():
    rows = _rows(RESULTS / "history.csv")
    assert len(rows) >= 195
    for r in rows:
        assert r["date"] and r["gpu"] and r["torch"] and r["triton"] and r["source"], r
        float(r["value"])
        assert r["metric"] in ("fwdbwd_ms", "graph_fwdbwd_ms", "tokens_per_s"), r
