"""Storage with per-head lengths, budgets and phases."""

from kvhive.cache.kv_cache import Budget, KVHiveCache
from kvhive.cache.storage import LayerStore

__all__ = ["Budget", "KVHiveCache", "LayerStore"]
