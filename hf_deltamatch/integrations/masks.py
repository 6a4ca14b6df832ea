"""The mask function registered under `deltamatch_fp8`: what transformers asks for, in a form the op runs exactly.

transformers builds each forward's masks by calling the registered mask function once per mask type, with the
pattern as a composed `mask_function` (causal, sliding window, chunks, packed documents, image-token blocks, a
model's own overlays) and the padding as a 2D `attention_mask`. The op runs causal or bidirectional attention,
sliding windows and packed sequences; padding becomes packed sequences too. So the pattern is read from the
composition (`pattern`; under torch.compile, which hides the composition, from the call's arguments and a check on the
device: `traced_pattern`), every pattern the op cannot express is refused by name, and what the attention function
needs is returned as a tensor:

  None                    no padding, no documents: one sequence per row (the pattern's causality and window
                          come with the attention call)
  bool (B, KV)            transformers' 2D padding mask (True: a real token), as flash-attention's mask function
                          returns it
  int32 (B, KV)           each token's segment (a packed document, or a chunk of chunked attention), -1 for
                          padding: the tokens of one segment see each other under the causal mask, and no other

Segments are found by asking the mask function itself whether each token sees its predecessor (causal masks over
documents or chunks see it exactly within a segment): O(B * KV) on the device, no host read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _varlen


class Pattern(NamedTuple):
    """What a composed transformers mask_function asks for, as far as the op can run it."""

    causal: bool
    window: int | None  # sliding window (keys a query sees, itself included)
    chunk: int | None  # chunked attention: queries see only their chunk's keys
    packed: bool  # documents packed in a row (transformers' packed-sequence mask, from position_ids)


_UNSUPPORTED = {
    "blockwise_overlay": "bidirectional blocks (block_sequence_ids: image or other non-text tokens that attend to "
                         "each other both ways)",
    "sliding_window_bidirectional_overlay": "a bidirectional sliding window",
    "padding_mask_function": "a padding mask inside the mask function",
}


def _refuse(what: str):
    raise ValueError(f"deltamatch_fp8 cannot run this model's attention mask: {what}. Running another mask would give "
                     "wrong results, so the call stops here. Use attn_implementation='sdpa' (or 'eager') for this "
                     "model, or for this input.")


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


def _walk(fn) -> Pattern:
    name = getattr(fn, "__qualname__", type(fn).__name__)
    module = getattr(fn, "__module__", "")
    outer = name.split(".<locals>")[0]
    if module != "transformers.masking_utils":
        _refuse(f"the custom mask function {module}.{name} (a model- or user-defined overlay)")
    if name == "causal_mask_function":
        return Pattern(True, None, None, False)
    if name == "bidirectional_mask_function":
        return Pattern(False, None, None, False)
    if outer in _UNSUPPORTED:
        _refuse(_UNSUPPORTED[outer])
    free = _closure(fn)
    if outer == "and_masks":
        parts = [_walk(f) for f in free["mask_functions"]]
        windows = [p.window for p in parts if p.window is not None]
        chunks = [p.chunk for p in parts if p.chunk is not None]
        return Pattern(any(p.causal for p in parts), min(windows) if windows else None,
                       min(chunks) if len(chunks) == 1 else _refuse("two chunk sizes") if chunks else None,
                       any(p.packed for p in parts))
    if outer == "or_masks":
        _refuse("a union of mask patterns (an or_mask_function: e.g. image tokens seeing each other both ways, or "
                "a prefix seen by every token)")
    if outer == "sliding_window_overlay":
        return Pattern(False, int(free["sliding_window"]), None, False)
    if outer == "chunked_overlay":
        return Pattern(False, None, int(free["chunk_size"]), False)
    if outer == "packed_sequence_mask_function":
        return Pattern(False, None, None, True)
    if outer in ("remap_positions_for_packed_sequence", "add_offsets_to_mask_function"):
        # positions restart with each packed document: within one, index and position differences agree
        return _walk(free["mask_function"])
    _refuse(f"the mask function transformers.masking_utils.{name}, which deltamatch_fp8 does not know")


def pattern(mask_function) -> Pattern:
    """The Pattern of a composed mask_function, read from transformers' closures (eager mode), or ValueError naming
    what the op cannot run."""
    return _walk(mask_function)


def traced_pattern(config, kwargs) -> Pattern:
    """The Pattern as far as torch.compile lets it be known: a traced function's closures cannot be read, so from the
    mask interface's arguments. transformers passes use_vmap=True exactly when a model's own or_mask_function /
    and_mask_function is composed in, local_size for sliding windows and chunks, allow_is_bidirectional_skip for
    bidirectional masks. Packed documents and chunks are then found by probing (segments), and what no argument
    shows (image-token blocks, which see the tokens after them) by a check on the device (see_no_successor)."""
    if kwargs.get("use_vmap"):
        _refuse("a model's own mask overlay (an or_mask_function or and_mask_function), which torch.compile hides")
    local = kwargs.get("local_size")
    if "allow_is_bidirectional_skip" in kwargs:
        if local is not None:
            _refuse(_UNSUPPORTED["sliding_window_bidirectional_overlay"])
        return Pattern(False, None, None, False)
    chunk = getattr(config, "attention_chunk_size", None)
    if local is not None and local == chunk:
        return Pattern(True, None, int(chunk), True)
    return Pattern(True, None if local is None else int(local), None, True)


def segments(mask_function, batch_size: int, length: int, device) -> torch.Tensor:
    """int32 (B, length): each token's segment, counted from 0 in its row, where a segment starts at every token
    that does not see its predecessor under mask_function (causal masks over packed documents or chunks: a
    token sees its predecessor exactly when both are in one segment)."""
    b = torch.arange(batch_size, device=device)[:, None]
    j = torch.arange(1, length, device=device)[None, :]
    sees = mask_function(b, 0, j, j - 1).expand(batch_size, length - 1)
    starts = torch.cat([torch.ones(batch_size, 1, dtype=torch.int32, device=device), (~sees).int()], dim=1)
    return starts.cumsum(1, dtype=torch.int32) - 1


def see_no_successor(mask_function, batch_size: int, length: int, device) -> None:
    """Check on the device (no host read; a device-side assertion stops the run) that no token sees the one after it:
    a causal pattern of segments, not image-token blocks or a prefix seen both ways (traced_pattern's blind spot)."""
    b = torch.arange(batch_size, device=device)[:, None]
    j = torch.arange(1, length, device=device)[None, :]
    torch._assert_async(~mask_function(b, 0, j - 1, j).any(),
                        "deltamatch_fp8 cannot run this model's attention mask under torch.compile: some tokens see "
                        "the tokens after them (bidirectional blocks of image tokens, or a prefix). Use "
                        "attn_implementation='sdpa' for this model.")


def deltamatch_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                    attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """transformers mask function (module docstring). With a static cache, whose key tensors are longer than what
    has been written and which `generate()` gives no padding mask, a mask of the written length (all True): the
    attention function then reads only those keys, as flash-attention's `_upad_input` does."""
    tracing = torch.compiler.is_compiling()
    if not tracing:
        _varlen.clear_cache()  # once per forward: cu_seqlens are read afresh for every batch
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else None)
    if mask_function is None:
        p = Pattern(True, None, None, False)
    else:
        p = traced_pattern(kwargs.get("config"), kwargs) if tracing else pattern(mask_function)
    chunked = p.chunk is not None and int(kv_offset) + kv_length > p.chunk  # shorter: one chunk, plain causal
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
    prefill = isinstance(q_offset, int) and q_offset == 0 and q_length == kv_length
    if chunked and not prefill:
        _refuse("chunked attention over a KV cache (generation past the first chunk)")
    if p.packed and not prefill and not tracing:
        _refuse("packed documents over a KV cache")
    if chunked or (p.packed and prefill):
        if tracing:
            see_no_successor(mask_function, batch_size, kv_length, device)
        seg = segments(mask_function, batch_size, kv_length, device)
        if attention_mask is not None:
            seg = torch.where(attention_mask.bool(), seg, -1)
        return seg
    if attention_mask is not None:
        if tracing or attention_mask.shape[1] != kv_length or not bool(attention_mask.all()):
            return attention_mask.bool()
        return None  # no padding: the fast path (one host read per forward, transformers' flash mask does the same)
    written = int(q_offset) + q_length - int(kv_offset)
    if p.causal and written < kv_length:
        return torch.ones(batch_size, written, dtype=torch.bool, device=device)
    return None
