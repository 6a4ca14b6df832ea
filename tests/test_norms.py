"""training/norms.py (`--fused_norms`): the model's RMSNorms through F.rms_norm, chosen by agreement with each class's
own forward; a norm whose arithmetic no candidate reproduces stays eager and is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from _recipe_helpers import TINY_MODEL
from _tiny_models import build
from hf_deltamatch.training import norms


def _hybrid(dtype=torch.float32, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_MODEL)
    mt = spec.pop("model_type")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mt, vocab_size=256, **spec),
                                             attn_implementation="sdpa", dtype=torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # zero-initialized (zero-centred) norm weights would hide a wrong (1 + w)
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.to(dtype)


def _loss_and_grads(model, ids, autocast):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=ids).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _norm_classes(model):
    return {type(m).__name__ for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_hybrid_norms_fused_and_training_unchanged(autocast):
    """The Qwen3.5 hybrid's three norm kinds (zero-centred layer and q/k norms, the Gated DeltaNet's gated output
    norm) all take a fused form; the loss and every gradient match the eager model's, fp32 to 1e-5 and under bf16
    autocast (the recipes' setting) to bf16 rounding."""
    eager, fused = _hybrid(), _hybrid()
    assert {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"} <= _norm_classes(fused)
    n, left = norms.fuse_rms_norms(fused)
    assert left == [] and n == sum(1 for m in fused.modules()
                                   if type(m).__name__ in ("Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"))
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    l0, g0 = _loss_and_grads(eager, ids, autocast)
    l1, g1 = _loss_and_grads(fused, ids, autocast)
    tol = 2e-2 if autocast else 1e-5
    assert torch.allclose(l0, l1, rtol=tol)
    assert g0.keys() == g1.keys()
    for k in g0:
        err = (g0[k] - g1[k]).norm() / g0[k].norm().clamp_min(1e-30)
        assert err < tol, (k, err.item())


def test_each_class_gets_its_own_form():
    """Qwen3's (Llama-style: w * x_normed.to(dtype)) and Qwen3.5's zero-centred norm take different candidates; each
    wrong one is rejected by the probe."""
    model = build("qwen3", "sdpa", dtype=torch.float32)
    norm = next(m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm")
    assert not norms._agrees(norm, norms._zero_centered, 1) and norms._agrees(norm, norms._weight_after_cast, 1)
    hybrid_norm = next(m for m in _hybrid().modules() if type(m).__name__ == "Qwen3_5RMSNorm")
    assert norms._agrees(hybrid_norm, norms._zero_centered, 1)
    assert not norms._agrees(hybrid_norm, norms._weight_after_cast, 1)
    n, left = norms.fuse_rms_norms(model)
    assert n > 0 and left == []
    assert all(m.forward.__func__ is norms._weight_after_cast for m in model.modules()
               if type(m).__name__ == "Qwen3RMSNorm")


class OddRMSNorm(nn.Module):
    """An RMSNorm with arithmetic no candidate has (eps outside the root)."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-2

    def forward(self, x):
        return self.weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + self.eps)


class FusedRMSNormGated(nn.Module):
    """Another library's norm (flash-linear-attention's fused gated norm has this name): not transformers', so left
    alone, its optional arguments notwithstanding."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x, g, residual=None, prenorm=False):
        raise AssertionError("never probed")


def test_a_norm_no_candidate_reproduces_stays_eager_and_is_named(caplog, monkeypatch):
    """A transformers norm (OddRMSNorm, placed in a transformers module) with arithmetic no candidate has stays
    eager and is named; another library's norm is neither probed nor named."""
    monkeypatch.setattr(OddRMSNorm, "__module__", "transformers.models.odd.modeling_odd")
    model = nn.Sequential(OddRMSNorm(32), nn.Linear(32, 32), FusedRMSNormGated(32))
    before = model[0].forward
    with caplog.at_level("WARNING"):
        n, left = norms.fuse_rms_norms(model)
    assert (n, left) == (0, ["OddRMSNorm"]) and model[0].forward == before
    assert "forward" not in vars(model[2])
    assert "OddRMSNorm" in caplog.text and "stays eager" in caplog.text


def test_qwen3_next_norms_fused_and_unchanged():
    """Qwen3-Next (zero-centred norms and, without flash-linear-attention, transformers' gated norm): every norm
    fused, forward and gradients as the eager model's in fp32."""
    eager, fused = build("qwen3_next", "sdpa", dtype=torch.float32), build("qwen3_next", "sdpa", dtype=torch.float32)
    n, left = norms.fuse_rms_norms(fused)
    assert n > 0 and left == []
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    (l0, g0), (l1, g1) = _loss_and_grads(eager.train(), ids, False), _loss_and_grads(fused.train(), ids, False)
    assert torch.allclose(l0, l1, rtol=1e-5)
    for k in g0:
        assert ((g0[k] - g1[k]).norm() / g0[k].norm().clamp_min(1e-30)) < 1e-5, k


def test_build_model_applies_fused_norms(tmp_path):
    """--fused_norms reaches build_model: every norm of the recipe's model runs the fused form."""
    from hf_deltamatch.training.config import TrainConfig
    from hf_deltamatch.training.data import train_tokenizer
    from hf_deltamatch.training.modeling import build_model

    tok = train_tokenizer(["the cat sat on the mat"] * 50, 300, tmp_path / "tok")
    cfg = TrainConfig(model_config=dict(TINY_MODEL), attn="sdpa", fused_norms=True, vocab_size=300)
    model = build_model(cfg, tok)
    forms = {m.forward.__func__ for m in model.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))}
    assert forms == {norms._zero_centered, norms._gated_silu}
    plain = build_model(TrainConfig(model_config=dict(TINY_MODEL), attn="sdpa", vocab_size=300), tok)
    plain_norms = [m for m in plain.modules() if type(m).__name__.endswith(("RMSNorm", "RMSNormGated"))]
    assert not any("forward" in vars(m) for m in plain_norms)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_takes_the_fused_kernel_and_matches_eager():
    """On CUDA the fused forms reach ATen's _fused_rms_norm (forward and backward), and the hybrid's loss and
    gradients under bf16 autocast match the eager model's to bf16 rounding."""
    eager, fused = _hybrid().cuda(), _hybrid().cuda()
    norms.fuse_rms_norms(fused)
    ids = torch.randint(0, 256, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(3))

    def run(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    with _Ops() as ops:
        l1, g1 = run(fused)
    assert any("_fused_rms_norm.default" in n for n in ops.names), sorted(set(ops.names))[:40]
    assert any("_fused_rms_norm_backward" in n for n in ops.names)
    l0, g0 = run(eager)
    assert torch.allclose(l0, l1, rtol=2e-2)
    for k in g0:
        assert ((g0[k] - g1[k]).norm() / g0[k].norm().clamp_min(1e-30)) < 2e-2, k
