"""How each layer decodes, decided when the cache is made and at the end of each layer's prefill.

A decode step is *static* (one shape, nothing read back: what ``torch.compile`` and CUDA graphs
need) when every layer holds a fixed number of tokens from one step to the next in buffers that
keep their address. :func:`static_decode` says whether a cache's options and method allow it;
:meth:`LayoutPlan.reserve_decode` lays a layer out for it once its prompt is cut (a fixed
capacity: the method's own bound, or its budget when the prompt left fewer tokens), or leaves it in
the growing layout; :func:`compile_problem` says before a prefill why a prompt would not compile.
"""

from __future__ import annotations

import torch

from kvhive import static_step
from kvhive.cache.budget import planned_layer_budgets
from kvhive.cache.options import ORIGINAL_POSITIONS
from kvhive.cache.storage import LayerStore

# A layer whose budget exceeds twice what it holds after its prompt by more than this decodes in
# the growing layout rather than in a fixed capacity of the whole budget.
BOUNDED_CAPACITY_SLACK = 64


def static_decode(cache) -> bool:
    """Whether ``cache``'s decode step compiles to one graph that serves every later step: the method
    evicts to its budget at every step (``Policy.static_decode``) in every layer, at original
    positions, with one copy per KV head (a growing layer may store one per query head);
    sliding-window layers keep their window in place (``LayerStore.drop_oldest``). Layers that grow
    (the full cache, prefill-only methods) compile with a fixed decode capacity (``decode_capacity``:
    room for that many decode tokens, attention over the whole capacity with the empty slots
    masked); without one they change shape at every step and decode eagerly. That holds for
    head-wise budgets too (Ada-KV: a packed layer, each segment with its own room), except in
    compressed sliding-window layers, whose packed heads drop tokens outside the window by their
    host-side lengths."""
    traits = cache.traits
    # A layer that only grows while decoding (no decode phase) has one shape with a fixed capacity.
    # (A method that does not declare its kept counts may keep different counts per head: packed.)
    declares_counts = not traits.compresses or traits.declares_kept_counts
    packed_sliding = not declares_counts and any(
        layer.is_sliding and cache.is_compressed(index) for index, layer in enumerate(cache.layers)
    )
    grows_in_place = not traits.has_decode and cache.decode_capacity is not None and not packed_sliding
    return (
        ((traits.static_decode and traits.has_decode) or grows_in_place)
        and cache.positions == ORIGINAL_POSITIONS
        and cache.decode_every == 1
        and cache.decode_slack == 0
        # One copy per query head (Ada-KV's head_granularity): a decode step repeats the new
        # token's KV heads by a fixed factor, a fixed shape; held to it only for growing layers.
        and (grows_in_place or not cache.stores_query_heads)
        # Every full-attention layer keeps a budget; a sliding layer keeps its window.
        and all(cache.is_compressed(index) or layer.is_sliding for index, layer in enumerate(cache.layers))
    )


def compile_problem(cache, prompt_length: int) -> str | None:
    """Why ``cache``'s decode step would not stay one graph after a prompt of ``prompt_length``
    tokens, known before the prefill; None when it would. A method that holds a layer in a fixed
    capacity of its own bound (``fixed_decode_capacity``) needs a budget near what the prompt leaves
    (at most twice the tokens kept plus :data:`BOUNDED_CAPACITY_SLACK`); methods that keep
    ``min(budget, N)`` fill a capacity of the budget, capped by ``decode_capacity``, unless they build
    state at their first eviction (``Policy.compiles_below_budget``), which needs a prompt at least as
    long as the budget."""
    if not static_step.compiles_kvhive():
        return (
            f"torch {torch.__version__} does not trace kvhive's attention switch in a compiled step; compile "
            "a step of your own inside kvhive.compression(model) (model.generate and kvhive.generate(compile=True) "
            f"switch it themselves), use torch >= {static_step.COMPILE_MIN_TORCH} (pyproject's floor), or decode "
            "without compile"
        )
    if not cache.layout_plan.compileable:
        return "its decode step does not compile to one graph"
    traits, name = cache.traits, cache.policy.name
    if cache.layer_budgets:
        budgets = cache.layer_budgets
    elif cache.budget_problem(prompt_length) is not None:
        return None  # the prefill refuses the budget itself, with its own message
    else:  # what the prefill will resolve, without fixing it now
        budgets = planned_layer_budgets(cache.policy, cache.budget, cache.compressed_layers, prompt_length)
    for index, budget in sorted(budgets.items()):
        kept = min(prompt_length, budget)
        bound = 2 * kept + BOUNDED_CAPACITY_SLACK
        if traits.has_decode and kept < budget and not traits.compiles_below_budget:
            return (
                f"a prompt of {prompt_length} tokens leaves layer {index} below its budget of {budget} tokens, "
                f"and {name} builds its state at its first eviction (a new graph); use a budget of at "
                f"most {prompt_length} tokens, or decode without compile"
            )
        if not traits.declares_capacity and cache.decode_capacity is None and budget > bound:
            return (
                f"layer {index}'s budget of {budget} tokens is far above the {kept} a prompt of {prompt_length} "
                "tokens leaves it, and no decode_capacity caps the capacity it fills while decoding; pass "
                "decode_capacity=N (the most tokens you will decode), or decode without compile"
            )
        if traits.declares_capacity and budget > bound:
            return (
                f"layer {index}'s budget of {budget} tokens is far above the {kept} a prompt of {prompt_length} "
                f"tokens leaves it (more than 2 x {kept} + {BOUNDED_CAPACITY_SLACK}): {name}'s fixed "
                f"capacity would attend the whole budget at every step; use a budget of at most {bound} tokens, "
                "or decode without compile"
            )
    return None


def window_within_budget(cache, layer_index: int, store: LayerStore) -> bool:
    """A compressed sliding layer whose budget reaches its window: the window bounds it more
    tightly than the budget, so it keeps exactly the window, as the model's own cache does (the
    outputs are the same: tokens beyond the window are masked). A method that never evicts (full)
    keeps what it is given: shared_prefill records with it."""
    if not store.is_sliding or not cache.traits.compresses:
        return False
    budget = cache.layer_budgets.get(layer_index)
    return budget is not None and budget >= store.sliding_window - 1


def hole_filling_layers(cache) -> frozenset[int]:
    """The layers where a decode eviction of one token per row may write the newest token into the
    freed slot (``LayerStore.fill_hole``) while they hold one length for every row and head: the
    method reads no stored order, and nothing else does (original positions, no sliding window)."""
    if cache.traits.reads_stored_order or cache.positions != ORIGINAL_POSITIONS:
        return frozenset()
    return frozenset(index for index, layer in enumerate(cache.layers) if not layer.is_sliding)


def fills_holes(hole_layers: frozenset[int], store: LayerStore) -> bool:
    """Whether a decode eviction of one token per row in ``store`` may fill the freed slot now
    (``hole_layers``: :func:`hole_filling_layers`)."""
    return store.layer_index in hole_layers and store.is_uniform and not store.has_row_lengths


def reserve_packed_room(cache) -> None:
    """With a decode capacity, a layer that only grows while decoding and is packed at prefill
    (head-wise budgets) is laid out with the room for the decode tokens at once (``reserve_decode``
    then finds it there: no second copy)."""
    if cache.decode_capacity is None or cache.traits.has_decode:
        return
    for layer in cache.layers:
        if not layer.is_sliding:
            layer.segment_reserve_tokens = max(layer.segment_reserve_tokens, cache.decode_capacity)


class LayoutPlan:
    """Whether a cache's decode step is static (``compileable``: decided when the cache is made, and
    turned off where a layer's prefill leaves it unable to keep one shape), and the layout each layer
    decodes in, chosen once at the end of its prefill (:meth:`reserve_decode`)."""

    def __init__(self, compileable: bool) -> None:
        self.compileable = compileable

    def reserve_decode(self, cache, store: LayerStore) -> None:
        """With a decode capacity, a layer that only grows while decoding gets its room now; in a
        static decode, a layer whose method keeps a varying number of tokens within a bound
        (``Policy.fixed_decode_capacity``) gets exactly that bound plus the new token."""
        traits = cache.traits
        if cache.decode_capacity is not None and not traits.has_decode and not store.is_sliding:
            store.reserve_decode(cache.decode_capacity)
            return
        index = store.layer_index
        if (
            not self.compileable
            or cache.takes_prompt_chunks  # later chunks grow the layer: it decodes in the growing layout
            or not traits.has_decode
            or index not in cache.layer_budgets
            or not store.is_initialized
            or not store.is_uniform
            or window_within_budget(cache, index, store)
        ):
            return
        keys = store.dense()[0]
        stored, budget = keys.shape[2], cache.layer_budgets[index]
        if traits.declares_capacity:
            bound = cache.policy.fixed_decode_capacity(keys, budget, store.policy_state)
        elif stored < budget and not traits.compiles_below_budget:
            self.compileable = False  # the layer decodes in the growing layout (compile_problem says so)
            return
        else:
            bound = None
            store.fills_to_budget = stored < budget
        if store.fills_to_budget:
            # A prompt shorter than the budget: the layer grows token by token up to its budget,
            # then evicts one token a step. A capacity of the budget plus the new token keeps one
            # shape through both (the method keeps every filled slot while there is room). No more
            # decode tokens come than a decode capacity asked for (kvhive.generate asks for
            # max_new_tokens): the layer never holds more than it holds now plus that.
            bound = budget if cache.decode_capacity is None else min(budget, stored + cache.decode_capacity)
        if bound is None:
            return
        if bound > 2 * stored + BOUNDED_CAPACITY_SLACK and not (store.fills_to_budget and cache.decode_capacity):
            # A bound far above what the layer holds (e.g. a budget meant to keep everything) would
            # allocate and attend the whole bound at every step: the layer decodes in the growing
            # layout, and the cache no longer says it compiles (kvhive.generate(compile=True) refuses
            # this before the prefill: compile_problem).
            self.compileable = False
            store.fills_to_budget = False
            return
        if traits.declares_capacity:
            cache.policy.prepare_fixed_capacity(keys, budget, store.policy_state)
        store.reserve_decode(max(bound, stored) + 1 - stored, exact=True)
