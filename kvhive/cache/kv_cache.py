"""``KVHiveCache``: a transformers ``Cache`` whose layers keep a budget chosen by a policy.

The cache owns storage, budgets and phases; it asks the policy (through the generic
:class:`~kvhive.methods.base.Policy` interface) which tokens to keep and never knows which
method it runs. The attention function (``kvhive.attention``) calls :meth:`after_prefill` and
:meth:`after_decode` right after a layer's attention, so each layer is cut as soon as its own
prefill is done and peak memory stays at one uncompressed layer.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import fields

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from kvhive import static_step
from kvhive.cache.budget import Budget, budget_label, budget_problem, minimum_budget_problem, row_budgets
from kvhive.cache.compressor import Compressor, drop_outside_window
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
    DECODE,
    QUERY_HEADS,
    KeyProbes,
    Policy,
    PrefillScratch,
    ScoringInputs,
)
from kvhive.static_step import in_static_step

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

# The key under which ``update`` hands the attention function its cache and layer through
# transformers' per-layer kwargs (transformers >= 5.24 passes the attention's kwargs to
# ``Cache.update``; the same dict is then unpacked into the attention call).
UPDATE_KWARG = "kvhive_layer"

# Older transformers (no kwargs reach ``update``): the last update of each thread, held weakly so a
# dead cache is never kept alive and threads never see each other's caches.
_thread_updates = threading.local()


def active_update(keys: torch.Tensor, attention_kwargs: dict) -> tuple[KVHiveCache | None, int | None]:
    """The cache and layer whose ``update`` just returned ``keys``, or ``(None, None)``.

    transformers does not pass the cache object to attention functions; it passes ``update`` the
    kwargs it will give the attention, so the cache puts itself there (:func:`mark_update`). On
    versions that do not, the thread's last update is matched by the identity of the returned keys.
    """
    handed = attention_kwargs.pop(UPDATE_KWARG, None)
    if handed is not None:
        return handed
    last = getattr(_thread_updates, "last", None)
    if last is None:
        return None, None
    cache_ref, layer_index, keys_ref = last
    if keys_ref() is keys:
        _thread_updates.last = None
        return cache_ref(), layer_index
    return None, None


def mark_update(cache, layer_index: int, keys: torch.Tensor, update_kwargs: dict) -> None:
    """Record that ``cache.update`` for ``layer_index`` just returned ``keys`` (read back by
    :func:`active_update` in kvhive's attention). ``update_kwargs`` are the kwargs ``update`` got."""
    layer_kwargs = update_kwargs.get("kwargs")
    if isinstance(layer_kwargs, dict):
        layer_kwargs[UPDATE_KWARG] = (cache, layer_index)
        return
    _thread_updates.last = (weakref.ref(cache), layer_index, weakref.ref(keys))


def model_shape(config) -> dict:
    """What a cache depends on in the model it is made for (host-side ints, read from the config):
    the layer count, each layer's kind (its sliding window, or None for full attention), query
    heads, KV heads and head dimension. A cache refuses a model whose shape differs."""
    text_config = config.get_text_config(decoder=True)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
    query_heads = text_config.num_attention_heads
    return {
        "layers": len(layer_types),
        "sliding windows": tuple(
            kwargs.get("sliding_window") if "sliding" in layer_type else None
            for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True)
        ),
        "query heads": query_heads,
        "KV heads": getattr(text_config, "num_key_value_heads", None) or query_heads,
        "head dimension": getattr(text_config, "head_dim", None) or text_config.hidden_size // query_heads,
    }


def _describe_windows(windows: tuple) -> str:
    """``(8, 8, 8, None)`` -> ``"3 sliding (window 8), 1 full"``, in order of first appearance."""
    counts: dict = {}
    for window in windows:
        counts[window] = counts.get(window, 0) + 1
    return ", ".join(f"{n} full" if w is None else f"{n} sliding (window {w})" for w, n in counts.items())


def refuse_encoder_decoder(config) -> None:
    """kvhive's caches serve decoder-only models: an encoder-decoder model (T5, BART) holds a
    cross-attention cache beside the self-attention one, which no method here compresses."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"encoder-decoder models are not supported (this is a {type(config).__name__}): kvhive compresses "
            "the KV cache of decoder-only causal LMs (Llama, Qwen, Mistral, Gemma, ...)"
        )


def _row_views(layer: LayerStore) -> list[tuple]:
    """``(keys, values, positions, token_scores)`` of each batch row of a dense layer, ``[1, H, L_b, ...]``
    views of its own ``L_b`` stored tokens (a layer of rows of different lengths holds row ``b``
    in slots ``[0, L_b)`` of a common capacity; the slots past it are empty)."""
    keys, values, positions, scores = layer.dense()
    lengths = layer._row_lengths or [layer.dense_length] * layer.batch_size
    return [
        (
            keys[row : row + 1, :, :length],
            values[row : row + 1, :, :length],
            positions[row : row + 1, :, :length],
            {name: score[row : row + 1, :, :length] for name, score in scores.items()},
        )
        for row, length in enumerate(lengths)
    ]


def _row_states(policy: Policy, layer: LayerStore) -> list[dict]:
    """The method's per-layer state of each batch row of ``layer`` (a layer of one row: its state as
    it is, so a method that refuses stacking says why in ``stack_states``)."""
    if layer.batch_size == 1:
        return [layer.policy_state]
    try:
        return [
            policy.select_state_rows(layer.policy_state, torch.tensor([row]), layer.num_heads)
            for row in range(layer.batch_size)
        ]
    except NotImplementedError as error:
        raise ValueError(f"method {policy.name!r} cannot stack caches of several rows: {error}") from None


def _budgets_of_rows(caches: list[KVHiveCache], layer: int, default: int | None) -> list[int | None]:
    """Layer ``layer``'s budget for every row of ``caches`` in order (a cache's own per-row budgets,
    else its layer budget, else ``default``)."""
    return [
        budget
        for cache in caches
        for budget in (
            cache._row_budgets(layer, cache._batch_size())
            if layer in cache.row_layer_budgets
            else [cache.layer_budgets.get(layer, default)] * cache._batch_size()
        )
    ]


def _without_unit_dims(shape: torch.Size) -> tuple[int, ...]:
    return tuple(size for size in shape if size != 1)


def _adopt_in_place(old: dict, new: dict) -> None:
    """Make the state dict ``old`` equal ``new`` keeping ``old``'s objects where they fit: a tensor
    of the same shape (up to unit dimensions), dtype and device is overwritten in place (its address stays, as a captured
    decode step needs); anything else is replaced."""

    def adopt(previous, value):
        if isinstance(value, torch.Tensor):
            if (
                isinstance(previous, torch.Tensor)
                and _without_unit_dims(previous.shape) == _without_unit_dims(value.shape)
                and previous.dtype == value.dtype
                and previous.device == value.device
            ):
                # (A method may lay a per-row counter out as [B] when stacking and [B, 1, 1] once
                # decoding, BUZZ's: the same values.)
                previous.copy_(value.reshape(previous.shape))
                return previous
            return value
        if isinstance(value, dict) and isinstance(previous, dict):
            _adopt_in_place(previous, value)
            return previous
        if isinstance(value, list) and isinstance(previous, list) and len(value) == len(previous):
            previous[:] = [adopt(p, v) for p, v in zip(previous, value, strict=True)]
            return previous
        params = getattr(type(value), "__dataclass_params__", None)
        if type(previous) is type(value) and params is not None and not params.frozen:
            # A method's own record of tensors (BumbleBee's StreamingSummary): field by field.
            for name, field in vars(value).items():
                setattr(previous, name, adopt(getattr(previous, name, None), field))
            return previous
        return value

    for key in [key for key in old if key not in new]:
        del old[key]
    for key, value in new.items():
        old[key] = adopt(old.get(key), value)


def _copy_without_layers(cache: KVHiveCache) -> KVHiveCache:
    """A deep copy of ``cache``'s settings and method, sharing none of its stored tokens: the layers
    and prefill records are replaced by the caller, so copying their buffers would only cost memory
    (a running batch's whole cache, at every join)."""
    import copy

    skipped = {id(cache.layers): [], id(cache.prefill_records): {}}
    return copy.deepcopy(cache, skipped)


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
        options = CacheOptions(
            budget, compress_sliding, decode_every, decode_slack, record_prefill, positions, dense_decode,
            prefill_chunk, decode_capacity, question_tokens,
        )  # fmt: skip
        traits = MethodTraits.of(policy)
        options.check_for(policy, traits, key_rotator)
        refuse_encoder_decoder(config)
        text_config = config.get_text_config(decoder=True)
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers = [
            LayerStore(index, kwargs.get("sliding_window") if "sliding" in layer_type else None)
            for index, (layer_type, kwargs) in enumerate(zip(layer_types, layer_kwargs, strict=True))
        ]
        super().__init__(layers=layers)
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
        # on how many tokens they were resolved.
        self._prompt_planned = False
        self._budgets_resolved_on: int | None = None
        # Question-aware chunked prefill: how many tokens of the forward now running are a copy of
        # the question (set by the prompt's feeder around that forward, 0 otherwise): each layer
        # drops them once its attention ran.
        self.question_copy_tokens = 0
        reserve_packed_room(self)
        self.compressor = Compressor(policy, traits, self.compressed_layers, hole_filling_layers(self))
        self.layout_plan = LayoutPlan(static_decode(self))
        if options.budget.tokens is not None:
            problem = minimum_budget_problem(policy, options.budget.tokens)
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
        """Whether ``torch.compile`` may take this cache's decode step (:attr:`static_decode` on a
        torch that traces kvhive's attention switch, ``kvhive.static_step.compiles_kvhive``)."""
        return self.layout_plan.compileable and static_step.compiles_kvhive()

    @property
    def static_decode(self) -> bool:
        """Whether the decode step keeps one shape and reads nothing back (``layout_plan.static_decode``)."""
        return self.layout_plan.compileable

    @property
    def _compileable(self) -> bool:
        return self.layout_plan.compileable

    @_compileable.setter
    def _compileable(self, value: bool) -> None:
        self.layout_plan.compileable = value

    def _static_decode(self) -> bool:
        return static_decode(self)

    def _reserve_decode(self, store: LayerStore) -> None:
        self.layout_plan.reserve_decode(self, store)

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
        if self.traits.compresses:
            self.compressor.resolve_budgets(self, prompt_length, row_lengths)
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

    # -- positions -----------------------------------------------------------------------------
    def _next_position(self, tokens_seen: int) -> int:
        return next_position(self, tokens_seen)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if query_length == 1 and self.layout_plan.compileable:
            # A static decode step masks its stored tokens itself (padding recorded at prefill): the
            # mask transformers builds for it is a fixed, unused column, not one growing every step.
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

    # -- transformers' Cache API ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._check_reuse(key_states, layer_idx)
        if self._unattended_update is not None:
            self._refuse_unattended_update()
        store: LayerStore = self.layers[layer_idx]
        if key_states.shape[2] > 1 and store.is_initialized:
            self._check_continuation(store, key_states.shape[2])
        self._unattended_update = layer_idx
        keys, values = store.update(key_states, value_states)
        # The attention function runs next; the cache hands itself over through transformers' kwargs.
        mark_update(self, layer_idx, keys, kwargs)
        return keys, values

    def _refuse_unattended_update(self) -> None:
        raise ValueError(
            f"layer {self._unattended_update} of this cache was updated but kvhive's attention did not run: the "
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

    # -- batch rows (beam search, contrastive search, batch slicing) -----------------------------
    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (host 1-D long; may repeat or reorder) in every layer: its
        stored tokens, per-token scores, per-row counters and the method's per-layer state. The
        method's state is selected first, so a method that cannot leaves the cache unchanged."""
        initialized = [layer for layer in self.layers if layer.is_initialized]
        if not initialized:
            return
        for layer in initialized:
            layer.check_rows_selectable(self.policy.name)
        batch = initialized[0].batch_size
        rows = index.tolist()
        if rows and (min(rows) < 0 or max(rows) >= batch):
            raise IndexError(f"batch row index {rows} out of range for a batch of {batch} row(s)")
        states = [self.policy.select_state_rows(layer.policy_state, index, layer.num_heads) for layer in initialized]
        for layer, state in zip(initialized, states, strict=True):
            layer.select_rows(index)
            layer.policy_state = state
        self.row_layer_budgets = {
            layer: [budgets[row] for row in rows] if len(budgets) == batch else budgets
            for layer, budgets in self.row_layer_budgets.items()
        }
        if self._generated_ids is not None and self._generated_ids.shape[0] == batch:
            self._generated_ids = self._generated_ids.index_select(0, index.to(self._generated_ids.device))
        if self.is_slotted:  # rows were selected: no longer the fixed slots
            self._slots = False
            for layer in initialized:
                layer.row_active, layer.row_active_device, layer.grows_in_slots = None, None, False

    def _batch_size(self) -> int:
        return next((layer.batch_size for layer in self.layers if layer.is_initialized), 0)

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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes row ``beam_idx[i]``."""
        self._select_rows(row_index(beam_idx, self._batch_size()))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (row numbers, or a boolean mask over the rows)."""
        self._select_rows(row_index(indices, self._batch_size()))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (``[a, b] -> [a, a, b, b]``)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"invalid repeats={repeats!r}: expected an integer >= 1")
        self._select_rows(torch.arange(self._batch_size()).repeat_interleave(repeats))

    # -- caches prefilled separately, decoded together ------------------------------------------
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
        """One batch cache whose rows are the rows of ``caches``, in order (every row of
        ``caches[0]``, then of ``caches[1]``, ...): caches of one model and one method (same options
        and budget), prefilled separately, e.g. from prompts of different lengths. A cache may hold
        one row or several (a batch prefilled together without padding, or a stacked cache that is
        decoding: a request joining a running batch, :meth:`add_rows`). The inputs are left as they
        were (the rows are copied into new buffers).

        Each row keeps the tokens it has seen (``row_tokens_seen``; new tokens get each row's own
        next position, which the caller passes as ``position_ids``: ``kvhive.generate_batch``) and
        its kept tokens. A layer whose rows keep equal counts is the usual dense layout; rows of
        different counts (the full cache, prefill-only methods, a prompt shorter than the budget)
        fill slots of a common capacity (the longest row + ``decode_capacity``, growing past it)
        with a per-row length, the empty slots masked. A stacked cache decodes one token per row
        per forward, eagerly.

        Refused with a ValueError naming the reason: caches of different models, methods, options,
        budgets, dtypes or devices; empty or unprefilled caches; a batch of several rows with left
        padding (its rows' positions count the padding); re-indexed positions; head-wise counts
        (Ada-KV's packed layout); a layer that evicts while decoding (or slides) whose rows keep
        different counts, unless its method ``decodes_rows_of_different_lengths`` (BUZZ: such a layer
        keeps a length per row in a capacity bounded by ``fixed_decode_capacity``); a method whose
        per-layer state cannot be stacked (``Policy.stack_states``; every registered method can).

        **Fixed batch slots** (``batch_slots=S``, at least the rows given): the buffers hold ``S``
        rows from the start; the rows past those given are free slots. Rows then leave
        (:meth:`free_slots`) and join (:meth:`fill_slots`) in place: no buffer is reallocated, every
        address stays, and the decode step keeps one shape (a free slot keeps decoding a
        placeholder; its outputs mean nothing). Every layer takes the static decode layout: an
        evicting layer its fixed capacity, a growing layer (the full cache, prefill-only methods)
        ``slot_capacity`` tokens per row (default: the longest row + ``decode_capacity``), which a
        row joining later must fit with all its decode steps. The decode step of such a cache
        reads nothing back and compiles to one graph (``is_compileable``) where the method's does."""
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
        if decode_capacity is not None and (
            isinstance(decode_capacity, bool) or not isinstance(decode_capacity, int) or decode_capacity < 0
        ):
            raise ValueError(f"invalid decode_capacity={decode_capacity!r}: expected an integer >= 0 (tokens), or None")
        first = caches[0]
        for number, cache in enumerate(caches):
            if not isinstance(cache, KVHiveCache):
                raise ValueError(f"caches[{number}]: expected a KVHiveCache, got {type(cache).__name__}")
            cls._check_stackable(first, cache, number)
        rows_given = sum(cache._batch_size() for cache in caches)
        if batch_slots is not None and (
            isinstance(batch_slots, bool) or not isinstance(batch_slots, int) or batch_slots < rows_given
        ):
            raise ValueError(
                f"invalid batch_slots={batch_slots!r}: expected an integer >= {rows_given} (the rows given), or None"
            )
        if slot_capacity is not None and (
            batch_slots is None
            or isinstance(slot_capacity, bool)
            or not isinstance(slot_capacity, int)
            or slot_capacity < 1
        ):
            raise ValueError(
                f"invalid slot_capacity={slot_capacity!r}: expected an integer >= 1 (tokens per row) with batch_slots, "
                "or None"
            )
        free = 0 if batch_slots is None else batch_slots - rows_given
        policy = first.policy
        room = decode_capacity if decode_capacity is not None else 64
        new_layers = []
        for index, layer in enumerate(first.layers):
            sources = [cache.layers[index] for cache in caches]
            # One state per row. The tokens seen passed with each state are those of the layer it
            # came from (its ``sequence_length``, the most any of its rows has seen): a stacked
            # row's state may be relative to it (AhaKV's padding), and the method re-bases it on
            # the most any source has seen, which becomes the new layer's count.
            states, state_seen = [], []
            for source in sources:
                states.extend(_row_states(policy, source))
                state_seen.extend([source.tokens_seen] * source.batch_size)
            # Free slots start as copies of the first row: real tokens, so a free slot's placeholder
            # decode computes finite values.
            states, state_seen = states + [states[0]] * free, state_seen + [state_seen[0]] * free
            state = policy.stack_states(states, state_seen)  # a method may refuse first
            row_seen = [seen for source in sources for seen in source.row_tokens_seen]
            rows = [view for source in sources for view in _row_views(source)]
            row_seen, rows = row_seen + [row_seen[0]] * free, rows + [rows[0]] * free
            lengths = [int(view[0].shape[2]) for view in rows]
            evicts = (index in first.compressed_layers and DECODE in policy.phases) or layer.is_sliding
            # A method whose rows may hold different lengths while it evicts (BUZZ's per-row
            # schedule): every such layer keeps a length per row, equal or not, in a bounded capacity.
            per_row = evicts and not layer.is_sliding and policy.decodes_rows_of_different_lengths
            if len(set(lengths)) > 1 and evicts and not per_row:
                why = "slides (keeps its window)" if layer.is_sliding else f"evicts while decoding ({policy.name!r})"
                raise ValueError(
                    f"cannot stack these caches: layer {index} {why} and its rows keep different numbers of tokens "
                    f"{lengths} (prompts shorter than the budget or the window); a layer that evicts while decoding "
                    "keeps one length for every row: give prompts longer than the budget, or decode them alone"
                )
            steps = {source.decode_steps_since_compression for source in sources}
            if len(steps) > 1:
                raise ValueError(
                    f"cannot stack these caches: layer {index} compressed {sorted(steps)} steps ago in different rows "
                    "(decode_every/decode_slack keep one schedule per layer)"
                )
            row_capacity = None
            if batch_slots is not None and not evicts:
                row_capacity = slot_capacity if slot_capacity is not None else max(lengths) + room
            store = LayerStore(layer.layer_index, layer.sliding_window)
            store.new_token_scores_read = layer.new_token_scores_read
            store.set_rows(
                [view[0] for view in rows],
                [view[1] for view in rows],
                [view[2] for view in rows],
                [view[3] for view in rows],
                row_seen,
                room,
                per_row_lengths=per_row,
                row_capacity=row_capacity,
            )
            store.tokens_seen = max(state_seen)  # the count every row's state is now relative to
            store.policy_state = state
            if per_row:
                budget = first.layer_budgets[index]
                bound = policy.fixed_decode_capacity(store.dense()[0], budget, state)
                if bound is None:
                    raise ValueError(
                        f"cannot stack these caches: method {policy.name!r} declares no bound for layer {index}'s rows"
                    )
                store.reserve_rows(max(bound, max(lengths)) + 1)  # the bound plus the new token
            store.has_padding = any(source.has_padding for source in sources)
            store.stored_in_order = all(source.stored_in_order for source in sources)
            store.heads_per_kv_head = layer.heads_per_kv_head
            store.decode_steps_since_compression = layer.decode_steps_since_compression
            store.last_update_tokens = 1
            new_layers.append(store)
        stacked = _copy_without_layers(first)
        stacked.layers = new_layers
        stacked.row_layer_budgets = {
            layer: _budgets_of_rows(caches, layer, first_budget) for layer, first_budget in first.layer_budgets.items()
        }
        stacked.row_layer_budgets = {
            layer: budgets + [budgets[0]] * free for layer, budgets in stacked.row_layer_budgets.items()
        }
        stacked.layer_budgets = {layer: max(budgets) for layer, budgets in stacked.row_layer_budgets.items()}
        stacked._cut_at_prefill = set.intersection(*(set(cache._cut_at_prefill) for cache in caches))
        stacked.prefill_records = {}
        stacked.record_prefill = False
        stacked._generated_ids = None
        stacked._unattended_update = None
        stacked._prompt_planned = False
        stacked._budgets_resolved_on = max(cache.layers[0].tokens_seen for cache in caches)
        stacked.prefill_chunk = None
        stacked.question_tokens = None
        stacked.decode_capacity = None
        stacked._compileable = False  # per-row lengths and counts live on the host: eager decode
        stacked._slots = False
        if batch_slots is not None:
            stacked._make_slots(caches, rows_given, decode_capacity)
        return stacked

    # -- fixed batch slots ---------------------------------------------------------------------------
    def _make_slots(self, caches: list[KVHiveCache], rows_given: int, decode_capacity: int | None) -> None:
        """Lay a freshly stacked cache out in fixed batch slots: the first ``rows_given`` rows run,
        the others are free; every layer in its static decode layout."""
        self.decode_capacity = decode_capacity
        if DECODE in self.policy.phases:
            # What the prefill of each cache found (a layer below its budget, a bound far above it).
            self._compileable = all(cache._compileable for cache in caches) and self._static_decode()
        else:
            self._compileable = decode_capacity is not None and self._static_decode()
        self._active_slots = [row < rows_given for row in range(self._batch_size())]
        for store in self.layers:
            if self._compileable and DECODE in self.policy.phases and not store.has_row_lengths:
                self._reserve_decode(store)  # (a layer of per-row lengths has its bound already)
            store.set_active_rows(self._active_slots)
        self._slots = True

    @property
    def is_slotted(self) -> bool:
        """Whether the rows are fixed batch slots (``KVHiveCache.stack(batch_slots=...)``)."""
        return getattr(self, "_slots", False)

    @property
    def active_slots(self) -> list[bool]:
        """Fixed batch slots: whether each slot holds a running row (host)."""
        if not self.is_slotted:
            raise ValueError("this cache has no fixed batch slots: stack(..., batch_slots=N) makes them")
        return list(self._active_slots)

    def _check_slots(self, slots, want_active: bool) -> list[int]:
        if not self.is_slotted:
            raise ValueError("this cache has no fixed batch slots: stack(..., batch_slots=N) makes them")
        count = self._batch_size()
        if not isinstance(slots, (list, tuple)) or not all(
            isinstance(slot, int) and not isinstance(slot, bool) for slot in slots
        ):
            raise ValueError(f"invalid slots={slots!r}: expected a list of slot numbers in [0, {count})")
        if len(set(slots)) != len(slots) or any(not 0 <= slot < count for slot in slots):
            raise ValueError(f"invalid slots={slots!r}: expected distinct slot numbers in [0, {count})")
        active = self.active_slots
        wrong = [slot for slot in slots if active[slot] != want_active]
        if wrong:
            state = "free" if want_active else "running"
            raise ValueError(f"slot(s) {wrong} are not {'running' if want_active else 'free'} (they are {state})")
        return list(slots)

    def _trust_the_device(self) -> None:
        """Before a leave or a join: the host mirrors of the layers' counters are read back from the
        device when next asked for (steps replayed from a CUDA graph advance only the device)."""
        for store in self.layers:
            store.trust_the_device()

    def free_slots(self, slots: list[int]) -> None:
        """Fixed batch slots: the rows in ``slots`` leave (finished requests). Nothing moves; the
        slots decode a placeholder until :meth:`fill_slots` gives them a new row."""
        slots = self._check_slots(slots, want_active=True)
        self._trust_the_device()
        for slot in slots:
            self._active_slots[slot] = False
        for store in self.layers:
            store.set_active_rows(self._active_slots)

    def fill_slots(self, slots: list[int], caches: list[KVHiveCache]) -> None:
        """Fixed batch slots: the rows of ``caches`` (each prefilled alone, e.g. requests joining a
        running batch; their rows in order) take the free ``slots``, copied into the buffers in
        place: no buffer is reallocated and the decode step keeps its shape and graph. The checks
        and refusals are :meth:`stack`'s; a row must also fit its slot (a growing layer's
        ``slot_capacity``; an evicting layer's one length). Everything is checked before anything
        changes."""
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
        slots = self._check_slots(slots, want_active=False)
        self._trust_the_device()
        for number, cache in enumerate(caches):
            if not isinstance(cache, KVHiveCache):
                raise ValueError(f"caches[{number}]: expected a KVHiveCache, got {type(cache).__name__}")
            self._check_stackable(self, cache, number)
        rows = sum(cache._batch_size() for cache in caches)
        if rows != len(slots):
            raise ValueError(f"{len(slots)} slot(s) {slots} for {rows} joining row(s): give one slot per row")
        policy = self.policy
        plans = []
        for index, layer in enumerate(self.layers):
            sources = [cache.layers[index] for cache in caches]
            views = [view for source in sources for view in _row_views(source)]
            seen = [count for source in sources for count in source.row_tokens_seen]
            steps = {source.decode_steps_since_compression for source in sources}
            if steps != {layer.decode_steps_since_compression}:
                raise ValueError(
                    f"cannot join these caches: layer {index} compressed {sorted(steps)} steps ago, the running "
                    f"rows {layer.decode_steps_since_compression} (decode_every/decode_slack keep one schedule per layer)"
                )
            for view in views:
                length = int(view[0].shape[2])
                if layer.has_row_lengths:
                    if length > layer.buffers()[0].shape[2]:
                        raise ValueError(
                            f"cannot join: a row holds {length} tokens in layer {index}, more than its slot capacity "
                            f"of {layer.buffers()[0].shape[2]}; give a larger slot_capacity"
                        )
                elif length != layer.dense_length:
                    raise ValueError(
                        f"cannot join: a row holds {length} tokens in layer {index}, where every running row holds "
                        f"{layer.dense_length}; a layer that evicts while decoding keeps one length for every row "
                        "(give prompts longer than the budget, or decode them alone)"
                    )
            states = _row_states(policy, layer)
            state_seen = [layer.tokens_seen] * len(states)
            joining = [(state, source.tokens_seen) for source in sources for state in _row_states(policy, source)]
            for slot, (state, count) in zip(slots, joining, strict=True):
                states[slot], state_seen[slot] = state, count
            state = policy.stack_states(states, state_seen)
            if (
                layer.bounded_capacity
                and not layer.has_row_lengths
                and type(policy).fixed_decode_capacity is not Policy.fixed_decode_capacity
            ):
                # The layer decodes in the fixed capacity its method declared: the stacked state
                # gets the device counters that declaration set up (as at stacking, _reserve_decode).
                policy.fixed_decode_capacity(layer.buffers()[0], self.layer_budgets[index], state)
            plans.append((layer, views, seen, state, max(state_seen), sources))
        for layer, views, seen, state, most_seen, sources in plans:
            for slot, view, count in zip(slots, views, seen, strict=True):
                layer.write_row(slot, *view, count)
            _adopt_in_place(layer.policy_state, state)
            layer.tokens_seen = most_seen
            layer.has_padding = layer.has_padding or any(source.has_padding for source in sources)
            layer.stored_in_order = layer.stored_in_order and all(source.stored_in_order for source in sources)
        joining_budgets = {layer: _budgets_of_rows(caches, layer, None) for layer in self.row_layer_budgets}
        for layer, budgets in self.row_layer_budgets.items():
            for slot, budget in zip(slots, joining_budgets[layer], strict=True):
                budgets[slot] = budget
        self.layer_budgets = {layer: max(budgets) for layer, budgets in self.row_layer_budgets.items()}
        for slot in slots:
            self._active_slots[slot] = True
        for store in self.layers:
            store.set_active_rows(self._active_slots)

    def add_rows(self, caches: list[KVHiveCache], decode_capacity: int | None = None) -> None:
        """Append the rows of ``caches`` (each prefilled, e.g. a request joining a batch that is
        decoding) after this cache's rows, in place: ``KVHiveCache.stack([self, *caches])`` with
        the same checks and refusals, adopted by this object (so a caller holding it, a server's
        scheduler, keeps its reference). Every layer's buffers are laid out again: their addresses
        change, as after ``batch_select_indices`` (docs/DESIGN.md, "Joining a running batch")."""
        if not isinstance(caches, (list, tuple)) or not caches:
            raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
        joined = type(self).stack([self, *caches], decode_capacity)
        self.__dict__.update(joined.__dict__)

    @staticmethod
    def _check_stackable(first: KVHiveCache, cache: KVHiveCache, number: int) -> None:
        where = f"caches[{number}]"
        if cache.positions != ORIGINAL_POSITIONS:
            raise ValueError(f"{where} uses positions={cache.positions!r}; stacked rows need positions='original'")
        if not all(layer.is_initialized for layer in cache.layers):
            raise ValueError(f"{where} holds no prompt: prefill each cache (its prompt through the model) first")
        batches = {layer.batch_size for layer in cache.layers}
        if len(batches) != 1 or min(batches) < 1:
            raise ValueError(
                f"{where} holds batches of {sorted(batches)} rows in its layers; expected one batch size >= 1"
            )
        if min(batches) > 1 and not cache.is_stacked and any(layer.has_padding for layer in cache.layers):
            # Its rows' token counts include the left padding, so each row's next position (its
            # tokens seen, as a stacked row continues) would not be the one it has alone.
            raise ValueError(
                f"{where} holds a left-padded batch of {min(batches)} rows: its rows' positions count the padding; "
                "prefill each prompt alone (a batch of one) and stack those"
            )
        for layer in cache.layers:
            if not layer.is_uniform:
                raise ValueError(
                    f"cannot stack caches of method {cache.policy.name!r}: layer {layer.layer_index} of {where} holds "
                    "a different number of tokens per head (head-wise budgets, Ada-KV's packed layout), which has no "
                    "dense row to stack; decode each prompt alone (kvhive.generate)"
                )
        if cache is first:
            return
        if cache.model_shape != first.model_shape:
            raise ValueError(f"{where} was made for another model ({cache.model_shape} vs {first.model_shape})")
        for layer, module in first._attention_modules.items():
            other = cache._attention_modules.get(layer)
            if other is not None and module() is not None and other() is not None and other() is not module():
                raise ValueError(f"{where} was filled by another model object than caches[0] (layer {layer})")
        if type(cache.policy) is not type(first.policy) or cache.policy.config != first.policy.config:
            raise ValueError(
                f"{where} runs method {cache.policy!r}, caches[0] {first.policy!r}: stacked rows run one method"
            )
        options = ("budget", "compress_sliding", "decode_every", "decode_slack", "dense_decode")
        for option in options:
            if getattr(cache, option) != getattr(first, option):
                raise ValueError(
                    f"{where} has {option}={getattr(cache, option)!r}, caches[0] {getattr(first, option)!r}: stacked "
                    "rows share one cache's options"
                )
        if DECODE in first.policy.phases:
            differing = {
                layer: (first.layer_budgets.get(layer), cache.layer_budgets.get(layer))
                for layer in set(first.layer_budgets) | set(cache.layer_budgets)
                if first.layer_budgets.get(layer) != cache.layer_budgets.get(layer)
            }
            if differing:
                raise ValueError(
                    f"{where} keeps other layer budgets than caches[0] {differing} (a ratio of prompts of different "
                    f"lengths): method {first.policy.name!r} keeps one budget per layer while decoding; give a token "
                    "budget"
                )
        for ours, theirs in zip(first.layers, cache.layers, strict=True):
            if (ours.dtype, ours.device) != (theirs.dtype, theirs.device):
                raise ValueError(
                    f"{where} holds {theirs.dtype} on {theirs.device} in layer {theirs.layer_index}, caches[0] "
                    f"{ours.dtype} on {ours.device}: stacked rows share one dtype and device"
                )
            if ours.heads_per_kv_head != theirs.heads_per_kv_head:
                raise ValueError(f"{where} stores another number of heads per KV head than caches[0]")

    def row_tokens_seen(self, layer_idx: int = 0) -> list[int]:
        """Tokens seen by each batch row of a layer (they differ in a stacked cache, :meth:`stack`)."""
        return self.layers[layer_idx].row_tokens_seen

    # -- reuse checks ------------------------------------------------------------------------------
    def _check_reuse(self, key_states: torch.Tensor, layer_idx: int) -> None:
        """Refuse new tokens that cannot continue what the cache holds (another batch size, another
        model's shapes) with a message naming the mismatch, instead of an obscure shape error."""
        if layer_idx >= len(self.layers):
            raise ValueError(
                f"this cache was made for a model with {len(self.layers)} layers; layer {layer_idx} "
                "does not exist in it: another model is using it (make a cache per model)"
            )
        store: LayerStore = self.layers[layer_idx]
        if not store.is_initialized:
            return
        if key_states.shape[0] != store.batch_size:
            raise ValueError(
                f"this cache holds a batch of {store.batch_size} row(s); the new input has "
                f"{key_states.shape[0]}: make a new cache for another batch size"
            )
        heads = store.num_heads // store.heads_per_kv_head
        stored_keys = store.buffers()[0]
        head_dim = stored_keys.shape[-1] if stored_keys is not None else key_states.shape[3]
        if key_states.shape[1] != heads or key_states.shape[3] != head_dim:
            raise ValueError(
                f"this cache holds {heads} KV heads of dimension {head_dim} in layer {layer_idx}; "
                f"the new input has {key_states.shape[1]} of {key_states.shape[3]}: another model is using "
                "it (make a cache per model)"
            )

    def check_model(self, config) -> None:
        """Refuse a model other than the one this cache was made for, empty or filled (its layers'
        kinds and windows, heads and head dimension are what the cache's layers, budgets and
        accounting were built from). Called before a forward of a model kvhive attached to, and by
        kvhive's attention the first time it sees a layer's module; a config already matched is
        not compared again."""
        if self._matching_config is not None and self._matching_config() is config:
            return
        actual = model_shape(config)
        if actual != self.model_shape:
            expected = self.model_shape
            differences = [
                f"{name}: {_describe_windows(expected[name])} here, {_describe_windows(actual[name])} in that model"
                if name == "sliding windows"
                else f"{name}: {expected[name]} here, {actual[name]} in that model"
                for name in expected
                if expected[name] != actual[name]
            ]
            raise ValueError(
                "this cache was made for another model (" + "; ".join(differences) + "): make a cache per model "
                "with kvhive.make_cache(model, ...)"
            )
        self._matching_config = weakref.ref(config)

    def check_attention_module(self, layer_index: int, module) -> None:
        """Called by kvhive's attention for the layer just updated. Refuses a cache filled by one
        model's attention layers being continued by another's (shapes may agree, so the modules
        themselves are compared)."""
        self._unattended_update = None
        known = self._attention_modules.get(layer_index)
        if known is None:
            config = getattr(module, "config", None)
            if config is not None:
                try:
                    self.check_model(config)
                except ValueError:
                    # The layer held nothing before this update (its module is seen for the first
                    # time): drop the other model's tokens, so nothing counts them.
                    self.layers[layer_index].reset()
                    raise
            self._attention_modules[layer_index] = weakref.ref(module)
        elif known() is not module:
            raise ValueError(
                f"this cache was filled by another model (layer {layer_index} belongs to a different "
                "module): make a cache per model"
            )

    def check_generation_inputs(self, input_ids: torch.Tensor | None, first_step: bool, new_tokens: int | None) -> None:
        """Called by ``generate`` (through ``kvhive.attention``) before each step with the sequence
        it was given and how many of its tokens are new (None: only new tokens were passed, with
        the full attention mask). A reused cache must be continued by a sequence that starts with
        the tokens it holds; otherwise transformers would silently treat them as its prefix."""
        if input_ids is None or input_ids.dim() != 2:
            return
        store: LayerStore = self.layers[0]
        seen = store.tokens_seen if store.is_initialized else 0
        if first_step and seen:
            if input_ids.shape[0] != store.batch_size:
                raise ValueError(
                    f"this cache holds a batch of {store.batch_size} row(s); the new prompt has "
                    f"{input_ids.shape[0]}: make a new cache for another batch size"
                )
            if new_tokens is not None and new_tokens < 1:
                raise ValueError(
                    f"the prompt of {input_ids.shape[1]} tokens does not extend the {seen} tokens this "
                    "cache holds: pass the previous tokens followed by the new ones, or make a new cache"
                )
            recorded = self._generated_ids
            if new_tokens is not None and recorded is not None and recorded.shape == (input_ids.shape[0], seen):
                if not torch.equal(recorded.to(input_ids.device), input_ids[:, :seen]):
                    raise ValueError(
                        f"the prompt does not start with the {seen} tokens this cache holds: it would be "
                        "answered as if they were its beginning; make a new cache for an unrelated prompt"
                    )
        # A reference, not a copy: generate appends to a new tensor, it never edits in place.
        self._generated_ids = input_ids if new_tokens is not None or not seen else None

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
