"""The nine-task commonsense preset used to compare (hybrid) LMs, as lm-eval group ``commonsense_dm``.

Metric per task follows the convention of the Mamba / GLA / Gated DeltaNet papers: length-
normalised accuracy (``acc_norm``) where choices differ a lot in length (HellaSwag, ARC-Challenge,
OpenBookQA), plain accuracy elsewhere; LAMBADA is scored by last-word accuracy (its perplexity is
reported by lm-eval too but not averaged). The average is the unweighted mean of those nine numbers.

All nine run zero-shot from the local Hugging Face cache; nothing is downloaded
(``hf-deltamatch eval`` sets ``HF_HUB_OFFLINE=1`` / ``HF_DATASETS_OFFLINE=1``).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

GROUP = "commonsense_dm"

# task -> metric averaged (lm-eval metric name, "none" filter)
METRICS: dict[str, str] = {
    "arc_easy": "acc",
    "arc_challenge": "acc_norm",
    "hellaswag": "acc_norm",
    "piqa": "acc",
    "winogrande": "acc",
    "boolq": "acc",
    "openbookqa": "acc_norm",
    "social_iqa": "acc",
    "lambada_openai": "acc",
}
TASKS = list(METRICS)


@contextmanager
def offline_env():
    """Force the hub and datasets libraries to use only the local cache."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    old = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: "1" for k in keys})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def dataset_of(task: str, task_manager=None) -> tuple[str, str | None]:
    """(dataset_path, dataset_name) of an lm-eval task, read from its YAML."""
    from lm_eval.tasks import TaskManager

    tm = task_manager or TaskManager()
    entry = tm.task_index.get(task)
    if entry is None or not entry.cfg:
        raise KeyError(f"lm-eval {_lm_eval_version()} has no task {task!r}")
    return entry.cfg.get("dataset_path"), entry.cfg.get("dataset_name")


def missing_datasets(tasks: list[str] | None = None, task_manager=None) -> dict[str, str]:
    """Tasks whose dataset is not in the local HF cache -> what to fetch. Empty if all present."""
    import datasets
    from lm_eval.tasks import TaskManager

    tm = task_manager or TaskManager()
    missing = {}
    with offline_env():
        # datasets reads the offline flag at import; make sure it sees it now as well.
        config = getattr(datasets, "config", None)
        old_flag = getattr(config, "HF_HUB_OFFLINE", None)
        if config is not None and old_flag is not None:
            config.HF_HUB_OFFLINE = True
        try:
            for task in tasks or TASKS:
                path, name = dataset_of(task, tm)
                try:
                    datasets.load_dataset_builder(path, name)
                except Exception as e:  # noqa: BLE001 - any failure means "not usable offline"
                    label = f"{path}" + (f" ({name})" if name else "")
                    missing[task] = f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        finally:
            if config is not None and old_flag is not None:
                config.HF_HUB_OFFLINE = old_flag
    return missing


def missing_message(missing: dict[str, str]) -> str:
    import datasets.config
    from huggingface_hub import constants

    lines = [f"commonsense preset: {len(missing)} of {len(TASKS)} datasets are not in the local Hugging Face "
             f"cache (datasets: {datasets.config.HF_DATASETS_CACHE}, hub: {constants.HF_HUB_CACHE}); "
             "nothing is downloaded:"]
    lines += [f"  - {t}: {why}" for t, why in missing.items()]
    lines.append("Fill the cache on a machine with network access, e.g. `python -c \"import datasets; "
                 "datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy')\"` for each dataset above, then copy "
                 "the cache (HF_HOME) here. The tasks above are skipped and the average is marked incomplete.")
    return "\n".join(lines)


def summarize(results: dict) -> dict | None:
    """{task: metric value %, ..., average} from an lm-eval results dict; None if no task ran."""
    res = results.get("results", {})
    scores = {}
    for task, metric in METRICS.items():
        val = res.get(task, {}).get(f"{metric},none")
        if isinstance(val, (int, float)):
            scores[task] = {"metric": metric, "value": round(100.0 * float(val), 2)}
    if not scores:
        return None
    return {
        "tasks": scores,
        "average": round(sum(s["value"] for s in scores.values()) / len(scores), 2),
        "num_tasks": len(scores),
        "complete": len(scores) == len(METRICS),
        "missing_tasks": [t for t in METRICS if t not in scores],
        "units": "percent",
    }


def format_summary(summary: dict) -> str:
    rows = [(t, s["metric"], f"{s['value']:.2f}") for t, s in summary["tasks"].items()]
    tag = "" if summary["complete"] else f" (INCOMPLETE: {summary['num_tasks']}/9 tasks)"
    rows.append(("average" + tag, "", f"{summary['average']:.2f}"))
    w = [max(len(r[i]) for r in rows + [("task", "metric", "%")]) for i in range(3)]
    out = ["Commonsense (%):", f"| {'task'.ljust(w[0])} | {'metric'.ljust(w[1])} | {'%'.ljust(w[2])} |",
           f"|{'-' * (w[0] + 2)}|{'-' * (w[1] + 2)}|{'-' * (w[2] + 2)}|"]
    out += [f"| {a.ljust(w[0])} | {b.ljust(w[1])} | {c.ljust(w[2])} |" for a, b, c in rows]
    return "\n".join(out)


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")
