"""The checks that caches may be stacked into one batch (:mod:`kvhive.cache.batching`): one model,
method, options, budgets, dtype and device; prefilled, unpadded rows of dense layers; no fixed
batch slots (their free slots hold placeholders, not rows)."""

from __future__ import annotations

from transformers.cache_utils import Cache

from kvhive.cache.options import ORIGINAL_POSITIONS


def refuse_slotted(cache: Cache, what: str) -> None:
    """Refuse ``what`` on a cache of fixed batch slots: its rows are the slots, free ones decoding a
    placeholder, which would become a row of their own."""
    if cache.slots_held is not None:
        free = [slot for slot, running in enumerate(cache.slots_held) if not running]
        raise ValueError(
            f"{what} is not supported on a cache of {len(cache.slots_held)} fixed batch slots (free: {free}), whose "
            "free slots hold placeholders, not rows: rows leave with free_slots(slots) and join with "
            "fill_slots(slots, caches)"
        )


def check_stackable(cache_class: type, first: Cache, caches: list[Cache]) -> None:
    """Refuse caches that cannot be rows of one batch with ``first`` (each named by its place)."""
    for number, cache in enumerate(caches):
        if not isinstance(cache, cache_class):
            raise ValueError(f"caches[{number}]: expected a {cache_class.__name__}, got {type(cache).__name__}")
        where = f"caches[{number}]"
        check_rows_stackable(cache, where)
        if cache is not first:
            check_same_cache_settings(first, cache, where)


def check_rows_stackable(cache: Cache, where: str) -> None:
    """Refuse a cache whose rows cannot be stacked, whatever the others."""
    refuse_slotted(cache, f"stacking {where}")
    if cache.positions != ORIGINAL_POSITIONS:
        raise ValueError(f"{where} uses positions={cache.positions!r}; stacked rows need positions='original'")
    if not all(layer.is_initialized for layer in cache.layers):
        raise ValueError(f"{where} holds no prompt: prefill each cache (its prompt through the model) first")
    batches = {layer.batch_size for layer in cache.layers}
    if len(batches) != 1 or min(batches) < 1:
        raise ValueError(f"{where} holds batches of {sorted(batches)} rows in its layers; expected one batch size >= 1")
    if min(batches) > 1 and not cache.is_stacked and any(layer.has_padding for layer in cache.layers):
        # Its rows' token counts include the left padding, so each row's next position (its
        # tokens seen, as a stacked row continues) would not be the one it has alone.
        raise ValueError(
            f"{where} holds a left-padded batch of {min(batches)} rows: its rows' positions count the padding; "
            "prefill each prompt alone (a batch of one) and stack those"
        )
    for layer in cache.layers:
        if not layer.is_uniform:
            raise ValueError(
                f"cannot stack caches of method {cache.policy.name!r}: layer {layer.layer_index} of {where} holds "
                "a different number of tokens per head (head-wise budgets, Ada-KV's packed layout), which has no "
                "dense row to stack; decode each prompt alone (kvhive.generate)"
            )


def check_same_cache_settings(first: Cache, cache: Cache, where: str) -> None:
    """Refuse a cache of another model, model object, method, options, budgets, dtype or device than ``first``."""
    if cache.model_shape != first.model_shape:
        raise ValueError(f"{where} was made for another model ({cache.model_shape} vs {first.model_shape})")
    for layer, module in first.attention_modules.items():
        other = cache.attention_modules.get(layer)
        if other is not None and module() is not None and other() is not None and other() is not module():
            raise ValueError(f"{where} was filled by another model object than caches[0] (layer {layer})")
    if type(cache.policy) is not type(first.policy) or cache.policy.config != first.policy.config:
        raise ValueError(
            f"{where} runs method {cache.policy!r}, caches[0] {first.policy!r}: stacked rows run one method"
        )
    for option in ("budget", "compress_sliding", "decode_every", "decode_slack", "dense_decode"):
        if getattr(cache, option) != getattr(first, option):
            raise ValueError(
                f"{where} has {option}={getattr(cache, option)!r}, caches[0] {getattr(first, option)!r}: stacked "
                "rows share one cache's options"
            )
    if first.traits.has_decode:
        differing = {
            layer: (first.layer_budgets.get(layer), cache.layer_budgets.get(layer))
            for layer in set(first.layer_budgets) | set(cache.layer_budgets)
            if first.layer_budgets.get(layer) != cache.layer_budgets.get(layer)
        }
        if differing:
            raise ValueError(
                f"{where} keeps other layer budgets than caches[0] {differing} (a ratio of prompts of different "
                f"lengths): method {first.policy.name!r} keeps one budget per layer while decoding; give a token "
                "budget"
            )
    for ours, theirs in zip(first.layers, cache.layers, strict=True):
        if (ours.dtype, ours.device) != (theirs.dtype, theirs.device):
            raise ValueError(
                f"{where} holds {theirs.dtype} on {theirs.device} in layer {theirs.layer_index}, caches[0] "
                f"{ours.dtype} on {ours.device}: stacked rows share one dtype and device"
            )
        if ours.heads_per_kv_head != theirs.heads_per_kv_head:
            raise ValueError(f"{where} stores another number of heads per KV head than caches[0]")
