"""Commonsense preset: the group resolves in lm-eval, missing datasets are named, the average is right."""

from __future__ import annotations

import pytest

from hf_deltamatch.eval import TASKS_DIR, commonsense
from hf_deltamatch.eval.cli import _expand_and_filter


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(TASKS_DIR)])


def test_group_resolves(task_manager):
    entry = task_manager.task_index[commonsense.GROUP]
    assert entry.cfg["task"] == commonsense.TASKS
    assert len(commonsense.TASKS) == 9
    for task in commonsense.TASKS:  # each member is a real lm-eval task with the metric we average
        cfg = task_manager.task_index[task].cfg
        assert cfg["dataset_path"]
        assert commonsense.METRICS[task] in [m["metric"] for m in cfg["metric_list"]], task


def test_metric_choices_documented():
    assert {t for t, m in commonsense.METRICS.items() if m == "acc_norm"} == {"hellaswag", "arc_challenge",
                                                                           "openbookqa"}


def test_missing_datasets_are_named(task_manager, tmp_path, monkeypatch, capsys):
    # An empty Hugging Face cache: every dataset is missing, and nothing is downloaded.
    import datasets.config

    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    missing = commonsense.missing_datasets(commonsense.TASKS, task_manager)
    assert sorted(missing) == sorted(commonsense.TASKS)
    assert "allenai/ai2_arc (ARC-Easy)" in missing["arc_easy"]
    assert "Rowan/hellaswag" in missing["hellaswag"]
    msg = commonsense.missing_message(missing)
    assert "9 of 9" in msg and "nothing is downloaded" in msg and "EleutherAI/lambada_openai" in msg
    with pytest.raises(SystemExit, match="nothing left to run"):
        _expand_and_filter([commonsense.GROUP], {}, task_manager)
    assert "commonsense preset: 9 of 9 datasets" in capsys.readouterr().err
    assert not list((tmp_path / "hub").rglob("*.parquet"))  # offline: nothing was fetched


def test_average_hand_computed():
    res = {"results": {
        "arc_easy": {"acc,none": 0.5, "acc_norm,none": 0.9},
        "arc_challenge": {"acc,none": 0.9, "acc_norm,none": 0.25},
        "hellaswag": {"acc,none": 0.1, "acc_norm,none": 0.3},
        "lambada_openai": {"acc,none": 0.45, "perplexity,none": 20.0},
    }}
    s = commonsense.summarize(res)
    assert s["tasks"]["arc_easy"] == {"metric": "acc", "value": 50.0}
    assert s["tasks"]["arc_challenge"] == {"metric": "acc_norm", "value": 25.0}
    assert s["average"] == pytest.approx((50 + 25 + 30 + 45) / 4)
    assert not s["complete"] and s["num_tasks"] == 4 and "piqa" in s["missing_tasks"]
    assert "INCOMPLETE: 4/9" in commonsense.format_summary(s)
    full = {"results": {t: {f"{m},none": 0.5} for t, m in commonsense.METRICS.items()}}
    assert commonsense.summarize(full)["complete"] and commonsense.summarize(full)["average"] == 50.0
    assert commonsense.summarize({"results": {}}) is None


def test_runs_from_the_local_cache(tmp_path, monkeypatch, capsys):
    """With one of the nine datasets cached, the preset runs it through deltamatch_fp8, names the other eight,
    and reports an average marked incomplete."""
    import json

    import datasets.config

    import _eval_assets as A
    from _eval_fixtures import _assets_root
    from hf_deltamatch.eval.cli import eval_main

    cache = tmp_path / "datasets"
    rows = [{"id": f"q{i}", "question": f"Which one is hot, number {i}?",
             "choices": {"text": ["fire", "ice", "snow"], "label": ["A", "B", "C"]}, "answerKey": "A"}
            for i in range(3)]
    A.fake_cached_hub_dataset(cache, "allenai/ai2_arc", "ARC-Easy", {"train": rows, "validation": rows, "test": rows})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))

    out = tmp_path / "out"
    model = _assets_root() / "tiny-llama"
    assert eval_main(["--model_args", f"pretrained={model},dtype=float32", "--device", "cpu",
                      "--tasks", "commonsense_dm", "--output_path", str(out)]) == 0
    captured = capsys.readouterr()
    assert "commonsense preset: 8 of 9 datasets" in captured.err and "arc_easy" not in captured.err.split(
        "datasets are not in")[1].split("Fill the cache")[0]
    res = json.loads(next(out.rglob("results_*.json")).read_text())
    acc = res["results"]["arc_easy"]["acc,none"]
    assert res["n-samples"]["arc_easy"]["effective"] == 3
    cs = res["deltamatch"]["commonsense"]
    assert cs["tasks"] == {"arc_easy": {"metric": "acc", "value": round(100 * acc, 2)}}
    assert cs["num_tasks"] == 1 and not cs["complete"] and len(cs["missing_tasks"]) == 8
    assert "INCOMPLETE: 1/9" in captured.out
