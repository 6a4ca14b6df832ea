"""`--attn_stats`: the in-training attention monitor measures the attention the model really runs (sink mass per
packed document, the dS row-sum residual under the run's numerics), leaves the model's numbers unchanged, reaches
metrics.jsonl, TensorBoard and `hf-deltamatch plot`; and the split-precision ablations are what they say."""

from __future__ import annotations

import pytest
import torch

from _recipe_helpers import metrics, run_inprocess, tiny_args, write_corpus
from test_fidelity import build_sink_model
from hf_deltamatch.training.attn_stats import AttentionStats


@pytest.fixture(scope="module")
def sink_model(tmp_path_factory):
    return build_sink_model(tmp_path_factory.mktemp("sink") / "model")


def _packed_batch(tok, lens=(41, 61)):
    """Two documents, each BOS + random tokens, packed into one row the way the recipes' collator does."""
    from hf_deltamatch.training.data import PackedCollator

    g = torch.Generator().manual_seed(0)
    ids = []
    for n in lens:
        ids += [tok.bos_token_id] + torch.randint(3, len(tok), (n - 1,), generator=g).tolist()
    return PackedCollator()([{"input_ids": ids, "doc_lens": list(lens)}])


def _run(model, batch, monitor=None):
    model.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.arm(monitor.every)
    loss = model(input_ids=batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                 cu_seq_lens_q=batch["cu_seq_lens_q"], cu_seq_lens_k=batch["cu_seq_lens_k"],
                 max_length_q=batch["max_length_q"], max_length_k=batch["max_length_k"]).loss
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return loss.detach(), grads, (monitor.collect() if monitor is not None else None)


@pytest.mark.parametrize("rows", [256, 16])
def test_monitor_measures_the_models_attention(sink_model, rows, monkeypatch):
    """rows=16: each document measured on its last 16 query rows only (ROWS), against all its keys."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_deltamatch.training import attn_stats

    monkeypatch.setattr(attn_stats, "ROWS", rows)

    model = AutoModelForCausalLM.from_pretrained(sink_model, attn_implementation="sdpa", dtype=torch.bfloat16)
    batch = _packed_batch(AutoTokenizer.from_pretrained(sink_model))
    loss0, grads0, _ = _run(model, batch)
    rows = {}
    for delta in ("matching", "stale"):
        with AttentionStats("sdpa", every=1, precision="fp8", delta=delta) as monitor:
            loss, grads, rows[delta] = _run(model, batch, monitor)
        assert torch.equal(loss, loss0) and torch.equal(grads, grads0)  # the monitor only looks
    sink, plain = rows["matching"]
    assert (sink["layer"], plain["layer"]) == (0, 1)
    # per packed document: every row of the second document attends to its own BOS, not the first document's
    # (treating the row as one sequence would split that mass between two BOS tokens: about 0.7 overall)
    assert sink["sink_mass"] > 0.85 and plain["sink_mass"] < 0.2, rows
    assert sink["max_abs_logit"] > 5 > plain["max_abs_logit"]
    for m, s in zip(rows["matching"], rows["stale"]):
        assert m["nonfinite"] == s["nonfinite"] == 0
        assert m["ds_residual"] < 1e-5 and s["ds_residual"] > 100 * m["ds_residual"], (m, s)
        assert m["sink_mass"] == s["sink_mass"] and m["head"] == s["head"]


def test_monitor_off_changes_nothing_and_skips_eager(tmp_path):
    from hf_deltamatch.training.config import ConfigError, parse_config

    from _recipe_helpers import to_argv

    corpus = write_corpus(tmp_path / "c.jsonl", n_docs=30)
    with pytest.raises(ConfigError, match="eager"):
        parse_config(to_argv(tiny_args(tmp_path, corpus, attn="eager", attn_stats=5)))
    with pytest.raises(ConfigError, match="attn_stats must be >= 0"):
        parse_config(to_argv(tiny_args(tmp_path, corpus, attn_stats=-1)))


@pytest.mark.parametrize("attn,precision,delta", [("deltamatch_fp8", "fp8", "matching"),
                                                   ("deltamatch_fp8", "fp8", "stale"), ("sdpa", "bf16", "matching")])
def test_recipe_writes_attn_stats(attn, precision, delta, tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", n_docs=80)
    out = tmp_path / "run"
    s = run_inprocess(tiny_args(tmp_path, corpus, attn=attn, precision=precision, delta=delta, attn_stats=3,
                                max_steps=6, eval_every=6, output_dir=str(out)))
    recs = [r for r in metrics(out) if r["kind"] == "attn"]
    assert [(r["step"], r["layer"]) for r in recs] == [(3, 1), (6, 1)]  # the tiny hybrid's one attention layer
    assert recs[0]["head"] != recs[1]["head"] and s["attn_stats_s"] > 0
    for r in recs:
        assert 0 < r["sink_mass"] < 1 and r["max_abs_logit"] > 0 and r["nonfinite"] == 0
        # stale delta: fp8's, or sdpa's (measured as bf16 with FlashAttention's delta: small, but above fp32 rounding)
        if delta == "stale" or attn == "sdpa":
            assert r["ds_residual"] > (1e-2 if precision == "fp8" else 1e-4)
        else:
            assert r["ds_residual"] < 1e-5
    if attn == "sdpa":
        assert recs[0]["ds_residual"] < 1e-2  # bf16 O: far smaller than fp8-stale's
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(out.glob("**/events.out.tfevents.*")).parent))
    events.Reload()
    assert {"attn/layer1/sink_mass", "attn/layer1/ds_residual", "attn/layer1/max_abs_logit"} <= \
        set(events.Tags()["scalars"])
    if attn == "deltamatch_fp8" and delta == "stale":
        from hf_deltamatch.training.plot import plot_main

        assert plot_main([str(out), "-o", str(tmp_path / "curves.png")]) == 0
        assert (tmp_path / "curves_attn.png").read_bytes()[:4] == b"\x89PNG"


def test_recipe_without_attn_stats_writes_none(tmp_path):
    corpus = write_corpus(tmp_path / "c.jsonl", n_docs=60)
    s = run_inprocess(tiny_args(tmp_path, corpus, max_steps=2, eval_every=2))
    assert not [r for r in metrics(tmp_path / "run") if r["kind"] == "attn"] and s["attn_stats_s"] is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("split", ["fp8_fwd", "fp8_bwd"])
def test_split_precision_ablation(split, device):
    """fp8_fwd: the output of the fp8 op, the gradient of the bf16 op; fp8_bwd: the other way round."""
    import hf_deltamatch
    from hf_deltamatch.training.config import TrainConfig
    from hf_deltamatch.training.modeling import SPLIT_PRECISION, setup_attention

    name = setup_attention(TrainConfig(attn="deltamatch_fp8", precision=split, delta="stale"))
    from transformers import AttentionInterface

    split_fn = AttentionInterface._global_mapping[name]
    plain_fn = AttentionInterface._global_mapping["deltamatch_fp8"]
    module = torch.nn.Module().eval()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 128, 32, generator=g).to(device, torch.bfloat16) for h in (4, 2, 2))
    do = torch.randn(1, 128, 4, 32, generator=g).to(device, torch.bfloat16)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(module, *leaves, None, scaling=32 ** -0.5)[0]
        out.backward(do)
        return out.detach(), [t.grad for t in leaves]

    out, grads = run(split_fn)
    ref = {}
    for precision in ("fp8", "bf16"):
        hf_deltamatch.set_default_config(hf_deltamatch.DeltaMatchConfig(precision=precision, delta="stale"))
        ref[precision] = run(plain_fn)
    fwd, bwd = SPLIT_PRECISION[split]
    assert torch.equal(out, ref[fwd][0]) and not torch.equal(out, ref[bwd][0])
    for a, b, c in zip(grads, ref[bwd][1], ref[fwd][1]):
        assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.gpu
def test_recipe_attn_stats_on_gpu(tmp_path):
    """The monitor around the Triton kernels (head_dim 64) in a CUDA training run."""
    pytest.importorskip("datasets", reason="the recipe reads its corpus with datasets")
    from _recipe_helpers import TINY_MODEL

    corpus = write_corpus(tmp_path / "c.jsonl", n_docs=80)
    model = {**TINY_MODEL, "head_dim": 64}
    for delta in ("matching", "stale"):
        out = tmp_path / delta
        run_inprocess(tiny_args(tmp_path, corpus, attn="deltamatch_fp8", precision="fp8", delta=delta, attn_stats=3,
                                max_steps=6, model_config=model, output_dir=str(out)))
        recs = [r for r in metrics(out) if r["kind"] == "attn"]
        assert [r["step"] for r in recs] == [3, 6] and all(r["nonfinite"] == 0 for r in recs)
        assert all((r["ds_residual"] > 1e-2) if delta == "stale" else (r["ds_residual"] < 1e-5) for r in recs), recs
