"""Offline RULER (NVIDIA/RULER) for lm-eval: generators, scoring and task glue."""

from .constants import LM_EVAL_GROUP, LM_EVAL_PREFIX, TASK_NAMES, TASKS, RulerTask
from .generate import generate_samples, prompt_text
from .scoring import string_match_all, string_match_part
from .sources import MissingSourceError, missing_sources

__all__ = [
    "LM_EVAL_GROUP", "LM_EVAL_PREFIX", "TASK_NAMES", "TASKS", "RulerTask",
    "generate_samples", "prompt_text", "string_match_all", "string_match_part",
    "MissingSourceError", "missing_sources",
]
