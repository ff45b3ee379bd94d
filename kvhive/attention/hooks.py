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
tokens of a static decode step itself (padding recorded at prefill, the window by position). The
same step run eagerly asks for a fixed unused column (``KVHiveCache.get_mask_sizes``: a mask over the
positions seen would span ``q_offset + 1`` columns), which is not built either (transformers >= 5.24
passes ``q_offset``; older versions build the column, unused).

The forward hook, when a forward with a kvhive cache ends, empties the caches' prefill scratch (held
for one prefill only, also when the forward raised), returns the heap's free pages after a prompt
chunk the attention ran on the CPU, and releases large captured prefill loops (BumbleBee's
similarity matrix at long prompts: not held through the decode; it never waits for another thread's
prefill).
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
from kvhive.cache.stacked_forward import prepare_stacked_forward
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
    if q_length == 1 and kwargs.get("kv_length") == 1 and kwargs.get("kv_offset") == 0 and kwargs.get("q_offset"):
        return None  # the fixed unused column of an eager static decode step (module docstring)
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
        if isinstance(value, (KVHiveCache, CacheRows)):
            return [value] if isinstance(value, KVHiveCache) else list(value.caches)
    return []


# The forwards this thread entered with a kvhive cache, innermost last: ``(model, its kvhive caches)``.
# The always-called forward hook also runs when the pre-hook raised, and must then restore nothing.
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


def refuse_two_caches(kwargs) -> None:
    """Refuse a call given one cache as ``cache=`` and another as ``past_key_values=`` (one keyword:
    its name from transformers 5.24 on, and the old one) where either is kvhive's: one of them would
    be used and the other silently left out."""
    named = (kwargs.get("cache"), kwargs.get("past_key_values"))
    if named[0] is None or named[1] is None or named[0] is named[1]:
        return
    if any(isinstance(cache, (KVHiveCache, CacheRows)) for cache in named):
        raise ValueError(
            "this call was given two different caches, cache= and past_key_values= (one keyword: its name from "
            "transformers 5.24 on, and its old name): one would be used and the other left out; pass one cache, as "
            "cache= (past_key_values= before transformers 5.24)"
        )


def refuse_plain_question_chunks(cache: KVHiveCache, args, kwargs) -> None:
    """Refuse a prompt fed to a question-aware cache (``question_tokens``) other than by
    :func:`kvhive.api.prefill_prompt`, which plans the prompt and follows every context chunk with a
    copy of the question: a plain forward of the prompt, or ``model.generate(prefill_chunk_size=...)``,
    would give the plain chunked result, the question never scoring a chunk."""
    if cache.question_tokens is None or cache.prompt_planned:
        return
    tokens = kwargs.get("input_ids")
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    if tokens is None or tokens.dim() < 2 or tokens.shape[1] < 2:
        return
    raise ValueError(
        f"this cache was made with question_tokens={cache.question_tokens} (a question-aware chunked prefill): its "
        "prompt is fed by kvhive.prefill_prompt(model, input_ids, cache), which follows every chunk with a copy of "
        "the question; a forward of the prompt or model.generate(prefill_chunk_size=...) would feed plain chunks. "
        "Feed it with prefill_prompt(..., last_chunk=False) and then call model.generate without prefill_chunk_size, "
        "use kvhive.generate(..., prefill_chunk=N, question=TEXT), or make the cache without question_tokens"
    )


def _enter_forward(model, args, kwargs):
    given = kwargs.get("cache")  # transformers >= 5.24 (``past_key_values`` before)
    if isinstance(given, KVHiveCache) and kwargs.get("past_key_values") is None:  # a decode step's case
        caches = [given]
    else:
        refuse_two_caches(kwargs)
        caches = _kvhive_caches_in(args, kwargs)
        if not caches:
            return None
    config = model.config
    for cache in caches:  # before anything is stored: an empty cache refuses too
        if cache.matching_config is None or cache.matching_config() is not config:
            cache.check_model(config)
        if cache.question_tokens is not None and not cache.prompt_planned:
            refuse_plain_question_chunks(cache, args, kwargs)
    if torch.compiler.is_compiling():
        return _switch_in_trace(model)
    # Stacked rows: a slot overflow refused before anything is stored; each row's own positions.
    first = caches[0].layers[0] if len(caches) == 1 and caches[0].layers else None
    stacked = first is not None and first.row_seen is not None
    positioned = prepare_stacked_forward(caches[0], args, kwargs) if stacked else None
    _switch_attention(model)
    _ENTERED.__dict__.setdefault("forwards", []).append((model, caches))
    return None if positioned is None else (args, positioned)


def _switch_attention(model) -> None:
    """Switch ``model``'s configs to kvhive's attention for one kvhive call (the first of
    concurrent calls switches, the last restores: :func:`_restore_attention`)."""
    config, attachment = model.config, _ATTACHED.get(model) or _attachment(model)
    with attachment.lock:
        if attachment.running == 0:
            configs = attachment.configs
            if not configs or configs[0] is not config:
                configs = attachment.configs = _attention_configs(model)
            attachment.switched = [(each, each._attn_implementation_internal) for each in configs]
            for switched in configs:
                switched._attn_implementation_internal = ATTENTION_NAME
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
    if torch.compiler.is_compiling():
        return _restore_in_trace(model) if _kvhive_caches_in(args, kwargs) else None
    entered = _ENTERED.__dict__.get("forwards")
    if not entered or entered[-1][0] is not model:  # no kvhive cache, or the pre-hook raised
        return None
    _, caches = entered.pop()
    ran_chunk_on_cpu = False
    for cache in caches:
        cache.prefill_scratch.held = None  # PrefillScratch.clear, inline: every step
        ran_chunk_on_cpu |= cache.__dict__.pop(PROMPT_CHUNK_ON_CPU, False)
    if ran_chunk_on_cpu:
        trim_heap()  # the chunk's last temporaries (the last layers' MLP) before the next chunk
    if static_step.LIVE_CAPTURED_LOOPS and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        static_step.release_captured_loops(larger_than=static_step.HELD_LOOP_BYTES, wait=False)  # (module docstring)
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
        refuse_two_caches(kwargs)
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVHiveCache) and cache.positions == ORIGINAL_POSITIONS:
            skip_cached_prefix(cache, input_ids, kwargs)
            new_tokens = kwargs.get("next_sequence_length")
            if new_tokens is None and not cache.get_seq_length():
                new_tokens = input_ids.shape[-1]
            cache.check_generation_inputs(input_ids, bool(kwargs.get("is_first_iteration")), new_tokens)
        return self.__wrapped__(input_ids, *args, **kwargs)


def skip_cached_prefix(cache: KVHiveCache, input_ids, kwargs: dict) -> None:
    """Feed only the tokens ``cache`` has not seen on a first step given the whole sequence.

    ``generate``'s own prefill slices the sequence after the cached tokens when the attention mask
    covers it (``next_sequence_length``), but transformers' assisted and speculative decoding
    (``prompt_lookup_num_tokens=``, ``assistant_model=``) prepares its first step without that
    slice, so a cache that already holds the prompt's beginning would get the whole prompt a
    second time, at positions after it. Here the slice is set as the prefill sets it: the first
    step, no slice given, a cache holding tokens, and the attention mask (or, where ``generate``
    dropped an all-ones mask, the position ids it made from it) covering the whole sequence."""
    if not kwargs.get("is_first_iteration") or kwargs.get("next_sequence_length") is not None:
        return
    seen = int(cache.get_seq_length())  # the host's count: no device read
    if input_ids is None or not seen:
        return
    length = int(input_ids.shape[-1])
    mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
    if mask is not None:
        whole = mask.shape[-1] == length
    elif positions is not None:
        # A later chunk of a chunked prefill has its own positions (from the cached length on): one
        # read of its last position tells it from the whole sequence, whose longest row ends at
        # length - 1. (Prefill only: a decode step never gets here.)
        whole = positions.shape[-1] == length and int(positions[..., -1].max()) == length - 1
    else:
        whole = False
    if whole:
        kwargs["next_sequence_length"] = length - seen


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
