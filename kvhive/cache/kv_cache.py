"""``KVHiveCache``: a transformers ``Cache`` whose layers keep a budget chosen by a policy.

The cache owns storage, budgets and phases; it asks the policy (through the generic
:class:`~kvhive.methods.base.Policy` interface) which tokens to keep and never knows which
method it runs. The attention function (``kvhive.attention``) calls :meth:`after_prefill` and
:meth:`after_decode` right after a layer's attention, so each layer is cut as soon as its own
prefill is done and peak memory stays at one uncompressed layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import fields

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from kvhive import static_step
from kvhive.cache import batching, guards
from kvhive.cache.budget import Budget, budget_label, budget_problem, minimum_budget_problem, row_budgets
from kvhive.cache.compressor import Compressor, drop_outside_window
from kvhive.cache.guards import model_shape
from kvhive.cache.guards import refuse_encoder_decoder as refuse_encoder_decoder  # (re-exported: kvhive.api)
from kvhive.cache.handoff import active_update as active_update  # (re-exported: kvhive.attention)
from kvhive.cache.handoff import mark_update
from kvhive.cache.layers.quantized import install_codecs, refuse_quantized_rows
from kvhive.cache.layout_plan import (
    BOUNDED_CAPACITY_SLACK,
    LayoutPlan,
    compile_problem,
    hole_filling_layers,
    reserve_packed_room,
    static_decode,
)
from kvhive.cache.options import (
    CACHE_POSITIONS,
    ORIGINAL_POSITIONS,
    BudgetNotKeptWarning,
    CacheOptions,
    DenseDecode,
    Positions,
    check_question_tokens,
)
from kvhive.cache.positions import ROPE_POSITION, next_position
from kvhive.cache.storage import LayerStore, row_index
from kvhive.cache.traits import MethodTraits
from kvhive.methods.base import (
    AUTO_HEADS,
    QUERY_HEADS,
    KeyProbes,
    Policy,
    PrefillScratch,
    ScoringInputs,
)

# Names other modules import from here (their home is the module named above).
__all__ = [
    "BOUNDED_CAPACITY_SLACK",
    "CACHE_POSITIONS",
    "ORIGINAL_POSITIONS",
    "ROPE_POSITION",
    "BudgetNotKeptWarning",
    "DenseDecode",
    "KVHiveCache",
    "Positions",
    "active_update",
    "check_question_tokens",
    "mark_update",
    "model_shape",
    "refuse_encoder_decoder",
]

# PADDING_SCORE (kvhive.cache.storage): per-token flag (1.0) of left padding, recorded at prefill
# when the batch is padded (kept aligned by the store; appended tokens get 0: real, whatever the
# method reads).


def layer_stores(text_config) -> list[LayerStore]:
    """One store per decoder layer of ``text_config``, a sliding layer's with its window."""
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    return [
        LayerStore(index, kwargs.get("sliding_window") if "sliding" in layer_type else None)
        for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
    ]


class KVHiveCache(Cache):
    """A cache that applies ``policy`` to keep ``budget`` tokens per head.

    The cache is the transformers-facing container; its jobs live in their own modules:
    ``options`` (:class:`~kvhive.cache.options.CacheOptions`, checked once), ``traits`` (the method's
    phases and capabilities, :class:`~kvhive.cache.traits.MethodTraits`), budgets
    (:mod:`kvhive.cache.budget`), ``layout_plan`` (whether the decode step is static and the layout
    each layer decodes in, :mod:`kvhive.cache.layout_plan`) and ``compressor`` (the method applied
    after each layer's attention, :mod:`kvhive.cache.compressor`).

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
        kv_bits: store the kept keys and values as int8 (8) or packed int4 (4) codes with scales
            (``kvhive/cache/layers/quantized.py``); None keeps the model's dtype.
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
        kv_bits: int | None = None,
    ) -> None:
        options = CacheOptions(
            budget, compress_sliding, decode_every, decode_slack, record_prefill, positions, dense_decode,
            prefill_chunk, decode_capacity, question_tokens,
        )  # fmt: skip
        traits = MethodTraits.of(policy)
        options.check_for(policy, traits, key_rotator)
        refuse_encoder_decoder(config)
        text_config = config.get_text_config(decoder=True)
        layers = layer_stores(text_config)
        super().__init__(layers=layers)
        self.kv_bits = install_codecs(layers, kv_bits, positions)
        self.policy = policy
        self.traits = traits
        for store in layers:
            store.new_token_scores_read = traits.reads_newest_token_scores
        # The options as attributes (stacking and fixed slots change some; ``options`` reads them back).
        for option in fields(CacheOptions):
            setattr(self, option.name, getattr(options, option.name))
        self.key_rotator = key_rotator
        self.num_query_heads = text_config.num_attention_heads
        self.num_kv_heads = getattr(text_config, "num_key_value_heads", None) or self.num_query_heads
        self.compressed_layers = [i for i, layer in enumerate(self.layers) if compress_sliding or not layer.is_sliding]
        if traits.compresses and not self.compressed_layers:
            self._refuse_all_sliding()
        # Per compressed layer: the largest row's budget, and every row's (they differ only when a
        # layer-wise split depends on a row's real length). Resolved at the first prefill.
        self.layer_budgets: dict[int, int] = {}
        self.row_layer_budgets: dict[int, list[int]] = {}
        # Queries and masks of every layer's prefill, kept so one prefill can serve many methods.
        self.prefill_records: dict[int, tuple] = {}
        # Work tensors the method reuses from one layer's prefill to the next (emptied after the
        # last compressed layer's and at the end of the model's forward).
        self.prefill_scratch = PrefillScratch()
        # Layers a prefill-only method cut at prefill, and whether the growth past the budget of
        # a layer it never cut was reported (once per cache).
        self.cut_at_prefill: set[int] = set()
        self.warned_budget_not_kept = False
        # Reuse checks: the attention module of each layer, and the token ids generate fed.
        self.attention_modules: dict[int, weakref.ref] = {}
        # The model this cache was made for, and the last config found to match it (checked once).
        self.model_shape = model_shape(config)
        self.matching_config: weakref.ref | None = None
        self.generated_ids: torch.Tensor | None = None
        self.unattended_update: int | None = None  # a layer updated whose attention has not run yet
        # Chunked prefill: whether the budgets were resolved for the whole prompt (plan_prompt), and
        # on how many tokens they were resolved.
        self.prompt_planned = False
        self.budgets_resolved_on: int | None = None
        # Question-aware chunked prefill: how many tokens of the forward now running are a copy of
        # the question (set by the prompt's feeder around that forward, 0 otherwise): each layer
        # drops them once its attention ran.
        self.question_copy_tokens = 0
        self.slots_held: list[bool] | None = None  # fixed batch slots: each one's row running (host)
        reserve_packed_room(self)
        self.compressor = Compressor(policy, traits, self.compressed_layers, hole_filling_layers(self))
        self.layout_plan = LayoutPlan(static_decode(self))
        problem = None if options.budget.tokens is None else minimum_budget_problem(policy, options.budget.tokens)
        if problem is not None:
            raise ValueError(problem)

    def _refuse_all_sliding(self) -> None:
        # Every layer slides (Mistral with sliding_window set) and keeps its window: the budget
        # would apply to no layer, and the cache would be the model's own under the method's name.
        windows = sorted({layer.sliding_window for layer in self.layers})
        raise ValueError(
            f"method {self.policy.name!r} at budget {budget_label(self.budget)} would compress no layer of this model: "
            f"all {len(self.layers)} layers are sliding-window layers (window {', '.join(map(str, windows))}), which "
            "keep their window when compress_sliding=False; pass compress_sliding=True (--compress-sliding) to apply "
            "the budget to them, or use method 'full'"
        )

    @property
    def options(self) -> CacheOptions:
        """The cache's options as they are now (stacking and fixed batch slots change some)."""
        return CacheOptions(**{option.name: getattr(self, option.name) for option in fields(CacheOptions)})

    # -- budgets (rules in kvhive.cache.budget) ------------------------------------------------
    def budget_problem(self, context_length: int) -> str | None:
        """Why this cache's budget cannot be honoured on a prompt of ``context_length`` tokens
        (a ratio resolving below the method's minimum), or None when it can."""
        return budget_problem(self.policy, self.budget, context_length)

    def _resolve_budgets(self, context_length: int, row_lengths: list[int] | None = None) -> None:
        self.compressor.resolve_budgets(self, context_length, row_lengths)

    def _row_budgets(self, layer_index: int, batch_size: int) -> list[int]:
        return row_budgets(self.layer_budgets, self.row_layer_budgets, layer_index, batch_size)

    @property
    def stores_query_heads(self) -> bool:
        """Whether each query head stores its own copy of its group's keys/values (the policy's
        ``head_granularity``: ``"query"``, or ``"auto"`` on a model with one KV head)."""
        granularity = self.traits.head_granularity
        return self.num_query_heads != self.num_kv_heads and (
            granularity == QUERY_HEADS or (granularity == AUTO_HEADS and self.num_kv_heads == 1)
        )

    # -- the decode layout (kvhive.cache.layout_plan) ------------------------------------------
    @property
    def is_compileable(self) -> bool:
        """Whether ``torch.compile`` may take this cache's decode step (:attr:`static_decode`), as
        transformers' ``generate`` reads it: its compiled forward switches the attention before the
        call on every torch (``kvhive.attention.hooks``). A compiled step of one's own needs a torch
        that traces the switch or ``kvhive.compression(model)`` (``kvhive.static_step.compiles_kvhive``)."""
        return self.layout_plan.compileable

    @property
    def static_decode(self) -> bool:
        """Whether the decode step keeps one shape and reads nothing back (``layout_plan.static_decode``)."""
        return self.layout_plan.compileable

    def compile_problem(self, prompt_length: int) -> str | None:
        """Why this cache's decode step would not stay one graph after a prompt of
        ``prompt_length`` tokens, known before the prefill; None when it would (as far as the
        prompt's length tells: ``is_compileable`` is the answer before any prompt). See
        :func:`kvhive.cache.layout_plan.compile_problem`."""
        return compile_problem(self, prompt_length)

    def is_compressed(self, layer_index: int) -> bool:
        return layer_index in self.compressor.compressed

    # -- phases (called by the attention function; kvhive.cache.compressor) ---------------------
    def after_prefill(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> None:
        """Cut one layer right after its prefill attention ran."""
        self.compressor.after_prefill(self, layer_index, make_scoring)

    def after_decode(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> None:
        """Keep the budget while decoding; the policy decides what goes."""
        self.compressor.after_decode(self, layer_index, make_scoring)

    def after_variable_length_decode(self, layer_index: int) -> None:
        """After a decode step over a layer whose heads hold different counts (no policy step
        there): a compressed sliding layer still never holds more than its window."""
        if layer_index in self.compressor.compressed:
            drop_outside_window(self.layers[layer_index])

    def chunk_column_sums_phase(self, layer_index: int) -> str | None:
        """The phase of the scoring that reads the column sums of several new queries' attention
        over this layer (a later chunk of a chunked prefill, or any multi-token forward of a
        decode-phase method) when the method reads them there (``Policy.chunk_column_sums``):
        ``observe_decode``'s (DECODE) or, for a prefill-only method, the decision over kept + new
        tokens of a prompt chunk (PREFILL). The attention then computes the sums with its output, in
        that scoring's order. None: nothing reads them."""
        return self.compressor.chunk_column_sums_phase(self, layer_index)

    def decode_key_probes(self, layer_index: int, make_scoring: Callable[[str], ScoringInputs]) -> KeyProbes | None:
        """Before a decode step's attention over this layer: the keys whose products with every stored
        key the method's decision reads (``Policy.decode_key_probes``); None where it reads none."""
        if not self.traits.takes_key_probes or not self.traits.has_decode:
            return None
        return self.compressor.decode_key_probes(self, layer_index, make_scoring)

    # -- chunked and question-aware prefill ----------------------------------------------------
    @property
    def takes_prompt_chunks(self) -> bool:
        """Whether a multi-token forward after the first is a chunk of the prompt, compressed as it
        comes (``prefill_chunk`` given, or ``plan_prompt`` called). Otherwise it is a continuation
        (e.g. a multiple-choice answer scored over the compressed prompt) that a prefill-only method
        leaves uncompressed, as before chunked prefill existed."""
        return self.prefill_chunk is not None or self.prompt_planned

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
        if self.traits.compresses:
            self.compressor.resolve_budgets(self, prompt_length, row_lengths)
        self.prompt_planned = True

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

    # -- positions -----------------------------------------------------------------------------
    def _next_position(self, tokens_seen: int) -> int:
        return next_position(self, tokens_seen)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The mask transformers builds: a fixed unused column in a static decode step, the new tokens only
        after an unpadded prompt at original positions, else every original position (kvhive.attention.masks)."""
        if query_length == 1 and self.layout_plan.compileable:
            return 1, 0
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is not None and layer.is_initialized and layer.is_uniform and not layer.has_padding:
            if self.positions == ORIGINAL_POSITIONS:
                return query_length, layer.tokens_seen
        return self.mask_sizes_over_positions(query_length, layer_idx)

    def mask_sizes_over_positions(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """The mask size over every original position (what the attention gathers kept tokens from)."""
        if self.positions == CACHE_POSITIONS:
            return self.get_seq_length(layer_idx) + query_length, 0
        return super().get_mask_sizes(query_length, layer_idx)

    # -- transformers' Cache API ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # A steady eager step (one token per row of the shape the layer's last full check passed, the
        # previous layer's attention ran) needs no check; any other update is checked in full first.
        if self.unattended_update is not None or layer_idx >= len(self.layers) or torch.compiler.is_compiling():
            self._check_update(key_states, layer_idx)
        elif key_states.shape != self.layers[layer_idx].steady_key_shape:
            self._check_update(key_states, layer_idx)
        self.unattended_update = layer_idx
        keys, values = self.layers[layer_idx].update(key_states, value_states)
        # The attention function runs next; the cache hands itself over through transformers' kwargs.
        mark_update(self, layer_idx, keys, kwargs)
        return keys, values

    def _check_update(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """Refuse, before anything is stored, new tokens the layer cannot take (another model's shapes,
        another batch size, a layer left unattended, tokens a filled layer cannot continue with); a
        decode token that passes gives the layer's steady shape."""
        self._check_reuse(key_states, layer_idx)
        if self.unattended_update is not None:
            self._refuse_unattended_update()
        store: LayerStore = self.layers[layer_idx]
        if key_states.shape[2] > 1 and store.is_initialized:
            self._check_continuation(store, key_states.shape[2])
        if key_states.shape[2] == 1 and store.is_initialized and not torch.compiler.is_compiling():
            store.steady_key_shape = key_states.shape

    def _refuse_unattended_update(self) -> None:
        raise ValueError(
            f"layer {self.unattended_update} of this cache was updated but kvhive's attention did not run: the "
            "model using it runs another attention implementation (another model than the one given to "
            "kvhive.make_cache?); make a cache per model with kvhive.make_cache(model, ...)"
        )

    def _check_continuation(self, store: LayerStore, new_tokens: int) -> None:
        """Refuse, before anything is stored (so the cache stays usable), several new tokens per row
        that a filled layer cannot take."""
        if store.row_tokens_seen_device is not None:
            raise ValueError(
                "a stacked cache (KVHiveCache.stack) decodes one token per row per forward: its rows are at different "
                f"positions; got {new_tokens} tokens per row"
            )
        layer_idx = store.layer_index
        if (
            self.takes_prompt_chunks
            and not store.is_uniform
            and layer_idx in self.compressor.compressed
            and not self.traits.has_decode
        ):
            raise ValueError(
                f"method {self.policy.name!r} holds a different number of tokens per head in layer {layer_idx}: a "
                "prompt chunk after the first cannot be scored over head-wise budgets yet; give the prompt in one "
                "forward (no prefill chunking) for this method, or decode token by token"
            )

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
        if self.traits.has_decode:
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
        if self.traits.has_decode:
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
        refuse_quantized_rows(caches)
        return batching.stack(KVHiveCache, caches, decode_capacity, batch_slots, slot_capacity)

    def add_rows(self, caches: list[KVHiveCache], decode_capacity: int | None = None) -> None:
        """Append the rows of ``caches`` (each prefilled, e.g. a request joining a batch that is
        decoding) after this cache's rows, in place: ``KVHiveCache.stack([self, *caches])`` with
        the same checks and refusals, taken by this object (a caller holding it keeps its
        reference). Every layer's buffers are laid out again (:func:`kvhive.cache.batching.add_rows`)."""
        refuse_quantized_rows([self, *caches])
        batching.add_rows(KVHiveCache, self, caches, decode_capacity)

    @property
    def is_slotted(self) -> bool:
        """Whether the rows are fixed batch slots (``KVHiveCache.stack(batch_slots=...)``)."""
        return self.slots_held is not None

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
        a device tensor inside a compiled step (``LayerStore.get_seq_length``)."""
        if layer_idx >= len(self.layers):
            return 0
        layer = self.layers[layer_idx]
        if self.positions == CACHE_POSITIONS:
            return self._next_position(layer.tokens_seen)
        if static_step.in_static_step():
            return layer.seen.device if layer.is_initialized else 0
        return layer.tokens_seen

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
        """What the cache holds: kept tokens per layer, bytes of every layer (sliding-window ones
        included) and, ``held_fraction_of_full``, those bytes over the full cache's for the same
        tokens (None before a prefill)."""
        kept = self.kept_tokens()
        held, full = self.nbytes(), self.full_cache_nbytes()
        return {
            "method": self.policy.name,
            "budget": self.budget_label(),
            "layer_budgets": {str(k): v for k, v in self.layer_budgets.items()},
            "layer_budgets_per_row": {str(k): v for k, v in self.row_layer_budgets.items()},
            "tokens_seen": self.get_seq_length(),
            "kept_tokens_total": int(sum(int(v.sum()) for v in kept.values())),
            "kept_tokens_per_layer": {str(i): v.tolist() for i, v in kept.items()},
            "cache_bytes": held,
            "reserved_bytes": self.reserved_nbytes(),
            "metadata_bytes": self.metadata_nbytes(),
            "policy_state_bytes": self.policy_state_nbytes(),
            "full_cache_bytes": full,
            "held_fraction_of_full": held / full if full else None,
            "kv_bits": self.kv_bits,
        }

    # -- copies ----------------------------------------------------------------------------------
    # Shared, not copied: weak references to the model's modules and config (a copy serves the
    # same model) and the key rotator (read-only frequencies).
    _SHARED_BY_COPIES = ("attention_modules", "matching_config", "key_rotator")

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
