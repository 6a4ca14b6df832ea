#!/usr/bin/env bash
# One-time set-up on a CPU machine: a virtualenv in .venv with pinned CPU packages and this package, and accelerate's
# default config where there is none (scripts/accelerate_default_config.sh).
# (Plain `pip install torch` pulls a ~5 GB CUDA build; the CPU wheel torch==2.13.0 is pinned instead.)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -r .ci/requirements.txt
python -m pip install -q --no-deps -e .
bash scripts/accelerate_default_config.sh
