"""The compressor: applies a cache's method to each layer right after the layer's attention ran.

:meth:`Compressor.after_prefill` cuts a layer's prompt to its budget (a chunk of a chunked prefill
after the first goes through :meth:`Compressor.after_decode`'s multi-token path);
:meth:`Compressor.after_decode` keeps the budget while decoding, in one path: the method observes
the new tokens, may name the one token a step drops, else decides a keep mask over the layer; the
mask is checked (:func:`kvhive.cache.decisions.check_keep`) and the store applies it. How the store
applies it follows the layout the layer took at the end of its prefill
(:class:`kvhive.cache.layout_plan.LayoutPlan`): a growing layer lays the kept tokens out (host
counts), a fixed capacity compacts in place with the counts on the device.

The compressor holds what never changes for a cache (its method, the method's traits, which
layers it compresses); everything else it reads from the cache it is given.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kvhive import static_step
from kvhive.cache.budget import resolve_row_layer_budgets, row_budgets
from kvhive.cache.decisions import check_capacity_keep, check_keep, check_row_keep
from kvhive.cache.layout_plan import window_within_budget
from kvhive.cache.options import CACHE_POSITIONS, BudgetNotKeptWarning
from kvhive.cache.positions import reindex
from kvhive.cache.storage import LayerStore, first_false
from kvhive.cache.traits import MethodTraits
from kvhive.methods.base import DECODE, PREFILL, KeyProbes, Policy, ScoringInputs
from kvhive.static_step import captures_conditional_nodes, run_if

MakeScoring = Callable[[str], ScoringInputs]


def real_lengths(scoring: ScoringInputs) -> list[int]:
    """Real (unpadded) tokens of each row: the keys some query of the prompt may attend."""
    if scoring.mask is None:
        return [scoring.num_tokens] * scoring.batch_size
    return scoring.mask[:, 0].any(dim=-2).sum(dim=-1).tolist()


def store_token_scores(store: LayerStore, scoring: ScoringInputs) -> None:
    """Write back the per-token scores a policy set, so eviction keeps them aligned."""
    for name, score in scoring.token_scores.items():
        # (No .to for a float32 score: a call per score and step that changes nothing.)
        store.set_token_scores(name, score if score.dtype == torch.float32 else score.to(torch.float32))


def trim_sliding(store: LayerStore) -> None:
    """A sliding layer keeps the last ``window - 1`` tokens, as transformers' own cache does."""
    if not store.is_sliding:
        return
    if store.keeps_window_per_row:  # stacked rows, each its own window: on the device
        store.layout.drop_outside_window()
        return
    if store.num_stored == 0:
        return
    if store.is_uniform:
        # An uncompressed layer holds its tokens contiguously, newest last: drop the oldest
        # (host-side arithmetic, no device read-back).
        store.drop_oldest(store.dense_length - (store.sliding_window - 1))
        return
    drop_outside_window(store, every_layout=True)


def drop_outside_window(store: LayerStore, every_layout: bool = False) -> None:
    """Forget tokens of a sliding layer that no later query can attend, once it holds more than its
    window (its heads may hold different positions). Stacked rows keep their own window
    (``keeps_window_per_row``), or, where the method cut them, grow: the attention masks each row's
    window by position."""
    if not store.is_sliding:
        return
    if store.keeps_window_per_row:
        store.layout.drop_outside_window()
        return
    if store.has_row_lengths or store.num_stored == 0:
        return
    if every_layout or store.max_length > store.sliding_window - 1:
        store.keep(store.stored_flat_positions() >= store.tokens_seen - store.sliding_window + 1)


class Compressor:
    """A cache's method applied to its layers (module docstring)."""

    def __init__(self, policy: Policy, traits: MethodTraits, compressed_layers: list[int], hole_layers) -> None:
        self.policy = policy
        self.traits = traits
        self.compressed = frozenset(compressed_layers)
        # Layers where a one-token eviction writes the newest token into the freed slot
        # (layout_plan.hole_filling_layers).
        self.hole_layers = hole_layers

    # -- budgets -----------------------------------------------------------------------------------
    def resolve_budgets(self, cache, context_length: int, row_lengths: list[int] | None = None) -> None:
        """The cache's layer budgets, once per cache (rules in ``kvhive.cache.budget``)."""
        if cache.layer_budgets:
            return
        cache.budgets_resolved_on = context_length
        per_row = resolve_row_layer_budgets(
            self.policy, cache.budget, cache.compressed_layers, context_length, row_lengths
        )
        cache.row_layer_budgets = per_row
        cache.layer_budgets = {layer: max(budgets) for layer, budgets in per_row.items()}

    # -- prefill -----------------------------------------------------------------------------------
    def after_prefill(self, cache, layer_index: int, make_scoring: MakeScoring) -> None:
        """Cut one layer right after its prefill attention ran; then lay it out for decoding."""
        store = cache.layers[layer_index]
        try:
            self._cut_prompt(cache, layer_index, store, make_scoring)
        finally:
            # What the compression dropped is freed first, so that a decode capacity is the kept
            # tokens plus its room, not the prompt's buffers (nor shaped by the prompt's length).
            store.release_unused()
            cache.layout_plan.reserve_decode(cache, store)
            if not cache.compressed_layers or layer_index >= cache.compressed_layers[-1]:
                cache.prefill_scratch.clear()  # no later layer reuses it

    def _cut_prompt(self, cache, layer_index: int, store: LayerStore, make_scoring: MakeScoring) -> None:
        policy, traits = self.policy, self.traits
        if layer_index not in self.compressed:
            self._keep_window(cache, store)
            return
        scoring = make_scoring(PREFILL)
        self.resolve_budgets(cache, store.tokens_seen, real_lengths(scoring))
        if window_within_budget(cache, layer_index, store):
            self._keep_window(cache, store)
            return
        budgets = row_budgets(cache.layer_budgets, cache.row_layer_budgets, layer_index, scoring.batch_size)
        if traits.has_decode:
            policy.initialize_decode(scoring, store.policy_state, budget=cache.layer_budgets[layer_index])
        known = None
        if len(set(budgets)) == 1 and scoring.num_tokens > budgets[0]:
            phase = PREFILL if traits.has_prefill else DECODE
            known = policy.kept_per_row(phase, scoring.num_tokens, budgets[0], store.policy_state)
        keep = self._select_prefill(scoring, budgets, store.policy_state)
        store_token_scores(store, scoring)
        if cache.stores_query_heads:
            store.expand_to_query_heads(cache.num_query_heads // cache.num_kv_heads)
        if keep is not None:
            limits = [policy.prefill_limit(budget) for budget in budgets]
            keep, counts = check_keep(keep, policy.name, layer_index, limits, known, uniform=store.is_uniform)
            store.keep(keep, counts)
            cache.cut_at_prefill.add(layer_index)
            store.settled_tokens = store.tokens_seen  # chosen with every token so far: no crop below this
        if cache.positions == CACHE_POSITIONS:
            reindex(cache, store)
        if traits.has_decode and layer_index in self.hole_layers and store.is_uniform and not store.has_row_lengths:
            # Its decode evictions will write the newest token into the freed slot: the method reads
            # recency by position from the first decode step on (the same answers while the order
            # still holds), so the step that first fills a hole is the graph of every step.
            store.stored_in_order = False

    def _keep_window(self, cache, store: LayerStore) -> None:
        trim_sliding(store)
        if cache.positions == CACHE_POSITIONS:
            reindex(cache, store)

    def _select_prefill(self, scoring: ScoringInputs, budgets: list[int], state: dict) -> torch.Tensor | None:
        """The policy's prefill decision, once per distinct row budget (one call unless rows of a
        padded batch got different layer budgets); None when nothing is evicted."""
        keep = None
        for budget in sorted(set(budgets)):
            if scoring.num_tokens <= budget:
                continue
            if self.traits.has_prefill:
                part = self.policy.select_prefill(scoring, budget, state)
            elif self.traits.has_decode:
                # A decode-only method sees the prompt as a stream that already overflowed.
                part = self.policy.select_decode(scoring, budget, state)
            else:
                part = None
            if part is None:
                continue
            if len(set(budgets)) == 1:
                return part
            rows = torch.tensor([b == budget for b in budgets], device=part.device)
            keep = part if keep is None else keep
            keep = torch.where(rows[:, None, None], part, keep)
        if keep is not None:
            # Rows whose budget covers the prompt keep everything.
            covered = torch.tensor([scoring.num_tokens <= b for b in budgets], device=keep.device)
            keep = keep | covered[:, None, None]
        return keep

    def compress_prompt_chunk(self, cache, layer_index: int, store: LayerStore, make_scoring: MakeScoring) -> None:
        """A prompt chunk after the first (chunked prefill) for a prefill-only method: the method
        scores kept + new tokens with this chunk's queries (its observation window is the chunk's
        last queries) and keeps its budget, so the layer never holds more than budget + one chunk."""
        if cache.budget.ratio is not None and not cache.prompt_planned:
            raise ValueError(
                f"ratio={cache.budget.ratio:g} was resolved on the first {cache.budgets_resolved_on} prompt tokens, "
                "but the prompt came in chunks (chunked prefill): a ratio needs the whole prompt's length; call "
                "cache.plan_prompt(prompt_length) before the first chunk (kvhive.generate(..., prefill_chunk=N) does), "
                "or give a token budget"
            )
        # (A layer of head-wise counts never gets here: update refuses its chunk before storing it.)
        self.resolve_budgets(cache, store.tokens_seen)
        budget = cache.layer_budgets[layer_index]
        if store.dense_length <= budget:
            return
        policy = self.policy
        scoring = make_scoring(PREFILL)
        known = policy.kept_per_row(PREFILL, scoring.num_tokens, budget, store.policy_state)
        keep = policy.select_prefill(scoring, budget, store.policy_state)
        store_token_scores(store, scoring)
        limits = [budget] * keep.shape[0]
        keep, counts = check_keep(keep, policy.name, layer_index, limits, known, uniform=store.is_uniform)
        store.keep(keep, counts)
        cache.cut_at_prefill.add(layer_index)
        store.settled_tokens = store.tokens_seen

    # -- decode ------------------------------------------------------------------------------------
    def after_decode(self, cache, layer_index: int, make_scoring: MakeScoring) -> None:
        """Keep the budget while decoding; the policy decides what goes."""
        store = cache.layers[layer_index]
        sliding = store.is_sliding
        try:
            if layer_index not in self.compressed or (sliding and window_within_budget(cache, layer_index, store)):
                if sliding:
                    trim_sliding(store)
            elif self.traits.has_decode:
                self._evict(cache, layer_index, store, make_scoring)
            elif self.traits.compresses or sliding:  # (the full cache only keeps a sliding window)
                self._grow(cache, layer_index, store, make_scoring)
        finally:
            if cache.positions == CACHE_POSITIONS:
                reindex(cache, store)

    def _evict(self, cache, layer_index: int, store: LayerStore, make_scoring: MakeScoring) -> None:
        """A decode step of a layer its method evicts from: observe, then the one dropped token or
        a keep mask, checked and applied by the layer's layout."""
        if not store.is_uniform:
            raise RuntimeError(
                f"method {self.policy.name!r} compresses while decoding but layer {layer_index} holds a different "
                "number of tokens per head; combine decode-phase methods with uniform prefill budgets"
            )
        if not cache.layer_budgets:  # (resolved at the prefill: a static step reads no host count)
            self.resolve_budgets(cache, store.tokens_seen)
        scoring = make_scoring(DECODE)
        # initialize_decode ran in after_prefill (every layer's first forward is its prefill).
        if store.bounded_capacity or store.row_lengths_device is not None:  # a fixed capacity, or stacked rows
            budget = cache.layer_budgets[layer_index]
            if self.traits.observes_decode:
                self.policy.observe_decode(scoring, store.policy_state, budget=budget)
            store_token_scores(store, scoring)
            self._evict_in_place(layer_index, store, scoring, budget)
            return
        self.evict_step(cache, layer_index, store, scoring)

    def evict_step(self, cache, layer_index: int, store: LayerStore, scoring: ScoringInputs) -> None:
        """A growing layer's decode decision: the method observes, then evicts past the budget."""
        policy, state, budget = self.policy, store.policy_state, cache.layer_budgets[layer_index]
        if self.traits.observes_decode:
            policy.observe_decode(scoring, state, budget=budget)
        if scoring.token_scores:
            store_token_scores(store, scoring)
        store.decode_steps_since_compression += 1
        shape = scoring.token_shape
        length = shape[2]
        if length <= budget + cache.decode_slack or store.decode_steps_since_compression < cache.decode_every:
            return
        holes = layer_index in self.hole_layers
        hole = policy.select_decode_drop(scoring, budget, state) if length == budget + 1 and holes else None
        if hole is None:
            self._evict_by_mask(cache, layer_index, store, scoring, budget, holes)
            return
        if hole.dtype != torch.int64 or hole.shape != shape[:2]:
            self.refuse_dropped_token(hole, scoring)
        if scoring.token_scores:
            store_token_scores(store, scoring)
        store.layout.fill_hole(hole)  # one token per row moved, not the whole kept window
        store.decode_steps_since_compression = 0

    def _evict_by_mask(self, cache, layer_index: int, store: LayerStore, scoring, budget: int, holes: bool) -> None:
        """:meth:`_evict`'s keep mask (``Policy.select_decode``), checked, then applied by the layout."""
        policy, state, length = self.policy, store.policy_state, scoring.num_tokens
        known = policy.kept_per_row(DECODE, length, budget, state)
        keep = policy.select_decode(scoring, budget, state)
        store_token_scores(store, scoring)
        if keep is None:
            return
        limits = [budget + cache.decode_slack] * keep.shape[0]
        keep, counts = check_keep(keep, policy.name, layer_index, limits, known)
        if holes and isinstance(counts, int) and counts == store.dense_length - 1:
            store.fill_hole(first_false(keep))  # one token per row moved, not the whole kept window
        else:
            store.keep(keep, counts)
        store.decode_steps_since_compression = 0

    def _evict_in_place(self, layer_index: int, store: LayerStore, scoring: ScoringInputs, budget: int) -> None:
        """A decode step of a layer held in a fixed capacity (the method's declared bound, or its
        budget) or in stacked rows of different lengths (``Policy.decodes_rows_of_different_lengths``):
        the method decides over the whole capacity at every step (it keeps every filled slot when its
        schedule evicts nothing) and the kept tokens are counted and compacted on the device. Fixed
        shapes, no host read. A captured step records the decision and compaction as an if-node where
        the method flags its eviction steps (``Policy.decode_eviction_due``)."""
        per_row = store.row_lengths_device is not None  # stacked rows of different lengths
        if (
            not per_row
            and self.traits.drops_at_most_one
            and scoring.known_filled == scoring.num_tokens == budget + 1
            and layer_index in self.hole_layers
            and not static_step.in_static_step()
        ):
            # An eager step over a full capacity whose method names its one dropped token: it
            # takes the newest token, and there is nothing more to decide.
            hole = self._dropped_token(scoring, budget, store)
            if hole is not None:
                store.fill_hole_in_capacity(hole, budget)
                store.decode_steps_since_compression = 0
                return
        due = None
        if captures_conditional_nodes():
            due = self.policy.decode_eviction_due(scoring, budget, store.policy_state)
        run_if(due, lambda: self._compact(layer_index, store, scoring, budget, per_row))
        store.decode_steps_since_compression = 0

    def _compact(self, layer_index: int, store: LayerStore, scoring: ScoringInputs, budget: int, per_row: bool) -> None:
        """The decision over a whole capacity, checked on the device and compacted in place."""
        policy, traits = self.policy, self.traits
        keep = policy.select_decode(scoring, budget, store.policy_state)
        store_token_scores(store, scoring)
        if keep is None and not per_row and not static_step.in_static_step():
            return  # an eager step the method knows evicts nothing (no compaction)
        bound = scoring.num_tokens - 1  # the capacity holds the bound plus the new token
        shape = (scoring.batch_size, scoring.num_heads, scoring.num_tokens)
        if per_row:
            # A method without a bound of its own fills each row up to its budget (its decision over
            # a row still below it keeps every token the row holds), dropping at most one a step.
            fill_to = None if traits.declares_capacity else budget
            if keep is None and fill_to is not None:
                keep = torch.ones(shape, dtype=torch.bool, device=scoring.filled.device)
            keep, kept = check_row_keep(keep, policy.name, layer_index, bound, shape, scoring.filled, fill_to)
            at_most_one = fill_to is not None or traits.drops_at_most_one
            fill_hole = at_most_one and layer_index in self.hole_layers
            store.compact_in_place(keep, kept, at_most_one_dropped=at_most_one, fill_hole=fill_hole)
            return
        known = None
        if traits.drops_at_most_one and keep is not None and scoring.known_filled == scoring.num_tokens:
            # An eager step of a full capacity (the host knows every slot holds a token) of a method
            # that drops at most one token a step and declares its count (kept_per_row): no empty
            # slot to check or to mask, and the count, checked on the device, stays the host length.
            known = policy.kept_per_row(DECODE, scoring.num_tokens, budget, store.policy_state)
        # A method that keeps min(budget, N) keeps every stored token while they fit the budget (its
        # decision over the capacity knows nothing of the empty slots, and would drop one).
        fill_to = budget if store.fills_to_budget else None
        keep, kept = check_capacity_keep(keep, policy.name, layer_index, bound, shape, scoring.filled, known, fill_to)
        # Filling to a budget (or a method that says so), a step drops at most one token: the
        # compaction needs no sort, and may write the newest token into the freed slot.
        at_most_one = store.fills_to_budget or traits.drops_at_most_one
        fill_hole = at_most_one and layer_index in self.hole_layers
        store.compact_in_place(keep, kept, at_most_one_dropped=at_most_one, fill_hole=fill_hole)

    def _dropped_token(self, scoring: ScoringInputs, budget: int, store: LayerStore) -> torch.Tensor | None:
        """A steady step's one dropped token per row, where the method names it
        (``Policy.select_decode_drop``; the per-token scores stored after it), else None."""
        hole = self.policy.select_decode_drop(scoring, budget, store.policy_state)
        if hole is None:
            return None
        if hole.dtype != torch.int64 or hole.shape != (scoring.batch_size, scoring.num_heads):
            self.refuse_dropped_token(hole, scoring)
        store_token_scores(store, scoring)
        return hole

    def refuse_dropped_token(self, hole: torch.Tensor, scoring: ScoringInputs) -> None:
        """Refuse an answer of ``select_decode_drop`` of another shape or dtype than one stored index per
        row and head (checked on the host; an index out of range is refused by the move that uses it)."""
        raise TypeError(
            f"{self.policy.name}: select_decode_drop must give one stored index per row and head, a long tensor "
            f"of shape {(scoring.batch_size, scoring.num_heads)}; got {hole.dtype} of shape {tuple(hole.shape)}"
        )

    def _grow(self, cache, layer_index: int, store: LayerStore, make_scoring: MakeScoring) -> None:
        """A decode step (or a later prompt chunk) of a layer whose method compresses only the prompt:
        the layer grows, a sliding one within its window; a prompt chunk is cut to the budget."""
        drop_outside_window(store)
        if self.traits.has_prefill and store.last_update_tokens > 1 and cache.takes_prompt_chunks:
            self.compress_prompt_chunk(cache, layer_index, store, make_scoring)
        if self.traits.compresses:
            self.warn_budget_not_kept(cache, layer_index, store)

    def warn_budget_not_kept(self, cache, layer_index: int, store: LayerStore) -> None:
        """Warn (once per cache) when a prefill-only method holds more than its budget without
        ever having compressed this layer: a token-by-token stream, or a prompt that fit the
        budget, gets no compression at all, so the cache is the full cache under the method's name."""
        if torch.compiler.is_compiling():
            return  # a compiled step reads no host length (the warning comes from eager steps)
        budget = cache.layer_budgets.get(layer_index)
        if (
            cache.warned_budget_not_kept
            or budget is None
            or layer_index in cache.cut_at_prefill
            or store.max_length <= budget
        ):
            return
        cache.warned_budget_not_kept = True
        phases = ", ".join(sorted(self.policy.phases))
        warnings.warn(
            f"method {self.policy.name!r} compresses only in phase(s) {phases}: layer {layer_index} now holds "
            f"{store.max_length} tokens, over its budget of {budget}, and was never compressed (fed token by token, "
            "or the prompt fit the budget); use a method with a decode phase (e.g. h2o, tova, streamingllm) to "
            "keep a budget while streaming",
            BudgetNotKeptWarning,
            stacklevel=2,
        )

    # -- what the attention asks before a layer's attention ------------------------------------------
    def decode_key_probes(self, cache, layer_index: int, make_scoring: MakeScoring) -> KeyProbes | None:
        """The stored keys whose products with every stored key the method's decision will read
        (``Policy.decode_key_probes``), or None (cache docstring)."""
        budget = cache.layer_budgets.get(layer_index)
        store = cache.layers[layer_index]
        if (
            budget is None
            or layer_index not in self.compressed
            or store.has_row_lengths
            or not store.is_uniform
            or window_within_budget(cache, layer_index, store)
        ):
            return None
        return self.policy.decode_key_probes(make_scoring(DECODE), budget, store.policy_state)

    def chunk_column_sums_phase(self, cache, layer_index: int) -> str | None:
        """The phase of the scoring that reads the column sums of several new queries' attention
        over this layer, or None (cache docstring)."""
        if (
            not self.traits.chunk_column_sums
            or layer_index not in self.compressed
            or window_within_budget(cache, layer_index, cache.layers[layer_index])
        ):
            return None
        if self.traits.has_decode:
            return DECODE
        if self.traits.has_prefill and cache.takes_prompt_chunks:
            return PREFILL
        return None
