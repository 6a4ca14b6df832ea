"""recipes/convergence_study.sh rehearsed on CPU (SMOKE=1): every mode's seed sweep, the fidelity check of each
final model, the noise-floor table and the plots."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from _recipe_helpers import REPO, env


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_convergence_study_smoke(tmp_path):
    e = env()
    e.update(SMOKE="1", STEPS="2", SEEDS="0,1", ATTN_STATS="1", WARM_STEPS="2", PARALLEL="3",
             MODES="bf16 fp8-matching fp8-stale fp8-fwd fp8-bwd", PYTHON=os.environ.get("PYTHON", sys.executable))
    out = tmp_path / "out"
    r = subprocess.run(["bash", "recipes/convergence_study.sh", str(out)], cwd=REPO, env=e, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    modes = ["bf16", "fp8-matching", "fp8-stale", "fp8-fwd", "fp8-bwd"]
    rows = json.loads((out / "table.json").read_text())
    assert [row["mode"] for row in rows] == modes and all(row["seeds"] == [0, 1] for row in rows)
    for mode in modes:
        summary = json.loads((out / "runs" / mode / "seed-1" / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["start_step"] == 0
        cfg = (out / "runs" / mode / "seed-1" / "config.yaml").read_text()
        assert str(out / "runs" / "warm" / "final") in cfg  # every mode continued from the warm start
        report = json.loads((out / "fidelity" / mode / "fidelity.json").read_text())
        assert report["layers"] and (out / "fidelity" / mode / "fidelity.png").is_file()
    assert (out / "fidelity" / "init" / "fidelity.json").is_file()
    results = (out / "results.md").read_text()
    assert "| bf16 | 2 |" in results and "(baseline)" in results and "Noise floor" in results
    assert "| fp8-stale |" in (out / "fidelity.md").read_text()
    assert (out / "loss.png").is_file() and (out / "loss_attn.png").is_file()
