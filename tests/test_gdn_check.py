"""benchmarks/gdn_check.py: its float64 Gated DeltaNet recurrence, its isolation check, and the CPU run end to end.

On CPU only transformers' torch path and the float64 recurrence run (FLA's Triton kernels need a GPU): the
torch path must match the float64 definition to bf16 rounding (its output and the gradients of bf16 inputs are
rounded to bf16: ~2^-9 relative, so 5e-3 leaves room and still catches a wrong scale, norm or gate, which
gives errors of order 1). The FLA comparison is the `gpu` test at the end.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _scripts import script_module  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gdn_check.py"
BF16_TOL = 5e-3


@pytest.fixture(scope="module")
def gdn():
    with script_module(SCRIPT, "bench_gdn_check") as module:
        yield module


CPU = torch.device("cpu")


@pytest.mark.parametrize("heads,v_heads", [(2, 2), (2, 4)], ids=["H2", "H2-HV4"])
def test_torch_path_matches_float64_recurrence(gdn, heads, v_heads):
    inputs, do = gdn.layer_inputs(1, 130, heads, v_heads, 16, seed=1, device=CPU)
    torch_fn = gdn.torch_gdn_fn()
    ref = gdn.forward_backward(gdn.gdn_float64, inputs, do, dtype=torch.float64)
    res = gdn.forward_backward(lambda **kw: gdn.call_torch(torch_fn, **kw), inputs, do)
    errs = gdn.errors(res, ref)
    assert all(0 < e < BF16_TOL for e in errs.values()), errs
    assert ref["dg"].dtype == torch.float64 and ref["dg"].abs().max() > 0


def test_packed_torch_path_matches_float64_per_document(gdn):
    inputs, do = gdn.layer_inputs(1, 200, 2, 2, 16, seed=2, device=CPU)
    cu = gdn.packed_bounds(200, CPU)
    assert cu.dtype == torch.int32 and len(cu) == len(gdn.DOC_FRACTIONS) + 2 and int(cu[-1]) == 200
    ref = gdn.forward_backward(gdn.gdn_float64, inputs, do, cu, dtype=torch.float64)
    res = gdn.forward_backward(lambda **kw: gdn.call_torch(gdn.torch_gdn_fn(), **kw), inputs, do, cu)
    errs = gdn.errors(res, ref)
    assert all(e < BF16_TOL for e in errs.values()), errs
    # and the packed reference really restarts the state: one run over the whole row differs
    whole = gdn.forward_backward(gdn.gdn_float64, inputs, do, dtype=torch.float64)
    assert gdn.errors(whole, ref)["o"] > 0.05


def test_isolation_catches_a_leak(gdn):
    """The isolation check must fail an implementation that lets documents see each other: transformers' torch
    function run over the whole packed row (ignoring cu_seqlens) carries the state across documents."""
    inputs, do = gdn.layer_inputs(1, 160, 2, 2, 16, seed=3, device=CPU)
    cu = gdn.packed_bounds(160, CPU)
    torch_fn = gdn.torch_gdn_fn()
    apart = gdn.isolation(lambda **kw: gdn.call_torch(torch_fn, **kw), inputs, do, cu, seed=0)
    assert apart["ok"] and apart["deterministic"] and apart["other_docs_max_abs_change"] == 0.0

    def mixing(cu_seqlens=None, **kw):
        return gdn.call_torch(torch_fn, **kw)

    leaky = gdn.isolation(mixing, inputs, do, cu, seed=0)
    assert not leaky["ok"] and leaky["other_docs_max_abs_change"] > 0


def test_cpu_run_end_to_end(gdn, tmp_path):
    rc = gdn.main(["--device", "cpu", "--batch", "1", "--heads", "2", "--v-heads", "4", "--dim", "16",
                   "--lengths", "150", "--time-lengths", "150", "--out", str(tmp_path)])
    assert rc == 0
    (js,) = tmp_path.glob("gdn-check-*-cpu.json")
    report = json.loads(js.read_text())
    assert report["meta"]["transformers_gdn_backend"] in ("fla", "torch")
    cases = {c["case"]: c for c in report["correctness"]}
    assert set(cases) == {"B1-H2/4-T150-D16", "B1-H2/4-T150-D16-packed"}
    for case in cases.values():
        assert case["status"] == "ok"
        assert all(e < BF16_TOL for e in case["errors"]["torch_vs_float64"].values())
        assert case["fla"].startswith("skipped")
    assert cases["B1-H2/4-T150-D16-packed"]["isolation_torch"]["ok"]
    (timing,) = report["timing"]
    assert timing["torch_ms"] > 0 and timing["fla"].startswith("skipped")
    md = js.with_suffix(".md").read_text()
    assert "torch vs float64" in md and "all checks pass" in md


@pytest.mark.gpu
def test_fla_matches_torch_and_float64_on_gpu(gdn, tmp_path):
    """FLA (as transformers calls it) against the torch path and float64: dense and packed at 2K, GVA like
    hybrid-1p7b's layers (16 q/k heads, 32 value heads), with the isolation check; timing at 8K."""
    pytest.importorskip("fla")
    rc = gdn.main(["--batch", "2", "--heads", "16", "--v-heads", "32", "--dim", "128", "--lengths", "2048",
                   "--time-lengths", "8192", "--out", str(tmp_path)])
    (js,) = tmp_path.glob("gdn-check-*.json")
    report = json.loads(js.read_text())
    for case in report["correctness"]:
        assert "fla_vs_torch" in case["errors"], case
        assert "fla_vs_float64" in case["errors"], case
        assert case["status"] == "ok", case
    assert report["correctness"][1]["isolation"]["ok"]
    assert report["timing"][0]["fla_ms"] > 0
    assert rc == 0


def test_gdn_backend_follows_transformers_dispatch():
    from hf_deltamatch.training.modeling import gdn_backend

    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        expected = "fla"
    except Exception:  # noqa: BLE001
        expected = "torch"
    assert gdn_backend() == expected


@pytest.mark.parametrize("triton_version,tilelang,capability,refuses", [
    ("3.6.0", False, (9, 0), True),
    ("3.6.0", True, (9, 0), False),
    ("3.7.1", False, (9, 0), False),
    ("3.3.1", False, (9, 0), False),
    ("3.6.0", False, (10, 0), False),
], ids=["hopper-triton3.6", "with-tilelang", "triton3.7.1", "triton3.3", "blackwell"])
def test_fla_hopper_backward_refusal(monkeypatch, triton_version, tilelang, capability, refuses):
    """FLA 0.6 raises in the gated backward on Hopper for 3.4 <= Triton < 3.7.1 without tilelang (FLA #640):
    the recipe warns before training starts. No Hopper here, so the environment is patched."""
    import importlib.util

    import triton

    from hf_deltamatch.training import modeling

    real_find_spec = importlib.util.find_spec
    # FLA's own backend rule is bypassed (its import fails), so tilelang's presence comes from find_spec below
    monkeypatch.setitem(sys.modules, "fla.ops.common.backends.tilelang", None)
    monkeypatch.setattr(modeling, "fla_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (object() if tilelang else None)
                        if name == "tilelang" else real_find_spec(name, *a))
    message = modeling.fla_hopper_backward_refusal()
    assert (message is not None) == refuses
    if refuses:
        assert "tilelang" in message and "3.7.1" in message


def test_layouts_select_the_correctness_cases(gdn, tmp_path):
    """--layouts packed runs only the packed case (the isolation check first, where a GPU call's time is short)."""
    rc = gdn.main(["--device", "cpu", "--batch", "1", "--heads", "2", "--dim", "16", "--lengths", "100",
                   "--layouts", "packed", "--time-lengths", "", "--out", str(tmp_path)])
    assert rc == 0
    (js,) = tmp_path.glob("gdn-check-*-cpu.json")
    report = json.loads(js.read_text())
    assert [c["case"] for c in report["correctness"]] == ["B1-H2-T100-D16-packed"] and not report["timing"]
    with pytest.raises(SystemExit):
        gdn.parse_args(["--layouts", "sparse"])
