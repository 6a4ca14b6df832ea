"""recipes/gpu_runs.sh rehearsed on CPU (SMOKE=1): every stage runs and the report is written."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from _recipe_helpers import REPO, env


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_runs_script_smoke(tmp_path):
    e = env()
    e.update(SMOKE="1", MINUTES="0.05", PYTHON=os.environ.get("PYTHON", __import__("sys").executable))
    r = subprocess.run(["bash", "recipes/gpu_runs.sh", str(tmp_path / "out")], cwd=REPO, env=e,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    out = tmp_path / "out"
    for name in ("bf16", "fp8-matching", "fp8-stale", "extend-64k"):
        assert (out / "runs" / name / "summary.json").is_file(), name
    assert (out / "loss_8k.png").stat().st_size > 10_000
    report = (out / "results.md").read_text()
    assert "| fp8-stale | deltamatch_fp8 | fp8 | stale |" in report and "| extend-64k |" in report
    assert "preflight:" in report
