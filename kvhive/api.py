"""One-line use of a method with ``model.generate``.

    cache = kvhive.make_cache(model, "snapkv", budget=128)
    model.generate(**inputs, past_key_values=cache, max_new_tokens=32)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from kvhive.attention import ATTENTION_NAME, register
from kvhive.cache import Budget, KVHiveCache
from kvhive.methods import Policy, make_policy


def use_kvhive_attention(model) -> str:
    """Switch ``model`` to the kvhive attention implementation; returns the previous one."""
    register()
    previous = model.config._attn_implementation
    if previous != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return previous


@contextlib.contextmanager
def compression(model) -> Iterator[Any]:
    """Run ``model`` with kvhive attention inside the block, restoring the previous one after."""
    previous = use_kvhive_attention(model)
    try:
        yield model
    finally:
        if previous != ATTENTION_NAME:
            model.set_attn_implementation(previous)


def make_cache(model, method: str | Policy = "full", budget: int | float | str | None = None, *,
               ratio: float | None = None, compress_sliding: bool = False, decode_every: int = 1,
               decode_slack: int = 0, **method_parameters: Any) -> KVHiveCache:
    """A :class:`KVHiveCache` for ``model`` running ``method`` at ``budget`` tokens per head
    (or ``ratio`` of the prompt). Also switches the model to kvhive attention (a no-op for
    other caches), so the cache can be passed straight to ``generate``."""
    policy = method if isinstance(method, Policy) else make_policy(method, **method_parameters)
    if budget is not None and ratio is not None:
        raise ValueError("give either budget (tokens per head, or a ratio as a float) or ratio, not both")
    if budget is None and ratio is None:
        budget_spec = Budget(ratio=1.0)
    elif ratio is not None:
        budget_spec = Budget(ratio=ratio)
    else:
        budget_spec = Budget.parse(budget)
    use_kvhive_attention(model)
    return KVHiveCache(model.config, policy, budget_spec, compress_sliding=compress_sliding,
                       decode_every=decode_every, decode_slack=decode_slack)
