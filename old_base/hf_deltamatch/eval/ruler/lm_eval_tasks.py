"""lm-eval glue for the offline RULER tasks (``ruler_dm_*``, group ``ruler_dm``).

The task YAMLs in ``hf_deltamatch/eval/tasks/ruler_dm`` point their ``custom_dataset`` here.
lm-eval calls it with the task metadata merged with ``--model_args`` and ``--metadata``:

* ``max_seq_lengths``: list of lengths (default ``[4096]``), e.g. ``[4096,8192]``
* ``num_samples`` (default 500, RULER's), ``seed`` (default 42)
* ``tokenizer`` or ``pretrained``: the evaluated model's tokenizer (local path or cached id)
* ``essay_path``, ``squad_path``, ``hotpotqa_path``: local data (see ``sources.py``)

Each document is scored into a metric named after its length (``"4096"`` ...), so
lm-eval reports one number per task and length.
"""

from __future__ import annotations

import ast
import logging
from functools import lru_cache
from typing import Any

from . import constants as C
from .generate import generate_samples
from .scoring import METRICS, postprocess_pred

log = logging.getLogger(__name__)

DEFAULT_LENGTHS = [4096]
STANDARD_LENGTHS = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]


def parse_lengths(value: Any) -> list[int]:
    """Accept [4096, 8192], "4096,8192", "[4096, 8192]", 4096 or "4K"."""
    if value is None:
        return list(DEFAULT_LENGTHS)
    if isinstance(value, str):
        v = value.strip()
        if v.startswith("["):
            value = ast.literal_eval(v)
        else:
            value = [p for p in v.replace(" ", ",").split(",") if p]
    if isinstance(value, (int, float)):
        value = [value]
    out = []
    for x in value:
        s = str(x).strip().upper()
        mult = 1024 if s.endswith("K") else 1
        out.append(int(float(s.rstrip("K"))) * mult)
    return out


@lru_cache(maxsize=4)
def load_tokenizer(name: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    if not tok("The quick brown fox jumps over the lazy dog.")["input_ids"]:
        raise ValueError(f"tokenizer {name!r} encodes text to 0 tokens; RULER cannot size its prompts with it")
    return tok


def tokenizer_from_metadata(meta: dict) -> Any:
    for key in ("tokenizer", "pretrained"):
        if isinstance(meta.get(key), str) and meta[key]:
            return load_tokenizer(meta[key])
    raise ValueError(
        "RULER sizes every prompt with the evaluated model's tokenizer; pass "
        "--model_args pretrained=/path/to/model (or --metadata tokenizer=/path/to/tokenizer).")


def build_records(ruler_task: str, meta: dict, progress: bool = True) -> list[dict]:
    tok = tokenizer_from_metadata(meta)
    rows: list[dict] = []
    for length in parse_lengths(meta.get("max_seq_lengths")):
        rows += generate_samples(
            ruler_task, tok, length,
            num_samples=int(meta.get("num_samples", C.NUM_SAMPLES)),
            seed=int(meta.get("seed", C.RANDOM_SEED)),
            metadata=meta, progress=progress)
    return rows


def ruler_dataset(ruler_task: str | None = None, **meta):
    """``custom_dataset`` entry point: ``{"test": datasets.Dataset}`` of generated samples."""
    import datasets

    if not ruler_task:
        raise ValueError("RULER task YAML must set dataset_kwargs.ruler_task")
    rows = build_records(ruler_task, meta)
    return {"test": datasets.Dataset.from_list(rows, split=datasets.Split.TEST)}


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """Score one generation; the metric key is the sample's target length."""
    pred = postprocess_pred(results[0])
    return {str(doc["max_length"]): METRICS[doc["metric"]](pred, list(doc["outputs"]))}


def summarize(results: dict) -> dict | None:
    """RULER table from an lm-eval results dict: {task: {length: score%}}, plus the average.

    Returns None when no ``ruler_dm_*`` task is in the results. The average row is the
    mean over the tasks that ran at that length, as RULER reports it (x100).
    """
    res = results.get("results", {})
    table: dict[str, dict[int, float]] = {}
    for name in C.TASK_NAMES:
        entry = res.get(C.LM_EVAL_PREFIX + name)
        if not entry:
            continue
        for key, val in entry.items():
            metric, _, filt = key.partition(",")
            if metric.isdigit() and "_stderr" not in metric and isinstance(val, (int, float)) and val >= 0:
                table.setdefault(name, {})[int(metric)] = round(100.0 * float(val), 2)
    if not table:
        return None
    lengths = sorted({L for row in table.values() for L in row})
    avg = {}
    for L in lengths:
        vals = [row[L] for row in table.values() if L in row]
        avg[L] = round(sum(vals) / len(vals), 2)
    missing = [n for n in C.TASK_NAMES if n not in table]
    return {
        "tasks": {n: {str(L): v for L, v in sorted(r.items())} for n, r in table.items()},
        "average": {str(L): v for L, v in avg.items()},
        "lengths": lengths,
        "num_tasks": len(table),
        "missing_tasks": missing,
        "units": "percent (RULER convention)",
    }


def format_summary(summary: dict) -> str:
    lengths = summary["lengths"]
    head = ["task"] + [_fmt_len(L) for L in lengths]
    rows = [[n] + [f"{r.get(str(L), float('nan')):.2f}" if str(L) in r else "-" for L in lengths]
            for n, r in summary["tasks"].items()]
    rows.append([f"average ({summary['num_tasks']}/13 tasks)"] + [f"{summary['average'][str(L)]:.2f}" for L in lengths])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = ["RULER (string match, %):", line(head), sep] + [line(r) for r in rows]
    if summary["missing_tasks"]:
        out.append("not run: " + ", ".join(summary["missing_tasks"]))
    return "\n".join(out)


def _fmt_len(L: int) -> str:
    return f"{L // 1024}K" if L % 1024 == 0 else str(L)
