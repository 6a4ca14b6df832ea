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


class _RegisterOnImport:
    """Registers `deltamatch_fp8` as transformers' attention and mask modules finish importing, so that
    `import hf_deltamatch` does not import transformers (seconds, and through its quantizers optional libraries
    such as torchao) for commands that never load a model, yet every model sees the registration: both
    `AttentionInterface` (modeling_utils) and `AttentionMaskInterface` (masking_utils) are looked up only after
    one of these two modules has been imported."""

    MODULES = ("transformers.modeling_utils", "transformers.masking_utils")

    def find_spec(self, name, path=None, target=None):
        if name not in self.MODULES:
            return None
        import importlib.util
        import sys

        sys.meta_path.remove(self)  # once: register() imports the other module itself
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:  # let the import fail as it would without us
            return None
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            register()

        spec.loader.exec_module = exec_and_register
        return spec


def _register_with_transformers() -> None:
    import importlib.util
    import sys

    if any(m in sys.modules for m in _RegisterOnImport.MODULES):
        register()
    elif importlib.util.find_spec("transformers") is not None:  # without transformers the op still works
        sys.meta_path.insert(0, _RegisterOnImport())


_register_with_transformers()  # registration is what users import us for

__all__ = ["ATTN_IMPLEMENTATION", "DeltaMatchConfig", "deltamatch_attention", "get_default_config", "register",
           "set_default_config"]
