"""The training recipe end to end on CPU: loss falls in every attention mode, exact resume (also after
Ctrl-C), LoRA trains only adapters, 2-process DDP, fail-fast configs, the embedded default, plotting."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from _recipe_helpers import REPO, TINY_MODEL, env, load_safetensors, metrics, run_inprocess, run_script, tiny_args, \
    to_argv, write_corpus
from hf_deltamatch.training.config import ConfigError, TrainConfig, parse_config


def _deltamatch_ready() -> bool:
    try:
        import hf_deltamatch  # noqa: F401
        from transformers import AttentionInterface
    except Exception:
        return False
    return "deltamatch_fp8" in AttentionInterface._global_mapping


needs_dm = pytest.mark.skipif(not _deltamatch_ready(), reason="deltamatch_fp8 not registered in this checkout")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.jsonl")


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


MODES = [
    ("sdpa", "bf16", "matching", "adamw"),
    pytest.param("deltamatch_fp8", "fp8", "matching", "adamw", marks=needs_dm),
    pytest.param("deltamatch_fp8", "fp8", "stale", "adamw", marks=needs_dm),
    pytest.param("deltamatch_fp8", "bf16", "matching", "adamw", marks=needs_dm),
    pytest.param("deltamatch_fp8", "fp8", "matching", "muon", marks=needs_dm),
]


@pytest.mark.parametrize("attn,precision,delta,optimizer", MODES)
def test_loss_falls_in_every_mode(attn, precision, delta, optimizer, corpus, runs_root):
    out = runs_root / f"{attn}-{precision}-{delta}-{optimizer}"
    s = run_inprocess(tiny_args(runs_root, corpus, attn=attn, precision=precision, delta=delta,
                                optimizer=optimizer, output_dir=str(out)))
    recs = [r for r in metrics(out) if r["kind"] == "train"]
    assert len(recs) == 12 and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    first, last3 = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
    assert last3 < first - 0.5, f"loss did not fall: {first:.3f} -> {last3:.3f}"
    evals = [r["val_loss"] for r in metrics(out) if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1] < first - 0.5
    assert s["steps"] == 12
    assert (out / "final" / "config.json").is_file() and (out / "final" / "tokenizer.json").is_file()
    assert any((out / "checkpoints").glob("step_*/DONE"))
    assert list(out.glob("*/events.out.tfevents.*")) or list(out.glob("**/events.out.tfevents.*"))
    for k in ("lr", "grad_norm", "tokens_per_s", "mem_gb", "tokens"):
        assert recs[-1][k] is not None


def test_plot_compares_runs(corpus, tmp_path):
    from hf_deltamatch.training.plot import plot_main

    run_dirs = []
    for lr in (3e-3, 1e-3):
        out = tmp_path / f"lr{lr}"
        run_inprocess(tiny_args(tmp_path, corpus, lr=lr, max_steps=4, eval_every=2, output_dir=str(out)))
        run_dirs.append(str(out))
    png, md = tmp_path / "cmp.png", tmp_path / "cmp.md"
    assert plot_main([*run_dirs, "-o", str(png), "--table", str(md)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    rows = [l for l in md.read_text().splitlines() if l.startswith("| ") and not l.startswith("| run")]
    assert [r.split("|")[1].strip() for r in rows] == ["lr0.003", "lr0.001"]
    assert "train loss @ step 4" in md.read_text()
    # the gap panel (each run minus the first) only where there is a second run: one run, one panel (8 x 5 in)
    import matplotlib.image

    one = tmp_path / "one.png"
    assert plot_main([run_dirs[0], "-o", str(one)]) == 0
    assert matplotlib.image.imread(png).shape[0] == 7 * 120 and matplotlib.image.imread(one).shape[0] == 5 * 120
    assert plot_main([str(tmp_path / "nope")]) == 2


def _same_checkpoint(a: Path, b: Path):
    ta, tb = load_safetensors(a / "model.safetensors"), load_safetensors(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), f"{k} differs"
    oa = torch.load(a / "optimizer.bin", weights_only=False)
    ob = torch.load(b / "optimizer.bin", weights_only=False)
    for pid, st in oa["state"].items():
        for name, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ob["state"][pid][name])), f"optimizer {pid}.{name}"


@pytest.fixture(scope="module")
def resume_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume")
    small = write_corpus(tmp / "small.jsonl", n_docs=60, seed=3)  # < 1 epoch of 48 micro-batches: crosses an epoch
    cfg = tiny_args(tmp, small, max_steps=24, grad_accum=2, save_every=8, keep_checkpoints=3, eval_every=8,
                    output_dir=str(tmp / "straight"))
    run_inprocess(cfg)
    return tmp, cfg


def test_resume_from_checkpoint_is_bit_identical(resume_setup):
    tmp, cfg = resume_setup
    straight = Path(cfg["output_dir"])
    resumed = tmp / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "tokenizer", resumed / "tokenizer")
    shutil.copytree(straight / "checkpoints" / "step_0000008", resumed / "checkpoints" / "step_0000008")
    s = run_inprocess({**cfg, "output_dir": str(resumed), "resume": "auto"})
    assert s["start_step"] == 8 and min(r["step"] for r in metrics(resumed)) == 9  # really resumed, not re-run
    _same_checkpoint(straight / "checkpoints" / "step_0000024", resumed / "checkpoints" / "step_0000024")
    a = [r for r in metrics(straight) if r["step"] > 8]
    b = [r for r in metrics(resumed) if r["step"] > 8]
    assert [(r["kind"], r.get("loss"), r.get("val_loss")) for r in a] == \
           [(r["kind"], r.get("loss"), r.get("val_loss")) for r in b]


def test_ctrl_c_saves_and_resume_continues_bit_identically(resume_setup):
    tmp, cfg = resume_setup
    out = tmp / "interrupted"
    argv = ["recipes/pretrain.py", *to_argv({**cfg, "output_dir": str(out)})]
    proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        m = out / "metrics.jsonl"
        if m.is_file() and any(json.loads(x)["step"] >= 2 for x in m.read_text().splitlines() if x.strip()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted:\n" + proc.stdout.read()[-3000:]
    proc.send_signal(signal.SIGINT)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, log[-3000:]
    saved = sorted((out / "checkpoints").glob("step_*/DONE"))
    assert saved, log[-3000:]
    stopped_at = int(saved[-1].parent.name.split("_")[1])
    assert 2 <= stopped_at < 24 and "--resume auto" in log
    s = run_inprocess({**cfg, "output_dir": str(out), "resume": "auto"})
    assert s["steps"] == 24 and s["start_step"] == stopped_at
    _same_checkpoint(Path(cfg["output_dir"]) / "checkpoints" / "step_0000024", out / "checkpoints" / "step_0000024")


def test_lora_trains_only_adapters(corpus, tmp_path):
    from hf_deltamatch.training.data import load_tokenizer
    from hf_deltamatch.training.modeling import build_model

    cfg = tiny_args(tmp_path, corpus, lora="4,8,q_proj,v_proj", max_steps=4, save_every=4, eval_every=4)
    s = run_inprocess(cfg)
    assert 0 < s["trainable_params"] < s["params"] / 5
    ckpt = load_safetensors(tmp_path / "run" / "checkpoints" / "step_0000004" / "model.safetensors")
    tc = parse_config(to_argv(cfg))
    init = build_model(tc, load_tokenizer(tc)).state_dict()
    lora_keys = [k for k in ckpt if "lora_" in k]
    assert lora_keys and all("q_proj" in k or "v_proj" in k for k in lora_keys)
    for k, v in ckpt.items():
        ref_key = k[len("model."):] if k.startswith("model.") else k
        if "lora_" in k:
            if "lora_B" in k:
                assert v.abs().sum() > 0, f"{k} did not train"
        else:
            assert torch.equal(v, init[ref_key]), f"base weight {k} changed"
    adapter = tmp_path / "run" / "final"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()


def test_streaming_data_trains_and_resumes(corpus, tmp_path):
    cfg = tiny_args(tmp_path, corpus, streaming=True, val_docs=8, shuffle_buffer=50, max_steps=6, save_every=3,
                    eval_every=3)
    s = run_inprocess(cfg)
    recs = [r for r in metrics(tmp_path / "run") if r["kind"] == "train"]
    assert s["steps"] == 6 and recs[-1]["loss"] < recs[0]["loss"]
    assert [r["step"] for r in metrics(tmp_path / "run") if r["kind"] == "eval"] == [3, 6]
    # resume a streamed run: the stream is replayed and the consumed batches skipped
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "run" / "tokenizer", resumed / "tokenizer")
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_0000003", resumed / "checkpoints" / "step_0000003")
    s2 = run_inprocess({**cfg, "output_dir": str(resumed), "resume": "auto"})
    assert s2["start_step"] == 3
    _same_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000006", resumed / "checkpoints" / "step_0000006")


def test_chunked_loss_equals_full_loss():
    from transformers import AutoConfig, AutoModelForCausalLM

    from hf_deltamatch.training.data import PackedCollator
    from hf_deltamatch.training.modeling import CausalLMWithLoss, keep_linear_attention_documents_apart

    spec = dict(TINY_MODEL)
    config = AutoConfig.for_model(spec.pop("model_type"), vocab_size=101, **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    keep_linear_attention_documents_apart(model, force=True)
    batch = PackedCollator()([{"input_ids": torch.randint(0, 101, (96,)).tolist(), "doc_lens": [30, 66]}])
    losses, grads = [], []
    for chunk in (0, 17):
        model.zero_grad()
        loss, n = CausalLMWithLoss(model, chunk)(**batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        assert n.item() == 96 - 2
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_ddp_two_processes_on_cpu(corpus, tmp_path):
    out = tmp_path / "ddp"
    cfg = tiny_args(tmp_path, corpus, max_steps=4, eval_every=2, save_every=2, output_dir=str(out))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        "29631", "recipes/pretrain.py", *to_argv(cfg)], cwd=REPO, env=env(), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["num_processes"] == 2 and s["steps"] == 4
    recs = [r_ for r_ in metrics(out) if r_["kind"] == "train"]
    assert [r_["step"] for r_ in recs] == [1, 2, 3, 4]  # one writer (rank 0), not two
    assert recs[0]["tokens"] > 4 * 64 * 1.5  # tokens counted over both ranks
    assert (out / "checkpoints" / "step_0000004" / "DONE").is_file()


# ---- fail fast ---------------------------------------------------------------------------------------------


def test_bad_configs_fail_fast(tmp_path, corpus):
    base = tiny_args(tmp_path, corpus)
    cases = [
        ({"data": str(tmp_path / "missing.jsonl")}, "matches no file"),
        ({"model": str(tmp_path / "no_such_checkpoint")}, "not a directory"),
        ({"attn": "flash_attn_99"}, "--attn"),
        ({"lora": "8"}, "--lora"),
        ({"attn": "deltamatch_fp8", "model_config": {**TINY_MODEL, "head_dim": 24}}, "head_dim % 16"),
        ({"precision": "fp4"}, "--precision"),
        ({"resume": str(tmp_path / "nope")}, "--resume"),
        ({"tokenizer": str(tmp_path / "no_tok")}, "--tokenizer"),
        ({"batch_size": 0}, "--batch_size"),
    ]
    for over, needle in cases:
        with pytest.raises(ConfigError, match=needle.replace("%", "%").replace("-", r"\-").replace("(", r"\(")):
            parse_config(to_argv({**base, **over}))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: 1e-3\nlearning_rate: 3e-4\n")
    with pytest.raises(ConfigError, match="unknown setting.*learning_rate"):
        parse_config(["--config", str(bad_yaml)])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_config(["--config", str(tmp_path / "nope.yaml")])


def test_cli_fails_fast_with_a_clear_message(tmp_path):
    start = time.time()
    r = run_script(["recipes/pretrain.py", "--data", str(tmp_path / "missing.txt"), "--output_dir",
                    str(tmp_path / "run")], timeout=120)
    assert r.returncode == 2 and "matches no file" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()  # nothing computed, nothing written
    assert time.time() - start < 60


def test_recipe_configs_parse_and_tiny_cpu_is_the_default(tmp_path):
    import yaml

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    configs = sorted((REPO / "recipes" / "configs").glob("*.yaml"))
    assert {p.stem for p in configs} >= {"tiny-cpu", "hybrid-small", "hybrid-1p7b", "extend-64k"}
    for path in configs:
        extra = ["--model", str(ckpt)] if yaml.safe_load(path.read_text()).get("model") else []
        cfg = parse_config(["--config", str(path), *extra])
        assert isinstance(cfg, TrainConfig)
    for path in sorted((REPO / "recipes" / "configs" / "accelerate").glob("*.yaml")):
        assert yaml.safe_load(path.read_text())["distributed_type"]
    tiny = yaml.safe_load((REPO / "recipes" / "configs" / "tiny-cpu.yaml").read_text())
    from_file = parse_config(["--config", str(REPO / "recipes/configs/tiny-cpu.yaml")])
    assert parse_config([]).to_dict() == from_file.to_dict()
    assert set(tiny) <= set(TrainConfig().to_dict())


@pytest.mark.slow
def test_embedded_default_runs(tmp_path):
    """`recipes/pretrain.py` with no data/model arguments: offline stdlib corpus + local tokenizer, shortened."""
    out = tmp_path / "default"
    r = run_script(["recipes/pretrain.py", "--max_steps", "5", "--eval_every", "5", "--log_every", "1",
                    "--output_dir", str(out)], timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    recs = [x for x in metrics(out) if x["kind"] == "train"]
    assert len(recs) == 5 and recs[-1]["loss"] < recs[0]["loss"]
    s = json.loads((out / "summary.json").read_text())
    assert s["attn"] == "deltamatch_fp8" or not _deltamatch_ready()


def test_context_extension_stage(corpus, tmp_path):
    """recipes/context_extension.py from a pretrained tiny checkpoint: RoPE base change, longer packed
    sequences, activation checkpointing and chunked loss; the saved model carries the new RoPE config."""
    base = tmp_path / "base"
    run_inprocess(tiny_args(tmp_path, corpus, max_steps=3, eval_every=3, output_dir=str(base)))
    out = tmp_path / "ext"
    r = run_script(["recipes/context_extension.py", "--model", str(base / "final"), "--data", str(corpus),
                    "--output_dir", str(out), "--seq_len", "512", "--max_position_embeddings", "512",
                    "--loss_chunk", "100", "--max_steps", "2", "--eval_every", "2", "--eval_batches", "1",
                    "--log_every", "1", "--attn", "sdpa"], timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    import yaml

    used = yaml.safe_load((out / "config.yaml").read_text())
    assert used["gradient_checkpointing"] and used["rope_theta"] == 1e6 and used["seq_len"] == 512
    saved = json.loads((out / "final" / "config.json").read_text())
    rope = saved.get("rope_parameters") or {}
    assert rope.get("rope_theta") == 1e6 and saved["max_position_embeddings"] == 512
    recs = [x for x in metrics(out) if x["kind"] == "train"]
    assert len(recs) == 2 and all(torch.isfinite(torch.tensor(x["loss"])) for x in recs)
    # it continued from the checkpoint: the loss starts near where pretraining ended, not at ln(vocab)
    assert recs[0]["loss"] < torch.log(torch.tensor(320.0)).item() - 0.3


def test_max_minutes_stops_cleanly(corpus, tmp_path):
    s = run_inprocess(tiny_args(tmp_path, corpus, max_minutes=1e-4, log_every=5, eval_every=5))
    assert s["time_limited"] and not s["interrupted"] and s["steps"] == 1
    kinds = [(r["kind"], r["step"]) for r in metrics(tmp_path / "run")]
    assert kinds == [("train", 1), ("eval", 1)]  # logged and evaluated at the stop even off-schedule
    assert (tmp_path / "run" / "checkpoints" / "step_0000001" / "DONE").is_file()
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def test_unreachable_hub_dataset_is_a_clear_error(tmp_path, corpus, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="could not load hub dataset 'someuser/somedataset'"):
        run_inprocess(tiny_args(tmp_path, corpus, data="someuser/somedataset"))


@needs_dm
def test_fp8_linear_layers_train(corpus, tmp_path):
    """--fp8_linear: torchao float8 training for every Linear but the LM head (CPU emulates the FP8 GEMMs);
    with deltamatch_fp8 attention that is the fully 8-bit configuration. The loss still falls."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from hf_deltamatch.training.data import load_tokenizer
    from hf_deltamatch.training.modeling import build_model

    cfg = tiny_args(tmp_path, corpus, fp8_linear=True, attn="deltamatch_fp8", precision="fp8", delta="matching")
    s = run_inprocess(cfg)
    recs = [r for r in metrics(tmp_path / "run") if r["kind"] == "train"]
    first, last3 = recs[0]["loss"], sum(r["loss"] for r in recs[-3:]) / 3
    assert s["steps"] == 12 and last3 < first - 0.5, f"loss did not fall: {first:.3f} -> {last3:.3f}"
    tc = parse_config(to_argv(cfg))
    model = build_model(tc, load_tokenizer(tc))
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    plain = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    assert fp8 and all("lm_head" not in n for n in fp8) and any("lm_head" in n for n in plain), (fp8, plain)


@pytest.mark.slow
def test_compiled_fp8_linears_match_eager():
    """--compile_fp8_linear: each float8 linear under torch.compile (torchao fuses its scaling and casts only there)
    computes what the eager float8 linear does: the same loss and gradients (the same casts and GEMMs, fused; 1e-6
    allows a reordered fp32 reduction), and dynamo's recompile limit leaves room for a model's distinct shapes."""
    pytest.importorskip("torchao.float8")
    import torch._dynamo
    from torchao.float8.float8_linear import Float8Linear

    from hf_deltamatch.training.modeling import FP8_LINEAR_RECOMPILE_LIMIT, convert_linear_to_fp8

    def run(compile):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        convert_linear_to_fp8(model, compile=compile)
        assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 2
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    limit = torch._dynamo.config.recompile_limit
    try:
        (l_eager, g_eager), (l_comp, g_comp) = run(False), run(True)
        assert torch._dynamo.config.recompile_limit >= FP8_LINEAR_RECOMPILE_LIMIT
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()
    assert torch.allclose(l_eager, l_comp, rtol=1e-6, atol=0)
    for a, b in zip(g_eager, g_comp):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9)


def test_compile_fp8_linear_needs_fp8_linear(corpus, tmp_path):
    with pytest.raises(ConfigError, match="--compile_fp8_linear compiles the float8 linears of --fp8_linear"):
        parse_config(to_argv(tiny_args(tmp_path, corpus, compile_fp8_linear=True)))


def test_fp8_linear_without_torchao_fails_fast(corpus, tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match="needs torchao"):
        parse_config(to_argv(tiny_args(tmp_path, corpus, fp8_linear=True)))
