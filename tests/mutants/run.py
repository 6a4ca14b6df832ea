"""Plant each mutant of tests/mutants/mutants.py alone in a copy of the tree and run the tests listed with it.

    python tests/mutants/run.py            # every mutant, 2 at a time (about 5 minutes on 2 idle cores)
    python tests/mutants/run.py -k kernel  # the mutants whose name contains "kernel"
    python tests/mutants/run.py --list     # the mutants and their tests, nothing run

The tree (git's tracked and untracked, not ignored, files) is copied once per worker into a temporary directory; the
tests run there with PYTHONPATH pointing at the copy (checked first: the installed package must not win). First the
listed tests run on the unmutated copy, which must pass; then, per mutant, its file(s) are edited (every anchor must
occur exactly once, else "anchor not found" / "anchor ambiguous" and nothing is run), its tests run, and the files
are restored. A mutant is caught when at least one of its tests fails. Exit status 0 when every mutant without a
known `gap` is caught and every anchor was found.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import MUTANTS  # noqa: E402

# the op's configuration from the environment would change what the tests check (tests/conftest.py drops it too)
_DROP_ENV = ("HF_DELTAMATCH_PRECISION", "HF_DELTAMATCH_DELTA", "HF_DELTAMATCH_BACKEND", "HF_DELTAMATCH_QK_ROTATION",
             "HF_DELTAMATCH_SMOOTH_K", "HF_DELTAMATCH_MEASURE", "PYTEST_ADDOPTS")


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def env_for(tree: Path, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    return env


def pytest(tree: Path, tests: list[str], threads: int, timeout: float) -> tuple[int, list[str], str, float]:
    """(exit status, failed node ids, output tail, seconds) of the tests in `tree`."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--no-header", "-o", "addopts=", *tests]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env_for(tree, threads), capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return -1, [], out[-2000:] + "\n(timed out)", time.time() - t0
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (.+?)(?: - |$)", out, flags=re.M)
    return proc.returncode, failed, out[-3000:], time.time() - t0


def check_import(tree: Path) -> None:
    probe = subprocess.run([sys.executable, "-c", "import hf_deltamatch; print(hf_deltamatch.__file__)"], cwd=tree,
                           env=env_for(tree, 1), capture_output=True, text=True)
    where = probe.stdout.strip()
    if probe.returncode != 0 or not Path(where).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"hf_deltamatch imports from {where or probe.stderr!r}, not from the copy {tree}: fix PYTHONPATH")


def apply(tree: Path, mutant: dict) -> tuple[str | None, dict]:
    """Edit the copy; returns (an error or None, the original texts to restore)."""
    originals, texts = {}, {}
    for path, anchor, repl in mutant["edits"]:
        texts.setdefault(path, (tree / path).read_text())
        originals.setdefault(path, texts[path])
        count = texts[path].count(anchor)
        if count != 1:
            first_line = anchor.strip().splitlines()[0]
            return (f"anchor not found in {path}: {first_line!r}" if count == 0 else
                    f"anchor ambiguous ({count} times) in {path}: {first_line!r}"), {}
        texts[path] = texts[path].replace(anchor, repl)
    for path, text in texts.items():
        (tree / path).write_text(text)
    return None, originals


def run_mutant(tree: Path, mutant: dict, threads: int, timeout: float) -> dict:
    error, originals = apply(tree, mutant)
    if error:
        return dict(mutant=mutant, status="ANCHOR", detail=error, seconds=0.0)
    try:
        code, failed, tail, secs = pytest(tree, mutant["tests"], threads, timeout)
    finally:
        for path, text in originals.items():
            (tree / path).write_text(text)
    if code == -1:
        return dict(mutant=mutant, status="TIMEOUT", detail=tail, seconds=secs)
    if code == 0:
        return dict(mutant=mutant, status="survived", detail=tail, seconds=secs)
    if code == 1 and failed:
        return dict(mutant=mutant, status="caught", detail=", ".join(failed), seconds=secs)
    return dict(mutant=mutant, status="caught", detail=f"pytest exit {code} (collection or usage error): "
                + tail.strip().splitlines()[-1], seconds=secs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only mutants whose name contains this")
    parser.add_argument("-j", "--jobs", type=int, default=2, help="mutants run at a time (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per pytest run (default 300)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    args = parser.parse_args()
    mutants = [m for m in MUTANTS if args.k in m["name"]]
    if args.list:
        for m in mutants:
            print(f"{m['name']}: {m['what']}\n  " + "\n  ".join(m["tests"]))
        return 0
    t_start = time.time()
    jobs = max(1, min(args.jobs, len(mutants)))
    threads = max(1, (os.cpu_count() or 2) // jobs)
    with tempfile.TemporaryDirectory(prefix="hf_deltamatch_mutants_") as tmp:
        trees = [Path(tmp) / f"tree{i}" for i in range(jobs)]
        for tree in trees:
            copy_tree(tree)
        check_import(trees[0])
        # the listed tests on the unmutated tree, split over the workers: they must pass
        tests = sorted({t for m in mutants for t in m["tests"]})
        chunks = [tests[i::jobs] for i in range(jobs)]
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            base = list(pool.map(lambda a: pytest(a[0], a[1], threads, 4 * args.timeout), zip(trees, chunks)))
        if any(code != 0 for code, *_ in base):
            for code, failed, tail, _ in base:
                if code != 0:
                    print(tail)
            print("the listed tests fail on the unmutated tree: mutants would prove nothing")
            return 2
        print(f"baseline: {len(tests)} tests pass on the unmutated tree ({time.time() - t_start:.0f} s)")
        free = list(trees)
        results = []
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            def task(m):
                tree = free.pop()
                try:
                    return run_mutant(tree, m, threads, args.timeout)
                finally:
                    free.append(tree)
            for r in pool.map(task, mutants):
                m = r["mutant"]
                detail = r["detail"] if r["status"] != "survived" else ""
                print(f"{r['status']:>8}  {m['name']:<42} {r['seconds']:5.0f} s  {detail}", flush=True)
                results.append(r)
    print(f"\n{len(results)} mutants in {time.time() - t_start:.0f} s")
    bad = 0
    for r in results:
        m = r["mutant"]
        if r["status"] == "caught":
            continue
        if m.get("gap") and r["status"] == "survived":
            print(f"known gap, {m['name']}: {m['gap']}")
            continue
        bad += 1
        print(f"{r['status']}: {m['name']} ({m['what']})\n{r['detail']}\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
