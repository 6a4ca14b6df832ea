"""The skip the Gluon (sm_90) kernels' GPU tests share."""

import pytest


def skip_unless_gluon_triton():
    """The Gluon kernels' tests run with a Triton release of kernels/toolchain.RELEASES, or any with
    HF_DELTAMATCH_GLUON=1 (benchmarks/triton_versions.sh)."""
    from hf_deltamatch.kernels import toolchain

    current = toolchain.current()
    if not current.gluon:
        pytest.skip(f"Triton {current.version} is not among the tested releases ({toolchain.tested_text()}); "
                    f"{toolchain.GLUON_ENV}=1 runs the Gluon kernels' tests on it")
