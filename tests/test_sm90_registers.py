"""benchmarks/sm90_registers.py: the sm_90 compile report that comes before any GPU time (no GPU needed)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sm90_registers.py"

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   MUFU.EX2 R2, R3 ;
        /*0020*/              @!P0 BRA 0x10 ;
        /*0100*/                   QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT ;
        /*0110*/                   FFMA R4, R5, R6, R7 ;
        /*0120*/                   MUFU.EX2 R8, R4 ;
        /*0130*/                   LDL R9, [R1+0x10] ;
        /*0140*/                   SHFL.BFLY PT, R10, R9, 0x1, 0x1f ;
        /*0400*/               @P1 BRA 0x100 ;
        /*0500*/                   FMUL R11, R12, R13 ;
        /*0600*/               @P2 BRA 0x0 ;
"""


def _load():
    spec = importlib.util.spec_from_file_location("sm90_registers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT))
    return mod


def _env():
    """The environment the script's subprocesses run in: the real compiler (no interpreter), this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _compile(*args, timeout=600) -> str:
    """stdout of sm90_registers.py with `args` (real compiles for sm_90); skips where this Triton install lacks the
    CUDA tools."""
    res = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=timeout)
    if res.returncode and "Cannot find" in res.stderr:
        pytest.skip(f"this Triton install lacks the CUDA tools: {res.stderr.strip().splitlines()[-1]}")
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def _record(loop: str) -> str:
    """stdout of `loop` run in a subprocess after `import sm90_registers as S`, `from hf_deltamatch.kernels import
    configs, plan` and `cases = S.default_cases()` (record_launches answers as on the H200's sm_90 and Triton 3.6)."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import sm90_registers as S\n"
            "from hf_deltamatch.kernels import configs, plan\n"
            "cases = S.default_cases()\n" + loop)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_loops_counts_innermost_bodies():
    """The outer loop (0x0-0x600) contains the inner one and the tiny busy-wait loop (0x10-0x20) is not a tile
    loop: only 0x100-0x400 is reported, with its instructions by kind."""
    loops = _load().loops(SASS)
    assert loops == [(0x100, {"all": 6, "mma": 1, "fp32": 1, "mufu": 1, "spill": 1, "shfl": 1, "other": 1})]


def test_forward_compiles_for_sm90_on_the_cpu():
    """The report on a real kernel: Triton compiles the forward for sm_90 without a GPU (its bundled ptxas and
    cuobjdump), outside the interpreter that the rest of the suite runs in."""
    stdout = _compile("--d", "64", "--kernels", "fwd", "--loops")
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    head = next(ln for ln in lines if " fwd " in ln)
    assert "regs=" in head and "spill=" in head and "QGMMA.64x" in head and "wgmma serialized:" in head
    body = [ln for ln in lines if "loop @" in ln]
    assert body and all("mma=" in ln and "mufu=" in ln for ln in body)


@pytest.mark.parametrize("variant", [[], ["--varlen"], ["--full"]], ids=["dense", "packed", "full"])
def test_gluon_kernels_compile_for_sm90_on_the_cpu(variant):
    """The Gluon kernels (kernels/*_hopper.py: forward, dQ, dK/dV; dense causal and packed batches, and the full
    mask, where dQ's second pass is pipelined and dK/dV takes its tiles in pairs) compile for sm_90
    with the installed Triton (3.6's Gluon API or the renamed one since): no spills and no serialized wgmmas, the
    properties their speed on the H200 rests on (docs/kernels.md). Known exceptions with Triton 3.9: the
    three-warpgroup forward at D=128 spills (16 bytes dense, 136 packed), and the dK/dV kernel 48 bytes since its
    accumulator units carry a running max (with Triton 3.6 on the H200 its fwd+bwd time did not change:
    docs/kernels.md). The Gluon kernels run with the Triton releases of kernels/toolchain.py only; the bounds keep the
    3.9 spills from growing unseen. The dK/dV kernel's MMA operands are checked tile by tile
    (sm90_registers.check_dkdv_operands) with the options the plan picks for this Triton's ptxas."""
    import triton
    stdout = _compile("--d", "128", "--kernels", "hopper,hopper_dq,hopper_fwd", "--operands", *variant)
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 3, stdout
    assert "operands: ok" in stdout, stdout  # dK/dV's MMAs multiply the values they should
    for ln in rows:
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in ln and "wgmma serialized: no" in ln, ln
        spill = int(re.search(r"spill=(\d+)B", ln).group(1))
        allowed = 0
        if not triton.__version__.startswith("3.6"):
            if " hopper_fwd " in ln:
                allowed = 136
            elif " hopper " in ln:  # dK/dV: the running max of its accumulator units (_fp8.acc_units), 48 B
                allowed = 48
        assert spill <= allowed, ln


def _tile_sass(dk_from):
    """A dK/dV tile in SASS: S^T into R24.. and dP^T into R56.. (fresh MMAs), P8 packed from S^T into R8-R11 for
    dV's MMA (R88), and dK's MMA (R120) from R16-R19, two k-steps each, R16-R19 packed from `dk_from`: "dS" (S^T
    times dP^T minus a loaded delta), "carried" (registers from before the tile), "dP" (the dP^T accumulator alone:
    what ptxas 13 made of the pipelined dK MMA)."""
    src = {"dS": [f"FFMA R{60 + r}, R{56 + r}, R2, -R3\nFMUL R{60 + r}, R{26 + r}, R{60 + r}" for r in range(8)],
           "carried": [f"FMUL R{60 + r}, R{160 + r}, R2" for r in range(8)],
           "dP": [f"MOV R{60 + r}, R{56 + r}" for r in range(8)]}[dk_from]
    lines = ["LDS.64 R2, [R17+0x100]",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR8], RZ, !UPT",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R56, gdesc[UR12], RZ, !UPT, gsb0",
             "WARPGROUP.DEPBAR.LE gsb0, 0x1",
             *[f"MUFU.EX2 R{24 + r}, R{24 + r}" for r in range(8)],
             *[f"F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R{8 + r}, R{25 + 2 * r}, R{24 + 2 * r}, RZ"
               for r in range(4)],
             "QGMMA.64x64x32.F32.E4M3.E4M3 R88, R8, gdesc[UR16], R88",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R88, R8, gdesc[UR18], R88, gsb0",
             *src,
             *[f"F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R{16 + r}, R{61 + 2 * r}, R{60 + 2 * r}, RZ"
               for r in range(4)],
             "QGMMA.64x64x32.F32.E4M3.E4M3 R120, R16, gdesc[UR20], R120",
             "QGMMA.64x64x32.F32.E4M3.E4M3 R120, R16, gdesc[UR22], R120, gsb0",
             "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
    return "\n".join(f"        /*{16 * i:04x}*/ {ln} ;" for i, ln in enumerate("\n".join(lines).splitlines()))


def test_dkdv_operand_check_on_hand_written_tiles():
    """check_dkdv_operands tells the tiles apart: dV's MMA from S^T alone (P8) and dK's from S^T and dP^T (dS8) is
    the plain loop; dK's from registers carried into the tile is the pipelined one; dK's from the fresh dP^T
    accumulator alone (the pipelined kernel as ptxas 13 compiled it) is wrong either way."""
    mod = _load()
    for dk_from, kinds, ok_plain, ok_pipe in (("dS", ["P8", "dS8"], True, False),
                                               ("carried", ["P8", "carried"], False, True),
                                               ("dP", ["P8", "wrong"], False, False)):
        tiles = mod.mma_operands(_tile_sass(dk_from))
        assert len(tiles) == 1 and sorted({mod.operand_kind(t[3]) for t in tiles[0]}) == kinds, (dk_from, tiles)
        assert (not mod.check_dkdv_operands(tiles, pipe=False)) == ok_plain, dk_from
        assert (not mod.check_dkdv_operands(tiles, pipe=True)) == ok_pipe, dk_from
    assert mod.check_dkdv_operands([], pipe=False) == ["no dK/dV tile found in the SASS"]


@pytest.mark.parametrize("form", ["on", "fresh"])
def test_pipelined_dkdv_operands_by_ptxas(form):
    """The dK/dV kernel's pipelined dK MMA (plan pin dkdv_pipe) compiled for sm_90 on the full mask at D=128 with
    the installed Triton. Its first form (dP^T's MMA into the registers that carried dS^T) checks out with a CUDA 12
    ptxas (Triton 3.6, 3.7) and not with CUDA 13's (Triton 3.9), which is why the plan uses the second there (a
    fresh dP^T accumulator), which checks out with both, and no serialized wgmma. Should a later ptxas compile the
    first form right, this fails and toolchain.PIPE_PTXAS_BELOW can go."""
    from hf_deltamatch.kernels import toolchain
    stdout = _compile("--d", "128", "--full", "--kernels", "hopper", "--operands", "--dkdv-pipe", form)
    broken = form == "on" and toolchain.sm90_ptxas_major() >= toolchain.PIPE_PTXAS_BELOW
    assert ("operands: WRONG" if broken else "operands: ok") in stdout, stdout
    if form == "fresh":
        assert "wgmma serialized: no" in stdout, stdout


def test_quantization_pass_with_the_outlier_transforms_compiles_for_sm90():
    """The q/k quantization pass with the fused outlier transforms (kernels/quantize.py, kernels/transform.py) at
    D=128: the rotation on the tensor cores (a bf16 wgmma), no spills, and each variant's instruction count
    printed for docs/numerics.md's cost account."""
    kinds = ["quantize", "quantize_rotate", "quantize_center", "quantize_both", "center_rotate"]
    stdout = _compile("--d", "128", "--kernels", ",".join(kinds))
    rows = {ln.split()[1]: ln for ln in stdout.splitlines() if ln.startswith("{")}
    assert sorted(rows) == sorted(kinds), stdout
    for name, ln in rows.items():
        assert "spill=0B" in ln and "instructions=" in ln, ln
        rotates = name in ("quantize_rotate", "quantize_both", "center_rotate")
        assert ("HGMMA.64x128x16.F32.BF16" in ln) == rotates, ln


def test_hash_records_the_default_launches():
    """--hash's launch recorder (record_launches) catches what ops.forward / ops.backward launch, without a GPU:
    the Gluon kernels for their case (D=128, N = 8192, fp8, on the H200's sm_90 with Triton 3.6), the Triton dQ
    kernel for the stale delta there, at N = 8000 the Gluon kernels' padded variant (VARLEN) by default and the Triton
    kernels where pinned, causal and full, with the Triton backward there for the stale delta (the padded layout: both
    Gluon kernels or neither), the Triton kernels in bf16, and at D=256 dK/dV in two launches of the Gluon kernel
    (dV, then dK) after the Triton forward and dQ kernels where those are pinned; with the constexprs the kernels
    get."""
    stdout = _record(
        "triton = {'pins': dict(fwd_kernel='triton', dq_kernel='triton', dkdv_kernel='triton')}\n"
        "for name in ('d128-causal-h4:4-n8192-fp8-matching', 'd128-causal-h4:4-n8192-fp8-stale',\n"
        "             'd128-full-h16:4-n8000-fp8-matching', 'd64-causal-h4:4-n8000-bf16-matching',\n"
        "             'd256-causal-triton-fwd-dq', 'd128-causal-h16:4-n8000-fp8-matching',\n"
        "             'd64-causal-h4:4-n8000-fp8-stale'):\n"
        "    for tag, case in (('', cases[name]), ('triton:', {**cases[name], **triton})):\n"
        "        print(tag + name, [(S.KERNELS[fn.__name__], cx.get('PART'), cx.get('FP8'), cx.get('VARLEN'))\n"
        "                           for fn, cx, *_ in S.record_launches(case)])\n"
    )
    got = dict(ln.split(" ", 1) for ln in stdout.splitlines())
    # (kernel, PART, FP8, VARLEN): the Gluon kernels have no FP8 constexpr, the Triton ones no VARLEN here
    gluon_dense = [("hopper_fwd", None, None, False), ("hopper_dq", None, None, False), ("hopper", 0, None, False)]
    gluon_padded = [("hopper_fwd", None, None, True), ("hopper_dq", None, None, True), ("hopper", 0, None, True)]
    triton_fp8 = [("fwd", None, True, False), ("dq", None, True, False), ("dkdv", 0, True, False)]
    triton_bf16 = [("fwd", None, False, False), ("dq", None, False, False), ("dkdv", 0, False, False)]
    assert got["d128-causal-h4:4-n8192-fp8-matching"] == str(gluon_dense)
    assert got["d128-causal-h4:4-n8192-fp8-stale"] == str([gluon_dense[0], triton_fp8[1], gluon_dense[2]])
    assert got["d64-causal-h4:4-n8000-bf16-matching"] == got["triton:d64-causal-h4:4-n8000-bf16-matching"] == \
        str(triton_bf16)
    assert got["d256-causal-triton-fwd-dq"] == str([*triton_fp8[:2], ("hopper", 1, None, False),
                                                   ("hopper", 2, None, False)])
    assert got["triton:d256-causal-triton-fwd-dq"] == str([*triton_fp8[:2], ("dkdv", 1, True, False),
                                                           ("dkdv", 2, True, False)])
    for name in ("d128-full-h16:4-n8000-fp8-matching", "d128-causal-h16:4-n8000-fp8-matching"):
        assert got[name] == str(gluon_padded) and got["triton:" + name] == str(triton_fp8)
    assert got["d64-causal-h4:4-n8000-fp8-stale"] == str([gluon_padded[0], *triton_fp8[1:]])
    assert got["triton:d64-causal-h4:4-n8000-fp8-stale"] == str(triton_fp8)
    assert got["triton:d128-causal-h4:4-n8192-fp8-matching"] == str(triton_fp8)


@pytest.mark.parametrize("dims", [["--d", "256"], ["--d", "256", "--full"], ["--d", "256", "--groups", "4"],
                                  ["--d", "192", "--dv", "128"]], ids=["d256", "d256-full", "d256-gqa", "mla"])
def test_gluon_forward_wide_compiles_for_sm90(dims):
    """The Gluon forward at D=256 (two MMA warpgroups of configs.FWD_HOPPER_WIDE_REGS: O alone is 128 registers per
    thread) and MLA's Dqk=192 / Dv=128 (three, q and k read 256 wide) compiles for sm_90 within the SM's 227 KB of
    shared memory, its P8 V MMA 256 wide at Dv = 256, no serialized wgmma, and no spills with Triton 3.6 (the
    version the Gluon kernels run with: kernels/toolchain.py); with 3.9 MLA spills 16-32 bytes, as the
    three-warpgroup forward does at D=128 there."""
    import triton
    stdout = _compile("--kernels", "hopper_fwd", *dims)
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 1, stdout
    ln = rows[0]
    assert "wgmma serialized: no" in ln and "QGMMA.64x128x32.F32.E4M3.E4M3" in ln, ln
    assert ("QGMMA.64x256x32.F32.E4M3.E4M3" in ln) == ("256" in dims[1]), ln
    assert int(re.search(r"smem=(\d+)", ln).group(1)) <= 227 * 1024, ln
    allowed = 0 if triton.__version__.startswith("3.6") or "256" in dims[1] else 32
    assert int(re.search(r"spill=(\d+)B", ln).group(1)) <= allowed, ln


@pytest.mark.parametrize("dims", [["--d", "256"], ["--d", "256", "--groups", "4"], ["--d", "192", "--dv", "128"]],
                         ids=["d256", "d256-gqa", "mla"])
@pytest.mark.parametrize("part", ["1", "2"])
def test_gluon_dkdv_wide_compiles_for_sm90(dims, part):
    """The Gluon dK/dV kernel at D=256 and MLA's Dqk=192 / Dv=128 (configs.GLUON_WIDE_DIMS), each of its two
    launches (PART 1: dV alone, P8 dO8 MMAs Dv wide; PART 2: dK alone, dS8 q8 MMAs 256 wide, Dqk in a power-of-two
    box), compiles for sm_90 within the SM's 227 KB of shared memory, no serialized wgmma. Spills, compiled on a CPU
    machine: with Triton 3.6 none but in the dK launch with GQA (40 bytes for MLA, 64 at D=256: the scales loaded a
    tile ahead beside dK's 128 registers per thread, S^T and dP^T); with 3.9 none in the dV launch and 24-128 bytes
    in the dK one. On the H200 (Triton 3.6, causal, no GQA) the two launches took 0.57x (D=256) and 0.51x (MLA) the
    Triton dK/dV kernels' time."""
    import triton
    stdout = _compile("--kernels", "hopper", "--part", part, *dims)
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 1, stdout
    ln = rows[0]
    assert "wgmma serialized: no" in ln, ln
    mma = "QGMMA.64x256x32.F32.E4M3.E4M3" if part == "2" or "256" in dims[1] else "QGMMA.64x128x32.F32.E4M3.E4M3"
    assert mma in ln and "QGMMA.64x64x32.F32.E4M3.E4M3" in ln, ln
    assert int(re.search(r"smem=(\d+)", ln).group(1)) <= 227 * 1024, ln
    if triton.__version__.startswith("3.6"):
        allowed = 64 if part == "2" and "--groups" in dims else 0
    else:
        allowed = 0 if part == "1" else 128
    assert int(re.search(r"spill=(\d+)B", ln).group(1)) <= allowed, ln


@pytest.mark.parametrize("dims", [["--d", "256"], ["--d", "256", "--full"], ["--d", "192", "--dv", "128"]],
                         ids=["d256", "d256-full", "mla"])
@pytest.mark.parametrize("half", ["1", "2"])
def test_gluon_dq_wide_compiles_for_sm90(dims, half):
    """The Gluon dQ kernel at D=256 and MLA's Dqk=192 / Dv=128 (configs.GLUON_WIDE_DIMS), each of its two launches
    (HALF 1: the correction pass and dQ's first 128 columns; HALF 2: the last 128, delta read), compiles for sm_90:
    its dQ MMAs 128 wide (as at D=128), no serialized wgmma, within the SM's 227 KB of shared memory (229712 bytes at
    D=256 with 2 stages), and spills: none with Triton 3.6 (the Gluon kernels' version), at most 8 bytes with 3.9."""
    import triton
    stdout = _compile("--kernels", "hopper_dq", "--part", half, *dims)
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 1, stdout
    ln = rows[0]
    assert "wgmma serialized: no" in ln and "QGMMA.64x128x32.F32.E4M3.E4M3" in ln and "64x256" not in ln, ln
    assert int(re.search(r"smem=(\d+)", ln).group(1)) <= 227 * 1024, ln
    allowed = 0 if triton.__version__.startswith("3.6") else 8
    assert int(re.search(r"spill=(\d+)B", ln).group(1)) <= allowed, ln


def test_hash_records_the_wide_forward():
    """--hash's cases at D=256 and MLA's 192/128: the Gluon forward launches (two warpgroups at Dv = 256, three at
    Dv = 128; HEAD_D is Dv), then the Gluon dQ kernel twice (dQ's column halves: HALF 1, 2) and the Gluon dK/dV kernel
    twice (dV, then dK: PART 1, 2; q/k boxes of 256, Dqk and Dv as given) with the very constexprs they get after
    the Triton forward (pinned: the backward reads the same saved tensors either way), and the pin is gone after."""
    stdout = _record(
        "for name in ('d256-causal-fp8', 'd256-full-h16:4', 'mla-192:128-causal'):\n"
        "    base = {**cases[name], 'pins': {'fwd_kernel': 'triton'}}\n"
        "    for tag, case in (('wide', cases[name]), ('base', base)):\n"
        "        got = [(S.KERNELS[fn.__name__], sorted(cx.items())) for fn, cx, *_ in S.record_launches(case)]\n"
        "        print(tag, name, repr(got), plan.PINS or configs.TUNE)\n"
    )
    got = {}
    for ln in stdout.splitlines():
        tag, name, rest = ln.split(" ", 2)
        launches, left = rest.rsplit(" ", 1)
        assert left == "{}", ln
        got[tag, name] = eval(launches)  # noqa: S307  (our own subprocess's repr)
    for name, (dv, nwg) in (("d256-causal-fp8", (256, 2)), ("d256-full-h16:4", (256, 2)),
                            ("mla-192:128-causal", (128, 3))):
        wide, base = got["wide", name], got["base", name]
        assert [k for k, _ in wide] == ["hopper_fwd", "hopper_dq", "hopper_dq", "hopper", "hopper"], wide
        assert [k for k, _ in base] == ["fwd", "hopper_dq", "hopper_dq", "hopper", "hopper"], base
        cx = dict(wide[0][1])
        assert cx["HEAD_D"] == dv and cx["NWG"] == nwg and not cx["VARLEN"], cx
        assert [dict(c)["HALF"] for _, c in wide[1:3]] == [1, 2], wide[1:3]
        parts = [dict(c) for _, c in wide[3:]]
        assert [(c["PART"], c["HEAD_D"], c["DQK"], c["HEAD_DV"], c["WGS"]) for c in parts] == \
            [(p, 256, 256 if dv == 256 else 192, dv, 2) for p in (1, 2)], parts
        assert wide[1:] == base[1:], name


def test_hash_records_the_window_launches():
    """record_launches on the sliding-window cases: a causal window takes the three Gluon kernels with HAS_WINDOW,
    dense (N = 8192), ragged (N = 8000: their padded variant) and packed, with the dK/dV kernel's pairs, peeled
    diagonal and pipelined dK MMA off, and the Triton kernels with HAS_WINDOW where pinned; the unwindowed Gluon
    launches have HAS_WINDOW off, and no pin is left after."""
    stdout = _record(
        "for name in ('d128-window-triton', 'd128-window-h4:4-n8192', 'd64-window-h16:4-n8000',\n"
        "             'd128-window-packed', 'd128-causal-h4:4-n8192-fp8-matching'):\n"
        "    print(name, [(S.KERNELS[fn.__name__], cx.get('HAS_WINDOW'), cx.get('VARLEN'),\n"
        "                  (cx.get('PAIRS'), cx.get('PEEL'), cx.get('PIPE')))\n"
        "                 for fn, cx, *_ in S.record_launches(cases[name])], dict(plan.PINS))\n"
    )
    got = dict(ln.split(" ", 1) for ln in stdout.splitlines())
    none = (None, None, None)
    assert got["d128-window-triton"] == str([("fwd", True, False, none), ("dq", True, False, none),
                                             ("dkdv", True, False, none)]) + " {}"
    for name, varlen in (("d128-window-h4:4-n8192", False), ("d64-window-h16:4-n8000", True),
                         ("d128-window-packed", True)):
        want = [("hopper_fwd", True, varlen, none), ("hopper_dq", True, varlen, (None, None, False)),
                ("hopper", True, varlen, (False, False, 0))]
        assert got[name] == str(want) + " {}", (name, got[name])
    plain = eval(got["d128-causal-h4:4-n8192-fp8-matching"].rsplit(" {", 1)[0])  # noqa: S307  (our own output)
    assert [k[:2] for k in plain] == [("hopper_fwd", False), ("hopper_dq", False), ("hopper", False)]


@pytest.mark.parametrize("variant", [[], ["--varlen"]], ids=["dense", "packed"])
def test_gluon_window_kernels_compile_for_sm90_on_the_cpu(variant):
    """The Gluon kernels' sliding-window variants (HAS_WINDOW) at D=128, dense and packed,
    compile for sm_90 with the installed Triton: no serialized wgmma, the dK/dV kernel's MMA operands right
    (check_dkdv_operands on its plain loop: no pairs, peel or pipe with a window), and spills within bounds. With
    Triton 3.6, which the Gluon kernels run with: the dQ kernel 8 bytes dense and 16 packed (0 without a window: the
    masked edge loop of each pass adds live values), none in the forward or dK/dV. With 3.9 (not run by default:
    kernels/toolchain.py) the forward 72, the dQ kernel 208 dense and 88 packed, dK/dV none."""
    import triton
    stdout = _compile("--d", "128", "--kernels", "hopper,hopper_dq,hopper_fwd", "--operands", "--window", *variant,
                      timeout=900)
    rows = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(rows) == 3, stdout
    assert "operands: ok" in stdout, stdout
    packed = bool(variant)
    if triton.__version__.startswith("3.6"):
        allowed = {"hopper_fwd": 0, "hopper_dq": 16 if packed else 8, "hopper": 0}
    else:
        allowed = {"hopper_fwd": 72, "hopper_dq": 88 if packed else 208, "hopper": 0}
    for ln in rows:
        assert "QGMMA.64x128x32.F32.E4M3.E4M3" in ln and "wgmma serialized: no" in ln, ln
        spill = int(re.search(r"spill=(\d+)B", ln).group(1))
        assert spill <= allowed[ln.split()[1]], ln
