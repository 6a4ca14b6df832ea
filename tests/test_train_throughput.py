"""benchmarks/train_throughput.py: its FLOP count, its span timer, and a 2-step CPU run of the tiny recipe.

The numbers that matter (tokens/s, MFU, attention share of hybrid-1p7b at 8K and 64K) come from the GPU tests
at the end; on CPU we check the plumbing: the recipe's model and step, the packed batch, the timer's forward,
recompute and backward spans, and the report.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _scripts import script_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_throughput.py"
TINY = str(ROOT / "recipes" / "configs" / "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def tp():
    with script_module(SCRIPT, "bench_train_throughput") as module:
        yield module


def test_step_flops_by_hand(tp):
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen3_5_text", hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                  layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                                  linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=16)
    flops = tp.step_flops(config, n_params=1000, doc_lens_per_row=[[100, 28], [128]], grad_accum=2)
    tokens = 256
    assert flops["dense"] == 2 * 6 * 1000 * tokens
    # causal attention: 12 * H * D * L^2 / 2 per document and layer, one attention layer
    assert flops["attention"] == 2 * 12 * 4 * 32 * (100**2 + 28**2 + 128**2) / 2
    c, k, v = 64, 32, 16
    per_token = 3 * 2 * 4 * (3 * c * k + 2 * c * v + 3 * k * v + c * c / 3)
    assert flops["gdn"] == pytest.approx(2 * 3 * per_token * tokens)
    assert flops["total"] == pytest.approx(flops["dense"] + flops["attention"] + flops["gdn"])


def test_matmul_params_tied_and_untied(tp):
    from torch import nn

    class LM(nn.Module):
        def __init__(self, tie):
            super().__init__()
            self.emb, self.body, self.head = nn.Embedding(50, 8), nn.Linear(8, 8), nn.Linear(8, 50, bias=False)
            if tie:
                self.head.weight = self.emb.weight

        def get_input_embeddings(self):
            return self.emb

        def get_output_embeddings(self):
            return self.head

    assert tp.matmul_params(LM(tie=False)) == 8 * 8 + 8 + 50 * 8
    assert tp.matmul_params(LM(tie=True)) == 50 * 8 + 8 * 8 + 8


def test_dense_flops_match_torch_flop_counter(tp):
    """6 * P * tokens against torch's FLOP counter on the tiny recipe's model (tied head): the linears'
    aten.mm FLOPs of one forward+backward. P also holds norms and the depthwise conv (not mm): well under 1%."""
    from torch.utils.flop_counter import FlopCounterMode

    from hf_deltamatch.training.modeling import CausalLMWithLoss, build_model, causal_lm

    cfg = tp.recipe_config(TINY, "sdpa", "bf16", ["--batch_size", "2", "--seq_len", "128"])
    tokenizer = tp.random_token_tokenizer(cfg.vocab_size)
    model = build_model(cfg, tokenizer)
    batch, doc_lens = tp.random_batch(cfg, len(tokenizer), 1, 0, torch.device("cpu"))
    counter = FlopCounterMode(display=False)
    with counter:
        CausalLMWithLoss(model, 0)(**batch)[0].backward()
    mm = counter.get_flop_counts()["Global"][torch.ops.aten.mm]
    dense = tp.step_flops(causal_lm(model).config, tp.matmul_params(causal_lm(model)), doc_lens, 1)["dense"]
    assert abs(mm - dense) / dense < 0.01


def test_span_timer_forward_recompute_backward(tp):
    from torch.utils.checkpoint import checkpoint

    timer = tp.SpanTimer(torch.device("cpu"))

    def op(query, weight):
        return (query @ weight).tanh(), None

    timed = timer.wrap(op, query_index=0)
    timer.enabled = True
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)
    q = x * 2
    timed(q, w)[0].sum().backward()
    assert len(timer.spans) == 2 and all(b >= a for a, b in timer.spans)  # forward, backward
    assert timer.take_ms() > 0 and timer.spans == []

    def block(x):
        return timed(x * 2, w)[0].sin()

    checkpoint(block, x, use_reentrant=False).sum().backward()
    assert timer.calls == 3 and len(timer.spans) == 3  # forward, recomputation, backward
    timer.take_ms()
    with torch.no_grad():
        timed(q, w)
    assert len(timer.spans) == 1  # no backward span without autograd


def test_instrument_undo_restores_what_it_wrapped(tp):
    """instrument() wraps the model's attention function (transformers' interface) and its Gated DeltaNet functions;
    undo() puts every one back (the attention one was left wrapped when a later loop variable shadowed its name)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from hf_deltamatch.training.modeling import build_model, causal_lm

    cfg = tp.recipe_config(TINY, "deltamatch_fp8", "bf16", [])
    lm = causal_lm(build_model(cfg, tp.random_token_tokenizer(cfg.vocab_size)))
    name = lm.config._attn_implementation
    module = sys.modules[type(next(m for m in lm.modules() if type(m).__name__.endswith("GatedDeltaNet"))).__module__]
    before = (ALL_ATTENTION_FUNCTIONS[name], module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn)
    *_, undo = tp.instrument(lm, torch.device("cpu"))
    assert ALL_ATTENTION_FUNCTIONS[name] is not before[0] and module.causal_conv1d_fn is not before[2]
    undo()
    assert (ALL_ATTENTION_FUNCTIONS[name], module.torch_chunk_gated_delta_rule, module.causal_conv1d_fn) == before


def test_recipe_config_64k_settings(tp):
    cfg = tp.recipe_config("64k", "sdpa", "bf16", [])
    assert (cfg.seq_len, cfg.batch_size, cfg.gradient_checkpointing, cfg.loss_chunk) == (65536, 1, True, 8192)
    assert cfg.rope_theta == 1e6 and cfg.model is None and cfg.model_config["hidden_size"] == 2048
    cfg8 = tp.recipe_config("8k", "deltamatch_fp8", "fp8-compiled", ["--grad_accum", "1"])
    assert (cfg8.seq_len, cfg8.batch_size, cfg8.grad_accum) == (8192, 2, 1)
    assert cfg8.fp8_linear and cfg8.compile_fp8_linear and not cfg.fp8_linear


def test_norms_option_and_config(tp):
    """--norms: eager (transformers' RMSNorms) and fused (the recipe's --fused_norms), each a configuration."""
    assert tp.parse_args([]).norms == ["eager"]
    assert tp.parse_args(["--norms", "eager,fused"]).norms == ["eager", "fused"]
    with pytest.raises(SystemExit):
        tp.parse_args(["--norms", "compiled"])
    assert tp.recipe_config("64k", "sdpa", "bf16", [], "fused").fused_norms
    assert not tp.recipe_config("64k", "sdpa", "bf16", []).fused_norms
    assert tp._variant({"linears": "bf16", "norms": "fused"}) == "bf16 + fused norms"
    assert tp._variant({"linears": "fp8"}) == "fp8"


def test_linears_option(tp):
    assert tp.parse_args(["--linears", "bf16,fp8-compiled"]).linears == ["bf16", "fp8-compiled"]
    assert tp.parse_args(["--fp8-linear"]).linears == ["bf16", "fp8"]
    with pytest.raises(SystemExit):
        tp.parse_args(["--linears", "fp4"])


def test_cpu_run_two_steps(tp, tmp_path):
    from hf_deltamatch.training.modeling import gdn_backend

    if gdn_backend() == "fla":
        pytest.skip("flash-linear-attention is installed: the tiny hybrid's Gated DeltaNet would need CUDA")
    rc = tp.main(["--settings", TINY, "--device", "cpu", "--warmup", "1", "--steps", "2", "--profile",
                  "--attn", "deltamatch_fp8,flash_attention_2", "--norms", "eager,fused", "--out", str(tmp_path)])
    assert rc == 0
    (js,) = tmp_path.glob("train-throughput-*-cpu.json")
    runs = json.loads(js.read_text())["runs"]
    ok, fused, skipped, _ = runs
    assert ok["status"] == "ok" and skipped["status"] == "skipped" and "flash" in skipped["reason"]
    assert (ok["norms"], fused["norms"], fused["status"]) == ("eager", "fused", "ok")
    # the same random batch and init: the fused norms' losses are the eager ones' to float rounding
    assert torch.allclose(torch.tensor(fused["losses"]), torch.tensor(ok["losses"]), rtol=1e-3)
    assert ok["tokens_per_s"] > 0 and ok["steps"] == 2 and len(ok["step_ms_all"]) == 2
    assert ok["tokens_per_step"] == 8 * 256 and ok["gdn_backend"] == gdn_backend()
    assert ok["attention_calls"] == 2  # one attention layer, 2 timed steps, no checkpointing
    assert 0 < ok["attention_share"] < 1 and 0 < ok["gdn_share"] < 1
    assert 0 < ok["short_conv_share"] < 1 and 0 < ok["optimizer_share"] < 1
    assert ok["attention_share"] + ok["gdn_share"] + ok["short_conv_share"] + ok["optimizer_share"] < 1
    assert all(torch.isfinite(torch.tensor(ok["losses"])))
    assert ok["mfu"] is None and ok["achieved_tflops"] > 0  # no peak known for a CPU
    prof = ok["profile"]  # --profile: one more step, its ATen ops' self CPU time by category
    assert prof["categories"]["matmul"] > 0 and prof["wall_ms"] > 0 and len(prof["top"]) <= 15
    assert abs(sum(prof["categories"].values()) - prof["busy_ms"]) < 1e-6 * prof["busy_ms"] + 1e-9
    owners = {k["owner"] for k in prof["by_owner"]}  # the layer parts and backward nodes that ran the ops
    assert any(o.startswith("Qwen3_5") for o in owners) and any(o.startswith("backward: ") for o in owners)
    assert all(k["ms"] > 0 for k in prof["by_owner"]) and len(prof["by_owner"]) <= 20
    md = js.with_suffix(".md").read_text()
    assert "deltamatch_fp8" in md and "Where the step time goes" in md and "Top kernels" in md and "By owner" in md
    assert "| bf16 + fused norms |" in md


def test_profile_categories_of_gpu_kernel_names(tp):
    expect = {
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN": "matmul",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128": "matmul",
        "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": "gated deltanet",  # not attention's _delta
        "recompute_w_u_fwd_kernel": "gated deltanet",
        "_bwd_dkdv_hopper_kernel": "attention", "_fwd_kernel": "attention", "_quantize_kernel": "attention",
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>": "attention",
        "causal_conv1d_fwd_kernel": "short conv",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
        "triton_red_fused__log_softmax_0": "loss (softmax, cross-entropy)",
        "triton_poi_fused_mul_0": "torch.compile kernels",
        "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float>>": "elementwise",
        "Memcpy DtoD (Device -> Device)": "copies, casts, fills",
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel"
        "_cuda(at::TensorIteratorBase&)": "copies, casts, fills",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<"
        "float, float, float, at::native::binary_internal::MulFunctor<float>>>": "elementwise",
        "some_kernel_nobody_knows": "other",
    }
    assert {name: tp.categorize(name) for name in expect} == expect


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("setting", ["8k", "64k"])
def test_hybrid_1p7b_step_fits_and_runs(tp, tmp_path, setting):
    """hybrid-1p7b trains at 8K (batch 2) and 64K (batch 1, checkpointing, chunked loss) on one H200."""
    rc = tp.main(["--settings", setting, "--attn", "deltamatch_fp8", "--warmup", "1", "--steps", "2",
                  "--out", str(tmp_path), "--", "--grad_accum", "1"])
    (js,) = tmp_path.glob("train-throughput-*.json")
    (run,) = json.loads(js.read_text())["runs"]
    assert rc == 0 and run["status"] == "ok", run
    assert run["peak_memory_gib"] < 139 and run["tokens_per_s"] > 0 and run["mfu"] > 0
    assert 0 < run["attention_share"] < 1


# --- torch_varlen: the packed rows' baseline (benchmarks/varlen_attention.py) ---------------------------------

@pytest.fixture
def varlen(tp):
    import varlen_attention  # benchmarks/ is on sys.path once the tp fixture's script is imported
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    had = varlen_attention.NAME in AttentionInterface._global_mapping
    varlen_attention.register()
    yield varlen_attention
    if not had:
        AttentionInterface._global_mapping.pop(varlen_attention.NAME, None)
        AttentionMaskInterface._global_mapping.pop(varlen_attention.NAME, None)


def test_varlen_baseline_registers_and_refuses_what_it_cannot_run(tp, varlen):
    """Registered, the recipes' config accepts it (an unregistered name stays an error); it refuses a padding mask,
    dropout, sinks and a CPU device with a message saying what to do; on CPU train_throughput skips it."""
    from hf_deltamatch.training.config import ConfigError

    cfg = tp.recipe_config(TINY, varlen.NAME, "bf16", [])
    assert cfg.attn == varlen.NAME
    with pytest.raises(ConfigError, match="register your own"):
        tp.recipe_config(TINY, "no_such_attention", "bf16", [])
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 16, 32)
    kv = torch.randn(1, 2, 16, 32)
    with pytest.raises(ValueError, match="pack the batch"):
        varlen.varlen_attention_forward(module, q, kv, kv, torch.ones(1, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="sinks"):
        varlen.varlen_attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match="CUDA"):
        varlen.varlen_attention_forward(module, q, kv, kv, None)
    assert varlen._half_dtype(module, q.bfloat16()) == torch.bfloat16  # 16-bit inputs keep their dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 inputs (upcast rotary/norms): autocast's dtype
        assert varlen._half_dtype(module, q) == torch.bfloat16
    with pytest.raises(ValueError, match="autocast"):  # fp32, no autocast, no 16-bit weights: what to do
        varlen._half_dtype(module, q)
    module.proj = torch.nn.Linear(2, 2, dtype=torch.float16)
    assert varlen._half_dtype(module, q) == torch.float16
    module.training = True
    with pytest.raises(ValueError, match="dropout"):
        varlen.varlen_attention_forward(module, q, kv, kv, None, dropout=0.1)
    assert "CUDA" in tp.skip_reason(varlen.NAME, "bf16", torch.device("cpu"))


@pytest.mark.gpu
def test_varlen_baseline_equals_sdpa_per_document(varlen):
    """On a packed row of three documents (GQA 8/2, D=128, causal), from cu_seq_lens and from position_ids alike,
    bf16 inputs and fp32 ones under autocast: out and the q/k/v gradients equal SDPA run on each document alone, to
    bf16 rounding (both are FlashAttention-style bf16 kernels: 2e-2 relative)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [700, 129, 1219]
    S, Hq, Hkv, D = sum(lens), 8, 2, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, do = mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
    module = torch.nn.Module()
    module.is_causal = True

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(do.transpose(1, 2))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    def per_document(q_, k_, v_):
        outs = [torch.nn.functional.scaled_dot_product_attention(q_[:, :, a:b], k_[:, :, a:b], v_[:, :, a:b],
                                                                  is_causal=True, enable_gqa=True)
                for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(outs, 2).transpose(1, 2)

    ref = grads(per_document)
    for kw in (dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens)),
               dict(position_ids=pos)):
        got = grads(lambda q_, k_, v_: varlen.varlen_attention_forward(module, q_, k_, v_, None, **kw)[0])
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
            assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 2e-2, (name, kw.keys())
    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 inputs, as a model's upcast rotary gives them
        got = grads(lambda q_, k_, v_: varlen.varlen_attention_forward(module, q_.float(), k_.float(), v_.float(),
                                                                       None, position_ids=pos)[0])
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 2e-2, (name, "fp32 in autocast")


@pytest.mark.gpu
@pytest.mark.slow
def test_varlen_baseline_trains_the_tiny_recipe(tp, tmp_path):
    """train_throughput with --attn torch_varlen: the recipe's packed row through FlashAttention-2 varlen."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rc = tp.main(["--settings", TINY, "--attn", "torch_varlen", "--warmup", "1", "--steps", "2",
                  "--out", str(tmp_path)])
    (js,) = tmp_path.glob("train-throughput-*.json")
    (run,) = json.loads(js.read_text())["runs"]
    assert rc == 0 and run["status"] == "ok", run
    assert run["attention_calls"] > 0 and all(torch.isfinite(torch.tensor(run["losses"])))
