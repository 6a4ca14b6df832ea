"""Realistic semantic bugs, each planted alone in a copy of the tree by tests/mutants/run.py, which runs the tests
listed with it: every one must fail, and each listed test's oracle is independent of the code the mutant changes
(the float64 FP8 oracle, float64 exact attention, transformers' eager/sdpa models, finite differences, or, for
the kernels, the reference backend; never the implementation's own row sums).

A mutant: `name`, `what` it means, `edits` [(file, exact text, replacement)] (each text must occur exactly once in
its file: run.py reports "anchor not found" rather than running an unmutated tree), `tests` (pytest node ids).
`gap`: a known missing test, reported as such instead of as a failure of the suite.
"""

REF = "hf_deltamatch/reference.py"
ATTN = "hf_deltamatch/attention.py"
OUTL = "hf_deltamatch/outliers.py"
FWD = "hf_deltamatch/kernels/forward.py"
BWD = "hf_deltamatch/kernels/backward.py"
FP8 = "hf_deltamatch/kernels/_fp8.py"
INTEG = "hf_deltamatch/integrations/transformers.py"
MASKS = "hf_deltamatch/integrations/masks.py"


def contract(case: str, delta: str = "matching") -> str:
    return f"tests/test_fp8_contract.py::test_reference_is_the_contract[{case}-{delta}]"


def PATTERNS(family: str, kind: str) -> str:  # noqa: N802 (reads as the harness's case name)
    return f"tests/test_transformers_patterns.py::test_matches_eager_or_raises[{family}-{kind}]"


def exact(case: str, mode: str = "fp8-matching") -> str:
    return f"tests/test_attention.py::test_matches_exact_attention[{case}-{mode}]"


KERNELS_CONTRACT = "tests/test_fp8_contract.py::test_triton_kernels_are_the_contract"
SINKS_EXACT = "tests/test_sinks.py::test_matches_exact_attention_with_sinks[causal-fp8-matching]"

MUTANTS = [
    # ---- reference.py: the contract's CPU implementation -------------------------------------------------------
    dict(name="stale-delta-when-matching", what="the backward uses dot(dO, O) where delta='matching' is asked "
         "(and the correction pass where 'stale' is)",
         edits=[(REF, 'if cfg.delta == "matching":', 'if cfg.delta != "matching":')],
         tests=[contract("causal"), "tests/test_attention.py::test_matching_beats_stale_against_float64[sinks]"]),
    dict(name="causal-diagonal-dropped", what="a query no longer sees its own key (j < i instead of j <= i)",
         edits=[(REF, "keep &= cols[None, :] <= pos", "keep &= cols[None, :] < pos")],
         tests=[contract("causal"), exact("causal")]),
    dict(name="packing-ignored", what="cu_seqlens ignored: packed sequences attend to each other",
         edits=[(REF, "    if cu_seqlens_q is None:\n        return [(0, n_total, 0, m_total)]",
                 "    if True:\n        return [(0, n_total, 0, m_total)]")],
         tests=[contract("varlen"), "tests/test_attention.py::test_packed_equals_separate_sequences"]),
    dict(name="packing-keys-shifted", what="each sequence's keys start at its query offset (cu_seqlens_q for k)",
         edits=[(REF, "return [(cq[i], cq[i + 1], ck[i], ck[i + 1])", "return [(cq[i], cq[i + 1], cq[i], ck[i + 1])")],
         tests=[contract("varlen q != k lengths"),
                "tests/test_attention.py::test_varlen_matches_exact_with_different_q_and_k_lengths"]),
    dict(name="packed-tiles-from-token-0", what="quantization tiles counted from the batch's first token, not from "
         "each sequence's",
         edits=[(REF, "x8[:, :, a:b], scale[:, :, a:b] = quantize_tokens(x[:, :, a:b], cfg.block, fmt, "
                      "cfg.scale_rounding)",
                 "x8[:, :, a:b], scale[:, :, a:b] = (t[:, :, a:b] for t in quantize_tokens(x, cfg.block, fmt, "
                 "cfg.scale_rounding))")],
         tests=[contract("varlen"), "tests/test_attention.py::test_packed_equals_separate_sequences"]),
    dict(name="P-in-e5m2", what="P rounded to e5m2 instead of e4m3 before the PV and P^T dO matmuls",
         edits=[(REF, 'return to_fp8(p * P_SCALE, "e4m3").float() / P_SCALE',
                 'return to_fp8(p * P_SCALE, "e5m2").float() / P_SCALE')],
         tests=[contract("causal"), exact("causal")]),
    dict(name="gqa-head-mapping", what="query head h reads KV head h % Hkv instead of h // (Hq / Hkv)",
         edits=[(REF, "self.k = k.float().repeat_interleave(groups, dim=1)",
                 "self.k = k.float().repeat(1, groups, 1, 1)"),
                (REF, "self.v = v.float().repeat_interleave(groups, dim=1)",
                 "self.v = v.float().repeat(1, groups, 1, 1)"),
                (REF, "self.sk = k_scale.repeat_interleave(groups, dim=1)", "self.sk = k_scale.repeat(1, groups, 1)"),
                (REF, "self.sv = v_scale.repeat_interleave(groups, dim=1)", "self.sv = v_scale.repeat(1, groups, 1)")],
         tests=[contract("gqa B=2"), exact("gqa")]),
    dict(name="gqa-dk-not-summed", what="a KV head's dK/dV take its first query head's instead of the group's sum",
         edits=[(REF, "dk = dk.reshape(B, H // ops.groups, ops.groups, m, dqk).sum(dim=2)",
                 "dk = dk.reshape(B, H // ops.groups, ops.groups, m, dqk)[:, :, 0]")],
         tests=[contract("gqa B=2"), exact("gqa")]),
    dict(name="sink-dropped-from-lse", what="O is rescaled by the sink but LSE' = LSE (the backward's P ignores it)",
         edits=[(REF, "    return out_s, lse_s\n", "    return out_s, lse\n")],
         tests=[contract("sinks"), SINKS_EXACT]),
    dict(name="sinks-grad-sign", what="d s_h = +sum P_sink delta",
         edits=[(REF, "return -(torch.exp(sinks.view(1, -1, 1) - lse_s) * delta)",
                 "return (torch.exp(sinks.view(1, -1, 1) - lse_s) * delta)")],
         tests=[contract("sinks"),
                "tests/test_sinks.py::test_fp32_reference_equals_float64_autograd[causal-matching]"]),
    dict(name="scale-doubled", what="tile scale 2 amax / fmax: operands use half of e4m3's range",
         edits=[(REF, "scale = (amax.float() / FP8_MAX[fmt]).clamp_min(SCALE_FLOOR)",
                 "scale = (amax.float() / FP8_MAX[fmt] * 2).clamp_min(SCALE_FLOOR)")],
         tests=[contract("causal"), "tests/test_attention.py::test_quantization_tiles_and_scales"]),
    dict(name="pow2-rounds-down", what="scale_rounding='pow2' rounds the scale down: the amax saturates at fmax",
         edits=[(REF, "scale = torch.exp2(torch.ceil(torch.log2(scale)))",
                 "scale = torch.exp2(torch.floor(torch.log2(scale)))")],
         tests=[contract("e5m2 gradients, pow2 scales"),
                "tests/test_attention.py::test_quantization_tiles_and_scales"]),
    dict(name="window-off-by-one", what="a window of w sees w + 1 keys (j >= i - w)",
         edits=[(REF, "keep &= cols[None, :] > pos - window", "keep &= cols[None, :] >= pos - window")],
         tests=[contract("window block 64"), exact("window")]),
    dict(name="causal-top-left", what="causal masks aligned top-left (j <= i) instead of bottom-right when N < M",
         edits=[(REF, "    pos = rows[:, None] + (m - n)\n", "    pos = rows[:, None]\n")],
         tests=[contract("N<M block 64"), exact("decode-chunk (N<M)")]),
    dict(name="ds-tile-128-rows", what="one dS scale per 128 query rows instead of 64",
         edits=[(REF, "DS_TILE_Q = 64 ", "DS_TILE_Q = 128 ")],
         tests=[contract("causal")]),
    dict(name="row-sum-from-quantized-P", what="the forward's l sums P8 instead of the unquantized P",
         edits=[(REF, "l = (p.sum(dim=-1) * w).sum(dim=-1)", "l = (ops.round_p(p).sum(dim=-1) * w).sum(dim=-1)")],
         tests=[contract("causal"), exact("causal")]),
    dict(name="matching-delta-from-P8", what="the correction pass sums P8 * dP instead of the unquantized P * dP",
         edits=[(REF, "delta = (p * dp).sum(dim=-1, keepdim=True)",
                 "delta = (ops.round_p(p) * dp).sum(dim=-1, keepdim=True)")],
         tests=[contract("causal"), "tests/test_attention.py::test_matching_beats_stale_against_float64[gaussian]"]),
    dict(name="dv-without-dO-scale", what="dV misses dO's tile scale",
         edits=[(REF, 'torch.einsum("bhqkt,bhqd->bhktd", p_q, do[:, :, r0:r1]) * sdo_tile',
                 'torch.einsum("bhqkt,bhqd->bhktd", p_q, do[:, :, r0:r1])')],
         tests=[contract("causal"), exact("causal")]),
    # ---- attention.py: sinks around the backend ----------------------------------------------------------------
    dict(name="sink-not-applied-to-out", what="the op returns the kernels' O instead of O' = O exp(LSE - LSE')",
         edits=[(ATTN, "out, lse = reference.apply_sinks(out, lse, sinks)",
                 "_, lse = reference.apply_sinks(out, lse, sinks)")],
         tests=[contract("sinks"), SINKS_EXACT]),
    # ---- outliers.py -------------------------------------------------------------------------------------------
    dict(name="rotation-rq-equals-rk", what="R_q = R_k: q' k'^T = 2 q k^T at D = 32 (every score doubled)",
         edits=[(OUTL, "r_q[start:start + b, start:start + b] = h * 2.0 ** -((log2b + 1) // 2)",
                 "r_q[start:start + b, start:start + b] = h * 2.0 ** -(log2b // 2)")],
         tests=["tests/test_sinks.py::test_rotation_with_sinks_is_exact_attention_with_sinks",
                "tests/test_outliers.py::test_fp8_gradients_against_float64[causal-gqa-hadamard]"]),
    dict(name="smooth-k-backward-uncentered", what="dk = dk' R^T without the centering C",
         edits=[(OUTL, "        if ctx.center:\n            g = _center(g",
                 "        if False:\n            g = _center(g")],
         tests=["tests/test_outliers.py::test_transforms_backward_is_exact_vjp[dense-smooth_k]"]),
    # ---- Triton kernels, under the interpreter (oracles: the float64 contract and the reference) ---------------
    dict(name="kernel-causal-diagonal-dropped", what="the forward/dQ kernels' mask drops the diagonal",
         edits=[(FWD, "vis = vis & (cols[None, :] <= pos)", "vis = vis & (cols[None, :] < pos)")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-dkdv-causal-diagonal-dropped", what="the dK/dV kernel's transposed mask drops the diagonal",
         edits=[(BWD, "vis = vis & (offs_n[:, None] <= pos)", "vis = vis & (offs_n[:, None] < pos)")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-window-off-by-one", what="the forward/dQ kernels' window sees one key more",
         edits=[(FWD, "vis = vis & (cols[None, :] > pos - window)", "vis = vis & (cols[None, :] >= pos - window)")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-P-in-e5m2", what="the forward kernel casts P * 256 to e5m2",
         edits=[(FWD, "acc = tl.dot(to_fp8(p, False, INTERP), v,", "acc = tl.dot(to_fp8(p, True, INTERP), v,")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-dv-P-in-e5m2", what="the dK/dV kernel casts P * 256 to e5m2 for dV",
         edits=[(BWD, "dv = tl.dot(to_fp8(p256, False, INTERP), dot_,",
                 "dv = tl.dot(to_fp8(p256, True, INTERP), dot_,")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-gqa-head-mapping", what="the forward kernel reads KV head h % GROUPS",
         edits=[(FWD, "    hk = h // GROUPS\n", "    hk = h % GROUPS\n")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-scale-doubled", what="every kernel tile scale (q, k, v, dO, dS) is 2 amax / fmax",
         edits=[(FP8, "scale = tl.maximum(amax / FMAX, SCALE_FLOOR)",
                 "scale = tl.maximum(amax / FMAX * 2.0, SCALE_FLOOR)")],
         tests=[KERNELS_CONTRACT]),
    dict(name="kernel-correction-pass-skipped", what="the dQ kernel skips the correction pass and takes delta from "
         "rowsum(dO * its O operand), which is dO in matching mode",
         edits=[(BWD, "    if STALE:\n        dohp", "    if True:\n        dohp")],
         tests=[KERNELS_CONTRACT]),
    # ---- the transformers integration (being rewritten: anchors may need updating) ------------------------------
    dict(name="integration-position-ids-packing-ignored", what="documents packed in rows by position_ids (the "
         "mask's segments) run as one sequence per row",
         edits=[(MASKS, "        seg = segments(mask_function, batch_size, kv_length, device)",
                 "        seg = torch.zeros(batch_size, kv_length, dtype=torch.int32, device=device)")],
         tests=[PATTERNS("qwen3", "packed-positions-b2"),
                "tests/test_transformers_models.py::test_packed_training_equals_per_sequence[llama-position_ids]"]),
    dict(name="integration-position-ids-packing-shifted", what="document boundaries one token late (a token's "
         "predecessor taken for its successor)",
         edits=[(MASKS, "    sees = mask_function(b, 0, j, j - 1).expand(batch_size, length - 1)",
                 "    sees = mask_function(b, 0, j - 1, j).expand(batch_size, length - 1)")],
         tests=[PATTERNS("qwen3", "packed-positions-b2")]),
    dict(name="integration-chunks-ignored", what="Llama 4's chunked attention run as full causal attention",
         edits=[(MASKS, "    chunked = p.chunk is not None and int(kv_offset) + kv_length > p.chunk",
                 "    chunked = False")],
         tests=[PATTERNS("llama4_chunked", "plain")]),
    dict(name="integration-cu-seqlens-ignored", what="flash-attention's cu_seq_lens kwargs dropped",
         edits=[(INTEG, '    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")\n',
                 "    cu_q = cu_k = None\n")],
         tests=[PATTERNS("llama", "packed-cu-only-b2")]),
    dict(name="integration-B>1-packing-broken", what="rows of B > 1 flattened without moving the batch axis next to "
         "the tokens (heads and rows interleave)",
         edits=[(INTEG, "        return x if B == 1 else x.transpose(0, 1).reshape(1, H, B * L, D)",
                 "        return x if B == 1 else x.reshape(1, H, B * L, D)")],
         tests=[PATTERNS("llama", "packed-cu-only-b2")]),
    dict(name="integration-cross-attention-queries-masked", what="a padded encoder's mask also taken for the "
         "decoder's queries (the last S key positions)",
         edits=[(INTEG, "    if not causal:\n        full = torch.full_like(n_k, S)",
                 "    if False:\n        full = torch.full_like(n_k, S)")],
         tests=[PATTERNS("bart", "dec-longer"), PATTERNS("bart", "enc-right-pad")]),
    dict(name="integration-padding-queries-misaligned", what="a padded row's queries taken in key order when the "
         "cache holds more keys than queries (decoding with left padding)",
         edits=[(INTEG, "    real_q = real[:, KV - S:]", "    real_q = real[:, :S]")],
         tests=[PATTERNS("llama", "decode")]),
    dict(name="integration-window-dropped", what="a sliding layer run without its window",
         edits=[(INTEG, "    window = sliding_window\n", "    window = None\n")],
         tests=[PATTERNS("mistral", "plain")]),
]
