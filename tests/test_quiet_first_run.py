"""A first run prints nothing on stderr that the user did not ask for: `import hf_deltamatch`, `hf-deltamatch check
--model`, and the quick start's `accelerate launch recipes/pretrain.py` (shortened), each in a fresh process. A
progress bar (tqdm) is the one thing allowed there; every other line on stderr fails the test, which names it.

What used to appear, and where it is handled: torchao's import-time messages (transformers imports torchao with
its model code; `hf_deltamatch._quiet_imports`), accelerate's list of defaulted launch settings (no accelerate
config; `scripts/accelerate_default_config.sh`), accelerate's INFO lines and its tied-weights warning on
checkpoints (`training/loop.py`), and transformers' Gated DeltaNet fallback notices (one notice of ours instead,
`training/modeling.py`).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _recipe_helpers import REPO, env, write_corpus

# a tqdm bar as it is drawn: "...[00:01<00:02, 3.2it/s]" or "...[00:00, 160 examples/s]", possibly with postfix
_BAR = re.compile(r"\[[\d:]+(<[\d:?]+)?, [^\]]*\]\s*$")


def unasked_stderr(stderr: str) -> list[str]:
    """stderr's lines (tqdm redraws split at carriage returns) that are not a progress bar or blank."""
    return [seg for seg in re.split(r"[\r\n]", stderr) if seg.strip() and not _BAR.search(seg)]


def test_progress_bars_are_told_from_other_lines():
    bars = ("run1:  50%|█████     | 1/2 [00:04<00:04,  4.18s/it, loss=5.789, lr=3.0e-04, tok_s=490]\r"
            "Generating train split: 160 examples [00:00, 80815.11 examples/s]\n"
            "Loading weights:   0%|          | 0/29 [00:00<?, ?it/s]\r   \n")
    assert unasked_stderr(bars) == []
    noise = "W1204 22:25:32.144000 6037 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass"
    assert unasked_stderr(bars + noise + "\n") == [noise]


def _run(args: list[str], cwd: Path, extra_env: dict | None = None, timeout: int = 300):
    e = env()
    e.update(extra_env or {})
    return subprocess.run([sys.executable, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


def test_import_prints_nothing(tmp_path):
    res = _run(["-c", "import hf_deltamatch"], cwd=tmp_path)
    assert res.returncode == 0 and res.stderr == "" and res.stdout == "", res.stderr


def test_check_model_prints_only_its_report(tmp_path):
    from test_fidelity import _text, build_sink_model

    model = build_sink_model(tmp_path / "model", sink=False)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _text(seed=1)))
    res = _run(["-m", "hf_deltamatch.cli", "check", "--model", str(model), "--data", str(data), "--seq-len", "64",
                "--batch", "2", "--block", "64", "--device", "cpu", "--out", str(tmp_path / "out")], cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "dS row-sum residual" in res.stdout
    assert unasked_stderr(res.stderr) == [], res.stderr


@pytest.mark.slow
def test_quick_start_training_prints_only_progress(tmp_path):
    """The quick start's command after scripts/setup_cpu.sh (which installs accelerate's default config; HF_HOME
    points accelerate at a fresh one here), on the default tiny-cpu model with a small corpus, two steps, one
    validation and one checkpoint (the tied embedding is saved); the run's own report goes to stdout."""
    hf_home = {"HF_HOME": str(tmp_path / "hf_home")}
    res = subprocess.run(["bash", "scripts/accelerate_default_config.sh"], cwd=REPO, capture_output=True, text=True,
                         env={**env(), **hf_home, "PYTHON": sys.executable}, timeout=120)
    assert res.returncode == 0 and (tmp_path / "hf_home/accelerate/default_config.yaml").is_file(), res.stderr
    corpus = write_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "run"
    res = _run(["-m", "accelerate.commands.launch", "recipes/pretrain.py", "--data", str(corpus), "--vocab_size",
                "320", "--max_steps", "2", "--eval_every", "2", "--save_every", "2", "--log_every", "1",
                "--output_dir", str(out)], cwd=REPO, extra_env=hf_home, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert (out / "checkpoints" / "step_0000002" / "DONE").is_file()
    assert "val CE" in res.stdout and "params" in res.stdout
    assert unasked_stderr(res.stderr) == [], res.stderr


def test_default_accelerate_config_is_kept_when_one_exists(tmp_path):
    """The set-up script never replaces a user's accelerate config."""
    mine = tmp_path / "hf_home" / "accelerate" / "default_config.yaml"
    mine.parent.mkdir(parents=True)
    mine.write_text("distributed_type: MULTI_GPU\n")
    res = subprocess.run(["bash", "scripts/accelerate_default_config.sh"], cwd=REPO, capture_output=True, text=True,
                         env={**env(), "HF_HOME": str(tmp_path / "hf_home"), "PYTHON": sys.executable}, timeout=120)
    assert res.returncode == 0 and "keeping" in res.stdout, res.stderr
    assert mine.read_text() == "distributed_type: MULTI_GPU\n"
