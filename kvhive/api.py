"""One-line use of a method with ``model.generate``.

cache = kvhive.make_cache(model, "snapkv", budget=128)
model.generate(**inputs, cache=cache, max_new_tokens=32)  # transformers < 5.24: past_key_values=cache

Also here: the attention switches (:func:`compression`, :func:`plain_attention`), one prefill
shared by several caches (:func:`shared_prefill`) and how a prompt is encoded and fed
(:func:`encode_prompt`, :func:`prefill_prompt`). Text generation (``generate``,
``generate_batch``) is ``kvhive.generation``, built on these.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from kvhive import static_step
from kvhive.attention import ATTENTION_NAME, register
from kvhive.attention.integration import attach
from kvhive.cache import Budget, KVHiveCache
from kvhive.cache.guards import refuse_encoder_decoder
from kvhive.cache.options import CACHE_POSITIONS
from kvhive.compat import cache_kwarg
from kvhive.methods import Policy, make_policy


def use_kvhive_attention(model) -> str:
    """Switch ``model`` to the kvhive attention implementation; returns the previous one."""
    register()
    attach(model)
    previous = model.config._attn_implementation
    if previous != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    return previous


@contextlib.contextmanager
def compression(model) -> Iterator[Any]:
    """Run ``model`` with kvhive attention inside the block, restoring the previous one after. A
    kvhive decode step compiled by one's own ``torch.compile`` compiles inside it on every torch
    (``kvhive.static_step``: below torch 2.13, only there; ``model.generate`` switches the attention
    before its compiled calls itself)."""
    previous = use_kvhive_attention(model)
    try:
        with static_step.attention_switched():
            yield model
    finally:
        if previous != ATTENTION_NAME:
            model.set_attn_implementation(previous)


def compiling_attention(model, compile) -> contextlib.AbstractContextManager:
    """Where kvhive compiles a decode step (``compile`` truthy) on a torch whose dynamo does not trace
    the attention switch of kvhive's forward pre-hook: :func:`compression` for the block; else
    nothing (the pre-hook switches per forward, safe across threads)."""
    if compile and not static_step.TORCH_COMPILES_KVHIVE:
        return compression(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def plain_attention(model) -> Iterator[Any]:
    """Run ``model`` with transformers' own sdpa attention inside the block (the uncompressed
    baseline benchmarks compare against), restoring the previous implementation after."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


class FirstTimes:
    """Keys seen so far, thread-safe: :meth:`first` is True for one caller per key, however many
    threads ask at once. ``seen``: the set that holds them (a fresh one by default)."""

    def __init__(self, seen: set | None = None) -> None:
        self._seen = set() if seen is None else seen
        self._lock = threading.Lock()

    def first(self, key) -> bool:
        """Record ``key``; whether this is the first time it is recorded."""
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()


# (method, query heads, KV heads, granularity) already warned about, once across threads.
EQUIVALENCE_WARNINGS = FirstTimes()


def warn_if_allocation_cannot_differ(policy: Policy, config) -> None:
    """Warn (once per method and head shape) when a method that allocates its budget across heads
    runs where there is only one stored head per layer: it then keeps what its base
    method keeps (e.g. an Ada-KV variant at ``head_granularity="kv"`` on a one-KV-head model).

    A method declares head-wise allocation by its config's ``head_granularity`` parameter; the
    stored heads per layer are the KV heads (``"kv"``) or the query heads (``"query"``).
    """
    import dataclasses
    import warnings

    if not any(field.name == "head_granularity" for field in dataclasses.fields(policy.config)):
        return
    text_config = config.get_text_config(decoder=True)
    query_heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or query_heads
    granularity = policy.head_granularity
    stored_heads = {"kv": kv_heads, "query": query_heads}.get(granularity)
    key = (policy.name, query_heads, kv_heads, granularity)
    if stored_heads != 1:
        return
    if not EQUIVALENCE_WARNINGS.first(key):
        return
    hint = (
        f" Pass head_granularity='query' to allocate over the {query_heads} query heads."
        if granularity == "kv" and query_heads > 1
        else ""
    )
    warnings.warn(
        f"method {policy.name!r} allocates its budget across heads, but with head_granularity={granularity!r} this "
        f"model stores one head per layer ({kv_heads} KV head(s), {query_heads} query head(s)): it keeps what its base "
        f"method keeps (up to how ties between equal scores are broken).{hint}",
        UserWarning,
        stacklevel=3,
    )


def make_cache(
    model,
    method: str | Policy = "full",
    budget: int | float | str | None = None,
    *,
    ratio: float | None = None,
    compress_sliding: bool = False,
    decode_every: int = 1,
    decode_slack: int = 0,
    record_prefill: bool = False,
    positions: str = "original",
    dense_decode: str = "auto",
    prefill_chunk: int | None = None,
    decode_capacity: int | None = None,
    bucket_budget: bool = False,
    question_tokens: int | None = None,
    kv_bits: int | None = None,
    **method_parameters: Any,
) -> KVHiveCache:
    """A :class:`KVHiveCache` for ``model`` running ``method`` at ``budget`` tokens per head
    (or ``ratio`` of the prompt), to pass straight to ``model.generate`` or ``model(...)``.

    The model runs kvhive's attention in the calls given a kvhive cache and only there
    (:func:`kvhive.attention.integration.attach`): its configured implementation (eager, sdpa,
    flash-attention) and ``prepare_inputs_for_generation`` behave as before in every other call.
    ``dense_decode`` picks the attention of a decode step over equal-length heads on CUDA:
    ``"sdpa"`` (flash / memory-efficient), ``"kernel"`` (kvhive's split-K Triton kernel over the
    buffer in place) or ``"auto"`` (the default: the kernel over a fixed capacity, whose empty
    slots sdpa would mask, which takes it off flash-decoding; sdpa over an unmasked slice); a method that scores by the new query's attention gets its weights from that
    kernel's own pass on CUDA either way (sdpa does not return them). ``prefill_chunk``: the prompt is fed in chunks of that many tokens by
    ``kvhive.generate`` (pass ``prefill_chunk_size=`` to ``model.generate`` yourself), compressed
    as it goes (``KVHiveCache``). ``bucket_budget``: a ratio budget resolves up to one of a few
    sizes (:func:`kvhive.cache.budget.bucket_up`: at most 25% more tokens), so prompts of many
    lengths share one compiled decode graph; ``kvhive.generate(compile=True)`` turns it on.
    ``question_tokens``: with ``prefill_chunk`` and a prefill-only method (SnapKV, PyramidKV, KNorm),
    the prompt's last that many tokens are its question: every chunk is scored with the question's
    queries (a copy of the question fed after the chunk, then dropped) instead of the chunk's own
    (:func:`prefill_prompt`; docs/METHODS.md, "Question-aware chunked prefill"). ``kv_bits``: the kept
    keys and values are stored as int8 (8) or packed int4 (4) codes with scales (None: the model's
    dtype; docs/DESIGN.md, "Quantized storage")."""
    refuse_encoder_decoder(model.config)
    if not isinstance(bucket_budget, bool):
        raise ValueError(f"invalid bucket_budget={bucket_budget!r}: expected True or False")
    policy = method if isinstance(method, Policy) else make_policy(method, **method_parameters)
    budget_spec = _budget_of(policy, budget, ratio, bucket_budget)
    attach(model)
    warn_if_allocation_cannot_differ(policy, model.config)
    rotator = None
    if positions == CACHE_POSITIONS:
        from kvhive.attention.rope import KeyRotator

        rotator = KeyRotator(model)
    return KVHiveCache(
        model.config,
        policy,
        budget_spec,
        compress_sliding=compress_sliding,
        decode_every=decode_every,
        decode_slack=decode_slack,
        record_prefill=record_prefill,
        positions=positions,
        key_rotator=rotator,
        dense_decode=dense_decode,
        prefill_chunk=prefill_chunk,
        decode_capacity=decode_capacity,
        question_tokens=question_tokens,
        kv_bits=kv_bits,
    )


def _budget_of(policy: Policy, budget, ratio, bucket_budget: bool) -> Budget:
    """The :class:`Budget` of :func:`make_cache`'s ``budget`` / ``ratio`` for ``policy``."""
    if budget is not None and ratio is not None:
        raise ValueError("give either budget (tokens per head, or a ratio as a float) or ratio, not both")
    if not policy.phases:
        # A method that never evicts (full) keeps everything: a budget would be a silent no-op.
        if budget is not None or ratio is not None:
            given = f"budget={budget!r}" if budget is not None else f"ratio={ratio!r}"
            warnings.warn(f"method {policy.name!r} keeps every token: {given} is ignored", UserWarning, stacklevel=3)
        return Budget(ratio=1.0)
    if budget is None and ratio is None:
        # No default: a ratio of the prompt is not lossless for a method that also evicts while
        # decoding (H2O would stay at the prompt length), and a user asking for a method expects
        # it to compress to a size they chose.
        raise ValueError(
            f"method {policy.name!r} needs a budget and none was given: pass budget= (tokens per head, e.g. 128) "
            "or ratio= (a fraction of the prompt, e.g. 0.2); method 'full' keeps everything"
        )
    budget_spec = Budget(ratio=ratio) if ratio is not None else Budget.parse(budget)
    if bucket_budget and budget_spec.ratio is not None:
        budget_spec = Budget(ratio=budget_spec.ratio, bucketed=True)
    return budget_spec


def changes_prefill_attention(policy: Policy) -> bool:
    """Whether a method alters the model's attention (so its prefill cannot be shared)."""
    return policy.changes_attention_logits


def shared_prefill(model, input_ids, caches: list[KVHiveCache]):
    """Run one prefill of ``input_ids`` and fill every cache in ``caches`` from it.

    Returns, per cache, the logits of the last prompt position. Each cache is compressed by its own method
    exactly as if it had run the prefill itself (a layer's cache is cut after its own attention,
    so the forward pass is the same for all of them); a cache whose method changes the
    attention (:func:`changes_prefill_attention`) runs its own prefill.
    """
    import torch

    from kvhive.attention.prefill import replay_prefill

    recorder = make_cache(model, "full", compress_sliding=True, record_prefill=True)
    per_cache_logits = []
    with torch.no_grad():
        logits = model(input_ids=input_ids, **{cache_kwarg(model): recorder}, use_cache=True, logits_to_keep=1).logits[
            :, -1
        ]
        for cache in caches:
            if changes_prefill_attention(cache.policy):
                own = model(input_ids=input_ids, **{cache_kwarg(model): cache}, use_cache=True, logits_to_keep=1)
                per_cache_logits.append(own.logits[:, -1])
            else:
                replay_prefill(recorder, cache)
                per_cache_logits.append(logits)
    return per_cache_logits


def context_length(model) -> int:
    """The model's trained context length (``max_position_embeddings``)."""
    return int(model.config.get_text_config(decoder=True).max_position_embeddings)


def encode_prompt(tokenizer, prompt: str, model, max_new_tokens: int = 0):
    """Tokenise ``prompt`` as a batch of one, with clear errors for empty or too long prompts."""
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("invalid prompt: expected a non-empty string")
    encoded = tokenizer(prompt, return_tensors="pt")
    limit = context_length(model)
    total = encoded["input_ids"].shape[1] + max_new_tokens
    if total > limit:
        raise ValueError(
            f"invalid prompt: {encoded['input_ids'].shape[1]} prompt tokens + max_new_tokens={max_new_tokens} "
            f"exceed the model's context length of {limit} tokens"
        )
    return encoded


def question_token_count(tokenizer, prompt: str, question: str) -> int:
    """How many of ``prompt``'s tokens are its question: ``question`` is the prompt's final part
    (the prompt must end with it); the count is of the prompt's tokens from where the tokens of the
    text before the question stop matching (a token spanning the boundary counts as the question's)."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"invalid question={question!r}: expected a non-empty string, the prompt's final part")
    if not prompt.endswith(question):
        raise ValueError(
            "invalid question: the prompt does not end with it (the question is the prompt's final part, after "
            "the context; give the question's text exactly as the prompt ends)"
        )
    ids = list(tokenizer(prompt)["input_ids"])
    before = list(tokenizer(prompt[: len(prompt) - len(question)])["input_ids"])
    common = 0
    while common < min(len(ids), len(before)) and ids[common] == before[common]:
        common += 1
    count = len(ids) - common
    if count < 1 or count >= len(ids):
        raise ValueError(
            f"invalid question: it is {count} of the prompt's {len(ids)} tokens; expected at least one token and some "
            "context before it"
        )
    return count


def static_decode_methods() -> list[str]:
    """Registered methods whose decode step compiles to one graph (``Policy.static_decode``)."""
    from kvhive.methods.registry import method_names, policy_class

    return [name for name in method_names() if policy_class(name).static_decode]


def prompt_chunks(
    length: int, prefill_chunk: int | None, question_tokens: int | None = None
) -> list[tuple[int, int, int]]:
    """How a prompt of ``length`` tokens is fed: ``(start, stop, copy)`` per forward, ``copy`` the
    number of question tokens appended to the chunk ``[start, stop)`` (question-aware chunked
    prefill: every chunk that holds only context, before the last, gets the prompt's last
    ``question_tokens`` tokens; 0 for the others). One forward without ``prefill_chunk``."""
    chunk = prefill_chunk or length
    context_end = length - question_tokens if question_tokens else 0
    return [
        (start, min(length, start + chunk), question_tokens if question_tokens and start + chunk <= context_end else 0)
        for start in range(0, length, chunk)
    ]


def prefill_prompt(model, input_ids, cache: KVHiveCache, attention_mask=None, *, last_chunk: bool = True):
    """Run a prompt ``input_ids [B, P]`` through ``cache`` and return the last position's logits
    ``[B, V]``: in one forward, or in chunks of ``cache.prefill_chunk`` tokens (the budgets planned
    on the whole prompt first, ``cache.plan_prompt``). With ``cache.question_tokens`` (a
    question-aware chunked prefill) each chunk that holds only context, before the last, is fed
    followed by a copy of the prompt's last ``question_tokens`` tokens (its question) at the
    positions right after the chunk; the cache drops the copy's entries once each layer has scored
    with its queries (docs/METHODS.md, "Question-aware chunked prefill"). ``last_chunk=False``
    leaves the last chunk unfed (``kvhive.generate`` lets ``model.generate`` feed it) and returns
    None."""
    import torch

    length = int(input_ids.shape[1])
    if cache.prefill_chunk is not None:
        cache.plan_prompt(length, attention_mask.sum(dim=-1).tolist() if attention_mask is not None else None)
    chunks = prompt_chunks(length, cache.prefill_chunk, cache.question_tokens)
    if not last_chunk:
        chunks = chunks[:-1]
    kwarg = cache_kwarg(model)
    logits = None
    with torch.no_grad():
        for start, stop, copy in chunks:
            ids = input_ids[:, start:stop]
            mask = attention_mask[:, :stop] if attention_mask is not None else None
            if copy:
                ids = torch.cat([ids, input_ids[:, length - copy :]], dim=1)
                if mask is not None:
                    mask = torch.cat([mask, attention_mask[:, length - copy :]], dim=1)
            cache.question_copy_tokens = copy
            try:
                output = model(input_ids=ids, attention_mask=mask, **{kwarg: cache}, use_cache=True, logits_to_keep=1)
            finally:
                cache.question_copy_tokens = 0
            logits = None if copy else output.logits[:, -1]
    return logits


# Text generation, read here before it moved to kvhive.generation. Resolved on first use:
# kvhive.generation builds on this module, so this module imports nothing of it.
_MOVED_TO_GENERATION = frozenset({"SlotScheduler", "generate", "generate_batch"})


def __getattr__(name: str) -> Any:
    if name in _MOVED_TO_GENERATION:
        return getattr(importlib.import_module("kvhive.generation"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
