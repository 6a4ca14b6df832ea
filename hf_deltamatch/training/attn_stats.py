"""`--attn_stats EVERY`: a cheap look inside attention while a run trains.

Every EVERY optimizer steps, on the first micro-batch of the step, each attention layer's call through
transformers' attention interface keeps one head's q, k, v (after RoPE), output and upstream gradient dO (batch
row 0; the head rotates with the step and the layer). After that backward, per layer:
  - sink_mass      mean attention probability on the first token of each packed document (rows after its first)
  - ds_residual    ||sum_j dS_ij|| / ||sum_j |dS_ij|||, the zero-row-sum invariant, from the reference backend with
                   the run's own backward numerics (precision and delta; bf16 with stale delta, FlashAttention's,
                   for other attention implementations) on the captured operands
  - max_abs_logit  largest |S_ij| over visible keys
  - nonfinite      non-finite entries in the captured q, k, v, output and dO
The statistics cover the DOCS longest documents of the row, each on its last ROWS query rows against all its keys
(the reference's bottom-right causal alignment keeps their positions; the dS quantization tiles then start at
the first of those rows). The attention itself is untouched: the wrapper calls the model's own attention function
and only copies one head.
"""

from __future__ import annotations

import math
import time

import torch

from .. import reference
from ..config import DeltaMatchConfig

# Measured on the DOCS longest documents of the row, on their last ROWS query rows each (against all their keys):
# bounded work per layer at any context length, and the late rows are where long-context attention lives.
DOCS = 4
ROWS = 256


class AttentionStats:
    """Installs a wrapper around the attention function `impl` for the lifetime of a `with` block."""

    def __init__(self, impl: str, every: int, precision: str = "bf16", delta: str = "stale", block: int = 128):
        self.impl, self.every = impl, every
        self.config = DeltaMatchConfig(precision=precision, delta=delta, block=block, backend="reference")
        self.armed_step: int | None = None
        self.records: dict[int, dict] = {}
        self.seconds = 0.0  # time spent capturing and measuring (the monitor's overhead)
        self._inner = None

    # -- installation ------------------------------------------------------------------------------------
    def __enter__(self):
        from transformers import AttentionInterface

        if self.impl not in AttentionInterface._global_mapping:
            raise ValueError(f"--attn_stats: attention implementation {self.impl!r} is not in transformers' "
                             "AttentionInterface (use sdpa or deltamatch_fp8).")
        self._inner = AttentionInterface._global_mapping[self.impl]
        AttentionInterface._global_mapping[self.impl] = self._wrap(self._inner)
        return self

    def __exit__(self, *exc):
        from transformers import AttentionInterface

        AttentionInterface._global_mapping[self.impl] = self._inner
        return False

    def due(self, next_step: int) -> bool:
        return self.every > 0 and next_step % self.every == 0

    def arm(self, step: int) -> None:
        self.armed_step, self.records = step, {}

    # -- capture -----------------------------------------------------------------------------------------
    def _wrap(self, inner):
        def attention_with_stats(module, query, key, value, attention_mask, *args, **kwargs):
            out, weights = inner(module, query, key, value, attention_mask, *args, **kwargs)
            if self.armed_step is not None and out.requires_grad:
                layer = int(getattr(module, "layer_idx", len(self.records)))
                if layer not in self.records:  # once per layer (activation checkpointing calls it again)
                    t0 = time.perf_counter()
                    self._record(layer, module, query, key, value, out, kwargs)
                    self.seconds += time.perf_counter() - t0
            return out, weights

        return attention_with_stats

    def _record(self, layer, module, query, key, value, out, kwargs):
        if query.shape[2] != key.shape[2]:
            return  # a KV cache (generation), not training
        heads = query.shape[1]
        head = (self.armed_step // self.every + layer) % heads
        kv_head = head // (heads // key.shape[1])
        cu = kwargs.get("cu_seq_lens_q")
        scaling = kwargs.get("scaling")
        causal = bool(getattr(module, "is_causal", True))
        one = lambda x, h: x[0:1, h:h + 1].detach().clone()  # noqa: E731  batch row 0, one head
        rec = {"head": head, "q": one(query, head), "k": one(key, kv_head), "v": one(value, kv_head),
               "out": out[0:1, :, head].detach().clone(), "do": None, "causal": causal,
               "scale": scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1]),
               "window": kwargs.get("sliding_window") if causal else None,
               "cu": cu.detach().clone() if cu is not None and query.shape[0] == 1 else None}
        self.records[layer] = rec

        def keep_grad(g, rec=rec, head=head):
            rec["do"] = g[0:1, :, head].detach().clone()

        out.register_hook(keep_grad)

    # -- measurement -------------------------------------------------------------------------------------
    def collect(self) -> list[dict]:
        """Per-layer stats of the armed step (call after its backward); disarms."""
        t0 = time.perf_counter()
        rows = []
        for layer, rec in sorted(self.records.items()):
            if rec["do"] is None:
                continue  # the layer's output took no part in the loss
            rows.append({"layer": layer, "head": rec["head"], **_measure(rec, self.config)})
        self.armed_step, self.records = None, {}
        self.seconds += time.perf_counter() - t0
        return rows


def _segments(n: int, cu) -> list[tuple[int, int]]:
    if cu is None:
        return [(0, n)]
    b = cu.tolist()
    return [(s, e) for s, e in zip(b[:-1], b[1:]) if e > s]


def _measure(rec: dict, config: DeltaMatchConfig) -> dict:
    dtype = rec["q"].dtype if rec["q"].dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    q, k, v = (rec[n].to(dtype) for n in ("q", "k", "v"))
    do = rec["do"].unsqueeze(1).to(dtype)  # (1, N, Dv) -> (1, 1, N, Dv)
    nonfinite = sum(int((~torch.isfinite(rec[name])).sum()) for name in ("q", "k", "v", "out", "do"))
    sink, rows, max_abs, sq_sums, sq_abs = 0.0, 0, 0.0, 0.0, 0.0
    docs = sorted(_segments(q.shape[2], rec["cu"]), key=lambda s: s[0] - s[1])[:DOCS]
    for a, b in docs:
        r = max(a, b - ROWS)  # the document's last rows, against all its keys (bottom-right causal alignment)
        n, m = b - r, b - a
        s = (q[0, 0, r:b].float() @ k[0, 0, a:b].float().T) * rec["scale"]
        keep = reference._visible(torch.arange(n, device=s.device), n, m, rec["causal"], rec["window"], s.device)
        max_abs = max(max_abs, s.abs().masked_fill(~keep, 0).amax().item())
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), dim=-1)
        first = 1 if r == a else 0  # the document's first row sees only itself
        sink += p[first:, 0].sum().item()
        rows += n - first
        if nonfinite:
            continue
        kw = dict(causal=rec["causal"], softmax_scale=rec["scale"], window=rec["window"], cu_seqlens_q=None,
                  cu_seqlens_k=None)
        qs, ks, vs = q[:, :, r:b], k[:, :, a:b], v[:, :, a:b]
        fwd = reference.forward(qs, ks, vs, **kw, config=config)
        *_, row_sums, row_abs = reference.backward(do[:, :, r:b], qs, ks, vs, fwd[0], fwd[1], *fwd[2:], **kw,
                                                   config=config, return_row_sums=True)
        sq_sums += row_sums.double().square().sum().item()
        sq_abs += row_abs.double().square().sum().item()
    residual = None if nonfinite else math.sqrt(sq_sums) / max(math.sqrt(sq_abs), 1e-30)
    return {"sink_mass": sink / max(rows, 1), "ds_residual": residual, "max_abs_logit": max_abs,
            "nonfinite": nonfinite}
