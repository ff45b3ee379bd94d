"""What the cache needs to know about a method, read once from its policy.

A method declares its phases and capability flags on its :class:`~kvhive.methods.base.Policy`
class, and some capabilities by overriding a hook (its own ``kept_per_row``, ``fixed_decode_capacity``
or ``extra_attention``). :class:`MethodTraits` reads all of them when the cache is made, so a
decode step reads a field instead of testing set membership or method identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.methods.base import DECODE, PREFILL, Policy


def overrides(policy: Policy, hook: str) -> bool:
    """Whether ``policy``'s class defines its own ``hook`` instead of :class:`Policy`'s."""
    return getattr(type(policy), hook) is not getattr(Policy, hook)


@dataclass(frozen=True)
class MethodTraits:
    """A method's phases and capabilities (docs/DESIGN.md §3 says what each flag buys)."""

    name: str
    # Phases: whether the method compresses at all, cuts the prompt, and evicts while decoding.
    compresses: bool
    has_prefill: bool
    has_decode: bool
    # Class flags (``Policy`` documents each).
    static_decode: bool
    compiles_below_budget: bool
    drops_at_most_one: bool
    reads_stored_order: bool
    reads_newest_token_scores: bool
    needs_decode_attention: bool
    chunk_column_sums: bool
    prefill_column_sums: bool
    takes_key_probes: bool
    decodes_rows_of_different_lengths: bool
    head_granularity: str
    # Overridden hooks: the method declares what it keeps per row (``kept_per_row``), bounds what
    # it holds while decoding (``fixed_decode_capacity``), or attends keys outside the cache
    # (``extra_attention``: SubGen's estimator).
    declares_kept_counts: bool
    declares_capacity: bool
    attends_outside_cache: bool
    changes_attention_logits: bool  # ``logit_scale`` overridden (BUZZ log n)
    observes_decode: bool  # ``observe_decode`` overridden (by the class or the instance): called each step

    @classmethod
    def of(cls, policy: Policy) -> MethodTraits:
        phases = policy.phases
        return cls(
            name=policy.name,
            compresses=bool(phases),
            has_prefill=PREFILL in phases,
            has_decode=DECODE in phases,
            static_decode=policy.static_decode,
            compiles_below_budget=policy.compiles_below_budget,
            drops_at_most_one=policy.drops_at_most_one,
            reads_stored_order=policy.reads_stored_order,
            reads_newest_token_scores=policy.reads_newest_token_scores,
            needs_decode_attention=policy.needs_decode_attention,
            chunk_column_sums=policy.chunk_column_sums,
            prefill_column_sums=policy.prefill_column_sums,
            takes_key_probes=policy.takes_key_probes,
            decodes_rows_of_different_lengths=policy.decodes_rows_of_different_lengths,
            head_granularity=policy.head_granularity,
            declares_kept_counts=overrides(policy, "kept_per_row"),
            declares_capacity=overrides(policy, "fixed_decode_capacity"),
            attends_outside_cache=overrides(policy, "extra_attention"),
            changes_attention_logits=overrides(policy, "logit_scale"),
            observes_decode=overrides(policy, "observe_decode") or "observe_decode" in getattr(policy, "__dict__", {}),
        )
