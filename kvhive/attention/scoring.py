"""What the attention hands a method after a layer's attention ran: the :class:`ScoringInputs`
of the layer (built by :func:`build_scoring`, the one place that makes them), as a factory the
cache calls with the phase of its decision, once the attention's by-products are known."""

from __future__ import annotations

import torch

from kvhive.methods.base import KeyProbes, PrefillScratch, ScoringInputs


def build_scoring(
    cache,
    layer_index: int,
    phase: str,
    view: tuple,
    queries: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    sequence_length,
    *,
    last_query_weights: torch.Tensor | None = None,
    last_query_logits: torch.Tensor | None = None,
    accumulated_weights: torch.Tensor | None = None,
    filled: torch.Tensor | None = None,
    known_filled: int | None = None,
    stored_in_order: bool = True,
    scratch: PrefillScratch | None = None,
    key_probes: KeyProbes | None = None,
    inputs_class: type[ScoringInputs] = ScoringInputs,
) -> ScoringInputs:
    """The :class:`ScoringInputs` of layer ``layer_index`` of ``cache`` for a decision in ``phase``:
    ``view`` is the layer's stored ``(keys, values, positions, token_scores)`` as the decision reads
    them, ``queries`` the queries the model attended with, ``mask`` the attention's mask over the
    stored tokens (None: causal over the stored positions), ``sequence_length`` the tokens seen (a
    device counter in a static decode step). The keywords are the attention's by-products (see
    :class:`ScoringInputs`); the token scores are copied, so a decision may add its own.
    ``inputs_class``: a subclass that reads the keys and values its own way (quantized storage)."""
    keys, values, positions, token_scores = view
    return inputs_class(
        keys=keys,
        values=values,
        queries=queries,
        positions=positions,
        mask=mask,
        scaling=scaling,
        layer_index=layer_index,
        num_layers=len(cache.layers),
        sequence_length=sequence_length,
        phase=phase,
        token_scores=dict(token_scores),
        last_query_weights=last_query_weights,
        last_query_logits=last_query_logits,
        accumulated_weights=accumulated_weights,
        filled=filled,
        known_filled=known_filled,
        stored_in_order=stored_in_order,
        scratch=scratch,
        key_probes=key_probes,
    )


def scored_view(cache, store) -> tuple:
    """A layer's stored ``(keys, values, positions, token_scores)`` as a prefill decision scores
    them: repeated to the query heads when the method stores one copy per query head and the layer
    has not been expanded yet."""
    keys, values, positions, token_scores = store.dense()
    if cache.stores_query_heads and cache.num_query_heads != keys.shape[1]:
        factor = cache.num_query_heads // keys.shape[1]
        keys = keys.repeat_interleave(factor, dim=1)
        values = values.repeat_interleave(factor, dim=1)
        positions = positions.repeat_interleave(factor, dim=1)
    return keys, values, positions, token_scores


def prefill_scoring(cache, layer_index: int, query, mask, scaling, accumulated=None):
    """A factory of the :class:`ScoringInputs` of one layer right after its prefill (``accumulated``:
    the column sums the attention computed with its output, or None)."""
    store = cache.layers[layer_index]

    def make_scoring(phase: str) -> ScoringInputs:
        return build_scoring(
            cache,
            layer_index,
            phase,
            scored_view(cache, store),
            query,
            mask,
            scaling,
            store.tokens_seen,
            accumulated_weights=accumulated,
            scratch=cache.prefill_scratch,
        )

    return make_scoring


def filled_count(store) -> torch.Tensor | None:
    """``ScoringInputs.filled`` of a decode step: the tokens a fixed capacity holds (0-d), each
    row's (``[B, 1, 1]``) when stacked rows hold different numbers; None for a growing layer."""
    if not store.fixed_capacity:
        return None
    if store.row_lengths_device is not None:
        return store.row_lengths_device.view(-1, 1, 1)
    return store.length_device


def question_scoring(cache, layer_index: int, query, mask, scaling, make_scoring):
    """The scoring factory of a layer after its attention ran. Question-aware chunked prefill
    (``cache.question_copy_tokens`` > 0: the forward is a prompt chunk followed by a copy of the
    prompt's question at the positions right after it): the copy's entries are dropped from the
    layer first (``KVHiveCache.drop_question_copy``), then the method scores what the layer keeps
    (the kept tokens and the chunk) with the copy's queries, which attended them and the copy itself
    as the prompt's question will: SnapKV's observation window is then the question's last queries
    (all of them when the question is shorter than the window), not the chunk's own. The softmax
    of those queries runs over the kept tokens and the chunk only (the question's own entries are
    neither candidates nor in its denominator). Otherwise ``make_scoring`` unchanged.

    ``mask``: the attention's mask over the stored tokens ``[B, 1|H, q, N]`` (its last rows are the
    copy's queries, its first columns the tokens that stay), or None (causal, no padding: the copy
    sees every token before it)."""
    count = cache.question_copy_tokens
    if not count:
        return make_scoring
    store = cache.layers[layer_index]
    sequence_length = store.tokens_seen  # the copy's last position + 1
    cache.drop_question_copy(layer_index)
    questions = query[:, :, -count:]

    def make_question_scoring(phase: str) -> ScoringInputs:
        view = scored_view(cache, store)
        num_keys = view[0].shape[2]
        if mask is None:
            # An explicit mask: the copy's queries follow every key (a causal mask read from the
            # shapes would take the last keys for the queries' own tokens).
            rows = torch.ones(1, 1, count, num_keys, dtype=torch.bool, device=view[0].device)
        else:
            rows = mask[:, :, -count:, :num_keys]
        return build_scoring(cache, layer_index, phase, view, questions, rows, scaling, sequence_length)

    return make_question_scoring
