"""Counting the host reads a method makes inside its own hooks (its share of a forward pass; the
cache's own reads are counted by the cache's tests)."""

from __future__ import annotations

import collections

from kvhive.diagnostics import HostReadCounter

POLICY_HOOKS = (
    "select_prefill",
    "select_decode",
    "select_decode_drop",
    "initialize_decode",
    "observe_decode",
    "extra_attention",
    "kept_per_row",
)


def count_policy_reads(policy) -> tuple[collections.Counter, collections.Counter]:
    """Wrap ``policy``'s hooks (on the instance) so that each call counts its host reads.

    Returns ``(reads by kind, calls by hook)``, both updated as the hooks run."""
    reads: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for name in POLICY_HOOKS:
        original = getattr(policy, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            with HostReadCounter() as counter:
                result = _original(*args, **kwargs)
            reads.update(counter.reads)
            return result

        setattr(policy, name, counted)
    return reads, calls
