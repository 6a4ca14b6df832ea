"""Shared pieces of the recipe tests: a tiny offline corpus, a tiny hybrid config, and a runner."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# 1 Gated DeltaNet + 1 GQA attention layer (the hybrid path), head_dim 16.
TINY_MODEL = {
    "model_type": "qwen3_5_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}

_WORDS = ("the cat sat on a mat while dogs ran in the park and birds sang songs of spring "
          "numbers one two three four five six seven eight nine ten repeat after me").split()


def write_corpus(path: Path, n_docs: int = 160, seed: int = 0) -> Path:
    """Documents of learnable structure (counting, repeated phrases) so a few steps lower the loss."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n_docs):
            kind = i % 3
            if kind == 0:
                start = rng.randrange(50)
                text = " ".join(str(start + k) for k in range(rng.randrange(20, 120)))
            elif kind == 1:
                phrase = " ".join(rng.choice(_WORDS) for _ in range(6))
                text = ". ".join([phrase] * rng.randrange(3, 12))
            else:
                text = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(30, 150)))
            f.write(json.dumps({"text": f"doc {i}: {text}"}) + "\n")
    return path


def tiny_args(tmp: Path, corpus: Path, **over) -> dict:
    cfg = {
        "model_config": TINY_MODEL, "data": str(corpus), "vocab_size": 320, "seq_len": 64, "batch_size": 4,
        "max_steps": 12, "warmup_steps": 2, "lr": 3e-3, "log_every": 1, "eval_every": 6, "eval_batches": 2,
        "save_every": 100, "val_fraction": 0.05, "output_dir": str(tmp / "run"), "attn": "sdpa",
    }
    cfg.update(over)
    return cfg


def to_argv(cfg: dict) -> list[str]:
    argv = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            argv.append(f"--{k}" if v else f"--no-{k}")
        elif isinstance(v, (dict, list)):
            argv += [f"--{k}", json.dumps(v)]
        elif v is None:
            argv += [f"--{k}", "none"]
        else:
            argv += [f"--{k}", str(v)]
    return argv


def run_inprocess(cfg: dict) -> dict:
    """Train in this process (fast: no interpreter start). Resets accelerate's process-wide state first."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_deltamatch.training.config import parse_config
    from hf_deltamatch.training.loop import train

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    # the recipe sets HF_DELTAMATCH_* for its run; do not let that leak into later tests of this process
    saved = {k: os.environ.get(k) for k in ("HF_DELTAMATCH_PRECISION", "HF_DELTAMATCH_DELTA")}
    try:
        return train(parse_config(to_argv(cfg)))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("TOKENIZERS_PARALLELISM", "false")
    e["HF_DATASETS_OFFLINE"] = "1"
    e["HF_HUB_OFFLINE"] = "1"
    return e


def run_script(args: list[str], timeout: int = 240, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env(), capture_output=True, text=True,
                          timeout=timeout, **kw)


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))
