"""The lm-eval model `hf-deltamatch`: registered, deltamatch_fp8 by default, overridable."""

from __future__ import annotations

from _eval_fixtures import tiny_model_dir  # noqa: F401


def test_registered_under_its_name():
    from lm_eval.api.registry import get_model

    from hf_deltamatch.eval.lm_eval_model import DeltaMatchLM

    assert get_model("hf-deltamatch") is DeltaMatchLM


def test_default_is_deltamatch_fp8_and_overridable(tiny_model_dir):
    from hf_deltamatch.eval.lm_eval_model import DeltaMatchLM

    lm = DeltaMatchLM(pretrained=str(tiny_model_dir), device="cpu", dtype="float32")
    assert lm.model.config._attn_implementation == "deltamatch_fp8"
    lm2 = DeltaMatchLM.create_from_arg_string(f"pretrained={tiny_model_dir},attn_implementation=sdpa,dtype=float32",
                                              {"device": "cpu"})
    assert lm2.model.config._attn_implementation == "sdpa"
    # both score the same continuation; FP8 attention stays close to the bf16/fp32 reference on this tiny model
    req = [("The sky is", " blue")]

    class R:  # minimal lm-eval Instance stand-in
        def __init__(self, args):
            self.args = args

    (ll_fp8, _), = lm.loglikelihood([R(a) for a in req], disable_tqdm=True)
    (ll_ref, _), = lm2.loglikelihood([R(a) for a in req], disable_tqdm=True)
    assert abs(ll_fp8 - ll_ref) < 0.1 * abs(ll_ref) + 0.05
