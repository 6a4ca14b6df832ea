# Shared by recipes/gpu_runs.sh and recipes/multi_gpu_runs.sh (sourced; expects PY, REPO and stamp()).

# `datasets` is not on every GPU image: install it offline from wheels ($WHEELS, default $REPO/.whl) if missing.
ensure_datasets() {
  if ! "$PY" -c "import datasets" 2>/dev/null; then
    WHEELS=${WHEELS:-$REPO/.whl}
    if [ -d "$WHEELS" ]; then
      stamp "installing datasets from $WHEELS (offline)"
      "$PY" -m pip install --no-index --find-links "$WHEELS" datasets
    else
      echo "error: the 'datasets' package is missing; pip install it, put it on PYTHONPATH, or its wheels in $WHEELS" >&2
      exit 2
    fi
  fi
}
