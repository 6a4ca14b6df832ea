"""The skip the Gluon (sm_90) kernels' GPU tests share."""

import pytest


def skip_unless_gluon_triton():
    """The Gluon kernels' tests run with a Triton of launch.GLUON_TRITON_VERSIONS, or any with HF_DELTAMATCH_GLUON=1
    (benchmarks/triton_versions.sh)."""
    from hf_deltamatch.kernels import launch

    if not launch._gluon_triton_ok(warn=False):
        import triton
        pytest.skip(f"Triton {triton.__version__} is not among launch.GLUON_TRITON_VERSIONS "
                    f"{launch.GLUON_TRITON_VERSIONS}; HF_DELTAMATCH_GLUON=1 runs the Gluon kernels' tests on it")
