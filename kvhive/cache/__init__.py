"""Storage with per-head lengths, budgets and phases."""

from kvhive.cache.kv_cache import Budget, BudgetNotKeptWarning, KVHiveCache
from kvhive.cache.storage import LayerStore

__all__ = ["Budget", "BudgetNotKeptWarning", "KVHiveCache", "LayerStore"]
