"""Shared test setup.

Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be set before any module
imports triton, which is why it is set here, at collection time. Tests marked `gpu` need CUDA.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Configuration from the environment would silently change what the tests check.
for _var in ("HF_DELTAMATCH_PRECISION", "HF_DELTAMATCH_DELTA", "HF_DELTAMATCH_BACKEND"):
    os.environ.pop(_var, None)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200; results are committed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_default_config():
    import hf_deltamatch

    saved = hf_deltamatch.get_default_config()
    yield
    hf_deltamatch.set_default_config(saved)
