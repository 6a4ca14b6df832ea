"""hf_deltamatch: FP8 attention that trains (Delta-Matching), for Hugging Face transformers.

    import hf_deltamatch  # registers attn_implementation="deltamatch_fp8" in transformers
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="deltamatch_fp8")
"""

from .attention import deltamatch_attention, get_default_config, set_default_config
from .config import DeltaMatchConfig

__version__ = "0.1.0"
ATTN_IMPLEMENTATION = "deltamatch_fp8"


def register() -> None:
    """Register `deltamatch_fp8` (attention and mask functions) in transformers. Idempotent."""
    from .integrations.transformers import register as _register

    _register()


try:  # registration is what users import us for; without transformers the op still works
    import transformers  # noqa: F401
except ImportError:  # pragma: no cover
    pass
else:
    register()

__all__ = ["ATTN_IMPLEMENTATION", "DeltaMatchConfig", "deltamatch_attention", "get_default_config", "register",
           "set_default_config"]
