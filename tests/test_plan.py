"""kernels/plan.py: which kernels run for an input and how they launch, as a table Case -> Plan.

Host logic, so it runs here as on an H200 (sm_90, Triton 3.6, CUDA 12.8's ptxas): `h200` answers the device and
toolchain questions as there. The kernels themselves are held to the contract elsewhere (tests/test_kernels.py under
the interpreter, tests/test_kernels_gpu.py on the H200); tests/test_launch_trace.py holds every launch of the default
plans to the record of the tree whose GPU tests last passed.
"""

import logging
import subprocess
import sys
import warnings

import pytest
import torch

from hf_deltamatch import _varlen
from hf_deltamatch.config import DeltaMatchConfig

pytest.importorskip("hf_deltamatch.kernels")
from hf_deltamatch.kernels import _fp8, toolchain  # noqa: E402
from hf_deltamatch.kernels import configs as C
from hf_deltamatch.kernels import plan as P


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(P, "SIMULATE_SM90", True)
    monkeypatch.setattr(_fp8, "INTERPRET", False)
    monkeypatch.setattr(toolchain, "current", lambda: toolchain._toolchain("3.6.0", ""))
    monkeypatch.setattr(toolchain, "sm90_ptxas_major", lambda: 12)
    P.select.cache_clear()
    yield
    P.select.cache_clear()


def plan_of(B=2, hq=16, hkv=None, n=8192, m=None, d=128, dv=None, causal=True, window=None, packed=None,
            row_sums=False, **config):
    meta = torch.device("meta")
    m = n if m is None else m
    q = torch.empty(B, hq, n, d, device=meta)
    k = torch.empty(B, hkv or hq, m, d, device=meta)
    v = torch.empty(B, hkv or hq, m, dv or d, device=meta)
    varlen = None
    if packed is not None:  # (query lengths, key lengths or None: the same)
        bq = tuple([0] + [sum(packed[0][:i + 1]) for i in range(len(packed[0]))])
        bk = bq if packed[1] is None else tuple([0] + [sum(packed[1][:i + 1]) for i in range(len(packed[1]))])
        cu = torch.empty(len(bq), device=meta)
        varlen = _varlen.Varlen(cu, cu, bq, bk, bq == bk)
    case = P.case_of(q, k, v, causal=causal, window=window, config=DeltaMatchConfig(**config), varlen=varlen,
                     row_sums=row_sums)
    return P.select(case)


PACKED = ([3000, 4000, 1000], None)
# id: (input, forward kernel and layout, dQ, dK/dV, a phrase of why not Gluon or None, launch options expected)
TABLE = {
    "d128-causal": (dict(), ("gluon", "dense"), "gluon", "gluon", None,
                    dict(dq=dict(pingpong=1, pipe=False, stages=3, halves=(0,)),
                         dkdv=dict(warpgroups=2, regs=240, pairs=True, peel=True, pipe=True, ahead=False))),
    "d128-full": (dict(causal=False), ("gluon", "dense"), "gluon", "gluon", None,
                  dict(dq=dict(pipe=True, stages=3), dkdv=dict(pairs=True, peel=False, pipe=True))),
    "d128-gqa": (dict(hkv=4), ("gluon", "dense"), "gluon", "gluon", None,
                 dict(dkdv=dict(pairs=True, peel=False, pipe=False, ahead=True))),
    "d64-causal": (dict(d=64, hq=32), ("gluon", "dense"), "gluon", "gluon", None,
                   dict(dq=dict(pingpong=0, pipe=False),
                        dkdv=dict(warpgroups=3, regs=160, pairs=False, peel=True, pipe=False, ahead=True))),
    "d64-full": (dict(d=64, causal=False), ("gluon", "dense"), "gluon", "gluon", None,
                 dict(dq=dict(pipe=True, stages=4))),
    "ragged-causal": (dict(n=8000), ("gluon", "ragged"), "gluon", "gluon", None,
                      dict(padded=True, dq=dict(pipe=False), dkdv=dict(pairs=False, peel=False, pipe=False))),
    "ragged-full": (dict(n=129, causal=False), ("gluon", "ragged"), "gluon", "gluon", None,
                    dict(padded=True, dq=dict(pipe=False))),
    "packed": (dict(B=1, n=8000, packed=PACKED), ("gluon", "packed"), "gluon", "gluon", None,
               dict(padded=True, dkdv=dict(pairs=False, peel=False))),
    "packed-full-mask": (dict(B=1, n=8000, packed=PACKED, causal=False), ("triton", "varlen"), "triton", "triton",
                         "a varlen batch other than causal self-attention", {}),
    "varlen-q-ne-k": (dict(B=1, n=8000, packed=([3000, 4000, 1000], [1000, 4000, 3000])), ("triton", "varlen"),
                      "triton", "triton", "a varlen batch other than causal", {}),
    "window": (dict(window=1024), ("gluon", "dense"), "gluon", "gluon", None,
               dict(dkdv=dict(pairs=False, peel=False, pipe=False))),
    "window-ragged": (dict(n=8000, window=128), ("gluon", "ragged"), "gluon", "gluon", None, dict(padded=True)),
    "window-packed": (dict(B=1, n=8000, packed=PACKED, window=1024), ("gluon", "packed"), "gluon", "gluon", None,
                      dict(padded=True)),
    "d256": (dict(d=256, hq=8), ("gluon", "dense"), "gluon", "gluon", None,
             dict(fwd=dict(warpgroups=2, regs=240), dq=dict(halves=(1, 2), pipe=False, stages=2),
                  dkdv=dict(parts=(1, 2), pipe=False, warpgroups=2, regs=240))),
    "mla": (dict(d=192, dv=128), ("gluon", "dense"), "gluon", "gluon", None,
            dict(fwd=dict(warpgroups=3, regs=160), dq=dict(halves=(1, 2)), dkdv=dict(parts=(1, 2)))),
    "d256-ragged": (dict(d=256, n=8000), ("triton", "dense"), "triton", "triton", "N not a multiple of 128 at head",
                    {}),
    "d256-window": (dict(d=256, window=512), ("triton", "dense"), "triton", "triton", "a sliding window at head", {}),
    "d256-packed": (dict(d=256, B=1, n=8000, packed=PACKED), ("triton", "varlen"), "triton", "triton",
                    "a varlen batch at head dims", {}),
    "d96": (dict(d=96), ("triton", "dense"), "triton", "triton", "Dqk = Dv in 64, 128 only", {}),
    "bf16": (dict(precision="bf16"), ("triton", "dense"), "triton", "triton", "precision='bf16'",
             dict(fwd=dict(block_m=64, warps=4, stages=3, tma=False), dq=dict(tma=False))),
    "e5m2": (dict(grad_format="e5m2"), ("gluon", "dense"), "triton", "triton", "e5m2 gradients", {}),
    "block64": (dict(block=64), ("triton", "dense"), "triton", "triton", "block=64",
                dict(fwd=dict(tma=True, asm_scales=True), dq=dict(tma=True), kv_n=64, ds_scales=True)),
    "stale": (dict(delta="stale"), ("gluon", "dense"), "triton", "gluon", "delta='stale'", {}),
    "stale-ragged": (dict(n=8000, delta="stale"), ("gluon", "ragged"), "triton", "triton", "delta='stale'",
                     dict(padded=False)),
    "row-sums-ragged": (dict(n=8000, row_sums=True), ("gluon", "ragged"), "triton", "triton",
                        "the invariant's row sums", {}),
    "row-sums-dense": (dict(row_sums=True), ("gluon", "dense"), "gluon", "gluon", None, {}),
    "cross": (dict(n=1024, m=4096, causal=False), ("triton", "dense"), "triton", "triton", "N != M", {}),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_plan_table(h200, name):
    given, (fwd_kernel, layout), dq, dkdv, why, launch = TABLE[name]
    p = plan_of(**given)
    assert (p.forward.kernel, p.forward.layout) == (fwd_kernel, layout), p.forward
    assert (p.backward.dq, p.backward.dkdv) == (dq, dkdv), p.backward
    reasons = [r for r in (p.forward.why_not_gluon, p.backward.why_not_gluon) if r]
    if why is None:
        assert not reasons, reasons
    else:
        assert any(why in r for r in reasons), reasons
    for key, want in launch.items():
        if key in ("fwd", "dq", "dkdv"):
            got = {"fwd": p.forward.launch, "dq": p.backward.dq_launch, "dkdv": p.backward.dkdv_launch}[key]
            assert {k: got[k] for k in want} == want, (key, got)
        else:
            assert getattr(p.backward, key) == want, (key, p.backward)


def test_plan_grids_and_ds_tiles(h200):
    """The grids: the Gluon kernels' programs of 64 rows per MMA warpgroup, the causal head groups; the dS tile
    scales' shape (dense: N / 64 + nseq rows; padded: the padded layout's rows)."""
    p = plan_of()
    assert p.forward.grid == (43 * 32, 1, 1) and p.forward.head_group == C.HEAD_GROUP_CAUSAL["fwd"]
    assert p.backward.dq_grid == ((64 * 32, 1, 1), 64, 8) and p.backward.dkdv_grid == ((64 * 32, 1, 1), 64, 4)
    assert p.backward.dss_shape == (8192 // 64 + 1, 64)
    p = plan_of(B=1, n=8000, packed=PACKED)
    npad = 3072 + 4096 + 1024
    assert p.backward.dss_shape == (npad // 64, npad // 128) and p.forward.grid[2] == 3
    assert plan_of(causal=False).backward.dq_grid[2] == 1  # the full mask: head by head


def test_pins(h200):
    assert plan_of().forward.kernel == "gluon"
    with P.pinned(fwd_kernel="triton", dq_kernel="triton", dkdv_kernel="triton"):
        p = plan_of()
        assert (p.forward.kernel, p.backward.dq, p.backward.dkdv) == ("triton",) * 3
        assert "pinned" in p.forward.why_not_gluon
    assert plan_of().forward.kernel == "gluon" and not P.PINS  # restored, and a new Case
    with P.pinned(fwd_kernel="gluon"), pytest.raises(ValueError, match="precision='bf16'"):
        plan_of(precision="bf16")
    with P.pinned(dkdv_kernel="gluon"), pytest.raises(ValueError, match="together"):
        plan_of(n=8000, delta="stale")  # padded: both Gluon kernels or neither
    with P.pinned(dkdv_pairs=False):
        assert not plan_of(causal=False).backward.dkdv_launch["pairs"]
    with P.pinned(dkdv_pairs=True), pytest.raises(ValueError, match="packed or ragged"):
        plan_of(n=8000)
    with P.pinned(dkdv_peel=True), pytest.raises(ValueError, match="without GQA"):
        plan_of(hkv=4)
    with P.pinned(dkdv_pipe=True), pytest.raises(ValueError, match="two MMA warpgroups"):
        plan_of(d=64)
    with P.pinned(dkdv_pairs=True), pytest.raises(ValueError, match="sliding window"):
        plan_of(window=128)
    triton = dict(fwd_kernel="triton", dq_kernel="triton", dkdv_kernel="triton")
    with P.pinned(fwd_tma=False, dq_tma=False), P.pinned(**triton):
        p = plan_of()
        assert not p.forward.launch["tma"] and not p.backward.dq_launch["tma"]
    with P.pinned(lse2=False):
        assert "LSE2" in plan_of().backward.why_not_gluon
    with pytest.raises(KeyError, match="hopper_window"):
        with P.pinned(hopper_window=False):
            pass
    with pytest.raises(ValueError, match="choose one of"):
        with P.pinned(fwd_kernel="fast"):
            pass


def test_variant_sends_each_key_to_one_place(h200):
    """plan.variant (the benchmarks' --variants) splits one dict into plan pins and TUNE launch shapes: the two
    vocabularies share no key, so no setting lands in both; both come back after, and an unknown key raises."""
    assert not set(P.PIN_CHOICES) & C.TUNE_KEYS
    with P.variant({"dq_kernel": "triton", "dq": (64, 4, 3)}):
        p = plan_of()
        assert p.backward.dq == "triton" and p.backward.dq_launch["block_m"] == 64
        assert P.PINS == {"dq_kernel": "triton"} and C.TUNE == {"dq": (64, 4, 3)}
    assert not P.PINS and not C.TUNE
    with pytest.raises(KeyError, match="hopper_ragged"):
        with P.variant({"hopper_ragged": False}):
            pass


def test_dkdv_loop_variants_follow_tune(h200, monkeypatch):
    """TUNE's dkdv_hopper_wgs moves D=64 to two warpgroups: pairs and the pipelined dK MMA follow (the pipelined MMA
    needs two); a ptxas of CUDA 13 turns the pipelined MMA off unless pinned, and then with a fresh accumulator."""
    monkeypatch.setitem(C.TUNE, "dkdv_hopper_wgs", (2, 240))
    cfg = plan_of(d=64).backward.dkdv_launch
    assert (cfg["warpgroups"], cfg["pairs"], cfg["pipe"]) == (2, True, True)
    monkeypatch.delitem(C.TUNE, "dkdv_hopper_wgs")
    monkeypatch.setattr(toolchain, "sm90_ptxas_major", lambda: 13)
    P.select.cache_clear()
    cfg = plan_of().backward.dkdv_launch
    assert not cfg["pipe"] and not cfg["fresh_dp"]
    with P.pinned(dkdv_pipe=True):
        cfg = plan_of().backward.dkdv_launch
        assert cfg["pipe"] and cfg["fresh_dp"]
    from hf_deltamatch.kernels.dkdv_hopper import pipe_mode
    assert pipe_mode(cfg["pipe"], cfg["fresh_dp"]) == 2


def test_select_is_cached_per_case_and_tune(h200, monkeypatch):
    assert plan_of() is plan_of()
    first = plan_of()
    monkeypatch.setitem(C.TUNE, "dq_hopper_stages", 2)
    assert plan_of() is not first and plan_of().backward.dq_launch["stages"] == 2
    monkeypatch.setitem(C.TUNE, "bwd_tma", False)
    with pytest.raises(KeyError, match="bwd_tma"):
        plan_of(n=4096)


def test_no_gluon_off_sm90_or_in_the_interpreter(h200, monkeypatch):
    monkeypatch.setattr(P, "_device", lambda device: ("cuda", (10, 0)))
    assert "compute capability 10.0" in plan_of().forward.why_not_gluon
    monkeypatch.setattr(P, "SIMULATE_SM90", False)
    monkeypatch.setattr(P, "_device", lambda device: ("cpu", None))
    assert "device cpu" in plan_of(n=4096).forward.why_not_gluon
    monkeypatch.setattr(_fp8, "INTERPRET", True)
    assert "TRITON_INTERPRET=1" in plan_of(n=2048).forward.why_not_gluon


def test_untested_triton_release(h200, monkeypatch):
    """A Triton release the GPU tests have not passed with: the Triton kernels, one warning per process naming the
    tested releases and HF_DELTAMATCH_GLUON=1, which runs the Gluon kernels anyway; =0 keeps them off."""
    monkeypatch.setattr(toolchain, "current", lambda: toolchain._toolchain("99.1.0", ""))
    toolchain._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan_of()
        plan_of(n=4096)
    assert p.forward.kernel == p.backward.dq == p.backward.dkdv == "triton"
    assert "HF_DELTAMATCH_GLUON=1 overrides" in p.forward.why_not_gluon
    msgs = [str(w.message) for w in caught]
    assert len(msgs) == 1 and "99.1.0" in msgs[0] and "3.6.x" in msgs[0] and "HF_DELTAMATCH_GLUON=1" in msgs[0]
    monkeypatch.setattr(toolchain, "current", lambda: toolchain._toolchain("99.1.0", "1"))
    assert plan_of().forward.kernel == "gluon"
    monkeypatch.setattr(toolchain, "current", lambda: toolchain._toolchain("3.6.0", "0"))
    assert plan_of().forward.kernel == "triton"


def test_toolchain_releases():
    """One record per Triton release the GPU tests passed with; release prefixes ("3.6" holds every 3.6.x, "3.7.1"
    that release only); untested releases warn with what to run."""
    assert [toolchain.listed(v) for v in ("3.6.0", "3.6.1+git1234", "3.60.0", "3.7.0", "3.7.1", "3.7.10", "3.9.0",
                                          "3.8.0")] == ["3.6", "3.6", None, None, "3.7.1", None, "3.9", None]
    t36, t371, t39 = (toolchain._toolchain(v, "") for v in ("3.6.0", "3.7.1", "3.9.0"))
    assert (t36.fused_token_major, t36.fused_padded_token_major) == (True, True)
    assert (t371.fused_token_major, t371.fused_padded_token_major) == (False, False)
    assert (t39.fused_token_major, t39.fused_padded_token_major) == (False, True)
    assert all(t.gluon and t.tested for t in (t36, t371, t39))
    untested = toolchain._toolchain("3.7.0", "")
    assert not untested.gluon and not untested.tested and not untested.fused_token_major
    assert toolchain.untested_text("3.9.1") is None
    msg = toolchain.untested_text("3.7.0")
    assert "3.7.0" in msg and "pytest -m gpu" in msg and "backend='reference'" in msg
    with pytest.raises(ValueError, match="HF_DELTAMATCH_GLUON"):
        toolchain._toolchain("3.6.0", "yes")


def test_sm90_ptxas_major_reads_the_version():
    try:
        major = toolchain.sm90_ptxas_major()
    except (FileNotFoundError, RuntimeError) as e:
        pytest.skip(f"this Triton install lacks a runnable ptxas: {e}")
    assert major >= 12


def test_dispatch_log_once_per_kind_of_input(monkeypatch, caplog):
    """At DEBUG on the "hf_deltamatch" logger, which kernels a call takes and why not the Gluon ones, once per kind of
    input (another N of the same kind logs nothing; another mask does); nothing while DEBUG is off, and the input
    still logs once it is on."""
    from hf_deltamatch import kernels as K

    monkeypatch.setattr(P, "_LOGGED", set())
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def call(N, causal=True):
        q, k, v, do = (torch.randn(1, 1, N, 16, generator=g).to(torch.bfloat16).to(dev) for _ in range(4))
        kw = dict(causal=causal, softmax_scale=0.25, window=None, cu_seqlens_q=None, cu_seqlens_k=None,
                  config=DeltaMatchConfig())
        f = K.forward(q, k, v, **kw)
        K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)

    def lines():
        return [r.getMessage() for r in caplog.records if r.name == "hf_deltamatch"]

    with caplog.at_level(logging.INFO, logger="hf_deltamatch"):
        call(72)
    assert lines() == []
    with caplog.at_level(logging.DEBUG, logger="hf_deltamatch"):
        call(72)
        call(72)
        call(40)  # another N not a multiple of 128: the same kind of input
        assert len(lines()) == 2, lines()
        fwd, bwd = lines()
        assert fwd.startswith("kernels forward: Triton for fp8 D=16/16, causal, a dense batch, N = M not a multiple "
                              "of 128 (not Gluon: "), fwd
        assert bwd.startswith("kernels backward: dQ Triton, dK/dV Triton for fp8 D=16/16, causal"), bwd
        if dev == "cpu":
            assert "TRITON_INTERPRET=1" in fwd and "TRITON_INTERPRET=1" in bwd
        call(72, causal=False)
        assert len(lines()) == 4 and "full mask" in lines()[2], lines()


def _cli(*args) -> str:
    res = subprocess.run([sys.executable, "-m", "hf_deltamatch.cli", "plan", *args], capture_output=True, text=True,
                         check=True)
    assert res.stderr == "", res.stderr
    return res.stdout


def test_plan_cli():
    """`hf-deltamatch plan`: the plan as on the H200 (sm_90, Triton 3.6 and its CUDA 12 ptxas, under which dense
    batches without GQA take the pipelined dK MMA), whatever this machine has, and nothing on stderr."""
    out = _cli("--shape", "2,16,8192,128")
    assert "forward: Gluon, dense layout" in out and "'pipe': True" in out and "Triton 3.6.0" in out, out
    out = _cli("--shape", "2,16,8000,128")
    assert "forward: Gluon, ragged layout" in out and "dQ Gluon" in out and "padded layout" in out, out
    out = _cli("--shape", "1,16,8000,64", "--packed", "3000,5000", "--delta", "stale")
    assert "forward: Gluon, packed layout" in out and "not Gluon: delta='stale'" in out, out
