"""benchmarks/results/history.py: the rows it reads from the benchmarks' result files, and history.csv itself."""

from __future__ import annotations

import csv
import importlib.util
import json
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
    assert {r["metric"] for r in rows} == {"fwdbwd_ms", "graph_fwdbwd_ms", "tokens_per_s", "peak_gib"}


def test_history_csv_is_complete():
    rows = _rows(RESULTS / "history.csv")
    assert len(rows) >= 195
    for r in rows:
        assert r["date"] and r["gpu"] and r["torch"] and r["triton"] and r["source"], r
        float(r["value"])
        assert r["metric"] in ("fwdbwd_ms", "graph_fwdbwd_ms", "tokens_per_s", "peak_gib"), r


def test_a_train_step_json_appends(history, tmp_path):
    """train_throughput.py's train_step.json (issue #45's schema): tokens/s and peak memory per row, ratios over each
    row's ratio_base in its group; its -detail.json is not read; appending again adds nothing."""
    def row(model, attn, tps, peak, compiled=False, base="sdpa", status="ok", packed=False):
        return {"model": model, "seq_len": 8192, "batch": 1, "packed": packed, "attn": attn, "linears": "bf16",
                "compiled": compiled, "tokens_per_s": tps, "peak_gib": peak, "ratio_to_sdpa": None,
                "ratio_base": base, "status": status}

    step = {"meta": {"date": "2026-12-05 10:00 UTC", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0",
                     "commit": "0123456789abcdef+dirty"},
            "rows": [row("qwen3-0.6b", "sdpa", 100.0, 20.0), row("qwen3-0.6b", "deltamatch_fp8", 110.0, 18.0),
                     row("qwen3-0.6b", "sdpa", 120.0, 19.0, compiled=True),
                     row("qwen3-0.6b", "deltamatch_fp8", 114.0, 17.0, compiled=True),
                     row("qwen3-0.6b", "torch_varlen", 105.0, 18.5, packed=True),
                     row("gptoss-attn", "torch_varlen", 50.0, 60.0, base="torch_varlen"),
                     row("gptoss-attn", "deltamatch_fp8", 55.0, 58.0, base="torch_varlen"),
                     row("gptoss-attn", "sdpa", None, None, base="torch_varlen", status="skipped")]}
    path = tmp_path / "train_step.json"
    path.write_text(json.dumps(step))
    detail = tmp_path / "train_step-detail.json"
    detail.write_text(json.dumps({"meta": {"date": "2026-12-05 10:00 UTC", "step_json": "train_step.json"},
                                  "environment": {"gpu": "NVIDIA H200"}, "runs": [{"status": "ok", "attn": "sdpa",
                                                                                   "tokens_per_s": 1.0}]}))
    out = tmp_path / "h.csv"
    assert history.main([str(path), str(detail), "--csv", str(out)]) == 0
    rows = _rows(out)
    assert len(rows) == 14 and {r["source"] for r in rows} == {str(path)}
    ours = _find(rows, "2026-12-05 10:00", "qwen3-0.6b 8192x1", "deltamatch_fp8, bf16 linears, eager", "tokens_per_s")
    assert ours["ratio"] == "1.1000" and ours["baseline"] == "sdpa, bf16 linears, eager"
    assert ours["commit"] == "0123456+dirty" and ours["gpu"] == "NVIDIA H200" and ours["triton"] == "3.6.0"
    mem = _find(rows, "2026-12-05 10:00", "qwen3-0.6b 8192x1", "deltamatch_fp8, bf16 linears, compiled", "peak_gib")
    assert mem["ratio"] == f"{17 / 19:.4f}" and mem["baseline"] == "sdpa, bf16 linears, compiled"
    packed = _find(rows, "2026-12-05 10:00", "qwen3-0.6b 8192x1 packed", "torch_varlen, bf16 linears, eager",
                   "tokens_per_s")
    assert packed["ratio"] == "" and packed["baseline"] == ""  # no sdpa row of that group
    oss = _find(rows, "2026-12-05 10:00", "gptoss-attn 8192x1", "deltamatch_fp8, bf16 linears, eager", "tokens_per_s")
    assert oss["ratio"] == "1.1000" and oss["baseline"] == "torch_varlen, bf16 linears, eager"
    assert history.main([str(path), "--csv", str(out)]) == 0 and len(_rows(out)) == 14
    root = tmp_path / "checkout"
    (root / "benchmarks" / "results" / "run").mkdir(parents=True)
    for p in (path, detail):
        shutil.copy(p, root / "benchmarks" / "results" / "run" / p.name)
    seeded = tmp_path / "seeded.csv"
    assert history.main(["--seed", str(root), "--csv", str(seeded)]) == 0 and len(_rows(seeded)) == 14
