"""The KV memory a result held, for results recorded before the backend measured it.

The backend records, per result, the KV entries and bytes held in the layers the budget applies
to (``kv_entries_mean``/``_peak``, ``kv_bytes_mean``/``_peak``; mean and peak over the item).
Earlier results recorded only tokens per stored head (``mean_kept_per_head``,
``peak_kept_per_head``: means over the compressed layers and their stored heads), from which the
same numbers follow exactly: kept per head × stored heads × compressed layers, times the bytes of
one entry (key + value, head dim × dtype size). Which layers are compressed and how many heads
they store come from the cache's own rules (:class:`~kvhive.cache.kv_cache.KVHiveCache` built on
the model's config, no weights), so the derivation cannot drift from what the cache did.
"""

from __future__ import annotations

import warnings

import torch

from kvhive.cache.budget import Budget
from kvhive.cache.kv_cache import KVHiveCache
from kvhive.methods.registry import make_policy_from_spec

from .backend import DEFAULT_DTYPE, FULL_METHOD, compresses_sliding

DERIVED_NOTE = "derived: kept per head × stored heads × compressed layers × bytes per entry (issue 26; not measured)"


def derive_held_memory(record: dict, config) -> dict | None:
    """The held-memory fields of ``record`` (a scored result of a model with ``config``) derived
    from its kept-per-head sizes, or None when the record has no sizes to derive from."""
    cache_sizes = record.get("cache") or {}
    if record.get("status", "ok") != "ok" or not {"mean_kept_per_head", "peak_kept_per_head"} <= cache_sizes.keys():
        return None
    text_config = config.get_text_config(decoder=True)
    method = record["method"]
    streaming = record.get("kind") == "perplexity"  # the backend feeds perplexity windows token by token
    sliding_window = getattr(text_config, "sliding_window", None)
    sliding = compresses_sliding(method, record["budget"], sliding_window) if streaming else False
    budget = None if method == FULL_METHOD else Budget.parse(record["budget"])
    cache = KVHiveCache(config, make_policy_from_spec(method), budget or Budget(ratio=1.0), compress_sliding=sliding)
    layers = len(cache.compressed_layers)
    stored_heads = cache.num_query_heads if cache.stores_query_heads else cache.num_kv_heads
    element_size = torch.empty(0, dtype=getattr(torch, record.get("dtype", DEFAULT_DTYPE))).element_size()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    bytes_per_entry = 2 * head_dim * element_size
    entries_mean = cache_sizes["mean_kept_per_head"] * stored_heads * layers
    entries_peak = round(cache_sizes["peak_kept_per_head"] * stored_heads * layers)
    return {
        "kv_entries_mean": round(entries_mean, 3),
        "kv_entries_peak": entries_peak,
        "kv_bytes_mean": round(entries_mean * bytes_per_entry, 3),
        "kv_bytes_peak": entries_peak * bytes_per_entry,
        "layers_counted": layers,
        "stored_heads": stored_heads,
        "held_memory": DERIVED_NOTE,
    }


WHOLE_CACHE_FIELDS = ("cache_bytes_mean", "cache_bytes_peak", "held_fraction_mean", "held_fraction_peak")
"""What the whole cache held (every layer, sliding-window ones included): its bytes, and those bytes
as a fraction of the full cache's at the same tokens (mean and peak over the item)."""


def held_memory(summary, task: str, method: str, budget: float | int | None) -> dict | None:
    """Mean over the setting's items of the KV entries and bytes it held (the item's mean and its
    peak, in the layers its budget applies to), or None when some record lacks them; with
    :data:`WHOLE_CACHE_FIELDS` (means over the items, ``held_fraction_max`` the largest peak of
    any item) where every record has them."""
    records = summary.item_records(task, method, budget)
    fields = ("kv_entries_mean", "kv_entries_peak", "kv_bytes_mean", "kv_bytes_peak")
    if not records or any(not all(f in (r.get("cache") or {}) for f in fields) for r in records):
        return None
    out = {f: sum(float(r["cache"][f]) for r in records) / len(records) for f in fields}
    for name in ("stored_heads", "layers_counted"):
        out[name] = sorted({int(r["cache"][name]) for r in records if name in r["cache"]})
    out.update(whole_cache_held(records) or {})
    return out


def whole_cache_held(records: list[dict]) -> dict | None:
    """Means over ``records`` of :data:`WHOLE_CACHE_FIELDS` and ``held_fraction_max`` (the largest
    peak fraction of any item), or None when some record lacks them (recorded before the backend
    measured the whole cache)."""
    if not records or any(not all(f in (r.get("cache") or {}) for f in WHOLE_CACHE_FIELDS) for r in records):
        return None
    out = {f: sum(float(r["cache"][f]) for r in records) / len(records) for f in WHOLE_CACHE_FIELDS}
    out["held_fraction_max"] = max(float(r["cache"]["held_fraction_peak"]) for r in records)
    return out


def warn_if_above_full(task: str, setting_label: str, cache_sizes: dict) -> None:
    """Warn when a setting's whole cache held more bytes than the full cache at some point of an
    item (Ada-KV storing a copy per query head on a model with one KV head): its budget then saves
    no memory, whatever its tokens per head say."""
    peak = cache_sizes.get("held_fraction_peak")
    if peak is not None and peak > 1.0:
        warnings.warn(
            f"task {task!r}, setting {setting_label}: the cache held more bytes than the full cache (all layers) on "
            "an item (its records' cache.held_fraction_peak): this setting saves no KV memory there",
            stacklevel=2,
        )


__all__ = [
    "DERIVED_NOTE",
    "WHOLE_CACHE_FIELDS",
    "derive_held_memory",
    "held_memory",
    "warn_if_above_full",
    "whole_cache_held",
]
