"""Shim so lm-eval's `!function utils.X` finds the package code."""

from hf_deltamatch.eval.ruler.lm_eval_tasks import process_results, ruler_dataset  # noqa: F401
