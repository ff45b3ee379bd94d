"""The batch rows of a :class:`~kvhive.cache.kv_cache.KVHiveCache`: selecting them (beam search,
batch slicing), stacking caches prefilled separately into one batch, and fixed batch slots that
rows leave and join in place.

Stacking (:func:`stack`, :func:`add_rows`) and joining a free slot (:func:`fill_slots`) take rows
from other caches the same way: a :class:`RowPlan` per layer collects each joining row's stored
tokens, tokens seen and method state, and refuses rows the layer cannot hold together (another
step of the compression schedule, another length where the layer keeps one) before anything is
built or written. ``KVHiveCache`` keeps a method of the same name for each public function here;
its class is passed in (``cache_class``) for the type checks, as this module sits below it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from kvhive.cache.layout_plan import static_decode, window_within_budget
from kvhive.cache.stack_checks import check_stackable, refuse_slotted
from kvhive.cache.storage import LayerStore
from kvhive.methods.base import Policy

# Room for decode tokens a stacked layer that grows gets past its longest row, when none is asked for.
DEFAULT_STACK_ROOM = 64


def batch_size(cache: Cache) -> int:
    """Rows of the cache's batch (0 before its first update)."""
    return next((layer.batch_size for layer in cache.layers if layer.is_initialized), 0)


def row_views(layer: LayerStore) -> list[tuple]:
    """``(keys, values, positions, token_scores)`` of each batch row of a dense layer, ``[1, H, L_b, ...]``
    views of its own ``L_b`` stored tokens (a layer of rows of different lengths holds row ``b``
    in slots ``[0, L_b)`` of a common capacity; the slots past it are empty)."""
    keys, values, positions, scores = layer.dense()
    lengths = layer.row_lengths or [layer.dense_length] * layer.batch_size
    return [
        (
            keys[row : row + 1, :, :length],
            values[row : row + 1, :, :length],
            positions[row : row + 1, :, :length],
            {name: score[row : row + 1, :, :length] for name, score in scores.items()},
        )
        for row, length in enumerate(lengths)
    ]


def row_states(policy: Policy, layer: LayerStore) -> list[dict]:
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


def budgets_of_rows(caches: list[Cache], layer: int, default: int | None) -> list[int | None]:
    """Layer ``layer``'s budget for every row of ``caches`` in order (a cache's own per-row budgets,
    else its layer budget, else ``default``)."""
    budgets = []
    for cache in caches:
        rows = batch_size(cache)
        own = cache.row_layer_budgets.get(layer)
        if own is None:
            budgets.extend([cache.layer_budgets.get(layer, default)] * rows)
        else:
            budgets.extend(own if len(own) == rows else [cache.layer_budgets[layer]] * rows)
    return budgets


def without_unit_dims(shape: torch.Size) -> tuple[int, ...]:
    return tuple(size for size in shape if size != 1)


def adopt_in_place(old: dict, new: dict) -> None:
    """Make the state dict ``old`` equal ``new`` keeping ``old``'s objects where they fit: a tensor
    of the same shape (up to unit dimensions), dtype and device is overwritten in place (its address
    stays, as a captured decode step needs); anything else is replaced."""
    for key in [key for key in old if key not in new]:
        del old[key]
    for key, value in new.items():
        old[key] = adopted(old.get(key), value)


def adopted(previous, value):
    """``value``, written into ``previous`` where it fits (see :func:`adopt_in_place`)."""
    if isinstance(value, torch.Tensor):
        if (
            isinstance(previous, torch.Tensor)
            and without_unit_dims(previous.shape) == without_unit_dims(value.shape)
            and previous.dtype == value.dtype
            and previous.device == value.device
        ):
            # (A method may lay a per-row counter out as [B] when stacking and [B, 1, 1] once
            # decoding, BUZZ's: the same values.)
            previous.copy_(value.reshape(previous.shape))
            return previous
        return value
    if isinstance(value, dict) and isinstance(previous, dict):
        adopt_in_place(previous, value)
        return previous
    if isinstance(value, list) and isinstance(previous, list) and len(value) == len(previous):
        previous[:] = [adopted(p, v) for p, v in zip(previous, value, strict=True)]
        return previous
    params = getattr(type(value), "__dataclass_params__", None)
    if type(previous) is type(value) and params is not None and not params.frozen:
        # A method's own record of tensors (BumbleBee's StreamingSummary): field by field.
        for name, field in vars(value).items():
            setattr(previous, name, adopted(getattr(previous, name, None), field))
        return previous
    return value


def copy_without_layers(cache: Cache) -> Cache:
    """A deep copy of ``cache``'s settings and method, sharing none of its stored tokens: the layers
    and prefill records are replaced by the caller, so copying their buffers would only cost memory
    (a running batch's whole cache, at every join)."""
    skipped = {id(cache.layers): [], id(cache.prefill_records): {}}
    return copy.deepcopy(cache, skipped)


# -- row selection (beam search, contrastive search, batch slicing) --------------------------------
def select_rows(cache: Cache, index: torch.Tensor) -> None:
    """Keep batch rows ``index`` (host 1-D long; may repeat or reorder) in every layer: its
    stored tokens, per-token scores, per-row counters and the method's per-layer state. The
    method's state is selected first, so a method that cannot leaves the cache unchanged."""
    initialized = [layer for layer in cache.layers if layer.is_initialized]
    if not initialized:
        return
    refuse_slotted(cache, "selecting its rows (reorder_cache, batch_select_indices, batch_repeat_interleave)")
    for layer in initialized:
        layer.check_rows_selectable(cache.policy.name)
    batch = initialized[0].batch_size
    rows = index.tolist()
    if rows and (min(rows) < 0 or max(rows) >= batch):
        raise IndexError(f"batch row index {rows} out of range for a batch of {batch} row(s)")
    states = [cache.policy.select_state_rows(layer.policy_state, index, layer.num_heads) for layer in initialized]
    for layer, state in zip(initialized, states, strict=True):
        layer.select_rows(index)
        layer.policy_state = state
    cache.row_layer_budgets = {
        layer: [budgets[row] for row in rows] if len(budgets) == batch else budgets
        for layer, budgets in cache.row_layer_budgets.items()
    }
    if cache.generated_ids is not None and cache.generated_ids.shape[0] == batch:
        cache.generated_ids = cache.generated_ids.index_select(0, index.to(cache.generated_ids.device))


# -- the rows one layer takes from other caches -----------------------------------------------------
@dataclass
class RowPlan:
    """One layer's rows taken from other caches, collected and checked once: :func:`stack` lays
    them out in new buffers, :func:`fill_slots` writes them into free slots."""

    layer_index: int
    sources: list[LayerStore]  # the layer of each cache the rows come from
    views: list[tuple]  # each row's (keys, values, positions, token scores), [1, H, L_b, ...]
    tokens_seen: list[int]  # each row's own count
    states: list[dict]  # the method's per-layer state of each row
    state_seen: list[int]  # the count each state is relative to: its source layer's tokens seen

    @classmethod
    def collect(cls, policy: Policy, caches: list[Cache], layer_index: int) -> RowPlan:
        """Layer ``layer_index``'s rows of ``caches``, in order (every row of ``caches[0]``, then of
        ``caches[1]``, ...). The tokens seen passed with each state are those of the layer it came
        from (its ``sequence_length``, the most any of its rows has seen): a stacked row's state may
        be relative to it (AhaKV's padding), and the method re-bases it on the new layer's count."""
        sources = [cache.layers[layer_index] for cache in caches]
        states, state_seen = [], []
        for source in sources:
            states.extend(row_states(policy, source))
            state_seen.extend([source.tokens_seen] * source.batch_size)
        return cls(
            layer_index=layer_index,
            sources=sources,
            views=[view for source in sources for view in row_views(source)],
            tokens_seen=[seen for source in sources for seen in source.row_tokens_seen],
            states=states,
            state_seen=state_seen,
        )

    def keep_last(self, tokens: int) -> None:
        """Each row's newest ``tokens`` at most: a sliding layer's rows keep ``window - 1`` (the full
        cache with ``compress_sliding`` keeps a whole prompt until its first decode step; no later
        query attends the older ones). Rows longer than that hold their tokens oldest first."""
        self.views = [
            tuple(part[:, :, -tokens:] for part in view[:3])
            + ({name: score[:, :, -tokens:] for name, score in view[3].items()},)
            if view[0].shape[2] > tokens
            else view
            for view in self.views
        ]

    @property
    def lengths(self) -> list[int]:
        """Tokens each row holds in this layer."""
        return [int(view[0].shape[2]) for view in self.views]

    @property
    def has_padding(self) -> bool:
        return any(source.has_padding for source in self.sources)

    @property
    def stored_in_order(self) -> bool:
        return all(source.stored_in_order for source in self.sources)

    def merged_state(
        self, policy: Policy, free: int = 0, running: LayerStore | None = None, slots: list[int] | None = None
    ) -> tuple[dict, int]:
        """The method's state of the layer that holds these rows, and the count it is relative to
        (the most any state's layer has seen). Stacking: these rows, then ``free`` free slots that
        start as copies of the first row (real tokens, so a free slot's placeholder decode computes
        finite values). Joining: the ``running`` layer's rows, these in its ``slots``. A method may
        refuse (``Policy.stack_states``)."""
        if running is None:
            states = self.states + [self.states[0]] * free
            seen = self.state_seen + [self.state_seen[0]] * free
        else:
            states = row_states(policy, running)
            seen = [running.tokens_seen] * len(states)
            for slot, state, count in zip(slots, self.states, self.state_seen, strict=True):
                states[slot], seen[slot] = state, count
        return policy.stack_states(states, seen), max(seen)

    def refuse_other_schedule(self, running: LayerStore | None = None) -> None:
        """Refuse rows compressed at different steps of the ``decode_every``/``decode_slack``
        schedule than each other (stacking) or than the ``running`` rows (joining them)."""
        steps = {source.decode_steps_since_compression for source in self.sources}
        if running is None and len(steps) > 1:
            raise ValueError(
                f"cannot stack these caches: layer {self.layer_index} compressed {sorted(steps)} steps ago in "
                "different rows (decode_every/decode_slack keep one schedule per layer)"
            )
        if running is not None and steps != {running.decode_steps_since_compression}:
            raise ValueError(
                f"cannot join these caches: layer {self.layer_index} compressed {sorted(steps)} steps ago, the "
                f"running rows {running.decode_steps_since_compression} (decode_every/decode_slack keep one "
                "schedule per layer)"
            )

    def refuse_unequal_lengths(self, policy: Policy, budget: int | None) -> None:
        """Stacking a layer whose method evicts while decoding and keeps one length for every row:
        refuse rows of different lengths, naming why the method keeps one."""
        lengths = self.lengths
        if len(set(lengths)) > 1:
            raise ValueError(
                f"cannot stack these caches: layer {self.layer_index} keeps different numbers of tokens {lengths} "
                f"in its rows (prompts shorter than its budget of {budget}), and method {policy.name!r} "
                f"{one_length_reason(policy)}, so its rows decode with one length: give prompts of at least "
                f"{budget} tokens (or a budget of at most the shortest), or decode them alone (kvhive.generate)"
            )

    def refuse_misfits(self, running: LayerStore, policy: Policy) -> None:
        """Joining the ``running`` rows: refuse a row longer than its slot (a layer of per-row
        lengths) or of another length than the running rows (a layer that keeps one)."""
        for length in self.lengths:
            if running.has_row_lengths:
                capacity = running.buffers()[0].shape[2]
                if length > capacity:
                    raise ValueError(
                        f"cannot join: a row holds {length} tokens in layer {self.layer_index}, more than its slot "
                        f"capacity of {capacity}; give a larger slot_capacity"
                    )
            elif length != running.dense_length:
                raise ValueError(
                    f"cannot join: a row holds {length} tokens in layer {self.layer_index}, where every running row "
                    f"holds {running.dense_length}; method {policy.name!r} {one_length_reason(policy)}, so its "
                    "rows decode with one length (give prompts of at least the budget, or decode them alone)"
                )


def one_length_reason(policy: Policy) -> str:
    """Why ``policy``'s evicting layers keep one length for every row."""
    if not policy.compiles_below_budget:
        return "builds its state at its first eviction"
    if policy.reads_stored_order and not policy.decodes_rows_of_different_lengths:
        return "ranks its tokens by their stored order (a row below its budget would be ranked over empty slots)"
    return "holds a layer in a capacity of its own bound (fixed_decode_capacity)"


# -- caches prefilled separately, decoded together --------------------------------------------------
def check_stack_request(
    cache_class: type,
    caches: list[Cache],
    decode_capacity: int | None,
    batch_slots: int | None,
    slot_capacity: int | None,
) -> int:
    """Refuse arguments of :func:`stack` it cannot serve; the rows given."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
    if decode_capacity is not None and (
        isinstance(decode_capacity, bool) or not isinstance(decode_capacity, int) or decode_capacity < 0
    ):
        raise ValueError(f"invalid decode_capacity={decode_capacity!r}: expected an integer >= 0 (tokens), or None")
    check_stackable(cache_class, caches[0], caches)
    rows_given = sum(batch_size(cache) for cache in caches)
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
    return rows_given


def stack(
    cache_class: type,
    caches: list[Cache],
    decode_capacity: int | None = None,
    batch_slots: int | None = None,
    slot_capacity: int | None = None,
) -> Cache:
    """One batch cache whose rows are the rows of ``caches``, in order (every row of
    ``caches[0]``, then of ``caches[1]``, ...): caches of one model and one method (same options
    and budget), prefilled separately, e.g. from prompts of different lengths. A cache may hold
    one row or several (a batch prefilled together without padding, or a stacked cache that is
    decoding: a request joining a running batch, :func:`add_rows`). The inputs are left as they
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
    (Ada-KV's packed layout); a layer that evicts while decoding whose rows keep different counts,
    where its method keeps one length per layer (it builds its state at its first eviction, holds
    its own bound without ``decodes_rows_of_different_lengths``, or ranks by the stored order); a
    method whose per-layer state cannot be stacked (``Policy.stack_states``; every registered
    method can). A sliding layer keeps each row's own window (a capacity of the window); a layer
    whose method keeps ``min(budget, N)`` each row's own length up to the budget (a capacity of the
    budget plus the new token); BUZZ's a length per row within its ``fixed_decode_capacity``.

    **Fixed batch slots** (``batch_slots=S``, at least the rows given): the buffers hold ``S``
    rows from the start; the rows past those given are free slots. Rows then leave
    (:func:`free_slots`) and join (:func:`fill_slots`) in place: no buffer is reallocated, every
    address stays, and the decode step keeps one shape (a free slot keeps decoding a
    placeholder; its outputs mean nothing). Every layer takes the static decode layout: an
    evicting layer its fixed capacity, a growing layer (the full cache, prefill-only methods)
    ``slot_capacity`` tokens per row (default: the longest row + ``decode_capacity``), which a
    row joining later must fit with all its decode steps. The decode step of such a cache
    reads nothing back and compiles to one graph (``is_compileable``) where the method's does."""
    rows_given = check_stack_request(cache_class, caches, decode_capacity, batch_slots, slot_capacity)
    free = 0 if batch_slots is None else batch_slots - rows_given
    layers = stacked_layers(
        caches, decode_capacity, free=free, slotted=batch_slots is not None, slot_capacity=slot_capacity
    )
    stacked = copy_without_layers(caches[0])
    take_stacked_layers(stacked, caches, layers, free)
    if batch_slots is not None:
        make_slots(stacked, caches, rows_given, decode_capacity)
    return stacked


def add_rows(cache_class: type, cache: Cache, caches: list[Cache], decode_capacity: int | None = None) -> None:
    """Append the rows of ``caches`` (each prefilled, e.g. a request joining a batch that is
    decoding) after ``cache``'s rows, in place: ``stack([cache, *caches])`` with the same checks and
    refusals, taken by ``cache`` itself (so a caller holding it, a server's scheduler, keeps its
    reference). Every layer's buffers are laid out again: their addresses change, as after
    ``batch_select_indices`` (docs/DESIGN.md, "Joining a running batch")."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
    refuse_slotted(cache, "add_rows")
    joined = [cache, *caches]
    check_stack_request(cache_class, joined, decode_capacity, None, None)
    take_stacked_layers(cache, joined, stacked_layers(joined, decode_capacity), free=0)


def stacked_layers(
    caches: list[Cache],
    decode_capacity: int | None,
    free: int = 0,
    slotted: bool = False,
    slot_capacity: int | None = None,
) -> list[LayerStore]:
    """New layers holding the rows of ``caches`` in order, then ``free`` free slots."""
    first = caches[0]
    room = decode_capacity if decode_capacity is not None else DEFAULT_STACK_ROOM
    return [
        stacked_layer(first, RowPlan.collect(first.policy, caches, index), free, room, slotted, slot_capacity)
        for index in range(len(first.layers))
    ]


def layer_kind(first: Cache, index: int) -> str:
    """How a stacked layer decodes: ``"window"`` (a sliding layer that keeps its window: uncompressed,
    a method that never evicts, or a budget that reaches the window), ``"evicts"`` (its method evicts
    while decoding) or ``"grows"`` (the full cache, prefill-only methods; a compressed sliding layer
    of a prefill-only method too, its window masked by position)."""
    layer, traits = first.layers[index], first.traits
    compressed = index in first.compressed_layers
    if layer.is_sliding and (not compressed or not traits.compresses or window_within_budget(first, index, layer)):
        return "window"
    if compressed and traits.has_decode:
        return "evicts"
    return "grows"


def rows_fill_to_budget(policy: Policy) -> bool:
    """Whether ``policy``'s rows of different lengths decode together in a capacity of the budget plus
    the new token: it keeps ``min(budget, N)`` (no bound of its own) and builds no state at its first
    eviction, so a decision over a row still below its budget keeps every token it holds; one that
    ranks by the stored order is held to one length."""
    return (
        type(policy).fixed_decode_capacity is Policy.fixed_decode_capacity
        and policy.compiles_below_budget
        and not policy.reads_stored_order
        and not policy.decodes_rows_of_different_lengths
    )


def stacked_layer(
    first: Cache, plan: RowPlan, free: int, room: int, slotted: bool, slot_capacity: int | None
) -> LayerStore:
    """One new layer of the rows of ``plan`` (laid out like ``first``'s layer) and ``free`` free
    slots; ``room`` decode tokens past the longest row where the layer grows. Every layer that can
    keeps a length per row (a free slot then takes a row of any length): a sliding layer in a
    capacity of its window, a layer that evicts in its method's bound (or its budget) plus the new
    token, a layer that grows in its slots' capacity (or with room to grow). A layer keeping a
    length per row in a bounded capacity holds no more than a slot can (``slot_capacity``, fixed
    batch slots): a budget far above the rows costs nothing there."""
    policy, index = first.policy, plan.layer_index
    layer = first.layers[index]
    kind = layer_kind(first, index)
    if kind == "window":
        plan.keep_last(layer.sliding_window - 1)
    lengths = plan.lengths
    budget = first.layer_budgets.get(index)
    per_row = kind == "window"
    if kind == "evicts":
        # BUZZ's rows follow their own schedule: always a length per row. A method keeping
        # min(budget, N) takes one where rows differ, or may differ later (a free slot's joiner).
        per_row = policy.decodes_rows_of_different_lengths or (
            rows_fill_to_budget(policy) and (slotted or len(set(lengths)) > 1)
        )
        if not per_row:
            plan.refuse_unequal_lengths(policy, budget)
    plan.refuse_other_schedule()
    state, most_seen = plan.merged_state(policy, free=free)
    views = plan.views + [plan.views[0]] * free  # free slots: copies of the first row
    row_capacity = None
    if slotted and kind == "grows":
        row_capacity = slot_capacity if slot_capacity is not None else max(lengths) + room
    store = LayerStore(layer.layer_index, layer.sliding_window)
    store.new_token_scores_read = layer.new_token_scores_read
    keys, values, positions, scores = zip(*views, strict=True)
    store.set_rows(
        list(keys),
        list(values),
        list(positions),
        list(scores),
        plan.tokens_seen + [plan.tokens_seen[0]] * free,
        room,
        per_row_lengths=per_row,
        row_capacity=row_capacity,
    )
    store.tokens_seen = most_seen  # the count every row's state is now relative to
    store.policy_state = state
    if kind == "window":
        store.reserve_rows(layer.sliding_window, window=layer.sliding_window)  # the window: the oldest's slot is reused
    elif per_row:
        bound = policy.fixed_decode_capacity(store.dense()[0], budget, state)
        if bound is None and rows_fill_to_budget(policy):
            bound = budget
        if bound is None:
            raise ValueError(
                f"cannot stack these caches: method {policy.name!r} declares no bound for layer {index}'s rows"
            )
        policy.prepare_fixed_capacity(store.dense()[0], budget, state)
        if slot_capacity is not None:
            bound = min(bound, slot_capacity)
        store.reserve_rows(max(bound, max(lengths)) + 1)  # the bound plus the new token
    store.has_padding = plan.has_padding
    store.stored_in_order = plan.stored_in_order
    store.heads_per_kv_head = layer.heads_per_kv_head
    store.decode_steps_since_compression = layer.decode_steps_since_compression
    store.last_update_tokens = 1
    return store


def take_stacked_layers(target: Cache, caches: list[Cache], layers: list[LayerStore], free: int) -> None:
    """Make ``target`` (a copy of ``caches[0]``'s settings, or ``caches[0]`` itself) the cache of
    ``layers``, stacked from ``caches``: their rows' budgets, and a prompt no longer planned or
    recorded. Everything is read from ``caches`` before ``target`` changes."""
    first = caches[0]
    row_budgets = {}
    for layer, budget in first.layer_budgets.items():
        budgets = budgets_of_rows(caches, layer, budget)
        row_budgets[layer] = budgets + [budgets[0]] * free  # free slots: the first row's budgets
    cut_at_prefill = set.intersection(*(set(cache.cut_at_prefill) for cache in caches))
    budgets_resolved_on = max(cache.layers[0].tokens_seen for cache in caches)
    target.layers = layers
    target.row_layer_budgets = row_budgets
    target.layer_budgets = {layer: max(budgets) for layer, budgets in row_budgets.items()}
    target.cut_at_prefill = cut_at_prefill
    target.prefill_records = {}
    target.record_prefill = False
    target.generated_ids = None
    target.unattended_update = None
    target.prompt_planned = False
    target.budgets_resolved_on = budgets_resolved_on
    target.prefill_chunk = None
    target.question_tokens = None
    target.decode_capacity = None
    target.layout_plan.compileable = False  # per-row lengths and counts live on the host: eager decode
    target.slots_held = None


# -- fixed batch slots ----------------------------------------------------------------------------
def make_slots(cache: Cache, caches: list[Cache], rows_given: int, decode_capacity: int | None) -> None:
    """Lay a freshly stacked cache out in fixed batch slots: the first ``rows_given`` rows run,
    the others are free; every layer in its static decode layout."""
    cache.decode_capacity = decode_capacity
    if cache.traits.has_decode:
        # What the prefill of each cache found (a layer below its budget, a bound far above it).
        cache.layout_plan.compileable = all(source.static_decode for source in caches) and static_decode(cache)
    else:
        cache.layout_plan.compileable = decode_capacity is not None and static_decode(cache)
    cache.slots_held = [row < rows_given for row in range(batch_size(cache))]
    for store in cache.layers:
        if cache.static_decode and cache.traits.has_decode and not store.has_row_lengths:
            cache.layout_plan.reserve_decode(cache, store)  # (a layer of per-row lengths has its bound already)
        store.set_active_rows(cache.slots_held)


def active_slots(cache: Cache) -> list[bool]:
    """Fixed batch slots: whether each slot holds a running row (host)."""
    if cache.slots_held is None:
        raise ValueError("this cache has no fixed batch slots: stack(..., batch_slots=N) makes them")
    return list(cache.slots_held)


def checked_slots(cache: Cache, slots, want_active: bool) -> list[int]:
    """``slots`` as a list, refused unless they are distinct slot numbers all running (``want_active``) or all free."""
    active = active_slots(cache)
    count = len(active)
    if not isinstance(slots, (list, tuple)) or not all(
        isinstance(slot, int) and not isinstance(slot, bool) for slot in slots
    ):
        raise ValueError(f"invalid slots={slots!r}: expected a list of slot numbers in [0, {count})")
    if len(set(slots)) != len(slots) or any(not 0 <= slot < count for slot in slots):
        raise ValueError(f"invalid slots={slots!r}: expected distinct slot numbers in [0, {count})")
    wrong = [slot for slot in slots if active[slot] != want_active]
    if wrong:
        state = "free" if want_active else "running"
        raise ValueError(f"slot(s) {wrong} are not {'running' if want_active else 'free'} (they are {state})")
    return list(slots)


def set_slots(cache: Cache, slots: list[int], running: bool) -> None:
    """Mark ``slots`` running or free, in the cache and in every layer."""
    for slot in slots:
        cache.slots_held[slot] = running
    for store in cache.layers:
        store.set_active_rows(cache.slots_held)


def trust_the_device(cache: Cache) -> None:
    """Before a leave or a join: the host mirrors of the layers' counters are read back from the
    device when next asked for (steps replayed from a CUDA graph advance only the device)."""
    for store in cache.layers:
        store.trust_the_device()


def free_slots(cache: Cache, slots: list[int]) -> None:
    """Fixed batch slots: the rows in ``slots`` leave (finished requests). Nothing moves; the
    slots decode a placeholder until :func:`fill_slots` gives them a new row."""
    slots = checked_slots(cache, slots, want_active=True)
    trust_the_device(cache)
    set_slots(cache, slots, running=False)


def fill_slots(cache_class: type, cache: Cache, slots: list[int], caches: list[Cache]) -> None:
    """Fixed batch slots: the rows of ``caches`` (each prefilled alone, e.g. requests joining a
    running batch; their rows in order) take the free ``slots``, copied into the buffers in
    place: no buffer is reallocated and the decode step keeps its shape and graph. The checks
    and refusals are :func:`stack`'s; a row must also fit its slot (a growing layer's
    ``slot_capacity``; an evicting layer's one length). Everything is checked before anything
    changes."""
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError(f"caches: expected a non-empty list of KVHiveCache, got {caches!r}")
    slots = checked_slots(cache, slots, want_active=False)
    trust_the_device(cache)
    check_stackable(cache_class, cache, caches)
    rows = sum(batch_size(joining) for joining in caches)
    if rows != len(slots):
        raise ValueError(f"{len(slots)} slot(s) {slots} for {rows} joining row(s): give one slot per row")
    plans = [RowPlan.collect(cache.policy, caches, index) for index in range(len(cache.layers))]
    for plan, layer in zip(plans, cache.layers, strict=True):
        if layer.keeps_window_per_row:
            plan.keep_last(layer.sliding_window - 1)
    joined = [joined_state(cache, plan, slots) for plan in plans]
    for layer, plan, (state, most_seen) in zip(cache.layers, plans, joined, strict=True):
        for slot, view, count in zip(slots, plan.views, plan.tokens_seen, strict=True):
            layer.write_row(slot, *view, count)
        adopt_in_place(layer.policy_state, state)
        layer.tokens_seen = most_seen
        layer.has_padding = layer.has_padding or plan.has_padding
        layer.stored_in_order = layer.stored_in_order and plan.stored_in_order
    joining_budgets = {layer: budgets_of_rows(caches, layer, None) for layer in cache.row_layer_budgets}
    for layer, budgets in cache.row_layer_budgets.items():
        for slot, budget in zip(slots, joining_budgets[layer], strict=True):
            budgets[slot] = budget
    cache.layer_budgets = {layer: max(budgets) for layer, budgets in cache.row_layer_budgets.items()}
    set_slots(cache, slots, running=True)


def joined_state(cache: Cache, plan: RowPlan, slots: list[int]) -> tuple[dict, int]:
    """The method's state of a running layer once the rows of ``plan`` take ``slots``, and the count
    it is relative to; refuses rows the layer cannot take."""
    layer = cache.layers[plan.layer_index]
    plan.refuse_other_schedule(running=layer)
    plan.refuse_misfits(layer, cache.policy)
    policy = cache.policy
    state, most_seen = plan.merged_state(policy, running=layer, slots=slots)
    if (
        layer.bounded_capacity
        and not layer.has_row_lengths
        and type(policy).fixed_decode_capacity is not Policy.fixed_decode_capacity
    ):
        # The layer decodes in the fixed capacity its method declared: the stacked state gets the
        # device counters that declaration set up (as at stacking, when the cache reserves its decode).
        budget = cache.layer_budgets[plan.layer_index]
        policy.fixed_decode_capacity(layer.buffers()[0], budget, state)
        policy.prepare_fixed_capacity(layer.buffers()[0], budget, state)
    return state, most_seen
