"""Training recipes' reusable parts: config, data (offline corpus, tokenizer, packing collator), model setup,
optimizers, the accelerate training loop, the attention monitor, seed sweeps, and loss-curve plotting. Entry
points live in recipes/."""

from .config import ConfigError, TrainConfig, parse_config, validate
from .data import PackedCollator, pack_token_lists

__all__ = ["ConfigError", "TrainConfig", "parse_config", "validate", "PackedCollator", "pack_token_lists", "main"]


def main(argv=None, base=None, description=None) -> int:
    from .loop import main as _main

    return _main(argv, base=base, description=description)
