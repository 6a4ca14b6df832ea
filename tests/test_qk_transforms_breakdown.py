"""benchmarks/qk_transforms_breakdown.py: its CPU dry run with launch-config variants, and its report and
summary on given numbers (the timings themselves need the H200)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _scripts import script_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "qk_transforms_breakdown.py"


@pytest.fixture(scope="module")
def breakdown():
    with script_module(SCRIPT, "qk_transforms_breakdown") as module:
        yield module


def test_dry_run_runs_every_config_under_each_variant():
    """Two variants: one tile per rotation program, and two (the loop path, its second tile past the head's end)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--variants",
                           "{'quantize_rotate': (1, 8, 1)}; {'quantize_rotate': (2, 8, 3)}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("+hadamard: ran") == 2 and proc.stdout.count("+both: ran") == 2


def test_a_misspelt_tune_key_is_refused():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--variants", "{'quantize_rotat': (1, 8, 1)}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0 and "unknown variant keys" in proc.stderr


def test_report_and_summary(breakdown, capsys):
    def results(base, rot):
        return {"fp8-matching": (base, {"fwd": 1.0, "quantize": 0.1}),
                "+hadamard": (rot, {"fwd": 1.0, "quantize": 0.15, "mm": 0.03}),
                "+smooth_k": (base, {"fwd": 1.0, "quantize": 0.1}), "+both": (rot, {"fwd": 1.0, "quantize": 0.15})}
    runs = [(0, "A", results(2.0, 2.1)), (0, "B", results(2.0, 2.05)), (1, "A", results(2.0, 2.1))]
    breakdown.report("title", runs[0][2], top=2)
    out = capsys.readouterr().out
    assert "+hadamard: 2.100 ms (+5.0 %)" in out
    assert "+50.0 us  quantize" in out and "+30.0 us  mm" in out
    breakdown.summary(["A", "B"], runs)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.split()[:2] == ["A", "+hadamard"] and line.count("(+5.0 %)") == 2 for line in lines)
    assert any(line.split()[:2] == ["B", "+hadamard"] and "2.050 (+2.5 %)" in line for line in lines)
