"""The docs cite what is in the tree: every relative markdown link resolves, and no tracked file outside the results
folders names a run folder that left the tree (earlier runs are cited through benchmarks/results/README.md, the
history CSV, or `git show fc37a8d:PATH`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
# a dated run folder of benchmarks/results (the only run folders there are current/ and git history's)
_RUN_FOLDER = re.compile(r"benchmarks/results/(20\d\d-\d\d-\d\d[\w.-]*|ncu-\w+|attention-20|kernel-breakdown-20|"
                         r"kernels-gpu-pytest|host-overhead)")


def _tracked(*patterns: str) -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / p for p in out.stdout.split()]


def test_relative_links_resolve():
    broken = []
    for md in _tracked("*.md"):
        for m in _LINK.finditer(md.read_text()):
            target = m.group(1)
            if re.match(r"[a-z]+:", target) or target.startswith("/"):
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(REPO)}: {target}")
    assert not broken, "\n".join(broken)


def test_no_removed_run_folder_is_cited():
    """Run folders are gone from benchmarks/results; text that still names one points nowhere. The results READMEs
    (which say where earlier runs are) and the CSV (whose `source` column is their path) are the exceptions."""
    allowed = {"benchmarks/results/README.md", "benchmarks/results/history.csv", "benchmarks/results/history.py"}
    cited = []
    for path in _tracked("*.md", "*.py", "*.sh", "*.yaml", "*.toml"):
        rel = str(path.relative_to(REPO))
        if rel in allowed or rel.startswith(("benchmarks/results/current/", "recipes/results/", "eval/results/")):
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _RUN_FOLDER.search(line) and "git show" not in line:
                cited.append(f"{rel}:{i}: {line.strip()[:120]}")
    assert not cited, "\n".join(cited)
