"""Does Triton's automatic warp specialization (tl.range(..., warp_specialize=True)) take a minimal FP8
attention forward on Hopper? Compiles for sm_90 on the CPU (no GPU needed) and prints, per variant, the warps of
the compiled kernel, its warp_specialize regions and setmaxnreg count, or the compiler's error.

  PYTHONPATH=<triton install> python hopper-ws-compile-probe-20261129.py

Session 7 (2026-11-29), q read through a descriptor inside the loop (q_desc=True) or through pointers before it:
- Triton 3.6 specializes the 128-row, 4-warp, q_desc variants into 12 warps with setmaxnreg. On the H200 such
  kernels never finished (sessions 3 and 5).
- Triton 3.9 fails those in NVGPUWarpSpecialization: the data partitioning halves q's load but not its
  descriptor block. The 64-row variant compiles into two consumer partitions that both compute and store the
  same tile rather than halves of it.
- q through pointers before the loop fails in both (Triton 3.9 with MLIR_ENABLE_DIAGNOSTICS=warnings says
  "capturing tensor values into warp partitions is not supported").
"""
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

D = 128


@triton.jit
def _probe_fwd(Q, Kd, Vd, O, qk_scale, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
               WS: tl.constexpr, Q_DESC: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = bh * N + pid_m * BLOCK_M
    if not Q_DESC:
        q = tl.load(Q + (row0 + tl.arange(0, BLOCK_M))[:, None] * D + tl.arange(0, D)[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start_n in tl.range(0, N, BLOCK_N, warp_specialize=WS):
        if Q_DESC:  # inside the loop: a tensor captured from outside cannot enter a partition
            q = Q.load([row0, 0])
        k = Kd.load([bh * N + start_n, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.exp2(s * qk_scale - m_new[:, None] + 8.0)  # P * 256
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        vt = Vd.load([bh * D, start_n])  # V^T tile: K-major for the FP8 P @ V
        acc = tl.dot(p.to(tl.float8e4nv), vt.T, acc)
        m_i = m_new
    acc = acc / l_i[:, None]
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(O + (bh * N + offs_m[:, None]) * D + tl.arange(0, D)[None, :], acc.to(tl.bfloat16))


def main():
    print("triton", triton.__version__)
    for q_desc in (False, True):
        for bm, w, st, ws in [(64, 4, 2, True), (128, 4, 2, True), (128, 4, 3, True), (128, 8, 2, True),
                              (64, 4, 3, False)]:
            sig = {"Q": ("tensordesc<fp8e4nv[%d, %d]>" % (bm, D)) if q_desc else "*fp8e4nv",
                   "Kd": "tensordesc<fp8e4nv[128, %d]>" % D, "Vd": "tensordesc<fp8e4nv[%d, 128]>" % D, "O": "*bf16",
                   "qk_scale": "fp32", "N": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "D": "constexpr",
                   "WS": "constexpr", "Q_DESC": "constexpr"}
            src = ASTSource(fn=_probe_fwd, signature=sig,
                            constexprs={"BLOCK_M": bm, "BLOCK_N": 128, "D": D, "WS": ws, "Q_DESC": q_desc},
                            attrs={(0,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]],
                                   (5,): [["tt.divisibility", 16]]})
            tag = f"q_desc={q_desc!s:5} BLOCK_M={bm:3d} warps={w} stages={st} ws={ws!s:5}"
            try:
                c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": w, "num_stages": st})
                print(tag, "-> warps", c.metadata.num_warps, "warp_specialize regions",
                      c.asm["ttgir"].count("ttg.warp_specialize("), "setmaxnreg", c.asm["ptx"].count("setmaxnreg"),
                      flush=True)
            except Exception as e:  # noqa: BLE001  (report and go on)
                print(tag, "-> FAILED:", str(e).splitlines()[0][:120], flush=True)


if __name__ == "__main__":
    main()
