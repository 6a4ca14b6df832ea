"""RULER scoring against hand-computed cases, per-length lm-eval metrics, and the summary table."""

from __future__ import annotations

import pytest

from hf_deltamatch.eval.ruler.lm_eval_tasks import format_summary, process_results, summarize
from hf_deltamatch.eval.ruler.scoring import postprocess_pred, string_match_all, string_match_part


def test_string_match_all_hand_computed():
    # sample 1: both refs found (case-insensitive) -> 1; sample 2: 1 of 2 -> 0.5; sample 3: 0 of 3 -> 0
    preds = ["The numbers are 123 and ABC.", "only 42 here", "nothing"]
    refs = [["123", "abc"], ["42", "43"], ["x1", "x2", "x3"]]
    assert string_match_all(preds, refs) == pytest.approx((1 + 0.5 + 0) / 3)


def test_string_match_part_any_reference_counts():
    # RULER: per sample 1 if any reference is in the prediction
    preds = ["Paris", "it is the town Town1x2", "no idea"]
    refs = [["Paris", "City of Paris"], ["Town1x2"], ["Rome"]]
    assert string_match_part(preds, refs) == pytest.approx(2 / 3)
    # Where it differs from lm-eval's copy (max over samples of the fraction found, / n):
    # lm-eval would give max(1/3, 0) / 2 = 1/6; RULER gives (1 + 0) / 2 = 0.5.
    assert string_match_part(["answer a", "b"], [["a", "y", "z"], ["c"]]) == pytest.approx(0.5)


def test_all_vs_part_on_multi_reference():
    assert string_match_all(["a"], [["a", "b"]]) == 0.5
    assert string_match_part(["a"], [["a", "b"]]) == 1.0


def test_postprocess_pred():
    assert postprocess_pred("  \x00abc\x07def\t \n") == "abc\ndef"
    assert postprocess_pred(" 1234567.\n\nThe") == "1234567.\n\nThe"


def test_bad_inputs_raise():
    with pytest.raises(ValueError):
        string_match_all([], [])
    with pytest.raises(ValueError):
        string_match_part(["a"], [["a"], ["b"]])


def test_process_results_keys_by_length():
    doc = {"max_length": 8192, "outputs": ["7", "8"], "metric": "all"}
    assert process_results(doc, [" 7 and 9"]) == {"8192": 0.5}
    doc = {"max_length": 4096, "outputs": ["Town", "the Town"], "metric": "part"}
    assert process_results(doc, ["Town!"]) == {"4096": 1.0}


def _fake_results():
    return {"results": {
        "ruler_dm_niah_single_1": {"4096,none": 1.0, "4096_stderr,none": 0.0, "8192,none": 0.5},
        "ruler_dm_vt": {"4096,none": 0.25, "8192,none": 0.75},
        "ruler_dm_qa_1": {"4096,none": 0.4},
        "hellaswag": {"acc,none": 0.3},
    }}


def test_summary_table_hand_computed():
    s = summarize(_fake_results())
    assert s["tasks"] == {"niah_single_1": {"4096": 100.0, "8192": 50.0}, "vt": {"4096": 25.0, "8192": 75.0},
                          "qa_1": {"4096": 40.0}}
    # RULER's average: mean over the tasks run at each length
    assert s["average"] == {"4096": pytest.approx((100 + 25 + 40) / 3, abs=0.01), "8192": 62.5}
    assert s["num_tasks"] == 3 and "cwe" in s["missing_tasks"] and s["lengths"] == [4096, 8192]
    text = format_summary(s)
    assert "| niah_single_1" in text and "4K" in text and "8K" in text and "55.00" in text and "62.50" in text
    assert summarize({"results": {"hellaswag": {"acc,none": 0.3}}}) is None
