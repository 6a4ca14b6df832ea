"""Seeds: the validation split does not move with --seed, `--seeds` sweeps a recipe, and the sweep summarizer
compares modes against the baseline's seed range."""

from __future__ import annotations

import json

import pytest

from _recipe_helpers import metrics, tiny_args, to_argv, write_corpus
from hf_deltamatch.training import sweep
from hf_deltamatch.training.config import parse_config


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


def _val_blocks(cfg_dict, tokenizer=None):
    from hf_deltamatch.training.data import load_text_splits, load_tokenizer, pack_dataset, tokenizer_training_texts

    cfg = parse_config(to_argv(cfg_dict))
    train, val = load_text_splits(cfg)
    tokenizer = tokenizer or load_tokenizer(cfg, tokenizer_training_texts(train))
    blocks = pack_dataset(val, tokenizer, cfg)["input_ids"]
    return sorted(tuple(b) for b in blocks), tokenizer


def test_validation_split_does_not_depend_on_seed(corpus, tmp_path):
    base = tiny_args(tmp_path, corpus, val_fraction=0.1)
    seed0, tok = _val_blocks({**base, "seed": 0, "output_dir": str(tmp_path / "a")})
    seed1, _ = _val_blocks({**base, "seed": 1, "output_dir": str(tmp_path / "b")}, tok)
    assert seed0 and seed0 == seed1
    # the split does follow --data_seed (so the assertion above can fail)
    other, _ = _val_blocks({**base, "seed": 0, "data_seed": 1, "output_dir": str(tmp_path / "c")}, tok)
    assert other != seed0


def test_validation_split_too_small_for_a_block_warns(corpus, tmp_path):
    """A validation split that packs into no block of seq_len tokens (a 64K stage's few held-out documents) turns
    evaluation off with a warning that names the remedy, rather than leaving every eval step silently missing; one
    that packs into a block evaluates."""
    from hf_deltamatch.training.data import build_dataloaders, load_text_splits, load_tokenizer, \
        tokenizer_training_texts

    base = {**tiny_args(tmp_path, corpus, val_fraction=0.1), "output_dir": str(tmp_path / "a")}
    cfg = parse_config(to_argv(base))
    train, val = load_text_splits(cfg)
    tokenizer = load_tokenizer(cfg, tokenizer_training_texts(train))
    _, val_dl, _ = build_dataloaders(cfg, tokenizer, train, val)
    assert val_dl is not None and len(val_dl) > 0
    # a block longer than the whole validation split, yet short enough for the training split's batches
    n_val_tokens = sum(len(tokenizer(t)["input_ids"]) + 1 for t in val["text"])
    big = parse_config(to_argv({**base, "seq_len": n_val_tokens + 1, "batch_size": 1}))
    with pytest.warns(UserWarning, match=r"validation split .* packs into no block of \d+ tokens.*--val_fraction"):
        _, val_dl, _ = build_dataloaders(big, tokenizer, train, val)
    assert val_dl is None


def test_seeds_sweep_and_summary(corpus, tmp_path):
    """Two modes x two seeds of the tiny config, then the noise-floor table."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from hf_deltamatch.training import main

    roots = {}
    for mode, over in (("sdpa", {"attn": "sdpa"}),
                       ("fp8-stale", {"attn": "deltamatch_fp8", "precision": "fp8", "delta": "stale"})):
        roots[mode] = tmp_path / mode
        cfg = tiny_args(tmp_path, corpus, max_steps=3, eval_every=3, log_every=1, output_dir=str(roots[mode]), **over)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
        assert main([*to_argv(cfg), "--seeds", "0,1"]) == 0
    for mode, root in roots.items():
        summaries = [json.loads((root / f"seed-{s}" / "summary.json").read_text()) for s in (0, 1)]
        assert [s["name"] for s in summaries] == [f"{mode}-seed0", f"{mode}-seed1"]
        assert all(s["steps"] == 3 for s in summaries)
        first_losses = [metrics(root / f"seed-{s}")[0]["loss"] for s in (0, 1)]
        assert first_losses[0] != first_losses[1]  # the seed reaches the initialization
        assert f"tokenizer: {root / 'seed-0' / 'tokenizer'}" in (root / "seed-1" / "config.yaml").read_text()
        rec = json.loads((root / "seeds.json").read_text())
        assert rec["seeds"] == [0, 1] and rec["final_val_loss"] == [s["final_val_loss"] for s in summaries]
        assert rec["spread"] == pytest.approx(abs(rec["final_val_loss"][0] - rec["final_val_loss"][1]))
    table = tmp_path / "table.md"
    assert sweep.main([str(roots["sdpa"]), str(roots["fp8-stale"]), "--baseline", "sdpa", "--table", str(table)]) == 0
    rows = sweep.compare([sweep.read_sweep(roots["sdpa"]), sweep.read_sweep(roots["fp8-stale"])], "sdpa")
    base, other = rows
    assert base["beyond_floor"] is None and other["gap"] == pytest.approx(other["mean"] - base["mean"])
    assert other["beyond_floor"] == (abs(other["gap"]) > base["spread"])
    text = table.read_text()
    assert "| sdpa | 2 |" in text and "(baseline)" in text and f"{base['spread']:.4f} nats" in text
    assert sweep.main([str(roots["sdpa"]), "--baseline", "bf16"]) == 2  # unknown baseline: a clear error


def test_bad_seeds_fail_fast(corpus, tmp_path):
    from hf_deltamatch.training import main

    assert main([*to_argv(tiny_args(tmp_path, corpus)), "--seeds", "0,0"]) == 2
    with pytest.raises(ValueError, match="distinct non-negative"):
        sweep.parse_seeds("a,b")


def _fake_sweep(root, runs: dict[int, dict[int, float]], stopped_at: dict[int, int] | None = None):
    """seed -> {eval step: val CE}: seed-N/metrics.jsonl (train and attn lines among the evals) and summary.json
    (steps = the last eval step unless `stopped_at` says otherwise; final CE = the last eval's)."""
    for seed, evals in runs.items():
        d = root / f"seed-{seed}"
        d.mkdir(parents=True)
        lines = []
        for step, val in evals.items():
            lines.append({"kind": "train", "step": step, "tokens": 100 * step, "loss": val + 0.5})
            lines.append({"kind": "attn", "step": step, "layer": 0, "sink_mass": 0.1})
            lines.append({"kind": "eval", "step": step, "tokens": 100 * step, "val_loss": val})
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        last = max(evals)
        steps = (stopped_at or {}).get(seed, last)
        (d / "summary.json").write_text(json.dumps({"name": f"{root.name}-seed{seed}", "steps": steps,
                                                    "final_val_loss": evals[last]}))
    return root


def test_sweep_at_a_common_step_and_paired_gaps(tmp_path):
    """--step reads metrics.jsonl at that step; the paired gaps are per-seed differences on the shared seeds."""
    base = _fake_sweep(tmp_path / "bf16", {0: {100: 6.0, 200: 5.5, 300: 5.25, 400: 5.0},
                                           1: {100: 6.5, 200: 5.75, 300: 5.5, 400: 5.25},
                                           2: {100: 6.25, 200: 5.5, 300: 5.0}})  # stopped at 352, last eval 300
    (base / "seed-2" / "summary.json").write_text(json.dumps({"steps": 352, "final_val_loss": 4.9}))
    fp8 = _fake_sweep(tmp_path / "fp8", {0: {100: 6.25, 200: 5.75, 300: 5.5, 400: 5.125},
                                         2: {100: 6.5, 200: 5.75, 300: 5.125, 400: 4.75},
                                         3: {100: 7.0, 200: 6.0, 300: 6.0, 400: 5.5}})  # seed 3: no bf16 partner

    at300 = [sweep.read_sweep(base, step=300), sweep.read_sweep(fp8, step=300)]
    assert at300[0].values == [5.25, 5.5, 5.0] and at300[1].values == [5.5, 5.125, 6.0]
    b, f = sweep.compare(at300, "bf16")
    assert b["step"] == 300 and b["paired_gaps"] is None and b["paired_mean"] is None
    assert f["paired_seeds"] == [0, 2] and f["paired_gaps"] == [0.25, 0.125]  # 5.5-5.25, 5.125-5.0 (exact in binary)
    assert f["paired_mean"] == 0.1875 and f["paired_std"] == pytest.approx(0.125 / 2 ** 0.5, rel=1e-12)
    assert f["gap"] == pytest.approx((5.5 + 5.125 + 6.0) / 3 - (5.25 + 5.5 + 5.0) / 3, rel=1e-12)
    assert f["beyond_floor"] == (abs(f["gap"]) > 0.5)  # bf16's range at step 300: 5.5 - 5.0

    table, js = tmp_path / "t300.md", tmp_path / "t300.json"
    assert sweep.main([str(base), str(fp8), "--step", "300", "--table", str(table), "--json", str(js)]) == 0
    text = table.read_text()
    assert "val CE at step 300 per seed" in text and "validation CE at eval step 300" in text
    assert "| 0: +0.2500, 2: +0.1250 | +0.1875 ± 0.0884 |" in text
    assert "stopped at different steps" not in text
    assert json.loads(js.read_text())[1]["paired_gaps"] == [0.25, 0.125]

    # the final values come from runs that stopped at 352 and 400: a note, and the largest step all evaluated
    final = tmp_path / "final.md"
    assert sweep.main([str(base), str(fp8), "--table", str(final)]) == 0
    text = final.read_text()
    assert "final val CE per seed" in text and "| 5.0000, 5.2500, 4.9000 |" in text
    assert "stopped at different steps (352, 400)" in text and "--step 300," in text
    rows = sweep.compare([sweep.read_sweep(base), sweep.read_sweep(fp8)], "bf16")
    assert rows[1]["paired_gaps"] == [5.125 - 5.0, 4.75 - 4.9] and rows[0]["stopped_at"] == [400, 400, 352]


def test_sweep_step_errors(tmp_path, capsys):
    base = _fake_sweep(tmp_path / "bf16", {0: {100: 6.0, 200: 5.5}, 1: {100: 6.5, 150: 6.0}})
    with pytest.raises(ValueError, match=r"seed-1: no validation CE at step 200 .* eval steps: \[100, 150\]"):
        sweep.read_sweep(base, step=200)
    assert sweep.main([str(base), "--step", "200"]) == 2
    assert "seed-1" in capsys.readouterr().err
    # without a step every run evaluated, the note says so instead of suggesting one
    other = _fake_sweep(tmp_path / "fp8", {0: {50: 6.1}})
    assert sweep.common_eval_step([sweep.read_sweep(base), sweep.read_sweep(other)]) is None
    assert sweep.common_eval_step([sweep.read_sweep(base)]) == 100
    rows = sweep.compare([sweep.read_sweep(base), sweep.read_sweep(other)], "bf16")
    assert "no step was evaluated by every run" in sweep.table_markdown(rows, "bf16", None)
