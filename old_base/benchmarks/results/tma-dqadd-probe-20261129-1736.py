# The probe behind tma-dqadd-probe-20261129-1736.log; runs against commit d7670f3 (python3 THIS_FILE from the repo root).
import sys, time, torch, triton, json
sys.path.insert(0, ".")
from triton.testing import do_bench
from hf_deltamatch import kernels as K
from hf_deltamatch.config import DeltaMatchConfig
cfg = DeltaMatchConfig()
def mk(*s): return torch.randn(*s, device="cuda", dtype=torch.bfloat16)
def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()
VARS = {"base": {}, "fwdtma": {"fwd_tma": True}, "dqtma": {"dq_add": "tma"}, "dqrelax": {"dq_add": "relaxed"},
        "both": {"fwd_tma": True, "dq_add": "tma"}, "both-kv2": {"fwd_tma": True, "dq_add": "tma", "dkdv": (8, 2)}}
cases = [("d128-causal-8k", (2, 16, 16, 8192, 128, 128), True, None, None, True),
         ("d128-full-8k", (2, 16, 16, 8192, 128, 128), False, None, None, True),
         ("d64-causal-8k", (2, 32, 32, 8192, 64, 64), True, None, None, True),
         ("gqa-causal-8k", (2, 16, 4, 8192, 128, 128), True, None, None, True),
         ("tail-1000", (1, 4, 2, 1000, 128, 128), True, None, None, False),
         ("window-4k", (1, 4, 4, 4096, 128, 128), True, 1000, None, False),
         ("varlen-unaligned", (1, 8, 8, 5000, 128, 128), True, None, [0, 1000, 1037, 3333, 5000], False),
         ("mla-192-128", (1, 8, 8, 2048, 192, 128), True, None, None, False),
         ("d256", (1, 8, 8, 2048, 256, 256), True, None, None, False)]
for name, (B, H, Hk, N, D, Dv), causal, window, cu, timeit in cases:
    torch.manual_seed(0)
    q, k, v, do = mk(B, H, N, D), mk(B, Hk, N, D), mk(B, Hk, N, Dv), mk(B, H, N, Dv)
    cut = torch.tensor(cu, dtype=torch.int32, device="cuda") if cu else None
    kw = dict(causal=causal, softmax_scale=D ** -0.5, window=window, cu_seqlens_q=cut, cu_seqlens_k=cut, config=cfg)
    def step():
        f = K.forward(q, k, v, **kw)
        return f, K.backward(do, q, k, v, f[0], f[1], *f[2:], **kw)
    res = {}
    for vn, tune in VARS.items():
        K.TUNE.clear(); K.TUNE.update(tune)
        try:
            f, g = step(); torch.cuda.synchronize()
            res[vn] = (f[0], *g)
            line = f"{name:17s} {vn:9s}"
            b = res["base"]
            line += "  diff vs base out/dq/dk/dv " + " ".join(f"{rel(a, c):.1e}" for a, c in zip(res[vn], b))
            line += f"  finite {all(torch.isfinite(t).all().item() for t in res[vn])}"
            if timeit:
                tf = do_bench(lambda: K.forward(q, k, v, **kw), warmup=20, rep=150)
                tt = do_bench(step, warmup=20, rep=150)
                line += f"  fwd {tf:.3f} ms  fwd+bwd {tt:.3f} ms"
            print(line, flush=True)
        except Exception as e:
            print(name, vn, "FAILED", repr(e)[:400], flush=True)
    if timeit:
        qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))
        def sd():
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=H != Hk)
            o.backward(do)
        print(f"{name:17s} sdpa-cudnn fwd+bwd {do_bench(sd, warmup=20, rep=150):.3f} ms", flush=True)
K.TUNE.clear()
