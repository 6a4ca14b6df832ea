"""Evaluation for hf_deltamatch models: lm-eval model, offline RULER, commonsense preset, model cards.

Everything here *uses* the library (``hf_deltamatch.register()``); nothing in the core
library imports this package. Heavy dependencies (lm-eval, datasets) are imported lazily
by the submodules that need them, so ``import hf_deltamatch.eval`` stays cheap.
"""

from pathlib import Path as _Path

DEFAULT_ATTN_IMPLEMENTATION = "deltamatch_fp8"

# lm-eval task directory shipped with the package (RULER + commonsense preset).
TASKS_DIR = _Path(__file__).resolve().parent / "tasks"

__all__ = ["DEFAULT_ATTN_IMPLEMENTATION", "TASKS_DIR"]
