"""`hf-deltamatch eval`: lm-eval's CLI with the hf-deltamatch model, on CPU, offline, through deltamatch_fp8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _eval_fixtures import ruler_sources, tiny_model_dir, tiny_tokenizer  # noqa: F401
from hf_deltamatch.eval import TASKS_DIR
from hf_deltamatch.eval.cli import _expand_and_filter, eval_main


@pytest.fixture
def fp8_calls(monkeypatch):
    """Count calls of the registered deltamatch_fp8 attention function during the test."""
    import hf_deltamatch
    from transformers import AttentionInterface

    hf_deltamatch.register()
    mapping = AttentionInterface._global_mapping
    real = mapping["deltamatch_fp8"]
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape)  # query
        return real(*args, **kwargs)

    monkeypatch.setitem(mapping, "deltamatch_fp8", spy)
    # hf-deltamatch registers again when it loads the model (idempotent): make it register the spy.
    import hf_deltamatch.integrations.transformers as integ

    monkeypatch.setattr(integ, "deltamatch_attention_forward", spy)
    return calls


def _results(out: Path) -> dict:
    files = sorted(out.rglob("results_*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


def test_local_task_through_deltamatch_fp8(tiny_model_dir, tmp_path, fp8_calls):
    data = tmp_path / "tiny_mc.jsonl"
    rows = [{"question": f"What is {i} plus one?", "choices": [str(i + 1), str(i + 7)], "label": 0} for i in range(4)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "dm_tiny_mc.yaml").write_text(f"""task: dm_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    out = tmp_path / "out"
    rc = eval_main(["--model_args", f"pretrained={tiny_model_dir},dtype=float32", "--device", "cpu",
                    "--tasks", "dm_tiny_mc", "--include_path", str(tasks), "--output_path", str(out),
                    "--batch_size", "2"])
    assert rc == 0
    res = _results(out)
    assert res["config"]["model"] == "hf-deltamatch"  # the default model, not plain hf
    assert 0.0 <= res["results"]["dm_tiny_mc"]["acc,none"] <= 1.0
    assert res["n-samples"]["dm_tiny_mc"]["effective"] == 4
    assert res["deltamatch"]["attn_implementation"] == "deltamatch_fp8"
    assert fp8_calls, "deltamatch_fp8 attention was never called"


def test_ruler_task_through_deltamatch_fp8(tiny_model_dir, ruler_sources, tmp_path, fp8_calls, capsys):
    out = tmp_path / "out"
    meta = json.dumps({"max_seq_lengths": [1024], "num_samples": 2, "seed": 5, **ruler_sources})
    rc = eval_main(["run", "--model", "hf-deltamatch", "--model_args", f"pretrained={tiny_model_dir},dtype=float32",
                    "--device", "cpu", "--tasks", "ruler_dm_niah_single_2", "--metadata", meta,
                    "--gen_kwargs", "max_gen_toks=4", "--output_path", str(out), "--log_samples"])
    assert rc == 0
    res = _results(out)
    score = res["results"]["ruler_dm_niah_single_2"]["1024,none"]
    assert 0.0 <= score <= 1.0
    assert res["n-samples"]["ruler_dm_niah_single_2"]["effective"] == 2
    assert res["deltamatch"]["ruler"]["tasks"] == {"niah_single_2": {"1024": round(100 * score, 2)}}
    assert res["deltamatch"]["ruler"]["average"] == {"1024": round(100 * score, 2)}
    samples = [json.loads(x) for f in out.rglob("samples_ruler_dm_niah_single_2_*.jsonl")
               for x in f.read_text().splitlines()]
    assert len(samples) == 2
    # the model saw the whole prompts (length - 128 tokens reserved for the answer) through the FP8 attention
    assert max(shape[-2] for shape in fp8_calls) == max(s["doc"]["length"] - 128 for s in samples)
    for s in samples:
        assert s["doc"]["outputs"][0] in s["arguments"]["gen_args_0"]["arg_0"]
        assert s["arguments"]["gen_args_0"]["arg_0"].endswith(s["doc"]["gen_prefix"])
    printed = capsys.readouterr().out
    assert "RULER (string match, %)" in printed and "niah_single_2" in printed

    # ... and a model card made from that real output carries the same number
    from huggingface_hub import ModelCard

    import _eval_assets as A
    from hf_deltamatch.eval.cli import card_main

    run = A.write_run_dir(tmp_path / "run", model_src=tiny_model_dir)
    assert card_main([str(run), "--eval", str(out)]) == 0
    card = ModelCard.load(run / "final" / "README.md")
    got = {(e.dataset_name, e.dataset_config): e.metric_value for e in card.data.eval_results}
    assert got[("RULER niah_single_2", "1024")] == round(100 * score, 2)


def test_preflight_skips_ruler_tasks_whose_files_are_missing(monkeypatch, capsys):
    from lm_eval.tasks import TaskManager

    for env in ("HF_DELTAMATCH_RULER_ESSAYS", "HF_DELTAMATCH_RULER_SQUAD", "HF_DELTAMATCH_RULER_HOTPOTQA"):
        monkeypatch.delenv(env, raising=False)
    tm = TaskManager(include_path=[str(TASKS_DIR)])
    tasks = _expand_and_filter(["ruler_dm", "hellaswag"], {}, tm)
    assert tasks == ["ruler_dm_niah_single_1", "ruler_dm_niah_multikey_2", "ruler_dm_niah_multikey_3",
                     "ruler_dm_vt", "ruler_dm_cwe", "ruler_dm_fwe", "hellaswag"]
    err = capsys.readouterr().err
    assert "skipping RULER niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery" in err
    assert "essay_path" in err and "squad_path" in err and "hotpotqa_path" in err
    assert "Nothing is downloaded" in err
    # a RULER task asked for by name fails before anything is loaded, naming what is missing
    with pytest.raises(SystemExit, match="cannot run ruler_dm_qa_1: .*squad_path"):
        _expand_and_filter(["ruler_dm_qa_1"], {}, tm)
    all13 = _expand_and_filter(["ruler_dm"], {"essay_path": __file__, "squad_path": __file__,
                                              "hotpotqa_path": __file__}, tm)
    assert len(all13) == 13


def test_every_ruler_task_resolves_in_lm_eval():
    from lm_eval.tasks import TaskManager

    from hf_deltamatch.eval.ruler import TASK_NAMES

    tm = TaskManager(include_path=[str(TASKS_DIR)])
    assert tm.task_index["ruler_dm"].cfg["task"] == [f"ruler_dm_{t}" for t in TASK_NAMES]
    for t in TASK_NAMES:
        assert f"ruler_dm_{t}" in tm.all_subtasks


def test_help_and_ls(capsys):
    assert eval_main([]) == 0
    assert "hf-deltamatch adds" in capsys.readouterr().out
    assert eval_main(["ls", "groups"]) == 0
    out = capsys.readouterr().out
    assert "ruler_dm" in out and "commonsense_dm" in out


def test_config_file_merges_with_command_line(tiny_model_dir, tmp_path, monkeypatch):
    """A --config YAML's model_args/metadata are merged with the flags (lm-eval alone would drop the file's)."""
    import lm_eval.evaluator

    seen = {}

    def fake_simple_evaluate(**kw):  # stop before any model work: we only check what lm-eval is handed
        seen.update(kw)
        return None

    monkeypatch.setattr(lm_eval.evaluator, "simple_evaluate", fake_simple_evaluate)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tasks: ruler_dm_niah_single_1\nmodel_args:\n  dtype: float32\n"
                   "metadata:\n  max_seq_lengths: [2048]\n  num_samples: 3\ndevice: cpu\n")
    assert eval_main(["--config", str(cfg), "--model_args", f"pretrained={tiny_model_dir}",
                      "--metadata", "seed=9"]) == 0
    assert seen["model"] == "hf-deltamatch"
    assert seen["model_args"] == {"dtype": "float32", "pretrained": str(tiny_model_dir), "max_length": 2048}
    assert seen["metadata"]["max_seq_lengths"] == [2048] and seen["metadata"]["seed"] == 9
    assert seen["tasks"] == ["ruler_dm_niah_single_1"]
