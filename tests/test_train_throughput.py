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
    with pytest.raises(ValueError, match="soft-capping"):
        varlen.varlen_attention_forward(module, q, kv, kv, None, softcap=30.0)
    for sinks in (None, torch.zeros(4)):
        with pytest.raises(ValueError, match="CUDA"):
            varlen.varlen_attention_forward(module, q, kv, kv, None, s_aux=sinks)
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


_PACKED_LENS = [700, 129, 1219]  # three documents, one of a length no tile size divides


def _packed_row(Hq, Hkv, D):
    """(q, k, v, do, position_ids, the generator) of one packed bf16 row of _PACKED_LENS documents on the GPU (skips
    without CUDA); q and do (1, Hq, S, D), k and v (1, Hkv, S, D)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    S = sum(_PACKED_LENS)
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(1, h, S, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    pos = torch.cat([torch.arange(n, device="cuda") for n in _PACKED_LENS])[None]
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq), pos, g


@pytest.mark.gpu
def test_varlen_baseline_equals_sdpa_per_document(varlen):
    """On a packed row of three documents (GQA 8/2, D=128, causal), from cu_seq_lens and from position_ids alike,
    bf16 inputs and fp32 ones under autocast: out and the q/k/v gradients equal SDPA run on each document alone, to
    bf16 rounding (both are FlashAttention-style bf16 kernels: 2e-2 relative)."""
    lens, Hq, Hkv, D = _PACKED_LENS, 8, 2, 128
    q, k, v, do, pos, _ = _packed_row(Hq, Hkv, D)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
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


class _MathKernels:
    """FlashKernels' contract on a CPU, in float64: forward -> (out, lse (Hq, T), state), and FlashAttention's backward
    (dS = P * (dO V^T - rowsum(dO * O)) with the O it is given), over packed documents, causal, a left window, GQA."""

    def __init__(self, cu, longest, causal, scale, window):
        lens = cu[1:] - cu[:-1]
        doc = torch.repeat_interleave(torch.arange(len(lens)), lens)
        i, j = torch.arange(len(doc))[:, None], torch.arange(len(doc))[None, :]
        assert causal and window[1] == 0 and int(lens.max()) == longest
        self.allowed = (doc[:, None] == doc[None, :]) & (j <= i) & ((i - j <= window[0]) if window[0] >= 0 else True)
        self.scale = scale

    def _expand(self, k, hq):
        return k.repeat_interleave(hq // k.shape[1], 1)

    def _probs(self, q, k, lse=None):
        s = torch.einsum("ihd,jhd->hij", q, self._expand(k, q.shape[1])) * self.scale
        s = s.masked_fill(~self.allowed, float("-inf"))
        lse = torch.logsumexp(s, -1) if lse is None else lse
        return (s - lse[..., None]).exp(), lse

    def forward(self, q, k, v):
        p, lse = self._probs(q, k)
        return torch.einsum("hij,jhd->ihd", p, self._expand(v, q.shape[1])), lse, ()

    def backward(self, grad, q, k, v, out, lse, state):
        hq, hkv = q.shape[1], k.shape[1]
        p, _ = self._probs(q, k, lse)
        dp = torch.einsum("ihd,jhd->hij", grad, self._expand(v, hq))
        ds = p * (dp - (grad * out).sum(-1).transpose(0, 1)[..., None])
        dq = torch.einsum("hij,jhd->ihd", ds, self._expand(k, hq)) * self.scale
        dk = torch.einsum("hij,ihd->jhd", ds, q) * self.scale
        dv = torch.einsum("hij,ihd->jhd", p, grad)
        group = lambda x: x.reshape(x.shape[0], hkv, hq // hkv, x.shape[-1]).sum(2)  # noqa: E731
        return dq, group(dk), group(dv)


@pytest.mark.parametrize("window", [-1, 3])
def test_varlen_sinks_equal_eager_sinks(tp, window):
    """torch_varlen's sinks (SinkAttention: out * sigmoid(lse - s), the kernel's backward given w * dY and Y) against
    gpt-oss's eager attention (a sink column in the softmax, autograd through it): out and the gradients of q, k, v
    and the sinks, float64, packed documents, GQA 4/2, full and windowed."""
    import varlen_attention

    g = torch.Generator().manual_seed(0)
    lens, hq, hkv, d = [5, 1, 7], 4, 2, 8
    T, scale = sum(lens), d ** -0.5
    leaves = [torch.randn(T, h, d, generator=g, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv)]
    sinks = torch.randn(hq, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(T, hq, d, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kernels = _MathKernels(cu, max(lens), True, scale, (window, 0))

    y = varlen_attention.SinkAttention.apply(*leaves, sinks, cu, max(lens), True, scale, (window, 0), _MathKernels)
    got = [y.detach()] + list(torch.autograd.grad(y, leaves + [sinks], dy))

    q, k, v = leaves
    s = torch.einsum("ihd,jhd->hij", q, kernels._expand(k, hq)) * scale
    s = s.masked_fill(~kernels.allowed, float("-inf"))
    p = torch.cat([s, sinks[:, None, None].expand(hq, T, 1)], -1).softmax(-1)[..., :T]
    ref_y = torch.einsum("hij,jhd->ihd", p, kernels._expand(v, hq))
    ref = [ref_y.detach()] + list(torch.autograd.grad(ref_y, leaves + [sinks], dy))
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


# --- the training-step suite (issue #45) and train_step.json ------------------------------------------------------

TINY_QWEN3 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256}
STEP_ROW_KEYS = {"model", "seq_len", "batch", "packed", "attn", "linears", "compiled", "tokens_per_s", "peak_gib",
                 "ratio_to_sdpa"}


def test_issue45_suite_holds_every_row_the_issue_lists(tp, capsys):
    rows = tp.plan_rows(tp.parse_args(["--suite", "issue45"]))
    have = {(r["model"], r["seq_len"], r["batch"], r["packed"], r["attn"], r["linears"], r["compiled"]) for r in rows}
    assert len(have) == len(rows)  # no configuration twice without --baseline-runs
    want = set()
    for compiled in (False, True):
        for model in ("qwen3-0.6b", "qwen3-1.7b"):
            for n, b in ((2048, 8), (4096, 4), (8192, 1), (16384, 1), (32768, 1)):
                want |= {(model, n, b, False, a, "bf16", compiled) for a in ("sdpa", "deltamatch_fp8")}
        want |= {("qwen3-0.6b", 8192, 1, True, a, "bf16", compiled) for a in ("sdpa", "deltamatch_fp8", "torch_varlen")}
        want |= {("gptoss-attn", 8192, 1, False, a, "bf16", compiled) for a in ("torch_varlen", "deltamatch_fp8")}
        want |= {("hybrid-1p7b", 8192, 2, True, a, "bf16", compiled)
                 for a in ("sdpa", "deltamatch_fp8", "torch_varlen")}
        want |= {("hybrid-1p7b", 65536, 1, True, a, "bf16", compiled) for a in ("sdpa", "deltamatch_fp8")}
    assert want <= have
    assert {r["ratio_base"] for r in rows if r["model"] == "gptoss-attn"} == {"torch_varlen"}
    assert {r["ratio_base"] for r in rows if r["model"] != "gptoss-attn"} == {"sdpa"}
    assert all(r["docs_per_row"] > 1 for r in rows if r["model"] == "qwen3-0.6b" and r["packed"])
    assert all(r["model"].startswith("qwen3") and not r["packed"] and not r["compiled"] for r in rows[:20])
    first_compiled = next(i for i, r in enumerate(rows) if r["compiled"])
    extras = [i for i, r in enumerate(rows) if r["attn"] == "flex_attention" or r["model"] == "hybrid-1p7b"
              and r["attn"] == "torch_varlen"]
    assert first_compiled == 30 and min(extras) == 60 and len(extras) == 4  # eager, compiled, extras
    again = tp.plan_rows(tp.parse_args(["--suite", "issue45", "--baseline-runs", "2", "--match", "qwen3-1.7b 8192x1"]))
    assert [(r["attn"], r["run"]) for r in again if not r["compiled"]] == [("sdpa", 1), ("deltamatch_fp8", 1),
                                                                          ("sdpa", 2)]
    assert tp.main(["--suite", "issue45", "--list"]) == 0
    assert "gptoss-attn 8192x1 torch_varlen" in capsys.readouterr().out


def test_presets_are_the_issues_shapes(tp):
    """Parameter counts of the real Qwen3-0.6B / 1.7B (0.44 / 1.41 B without the tied embedding), gpt-oss-20b's
    attention (64/8 heads of 64, sinks, 128-token windows on every other layer) with one 4x-wide expert."""
    from transformers import AutoModelForCausalLM

    counts = {}
    for name in ("qwen3-0.6b", "qwen3-1.7b", "gptoss-attn"):
        config = tp.preset_config(name)
        assert config.use_cache is False
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        counts[name] = (sum(p.numel() for p in model.parameters()), tp.matmul_params(model))
    assert counts["qwen3-0.6b"] == (pytest.approx(0.596e9, rel=0.01), pytest.approx(0.596e9, rel=0.01))  # tied head
    assert counts["qwen3-1.7b"][0] - 151936 * 2048 == pytest.approx(1.41e9, rel=0.01)
    oss = tp.preset_config("gptoss-attn")
    assert (oss.head_dim, oss.num_attention_heads, oss.num_key_value_heads, oss.sliding_window) == (64, 64, 8, 128)
    assert oss.layer_types == ["sliding_attention", "full_attention"] * 12
    assert oss.num_local_experts == oss.num_experts_per_tok == 1 and oss.intermediate_size == 4 * 2880
    assert counts["gptoss-attn"][0] == pytest.approx(4.2e9, rel=0.03)
    assert tp.attention_windows(oss) == [128, None] * 12
    flops = tp.step_flops(oss, 1, [[8192]], 1)["attention"]
    assert flops == pytest.approx(12 * 64 * 64 * 12 * (8192 ** 2 / 2 + 8192 * 128 - 128 ** 2 / 2))


def test_step_json_of_a_tiny_cpu_run(tp, tmp_path):
    """A tiny Qwen3 (2 layers, hidden 64) through the reference path, sdpa and deltamatch_fp8, eager and compiled
    (aot_eager: dynamo and autograd's graphs without inductor's C++ builds): train_step.json's schema, the ratios,
    the markdown, and the same losses eager and compiled."""
    step_json = tmp_path / "train_step.json"
    rc = tp.main(["--settings", "qwen3-0.6b", "--shapes", "64x2", "--attn", "sdpa,deltamatch_fp8",
                  "--compile", "eager,compiled", "--compile-backend", "aot_eager", "--override", json.dumps(TINY_QWEN3),
                  "--device", "cpu", "--warmup", "1", "--steps", "1", "--repeats", "2", "--step-json", str(step_json)])
    assert rc == 0
    step = json.loads(step_json.read_text())
    assert {"date", "gpu", "torch", "triton", "commit"} <= set(step["meta"]) and step["meta"]["gpu"] == "cpu"
    rows = step["rows"]
    assert len(rows) == 4 and all(STEP_ROW_KEYS <= set(r) and r["status"] == "ok" for r in rows)
    by = {(r["attn"], r["compiled"]): r for r in rows}
    for compiled in (False, True):
        base, ours = by["sdpa", compiled], by["deltamatch_fp8", compiled]
        assert base["ratio_to_sdpa"] == 1.0
        assert ours["ratio_to_sdpa"] == pytest.approx(ours["tokens_per_s"] / base["tokens_per_s"])
        for r in (base, ours):
            assert (r["model"], r["seq_len"], r["batch"], r["packed"], r["linears"]) == ("qwen3-0.6b", 64, 2, False,
                                                                                       "bf16")
            assert len(r["windows"]) == 2 and r["tokens_per_s"] == pytest.approx(sum(r["windows"]) / 2)
            assert r["tokens_per_s_spread"] == pytest.approx((max(r["windows"]) - min(r["windows"])) / 2)
            assert r["peak_gib"] > 0 and r["runs"] == 1
    runs = json.loads((tmp_path / "train_step-detail.json").read_text())["runs"]
    losses = {(r["attn"], r["compiled"]): r["losses"] for r in runs}
    for attn in ("sdpa", "deltamatch_fp8"):  # one init, one batch: compiling changes no loss beyond rounding
        assert torch.allclose(torch.tensor(losses[attn, True]), torch.tensor(losses[attn, False]), rtol=1e-3)
    md = (tmp_path / "train_step.md").read_text()
    assert "| qwen3-0.6b | 64 × 2 | no | bf16 | yes | sdpa |" in md and "## Every row" in md


class _FakeChild:
    """Stands in for train_throughput's subprocess: writes a result from the spec at once. `outcome(spec)` says what
    the run does: "ok", "oom" (the child reports it), "oom-crash" (it dies with torch's OOM message) or "fail"."""

    TimeoutExpired = __import__("subprocess").TimeoutExpired

    def __init__(self, outcome=lambda spec: "ok"):
        self.outcome, self.specs = outcome, []

    def run(self, cmd, **kwargs):
        import subprocess

        spec = json.loads(Path(cmd[-1]).read_text())
        self.specs.append(spec)
        outcome = self.outcome(spec)
        if outcome in ("oom-crash", "fail"):
            err = "torch.OutOfMemoryError: CUDA out of memory." if outcome == "oom-crash" else "RuntimeError: broken"
            return subprocess.CompletedProcess(cmd, 1, "", f"Traceback (most recent call last):\n{err}")
        speed = {"sdpa": 1000.0, "deltamatch_fp8": 1100.0}.get(spec["attn"], 1050.0) * (1 + len(self.specs) / 1e3)
        windows = [speed * f for f in (0.99, 1.0, 1.01)[:spec["repeats"]]]
        result = {"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory"} if outcome == "oom" else {
            "window_tokens_per_s": windows, "tokens_per_s": sum(windows) / len(windows),
            "tokens_per_s_spread": (max(windows) - min(windows)) / 2, "peak_memory_gib": 10.0}
        Path(spec["result"]).write_text(json.dumps(result))
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _suite_rows(path):
    return {(r["model"], r["seq_len"], r["batch"], r["packed"], r["attn"], r["compiled"]): r
            for r in json.loads(path.read_text())["rows"]}


def test_append_resumes_and_pools_baseline_runs(tp, tmp_path, monkeypatch):
    """A call with --time-budget stops before a row it may not finish (the first compiled one: FIRST_ROW_S); the next
    call with --append runs only the rest; the base's second run pools its windows into its row; a file of another
    commit is refused."""
    child = _FakeChild()
    monkeypatch.setattr(tp, "subprocess", child)
    step_json = tmp_path / "train_step.json"
    args = ["--suite", "issue45", "--match", "qwen3-0.6b 8192x1", "--device", "cpu", "--step-json", str(step_json),
            "--baseline-runs", "2"]
    assert tp.main(args + ["--time-budget", "100"]) == 0
    first = _suite_rows(step_json)
    assert len(first) == 5 and len(child.specs) == 6  # the eager rows: sdpa, ours, sdpa again (varlen: a skip)
    assert not any(r["compiled"] for r in first.values())
    base = first["qwen3-0.6b", 8192, 1, False, "sdpa", False]
    assert base["runs"] == 2 and len(base["windows"]) == 6
    assert base["tokens_per_s"] == pytest.approx(sum(base["windows"]) / 6)
    assert tp.main(args + ["--append"]) == 0
    rows = _suite_rows(step_json)
    assert len(rows) == 10 and len(child.specs) == 12 and {r["compiled"] for r in rows.values()} == {False, True}
    assert all(r["runs"] == 2 for k, r in rows.items() if k[4] == "sdpa")
    assert rows["qwen3-0.6b", 8192, 1, True, "torch_varlen", True]["status"] == "skipped"  # CUDA only
    ours = rows["qwen3-0.6b", 8192, 1, False, "deltamatch_fp8", True]
    assert ours["ratio_to_sdpa"] == pytest.approx(ours["tokens_per_s"] / rows[ours["model"], 8192, 1, False, "sdpa",
                                                                            True]["tokens_per_s"])
    meta = json.loads(step_json.read_text())["meta"]
    assert [c["rows"] for c in meta["calls"]] == [7, 7]
    assert tp.main(args + ["--append"]) == 0 and len(child.specs) == 12  # nothing left
    step = json.loads(step_json.read_text())
    step["meta"]["commit"] = "0000000"
    step_json.write_text(json.dumps(step))
    assert tp.main(args + ["--append"]) == 2


def test_ratios_by_group_and_base(tp):
    def row(model, attn, tps, compiled=False, linears="bf16", base="sdpa", status="ok"):
        return {"model": model, "seq_len": 8192, "batch": 1, "packed": False, "attn": attn, "linears": linears,
                "compiled": compiled, "tokens_per_s": tps if status == "ok" else None, "ratio_base": base,
                "status": status}

    rows = [row("m", "sdpa", 100.0), row("m", "deltamatch_fp8", 120.0), row("m", "deltamatch_fp8", 90.0, True),
            row("m", "sdpa", 80.0, True), row("m", "deltamatch_fp8", 50.0, linears="fp8"),
            row("g", "torch_varlen", 200.0, base="torch_varlen"),
            row("g", "deltamatch_fp8", 210.0, base="torch_varlen"),
            row("g", "sdpa", None, base="torch_varlen", status="skipped")]
    tp.add_ratios(rows)
    assert [r["ratio_to_sdpa"] for r in rows] == [1.0, pytest.approx(1.2), pytest.approx(1.125), 1.0, None, 1.0,
                                                  pytest.approx(1.05), None]


def test_oom_skip_and_failure_rows(tp, tmp_path, monkeypatch):
    """An OOM the child reports or dies of becomes an "oom" row; the same configuration at a larger shape is then a
    skip that says so; a crash is a "failed" row with its message; the suite goes on either way."""
    def outcome(spec):
        if spec["attn"] == "sdpa" and spec["seq_len"] == 16384:
            return "oom" if spec["compiled"] else "oom-crash"
        return "fail" if spec["attn"] == "deltamatch_fp8" and spec["seq_len"] == 2048 else "ok"

    child = _FakeChild(outcome)
    monkeypatch.setattr(tp, "subprocess", child)
    step_json = tmp_path / "train_step.json"
    rc = tp.main(["--suite", "issue45", "--match", "qwen3-1.7b", "--device", "cpu", "--step-json", str(step_json)])
    assert rc == 1  # a failed row
    rows = _suite_rows(step_json)
    assert len(rows) == 20
    for compiled in (False, True):
        oom = rows["qwen3-1.7b", 16384, 1, False, "sdpa", compiled]
        assert oom["status"] == "oom" and "out of memory" in oom["reason"] and oom["tokens_per_s"] is None
        skipped = rows["qwen3-1.7b", 32768, 1, False, "sdpa", compiled]
        assert skipped["status"] == "skipped" and "16384 x 1" in skipped["reason"]
        assert rows["qwen3-1.7b", 32768, 1, False, "deltamatch_fp8", compiled]["status"] == "ok"
        assert rows["qwen3-1.7b", 32768, 1, False, "deltamatch_fp8", compiled]["ratio_to_sdpa"] is None
        failed = rows["qwen3-1.7b", 2048, 8, False, "deltamatch_fp8", compiled]
        assert failed["status"] == "failed" and "broken" in failed["reason"]
    assert len(child.specs) == 18  # the two 32K sdpa rows never started
    md = (tmp_path / "train_step.md").read_text()
    assert "| qwen3-1.7b | 16384 × 1 | no | sdpa | bf16 | no | oom |" in md
    n = len(child.specs)
    assert tp.main(["--suite", "issue45", "--match", "qwen3-1.7b", "--device", "cpu", "--step-json", str(step_json),
                    "--append", "--retry-failed"]) == 1 and len(child.specs) == n + 2  # only the failed rows again


def test_run_one_reports_an_oom(tp, monkeypatch):
    def boom(spec, device):
        raise RuntimeError("inductor failed") from torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    monkeypatch.setattr(tp, "_run_one", boom)
    result = tp.run_one({"device": "cpu"})
    assert result["status"] == "oom" and "inductor failed" in result["reason"] and result["peak_memory_gib"] > 0
    monkeypatch.setattr(tp, "_run_one", lambda spec, device: 1 / 0)
    result = tp.run_one({"device": "cpu"})
    assert result["status"] == "failed" and result["reason"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in result["traceback"]


def test_doc_lengths_and_packed_preset_batch(tp):
    lens = tp.doc_lengths(8192, 8, 0)
    assert len(lens) == 8 and sum(lens) == 8192 and min(lens) >= 1 and len(set(lens)) > 1
    assert tp.doc_lengths(8192, 8, 0) == lens and tp.doc_lengths(100, 1, 0) == [100]
    batch, doc_lens = tp.preset_batch(64, 2, 3, 256, 0, torch.device("cpu"))
    assert batch["input_ids"].shape == (1, 128) and doc_lens == [tp.doc_lengths(64, 3, 0)] * 2
    assert batch["cu_seq_lens_q"].tolist() == [0, *torch.tensor(doc_lens[0] * 2).cumsum(0).tolist()]
    batch, _ = tp.preset_batch(64, 2, 1, 256, 0, torch.device("cpu"))
    assert batch["input_ids"].shape == (2, 64) and set(batch) == {"input_ids", "labels"}


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_varlen_sinks_equal_eager_sinks_on_the_gpu(varlen, window):
    """gpt-oss's attention shape (D=64, GQA 8:1, sinks; full and a 128-token window) through torch_varlen's
    FlashAttention-2 + exact sinks, a packed row of three documents: out and the q, k, v, sink gradients against
    float32 eager attention with a sink column (bf16 kernels: 2e-2 relative)."""
    lens, Hq, Hkv, D = _PACKED_LENS, 16, 2, 64
    S = sum(lens)
    q, k, v, do, pos, g = _packed_row(Hq, Hkv, D)
    sinks = torch.randn(Hq, device="cuda", generator=g) + 2.0
    module = torch.nn.Module()
    module.is_causal = True

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        out = fn(*leaves)
        out.backward(do.transpose(1, 2).to(out.dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    def eager(q_, k_, v_, s_):
        doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
        i, j = torch.arange(S, device="cuda")[:, None], torch.arange(S, device="cuda")[None, :]
        allowed = (doc[:, None] == doc[None, :]) & (j <= i) & ((i - j < window) if window else True)
        kk, vv = (t.float().repeat_interleave(Hq // Hkv, 1) for t in (k_, v_))
        scores = (q_.float() @ kk.transpose(-1, -2) * D ** -0.5).masked_fill(~allowed, float("-inf"))
        p = torch.cat([scores, s_[None, :, None, None].expand(1, Hq, S, 1)], -1).softmax(-1)[..., :S]
        return (p @ vv).transpose(1, 2)

    ref = grads(eager)
    got = grads(lambda q_, k_, v_, s_: varlen.varlen_attention_forward(
        module, q_, k_, v_, None, scaling=D ** -0.5, sliding_window=window, s_aux=s_, position_ids=pos)[0])
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), got, ref):
        assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 2e-2, (name, window)
