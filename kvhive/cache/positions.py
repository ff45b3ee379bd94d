"""Re-indexed positions (``positions="cache"``): kept keys are re-rotated to contiguous positions
just before the next query's, so a token-by-token stream can run past the model's trained length
(StreamingLLM-style). The rotation itself is the cache's ``key_rotator``
(:class:`kvhive.attention.rope.KeyRotator`)."""

from __future__ import annotations

import torch

from kvhive.cache.storage import LayerStore

# Per-token RoPE position of a cached key under positions="cache" (kept aligned by the store).
ROPE_POSITION = "_rope_position"


def position_cap(cache) -> float:
    """The most tokens any layer of ``cache`` can hold, so re-indexed positions stay below it."""
    caps = []
    for index, layer in enumerate(cache.layers):
        if index in cache.layer_budgets:
            caps.append(cache.layer_budgets[index] + cache.decode_slack + cache.decode_every - 1)
        elif layer.is_sliding and not cache.is_compressed(index):
            caps.append(layer.sliding_window - 1)
        else:
            return float("inf")
    return max(caps) if caps else float("inf")


def next_position(cache, tokens_seen: int) -> int:
    """The re-indexed position of the next token after ``tokens_seen`` tokens."""
    return int(min(tokens_seen, position_cap(cache)))


def reindex(cache, store: LayerStore) -> None:
    """Re-rotate the kept keys of ``store`` to sit just before the next query's position."""
    if store.num_stored == 0:
        return
    keys, _, original_positions, scores = store.dense()
    length = keys.shape[2]
    # Tokens appended since the last re-indexing were rotated at the position the model was
    # given for them (get_seq_length at that forward); older ones sit where we put them.
    given = next_position(cache, store.rope_tokens_seen) + (original_positions - store.rope_tokens_seen)
    current = given.to(torch.float32)
    if ROPE_POSITION in scores:
        is_new = original_positions >= store.rope_tokens_seen
        current = torch.where(is_new, current, scores[ROPE_POSITION])
    position = next_position(cache, store.tokens_seen)
    target = torch.arange(position - length, position, dtype=torch.float32, device=keys.device)
    delta = target - current
    if bool((delta != 0).any()):
        store.set_keys(cache.key_rotator.rotate(store.layer_index, keys, delta))
    store.set_token_scores(ROPE_POSITION, target.expand(keys.shape[:3]))
    store.rope_tokens_seen = store.tokens_seen
