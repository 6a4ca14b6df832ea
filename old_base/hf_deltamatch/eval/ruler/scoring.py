"""RULER scoring, as in NVIDIA/RULER scripts/eval/synthetic/constants.py.

Both metrics are case-insensitive substring matches on the post-processed prediction:

* ``string_match_all``: per sample, the fraction of references found; averaged.
* ``string_match_part``: per sample, 1 if *any* reference is found, else 0; averaged.
  (RULER: ``sum(max(r in pred for r in ref)) / len(preds)``. lm-eval's copy takes the max
  over samples instead, which is not what RULER reports.)

Scores here are fractions in [0, 1]; RULER prints them x100 (the summary table does too).
"""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(pred: str) -> str:
    """Strip and turn control characters into newlines, as RULER's evaluator does."""
    return _CONTROL.sub("\n", pred.strip()).strip()


def _found(ref: str, pred: str) -> float:
    return 1.0 if ref.lower() in pred.lower() else 0.0


def sample_match_all(pred: str, refs: list[str]) -> float:
    return sum(_found(r, pred) for r in refs) / len(refs)


def sample_match_part(pred: str, refs: list[str]) -> float:
    return max(_found(r, pred) for r in refs)


def string_match_all(preds: list[str], refs: list[list[str]]) -> float:
    if len(preds) != len(refs) or not preds:
        raise ValueError("need one reference list per prediction, and at least one prediction")
    return sum(sample_match_all(p, r) for p, r in zip(preds, refs)) / len(preds)


def string_match_part(preds: list[str], refs: list[list[str]]) -> float:
    if len(preds) != len(refs) or not preds:
        raise ValueError("need one reference list per prediction, and at least one prediction")
    return sum(sample_match_part(p, r) for p, r in zip(preds, refs)) / len(preds)


METRICS = {"all": sample_match_all, "part": sample_match_part}
