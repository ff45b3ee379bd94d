"""Several caches decoded as the rows of one batch.

Comparing methods means decoding the same prompt under many caches (one per method and budget).
One at a time, every decode step reads all of the model's weights once per cache; a decode step
of a small model is bound by those reads (a batch of 16 costs little more than a batch of one;
measurements in docs/DESIGN.md), so decoding the caches as the rows of one batch costs about one
cache's time. Each row keeps its own :class:`KVHiveCache` (its own method, budget,
kept tokens and per-head lengths); kvhive's attention serves row ``i`` of the batch from cache
``i`` (:mod:`kvhive.attention.integration`), so a row computes what its cache would alone.

The rows must be in the same place of the same sequence: every cache has seen the same number of
tokens (the same prompt, the same number of decode steps), so the positions and the mask the
model builds are the same for every row; this is checked on every mask the model asks for.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from kvhive.cache.handoff import mark_update
from kvhive.cache.kv_cache import ORIGINAL_POSITIONS, KVHiveCache


class CacheRows(Cache):
    """Row ``i`` of the model's batch reads and writes ``caches[i]`` (each a batch of one).

    ``model(input_ids=ids, past_key_values=CacheRows(caches))`` with ``ids`` of shape
    ``[len(caches), q]`` advances every cache by the row's ``q`` tokens. The model must run
    kvhive's attention (``kvhive.make_cache`` switched it on for each cache).
    """

    def __init__(self, caches: list[KVHiveCache]) -> None:
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
        for index, cache in enumerate(caches):
            if not isinstance(cache, KVHiveCache):
                raise ValueError(f"caches[{index}]: expected a KVHiveCache, got {type(cache).__name__}")
            if cache.positions != ORIGINAL_POSITIONS:
                # Re-indexed positions depend on each cache's kept tokens: rows would need
                # different position ids and masks.
                raise ValueError(
                    f"caches[{index}] uses positions={cache.positions!r}; rows of one batch need "
                    f"positions={ORIGINAL_POSITIONS!r}"
                )
            batch = {layer.batch_size for layer in cache.layers if layer.is_initialized}
            if batch - {1}:
                raise ValueError(f"caches[{index}] holds a batch of {sorted(batch)} rows; each cache must hold one row")
            if len(cache.layers) != len(caches[0].layers):
                raise ValueError(
                    f"caches[{index}] has {len(cache.layers)} layers, caches[0] has {len(caches[0].layers)}: "
                    "rows must be caches of one model"
                )
        seen = [cache.get_seq_length() for cache in caches]
        if len(set(seen)) > 1:
            raise ValueError(f"caches have seen different numbers of tokens {seen}: rows must be at the same position")
        self.caches = list(caches)
        # The layer list of the first row answers transformers' read-only questions (layer types);
        # everything that reads lengths is answered below after checking that all rows agree.
        super().__init__(layers=self.caches[0].layers)

    def __len__(self) -> int:
        return len(self.caches[0].layers)

    @property
    def batch_size(self) -> int:
        return len(self.caches)

    # -- what the model asks before a forward pass -----------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[0].get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        # Over original positions for every row: a static-decode row ignores it and masks itself.
        sizes = [cache.mask_sizes_over_positions(query_length, layer_idx) for cache in self.caches]
        if len(set(sizes)) > 1:
            raise RuntimeError(f"rows disagree on the mask of layer {layer_idx} (kv length, offset): {sizes}")
        return sizes[0]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        offsets = [cache.get_query_offset(layer_idx) for cache in self.caches]
        if len(set(offsets)) > 1:
            raise RuntimeError(f"rows disagree on the query offset of layer {layer_idx}: {offsets}")
        return offsets[0]

    # -- the layer update: the attention splits it over the rows -------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if key_states.shape[0] != len(self.caches):
            raise ValueError(
                f"the batch has {key_states.shape[0]} rows; this CacheRows holds {len(self.caches)} caches"
            )
        # kvhive's attention recognises the returned tensor, then hands each row to its own cache
        # (``KVHiveCache.update``) and runs that row's attention over it.
        mark_update(self, layer_idx, key_states, kwargs)
        return key_states, value_states

    def _not_per_row(self, *args, **kwargs):
        raise NotImplementedError("CacheRows only decodes; crop, reorder or reset each row's cache instead")

    reset = crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _not_per_row
