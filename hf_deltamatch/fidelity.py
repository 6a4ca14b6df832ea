"""Gradient fidelity of FP8 attention on a real model and real text: `hf-deltamatch check --model PATH --data FILE`.

Runs a forward and backward of a local transformers causal LM on a few sequences of the user's text with every
attention layer computed exactly (float64, through a capturing attention function registered in transformers'
AttentionInterface), so the loss and every layer's upstream gradient are the true ones. Each layer's q, k, v
(after RoPE) and the gradient of its output dO are kept; then, per layer, on those operands (in bf16, fp16
for an fp16 model):
  - sink mass            mean attention probability on the sequence's first token (query rows 1..N-1)
  - max |logit|, range   largest |S_ij| and the largest per-row max_j S_ij - min_j S_ij over visible keys
  - P underflow          share of nonzero P whose P * 256 rounds to 0 in e4m3 (the forward's static P scale)
  - dQ/dK/dV errors      relative (Frobenius) error against float64 exact attention of fp8-matching, fp8-stale,
                         bf16 (this op in bf16) and SDPA (torch's scaled_dot_product_attention in bf16)
  - dS row-sum residual  ||sum_j dS_ij|| / ||sum_j |dS_ij|||, by the reference backend (the contract's dS)
  - shift residual       ||sum_j dK_j|| / ||dK||: a bias that moves every key alike (exact attention: ~0)
  - channel outliers     q's and k's largest per-channel RMS over their median channel RMS (trained LLMs carry a few
                         channels tens of times the rest: docs/numerics.md, "Outlier channels"), and k's mean over
                         the keys relative to its RMS (a bias K smoothing removes)
With `qk_transforms=True` (`--qk-transforms`), fp8-matching also runs with the outlier transforms
(DeltaMatchConfig.qk_rotation="hadamard", smooth_k=True, and both): the measurement behind choosing them for a model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from . import reference
from .attention import deltamatch_attention
from .config import DeltaMatchConfig
from .diagnostics import exact_attention
from .testing import rel_err

CAPTURE = "hf_deltamatch_capture"
MODES = ("fp8-matching", "fp8-stale", "bf16", "sdpa")
_OUR_MODES = {"fp8-matching": ("fp8", "matching"), "fp8-stale": ("fp8", "stale"), "bf16": ("bf16", "matching")}
# fp8-matching with the outlier transforms: mode -> (qk_rotation, smooth_k)
TRANSFORM_MODES = {"fp8+hadamard": ("hadamard", False), "fp8+smooth": ("none", True), "fp8+both": ("hadamard", True)}
_HEADS_PER_CHUNK = 4  # float64 score matrices of this many heads at a time (memory)


# ----------------------------------------------------------------------------------------------------
# Capture: exact attention inside the model, keeping each layer's operands and upstream gradient
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class LayerCapture:
    """One attention call: q (B, Hq, N, D), k/v (B, Hkv, M, D) after RoPE, out (B, Hq, N, Dv), dO like out."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    causal: bool
    scale: float
    window: int | None
    do: torch.Tensor | None = None


def exact_grads(q, k, v, do, causal, scale, window):
    """Float64 exact attention and its gradients (out, dq, dk, dv), a few heads at a time; GQA summed per KV head."""
    B, Hq, N, _ = q.shape
    groups = Hq // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = q.new_zeros(B, Hq, N, v.shape[-1], dtype=torch.float64)
    grads = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in (q, k, v)]
    for h0 in range(0, Hq, _HEADS_PER_CHUNK):
        h = slice(h0, h0 + _HEADS_PER_CHUNK)
        leaves = [t[:, h].double().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():
            o = exact_attention(*leaves, causal=causal, softmax_scale=scale, window=window)
        out[:, h] = o.detach()
        if do is not None:
            for g, d in zip(grads, torch.autograd.grad(o, leaves, do[:, h].double())):
                g[:, h] = d
    dq, dk, dv = grads
    dk = dk.reshape(B, Hq // groups, groups, *dk.shape[2:]).sum(dim=2)
    dv = dv.reshape(B, Hq // groups, groups, *dv.shape[2:]).sum(dim=2)
    return out, dq, dk, dv


class _ExactAttention(torch.autograd.Function):
    """Exact attention whose backward records dO; recomputes in backward so no layer keeps its scores."""

    @staticmethod
    def forward(ctx, q, k, v, rec: LayerCapture):
        out = exact_grads(q, k, v, None, rec.causal, rec.scale, rec.window)[0].to(q.dtype)
        ctx.save_for_backward(q, k, v)
        ctx.rec = rec
        rec.out = out.detach()
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        rec = ctx.rec
        rec.do = do.detach().clone()
        _, dq, dk, dv = exact_grads(q, k, v, do, rec.causal, rec.scale, rec.window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _Recorder:
    def __init__(self):
        self.layers: list[LayerCapture] = []


_ACTIVE: list[_Recorder] = []


def _capture_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                       softcap=None, is_causal=None, **kwargs):
    """transformers attention function: exact attention, recording the call (see `capture`)."""
    if not _ACTIVE:
        raise RuntimeError(f"attn_implementation={CAPTURE!r} runs only inside hf_deltamatch.fidelity.capture().")
    if attention_mask is not None or kwargs.get("cu_seq_lens_q") is not None:
        raise ValueError("the fidelity capture takes unpadded, unpacked sequences (it builds them itself).")
    if softcap is not None or kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise ValueError("the fidelity check does not cover logit softcapping or learned attention sinks (s_aux): "
                         "deltamatch_fp8 supports neither.")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    recorder = _ACTIVE[-1]
    layer = getattr(module, "layer_idx", None)
    rec = LayerCapture(layer=len(recorder.layers) if layer is None else int(layer), q=query.detach(), k=key.detach(),
                       v=value.detach(), out=None, causal=bool(causal), scale=float(scale),
                       window=sliding_window if causal else None)
    recorder.layers.append(rec)
    out = _ExactAttention.apply(query, key, value, rec)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .integrations.transformers import deltamatch_mask

    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, deltamatch_mask)  # a 2D padding mask or None, as the op takes


def _checkpoint(path) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"--model {str(path)!r} is not a local checkpoint directory (no config.json); "
                                "give a directory saved with save_pretrained (hub names are not downloaded).")
    return p


def load_model(path: str | Path, dtype=torch.bfloat16, device="cpu"):
    """A local causal LM (no hub) with the capturing attention, frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    p = _checkpoint(path)
    _register()
    model = AutoModelForCausalLM.from_pretrained(str(p), attn_implementation=CAPTURE, dtype=dtype)
    return model.to(device).eval().requires_grad_(False)


def capture(model, input_ids: torch.Tensor):
    """Forward + backward of the mean next-token CE on input_ids (B, N); returns (loss, [LayerCapture])."""
    recorder = _Recorder()
    _ACTIVE.append(recorder)
    try:
        embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_()  # a graph without weight grads
        loss = model(inputs_embeds=embeds, labels=input_ids, use_cache=False).loss
        loss.backward()
    finally:
        _ACTIVE.pop()
    missing = [r.layer for r in recorder.layers if r.do is None]
    if not recorder.layers:
        raise ValueError("the model made no attention call through transformers' attention interface.")
    if missing:
        raise RuntimeError(f"no upstream gradient reached the attention output of layers {missing}.")
    return loss.detach().float().item(), recorder.layers


# ----------------------------------------------------------------------------------------------------
# Text -> sequences
# ----------------------------------------------------------------------------------------------------


def read_documents(path: str | Path, text_field: str = "text") -> list[str]:
    """Plain text (one document per file) or JSON lines with a `text_field` per line."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--data {str(path)!r} is not a file; give a .txt or .jsonl file of text.")
    if p.suffix in (".jsonl", ".json"):
        docs = []
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or text_field not in row:
                raise ValueError(f"{p}:{i + 1}: expected a JSON object with a {text_field!r} field.")
            docs.append(str(row[text_field]))
        return [d for d in docs if d.strip()]
    return [p.read_text(encoding="utf-8")]


def make_sequences(tokenizer, docs: list[str], seq_len: int, batch: int) -> torch.Tensor:
    """(batch, seq_len) token ids. Each sequence starts at a document start (with the tokenizer's BOS if it has
    one), runs on through the following documents (EOS-separated), and sequences do not overlap."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    stream, starts = [], []
    for doc in docs:
        ids = tokenizer(doc)["input_ids"]
        if bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        starts.append(len(stream))
        stream += ids + ([eos] if eos is not None else [])
    seqs, end = [], 0
    for s in starts:
        if s >= end and s + seq_len <= len(stream):
            seqs.append(stream[s:s + seq_len])
            end = s + seq_len
            if len(seqs) == batch:
                return torch.tensor(seqs)
    raise ValueError(f"the text gives {len(seqs)} sequence(s) of {seq_len} tokens starting at a document start "
                     f"({len(stream)} tokens in {len(docs)} document(s)); need --batch {batch}. Give more text, or "
                     "a smaller --seq-len or --batch.")


# ----------------------------------------------------------------------------------------------------
# Per-layer measurements
# ----------------------------------------------------------------------------------------------------


def _score_stats(q, k, causal, scale, window) -> dict:
    """Sink mass, logit extremes and the e4m3 underflow share of P, from float64 scores."""
    B, Hq, N, _ = q.shape
    groups = Hq // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    keep = reference._visible(torch.arange(N, device=q.device), N, k.shape[2], causal, window, q.device)
    sink, max_abs, spread, nonzero, under = 0.0, 0.0, 0.0, 0, 0
    for h0 in range(0, Hq, _HEADS_PER_CHUNK):
        s = (q[:, h0:h0 + _HEADS_PER_CHUNK].double() @ k[:, h0:h0 + _HEADS_PER_CHUNK].double().transpose(-1, -2))
        s = s * scale
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        sink += p[:, :, 1:, 0].sum().item()
        max_abs = max(max_abs, s.abs().masked_fill(~keep, 0).amax().item())
        hi = s.masked_fill(~keep, float("-inf")).amax(dim=-1)
        lo = s.masked_fill(~keep, float("inf")).amin(dim=-1)
        spread = max(spread, (hi - lo)[..., 1:].amax().item()) if N > 1 else 0.0
        pos = (p > 0) & keep
        nonzero += pos.sum().item()
        under += (pos & (reference.to_fp8(p.float() * reference.P_SCALE, "e4m3").float() == 0)).sum().item()
    return {"sink_mass": sink / max(1, B * Hq * (N - 1)), "max_abs_logit": max_abs, "logit_range": spread,
            "p_underflow": under / max(1, nonzero)}


def _shift(dk: torch.Tensor) -> float:
    dk = dk.double()
    return (dk.sum(dim=2).norm() / dk.norm().clamp_min(1e-300)).item()


def _sdpa(q, k, v, causal, scale, window):
    import torch.nn.functional as F

    mask = None
    if causal and window is not None:
        n = q.shape[2]
        mask = reference._visible(torch.arange(n, device=q.device), n, k.shape[2], True, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _channel_stats(q: torch.Tensor, k: torch.Tensor) -> dict:
    """Per-channel RMS of q and k over heads' tokens: largest over median (1 for evenly spread channels); and the
    norm of k's mean over the keys relative to k's RMS (per head, the largest)."""
    def ratio(x):
        rms = x.double().pow(2).mean(dim=(0, 2)).sqrt()  # (heads, D)
        return (rms.amax(dim=-1) / rms.median(dim=-1).values.clamp_min(1e-300)).amax().item()

    kd = k.double()
    bias = kd.mean(dim=2).norm(dim=-1) / kd.pow(2).sum(-1).mean(dim=2).sqrt().clamp_min(1e-300)  # (B, Hkv)
    return {"q_channel_ratio": ratio(q), "k_channel_ratio": ratio(k), "k_mean_ratio": bias.amax().item()}


def measure_layer(rec: LayerCapture, block: int = 128, backend: str = "auto", qk_transforms: bool = False) -> dict:
    """Everything the module docstring lists, for one captured layer (with `qk_transforms`, also fp8-matching with
    each of TRANSFORM_MODES)."""
    dtype = torch.float16 if rec.q.dtype == torch.float16 else torch.bfloat16
    q, k, v, do = (t.to(dtype) for t in (rec.q, rec.k, rec.v, rec.do))
    kw = dict(causal=rec.causal, softmax_scale=rec.scale, window=rec.window)
    _, *exact = exact_grads(q, k, v, do, rec.causal, rec.scale, rec.window)
    row = {"layer": rec.layer, "heads": q.shape[1], "kv_heads": k.shape[1], "head_dim": q.shape[-1],
           "tokens": q.shape[2], **_score_stats(q, k, rec.causal, rec.scale, rec.window), **_channel_stats(q, k),
           "exact_dk_shift": _shift(exact[1]), "modes": {}}
    for mode in MODES + (tuple(TRANSFORM_MODES) if qk_transforms else ()):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if mode == "sdpa":
            out = _sdpa(*leaves, rec.causal, rec.scale, rec.window)
            residual = None
        elif mode in TRANSFORM_MODES:
            rotation, smooth = TRANSFORM_MODES[mode]
            config = DeltaMatchConfig(precision="fp8", delta="matching", block=block, backend=backend,
                                      qk_rotation=rotation, smooth_k=smooth)
            out = deltamatch_attention(*leaves, **kw, config=config)
            residual = None  # the transformed problem's dS is fp8-matching's on rotated/centered q and k
        else:
            precision, delta = _OUR_MODES[mode]
            config = DeltaMatchConfig(precision=precision, delta=delta, block=block, backend=backend)
            out = deltamatch_attention(*leaves, **kw, config=config)
            # dS before quantization, which only the reference exposes (the kernels implement the same contract)
            ref_cfg = config.replace(backend="reference")
            fwd = reference.forward(q, k, v, **kw, cu_seqlens_q=None, cu_seqlens_k=None, config=ref_cfg)
            *_, row_sums, row_abs = reference.backward(do, q, k, v, fwd[0], fwd[1], *fwd[2:], **kw, cu_seqlens_q=None,
                                                       cu_seqlens_k=None, config=ref_cfg, return_row_sums=True)
            residual = (row_sums.norm() / row_abs.norm().clamp_min(1e-30)).item()
        out.backward(do)
        dq, dk, dv = (t.grad for t in leaves)
        row["modes"][mode] = {"err_dq": rel_err(exact[0], dq), "err_dk": rel_err(exact[1], dk),
                              "err_dv": rel_err(exact[2], dv),
                              "ds_residual": residual, "dk_shift": _shift(dk),
                              "nonfinite": int(sum((~torch.isfinite(g)).sum().item() for g in (dq, dk, dv)))}
    return row


# ----------------------------------------------------------------------------------------------------
# Driver, table, plot
# ----------------------------------------------------------------------------------------------------


def check_model(model_path, data_path, *, seq_len=1024, batch=1, block=128, device="cpu", backend="auto",
                dtype=torch.bfloat16, text_field="text", qk_transforms=False) -> dict:
    """Load the model and tokenizer from `model_path`, run `batch` sequences of `seq_len` tokens of `data_path`
    through it, and measure every attention layer (measure_layer). Returns the report (JSON-ready)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(_checkpoint(model_path)))
    ids = make_sequences(tokenizer, read_documents(data_path, text_field), seq_len, batch)
    model = load_model(model_path, dtype=dtype, device=device)
    loss, layers = capture(model, ids.to(device))
    del model
    rows = [measure_layer(rec, block=block, backend=backend, qk_transforms=qk_transforms) for rec in layers]
    return {"model": str(model_path), "data": str(data_path), "seq_len": seq_len, "batch": batch, "block": block,
            "device": str(device), "backend": backend, "dtype": str(dtype).replace("torch.", ""), "loss": loss,
            "layers": rows}


def format_tables(report: dict) -> str:
    head = (f"model {report['model']}  data {report['data']}  {report['batch']} x {report['seq_len']} tokens  "
            f"loss {report['loss']:.4f}  device {report['device']} backend {report['backend']} block {report['block']}")
    t1 = [f"{'layer':>5} {'sink':>6} {'max|S|':>7} {'range':>7} {'P undfl':>8} | {'dS row-sum residual':^19} | "
          f"{'||sum_j dK_j||/||dK||':^30}",
          f"{'':>5} {'mass':>6} {'':>7} {'':>7} {'e4m3':>8} | {'match':>9} {'stale':>9} | "
          f"{'exact':>9} {'match':>9} {'stale':>9}"]
    for r in report["layers"]:
        m = r["modes"]
        t1.append(f"{r['layer']:>5} {r['sink_mass']:>6.3f} {r['max_abs_logit']:>7.2f} {r['logit_range']:>7.2f} "
                  f"{r['p_underflow']:>8.2%} | {m['fp8-matching']['ds_residual']:>9.1e} "
                  f"{m['fp8-stale']['ds_residual']:>9.1e} | {r['exact_dk_shift']:>9.1e} "
                  f"{m['fp8-matching']['dk_shift']:>9.1e} {m['fp8-stale']['dk_shift']:>9.1e}")
    names = {"fp8-matching": "match", "fp8-stale": "stale", "bf16": "bf16", "sdpa": "sdpa"}
    t2 = [f"{'layer':>5} | " + " | ".join(f"{g + ' error vs float64':^27}" for g in ("dQ", "dK", "dV")),
          f"{'':>5} | " + " | ".join(" ".join(f"{names[m]:>6}" for m in MODES) for _ in range(3))]
    for r in report["layers"]:
        t2.append(f"{r['layer']:>5} | " + " | ".join(
            " ".join(f"{r['modes'][m][g]:>6.3f}" for m in MODES) for g in ("err_dq", "err_dk", "err_dv")))
    extra = [m for m in TRANSFORM_MODES if m in report["layers"][0]["modes"]]
    t3 = [f"{'layer':>5} | {'channel RMS max/median':^19} | {'k mean':>7} | "
          + " | ".join(f"{g + ' error, fp8-matching':^{8 * (len(extra) + 1) - 1}}" for g in ("dQ", "dK")),
          f"{'':>5} | {'q':>9} {'k':>9} | {'/ RMS':>7} | "
          + " | ".join(" ".join(f"{n:>7}" for n in ("plain", *(m[4:] for m in extra))) for _ in range(2))]
    for r in report["layers"]:
        t3.append(f"{r['layer']:>5} | {r['q_channel_ratio']:>9.1f} {r['k_channel_ratio']:>9.1f} | "
                  f"{r['k_mean_ratio']:>7.2f} | " + " | ".join(
                      " ".join(f"{r['modes'][m][g]:>7.4f}" for m in ("fp8-matching", *extra))
                      for g in ("err_dq", "err_dk")))

    def ratio_of(r):
        return r["modes"]["fp8-stale"]["err_dq"] / r["modes"]["fp8-matching"]["err_dq"]

    worst = max(report["layers"], key=ratio_of)
    ratio = ratio_of(worst)
    bad = sum(m["nonfinite"] for r in report["layers"] for m in r["modes"].values())
    tail = (f"largest stale/matching dQ error ratio: {ratio:.2f}x at layer {worst['layer']} "
            f"(sink mass {worst['sink_mass']:.3f}); non-finite gradient entries: {bad}")
    return "\n".join([head, "", *t1, "", *t2, "", *t3, "", tail])


def plot(report: dict, path: str | Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [r["layer"] for r in report["layers"]]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for ax, (g, title) in zip(axes.flat, (("err_dq", "dQ"), ("err_dk", "dK"), ("err_dv", "dV"))):
        for i, mode in enumerate(report["layers"][0]["modes"]):
            ax.plot(layers, [r["modes"][mode][g] for r in report["layers"]], "o-" if mode in MODES else "^:",
                    color=f"C{i}", ms=3, label=mode)
        ax.set_yscale("log")
        ax.set_title(f"{title}: relative error vs float64")
        ax.grid(alpha=0.3, which="both")
    axes[0, 0].legend(fontsize=8)
    ax = axes[1, 1]
    ax.plot(layers, [r["sink_mass"] for r in report["layers"]], "o-", color="k", ms=3, label="sink mass")
    ax.plot(layers, [r["p_underflow"] for r in report["layers"]], "s--", color="C5", ms=3, label="P underflow (e4m3)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("attention shape")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for ax in axes[1]:
        ax.set_xlabel("layer")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.suptitle(f"{Path(report['model']).name}: {report['batch']} x {report['seq_len']} tokens, "
                 f"loss {report['loss']:.3f}", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check_main(args) -> int:
    """`hf-deltamatch check --model PATH --data FILE` (args from hf_deltamatch.cli's parser)."""
    import sys

    if not (args.model and args.data):
        print("error: give both --model PATH (a local checkpoint) and --data FILE (.txt or .jsonl)", file=sys.stderr)
        return 2
    try:
        report = check_model(args.model, args.data, seq_len=args.seq_len, batch=args.batch, block=args.block,
                             device=args.device, backend=args.backend, qk_transforms=args.qk_transforms)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_tables(report))
    out = Path(args.out or f"fidelity-{Path(args.model).resolve().name}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "fidelity.png")
    print(f"\nwrote {out / 'fidelity.json'} and {out / 'fidelity.png'}")
    return 0
