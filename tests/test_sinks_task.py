"""The sinks task (`data: bigram_backcopy`, training/tasks.py): the generator makes what its docstring says, offline
and reproducibly; the recipe reads it with <bos> first in every packed document (the key the monitor measures as
the sink) and reports the task's accuracy; recipes/configs/sinks-cpu.yaml grows a sink; and the study's analysis
(training/sink_study.py, recipes/sinks_study.sh) turns runs into summary.json, results.md and plots."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from _recipe_helpers import REPO, env, metrics, run_inprocess, to_argv
from hf_deltamatch.training import sink_study
from hf_deltamatch.training.config import ConfigError, parse_config
from hf_deltamatch.training.tasks import BOS, BigramBackcopy, task_of

CPU_CONFIG = REPO / "recipes" / "configs" / "sinks-cpu.yaml"
GPU_CONFIG = REPO / "recipes" / "configs" / "sinks-task.yaml"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The task's files and the datasets cache under tmp_path (never the user's cache)."""
    import datasets

    monkeypatch.setenv("HF_DELTAMATCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache" / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache" / "datasets")
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------------------------------------
# The generator
# ---------------------------------------------------------------------------------------------------------------


def test_sequences_follow_the_task_rules():
    task = BigramBackcopy(vocab=16, triggers=2, trigger_p=0.2, alpha=0.3)
    seqs = task.generate(400, 60, seed=3, stream=1)
    V = task.vocab
    assert seqs.shape == (400, 60) and seqs.min() >= 0 and seqs.max() < V + task.triggers
    trig = seqs >= V
    assert not trig[:, 0].any() and not trig[:, -1].any()  # a trigger always has a token before and after it
    assert not (trig[:, 1:] & trig[:, :-1]).any()  # a copy follows every trigger, never another trigger
    rows, cols = np.nonzero(trig)
    assert (seqs[rows, cols + 1] == seqs[rows, cols - 1]).all()  # the copy of the token before the trigger
    # a trigger comes with probability trigger_p at every position after an ordinary token but the last
    eligible = ~trig[:, :-1]  # position t = 1.. follows an ordinary token
    eligible[:, -1] = False
    share = trig[:, 1:].sum() / eligible.sum()
    assert abs(share - task.trigger_p) < 0.02, share
    # the bigram steps (not after a trigger, not a trigger) follow the transition matrix
    trans = task.transitions(3)
    prev, nxt = seqs[:, :-1], seqs[:, 1:]
    step = ~trig[:, :-1] & ~trig[:, 1:]
    common = np.bincount(prev[step], minlength=V).argmax()
    seen = np.bincount(nxt[step & (prev == common)], minlength=V)
    assert 0.5 * np.abs(seen / seen.sum() - trans[common]).sum() < 0.1
    # reproducible, and the train and validation streams differ
    assert np.array_equal(seqs, task.generate(400, 60, seed=3, stream=1))
    assert not np.array_equal(seqs, task.generate(400, 60, seed=3, stream=2))
    assert not np.array_equal(trans, task.transitions(4))


def test_files_and_tokenizer(cache, tmp_path):
    task = BigramBackcopy(vocab=8, triggers=3, train_sequences=50, val_sequences=20)
    train, val = task.build(cache, seq_len=32, seed=0)
    assert train.parent == val.parent and json.loads((train.parent / "task.json").read_text())["seq_len"] == 32
    docs = [json.loads(x)["text"] for x in val.read_text().splitlines()]
    assert len(docs) == 20 and len(train.read_text().splitlines()) == 50
    tok = task.build_tokenizer(tmp_path / "tok")
    assert tok.bos_token == BOS and tok.convert_tokens_to_ids(BOS) == 1 and tok.eos_token_id == 0
    ids = tok(docs, add_special_tokens=False)["input_ids"]
    assert all(len(x) == 31 and x[0] == tok.bos_token_id for x in ids)  # + <|endoftext|> = one 32-token block
    assert tok.decode(ids[0]) == docs[0]
    with pytest.raises(Exception):
        tok("<bos> w3 w99")  # not a task word: an error, not a silent <unk>
    # written once: a second build reads the same files
    mtime = val.stat().st_mtime_ns
    assert task.build(cache, seq_len=32, seed=0) == (train, val) and val.stat().st_mtime_ns == mtime
    assert task.build(cache, seq_len=32, seed=1)[1] != val


def test_config_errors(tmp_path):
    base = ["--config", str(CPU_CONFIG), "--output_dir", str(tmp_path / "run")]
    assert task_of(parse_config(base)) == BigramBackcopy(vocab=64, triggers=3, trigger_p=0.1, alpha=0.1,
                                                         train_sequences=20000, val_sequences=256)
    assert task_of(parse_config(base + ["--task", '{"vocab": 32}'])).vocab == 32
    assert task_of(parse_config(base + ["--task", "none"])) == BigramBackcopy()  # the task's defaults
    for argv, match in ((["--task", '{"vocabulary": 32}'], r"unknown bigram_backcopy parameter\(s\) \['vocabulary'\]"),
                        (["--task", '{"trigger_p": 1.5}'], "trigger_p must be in"),
                        (["--task", '{"vocab": 64.0}'], "task.vocab must be an integer, got 64.0"),
                        (["--seq_len", "2"], "seq_len must be at least 3"),
                        (["--data_seed", "-1"], "data_seed must be >= 0"),
                        (["--data", "stdlib"], "--task sets the parameters of a generated task")):
        with pytest.raises(ConfigError, match=match):
            parse_config(base + argv)


def test_a_foreign_tokenizer_is_refused(cache, tmp_path):
    from hf_deltamatch.training.data import load_tokenizer

    other = BigramBackcopy(vocab=10).build_tokenizer(tmp_path / "other")
    assert other is not None
    cfg = parse_config(["--config", str(CPU_CONFIG), "--output_dir", str(tmp_path / "run"),
                        "--tokenizer", str(tmp_path / "other")])
    with pytest.raises(ConfigError, match="not the bigram_backcopy task's vocabulary"):
        load_tokenizer(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Through the recipe
# ---------------------------------------------------------------------------------------------------------------


def _small(tmp_path, **over) -> dict:
    cfg = {"config": str(CPU_CONFIG), "output_dir": str(tmp_path / "run"), "batch_size": 4,
           "task": {"vocab": 16, "train_sequences": 64, "val_sequences": 12}, "seq_len": 32}
    cfg.update(over)
    return cfg


def test_packed_documents_start_with_the_sink_key(cache, tmp_path):
    """Each sequence fills one block, so every packed document (what --attn_stats and the monitor call a document,
    with position_ids restarting at 0) starts with <bos>; the scored positions are the triggers and their labels
    the copies."""
    from hf_deltamatch.training.data import build_dataloaders, load_text_splits, load_tokenizer

    cfg = parse_config(to_argv(_small(tmp_path)))
    train_text, val_text = load_text_splits(cfg)
    tok = load_tokenizer(cfg)
    train_dl, val_dl, n_blocks = build_dataloaders(cfg, tok, train_text, val_text)
    assert n_blocks == 64
    task = task_of(cfg)
    for batch in (next(iter(train_dl)), next(iter(val_dl))):
        ids, pos, labels = batch["input_ids"][0], batch["position_ids"][0], batch["labels"][0]
        starts = torch.nonzero(pos == 0).flatten()
        assert starts.tolist() == list(range(0, ids.numel(), cfg.seq_len))
        assert batch["cu_seq_lens_q"].tolist() == list(range(0, ids.numel() + 1, cfg.seq_len))
        assert (ids[starts] == tok.bos_token_id).all() and (ids == tok.bos_token_id).sum() == len(starts)
        scored = task.scored_positions(batch["input_ids"], tok)[0]
        t = torch.nonzero(scored).flatten()
        assert len(t) and torch.equal(labels[t + 1], ids[t - 1])


def test_recipe_reports_the_task_accuracy(cache, tmp_path):
    """val_targets counts every trigger of the validation set (eval covers all of it), val_acc is a share of
    them, and the run's summary has the final values; the training loss falls."""
    out = tmp_path / "run"
    s = run_inprocess(_small(tmp_path, max_steps=6, eval_every=3, attn_stats=3, log_every=1, eval_batches=100))
    evals = [r for r in metrics(out) if r["kind"] == "eval"]
    val_docs = [json.loads(x)["text"] for x in
                next((cache / "tasks").glob("bigram_backcopy-*/val.jsonl")).read_text().splitlines()]
    triggers = sum(w.startswith("T") for doc in val_docs for w in doc.split())
    assert [r["step"] for r in evals] == [3, 6] and triggers > 0
    for r in evals:
        assert r["val_targets"] == triggers and 0 <= r["val_acc"] <= 1 and r["val_target_loss"] > 0
    assert s["final_val_acc"] == evals[-1]["val_acc"] and s["final_val_target_loss"] == evals[-1]["val_target_loss"]
    attn = [r for r in metrics(out) if r["kind"] == "attn"]
    assert [(r["step"], r["layer"]) for r in attn] == [(3, 0), (3, 1), (6, 0), (6, 1)]
    train = [r["loss"] for r in metrics(out) if r["kind"] == "train"]
    assert train[-1] < train[0]
    assert (out / "final" / "tokenizer.json").is_file()


def test_chunked_loss_reports_the_same_targets(cache, tmp_path):
    """--loss_chunk computes the target statistics from the scored positions' hidden states alone: the same
    numbers as the full logits."""
    from hf_deltamatch.training.data import PackedCollator
    from hf_deltamatch.training.modeling import CausalLMWithLoss, build_model

    cfg = parse_config(to_argv(_small(tmp_path)))
    task = task_of(cfg)
    tok = task.build_tokenizer()
    model = build_model(cfg, tok)
    docs = task.documents(3, cfg.seq_len, seed=0, stream=2)
    ids = [x + [tok.eos_token_id] for x in tok(docs, add_special_tokens=False)["input_ids"]]
    batch = PackedCollator()([{"input_ids": x, "doc_lens": [len(x)]} for x in ids])
    scored = task.scored_positions(batch["input_ids"], tok)
    with torch.no_grad():
        full = CausalLMWithLoss(model, 0)(**batch, scored=scored)
        chunked = CausalLMWithLoss(model, 16)(**batch, scored=scored)
    assert full[2][2] == scored.sum() > 0
    assert torch.allclose(full[0], chunked[0], rtol=1e-5) and torch.allclose(full[2], chunked[2], rtol=1e-5)


@pytest.mark.slow
def test_sinks_cpu_config_grows_a_sink(cache, tmp_path):
    """recipes/configs/sinks-cpu.yaml as it is (bf16 attention numerics): some layer's sink mass reaches 0.5, and
    the copies are learned."""
    out = tmp_path / "run"
    run_inprocess({"config": str(CPU_CONFIG), "output_dir": str(out)})
    attn = [r for r in metrics(out) if r["kind"] == "attn"]
    best = max(attn, key=lambda r: r["sink_mass"])
    assert best["sink_mass"] >= 0.5, [(r["step"], r["layer"], round(r["sink_mass"], 3)) for r in attn]
    assert all(r["nonfinite"] == 0 for r in attn)
    evals = [r for r in metrics(out) if r["kind"] == "eval"]
    assert evals[-1]["step"] == 200 and evals[-1]["val_acc"] > 0.9 and evals[-1]["val_targets"] > 100


def test_gpu_config_parses():
    cfg = parse_config(["--config", str(GPU_CONFIG)])
    assert task_of(cfg) is not None and cfg.attn_stats > 0 and cfg.attn == "deltamatch_fp8"
    assert cfg.model_config["num_attention_heads"] == 1  # the monitor's per-layer numbers are the layer's one head


# ---------------------------------------------------------------------------------------------------------------
# The study's analysis
# ---------------------------------------------------------------------------------------------------------------


def _fake_run(path, seed, val_loss, val_acc, sink, residual, steps=100):
    """A run directory as the recipe writes it (metrics.jsonl, summary.json), with chosen final values."""
    path.mkdir(parents=True)
    recs = [{"kind": "train", "step": s, "tokens": s * 10, "loss": 3.0 - s / 100} for s in (50, 100)]
    recs += [{"kind": "eval", "step": s, "tokens": s * 10, "val_loss": val_loss + (0.5 if s == 50 else 0),
              "val_acc": val_acc, "val_target_loss": 0.1, "val_targets": 400} for s in (50, 100)]
    for s, frac in ((25, 0.3), (50, 0.95), (75, 1.0), (100, 1.0)):
        for layer, mass in ((0, 0.05), (1, sink * frac)):
            recs.append({"kind": "attn", "step": s, "tokens": s * 10, "layer": layer, "head": 0, "sink_mass": mass,
                         "ds_residual": residual * (1 + layer), "max_abs_logit": 5.0, "nonfinite": 0})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (path / "summary.json").write_text(json.dumps({"name": path.name, "steps": steps, "final_val_loss": val_loss}))


def test_analysis_counts_a_gap_only_beyond_the_floor(tmp_path):
    runs = tmp_path / "runs"
    for seed, (b, m, s) in enumerate(((2.00, 2.005, 2.10), (2.01, 2.012, 2.11), (2.02, 2.001, 2.12))):
        _fake_run(runs / "bf16" / f"seed-{seed}", seed, b, 1.0, 0.99, 1e-7)
        _fake_run(runs / "fp8-matching" / f"seed-{seed}", seed, m, 1.0, 0.98, 2e-7)
        _fake_run(runs / "fp8-stale" / f"seed-{seed}", seed, s, 0.99, 0.97, 3e-2)
    record = sink_study.analyse(runs, tmp_path / "out", modes=["bf16", "fp8-matching", "fp8-stale"])
    written = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert written == record and set(record) == {"modes", "steps", "conclusion"} and record["steps"] == 100
    assert list(record["modes"]) == ["bf16", "fp8-matching", "fp8-stale"]
    assert record["modes"]["fp8-stale"] == {"val_loss": [2.10, 2.11, 2.12], "val_acc": [0.99] * 3,
                                            "max_sink_mass": [0.97] * 3, "final_ds_residual": [6e-2] * 3}
    c = record["conclusion"]
    # bf16's range is 0.02 nats: fp8-matching (gap -0.004) is within it, fp8-stale (+0.1) beyond, and worse; the
    # accuracy floor is one target in 400 (bf16's seeds agree exactly), which fp8-stale's 0.01 exceeds
    assert "fp8-matching 2.0060 ± 0.0056, gap -0.0040 (within the floor)" in c
    assert "fp8-stale is worse than bf16 in validation loss by 0.1000, beyond bf16's seed spread (0.0200)" in c
    assert "fp8-stale is worse than bf16 in task accuracy by 0.0100, beyond bf16's seed spread (0.0025)" in c
    assert "never reached" not in c
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| fp8-stale | 0, 1, 2 | 2.1100 ± 0.0100 | 0.0200 | +0.1000 | **yes** |" in md
    for png in ("sink_mass.png", "ds_residual.png", "val.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
    # only within the floor: no verdict against the mode
    shutil.rmtree(runs / "fp8-stale")
    c = sink_study.analyse(runs, tmp_path / "out2")["conclusion"]
    assert "Verdict: no mode differs from bf16 beyond bf16's seed spread" in c


def test_analysis_refuses_what_it_cannot_compare(tmp_path):
    runs = tmp_path / "runs"
    _fake_run(runs / "bf16" / "seed-0", 0, 2.0, 1.0, 0.5, 1e-7)
    _fake_run(runs / "fp8-stale" / "seed-0", 0, 2.0, 1.0, 0.5, 1e-2, steps=80)
    with pytest.raises(sink_study.StudyError, match="stopped at different steps"):
        sink_study.read_study(runs)
    (runs / "fp8-stale" / "seed-0" / "summary.json").unlink()
    with pytest.raises(sink_study.StudyError, match="did not finish; run the study again"):
        sink_study.read_study(runs)
    shutil.rmtree(runs / "fp8-stale")
    with pytest.raises(sink_study.StudyError, match="no mode named 'fp8-matching'"):
        sink_study.analyse(runs, tmp_path / "out", baseline="fp8-matching")
    assert "never reached a sink mass of 0.9" in sink_study.analyse(runs, tmp_path / "out")["conclusion"]
    assert sink_study.main([str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_study_script_smoke(tmp_path):
    """recipes/sinks_study.sh rehearsed on CPU (SMOKE=1: sinks-cpu.yaml, 20 steps): 2 modes x 2 seeds, the fidelity
    check of every final model, summary.json in its schema and the plots; a second call keeps what is done."""
    out = tmp_path / "out"
    e = env()
    e.update(SMOKE="1", SEEDS="0,1", MODES="bf16 fp8-stale", PYTHON=sys.executable)
    r = subprocess.run(["bash", "recipes/sinks_study.sh", str(out)], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    record = json.loads((out / "summary.json").read_text())
    assert set(record) == {"modes", "steps", "conclusion"} and record["steps"] == 20
    assert list(record["modes"]) == ["bf16", "fp8-stale"]
    for mode in record["modes"].values():
        assert set(mode) == {"val_loss", "val_acc", "max_sink_mass", "final_ds_residual"}
        assert all(len(v) == 2 and all(isinstance(x, float) for x in v) for v in mode.values())
    # stale fp8's dS rows keep a residual that bf16 with Delta-Matching does not
    residual = {mode: v["final_ds_residual"] for mode, v in record["modes"].items()}
    assert min(residual["fp8-stale"]) > 100 * max(residual["bf16"])
    assert "baseline bf16" in record["conclusion"] and "Verdict" in record["conclusion"]
    for png in ("sink_mass.png", "ds_residual.png", "val.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    md = (out / "results.md").read_text()
    assert "| bf16 | 0, 1 |" in md and "| fp8-stale | 1 | " in md and "hf-deltamatch check --model" in md
    for mode in ("bf16", "fp8-stale"):
        for seed in (0, 1):
            report = json.loads((out / "fidelity" / mode / f"seed-{seed}" / "fidelity.json").read_text())
            assert [x["layer"] for x in report["layers"]] == [0, 1]
            cfg = (out / "runs" / mode / f"seed-{seed}" / "config.yaml").read_text()
            assert "data: bigram_backcopy" in cfg and str(out / "cache" / "prep" / "tokenizer") in cfg
    assert json.loads((out / "task.json").read_text())["task"] == "bigram_backcopy"
    assert "validation sequences:" in (out / "environment.txt").read_text()
    r = subprocess.run(["bash", "recipes/sinks_study.sh", str(out)], cwd=REPO, env=e, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert r.stdout.count("finished before, kept") == 4 and "0 runs to do" in r.stdout
