"""Continued pretraining (--model PATH) or pretraining from scratch (--model_config YAML/JSON).

    accelerate launch recipes/pretrain.py                       # tiny-cpu recipe, offline, a few CPU minutes
    accelerate launch recipes/pretrain.py --config recipes/configs/hybrid-small.yaml --attn deltamatch_fp8 \
        --precision fp8 --delta matching --output_dir runs/small-fp8

Every setting: python recipes/pretrain.py --help. Settings come from the dataclass defaults (= tiny-cpu),
then --config, then flags.
"""

import sys

from hf_deltamatch.training import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], description=__doc__))
