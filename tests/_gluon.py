"""The skip the Gluon (sm_90) kernels' GPU tests share."""

import pytest


def skip_unless_gluon_triton(dqk=None, padded=False):
    """The Gluon kernels' tests run with a Triton of launch.GLUON_TRITON_VERSIONS, or any with HF_DELTAMATCH_GLUON=1
    (benchmarks/triton_versions.sh); a test of head dim `dqk` on the padded layout (`padded`: packed batches, N not
    a multiple of 128) only where that version has passed the case (launch.GLUON_TRITON_UNPASSED), or with
    HF_DELTAMATCH_GLUON=1."""
    from hf_deltamatch.kernels import launch

    if not launch._gluon_triton_ok(warn=False):
        import triton
        pytest.skip(f"Triton {triton.__version__} is not among launch.GLUON_TRITON_VERSIONS "
                    f"{launch.GLUON_TRITON_VERSIONS}; HF_DELTAMATCH_GLUON=1 runs the Gluon kernels' tests on it")
    why = launch._version_why_not(dqk=dqk, padded=padded) if dqk is not None else None
    if why:
        pytest.skip(f"{why}: the Triton kernels run this case")
