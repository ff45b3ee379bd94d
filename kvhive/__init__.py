"""kvhive: KV-cache compression for Hugging Face causal LMs, without retraining."""

from kvhive.api import compression, make_cache, use_kvhive_attention
from kvhive.cache import Budget, KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.generation import generate, generate_batch
from kvhive.methods import make_policy, method_names

__all__ = [
    "Budget",
    "KVHiveCache",
    "cache_kwarg",
    "compression",
    "generate",
    "generate_batch",
    "make_cache",
    "make_policy",
    "method_names",
    "use_kvhive_attention",
    "load_model",
]


def load_model(*args, **kwargs):
    """See :func:`kvhive.models.load_model` (imported lazily: it pulls in model code)."""
    from kvhive.models import load_model as _load_model

    return _load_model(*args, **kwargs)
