"""Where window128's fwd+bwd time goes: one profiled fwd+bwd per window, kernel CUDA time by name."""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from hf_deltamatch import DeltaMatchConfig, deltamatch_attention
from triton.testing import do_bench

B, H, N, D = 2, 16, 8192, 128
torch.manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
cfg = DeltaMatchConfig(precision="fp8", delta="matching")
for window in [int(w) for w in (sys.argv[1] if len(sys.argv) > 1 else "128,4096,0").split(",")]:
    w = window or None
    def fb():
        out = deltamatch_attention(q, k, v, causal=True, window=w, config=cfg)
        out.backward(do)
    def f():
        with torch.no_grad():
            deltamatch_attention(q, k, v, causal=True, window=w, config=cfg)
    fb(); torch.cuda.synchronize()
    t_fb = do_bench(fb, warmup=20, rep=200)
    t_f = do_bench(f, warmup=20, rep=200)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fb()
        torch.cuda.synchronize()
    print(f"== window {w}: fwd+bwd {t_fb:.3f} ms, fwd {t_f:.3f} ms (do_bench median); kernels per fwd+bwd (5 calls / 5):")
    rows = []
    for e in prof.key_averages():
        ct = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if ct > 0 and e.count >= 1:
            rows.append((ct / 5 / 1000, e.count // 5, e.key))
    rows.sort(reverse=True)
    tot = sum(r[0] for r in rows)
    for ms, cnt, name in rows[:20]:
        print(f"  {ms:8.3f} ms  x{cnt:<3d} {name[:110]}")
    print(f"  {tot:8.3f} ms  total kernel time")
