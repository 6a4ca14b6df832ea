"""Context extension 8K -> 64K from a pretrained checkpoint (stage defaults: recipes/configs/extend-64k.yaml).

    accelerate launch recipes/context_extension.py --model runs/hybrid-small/final --output_dir runs/ext-64k

RoPE base / scaling change in the loaded config (--rope_theta, --rope_scaling JSON), lower LR, long packed
sequences with document boundaries kept, activation checkpointing and a chunked cross-entropy (--loss_chunk).
Any pretrain.py flag works here too; --config adds a file on top of the stage defaults.
"""

import sys
from pathlib import Path

from hf_deltamatch.training import main
from hf_deltamatch.training.config import load_config_file

STAGE = Path(__file__).resolve().parent / "configs" / "extend-64k.yaml"

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], base=load_config_file(STAGE), description=__doc__))
