"""``KVHiveCache``: a transformers ``Cache`` whose layers keep a budget chosen by a policy.

The cache owns storage, budgets and phases; it asks the policy (through the generic
:class:`~kvhive.methods.base.Policy` interface) which tokens to keep and never knows which
method it runs. The attention function (``kvhive.attention``) calls :meth:`after_prefill` and
:meth:`after_decode` right after a layer's attention, so each layer is cut as soon as its own
prefill is done and peak memory stays at one uncompressed layer.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Final, Literal

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from kvhive import static_step
from kvhive.cache import batching, guards
from kvhive.cache.batching import real_lengths as _real_lengths  # (the name the budget code calls)
from kvhive.cache.budget import Budget, budget_label, budget_problem, layer_budgets, minimum_budget_problem
from kvhive.cache.guards import model_shape
from kvhive.cache.guards import refuse_encoder_decoder as refuse_encoder_decoder  # (re-exported: kvhive.api)
from kvhive.cache.handoff import active_update as active_update  # (re-exported: kvhive.attention)
from kvhive.cache.handoff import mark_update
from kvhive.cache.storage import LayerStore, first_false, row_index
from kvhive.methods.base import (
    AUTO_HEADS,
    DECODE,
    PREFILL,
    QUERY_HEADS,
    KeyProbes,
    Policy,
    PrefillScratch,
    ScoringInputs,
    require_choice,
)
from kvhive.static_step import captures_conditional_nodes, in_static_step, run_if

Positions = Literal["original", "cache"]
"""Keys keep their true positions (``"original"``) or are re-indexed to contiguous ones (``"cache"``)."""
ORIGINAL_POSITIONS: Final[Positions] = "original"
CACHE_POSITIONS: Final[Positions] = "cache"
DenseDecode = Literal["auto", "sdpa", "kernel"]
"""Attention of a decode step over equal-length heads on CUDA: sdpa, kvhive's split-K kernel, or
``"auto"``: the kernel over a fixed capacity (where sdpa would need a mask over the empty slots,
which takes it off flash-decoding's split-K path: ~1.7 ms a layer for one query over 32k masked
slots on an H200, against ~0.2 ms for the kernel), sdpa over a growing layer's unmasked slice."""

# Per-token RoPE position of a cached key under positions="cache" (kept aligned by the store).
ROPE_POSITION = "_rope_position"
# PADDING_SCORE (kvhive.cache.storage): per-token flag (1.0) of left padding, recorded at prefill
# when the batch is padded (kept aligned by the store; appended tokens get 0: real, whatever the
# method reads).


class BudgetNotKeptWarning(UserWarning):
    """A cache holds more than its budget because its method cannot compress in this phase
    (a prefill-only method fed token by token, or decoding past a prompt that fit the budget)."""


def check_question_tokens(question_tokens, prefill_chunk, policy: Policy) -> None:
    """Refuse a question-aware chunked prefill that cannot run, naming the parameter."""
    if question_tokens is None:
        return
    if isinstance(question_tokens, bool) or not isinstance(question_tokens, int) or question_tokens < 1:
        raise ValueError(
            f"invalid question_tokens={question_tokens!r}: expected an integer >= 1 (the prompt's last tokens that are "
            "its question), or None"
        )
    if prefill_chunk is None:
        raise ValueError(
            f"question_tokens={question_tokens} needs prefill_chunk (the question is appended to each chunk of a "
            "chunked prefill); without chunks the prompt's own last queries are the question already"
        )
    if DECODE in policy.phases or PREFILL not in policy.phases:
        raise ValueError(
            f"question_tokens is for methods that compress only the prompt (e.g. snapkv, pyramidkv): method "
            f"{policy.name!r} "
            + ("evicts by its decode rule after each chunk" if DECODE in policy.phases else "never evicts")
            + "; give question_tokens=None for it"
        )


# A layer whose budget exceeds twice what it holds after its prompt by more than this decodes in
# the growing layout rather than in a fixed capacity of the whole budget.
BOUNDED_CAPACITY_SLACK = 64


class KVHiveCache(Cache):
    """A cache that applies ``policy`` to keep ``budget`` tokens per head.

    Args:
        config: the model config (layer types and sliding windows are read from it).
        policy: the compression method.
        budget: a :class:`Budget`, an int (tokens per head) or a float ratio in (0, 1].
        compress_sliding: also compress sliding-window layers (default: leave them as the
            model defines them, already bounded by their window).
        decode_every: in decoding, compress at most every N steps (the cache overshoots by < N).
        decode_slack: in decoding, let the cache grow ``slack`` tokens past the budget before
            compressing back to the budget (threshold policy). A step compresses when the layer
            holds more than ``budget + slack`` tokens and ``decode_every`` steps have passed.
        record_prefill: keep each layer's prefill queries and mask (see
            ``kvhive.attention.integration.replay_prefill``).
        positions: ``"original"`` (keys keep their true positions) or ``"cache"``: kept keys are
            re-rotated to contiguous positions and new tokens continue after them, so a token-by-
            token stream (``model(input_ids, past_key_values=cache)`` calls, batch without
            padding) can run past the model's trained length (StreamingLLM-style). Needs
            ``key_rotator`` (``kvhive.attention.rope.KeyRotator``; ``make_cache`` passes it).
        dense_decode: ``"auto"`` (the default), ``"sdpa"`` or ``"kernel"`` (see :data:`DenseDecode`).
        decode_capacity: room for this many decode tokens in every layer that only grows while
            decoding (the full cache, prefill-only methods), reserved after the prompt: its decode
            step then has one shape (attention over the capacity, empty slots masked) and the cache
            is compileable. Tokens past it fall back to growing buffers (eager only).
        prefill_chunk: feed the prompt in chunks of this many tokens (``kvhive.generate``; with
            ``model.generate`` pass ``prefill_chunk_size=cache.prefill_chunk``). After each chunk
            every compressed layer holds at most its budget plus one chunk: streaming methods evict
            by their decode rule once per chunk, prefill-only methods score kept + new tokens with
            the chunk's queries (docs/METHODS.md, "Chunked prefill").
        question_tokens: the last this many tokens of the prompt are its question (a question-aware
            chunked prefill, FINCH-style; needs ``prefill_chunk`` and a prefill-only method). The
            prompt's feeder (``kvhive.api.prefill_prompt``, which ``kvhive.generate`` and the
            evaluation backend use) appends a copy of the question to every chunk that holds only
            context, at the positions right after the chunk; the method scores kept + chunk with the
            question's queries and the copy's entries are dropped (docs/METHODS.md, "Question-aware
            chunked prefill").
    """

    def __init__(
        self,
        config,
        policy: Policy,
        budget: Budget | int | float,
        *,
        compress_sliding: bool = False,
        decode_every: int = 1,
        decode_slack: int = 0,
        record_prefill: bool = False,
        positions: Positions = ORIGINAL_POSITIONS,
        key_rotator=None,
        dense_decode: DenseDecode = "auto",
        prefill_chunk: int | None = None,
        decode_capacity: int | None = None,
        question_tokens: int | None = None,
    ) -> None:
        if not isinstance(budget, (Budget, bool, str)):
            budget = Budget.parse(budget)  # ints and floats, numpy's included
        if not isinstance(budget, Budget):
            raise ValueError(f"invalid budget={budget!r}: expected an int >= 1 or a ratio in (0, 1]")
        if isinstance(decode_every, bool) or not isinstance(decode_every, int) or decode_every < 1:
            raise ValueError(f"invalid decode_every={decode_every!r}: expected an integer >= 1")
        if isinstance(decode_slack, bool) or not isinstance(decode_slack, int) or decode_slack < 0:
            raise ValueError(f"invalid decode_slack={decode_slack!r}: expected an integer >= 0")
        if not isinstance(compress_sliding, bool):
            raise ValueError(f"invalid compress_sliding={compress_sliding!r}: expected True or False")
        if not isinstance(record_prefill, bool):
            raise ValueError(f"invalid record_prefill={record_prefill!r}: expected True or False")
        require_choice(positions, "positions", Positions)
        require_choice(dense_decode, "dense_decode", DenseDecode)
        if prefill_chunk is not None and (
            isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1
        ):
            raise ValueError(f"invalid prefill_chunk={prefill_chunk!r}: expected an integer >= 1 (tokens), or None")
        if decode_capacity is not None and (
            isinstance(decode_capacity, bool) or not isinstance(decode_capacity, int) or decode_capacity < 1
        ):
            raise ValueError(f"invalid decode_capacity={decode_capacity!r}: expected an integer >= 1 (tokens), or None")
        if decode_capacity is not None and prefill_chunk is not None:
            raise ValueError("decode_capacity (a compiled decode) and prefill_chunk cannot be combined yet")
        if prefill_chunk is not None and positions == CACHE_POSITIONS:
            raise ValueError("prefill_chunk is not supported with positions='cache' (stream token by token instead)")
        check_question_tokens(question_tokens, prefill_chunk, policy)
        if positions == CACHE_POSITIONS and key_rotator is None:
            raise ValueError("positions='cache' needs a key_rotator (use kvhive.make_cache)")
        if positions == CACHE_POSITIONS and type(policy).extra_attention is not Policy.extra_attention:
            raise ValueError(
                f"positions='cache' is not supported by method {policy.name!r}: its estimator "
                "keeps keys outside the cache that cannot be re-indexed"
            )
        refuse_encoder_decoder(config)
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            LayerStore(index, kwargs.get("sliding_window") if "sliding" in layer_type else None)
            for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        super().__init__(layers=layers)
        self.policy = policy
        for store in layers:
            store.new_token_scores_read = policy.reads_newest_token_scores
        self.budget = budget
        self.compress_sliding = compress_sliding
        self.decode_every = decode_every
        self.decode_slack = decode_slack
        self.num_query_heads = text_config.num_attention_heads
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or self.num_query_heads
        self.compressed_layers = [i for i, layer in enumerate(self.layers) if compress_sliding or not layer.is_sliding]
        if policy.phases and not self.compressed_layers:
            # Every layer slides (Mistral with sliding_window set) and keeps its window: the budget
            # would apply to no layer, and the cache would be the model's own under the method's name.
            windows = sorted({layer.sliding_window for layer in self.layers})
            raise ValueError(
                f"method {policy.name!r} at budget {budget_label(budget)} would compress no layer of this model: all "
                f"{len(self.layers)} layers are sliding-window layers (window {', '.join(map(str, windows))}), which "
                "keep their window when compress_sliding=False; pass compress_sliding=True (--compress-sliding) to apply "
                "the budget to them, or use method 'full'"
            )
        # Per compressed layer: the largest row's budget, and every row's (they differ only when a
        # layer-wise split depends on a row's real length).
        self.layer_budgets: dict[int, int] = {}
        self.row_layer_budgets: dict[int, list[int]] = {}
        # Queries and masks of every layer's prefill, kept so one prefill can serve many methods.
        self.record_prefill = record_prefill
        self.prefill_records: dict[int, tuple] = {}
        # Work tensors the method reuses from one layer's prefill to the next (emptied after the
        # last compressed layer's and at the end of the model's forward).
        self.prefill_scratch = PrefillScratch()
        self.positions = positions
        self.key_rotator = key_rotator
        self.dense_decode = dense_decode
        # Layers a prefill-only method cut at prefill, and whether the growth past the budget of
        # a layer it never cut was reported (once per cache).
        self._cut_at_prefill: set[int] = set()
        self._warned_budget_not_kept = False
        # Reuse checks: the attention module of each layer, and the token ids generate fed.
        self._attention_modules: dict[int, weakref.ref] = {}
        # The model this cache was made for, and the last config found to match it (checked once).
        self.model_shape = model_shape(config)
        self._matching_config: weakref.ref | None = None
        self._generated_ids: torch.Tensor | None = None
        self._unattended_update: int | None = None  # a layer updated whose attention has not run yet
        # Chunked prefill: whether the budgets were resolved for the whole prompt (plan_prompt), and
        # on how many tokens they were resolved; the chunk size kvhive.generate feeds the prompt in.
        self._prompt_planned = False
        self._budgets_resolved_on: int | None = None
        self.prefill_chunk = prefill_chunk
        self.decode_capacity = decode_capacity
        # Question-aware chunked prefill: how many of the prompt's last tokens are its question, and
        # how many tokens of the forward now running are a copy of it (set by the prompt's feeder
        # around that forward, 0 otherwise): each layer drops them once its attention ran.
        self.question_tokens = question_tokens
        self.question_copy_tokens = 0
        if decode_capacity is not None and DECODE not in policy.phases:
            for layer in self.layers:
                if not layer.is_sliding:
                    # A layer packed at prefill (head-wise budgets) is laid out with the room for the
                    # decode tokens at once (reserve_decode then finds it there: no second copy).
                    layer.segment_reserve_tokens = max(layer.segment_reserve_tokens, decode_capacity)
        self._compileable = self._static_decode()
        if budget.tokens is not None:
            problem = minimum_budget_problem(policy, budget.tokens)
            if problem is not None:
                raise ValueError(problem)

    # -- budgets (rules in kvhive.cache.budget) ------------------------------------------------
    def budget_problem(self, context_length: int) -> str | None:
        """Why this cache's budget cannot be honoured on a prompt of ``context_length`` tokens
        (a ratio resolving below the method's minimum), or None when it can."""
        return budget_problem(self.policy, self.budget, context_length)

    def _resolve_budgets(self, context_length: int, row_lengths: list[int] | None = None) -> None:
        """Layer budgets, once per cache. A token budget is the same for every row; a ratio resolves
        on each row's real (unpadded) prompt length ``row_lengths``, so a row of a left-padded batch
        keeps what it would keep alone, and so does a layer-wise split (PyramidKV's short-prompt
        rule). A method that also keeps its budget while decoding holds every row of a layer at one
        length, so rows whose ratio resolves to different token counts are refused for it."""
        if self.layer_budgets:
            return
        self._budgets_resolved_on = context_length
        lengths = row_lengths or [context_length]
        row_tokens = []
        for row, length in enumerate(lengths):
            problem = self.budget_problem(length)
            if problem is not None:
                raise ValueError(problem if len(lengths) == 1 else f"row {row} of the batch: {problem}")
            row_tokens.append(self.budget.resolve(length))
        if len(set(row_tokens)) > 1 and DECODE in self.policy.phases:
            raise ValueError(
                f"invalid budget for this batch: ratio={self.budget.ratio:g} of rows with {lengths} real tokens is "
                f"{row_tokens} tokens per head, but method {self.policy.name!r} keeps one budget for every row of a "
                "layer while decoding; give a token budget (budget=N, the same for every row) or batch rows of equal "
                "real length"
            )
        per_row = [
            layer_budgets(self.policy, tokens, len(self.compressed_layers), length)
            for tokens, length in zip(row_tokens, lengths, strict=True)
        ]
        self.row_layer_budgets = {layer: [row[i] for row in per_row] for i, layer in enumerate(self.compressed_layers)}
        self.layer_budgets = {layer: max(budgets) for layer, budgets in self.row_layer_budgets.items()}

    def _row_budgets(self, layer_index: int, batch_size: int) -> list[int]:
        budgets = self.row_layer_budgets[layer_index]
        return budgets if len(budgets) == batch_size else [self.layer_budgets[layer_index]] * batch_size

    @property
    def stores_query_heads(self) -> bool:
        """Whether each query head stores its own copy of its group's keys/values (the policy's
        ``head_granularity``: ``"query"``, or ``"auto"`` on a model with one KV head)."""
        granularity = self.policy.head_granularity
        return self.num_query_heads != self.num_kv_heads and (
            granularity == QUERY_HEADS or (granularity == AUTO_HEADS and self.num_kv_heads == 1)
        )

    @property
    def is_compileable(self) -> bool:
        """Whether ``torch.compile`` may take this cache's decode step (transformers' ``generate``
        then compiles it, on CUDA by default): a static decode layout (:attr:`static_decode`) on a
        torch whose dynamo traces kvhive's attention switch, or inside ``kvhive.compression(model)``
        (``kvhive.static_step.compiles_kvhive``)."""
        return self._compileable and static_step.compiles_kvhive()

    @property
    def static_decode(self) -> bool:
        """Whether the decode step keeps one shape and reads nothing back (the layout a compiled or
        CUDA-graph-captured step needs), whatever the installed torch compiles."""
        return self._compileable

    def _static_decode(self) -> bool:
        """Whether a decode step compiles to one graph that serves every later step, so transformers'
        ``generate`` takes its compiled path (``torch.compile``; CUDA graphs on a GPU): every layer
        holds a fixed number of tokens from one step to the next, in buffers that keep their
        address, and the step reads nothing back. That holds when the method evicts to its budget
        at every step (``Policy.static_decode``) in every layer, at original positions, with one copy
        per KV head (a growing layer may store one per query head); sliding-window layers keep their window in place (``LayerStore.drop_oldest``).
        Layers that grow (the full cache, prefill-only methods) compile with a fixed decode capacity
        (``decode_capacity``: room for that many decode tokens, attention over the whole capacity
        with the empty slots masked); without one they change shape at every step and decode eagerly.
        That holds for head-wise budgets too (Ada-KV: a packed layer, each segment with its own room,
        attention over every page of the buffers with the slots past each segment's length masked),
        except in compressed sliding-window layers, whose packed heads drop tokens outside the window
        by their host-side lengths."""
        policy = self.policy
        # A layer that only grows while decoding (no decode phase) has one shape with a fixed capacity.
        # (A method that does not declare its kept counts may keep different counts per head: packed.)
        declares_counts = not policy.phases or type(policy).kept_per_row is not Policy.kept_per_row
        packed_sliding = not declares_counts and any(
            layer.is_sliding and self.is_compressed(index) for index, layer in enumerate(self.layers)
        )
        grows_in_place = DECODE not in policy.phases and self.decode_capacity is not None and not packed_sliding
        return (
            ((policy.static_decode and DECODE in policy.phases) or grows_in_place)
            and self.positions == ORIGINAL_POSITIONS
            and self.decode_every == 1
            and self.decode_slack == 0
            # One copy per query head (Ada-KV's head_granularity): a decode step repeats the new
            # token's KV heads by a fixed factor, a fixed shape; held to it only for growing layers.
            and (grows_in_place or not self.stores_query_heads)
            # Every full-attention layer keeps a budget; a sliding layer keeps its window.
            and all(self.is_compressed(index) or layer.is_sliding for index, layer in enumerate(self.layers))
        )

    def compile_problem(self, prompt_length: int) -> str | None:
        """Why this cache's decode step would not stay one graph after a prompt of
        ``prompt_length`` tokens, known before the prefill; None when it would (as far as the
        prompt's length tells: ``is_compileable`` is the answer before any prompt).

        A method that holds a layer in a fixed capacity of its own bound (``fixed_decode_capacity``:
        BUZZ, BumbleBee) needs a budget near what the prompt leaves: a budget far above it (more
        than twice the tokens kept plus 64) would be attended in full at every step, so such a
        layer keeps the growing layout instead. Methods that keep ``min(budget, N)`` fill a capacity
        of the budget, capped by ``decode_capacity``, unless they build state at their first
        eviction (``Policy.compiles_below_budget``: SubGen's clusters), which needs a prompt at
        least as long as the budget."""
        if not static_step.compiles_kvhive():
            return (
                f"torch {torch.__version__} does not trace kvhive's attention switch in a compiled step; compile "
                "inside kvhive.compression(model) (kvhive.generate(compile=True) does), use torch >= "
                f"{static_step.COMPILE_MIN_TORCH} (pyproject's floor), or decode without compile"
            )
        if not self._compileable:
            return "its decode step does not compile to one graph"
        if self.layer_budgets:
            budgets = self.layer_budgets
        elif self.budget_problem(prompt_length) is not None:
            return None  # the prefill refuses the budget itself, with its own message
        else:  # what the prefill will resolve, without fixing it now
            tokens = self.budget.resolve(prompt_length)
            per_layer = layer_budgets(self.policy, tokens, len(self.compressed_layers), prompt_length)
            budgets = dict(zip(self.compressed_layers, per_layer, strict=True))
        declares_capacity = type(self.policy).fixed_decode_capacity is not Policy.fixed_decode_capacity
        for index, budget in sorted(budgets.items()):
            kept = min(prompt_length, budget)
            if DECODE in self.policy.phases and kept < budget and not self.policy.compiles_below_budget:
                return (
                    f"a prompt of {prompt_length} tokens leaves layer {index} below its budget of {budget} tokens, "
                    f"and {self.policy.name} builds its state at its first eviction (a new graph); use a budget of at "
                    f"most {prompt_length} tokens, or decode without compile"
                )
            if not declares_capacity and self.decode_capacity is None and budget > 2 * kept + BOUNDED_CAPACITY_SLACK:
                return (
                    f"layer {index}'s budget of {budget} tokens is far above the {kept} a prompt of {prompt_length} "
                    "tokens leaves it, and no decode_capacity caps the capacity it fills while decoding; pass "
                    "decode_capacity=N (the most tokens you will decode), or decode without compile"
                )
            if declares_capacity and budget > 2 * kept + BOUNDED_CAPACITY_SLACK:
                return (
                    f"layer {index}'s budget of {budget} tokens is far above the {kept} a prompt of {prompt_length} "
                    f"tokens leaves it (more than 2 x {kept} + {BOUNDED_CAPACITY_SLACK}): {self.policy.name}'s fixed "
                    "capacity would attend the whole budget at every step; use a budget of at most "
                    f"{2 * kept + BOUNDED_CAPACITY_SLACK} tokens, or decode without compile"
                )
        return None

    def is_compressed(self, layer_index: int) -> bool:
        return layer_index in self.compressed_layers

    # -- phases (called by the attention function) --------------------------------------------
    def after_prefill(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> None:
        """Cut one layer right after its prefill attention ran."""
        try:
            self._after_prefill(layer_index, make_scoring)
        finally:
            # What the compression dropped is freed first, so that a decode capacity is the kept
            # tokens plus its room, not the prompt's buffers (nor shaped by the prompt's length).
            self.layers[layer_index].release_unused()
            self._reserve_decode(self.layers[layer_index])
            if not self.compressed_layers or layer_index >= self.compressed_layers[-1]:
                self.prefill_scratch.clear()  # no later layer reuses it

    def _reserve_decode(self, store: LayerStore) -> None:
        """With a decode capacity, a layer that only grows while decoding gets its room now; in a
        static decode, a layer whose method keeps a varying number of tokens within a bound
        (``Policy.fixed_decode_capacity``) gets exactly that bound plus the new token."""
        if self.decode_capacity is not None and DECODE not in self.policy.phases and not store.is_sliding:
            store.reserve_decode(self.decode_capacity)
            return
        index = store.layer_index
        if (
            not self._compileable
            or self.takes_prompt_chunks  # later chunks grow the layer: it decodes in the growing layout
            or DECODE not in self.policy.phases
            or index not in self.layer_budgets
            or not store.is_initialized
            or not store.is_uniform
            or self._window_within_budget(index, store)
        ):
            return
        keys = store.dense()[0]
        stored, budget = keys.shape[2], self.layer_budgets[index]
        if type(self.policy).fixed_decode_capacity is not Policy.fixed_decode_capacity:
            bound = self.policy.fixed_decode_capacity(keys, budget, store.policy_state)
        elif stored < budget and not self.policy.compiles_below_budget:
            self._compileable = False  # the layer decodes in the growing layout (compile_problem says so)
            return
        else:
            bound = None
            store.fills_to_budget = stored < budget
        if store.fills_to_budget:
            # A prompt shorter than the budget: the layer grows token by token up to its budget,
            # then evicts one token a step. A capacity of the budget plus the new token keeps one
            # shape through both (the method keeps every filled slot while there is room).
            bound = budget
            if self.decode_capacity is not None:
                # No more decode tokens will come than the room asked for (kvhive.generate asks
                # for max_new_tokens): the layer never holds more than it holds now plus that.
                bound = min(bound, stored + self.decode_capacity)
        if bound is None:
            return
        if bound > 2 * stored + BOUNDED_CAPACITY_SLACK and not (store.fills_to_budget and self.decode_capacity):
            # A bound far above what the layer holds (e.g. a budget meant to keep everything) would
            # allocate and attend the whole bound at every step: the layer decodes in the growing
            # layout, and the cache no longer says it compiles (kvhive.generate(compile=True) refuses
            # this before the prefill: compile_problem).
            self._compileable = False
            store.fills_to_budget = False
            return
        store.reserve_decode(max(bound, stored) + 1 - stored, exact=True)

    def _after_prefill(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> None:
        store: LayerStore = self.layers[layer_index]
        if not self.is_compressed(layer_index):
            self._trim_sliding(store)
            self._reindex(store)
            return
        scoring = make_scoring(PREFILL)
        self._resolve_budgets(store.tokens_seen, _real_lengths(scoring))
        if self._window_within_budget(layer_index, store):
            self._trim_sliding(store)
            self._reindex(store)
            return
        row_budgets = self._row_budgets(layer_index, scoring.batch_size)
        if DECODE in self.policy.phases:
            self.policy.initialize_decode(scoring, store.policy_state, budget=self.layer_budgets[layer_index])
        known_count = None
        if len(set(row_budgets)) == 1 and scoring.num_tokens > row_budgets[0]:
            phase = PREFILL if PREFILL in self.policy.phases else DECODE
            known_count = self.policy.kept_per_row(phase, scoring.num_tokens, row_budgets[0], store.policy_state)
        keep = self._select_prefill(scoring, row_budgets, store.policy_state)
        self._store_token_scores(store, scoring)
        if self.stores_query_heads:
            store.expand_to_query_heads(self.num_query_heads // self.num_kv_heads)
        if keep is not None:
            limits = [self.policy.prefill_limit(budget) for budget in row_budgets]
            store.keep(keep, self._kept_counts(keep, store, limits, known_count))
            self._cut_at_prefill.add(layer_index)
            store.settled_tokens = store.tokens_seen  # chosen with every token so far: no crop below this
        self._reindex(store)
        if DECODE in self.policy.phases and self._fills_holes(store):
            # Its decode evictions will write the newest token into the freed slot: the method reads
            # recency by position from the first decode step on (the same answers while the order
            # still holds), so the step that first fills a hole is the graph of every step.
            store.stored_in_order = False

    def _select_prefill(self, scoring: ScoringInputs, row_budgets: list[int], state: dict) -> torch.Tensor | None:
        """The policy's prefill decision, once per distinct row budget (one call unless rows of a
        padded batch got different layer budgets); None when nothing is evicted."""
        keep = None
        for budget in sorted(set(row_budgets)):
            if scoring.num_tokens <= budget:
                continue
            if PREFILL in self.policy.phases:
                part = self.policy.select_prefill(scoring, budget, state)
            elif DECODE in self.policy.phases:
                # A decode-only method sees the prompt as a stream that already overflowed.
                part = self.policy.select_decode(scoring, budget, state)
            else:
                part = None
            if part is None:
                continue
            if len(set(row_budgets)) == 1:
                return part
            rows = torch.tensor([b == budget for b in row_budgets], device=part.device)
            keep = part if keep is None else keep
            keep = torch.where(rows[:, None, None], part, keep)
        if keep is not None:
            # Rows whose budget covers the prompt keep everything.
            covered = torch.tensor([scoring.num_tokens <= b for b in row_budgets], device=keep.device)
            keep = keep | covered[:, None, None]
        return keep

    def after_decode(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> None:
        """Keep the budget while decoding; the policy decides what goes."""
        store: LayerStore = self.layers[layer_index]
        try:
            self._decode_step(layer_index, store, make_scoring)
        finally:
            self._reindex(store)

    def chunk_column_sums_phase(self, layer_index: int) -> str | None:
        """The phase of the scoring that reads the column sums of several new queries' attention
        over this layer (a later chunk of a chunked prefill, or any multi-token forward of a
        decode-phase method) when the method reads them there (``Policy.chunk_column_sums``):
        ``observe_decode``'s (DECODE) or, for a prefill-only method, the decision over kept + new
        tokens of a prompt chunk (PREFILL). The attention then computes the sums with its output, in
        that scoring's order. None: nothing reads them."""
        policy = self.policy
        store = self.layers[layer_index]
        if (
            not policy.chunk_column_sums
            or not self.is_compressed(layer_index)
            or self._window_within_budget(layer_index, store)
        ):
            return None
        if DECODE in policy.phases:
            return DECODE
        if PREFILL in policy.phases and self.takes_prompt_chunks:
            return PREFILL
        return None

    def decode_key_probes(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> KeyProbes | None:
        """Before a decode step's attention over this layer: the stored keys whose products with
        every stored key the method's decision will read (``Policy.decode_key_probes``), for the
        attention to compute with its logits; None where the method asks for none or this step
        decides through another path (a layer the method does not compress, stacked rows of
        different lengths, heads holding different numbers of tokens)."""
        policy = self.policy
        if not policy.takes_key_probes or DECODE not in policy.phases or not self.is_compressed(layer_index):
            return None
        store: LayerStore = self.layers[layer_index]
        budget = self.layer_budgets.get(layer_index)
        if (
            budget is None
            or store.has_row_lengths
            or not store.is_uniform
            or self._window_within_budget(layer_index, store)
        ):
            return None
        return policy.decode_key_probes(make_scoring(DECODE), budget, store.policy_state)

    def _warn_budget_not_kept(self, layer_index: int, store: LayerStore) -> None:
        """Warn (once per cache) when a prefill-only method holds more than its budget without
        ever having compressed this layer: a token-by-token stream, or a prompt that fit the
        budget, gets no compression at all, so the cache is the full cache under the method's name."""
        budget = self.layer_budgets.get(layer_index)
        if torch.compiler.is_compiling():
            return  # a compiled step reads no host length (the warning comes from eager steps)
        if (
            self._warned_budget_not_kept
            or budget is None
            or not self.policy.phases  # full: no budget to keep
            or layer_index in self._cut_at_prefill
            or store.max_length <= budget
        ):
            return
        self._warned_budget_not_kept = True
        phases = ", ".join(sorted(self.policy.phases))
        warnings.warn(
            f"method {self.policy.name!r} compresses only in phase(s) {phases}: layer {layer_index} now holds "
            f"{store.max_length} tokens, over its budget of {budget}, and was never compressed (fed token by token, "
            "or the prompt fit the budget); use a method with a decode phase (e.g. h2o, tova, streamingllm) to "
            "keep a budget while streaming",
            BudgetNotKeptWarning,
            stacklevel=2,
        )

    def after_variable_length_decode(self, layer_index: int) -> None:
        """After a decode step over a layer whose heads hold different counts (no policy step
        there): a compressed sliding layer still never holds more than its window."""
        if self.is_compressed(layer_index):
            self._drop_outside_window(self.layers[layer_index])

    def _decode_step(self, layer_index: int, store: LayerStore, make_scoring) -> None:
        if not self.is_compressed(layer_index) or self._window_within_budget(layer_index, store):
            self._trim_sliding(store)
            return
        if DECODE not in self.policy.phases:
            self._drop_outside_window(store)  # a prefill-only method lets the layer grow while decoding
            if PREFILL in self.policy.phases and store.last_update_tokens > 1 and self.takes_prompt_chunks:
                self._compress_prompt_chunk(layer_index, store, make_scoring)
            self._warn_budget_not_kept(layer_index, store)
            return
        if not store.is_uniform:
            raise RuntimeError(
                f"method {self.policy.name!r} compresses while decoding but layer {layer_index} holds a different "
                "number of tokens per head; combine decode-phase methods with uniform prefill budgets"
            )
        if store.has_row_lengths:  # stacked rows of different lengths (decodes_rows_of_different_lengths)
            self._decode_step_in_rows(layer_index, store, make_scoring)
            return
        if store.bounded_capacity:
            self._decode_step_in_capacity(layer_index, store, make_scoring)
            return
        if not self.layer_budgets:  # (resolved at the prefill: a static step reads no host count)
            self._resolve_budgets(store.tokens_seen)
        budget = self.layer_budgets[layer_index]
        scoring = make_scoring(DECODE)
        # initialize_decode ran in after_prefill (every layer's first forward is its prefill).
        self.policy.observe_decode(scoring, store.policy_state, budget=budget)
        self._store_token_scores(store, scoring)
        store.decode_steps_since_compression += 1
        length = scoring.num_tokens
        if length <= budget + self.decode_slack or store.decode_steps_since_compression < self.decode_every:
            return
        if length == budget + 1 and self._fills_holes(store):
            hole = self._dropped_token(scoring, budget, store)
            if hole is not None:
                store.fill_hole(hole)  # one token per row moved, not the whole kept window
                store.decode_steps_since_compression = 0
                return
        known_count = self.policy.kept_per_row(DECODE, length, budget, store.policy_state)
        keep = self.policy.select_decode(scoring, budget, store.policy_state)
        self._store_token_scores(store, scoring)
        if keep is None:
            return
        counts = self._kept_counts(keep, store, [budget + self.decode_slack] * keep.shape[0], known_count)
        if isinstance(counts, int) and counts == store.dense_length - 1 and self._fills_holes(store):
            store.fill_hole(first_false(keep))  # one token per row moved, not the whole kept window
        else:
            store.keep(keep, counts)
        store.decode_steps_since_compression = 0

    def _dropped_token(self, scoring: ScoringInputs, budget: int, store: LayerStore) -> torch.Tensor | None:
        """A steady step's one dropped token per row, where the method names it
        (``Policy.select_decode_drop``; the per-token scores stored after it), else None (nothing
        decided). Its shape and dtype are checked on the host (no read of its values: an index out
        of range is refused by the move that uses it)."""
        hole = self.policy.select_decode_drop(scoring, budget, store.policy_state)
        if hole is None:
            return None
        if hole.dtype != torch.int64 or tuple(hole.shape) != tuple(scoring.keys.shape[:2]):
            raise TypeError(
                f"{self.policy.name}: select_decode_drop must give one stored index per row and head, a long tensor "
                f"of shape {tuple(scoring.keys.shape[:2])}; got {hole.dtype} of shape {tuple(hole.shape)}"
            )
        self._store_token_scores(store, scoring)
        return hole

    def _observe(self, layer_index: int, store: LayerStore, make_scoring, may_drop_one: bool = False):
        """A fixed-capacity decode step's first method call: observe the new token, its per-token
        scores stored; ``(budget, scoring, hole)``. With ``may_drop_one``, an eager step over a full
        capacity of ``budget + 1`` tokens whose method names its one dropped token gives ``hole``
        (:meth:`_dropped_token`), and there is nothing more to decide."""
        budget = self.layer_budgets[layer_index]
        scoring = make_scoring(DECODE)
        self.policy.observe_decode(scoring, store.policy_state, budget=budget)
        self._store_token_scores(store, scoring)
        if (
            may_drop_one
            and self.policy.drops_at_most_one
            and scoring.known_filled == scoring.num_tokens == budget + 1
            and self._fills_holes(store)
            and not in_static_step()
        ):
            hole = self._dropped_token(scoring, budget, store)
            if hole is not None:
                return budget, scoring, hole
        return budget, scoring, None

    def _select(self, store: LayerStore, scoring: ScoringInputs, budget: int) -> torch.Tensor | None:
        """The method's decision over the whole capacity, its per-token scores stored after it."""
        keep = self.policy.select_decode(scoring, budget, store.policy_state)
        self._store_token_scores(store, scoring)
        return keep

    def _eviction_due(self, store: LayerStore, scoring: ScoringInputs, budget: int) -> torch.Tensor | None:
        """Where a CUDA graph captures this step and records conditional nodes: the method's device
        flag that the decision may evict at this step (``Policy.decode_eviction_due``), on which the
        decision and the compaction become an if-node (``kvhive.static_step.run_if``); None (they run
        at every step) elsewhere, and for a method that may evict at any step."""
        if not captures_conditional_nodes():
            return None
        return self.policy.decode_eviction_due(scoring, budget, store.policy_state)

    def _decode_step_in_capacity(self, layer_index: int, store: LayerStore, make_scoring) -> None:
        """A decode step of a layer held in the fixed capacity its method declared: the method
        observes and decides over the whole capacity at every step (it keeps every filled slot
        when its schedule evicts nothing), and the kept tokens are counted and compacted on the
        device. Fixed shapes, no host read. A captured step records the decision and compaction as
        an if-node where the method flags its eviction steps (:meth:`_eviction_due`)."""
        budget, scoring, hole = self._observe(layer_index, store, make_scoring, may_drop_one=True)
        if hole is not None:  # every slot held a token and one per row goes: it takes the newest token
            store.fill_hole_in_capacity(hole, budget)
            store.decode_steps_since_compression = 0
            return
        run_if(
            self._eviction_due(store, scoring, budget),
            lambda: self._select_and_compact_in_capacity(layer_index, store, scoring, budget),
        )
        store.decode_steps_since_compression = 0

    def _select_and_compact_in_capacity(
        self, layer_index: int, store: LayerStore, scoring: ScoringInputs, budget: int
    ) -> None:
        keep = self._select(store, scoring, budget)
        if keep is None and not in_static_step():
            return  # an eager step the method knows evicts nothing (no compaction)
        if keep is None or keep.dtype != torch.bool or keep.shape != scoring.keys.shape[:3]:
            raise TypeError(
                f"{self.policy.name}: a decision over a fixed capacity must be a boolean mask of shape "
                f"{tuple(scoring.keys.shape[:3])}"
            )
        bound = scoring.num_tokens - 1  # the capacity holds the bound plus the new token
        at_most_one = store.fills_to_budget or self.policy.drops_at_most_one
        fill_hole = at_most_one and self._fills_holes(store)
        if self.policy.drops_at_most_one and scoring.known_filled == scoring.num_tokens:
            # An eager step of a full capacity (the host knows every slot holds a token) of a method
            # that drops at most one token a step and declares its count (kept_per_row; BumbleBee): no
            # empty slot to check or to mask, and the count, checked on the device as the growing
            # layout's is, stays the host length.
            known = self.policy.kept_per_row(DECODE, scoring.num_tokens, budget, store.policy_state)
            if known is not None:
                if known > bound:
                    raise RuntimeError(
                        f"{self.policy.name} declares {known} tokens kept per head in layer {layer_index}, more than "
                        f"the {bound} its fixed_decode_capacity declared"
                    )
                self._assert_kept_count(keep, known, layer_index)
                store.compact_in_place(keep, known, at_most_one_dropped=at_most_one, fill_hole=fill_hole)
                return
        empty = torch.arange(scoring.num_tokens, device=keep.device) >= scoring.filled
        if store.fills_to_budget:
            # A method that keeps min(budget, N) keeps every stored token while they fit the budget
            # (its decision over the capacity knows nothing of the empty slots, and would drop one);
            # once they do not, what it keeps of the filled slots.
            keep = torch.where(scoring.filled <= budget, ~empty, keep & ~empty)
        counts = keep.sum(dim=-1)
        kept = counts.reshape(-1)[0]
        torch._assert_async(
            (counts == kept).all() & (kept <= bound) & ~(keep & empty).any(),
            f"{self.policy.name}: the keep mask of layer {layer_index} keeps an empty slot, different counts per "
            f"head, or more than the {bound} tokens its fixed_decode_capacity declared",
        )
        # Filling to a budget (or a method that says so), a step drops at most one token: the
        # compaction needs no sort, and may write the newest token into the freed slot.
        store.compact_in_place(keep, kept, at_most_one_dropped=at_most_one, fill_hole=fill_hole)

    def _decode_step_in_rows(self, layer_index: int, store: LayerStore, make_scoring) -> None:
        """A decode step of stacked rows holding different numbers of tokens in a layer that evicts
        (``Policy.decodes_rows_of_different_lengths``): the method observes and decides over the
        whole capacity with each row's length (``ScoringInputs.filled`` ``[B, 1, 1]``), and every
        row's kept tokens are counted and compacted on the device, each row its own count. No host
        read: the host lengths are read back when next asked for (a join, accounting). A captured
        step records the decision and compaction as an if-node as in a fixed capacity."""
        budget, scoring, _ = self._observe(layer_index, store, make_scoring)
        run_if(
            self._eviction_due(store, scoring, budget),
            lambda: self._select_and_compact_rows(layer_index, store, scoring, budget),
        )
        store.decode_steps_since_compression = 0

    def _select_and_compact_rows(
        self, layer_index: int, store: LayerStore, scoring: ScoringInputs, budget: int
    ) -> None:
        keep = self._select(store, scoring, budget)
        if keep is None or keep.dtype != torch.bool or keep.shape != scoring.keys.shape[:3]:
            raise TypeError(
                f"{self.policy.name}: a decision over rows of different lengths must be a boolean mask of shape "
                f"{tuple(scoring.keys.shape[:3])}"
            )
        capacity = scoring.num_tokens
        empty = torch.arange(capacity, device=keep.device) >= scoring.filled
        counts = keep.sum(dim=-1)
        kept = counts[:, 0]
        torch._assert_async(
            (counts == kept[:, None]).all() & (kept < capacity).all() & ~(keep & empty).any(),
            f"{self.policy.name}: the keep mask of layer {layer_index} keeps an empty slot, different counts for the "
            f"heads of a row, or more than the {capacity - 1} tokens its fixed_decode_capacity declared",
        )
        store.compact_in_place(keep, kept)

    def _fills_holes(self, store: LayerStore) -> bool:
        """Whether a decode eviction of one token per row may write the newest token into the freed
        slot (``DenseLayerStore.fill_hole``): the method reads no stored order, and nothing else
        does (original positions, not a sliding window, one length for every row)."""
        return (
            not self.policy.reads_stored_order
            and self.positions == ORIGINAL_POSITIONS
            and not store.is_sliding
            and store.is_uniform
            and not store.has_row_lengths
        )

    def _compress_prompt_chunk(self, layer_index: int, store: LayerStore, make_scoring) -> None:
        """A prompt chunk after the first (chunked prefill) for a prefill-only method: the method
        scores kept + new tokens with this chunk's queries (its observation window is the chunk's
        last queries) and keeps its budget, so the layer never holds more than budget + one chunk."""
        if self.budget.ratio is not None and not self._prompt_planned:
            raise ValueError(
                f"ratio={self.budget.ratio:g} was resolved on the first {self._budgets_resolved_on} prompt tokens, but "
                "the prompt came in chunks (chunked prefill): a ratio needs the whole prompt's length; call "
                "cache.plan_prompt(prompt_length) before the first chunk (kvhive.generate(..., prefill_chunk=N) does), "
                "or give a token budget"
            )
        # (A layer of head-wise counts never gets here: update refuses its chunk before storing it.)
        self._resolve_budgets(store.tokens_seen)
        budget = self.layer_budgets[layer_index]
        if store.dense_length <= budget:
            return
        scoring = make_scoring(PREFILL)
        known_count = self.policy.kept_per_row(PREFILL, scoring.num_tokens, budget, store.policy_state)
        keep = self.policy.select_prefill(scoring, budget, store.policy_state)
        self._store_token_scores(store, scoring)
        store.keep(keep, self._kept_counts(keep, store, [budget] * keep.shape[0], known_count))
        self._cut_at_prefill.add(layer_index)
        store.settled_tokens = store.tokens_seen

    @property
    def takes_prompt_chunks(self) -> bool:
        """Whether a multi-token forward after the first is a chunk of the prompt, compressed as it
        comes (``prefill_chunk`` given, or ``plan_prompt`` called). Otherwise it is a continuation
        (e.g. a multiple-choice answer scored over the compressed prompt) that a prefill-only method
        leaves uncompressed, as before chunked prefill existed."""
        return self.prefill_chunk is not None or self._prompt_planned

    def plan_prompt(self, prompt_length: int, row_lengths: list[int] | None = None) -> None:
        """Resolve the budgets for a prompt of ``prompt_length`` tokens (each row's real length in
        ``row_lengths`` for a left-padded batch) before it is fed in chunks: a ratio is of the whole
        prompt, not of its first chunk. Once per cache, before its first forward."""
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 1:
            raise ValueError(f"invalid prompt_length={prompt_length!r}: expected an integer >= 1")
        if self.layer_budgets or any(layer.is_initialized for layer in self.layers):
            raise ValueError("plan_prompt must be called on an empty cache, before the prompt's first chunk")
        if self.question_tokens is not None and self.question_tokens >= prompt_length:
            raise ValueError(
                f"invalid question_tokens={self.question_tokens}: expected fewer than the prompt's {prompt_length} "
                "tokens (the question is the prompt's last part; the context before it is what the chunks compress)"
            )
        if self.policy.phases:
            self._resolve_budgets(prompt_length, row_lengths)
        self._prompt_planned = True

    def drop_question_copy(self, layer_index: int) -> int:
        """Question-aware chunked prefill: forget the copy of the question the forward now running
        appended to this layer after its chunk (its last ``question_copy_tokens`` entries), once the
        layer's attention ran; the layer has then seen only the prompt up to the chunk's end, and the
        next chunk continues at the position right after it. Returns how many were dropped (0 when
        this forward carries no copy). Called by the attention before the layer's decision, which
        then scores with the copy's queries (``kvhive.attention.integration``)."""
        count = self.question_copy_tokens
        if count:
            # Nothing of this forward was evicted yet: the newest entries are the copy's.
            self.layers[layer_index].drop_newest(count)
        return count

    # -- re-indexed positions ------------------------------------------------------------------
    def _position_cap(self) -> float:
        """The most tokens any layer can hold, so re-indexed positions stay below it."""
        caps = []
        for index, layer in enumerate(self.layers):
            if index in self.layer_budgets:
                caps.append(self.layer_budgets[index] + self.decode_slack + self.decode_every - 1)
            elif layer.is_sliding and not self.is_compressed(index):
                caps.append(layer.sliding_window - 1)
            else:
                return float("inf")
        return max(caps) if caps else float("inf")

    def _next_position(self, tokens_seen: int) -> int:
        return int(min(tokens_seen, self._position_cap()))

    def _reindex(self, store: LayerStore) -> None:
        """Re-rotate kept keys to sit just before the next query's position."""
        if self.positions != CACHE_POSITIONS or store.num_stored == 0:
            return
        keys, _, original_positions, scores = store.dense()
        length = keys.shape[2]
        # Tokens appended since the last re-indexing were rotated at the position the model was
        # given for them (get_seq_length at that forward); older ones sit where we put them.
        given = self._next_position(store.rope_tokens_seen) + (original_positions - store.rope_tokens_seen)
        current = given.to(torch.float32)
        if ROPE_POSITION in scores:
            is_new = original_positions >= store.rope_tokens_seen
            current = torch.where(is_new, current, scores[ROPE_POSITION])
        next_position = self._next_position(store.tokens_seen)
        target = torch.arange(next_position - length, next_position, dtype=torch.float32, device=keys.device)
        delta = target - current
        if bool((delta != 0).any()):
            store.set_keys(self.key_rotator.rotate(store.layer_index, keys, delta))
        store.set_token_scores(ROPE_POSITION, target.expand(keys.shape[:3]))
        store.rope_tokens_seen = store.tokens_seen

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if query_length == 1 and self._compileable:
            # A static decode step masks its stored tokens itself (padding recorded at prefill), so
            # the mask transformers builds for it is a fixed, unused column instead of one that
            # grows with every token seen (a new graph at every step).
            return 1, 0
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if (
            self.positions == ORIGINAL_POSITIONS
            and layer is not None
            and layer.is_initialized
            and layer.is_uniform
            and not layer.has_padding
        ):
            # After an unpadded prompt kvhive's attention masks by the stored positions and ignores
            # the model's mask (see kvhive_attention): the mask transformers builds need only span
            # the new tokens, not every token seen (which grows without bound in a long stream).
            return query_length, layer.tokens_seen
        return self.mask_sizes_over_positions(query_length, layer_idx)

    def mask_sizes_over_positions(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The mask size over every original position (what the attention gathers kept tokens from)."""
        if self.positions == CACHE_POSITIONS:
            return self.get_seq_length(layer_idx) + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)

    @staticmethod
    def _store_token_scores(store: LayerStore, scoring: ScoringInputs) -> None:
        """Write back the per-token scores a policy set, so eviction keeps them aligned."""
        for name, score in scoring.token_scores.items():
            # (No .to for a float32 score: a call per score and step that changes nothing.)
            store.set_token_scores(name, score if score.dtype == torch.float32 else score.to(torch.float32))

    def _trim_sliding(self, store: LayerStore) -> None:
        """A sliding layer keeps the last ``window - 1`` tokens, as transformers' own cache does."""
        if not store.is_sliding or store.num_stored == 0:
            return
        if store.is_uniform:
            # An uncompressed layer holds its tokens contiguously, newest last: drop the oldest
            # (host-side arithmetic, no device read-back).
            store.drop_oldest(store.dense_length - (store.sliding_window - 1))
            return
        store.keep(store.stored_flat_positions() >= store.tokens_seen - store.sliding_window + 1)

    def _window_within_budget(self, layer_index: int, store: LayerStore) -> bool:
        """A compressed sliding layer whose budget reaches its window: the window bounds it more
        tightly than the budget, so it keeps exactly the window, as the model's own cache does
        (the outputs are the same: tokens beyond the window are masked)."""
        budget = self.layer_budgets.get(layer_index)
        # A method that never evicts (full) keeps what it is given: shared_prefill records with it.
        return (
            store.is_sliding and bool(self.policy.phases) and budget is not None and budget >= store.sliding_window - 1
        )

    def _drop_outside_window(self, store: LayerStore) -> None:
        """Forget tokens of a compressed sliding layer that no later query can attend, once it
        holds more than its window (its heads may hold different positions)."""
        if not store.is_sliding or store.num_stored == 0 or store.max_length <= store.sliding_window - 1:
            return
        store.keep(store.stored_flat_positions() >= store.tokens_seen - store.sliding_window + 1)

    def _kept_counts(
        self, keep: torch.Tensor, store: LayerStore, row_budgets: list[int], known_count: int | None
    ) -> torch.Tensor | int:
        """What ``store.keep`` needs to lay out the kept tokens: the count every row keeps when the
        policy declared it (``kept_per_row``; checked on the device without waiting for the check),
        else the counts per row ``[B, H]`` read back once (:meth:`_check_keep`)."""
        if keep.dtype != torch.bool:
            raise TypeError(f"{self.policy.name}: a keep mask must be boolean, got {keep.dtype}")
        if known_count is None or not store.is_uniform:
            return self._check_keep(keep, store, row_budgets)
        if known_count > min(row_budgets):
            raise RuntimeError(
                f"{self.policy.name} declares {known_count} tokens kept per head in layer {store.layer_index}, "
                f"over its budget of {min(row_budgets)}"
            )
        self._assert_kept_count(keep, known_count, store.layer_index)
        return known_count

    def _assert_kept_count(self, keep: torch.Tensor, known: int, layer_index: int) -> None:
        """Check on the device that every row of ``keep`` keeps the ``known`` tokens the method's
        ``kept_per_row`` declared: asynchronous on a GPU (a mismatch stops the device, an error at the
        next synchronisation) instead of every step waiting for the host to read the counts."""
        torch._assert_async(
            (keep.sum(dim=-1) == known).all(),
            f"{self.policy.name}: the keep mask of layer {layer_index} does not keep the {known} tokens per head "
            "its kept_per_row declared",
        )

    def _check_keep(self, keep: torch.Tensor, store: LayerStore, row_budgets: list[int]) -> torch.Tensor:
        """Kept tokens per row ``[B, H]`` (read back once, on the host); refuses a mask over budget."""
        counts = keep.sum(dim=-1).cpu()
        kept_per_sequence = counts.reshape(counts.shape[0], -1).sum(-1)
        allowed = torch.tensor(row_budgets) * keep.shape[1]
        over = kept_per_sequence > allowed
        if bool(over.any()):
            row = int(over.nonzero()[0])
            raise RuntimeError(
                f"{self.policy.name} kept {int(kept_per_sequence[row])} tokens per sequence in layer "
                f"{store.layer_index}, over its budget of {int(allowed[row])}"
            )
        return counts

    # -- transformers' Cache API ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_reuse(key_states, layer_idx)
        if self._unattended_update is not None:
            raise ValueError(
                f"layer {self._unattended_update} of this cache was updated but kvhive's attention did not run: the "
                "model using it runs another attention implementation (another model than the one given to "
                "kvhive.make_cache?); make a cache per model with kvhive.make_cache(model, ...)"
            )
        store: LayerStore = self.layers[layer_idx]
        if key_states.shape[2] > 1 and store.is_initialized and store.row_tokens_seen_device is not None:
            raise ValueError(
                "a stacked cache (KVHiveCache.stack) decodes one token per row per forward: its rows are at different "
                f"positions; got {key_states.shape[2]} tokens per row"
            )
        if (
            key_states.shape[2] > 1
            and self.takes_prompt_chunks
            and store.is_initialized
            and not store.is_uniform
            and self.is_compressed(layer_idx)
            and DECODE not in self.policy.phases
        ):
            # Refused before anything is stored, so the cache stays usable.
            raise ValueError(
                f"method {self.policy.name!r} holds a different number of tokens per head in layer {layer_idx}: a "
                "prompt chunk after the first cannot be scored over head-wise budgets yet; give the prompt in one "
                "forward (no prefill chunking) for this method, or decode token by token"
            )
        self._unattended_update = layer_idx
        keys, values = store.update(key_states, value_states)
        # The attention function runs next; the cache hands itself over through transformers' kwargs.
        mark_update(self, layer_idx, keys, kwargs)
        return keys, values

    # -- model guards (kvhive.cache.guards) -----------------------------------------------------------
    # The guards' functions themselves: the attention and the generation hook call these at every
    # decode step, so a method that only forwarded to them would cost an extra call each time.
    _check_reuse = guards.check_reuse
    check_model = guards.check_model
    check_attention_module = guards.check_attention_module
    check_generation_inputs = guards.check_generation_inputs

    # -- batch rows (beam search, contrastive search, batch slicing: kvhive.cache.batching) ------------
    _batch_size = batching.batch_size

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes row ``beam_idx[i]``."""
        batching.select_rows(self, row_index(beam_idx, self._batch_size()))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (row numbers, or a boolean mask over the rows)."""
        batching.select_rows(self, row_index(indices, self._batch_size()))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"invalid repeats={repeats!r}: expected an integer >= 1")
        batching.select_rows(self, torch.arange(self._batch_size()).repeat_interleave(repeats))

    @property
    def is_croppable(self) -> bool:
        """Whether :meth:`crop` can roll the newest tokens back (transformers' assisted decoding asks
        after the prefill): no eviction while decoding, one count for every head and row, and no
        sliding window already full (its oldest tokens would go with the drafts)."""
        if DECODE in self.policy.phases:
            return False
        return all(
            layer.is_uniform
            and not layer.has_row_lengths
            and not (layer.is_sliding and layer.tokens_seen >= layer.sliding_window - 1)
            for layer in self.layers
            if layer.is_initialized
        )

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back the newest tokens, as assisted / speculative decoding does with rejected drafts.

        Supported where nothing is evicted while decoding (the full cache and the prefill-only
        methods: the drafts were only appended); every layer is checked before any is changed."""
        if DECODE in self.policy.phases:
            # A draft token may have made the method evict a prompt token or move its scores; no
            # crop can undo that, so the result would not be what the method keeps.
            raise ValueError(
                f"method {self.policy.name!r} evicts while decoding, so its cache cannot be rolled back (cropped): "
                "assisted or speculative decoding (assistant_model=, prompt_lookup_num_tokens=) would keep tokens "
                "chosen with the rejected drafts. Generate without an assistant, or use a method that compresses "
                "only the prompt (full, snapkv, pyramidkv, knorm)"
            )
        for layer in self.layers:
            problem = layer.crop_problem(tokens_to_remove)
            if problem is not None:
                raise ValueError(problem)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    # -- caches prefilled separately, decoded together (kvhive.cache.batching) --------------------------
    # Fixed batch slots (stack(batch_slots=...)): whether each slot holds a running row (host), or
    # None for a cache whose rows are not slots.
    _slots: list[bool] | None = None

    @property
    def is_stacked(self) -> bool:
        """Whether the rows have seen different numbers of tokens (made by :meth:`stack`)."""
        return any(layer.is_initialized and layer.row_tokens_seen_device is not None for layer in self.layers)

    @classmethod
    def stack(
        cls,
        caches: list[KVHiveCache],
        decode_capacity: int | None = None,
        batch_slots: int | None = None,
        slot_capacity: int | None = None,
    ) -> KVHiveCache:
        """One batch cache whose rows are the rows of ``caches`` (caches of one model and one
        method, prefilled separately), in order; the inputs are left as they were. With
        ``batch_slots`` the rows past those given are free slots that rows leave (:meth:`free_slots`)
        and join (:meth:`fill_slots`) in place. Layouts, refusals and slots:
        :func:`kvhive.cache.batching.stack`."""
        return batching.stack(KVHiveCache, caches, decode_capacity, batch_slots, slot_capacity)

    def add_rows(self, caches: list[KVHiveCache], decode_capacity: int | None = None) -> None:
        """Append the rows of ``caches`` (each prefilled, e.g. a request joining a batch that is
        decoding) after this cache's rows, in place: ``KVHiveCache.stack([self, *caches])`` with
        the same checks and refusals, taken by this object (a caller holding it keeps its
        reference). Every layer's buffers are laid out again (:func:`kvhive.cache.batching.add_rows`)."""
        batching.add_rows(KVHiveCache, self, caches, decode_capacity)

    @property
    def is_slotted(self) -> bool:
        """Whether the rows are fixed batch slots (``KVHiveCache.stack(batch_slots=...)``)."""
        return self._slots is not None

    @property
    def active_slots(self) -> list[bool]:
        """Fixed batch slots: whether each slot holds a running row (host)."""
        return batching.active_slots(self)

    def free_slots(self, slots: list[int]) -> None:
        """Fixed batch slots: the rows in ``slots`` leave (finished requests). Nothing moves; the
        slots decode a placeholder until :meth:`fill_slots` gives them a new row."""
        batching.free_slots(self, slots)

    def fill_slots(self, slots: list[int], caches: list[KVHiveCache]) -> None:
        """Fixed batch slots: the rows of ``caches`` (each prefilled alone; their rows in order) take
        the free ``slots``, copied into the buffers in place: no buffer is reallocated and the decode
        step keeps its shape and graph. The checks and refusals are :meth:`stack`'s; a row must also
        fit its slot. Everything is checked before anything changes
        (:func:`kvhive.cache.batching.fill_slots`)."""
        batching.fill_slots(KVHiveCache, self, slots, caches)

    def row_tokens_seen(self, layer_idx: int = 0) -> list[int]:
        """Tokens seen by each batch row of a layer (they differ in a stacked cache, :meth:`stack`)."""
        return self.layers[layer_idx].row_tokens_seen

    def next_position_ids(self) -> torch.Tensor:
        """``[B, 1]`` position ids of each row's next token (original positions), on the cache's
        device: what a stacked cache's next decode step passes as ``position_ids``, its rows being at
        different positions. Read from the first layer's device counters, so nothing is read back to
        the host (a decode loop asks for it at every step)."""
        layer = self.layers[0]
        if self.positions != ORIGINAL_POSITIONS or not layer.is_initialized:
            raise ValueError("next_position_ids: expected a prefilled cache at positions='original'")
        if layer.row_tokens_seen_device is not None:
            return layer.row_tokens_seen_device[:, None].clone()
        return layer.tokens_seen_device.expand(layer.batch_size, 1).clone()

    def get_seq_length(self, layer_idx: int = 0) -> int | torch.Tensor:
        """The true number of tokens seen (``positions="cache"``: the next re-indexed position);
        a device tensor inside a compiled step."""
        if layer_idx >= len(self.layers):
            return 0
        if in_static_step() and self.positions == ORIGINAL_POSITIONS:
            # A compiled step reads the device counter (see LayerStore.tokens_seen).
            return self.layers[layer_idx].get_seq_length() if self.layers[layer_idx].is_initialized else 0
        tokens_seen = self.layers[layer_idx].tokens_seen
        if self.positions == CACHE_POSITIONS:
            return self._next_position(tokens_seen)
        return tokens_seen

    # -- accounting ----------------------------------------------------------------------------
    def kept_tokens(self) -> dict[int, torch.Tensor]:
        """Stored tokens per layer as ``[B, H]`` (H = stored heads), on the host."""
        return {i: layer.lengths_host for i, layer in enumerate(self.layers) if layer.is_initialized}

    def mean_kept_per_head(self) -> float:
        """Tokens held per stored head, averaged over the compressed layers (0 before prefill)."""
        lengths = [self.layers[i].lengths_host for i in self.compressed_layers if self.layers[i].is_initialized]
        if not lengths:
            return 0.0
        return float(torch.stack([length.float().mean() for length in lengths]).mean())

    def nbytes(self) -> int:
        """Key/value bytes of the kept tokens of every layer (sliding layers included)."""
        return sum(layer.nbytes() for layer in self.layers)

    def reserved_nbytes(self) -> int:
        """Key/value bytes allocated (kept tokens plus each layer's append reserve)."""
        return sum(layer.reserved_nbytes() for layer in self.layers)

    def metadata_nbytes(self) -> int:
        return sum(layer.metadata_nbytes() for layer in self.layers)

    def policy_state_nbytes(self) -> int:
        """Bytes the method holds beside the cached tokens (SubGen's estimator structures)."""
        return sum(self.policy.state_nbytes(layer.policy_state) for layer in self.layers)

    def full_cache_nbytes(self) -> int:
        """Bytes an uncompressed transformers cache would hold for the same tokens.

        Sliding layers count their window, as transformers' own cache keeps only that.
        """
        total = 0
        for layer in self.layers:
            if not layer.is_initialized or layer.nbytes() == 0:
                continue
            # Each row's own count (rows of a stacked cache have seen different numbers of tokens).
            rows = layer.row_tokens_seen
            if layer.is_sliding:
                rows = [min(tokens, layer.sliding_window - 1) for tokens in rows]
            total += sum(rows) * layer.bytes_per_token() * self.num_kv_heads
        return total

    def budget_label(self) -> str:
        """The budget as given, unambiguous: "ratio 1" and "1 tok" are different budgets."""
        if not self.policy.phases:
            return "none (keeps every token)"
        return budget_label(self.budget)

    def statistics(self) -> dict:
        kept = self.kept_tokens()
        return {
            "method": self.policy.name,
            "budget": self.budget_label(),
            "layer_budgets": {str(k): v for k, v in self.layer_budgets.items()},
            "layer_budgets_per_row": {str(k): v for k, v in self.row_layer_budgets.items()},
            "tokens_seen": self.get_seq_length(),
            "kept_tokens_total": int(sum(int(v.sum()) for v in kept.values())),
            "kept_tokens_per_layer": {str(i): v.tolist() for i, v in kept.items()},
            "cache_bytes": self.nbytes(),
            "reserved_bytes": self.reserved_nbytes(),
            "metadata_bytes": self.metadata_nbytes(),
            "policy_state_bytes": self.policy_state_nbytes(),
            "full_cache_bytes": self.full_cache_nbytes(),
        }

    # -- copies ----------------------------------------------------------------------------------
    # Shared, not copied: weak references to the model's modules and config (a copy serves the
    # same model) and the key rotator (read-only frequencies).
    _SHARED_BY_COPIES = ("_attention_modules", "_matching_config", "key_rotator")

    def __deepcopy__(self, memo: dict) -> KVHiveCache:
        """An independent copy for the same model (transformers' prompt-reuse pattern: fill a cache
        with a shared prefix once, ``copy.deepcopy`` it for each continuation)."""
        import copy

        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            if name in self._SHARED_BY_COPIES:
                value = dict(value) if isinstance(value, dict) else value
            else:
                value = copy.deepcopy(value, memo)
            object.__setattr__(copied, name, value)
        return copied

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "a KVHiveCache cannot be pickled or shallow-copied: it belongs to one model in this process (it holds "
            "weak references to its attention layers). copy.deepcopy(cache) gives an independent copy for the same "
            "model; in another process, make a cache there with kvhive.make_cache(model, ...) and run the prompt again"
        )
