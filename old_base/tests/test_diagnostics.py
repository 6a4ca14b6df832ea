"""`hf-deltamatch check`: the invariant demo tells matching from stale on every input profile."""

import subprocess
import sys

import pytest

from hf_deltamatch import diagnostics


@pytest.mark.parametrize("profile", diagnostics.PROFILES)
def test_matching_keeps_invariant_stale_breaks_it(profile):
    rows = {r.mode: r for r in diagnostics.run(profile, n=256, d=32, heads=2)}
    matching, stale, bf16 = rows["fp8-matching"], rows["fp8-stale"], rows["bf16"]
    assert matching.row_sum_residual < 1e-5 and bf16.row_sum_residual < 1e-5
    assert stale.row_sum_residual > 100 * matching.row_sum_residual
    assert stale.dk_drift > matching.dk_drift  # the stale bias shows up in sum_j dK_j
    assert bf16.err_dq < matching.err_dq < 0.3
    assert rows["exact (fp64)"].dk_drift < 1e-10


def test_cli_check_runs():
    res = subprocess.run([sys.executable, "-m", "hf_deltamatch.cli", "check", "--seq-len", "128", "--head-dim", "32",
                          "--profile", "sinks"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "fp8-matching" in res.stdout and "fp8-stale" in res.stdout and "profile=sinks" in res.stdout


def test_cli_unknown_command_fails():
    res = subprocess.run([sys.executable, "-m", "hf_deltamatch.cli", "frobnicate"], capture_output=True, text=True)
    assert res.returncode == 2 and "usage" in res.stdout
