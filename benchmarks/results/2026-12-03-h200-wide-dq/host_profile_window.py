"""Where window128's host time goes: cProfile of fwd+bwd calls (host functions by own time), and the same fwd+bwd
replayed from a CUDA graph (host-free), against Flex in the same run."""
import cProfile, pstats, io, sys, torch
from hf_deltamatch import DeltaMatchConfig, deltamatch_attention
from triton.testing import do_bench

B, H, N, D = 2, 16, 8192, 128
torch.manual_seed(0)
q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_()
cfg = DeltaMatchConfig(precision="fp8", delta="matching")
for w in (128, 4096):
    def fb():
        out = deltamatch_attention(q, k, v, causal=True, window=w, config=cfg)
        out.backward(do)
    for _ in range(3):
        fb()
    torch.cuda.synchronize()
    t_fb = do_bench(fb, warmup=20, rep=200)
    # host time alone: calls queued back to back, measured on the host clock, the GPU drained after
    import time
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(50):
        fb()
    t_host = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize(); t_all = (time.perf_counter() - t0) / 50 * 1e3
    print(f"== window {w}: do_bench fwd+bwd {t_fb:.3f} ms; host per call {t_host:.3f} ms (queueing 50), "
          f"wall per call {t_all:.3f} ms")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fb()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    ps = pstats.Stats(pr, stream=s).sort_stats("tottime")
    ps.print_stats(30)
    print("\n".join(s.getvalue().splitlines()[:60]))
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
    print("\n".join(s.getvalue().splitlines()[:70]))
    # CUDA graph: static inputs, fwd+bwd captured once, replayed
    try:
        s_ = torch.cuda.Stream()
        s_.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s_):
            for _ in range(3):
                q.grad = k.grad = v.grad = None
                fb()
        torch.cuda.current_stream().wait_stream(s_)
        g = torch.cuda.CUDAGraph()
        q.grad = k.grad = v.grad = None
        with torch.cuda.graph(g):
            fb()
        g.replay(); torch.cuda.synchronize()
        t_g = do_bench(g.replay, warmup=20, rep=200)
        print(f"== window {w}: CUDA graph replay of fwd+bwd {t_g:.3f} ms")
    except Exception as e:
        print(f"== window {w}: CUDA graph capture failed: {type(e).__name__}: {str(e)[:300]}")
    q.grad = k.grad = v.grad = None
try:
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    fa = torch.compile(flex_attention)
    bm = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < 128), None, None, N, N, device="cuda")
    def ffb():
        fa(q, k, v, block_mask=bm).backward(do)
    for _ in range(3):
        ffb()
    print(f"== Flex window 128 fwd+bwd {do_bench(ffb, warmup=20, rep=200):.3f} ms")
except Exception as e:
    print(f"Flex failed: {type(e).__name__}: {str(e)[:200]}")
