"""`hf-deltamatch card`: a model card that huggingface_hub parses, carrying the numbers of the results file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import _eval_assets as A
from hf_deltamatch.eval.cli import card_main


def _results_file(path):
    res = {
        "results": {
            "arc_easy": {"alias": "arc_easy", "acc,none": 0.4321, "acc_stderr,none": 0.01, "acc_norm,none": 0.4011},
            "hellaswag": {"alias": "hellaswag", "acc,none": 0.2875, "acc_norm,none": 0.3012},
            "lambada_openai": {"alias": "lambada_openai", "perplexity,none": 35.25, "acc,none": 0.3456},
            "ruler_dm_niah_single_1": {"4096,none": 0.98, "4096_stderr,none": 0.01, "8192,none": 0.9},
            "ruler_dm_qa_1": {"4096,none": 0.37, "8192,none": 0.31},
        },
        "configs": {
            "arc_easy": {"dataset_path": "allenai/ai2_arc", "dataset_name": "ARC-Easy", "test_split": "test"},
            "hellaswag": {"dataset_path": "Rowan/hellaswag", "validation_split": "validation"},
            "lambada_openai": {"dataset_path": "EleutherAI/lambada_openai", "dataset_name": "default",
                               "test_split": "test"},
        },
        "config": {"model": "hf-deltamatch", "model_args": {"pretrained": "/x"}},
        "lm_eval_version": "0.4.13",
    }
    path.write_text(json.dumps(res))
    return path


def test_card_parses_and_has_the_numbers(tmp_path, capsys):
    from huggingface_hub import ModelCard

    run = A.write_run_dir(tmp_path / "run")
    results = _results_file(tmp_path / "results.json")
    assert card_main([str(run), "--eval", str(results), "--name", "tiny-dm", "--repo-id", "me/tiny-dm"]) == 0
    readme = run / "final" / "README.md"
    assert f"wrote {readme}" in capsys.readouterr().out
    card = ModelCard.load(readme)
    assert card.data.model_name == "tiny-dm" and card.data.license == "apache-2.0"
    assert "deltamatch_fp8" in card.data.tags and card.data.library_name == "transformers"
    got = {(e.dataset_name, e.dataset_config, e.metric_type): e.metric_value for e in card.data.eval_results}
    assert got[("arc_easy", "ARC-Easy", "acc")] == 0.4321
    assert got[("arc_easy", "ARC-Easy", "acc_norm")] == 0.4011
    assert got[("hellaswag", None, "acc_norm")] == 0.3012
    assert got[("lambada_openai", "default", "perplexity")] == 35.25
    assert got[("RULER niah_single_1", "4096", "string_match_all")] == 98.0
    assert got[("RULER qa_1", "8192", "string_match_part")] == 31.0
    assert got[("RULER average (2/13 tasks)", "4096", "average")] == 67.5  # (98 + 37) / 2
    assert got[("RULER average (2/13 tasks)", "8192", "average")] == 60.5  # (90 + 31) / 2
    # commonsense average over what ran (arc_easy acc, hellaswag acc_norm, lambada acc), flagged incomplete
    assert got[("Commonsense average (3/9 tasks)", None, "average")] == pytest.approx(
        round((43.21 + 30.12 + 34.56) / 3, 2))
    assert not any("stderr" in k[2] for k in got)
    text = card.text
    # run contents: FP8 settings, tokens, recipe, loss curve
    assert "| precision | fp8 |" in text and "| delta | matching |" in text
    assert "| tokens seen | 81,920 |" in text and "| head_dim | 32 |" in text
    assert "![Training loss](loss_curve.png)" in text and (run / "final" / "loss_curve.png").stat().st_size > 1000
    assert "optimizer: adamw" in text and "me/tiny-dm" in text
    assert "attention runs in\nfp8 with matching delta" in text
    assert "| **average** (2/13) | **67.50** | **60.50** |" in text
    assert "INCOMPLETE" not in text and "incomplete: 3/9" in text


def test_card_from_lm_eval_output_folder(tmp_path):
    from huggingface_hub import ModelCard

    run = A.write_run_dir(tmp_path / "run")
    out = tmp_path / "lm_eval_out" / "model"
    out.mkdir(parents=True)
    _results_file(out / "results_2026-01-01T00-00-00.json")
    assert card_main([str(run), "--eval", str(tmp_path / "lm_eval_out"), "--output", str(tmp_path / "card")]) == 0
    card = ModelCard.load(tmp_path / "card" / "README.md")
    assert card.data.model_name == "tiny-test"  # from summary.json
    # 6 lm-eval metrics (2 per task), 2 RULER tasks x 2 lengths, 2 RULER averages, 1 commonsense average
    assert len(card.data.eval_results) == 6 + 4 + 2 + 1


def test_clear_errors(tmp_path, capsys):
    assert card_main([str(tmp_path / "nope"), "--eval", str(tmp_path / "r.json")]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = A.write_run_dir(tmp_path / "run")
    (tmp_path / "bad.json").write_text(json.dumps({"foo": 1}))
    assert card_main([str(run), "--eval", str(tmp_path / "bad.json")]) == 2
    assert "not an lm-eval results file" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert card_main([str(tmp_path / "empty")]) == 2
    assert "training run directory" in capsys.readouterr().err


def test_card_of_a_baseline_run_says_so(tmp_path):
    from huggingface_hub import ModelCard

    run = A.write_run_dir(tmp_path / "run")
    cfg = (run / "config.yaml").read_text().replace("attn: deltamatch_fp8", "attn: sdpa")
    (run / "config.yaml").write_text(cfg)
    assert card_main([str(run)]) == 0
    text = ModelCard.load(run / "final" / "README.md").text
    assert 'trained with `attn_implementation="sdpa"` (a baseline' in text
    assert "| attn_implementation | sdpa |" in text and "| delta |" not in text
    assert "No evaluation results were given." in text


def test_default_template_ships_in_the_package():
    """The default template is package data (pyproject), so `hf-deltamatch card` works from a wheel install."""
    import tomllib

    import hf_deltamatch
    from hf_deltamatch.eval import model_card

    pkg = Path(hf_deltamatch.__file__).parent
    assert model_card.DEFAULT_TEMPLATE.is_file() and pkg in model_card.DEFAULT_TEMPLATE.parents
    data = tomllib.loads((pkg.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert model_card.DEFAULT_TEMPLATE.name in data["hf_deltamatch.eval"]


def test_example_card_is_the_card_of_its_committed_run(tmp_path):
    """model_cards/dense-small-fp8-matching is `hf-deltamatch card` of a committed H200 run and its RULER results
    (the command in model_cards/README.md): regenerated, it is the committed card, and its metadata is what the
    Hub accepts (huggingface_hub's parser; model-index round-trips through EvalResult)."""
    import yaml
    from huggingface_hub import ModelCard, ModelCardData
    from huggingface_hub.repocard_data import eval_results_to_model_index

    root = Path(__file__).resolve().parent.parent
    example = root / "model_cards" / "dense-small-fp8-matching"
    assert card_main([str(root / "recipes/results/2026-11-29-h200-dense-small/runs/fp8-matching"),
                      "--eval", str(root / "eval/results/2026-11-29-h200-ruler-8k/ruler-deltamatch_fp8-results.json"),
                      "--output", str(tmp_path), "--name", example.name]) == 0
    assert (tmp_path / "README.md").read_text() == (example / "README.md").read_text(), (
        "the example card is stale: regenerate it with the command in model_cards/README.md")
    assert (example / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    card = ModelCard.load(example / "README.md")
    meta = yaml.safe_load((example / "README.md").read_text().split("---\n")[1])
    assert card.data.model_name == example.name and card.data.license == "apache-2.0"
    assert card.data.pipeline_tag == "text-generation" and "deltamatch_fp8" in card.data.tags
    results = card.data.eval_results
    assert len(results) == 12  # 11 RULER tasks at 8K (qa_1/qa_2 need SQuAD/HotpotQA files) and their average
    assert eval_results_to_model_index(example.name, results) == meta["model-index"]
    assert ModelCardData(**meta).to_dict() == card.data.to_dict()
    text = card.text
    assert "| parameters | 41,953,792 |" in text and "| optimizer steps | 234 |" in text  # model_config.json, summary
    assert "| **average** (11/13) | **0.00** |" in text
