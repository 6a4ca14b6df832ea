"""transformers' model machinery, imported without torchao's import-time messages when torchao is not in use.

`transformers.modeling_utils` imports transformers' quantizers, and its torchao quantizer imports torchao whenever
torchao is installed, so every model load imports torchao, FP8 linear layers or not. torchao's import logs each of
its CUDA extension libraries that it cannot load (all of them under a CPU torch) and registers enums as pytree
constants, which torch logs as deprecated. None of that concerns a run that does not use torchao: for that one
import, and only when torchao is not imported yet, those two loggers are raised to ERROR. A run that asks for FP8
linears imports torchao itself first (`import_torchao_float8`), and torchao's messages reach the user unchanged.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

# the loggers torchao's import writes to: torchao's own, and torch's pytree registry (torch._logging's handler)
_TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


def import_transformers_modeling() -> None:
    """Import `transformers.modeling_utils` (which also registers `deltamatch_fp8`, see `hf_deltamatch.__init__`)."""
    if "transformers.modeling_utils" in sys.modules:
        return
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        import transformers.modeling_utils  # noqa: F401

        return
    loggers = [logging.getLogger(name) for name in _TORCHAO_IMPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        import transformers.modeling_utils  # noqa: F401  (imports torchao through transformers.quantizers)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def import_torchao_float8():
    """torchao's float8 training API, imported as torchao imports (the user asked for it: its messages stay)."""
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    return convert_to_float8_training, Float8Linear
