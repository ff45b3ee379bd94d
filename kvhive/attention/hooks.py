"""transformers' side of kvhive's attention: the names it is registered under, and the hooks that
switch an attached model to it for the forwards given a kvhive cache (and only for them).

``kvhive`` is registered as an attention implementation (``AttentionInterface``) together with its
mask function (``AttentionMaskInterface``; without it transformers would silently drop the
sliding-window pattern). :func:`attach` adds a forward pre-hook and an always-called forward hook
to a model: a forward given a :class:`KVHiveCache` (or ``CacheRows``) runs ``"kvhive"``, every other
forward the model's own implementation.

The mask function (:func:`kvhive_mask`) is transformers' sdpa mask. It is None when nothing needs
masking (no padding, no window in reach), which the attention reads as "causal over original
positions"; otherwise it spans every original position and kept tokens are gathered from it by
position. A compiled decode step (one new query) gets no mask at all: a mask over every original
position grows by one column per step (a new graph each step); kvhive's attention masks the stored
tokens of a static decode step itself (padding recorded at prefill, the window by position).
"""

from __future__ import annotations

import threading
import types
import weakref

import torch
from transformers.masking_utils import sdpa_mask

from kvhive import static_step
from kvhive.cache.kv_cache import ORIGINAL_POSITIONS, KVHiveCache
from kvhive.cache.rows import CacheRows
from kvhive.heap import trim_heap

ATTENTION_NAME = "kvhive"

# The attribute of a KVHiveCache that says the attention ran a prompt chunk over it on the CPU during
# the forward now running (set by :func:`mark_prompt_chunk_on_cpu`): the forward hook then returns the
# heap's free pages once more when the forward ends, and removes it. Absent outside such a forward.
PROMPT_CHUNK_ON_CPU = "ran_prompt_chunk_on_cpu"


def kvhive_mask(*args, **kwargs):
    """transformers' sdpa mask, or None where kvhive's attention masks itself (module docstring)."""
    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    if q_length == 1 and static_step.in_static_step():
        return None  # no mask is built inside a compiled step (kvhive's attention masks it)
    if (
        q_length == 1
        and kwargs.get("kv_length") == 1
        and kwargs.get("kv_offset") == 0
        and (kwargs.get("q_offset") or 0) > 0
    ):
        # The fixed unused column KVHiveCache.get_mask_sizes asks for in a static decode step, run
        # eagerly (a mask over the positions seen would span q_offset + 1 columns): kvhive's attention
        # masks the stored tokens itself, so the ten ops that build this column are not spent
        # (transformers >= 5.24 passes q_offset; older versions build the column, unused).
        return None
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


class _ModelAttachment:
    """What :func:`attach` added to one model: how many forwards with a kvhive cache are running
    (a lock guards the count, so concurrent kvhive forwards switch and restore once), the
    attention implementation of each config they switched, restored when the last one ends, and
    the configs the model's attention layers and masks read (:func:`_attention_configs`, found
    again when ``model.config`` is replaced)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.switched: list[tuple[object, object]] = []
        self.configs: list = []


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ATTACHED_LOCK = threading.Lock()


def attach(model) -> None:
    """Let ``model`` run kvhive's attention for the calls given a kvhive cache, and only for them.

    transformers picks the attention function from ``model.config``; a forward that is given a
    :class:`KVHiveCache` (or ``CacheRows``) switches the model's configs to ``"kvhive"`` for that
    forward and restores what they held after it (a forward pre-hook and an always-called forward
    hook). Calls with another cache or none run the model's own implementation (eager, sdpa,
    flash-attention) and its own mask, as if kvhive had never seen the model; the configs read as
    before between calls. The one caveat: a forward with a kvhive cache and one without running
    at the same time in two threads on the *same* model object both see ``"kvhive"`` (which is
    plain sdpa for other caches).

    ``generate`` also shows a kvhive cache the full token sequence before each step
    (:class:`_ReuseCheckingPrepare`), so a reused cache refuses a prompt that does not continue
    it, and runs its compiled decode step with the attention switched before the compiled call
    (:class:`_SwitchingCompiledCall`). Idempotent. The attention and mask functions are registered by
    :func:`kvhive.attention.integration.attach`, which calls this one."""
    with _ATTACHED_LOCK:
        if model in _ATTACHED:
            return
        _ATTACHED[model] = _ModelAttachment()
    if _enter_forward in model._forward_pre_hooks.values():  # a copy of an attached model
        return
    model.register_forward_pre_hook(_enter_forward, with_kwargs=True)
    model.register_forward_hook(_leave_forward, with_kwargs=True, always_call=True)
    if callable(getattr(model, "prepare_inputs_for_generation", None)):
        model.prepare_inputs_for_generation = _ReuseCheckingPrepare(model)
    if callable(getattr(model, "get_compiled_call", None)):
        model.get_compiled_call = _SwitchingCompiledCall(model)


def _kvhive_caches_in(args, kwargs) -> list[KVHiveCache]:
    """The kvhive caches a forward was given (each row's cache for ``CacheRows``)."""
    # transformers >= 5.24 names the forward argument ``cache`` (``past_key_values`` before).
    for value in (kwargs.get("cache"), kwargs.get("past_key_values"), *args):
        if isinstance(value, KVHiveCache):
            return [value]
        if isinstance(value, CacheRows):
            return list(value.caches)
    return []


# The attached models whose forward this thread entered with a kvhive cache, innermost last: the
# always-called forward hook also runs when the pre-hook raised, and must then restore nothing.
_ENTERED = threading.local()


def mark_prompt_chunk_on_cpu(cache: KVHiveCache) -> None:
    """Note on ``cache`` that the attention ran a prompt chunk over it on the CPU in this forward."""
    setattr(cache, PROMPT_CHUNK_ON_CPU, True)


def _attention_configs(model) -> list:
    """The configs whose ``_attn_implementation`` the model's attention layers and masks read."""
    configs = [model.config]
    text_config = model.config.get_text_config(decoder=True)
    if text_config is not model.config:
        configs.append(text_config)
    return configs


def _attachment(model) -> _ModelAttachment:
    # A deep copy or an unpickled copy of an attached model carries the hooks but no entry yet.
    with _ATTACHED_LOCK:
        attachment = _ATTACHED.get(model)
        if attachment is None:
            attachment = _ATTACHED[model] = _ModelAttachment()
        return attachment


def _switch_in_trace(model) -> None:
    """The pre-hook inside a compiled step (one thread, traced once): switch without the lock and the
    thread-local bookkeeping, which dynamo cannot trace; the switch is replayed as a side effect."""
    if not static_step.TORCH_COMPILES_KVHIVE and model.config._attn_implementation_internal != ATTENTION_NAME:
        # Older dynamo does not trace the switch below (kvhive.static_step).
        raise RuntimeError(
            f"torch {torch.__version__} compiles a kvhive decode step only with kvhive's attention switched "
            "before the compiled call: run a step compiled by your own torch.compile inside "
            "kvhive.compression(model) (model.generate and kvhive.generate(compile=True) switch it themselves), "
            f"or use torch >= {static_step.COMPILE_MIN_TORCH}"
        )
    for config in _attention_configs(model):
        config._kvhive_previous_attention = config._attn_implementation_internal
        config._attn_implementation_internal = ATTENTION_NAME


def _restore_in_trace(model) -> None:
    """The forward hook inside a compiled step: undo :func:`_switch_in_trace`."""
    for config in _attention_configs(model):
        config._attn_implementation_internal = config._kvhive_previous_attention


def _enter_forward(model, args, kwargs):
    caches = _kvhive_caches_in(args, kwargs)
    if not caches:
        return None
    for cache in caches:
        cache.check_model(model.config)  # before anything is stored: an empty cache refuses too
    if torch.compiler.is_compiling():
        return _switch_in_trace(model)
    _switch_attention(model)
    _ENTERED.__dict__.setdefault("models", []).append(model)
    return None


def _switch_attention(model) -> None:
    """Switch ``model``'s configs to kvhive's attention for one kvhive call (the first of
    concurrent calls switches, the last restores: :func:`_restore_attention`)."""
    attachment = _ATTACHED.get(model) or _attachment(model)
    with attachment.lock:
        if attachment.running == 0:
            configs = attachment.configs
            if not configs or configs[0] is not model.config:
                configs = attachment.configs = _attention_configs(model)
            attachment.switched = [(config, config._attn_implementation_internal) for config in configs]
            for config in configs:
                config._attn_implementation_internal = ATTENTION_NAME
        attachment.running += 1


def _restore_attention(model) -> None:
    """End one kvhive call of :func:`_switch_attention`: the last one restores the configs."""
    attachment = _ATTACHED.get(model) or _attachment(model)
    with attachment.lock:
        attachment.running -= 1
        if attachment.running == 0:
            for config, previous in attachment.switched:
                config._attn_implementation_internal = previous
            attachment.switched = []


def _leave_forward(model, args, kwargs, output):
    caches = _kvhive_caches_in(args, kwargs)
    if not caches:  # calls without a kvhive cache touch nothing else
        return None
    if torch.compiler.is_compiling():
        return _restore_in_trace(model)
    for cache in caches:
        cache.prefill_scratch.clear()  # held for one prefill only, also when the forward raised
    if static_step.LIVE_CAPTURED_LOOPS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        # Large captured prefill loops likewise (BumbleBee's similarity matrix at long prompts): not
        # held through the decode. Never waits for another thread's prefill.
        static_step.release_captured_loops(larger_than=static_step.HELD_LOOP_BYTES, wait=False)
    entered = _ENTERED.__dict__.get("models")
    if not entered or entered[-1] is not model:
        return None
    entered.pop()
    ran_chunk_on_cpu = False
    for cache in caches:  # the note of a prompt chunk the attention ran on the CPU, removed
        ran_chunk_on_cpu |= cache.__dict__.pop(PROMPT_CHUNK_ON_CPU, False)
    if ran_chunk_on_cpu:
        trim_heap()  # the chunk's last temporaries (the last layers' MLP) before the next chunk
    _restore_attention(model)
    return None


class _ReuseCheckingPrepare:
    """The model's own ``prepare_inputs_for_generation``, called unchanged, after showing a kvhive
    cache the full token sequence (transformers passes the model only the tokens the cache has
    not seen, so this is where a reused cache can refuse a prompt that does not continue it).

    ``__wrapped__`` is the model's own bound method, so ``inspect.signature`` (which transformers
    reads to decide, e.g., whether ``generate(inputs_embeds=...)`` is supported) sees exactly the
    stock signature; other caches go straight through. A class, not a closure, so the model still
    pickles and deep-copies (a copy's hook calls the copy's method)."""

    def __init__(self, model) -> None:
        self.model = model

    @property
    def __wrapped__(self):
        return types.MethodType(type(self.model).prepare_inputs_for_generation, self.model)

    def __call__(self, input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVHiveCache) and cache.positions == ORIGINAL_POSITIONS:
            new_tokens = kwargs.get("next_sequence_length")
            if new_tokens is None and not cache.get_seq_length():
                new_tokens = input_ids.shape[-1]
            cache.check_generation_inputs(input_ids, bool(kwargs.get("is_first_iteration")), new_tokens)
        return self.__wrapped__(input_ids, *args, **kwargs)


class _SwitchingCompiledCall:
    """The model's own ``get_compiled_call`` (transformers' compiled forward, which ``generate`` runs
    for each decode step when the cache ``is_compileable``), whose compiled call, given a kvhive cache,
    runs with the model's attention switched to kvhive's before the call starts, and restored after
    it: the route is chosen outside the graph, as for an eager forward. Dynamo below torch 2.13 does
    not see the forward pre-hook's switch inside a trace (``kvhive.static_step``); with the switch
    made before the call, the trace reads kvhive's attention on every torch, and each later call
    meets the same route (one graph). Calls without a kvhive cache go straight through.

    ``__wrapped__`` is the model's own bound method; a class, not a closure, so the model still
    pickles and deep-copies (as :class:`_ReuseCheckingPrepare`)."""

    def __init__(self, model) -> None:
        self.model = model

    @property
    def __wrapped__(self):
        return types.MethodType(type(self.model).get_compiled_call, self.model)

    def __call__(self, *args, **kwargs):
        return _SwitchedCall(self.model, self.__wrapped__(*args, **kwargs))


class _SwitchedCall:
    """One compiled forward of ``model``, run with kvhive's attention switched for kvhive caches."""

    def __init__(self, model, compiled) -> None:
        self.model = model
        self.compiled = compiled

    def __call__(self, *args, **kwargs):
        caches = _kvhive_caches_in(args, kwargs)
        if not caches:
            return self.compiled(*args, **kwargs)
        for cache in caches:
            cache.check_model(self.model.config)
        _switch_attention(self.model)
        try:
            with static_step.attention_switched():
                return self.compiled(*args, **kwargs)
        finally:
            _restore_attention(self.model)
