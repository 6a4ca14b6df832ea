#!/usr/bin/env bash
# Installs recipes/configs/accelerate/default.yaml as accelerate's default config when there is none (without one,
# `accelerate launch` lists every launch setting it had to default). An existing default config is left alone:
# `accelerate config` edits it, and `accelerate launch --config_file FILE` picks another.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
target=$("$PY" -c "from accelerate.commands.config.config_args import default_config_file; print(default_config_file)")
if [ -e "$target" ]; then
  echo "accelerate: keeping the default config $target"
  exit 0
fi
mkdir -p "$(dirname "$target")"
cp recipes/configs/accelerate/default.yaml "$target"
echo "accelerate: installed recipes/configs/accelerate/default.yaml as the default config ($target)"
