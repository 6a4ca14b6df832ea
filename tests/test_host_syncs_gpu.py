"""Host synchronizations in a transformers training step through deltamatch_fp8: none per attention call.

A synchronization stalls the host until the GPU's queue drains, so one per layer serializes the step. With
torch.cuda.set_sync_debug_mode("warn") every synchronizing call warns from the Python line that made it; the
forward's warnings are counted by file (the package's against transformers' own), and the backward runs under
"error". Per forward the package may read the packed sequences' bounds once (hf_deltamatch/_varlen.py: the launch
grids need them) and the padding mask's all-true check once (integrations/masks.py, as transformers' flash mask
does); nothing more, and nothing that grows with the layers: a 2-layer and a 4-layer model make the same count.
"""

import os
import sys
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.dirname(__file__))

# the package's synchronizations per forward + backward, by input
ALLOWED = {"plain": 0, "padded": 2, "packed-positions": 1, "packed-cu": 1}


def _inputs(kind):
    from test_transformers_patterns import ids, packed_rows, padded

    if kind == "plain":
        return dict(input_ids=ids(2, 512))
    if kind == "padded":
        x, mask, pos = padded([512, 300, 129], "left")
        return dict(input_ids=x, attention_mask=mask, position_ids=pos)
    x, pos = packed_rows([[200, 100, 212], [12, 500]])
    if kind == "packed-positions":
        return dict(input_ids=x, position_ids=pos)
    cu = torch.tensor([0, 200, 300, 512, 524, 1024], dtype=torch.int32)
    return dict(input_ids=x, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=500, max_length_k=500)


def _syncs(layers, kind):
    import _tiny_models as tiny
    from transformers import AutoModelForCausalLM

    config = tiny.qwen3_config(num_hidden_layers=layers, max_position_embeddings=2048, head_dim=64,
                               num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="deltamatch_fp8", dtype=torch.bfloat16)
    model.cuda().train()
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _inputs(kind).items()}
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100) if "attention_mask" in batch \
        else batch["input_ids"]
    for _ in range(2):  # the first step compiles the kernels
        model(**batch, labels=labels, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = model(**batch, labels=labels, use_cache=False).loss
            torch.cuda.set_sync_debug_mode("error")
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    ours = [f"{w.filename}:{w.lineno}" for w in caught
            if "synchroniz" in str(w.message) and f"{os.sep}hf_deltamatch{os.sep}" in w.filename]
    return ours


@pytest.mark.parametrize("kind", list(ALLOWED))
def test_no_host_sync_per_attention_call(kind):
    two, four = _syncs(2, kind), _syncs(4, kind)
    assert len(two) == len(four), (two, four)  # nothing per layer
    assert len(two) <= ALLOWED[kind], two
