"""Smoke tests of benchmarks/attention.py: its conventions, its writers, and the CPU dry run end to end.

The numbers themselves come from the H200 (`bash benchmarks/gpu_check.sh "$OUT"`); here we check that the
script runs, that its FLOP convention matches docs/baselines.md, and that failures land in the report.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _scripts import script_module  # noqa: E402


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "attention.py"


@pytest.fixture(scope="module")
def bench():
    with script_module(SCRIPT, "bench_attention") as module:
        yield module


def test_flop_convention_matches_anchors(bench):
    # docs/baselines.md: SDPA cuDNN fwd+bwd 3.865 ms = 498 TFLOP/s at N=8192 causal, 7.154 ms = 538 at N=8192 full,
    # 113.1 ms = 544 at N=65536 causal (B=1); and a forward alone of 1.014 ms at N=8192 causal is 542.
    for name, key, ms, tflops in [("n8192c", "fwdbwd", 3.865, 498), ("n8192f", "fwdbwd", 7.154, 538),
                                  ("n65536c", "fwdbwd", 113.1, 544), ("n8192c", "fwd", 1.014, 542)]:
        flops = bench.attention_flops(bench.PRESETS[name])
        assert flops[key] / (ms * 1e-3) / 1e12 == pytest.approx(tflops, abs=1.0), name
    f = bench.attention_flops(bench.PRESETS["gqa"])  # GQA counts query heads
    assert f["fwd"] == 4 * 2 * 16 * 8192**2 * 128 / 2 and f["bwd"] == 2.5 * f["fwd"]


def test_presets_follow_anchors(bench):
    for name, s in bench.PRESETS.items():
        assert s.Hq * s.dv == 2048, name  # hidden 2048 (MLA: v's head dim)
        assert s.B * s.N == 16384 or name in ("n65536c", "ragged"), name
    assert bench.PRESETS["ragged"].N % 128 and bench.PRESETS["ragged"].causal  # the Gluon kernels' padded path
    assert bench.PRESETS["gqa"].Hkv == 4 and bench.PRESETS["n8192f"].causal is False


def test_parse_shape(bench):
    assert bench.parse_shape("n8192c") is bench.PRESETS["n8192c"]
    s = bench.parse_shape("B2-H16-KV4-N8192-D128-causal")
    assert (s.B, s.Hq, s.Hkv, s.N, s.D, s.causal) == (2, 16, 4, 8192, 128, True)
    s = bench.parse_shape("B1-H8-N1024-D64-full")
    assert (s.Hkv, s.causal) == (8, False)
    with pytest.raises(ValueError, match="preset"):
        bench.parse_shape("B2-H16-X9")
    with pytest.raises(ValueError, match="multiple"):
        bench.parse_shape("B1-H6-KV4-N128-D64")
    s = bench.parse_shape("B2-H16-N8192-D192-DV128-causal")  # MLA
    assert (s.D, s.dv, s.Dv) == (192, 128, 128) and "D192/128" in s.label
    assert bench.parse_shape("B1-H8-N1024-D64-full").dv == 64


def test_mla_flops_count_both_head_dims(bench):
    mla = bench.PRESETS["mla"]
    # QK^T at Dqk=192 and PV at Dv=128: 2*(192 + 128) per causal pair shown, times B*Hq
    assert bench.attention_flops(mla)["fwd"] == 2 * 2 * 16 * (192 + 128) * 8192**2 / 2


def _fake_report(bench):
    """A GPU-like report (ratios, anchor estimates, a failure, a skipped shape) the CPU run cannot produce."""
    shape = bench.PRESETS["n8192c"]
    flops = bench.attention_flops(shape)

    def ok(ms, err=3e-3, **extra):
        res = {"status": "ok", "fwd_ms": ms / 3.5, "bwd_ms": ms * 2.5 / 3.5, "fwdbwd_ms": ms,
               "bwd_method": "retained graph", "peak_mib": 1234.0,
               "err": {"out": err, "dq": err, "dk": err, "dv": err}}
        res.update({f"{k}_tflops": flops[k] / (res[f"{k}_ms"] * 1e-3) / 1e12 for k in ("fwd", "bwd", "fwdbwd")})
        res.update(extra)
        return res

    ops = {
        "dm-fp8-matching": ok(3.0, 0.04, check="ok"),
        "dm-fp8-stale": ok(2.9, float("nan"), check="FAIL (non-finite)"),
        "dm-bf16": {"status": "error", "stage": "first call", "error": "ValueError: the Triton kernels do not"},
        "sdpa-flash": ok(6.6), "sdpa-cudnn": ok(3.865), "flex": ok(5.2, bwd_method="fwd+bwd minus fwd"),
    }
    for res in ops.values():
        if res["status"] == "ok":
            res["speedup_vs_base"] = {k: ops["sdpa-cudnn"][f"{k}_ms"] / res[f"{k}_ms"]
                                      for k in ("fwd", "bwd", "fwdbwd")}
    entry = {"name": "n8192c", "label": shape.label, "status": "done", "flops": flops, "ops": ops,
             "ratio_base": "sdpa-cudnn", "reference": "fp32, SDPA mem-efficient backend",
             "anchor_estimates_ms": {"fa4": 3.44, "cudnn-fp8": 2.968}}
    skipped = {"name": "n65536c", "label": bench.PRESETS["n65536c"].label, "status": "skipped",
               "reason": "skipped: time budget of 300 s used up (301 s)"}
    env = {"python": "3.12", "torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "cudnn": "9.19.0",
           "gpu": "NVIDIA H200", "sm_count": 132, "capability": "9.0", "gpu_memory_gib": 139.8,
           "git_commit": "0" * 40, "hf_deltamatch": "0.1.0"}
    meta = {k: "x" for k in ("timing", "flops", "ratio", "ops_doc", "memory", "check")}
    meta.update(date="2026-11-29 15:00 UTC", dry_run=False, ops=list(ops), ratio_base="sdpa-cudnn", backend="triton")
    return {"meta": meta, "environment": env, "shapes": [entry, skipped]}


def test_writers_report_ratios_failures_and_skips(bench, tmp_path):
    report = _fake_report(bench)
    json_path, md_path = tmp_path / "r.json", tmp_path / "r.md"
    bench.write_outputs(report, json_path, md_path)
    data = json.loads(json_path.read_text())  # strict JSON: NaN was turned into a string
    assert data["shapes"][0]["ops"]["dm-fp8-stale"]["err"]["out"] == "nan"
    md = md_path.read_text()
    assert "3.000 (" in md and "1.29×" in md  # ours: ms (TFLOP/s) and speed-up vs cuDNN
    assert "FA4 est." in md and "3.440 (559)" in md  # docs/baselines.md's FA4 at N=8192 causal: 3.440 ms = 559 TFLOP/s
    assert "**WRONG**" in md  # the non-finite error is flagged in the summary table
    assert "## Failures" in md and "dm-bf16 (at first call): ValueError" in md
    assert "time budget" in md and "†" in md
    tail = bench.stdout_md(report).rstrip().splitlines()
    assert tail[-1].startswith("FA4 est.") and any(line.startswith("| n8192c: B2 H16") for line in tail[-6:])


def test_cuda_graph_table(bench, tmp_path):
    """--cuda-graph: the graphed fwd+bwd beside the eager one, over the graphed base (a baseline where the base did
    not run: Flex on the window presets), a failed capture said as such; no table without the option."""
    report = _fake_report(bench)
    assert bench.graph_md(report) == []
    ops = report["shapes"][0]["ops"]
    ops["dm-fp8-matching"]["graph_fwdbwd_ms"] = 1.5
    ops["sdpa-cudnn"]["graph_fwdbwd_ms"] = 3.0
    ops["flex"]["graph_error"] = "RuntimeError: operation not permitted when stream is capturing"
    md = "\n".join(bench.graph_md(report))
    assert "| n8192c | dm-fp8-matching | 3.000 | 1.500 | 0.50× |" in md
    assert "| n8192c | sdpa-cudnn | 3.865 | 3.000 | 1.00× |" in md
    assert "| n8192c | flex | 5.200 | capture failed: RuntimeError: operation not permitted" in md
    del ops["sdpa-cudnn"]["graph_fwdbwd_ms"]
    ops["flex"] = dict(ops["flex"], graph_fwdbwd_ms=0.6)
    del ops["flex"]["graph_error"]
    assert "| n8192c | dm-fp8-matching | 3.000 | 1.500 | 2.50× |" in "\n".join(bench.graph_md(report))
    bench.write_outputs(report, tmp_path / "r.json", tmp_path / "r.md")
    assert "## fwd+bwd from a CUDA graph" in (tmp_path / "r.md").read_text()


def test_dry_run_end_to_end(tmp_path):
    try:
        from hf_deltamatch import DeltaMatchConfig, deltamatch_attention  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"hf_deltamatch.deltamatch_attention is not importable yet ({exc})")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("attention-*-cpu.json")
    (md_path,) = tmp_path.glob("attention-*-cpu.md")
    report = json.loads(json_path.read_text())
    assert report["meta"]["dry_run"] is True and report["environment"]["torch"]
    assert len(report["shapes"]) == 2
    for shape in report["shapes"]:
        assert shape["reference"].startswith("float64")
        for name in ("dm-fp8-matching", "dm-fp8-stale", "dm-bf16", "sdpa-math"):
            res = shape["ops"][name]
            assert res["status"] == "ok", (shape["name"], name, res.get("error"))
            assert res["check"] == "ok", (shape["name"], name, res["err"])
            assert all(math.isfinite(e) for e in res["err"].values())
            assert res["bwd_method"] == "retained graph"
            assert res["speedup_vs_base"]["fwdbwd"] > 0
        for name in ("sdpa-flash", "sdpa-cudnn", "flex"):
            assert shape["ops"][name]["status"] == "skipped"
        # FP8 is visibly less accurate than the same algorithm in bf16 (the error columns are live)
        assert shape["ops"]["dm-fp8-matching"]["err"]["dq"] > 3 * shape["ops"]["dm-bf16"]["err"]["dq"]
        # saved for backward: fp8 keeps 1-byte q8/k8/v8 (+ fp32 per-token scales, lse), bf16 mode the 2-byte inputs
        saved = {name: shape["ops"][name]["saved_mib"] for name in ("dm-fp8-matching", "dm-bf16")}
        assert 0 < saved["dm-fp8-matching"] < 0.65 * saved["dm-bf16"], saved
    assert "DRY RUN" in md_path.read_text()
    last = proc.stdout.rstrip().splitlines()[-1]
    assert last.startswith("| tiny-full:"), last  # the summary table is printed last


@pytest.mark.parametrize("causal", [True, False])
def test_sinks_reference_is_exact_attention_with_sinks(bench, causal):
    """The sink ops' reference (the sinks as one more key through SDPA) is float64 exact attention with a sink
    column (hf_deltamatch.diagnostics), GQA included; and the sinks change it (the comparison can fail)."""
    import torch

    from hf_deltamatch.diagnostics import exact_attention
    from hf_deltamatch.testing import rel_err

    shape = bench.Shape("t", 2, 4, 2, 70, 32, causal)
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in
                   ((2, 4, 70, 32), (2, 2, 70, 32), (2, 2, 70, 32), (2, 4, 70, 32)))
    sinks = bench.make_sinks(shape, "cpu", 0)
    out, grads, label, _ = bench.reference_fwd_bwd(shape, q, k, v, do, sinks)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    want = exact_attention(*leaves, causal=causal, sinks=sinks.detach())
    want.backward(do.double())
    for got, w in zip((out, *grads), (want, *(t.grad for t in leaves))):
        assert rel_err(w.detach(), got) < 1e-12
    assert rel_err(want.detach(), bench.reference_fwd_bwd(shape, q, k, v, do)[0]) > 0.05


def test_dry_run_with_sinks(tmp_path):
    """--sinks adds dm-fp8-sinks, its errors taken against exact attention with the same sinks."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--sinks", "--out", str(tmp_path),
                           "--shapes", "B1-H4-KV2-N160-D32-causal", "--ops", "dm-fp8-matching"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("attention-*-cpu.json")
    (shape,) = json.loads(json_path.read_text())["shapes"]
    assert list(shape["ops"]) == ["dm-fp8-matching", "dm-fp8-sinks", "sdpa-math"]
    assert "sinks as one more key" in shape["reference_sinks"]
    res = shape["ops"]["dm-fp8-sinks"]
    assert res["status"] == "ok" and res["check"] == "ok", res
    assert 0.01 < max(res["err"].values()) < 0.11  # FP8-level, not a wrong reference (tens of %)
    assert "dm fp8 + sinks" in proc.stdout


def test_dry_run_qk_transforms_report_their_cost(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--qk-transforms",
                           "--ops", "dm-bf16", "--shapes", "B1-H2-KV1-N96-D32-causal"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("attention-*-cpu.json")
    report = json.loads(json_path.read_text())
    ops = report["shapes"][0]["ops"]
    assert list(ops) == ["dm-bf16", "dm-fp8-matching", "dm-fp8-hadamard", "dm-fp8-smooth-k",
                         "dm-fp8-hadamard-smooth-k", "sdpa-math"]
    for name in ("dm-fp8-hadamard", "dm-fp8-smooth-k", "dm-fp8-hadamard-smooth-k"):
        assert ops[name]["status"] == "ok" and ops[name]["check"] == "ok", (name, ops[name].get("error"))
        assert ops[name]["cost_vs_fp8_matching"]["fwdbwd"] > -1
    assert ops["dm-fp8-hadamard-smooth-k"]["config"]["qk_rotation"] == "hadamard"
    assert ops["dm-fp8-hadamard-smooth-k"]["config"]["smooth_k"] is True
    assert "% vs dm fp8-matching)" in proc.stdout


def test_gpu_check_skips_the_benchmark_when_the_tests_leave_too_little_time(tmp_path):
    """gpu_check.sh's control flow (the GPU tests and timing need the H200): with `true` as the interpreter the
    tests "pass" at once, and a 60 s total leaves under the 120 s the benchmark needs, so it is skipped with a
    note on what to run instead, and the script exits with pytest's status, writing no benchmark report."""
    env = {**os.environ, "PYTHON": "true", "GPU_CHECK_TOTAL": "60"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest -m gpu: passed" in proc.stdout
    assert "benchmark skipped" in proc.stdout and "benchmarks/attention.py" in proc.stdout
    assert not list(tmp_path.glob("attention-*"))


def test_triton_versions_script_control_flow(tmp_path):
    """triton_versions.sh's control flow (its tests, compiles and timing need the H200 and a Triton wheel): with
    `true` as the interpreter every step "passes" at once; a 60 s total leaves too little for the benchmark, which
    is skipped with a note on what to run, and the script exits with pytest's status; TV_BENCH=0 leaves the benchmark
    out whatever the time left; without an output folder it refuses with its usage."""
    script = str(ROOT / "benchmarks" / "triton_versions.sh")
    env = {**os.environ, "PYTHON": "true", "TV_TOTAL": "60"}
    proc = subprocess.run(["bash", script, str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tests/test_kernels_gpu.py: passed" in proc.stdout and "benchmark skipped" in proc.stdout
    assert (tmp_path / "operands.log").read_text().count("== sm90_registers.py --kernels hopper --operands") == 5
    assert not list(tmp_path.glob("attention-*"))
    proc = subprocess.run(["bash", script, str(tmp_path)], cwd=ROOT, env={**env, "TV_TOTAL": "590", "TV_BENCH": "0"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "benchmark left out (TV_BENCH=0)" in proc.stdout, proc.stdout + proc.stderr
    assert not list(tmp_path.glob("attention-*"))
    env.pop("OUT", None)
    proc = subprocess.run(["bash", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_triton_versions_script_deals_the_tests_to_parallel_processes(tmp_path):
    """The GPU tests run as TV_PARALLEL processes, the collected ids dealt round-robin, each verbose: a stand-in
    interpreter lists 7 ids when asked to collect and records each run's arguments; one run exiting 1 makes the
    status FAILED (a failure outranks another process's time limit, 124)."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in\n'
        '  *" --collect-only "*) for i in 0 1 2 3 4 5 6; do echo "tests/test_kernels_gpu.py::test_$i"; done ;;\n'
        '  *"::test_1 "*) echo "$*" >> "$RUNS"; exit 1 ;;\n'
        '  *"::test_2 "*) echo "$*" >> "$RUNS"; exit 124 ;;\n'
        '  *" -m pytest "*) echo "$* PEAK=$HF_DELTAMATCH_GPU_PEAK_LOG" >> "$RUNS" ;;\n'
        "esac\n")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "TV_TOTAL": "60", "TV_PARALLEL": "3", "RUNS": str(tmp_path / "runs")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "triton_versions.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tests/test_kernels_gpu.py: FAILED (rc=1) (3 processes" in proc.stdout
    runs = sorted((tmp_path / "runs").read_text().splitlines())
    assert len(runs) == 3 and all(" -v " in r for r in runs)
    assert all(r.endswith(f"PEAK={out / 'gpu-peak.txt'}") for r in runs if "::test_0 " in r)  # conftest's peak log
    dealt = sorted(sorted(int(t.rsplit("_", 1)[1]) for t in r.split() if "::" in t) for r in runs)
    assert dealt == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(p.name for p in out.glob("pytest-gluon-*.log")) == [f"pytest-gluon-{i}.log" for i in range(3)]


def test_triton_versions_script_fits_the_processes_to_free_gpu_memory(tmp_path):
    """TV_PARALLEL is capped at what the free GPU memory holds at TV_GIB_PER_PROCESS (the tests' processes peaked at
    3.1-5.0 GiB each on the H200; more of them than fit die of out-of-memory errors): a stand-in nvidia-smi reporting
    17000 MiB free leaves 2 of 3 processes at the default 8 GiB each. TV_PYTEST_K reaches pytest as one -k
    expression, spaces and all."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in\n'
        '  *" --collect-only "*) printf "%s\\n" "$@" > "$COLLECT"\n'
        '    for i in 0 1 2 3 4 5 6; do echo "tests/test_kernels_gpu.py::test_$i"; done ;;\n'
        '  *" -m pytest "*) echo "$*" >> "$RUNS" ;;\n'
        "esac\n")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/usr/bin/env bash\necho 17000\n")
    for f in (fake, smi):
        f.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "TV_TOTAL": "60", "TV_PARALLEL": "3", "RUNS": str(tmp_path / "runs"),
           "PATH": f"{smi.parent}:{os.environ['PATH']}", "COLLECT": str(tmp_path / "collect"),
           "TV_PYTEST_K": "window or (ragged and 129-)"}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "triton_versions.sh"), str(tmp_path / "out")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "TV_PARALLEL 3 -> 2: 17000 MiB of GPU memory free" in proc.stdout
    assert len((tmp_path / "runs").read_text().splitlines()) == 2
    args = (tmp_path / "collect").read_text().splitlines()
    assert args[args.index("-k") + 1] == "window or (ragged and 129-)"


def _fake_triton_wheel(path, elf):
    """A wheel laid out like Triton's: the NVIDIA backend's two ptxas, cuobjdump, nvdisasm (executable, as the wheel
    records them) and CUPTI, an AMD backend, an ELF shared library (a copy of `elf`) and a non-ELF one."""
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        z.writestr("triton/__init__.py", "__version__ = '9.9.0'\n")
        z.write(elf, "triton/_C/libreal.so")
        z.writestr("triton/_C/libtext.so", "not an ELF file\n")
        for name in ("ptxas", "ptxas-blackwell", "cuobjdump", "nvdisasm"):
            info = zipfile.ZipInfo(f"triton/backends/nvidia/bin/{name}")
            info.external_attr = 0o100755 << 16
            z.writestr(info, "#!/bin/sh\n")
        z.writestr("triton/backends/nvidia/lib/cupti/libcupti_static.a", "x" * 1000)
        z.writestr("triton/backends/nvidia/lib/cupti-blackwell/libcupti_static.a", "x" * 1000)
        z.writestr("triton/backends/amd/lib/libtriton_amd_codegen.so", "x" * 1000)
        z.writestr("triton-9.9.0.dist-info/METADATA", "Name: triton\nVersion: 9.9.0\n")
        z.writestr("triton-9.9.0.dist-info/entry_points.txt",
                   "[triton.backends]\namd = triton.backends.amd\nnvidia = triton.backends.nvidia\n")


def test_pack_triton_keeps_what_the_gpu_runs_need(tmp_path):
    """pack_triton.sh: the archive holds the NVIDIA backend with the ptxas asked for, cuobjdump and nvdisasm, still
    executable, and no
    AMD backend (nor its entry point), CUPTI or other ptxas; ELF libraries are stripped and still load, other files
    are left alone; --part-mib splits the archive; a missing --keep-ptxas is refused with the usage."""
    import ctypes
    import shutil
    import sysconfig
    import tarfile

    # a small real shared library: one of the interpreter's own extension modules
    elf = min(Path(sysconfig.get_config_var("DESTSHARED")).glob("*.so"), key=lambda p: p.stat().st_size, default=None)
    if elf is None:
        pytest.skip("no shared library of the interpreter's to pack")
    wheel = tmp_path / "triton-9.9.0-py3-none-any.whl"
    _fake_triton_wheel(wheel, elf)
    script = str(ROOT / "benchmarks" / "pack_triton.sh")
    proc = subprocess.run(["bash", script, str(wheel), str(tmp_path / "out"), "--keep-ptxas", "ptxas-blackwell"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "out" / "triton-9.9.0.tar.xz") as tar:
        names = set(tar.getnames())
        tar.extractall(tmp_path / "site", filter="data")
    assert {f"triton/backends/nvidia/bin/{n}" for n in ("ptxas-blackwell", "cuobjdump", "nvdisasm")} <= names
    for n in ("ptxas-blackwell", "cuobjdump", "nvdisasm"):
        assert os.access(tmp_path / "site/triton/backends/nvidia/bin" / n, os.X_OK), n
    assert not any("amd" in n or "cupti" in n or n.endswith("/bin/ptxas") for n in names), names
    site = tmp_path / "site"
    assert "amd" not in (site / "triton-9.9.0.dist-info" / "entry_points.txt").read_text()
    assert (site / "triton/_C/libtext.so").read_text() == "not an ELF file\n"
    packed = site / "triton/_C/libreal.so"
    if shutil.which("strip"):
        assert packed.stat().st_size <= elf.stat().st_size
    ctypes.CDLL(str(packed), mode=os.RTLD_LAZY)  # still a loadable library
    proc = subprocess.run(["bash", script, str(wheel), str(tmp_path / "parts"), "--keep-ptxas", "ptxas",
                           "--part-mib", "1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [p.name for p in (tmp_path / "parts").iterdir()] == ["triton-9.9.0.tar.xz.part.aa"]
    proc = subprocess.run(["bash", script, str(wheel), str(tmp_path / "x")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr


def test_window_presets_and_dry_run(bench, tmp_path):
    """The sliding-window presets (issue #32: W 4096 and 128 at 8K): FLOPs counted over the pairs the window shows
    (W = N: the causal count plus the diagonal's N/2 pairs), `W<n>` in custom shapes, and a dry run whose errors are
    taken against exact attention with the window's mask (FP8-level; against the plain causal mask they would be
    tens of percent), with --tune recorded."""
    for name, w in (("window4096", 4096), ("window128", 128)):
        s = bench.PRESETS[name]
        assert (s.B, s.Hq, s.N, s.D, s.causal, s.window) == (2, 16, 8192, 128, True, w)
        assert bench.attention_flops(s)["fwd"] == 4 * 2 * 16 * 128 * (w * 8192 - w * (w - 1) / 2)
    full = bench.parse_shape("B1-H2-N64-D32-W64")
    assert bench.attention_flops(full)["fwd"] == bench.attention_flops(bench.parse_shape("B1-H2-N64-D32"))["fwd"] \
        + 4 * 2 * 32 * 64 / 2
    with pytest.raises(ValueError, match="causal"):
        bench.parse_shape("B1-H2-N64-D32-full-W16")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path), "--ops",
                           "dm-fp8-matching", "--shapes", "B1-H4-KV2-N192-D32-W40", "--tune", "{'fwd_tma': False}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (json_path,) = tmp_path.glob("attention-*-cpu.json")
    report = json.loads(json_path.read_text())
    assert report["meta"]["tune"] == {"fwd_tma": False}
    (shape,) = report["shapes"]
    assert shape["shape"]["window"] == 40 and "window 40" in shape["label"]
    for name in ("dm-fp8-matching", "sdpa-math"):
        res = shape["ops"][name]
        assert res["status"] == "ok" and res["check"] == "ok", (name, res)
    assert 0.005 < max(shape["ops"]["dm-fp8-matching"]["err"].values()) < 0.11
    # SDPA math in bf16 with the same mask as the float64 reference: bf16 rounding only
    assert max(shape["ops"]["sdpa-math"]["err"].values()) < 5e-3


def test_dq_one_pass_study_separates_the_variants(tmp_path):
    """benchmarks/dq_one_pass.py on a small causal draw (N=256, D=32, peaked logits): Delta-Matching's two-pass dS
    has the smallest row-sum residual; the one-pass split (P∘dP and P quantized apart) is worse than matching at
    logit std 6, where it cancels; the report and JSON are written."""
    with script_module(ROOT / "benchmarks" / "dq_one_pass.py", "dq_one_pass") as mod:
        runs = [mod.study(256, 32, 2, seed, 6.0) for seed in range(2)]
        assert mod.main(["--n", "256", "--d", "32", "--heads", "2", "--seeds", "1", "--out", str(tmp_path)]) == 0
    for r in runs:
        assert r["matching"]["row_sum_abs"] < r["stale"]["row_sum_abs"]
        assert r["matching"]["row_sum_abs"] * 3 < r["one-pass"]["row_sum_abs"]
        assert all(0 < r[v]["dq_rel_err"] < 0.5 for v in mod.VARIANTS)
    report = json.loads((tmp_path / "dq-one-pass.json").read_text())
    assert report["meta"]["n"] == 256 and len(report["runs"]) == 1
    assert "| one-pass |" in (tmp_path / "dq-one-pass.md").read_text()


def test_kernel_breakdown_window_shapes():
    """kernel_breakdown.py's window shapes (variant shapes only): the 7th field is the window, the others' is None,
    and a window's FLOPs count the pairs it shows, as attention.py's presets do."""
    with script_module(ROOT / "benchmarks" / "kernel_breakdown.py", "kernel_breakdown") as kb, \
            script_module(SCRIPT, "bench_attention_kb") as bench:
        assert kb.shape_of("d128-causal") == (2, 16, 16, 8192, 128, True, None)
        for name, preset in (("window128-d128", "window128"), ("window4096-d128", "window4096")):
            B, Hq, Hkv, N, D, causal, window = kb.shape_of(name)
            s = bench.PRESETS[preset]
            assert (B, Hq, Hkv, N, D, causal, window) == (s.B, s.Hq, s.Hkv, s.N, s.D, s.causal, s.window)
            assert kb.flops(B, Hq, N, D, causal, window=window) == bench.attention_flops(s)["fwd"]
        whole = kb.flops(2, 16, 8192, 128, True, window=8192)  # W = N: causal plus the diagonal's N/2 pairs
        assert whole == kb.flops(2, 16, 8192, 128, True) + 4 * 2 * 16 * 128 * 8192 / 2
