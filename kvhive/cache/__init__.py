"""Storage with per-head lengths, budgets and phases."""

from kvhive.cache.budget import Budget, budget_label
from kvhive.cache.kv_cache import BudgetNotKeptWarning, KVHiveCache
from kvhive.cache.storage import LayerStore

__all__ = ["Budget", "BudgetNotKeptWarning", "KVHiveCache", "LayerStore", "budget_label"]
