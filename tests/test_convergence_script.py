"""recipes/convergence_study.sh rehearsed on CPU (SMOKE=1): every mode's seed sweep, the fidelity check of each
final model, the noise-floor table at a common step and the plots; a run that dies of torch.OutOfMemoryError is
re-run once (PYTHON is then a wrapper that fails one run the way an OOM does, and calls the real Python
otherwise)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _recipe_helpers import REPO, env

# PYTHON for the study: the run named $FAIL_RUN exits 1 with an OOM traceback's last line, once (FAIL_ALWAYS
# unset) or every time; every other command is the real Python.
OOM_WRAPPER = """#!/usr/bin/env bash
case " $* " in
  *" --run_name $FAIL_RUN "*)
    if [ -n "${FAIL_ALWAYS:-}" ] || [ ! -e "$0.failed" ]; then
      touch "$0.failed"
      echo "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" >&2
      exit 1
    fi ;;
esac
exec "$REAL_PYTHON" "$@"
"""


def _study(tmp_path, fail_run: str, fail_always: bool = False, **over) -> tuple[subprocess.CompletedProcess, Path]:
    wrapper = tmp_path / "python"
    wrapper.write_text(OOM_WRAPPER)
    wrapper.chmod(0o755)
    e = env()
    e.update(SMOKE="1", STEPS="2", SEEDS="0,1", ATTN_STATS="1", PYTHON=str(wrapper), FAIL_RUN=fail_run,
             REAL_PYTHON=os.environ.get("PYTHON", sys.executable), **over)
    e.pop("FAIL_ALWAYS", None)
    if fail_always:
        e["FAIL_ALWAYS"] = "1"
    out = tmp_path / "out"
    r = subprocess.run(["bash", "recipes/convergence_study.sh", str(out)], cwd=REPO, env=e, capture_output=True,
                       text=True, timeout=1200)
    return r, out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_convergence_study_smoke(tmp_path):
    r, out = _study(tmp_path, "fp8-stale-seed1", WARM_STEPS="2", PARALLEL="3", STEP="2",
                    MODES="bf16 fp8-matching fp8-stale fp8-fwd fp8-bwd")
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    # the OOM victim ran again, alone, and its first log is kept
    assert "run fp8-stale seed 1 ran out of GPU memory: again, alone" in r.stdout
    assert "torch.OutOfMemoryError" in (out / "runs" / "fp8-stale" / "seed-1.oom.log").read_text()
    assert "OutOfMemoryError" not in (out / "runs" / "fp8-stale" / "seed-1.log").read_text()
    modes = ["bf16", "fp8-matching", "fp8-stale", "fp8-fwd", "fp8-bwd"]
    rows = json.loads((out / "table.json").read_text())
    assert [row["mode"] for row in rows] == modes and all(row["seeds"] == [0, 1] for row in rows)
    assert all(row["step"] == 2 and len(row["values"]) == 2 for row in rows)
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
    assert "Validation CE at step 2 per mode" in results and "paired gap per seed" in results
    assert "| fp8-stale |" in (out / "fidelity.md").read_text()
    assert (out / "loss.png").is_file() and (out / "loss_attn.png").is_file()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_convergence_study_fails_when_the_rerun_fails(tmp_path):
    r, out = _study(tmp_path, "bf16-seed1", fail_always=True, PARALLEL="2", MODES="bf16")
    assert r.returncode == 1, (r.stdout + r.stderr)[-5000:]
    log = r.stdout + r.stderr  # (the script sends both to its study.log and stdout)
    assert "run bf16 seed 1 ran out of GPU memory: again, alone" in log and "error: run bf16 seed 1 failed" in log
    assert (out / "runs" / "bf16" / "seed-1.oom.log").is_file() and not (out / "results.md").exists()
