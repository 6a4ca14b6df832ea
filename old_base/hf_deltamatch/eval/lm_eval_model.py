"""lm-eval model ``hf-deltamatch``: Hugging Face ``HFLM`` with deltamatch_fp8 attention.

The plain ``lm_eval`` CLI loads models with whatever attention transformers knows about;
``deltamatch_fp8`` only exists after ``hf_deltamatch.register()``. This subclass registers it
and makes it the default, so ``--model hf-deltamatch --model_args pretrained=DIR`` evaluates
the FP8 attention. ``attn_implementation=sdpa`` (or eager, ...) in ``--model_args`` overrides it,
e.g. for a bf16 baseline of the same checkpoint.
"""

from __future__ import annotations

import logging

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from . import DEFAULT_ATTN_IMPLEMENTATION

log = logging.getLogger(__name__)

MODEL_NAME = "hf-deltamatch"


def ensure_registered(attn_implementation: str) -> None:
    """Register deltamatch_fp8 with transformers (idempotent) and check it took."""
    import hf_deltamatch

    hf_deltamatch.register()
    if attn_implementation != DEFAULT_ATTN_IMPLEMENTATION:
        return
    from transformers import AttentionInterface

    if attn_implementation not in AttentionInterface._global_mapping:
        raise RuntimeError(
            f"hf_deltamatch.register() ran but transformers does not know attn_implementation="
            f"{attn_implementation!r}; check that this transformers version is supported "
            f"(pass attn_implementation=sdpa in --model_args to evaluate without FP8 attention).")


@register_model(MODEL_NAME)
class DeltaMatchLM(HFLM):
    """``HFLM`` that loads the model with ``attn_implementation="deltamatch_fp8"`` by default."""

    def __init__(self, pretrained, attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION, **kwargs):
        ensure_registered(attn_implementation)
        self.attn_implementation = attn_implementation
        # HFLM forwards unknown kwargs to from_pretrained, which is where the attention is chosen.
        super().__init__(pretrained=pretrained, attn_implementation=attn_implementation, **kwargs)
        if not isinstance(pretrained, str):
            # A model object was passed: it was built already, so set its attention here.
            set_impl = getattr(self.model, "set_attn_implementation", None)
            if set_impl is not None:
                set_impl(attn_implementation)
            else:
                self.model.config._attn_implementation = attn_implementation
        actual = getattr(self.model.config, "_attn_implementation", None)
        if actual != attn_implementation:
            raise RuntimeError(f"model loaded with attention {actual!r}, expected {attn_implementation!r}")
        log.info("hf-deltamatch: evaluating with attn_implementation=%s", actual)
