"""The method contract under one name: every public member of :mod:`kvhive.methods.contract`
(:class:`Policy`, :class:`ScorerPolicy`, :class:`PolicyConfig`, the ``require_*`` checks),
:mod:`kvhive.methods.scoring` (:class:`ScoringInputs`, :class:`KeyProbes`, :class:`PrefillScratch`,
the phases) and :mod:`kvhive.methods.selection` (:func:`keep_top_scores`, :func:`lowest_ranked`,
:func:`recent_mask`, ...), so a method imports what it needs from one place.
"""

from __future__ import annotations

from kvhive.methods.contract import (
    AUTO_HEADS,
    KV_HEADS,
    QUERY_HEADS,
    SEED_LIMIT,
    HeadGranularity,
    Policy,
    PolicyConfig,
    ScorerPolicy,
    derived_seed,
    require,
    require_choice,
    require_int_at_least,
    require_probability,
    require_seed,
)
from kvhive.methods.scoring import (
    DECODE,
    PREFILL,
    KeyProbes,
    Phase,
    PrefillScratch,
    ScoringInputs,
    causal_mask,
    chunk_elements,
)
from kvhive.methods.selection import (
    first_real_tokens,
    keep_top_scores,
    lowest_ranked,
    recency,
    recent_mask,
    top_indices,
)

__all__ = [
    "AUTO_HEADS",
    "DECODE",
    "KV_HEADS",
    "PREFILL",
    "QUERY_HEADS",
    "SEED_LIMIT",
    "HeadGranularity",
    "KeyProbes",
    "Phase",
    "Policy",
    "PolicyConfig",
    "PrefillScratch",
    "ScorerPolicy",
    "ScoringInputs",
    "causal_mask",
    "chunk_elements",
    "derived_seed",
    "first_real_tokens",
    "keep_top_scores",
    "lowest_ranked",
    "recency",
    "recent_mask",
    "require",
    "require_choice",
    "require_int_at_least",
    "require_probability",
    "require_seed",
    "top_indices",
]
