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
_CONFIG_ENV = ("HF_DELTAMATCH_PRECISION", "HF_DELTAMATCH_DELTA", "HF_DELTAMATCH_BACKEND", "HF_DELTAMATCH_QK_ROTATION",
               "HF_DELTAMATCH_SMOOTH_K")
for _var in _CONFIG_ENV:
    os.environ.pop(_var, None)

# Property tests draw the same examples on every run and machine (no example database either): a fresh CI clone
# cannot fail on a draw nobody has seen. HYPOTHESIS_PROFILE=explore draws new examples, to look for failures.
try:
    from hypothesis import settings as _hyp_settings

    _hyp_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
    _hyp_settings.register_profile("explore", derandomize=False, database=None, print_blob=True)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is a dev dependency: only the property tests need it
    pass

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
    """The op's default config and its environment variables, as they were before each test: the training
    recipe sets HF_DELTAMATCH_PRECISION/_DELTA process-wide on purpose (its workers inherit them), and read by
    every later call they would switch another test's op to fp8 when the recipe test ran first in a worker."""
    import hf_deltamatch

    saved = hf_deltamatch.get_default_config()
    saved_env = {var: os.environ.get(var) for var in _CONFIG_ENV}
    yield
    hf_deltamatch.set_default_config(saved)
    for var, value in saved_env.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def _gpu_peak_memory(request):
    """With HF_DELTAMATCH_GPU_PEAK_LOG set, each GPU test appends its id and the peak GiB that PyTorch's allocator
    reserved to that file: benchmarks/triton_versions.sh sizes its parallel test processes by it."""
    path = os.environ.get("HF_DELTAMATCH_GPU_PEAK_LOG")
    if not path or "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    torch.cuda.reset_peak_memory_stats()
    yield
    with open(path, "a") as f:
        f.write(f"{request.node.nodeid} {torch.cuda.max_memory_reserved() / 2**30:.2f}\n")


@pytest.fixture(autouse=True)
def _fresh_kernel_plans():
    """Kernel plans are cached per input (kernels/plan.py); a test that changes a launch table changes what a plan
    would be: each test starts and ends with an empty cache."""
    try:
        from hf_deltamatch.kernels import plan
    except ImportError:  # no triton
        yield
        return
    plan.select.cache_clear()
    yield
    plan.select.cache_clear()
