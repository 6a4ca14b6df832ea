"""What each Triton release was found to do on the H200, in one record per release.

Code generation differs between Triton releases (and the ptxas each runs for sm_90), and the kernels were tested on
the H200 release by release (tests/test_kernels_gpu.py, benchmarks/triton_versions.sh). A release joins RELEASES after
its GPU tests pass; with any other release the plain Triton kernels run (the Gluon ones only with
HF_DELTAMATCH_GLUON=1) and a warning asks for the GPU tests. Releases are prefixes: "3.6" is any 3.6.x, "3.7.1" that
release only.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import subprocess
import warnings

GLUON_ENV = "HF_DELTAMATCH_GLUON"
# ptxas from this CUDA major on reorders the pipelined dK MMA's fp8 conversions past the MMA that reuses their
# registers (docs/kernels.md, "ptxas 13 and the pipelined dK MMA"): the dK/dV kernel takes its other form there
PIPE_PTXAS_BELOW = 13


@dataclasses.dataclass(frozen=True)
class Release:
    """What the GPU tests established for a Triton release."""

    gluon: bool  # the Gluon kernels (fwd_hopper, dq_hopper, dkdv_hopper) passed
    fused_token_major: bool  # quantize writes a dense batch's token-major copy in the same pass (3.9: wrong stores)
    fused_padded_token_major: bool  # ... and the padded layout's (3.7.1 at D=64: a wrong forward, a NaN dV)


RELEASES = {
    "3.6": Release(gluon=True, fused_token_major=True, fused_padded_token_major=True),
    "3.7.1": Release(gluon=True, fused_token_major=False, fused_padded_token_major=False),
    "3.9": Release(gluon=True, fused_token_major=False, fused_padded_token_major=True),
}


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """The installed Triton, as the kernels' choices need it."""

    version: str
    release: str | None  # its entry of RELEASES, or None (untested)
    gluon: bool  # the Gluon kernels may run: a release whose tests passed, or HF_DELTAMATCH_GLUON=1
    fused_token_major: bool
    fused_padded_token_major: bool

    @property
    def tested(self) -> bool:
        return self.release is not None


def listed(version: str, releases=RELEASES) -> str | None:
    """The entry of `releases` (release prefixes) that Triton `version` belongs to ("3.6" holds 3.6.0 and
    3.6.1+git..., not 3.60.0; "3.7.1" holds 3.7.1 only), or None."""
    parts = version.split("+")[0].split(".")
    return next((r for r in releases if parts[:len(r.split("."))] == r.split(".")), None)


def tested_text() -> str:
    """RELEASES for a message: 3.6.x, 3.7.1, 3.9.x."""
    return ", ".join(r + ".x" if r.count(".") == 1 else r for r in RELEASES)


def current() -> Toolchain:
    """The installed Triton's record (cheap: cached per version and HF_DELTAMATCH_GLUON value)."""
    import triton

    return _toolchain(triton.__version__, os.environ.get(GLUON_ENV, ""))


@functools.lru_cache(maxsize=None)
def _toolchain(version: str, gluon_env: str) -> Toolchain:
    if gluon_env not in ("", "0", "1"):
        raise ValueError(f"{GLUON_ENV}={gluon_env!r}: use 1 (the Gluon kernels on any Triton version) or 0 (never)")
    name = listed(version)
    release = RELEASES.get(name) if name else None
    gluon = gluon_env == "1" if gluon_env else bool(release and release.gluon)
    # untested: the fused stores off, as on the releases where they failed
    return Toolchain(version, name, gluon, bool(release and release.fused_token_major),
                     bool(release and release.fused_padded_token_major))


def warn_untested_gluon() -> None:
    """Once per process: the Gluon kernels would take this input but the Triton release is untested."""
    _warn_once(f"hf_deltamatch: the Gluon (sm_90) kernels are tested with Triton {tested_text()}, not "
               f"{current().version}: the plain Triton kernels run instead (slower). Install a tested Triton for the "
               f"fast path, or set {GLUON_ENV}=1 to run the Gluon kernels on this version anyway.")


def untested_text(version: str) -> str | None:
    """None for a Triton release the kernels' GPU tests passed with, else the warning's text."""
    if listed(version):
        return None
    return (f"hf_deltamatch's Triton kernels passed their GPU tests with Triton {tested_text()}, not yet with "
            f"{version} (Triton 3.9 once compiled one of them wrongly): run `pytest -m gpu tests/test_kernels_gpu.py` "
            "on this GPU before training, or use backend='reference'.")


def warn_untested_triton() -> None:
    """Once per process, on the first CUDA launch with an untested release."""
    msg = untested_text(current().version)
    if msg:
        _warn_once(msg)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def sm90_ptxas() -> str:
    """The path of the ptxas that Triton runs for sm_90 (its bundled one, or TRITON_PTXAS_PATH /
    TRITON_PTXAS_BLACKWELL_PATH)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(90).path


@functools.lru_cache(maxsize=None)
def sm90_ptxas_major() -> int:
    """The CUDA major version of sm90_ptxas()."""
    out = subprocess.run([sm90_ptxas(), "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+)\.", out)
    if not found:
        raise RuntimeError(f"cannot read the CUDA version of ptxas from {out!r}")
    return int(found.group(1))
