"""Comparing tensors the way the tests, benchmarks and diagnostics do: relative Frobenius error in float64.

`rel_err(ref, out)` is ||out - ref|| / ||ref|| (both Frobenius, float64); `assert_rel_close(name, ref, out, tol)`
raises with what a failure needs to be read: the error against the bound, the largest absolute difference and where
it is, and the count of non-finite elements (a NaN makes the error NaN, which fails every bound).
"""

from __future__ import annotations

import torch

__all__ = ["rel_err", "assert_rel_close"]


def _check_shapes(ref: torch.Tensor, out: torch.Tensor) -> None:
    if tuple(ref.shape) != tuple(out.shape):  # no broadcasting: a (N, 1) against an (N,) would compare N^2 pairs
        raise ValueError(f"shapes differ: ref {tuple(ref.shape)}, out {tuple(out.shape)}")


@torch.no_grad()
def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64: 0 when both are zero, inf when only ref is, NaN when out has a NaN."""
    _check_shapes(ref, out)
    ref, out = ref.detach().double(), out.detach().double().to(ref.device)
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


@torch.no_grad()
def assert_rel_close(name: str, ref: torch.Tensor, out: torch.Tensor, tol: float) -> float:
    """Assert rel_err(ref, out) <= tol; returns the error. The message names `name` and gives the error, the bound,
    the largest |out - ref| with its index and both values there, and how many elements of out are not finite."""
    err = rel_err(ref, out)
    if err <= tol:
        return err
    r, o = ref.detach().double(), out.detach().double().to(ref.device)
    diff = (o - r).abs()
    bad = ~torch.isfinite(o)
    finite_max = diff[~bad].max().item() if (~bad).any() else float("nan")
    flat = int(bad.flatten().nonzero()[0]) if bad.any() else int(diff.flatten().argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), r.shape))
    at = "first non-finite" if bad.any() else "max |out - ref|"
    raise AssertionError(
        f"{name}: relative error {err:.4g} > {tol:.4g} (||out - ref|| / ||ref||, ||ref|| = {r.norm().item():.4g}); "
        f"max |out - ref| = {finite_max:.4g} over finite elements; {at} at {idx}: out {o[idx].item():.6g}, "
        f"ref {r[idx].item():.6g}; non-finite in out: {int(bad.sum())} of {o.numel()}")
