"""A forward over stacked rows (``KVHiveCache.stack``), checked before any layer stores a token:
kvhive's model pre-hook asks :func:`prepare_stacked_forward` for the keyword arguments to run with."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvhive.cache.options import ORIGINAL_POSITIONS


def new_token_count(args, kwargs) -> int | None:
    """Tokens per row a model forward was given (``input_ids`` or ``inputs_embeds``), or None."""
    for name, position in (("input_ids", 0), ("inputs_embeds", None)):
        value = kwargs.get(name)
        if value is None and position is not None and len(args) > position:
            value = args[position]
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def prepare_stacked_forward(cache: Cache, args, kwargs) -> dict | None:
    """Before an eager forward over ``cache`` (kvhive's model pre-hook), for stacked rows: a step that
    would take a running slot past its capacity is refused before any layer stores a token (the
    cache stays usable: free that slot and decode on), and a forward without ``position_ids`` gets
    each row's own next positions (transformers would number every row from the most-seen row's
    count). Returns the forward's keyword arguments with the position ids added, or None."""
    layer = cache.layers[0] if cache.layers else None
    if layer is None or not layer.is_initialized or layer.row_seen is None:
        return None
    new_tokens = new_token_count(args, kwargs)
    if new_tokens is None:
        return None
    refuse_slot_overflow(cache, new_tokens)
    if kwargs.get("position_ids") is not None or cache.positions != ORIGINAL_POSITIONS:
        return None
    steps = torch.arange(new_tokens, device=layer.device)
    return {**kwargs, "position_ids": layer.row_seen.device[:, None] + steps}


def refuse_slot_overflow(cache: Cache, new_tokens: int) -> None:
    """Refuse ``new_tokens`` more tokens where a running slot of a growing layer would pass its
    capacity (``slot_capacity``), naming the slot and the capacity. Eager steps only (a compiled
    step's layers check it on the device), from the host lengths (no read back)."""
    if cache.slots_held is None:
        return
    for store in cache.layers:
        if not store.grows_in_slots or store.layout.lengths.stale:
            continue
        capacity = store.buffers()[0].shape[2]
        for slot, (length, running) in enumerate(zip(store.layout.lengths.host, cache.slots_held, strict=True)):
            if running and length + new_tokens > capacity:
                raise ValueError(
                    f"slot {slot} holds {length} tokens in layer {store.layer_index}: {new_tokens} more would pass "
                    f"its capacity of {capacity} tokens (slot_capacity); nothing was stored: free the slot "
                    f"(free_slots([{slot}])) and the other rows decode on, or stack with a larger slot_capacity"
                )
