"""Session-wide fixtures for the eval tests (import them into a test module to use them).

The assets are built once per process (lru_cache), so modules that import these fixtures
share one tokenizer/model build even though pytest registers the fixture per module."""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

import pytest

import _eval_assets as A


@lru_cache(maxsize=1)
def _assets_root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="hf_deltamatch_eval_"))
    model = root / "tiny-llama"
    tok = A.build_tokenizer(model)
    A.build_model(model, len(tok))
    A.write_essay(root / "essays.json")
    A.write_squad(root / "squad-dev-v2.0.json")
    A.write_hotpotqa(root / "hotpot_dev_distractor_v1.json")
    return root


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return _assets_root() / "tiny-llama"


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def ruler_sources() -> dict:
    root = _assets_root()
    return {"essay_path": str(root / "essays.json"), "squad_path": str(root / "squad-dev-v2.0.json"),
            "hotpotqa_path": str(root / "hotpot_dev_distractor_v1.json")}
