"""Load a script under benchmarks/ (not a package) as a module for its tests."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def script_module(path: Path, name: str):
    """The script at `path` imported as module `name`, registered in sys.modules while in use (dataclasses resolve
    string annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
