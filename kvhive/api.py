"""One-line use of a method with ``model.generate``.

cache = kvhive.make_cache(model, "snapkv", budget=128)
model.generate(**inputs, cache=cache, max_new_tokens=32)  # transformers < 5.24: past_key_values=cache
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from kvhive import static_step
from kvhive.attention import ATTENTION_NAME, register
from kvhive.attention.integration import attach
from kvhive.cache import Budget, KVHiveCache
from kvhive.cache.budget import bucket_up
from kvhive.cache.kv_cache import CACHE_POSITIONS, refuse_encoder_decoder
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
    kvhive decode step compiles inside it on every torch (``kvhive.static_step``: below torch 2.13,
    only there)."""
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


# (method, query heads, KV heads, granularity) already warned about; the lock makes "once" hold
# when several threads make caches at the same time.
_EQUIVALENCE_WARNED: set[tuple[str, int, int, str]] = set()
_EQUIVALENCE_WARNED_LOCK = threading.Lock()


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
    with _EQUIVALENCE_WARNED_LOCK:
        if key in _EQUIVALENCE_WARNED:
            return
        _EQUIVALENCE_WARNED.add(key)
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
    (:func:`prefill_prompt`; docs/METHODS.md, "Question-aware chunked prefill")."""
    refuse_encoder_decoder(model.config)
    if not isinstance(bucket_budget, bool):
        raise ValueError(f"invalid bucket_budget={bucket_budget!r}: expected True or False")
    policy = method if isinstance(method, Policy) else make_policy(method, **method_parameters)
    if budget is not None and ratio is not None:
        raise ValueError("give either budget (tokens per head, or a ratio as a float) or ratio, not both")
    if not policy.phases:
        # A method that never evicts (full) keeps everything: a budget would be a silent no-op.
        if budget is not None or ratio is not None:
            given = f"budget={budget!r}" if budget is not None else f"ratio={ratio!r}"
            warnings.warn(f"method {policy.name!r} keeps every token: {given} is ignored", UserWarning, stacklevel=2)
        budget, ratio = None, 1.0
    elif budget is None and ratio is None:
        # No default: a ratio of the prompt is not lossless for a method that also evicts while
        # decoding (H2O would stay at the prompt length), and a user asking for a method expects
        # it to compress to a size they chose.
        raise ValueError(
            f"method {policy.name!r} needs a budget and none was given: pass budget= (tokens per head, e.g. 128) "
            "or ratio= (a fraction of the prompt, e.g. 0.2); method 'full' keeps everything"
        )
    if ratio is not None:
        budget_spec = Budget(ratio=ratio)
    else:
        budget_spec = Budget.parse(budget)
    if bucket_budget and budget_spec.ratio is not None and policy.phases:
        budget_spec = Budget(ratio=budget_spec.ratio, bucketed=True)
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
    )


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

    from kvhive.attention.integration import replay_prefill

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


def generate(
    model,
    tokenizer,
    prompt: str,
    method: str | Policy = "full",
    budget: int | float | str | None = None,
    max_new_tokens: int = 32,
    compile: bool | None = None,
    question: str | None = None,
    **cache_options: Any,
) -> tuple[str, KVHiveCache]:
    """Greedy generation with a compressed cache; returns the generated text and the cache.

    ``compile``: None follows transformers (its compiled decode on an accelerator when the cache is
    compileable, ``KVHiveCache.is_compileable``); True compiles the decode step on any device and
    refuses a cache whose step cannot compile to one graph, and resolves a ratio budget up to one of a
    few sizes (``bucket_budget``, at most 25% more tokens; pass ``bucket_budget=False`` for the
    exact ratio, one graph per prompt length); False decodes eagerly.

    ``question`` (with ``prefill_chunk``): the prompt's final part, its question (the prompt must
    end with it): a question-aware chunked prefill (``question_tokens``, :func:`make_cache`), each
    chunk scored with the question's queries instead of the chunk's own."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"invalid max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    if compile not in (None, True, False):
        raise ValueError(f"invalid compile={compile!r}: expected True, False or None")
    encoded = encode_prompt(tokenizer, prompt, model, max_new_tokens)
    if question is not None:
        if cache_options.get("question_tokens") is not None:
            raise ValueError("give either question (its text) or question_tokens (its token count), not both")
        if not cache_options.get("prefill_chunk"):
            raise ValueError(
                "question needs prefill_chunk: it makes a chunked prefill question-aware (without chunks the prompt's "
                "own last queries are the question already)"
            )
        cache_options["question_tokens"] = question_token_count(tokenizer, prompt, question)
    if compile is True and "decode_capacity" not in cache_options and not cache_options.get("prefill_chunk"):
        # Layers that grow while decoding (the full cache, prefill-only methods) get room for every
        # new token, so the compiled step keeps one shape (used only by such layers); bucketed, so
        # requests of different lengths share it.
        cache_options["decode_capacity"] = bucket_up(max_new_tokens + 1)
    if compile is True:
        # A ratio of each prompt would be a new shape, and so a new graph, per prompt length.
        cache_options.setdefault("bucket_budget", True)
    cache = make_cache(model, method, budget, **cache_options)
    import torch

    compile_options: dict[str, Any] = {}
    if cache.prefill_chunk is not None:
        if compile is True:
            raise ValueError(
                "compile=True with prefill_chunk: transformers would compile the prompt chunks too, whose compression "
                "is not one static graph; compile the decode without chunks, or chunk without compile"
            )
        compile = False if compile is None else compile
        if cache.question_tokens is not None:
            # Question-aware: kvhive feeds every chunk but the last, each followed by a copy of the
            # question (plans the prompt too); model.generate feeds the last chunk, which ends with
            # the real question, in one forward (it is at most prefill_chunk tokens).
            prefill_prompt(model, encoded["input_ids"], cache, encoded.get("attention_mask"), last_chunk=False)
        else:
            row_lengths = encoded["attention_mask"].sum(dim=-1).tolist() if "attention_mask" in encoded else None
            cache.plan_prompt(int(encoded["input_ids"].shape[1]), row_lengths)
            compile_options["prefill_chunk_size"] = cache.prefill_chunk
    # (Below torch 2.13 a compiled step needs the attention switched before the call: kvhive.static_step.)
    with compiling_attention(model, compile is True):
        if compile is True:
            if cache.static_decode and not cache.is_compileable:  # the installed torch (kvhive.static_step)
                raise ValueError(f"compile=True: {cache.compile_problem(int(encoded['input_ids'].shape[1]))}")
            if not cache.is_compileable:
                raise ValueError(
                    f"compile=True: the decode step of method {cache.policy.name!r} with these options cannot compile "
                    "to one graph (its layers change size from step to step: decode_every/decode_slack, positions='cache', "
                    "per-query-head storage with a decode-phase method, or head-wise budgets in compressed "
                    "sliding-window layers); "
                    "methods that can: "
                    + ", ".join(static_decode_methods())
                    + ", and with a decode capacity the full cache and the prefill-only scorers (Ada-KV's included)"
                )
            problem = cache.compile_problem(int(encoded["input_ids"].shape[1]))
            if problem is not None:
                raise ValueError(f"compile=True with method {cache.policy.name!r}: {problem}")
            from transformers import CompileConfig

            config = CompileConfig(fullgraph=True, dynamic=False)
            config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
            compile_options["compile_config"] = config
        if compile is False:
            compile_options["disable_compile"] = True
        with torch.no_grad():
            output = model.generate(
                **encoded,
                **{cache_kwarg(model): cache},
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                **compile_options,
            )
    new_tokens = output[0, encoded["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True), cache


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


def _prefill_alone(model, encoded, cache: KVHiveCache):
    """Run one prompt (a batch of one) through ``cache``, in chunks when the cache was made with
    ``prefill_chunk`` (as ``kvhive.generate`` feeds it); returns the last position's logits."""
    return prefill_prompt(model, encoded["input_ids"], cache, encoded.get("attention_mask"))


def _stop_ids(model, eos_token_id) -> set[int]:
    """The token ids that end a row: ``eos_token_id`` (an int or ints) or the model's generation
    config's (as ``model.generate`` stops)."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(token) for token in eos_token_id}


def generate_batch(
    model,
    tokenizer,
    prompts: list[str],
    method: str | Policy = "full",
    budget: int | float | str | None = None,
    max_new_tokens: int = 32,
    *,
    stop_strings: list[str] | list[list[str]] | None = None,
    eos_token_id: int | list[int] | None = None,
    max_batch_size: int | None = None,
    compile: bool | str = False,
    do_sample: bool | list[bool] = False,
    temperature: float | list[float] = 1.0,
    top_k: int | list[int | None] | None = None,
    top_p: float | list[float | None] | None = None,
    seed: int | list[int] | None = None,
    **cache_options: Any,
) -> list[str]:
    """Generation for several prompts (greedy, or sampled per row): each prompt is prefilled alone into its own cache
    (``make_cache(model, method, budget, **cache_options)``; ``prefill_chunk`` feeds it in chunks),
    the caches are stacked into one batch of fixed slots (:meth:`KVHiveCache.stack` with
    ``batch_slots``), and all rows decode together, one token per row per step with each row's own
    positions. A row ends at an end-of-sequence token (``eos_token_id``, default the model's
    generation config, as ``model.generate``) or once its text contains one of its
    ``stop_strings`` (a list for every row, or one list per row; the stop string stays in the text),
    or after ``max_new_tokens``; a finished row frees its slot. Returns one text per prompt, each
    what ``kvhive.generate`` returns for that prompt alone.

    ``max_batch_size`` (an integer >= 1; None: every prompt at once): at most that many rows decode
    at once. The first ``max_batch_size`` prompts start; the others wait in order, and as soon as a
    row leaves, the next waiting prompt is prefilled alone and takes its slot
    (:meth:`KVHiveCache.fill_slots`; continuous batching), between two decode steps. Slots are
    fixed: rows leaving and joining move no buffer (a free slot decodes a placeholder until a
    prompt takes it), so the decode step keeps one shape.

    **Sampling, per row.** ``do_sample``, ``temperature``, ``top_k``, ``top_p`` and ``seed`` are each
    one value for every prompt or a list with one per prompt: a row with ``do_sample`` draws each
    token from its softmax at ``temperature``, restricted to its ``top_k`` tokens and its ``top_p``
    nucleus (transformers' logits warpers), with its own generator seeded by ``seed`` (None: drawn
    from torch's global generator), so a row gives the same tokens in any batch as alone with the
    same seed; a row without ``do_sample`` is greedy.

    ``compile=True`` (or the name of a ``torch.compile`` backend, e.g. ``"aot_eager"``) compiles
    that decode step once (``torch.compile(fullgraph=True, dynamic=False)``; on CUDA with the
    default backend, CUDA graphs: ``mode="reduce-overhead"``) and every step, across
    joins and leaves, replays it; the slots round up to a power of two and a growing layer's slot
    capacity to a bucket (``bucket_up``), so other batches of similar size reuse the graph. Refused,
    naming why, where the cache's step cannot compile (``KVHiveCache.compile_problem``).

    Every method decodes stacked rows (BUZZ with each row's own eviction schedule, BumbleBee's
    summaries and subgen-attention's estimators per row). Caches that cannot be stacked (Ada-KV when
    heads keep different counts; rows of different lengths in a layer that evicts while decoding,
    e.g. H2O with a prompt shorter than the budget; BUZZ keeps a length per row there) are refused
    with a ValueError naming the reason: decode those prompts one at a time with ``kvhive.generate``."""
    import torch

    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError(f"invalid prompts={prompts!r}: expected a non-empty list of strings")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"invalid max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    if max_batch_size is not None and (
        isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1
    ):
        raise ValueError(f"invalid max_batch_size={max_batch_size!r}: expected an integer >= 1 (rows), or None")
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile)):
        raise ValueError(f"invalid compile={compile!r}: expected True, False or a torch.compile backend name")
    if "decode_capacity" in cache_options:
        raise ValueError(
            "generate_batch sizes the decode capacity itself (max_new_tokens): decode_capacity is not accepted"
        )
    if compile and cache_options.get("prefill_chunk"):
        raise ValueError("compile=True with prefill_chunk: compile the decode without chunks, or chunk without compile")
    if compile:
        cache_options.setdefault("bucket_budget", True)  # one shape for prompts of nearby lengths
        cache_options["decode_capacity"] = bucket_up(max_new_tokens + 1)
    row_stops = _row_stop_strings(stop_strings, len(prompts))
    samplings = _row_samplings(len(prompts), do_sample, temperature, top_k, top_p, seed, model.device)
    stop_ids = _stop_ids(model, eos_token_id)
    encoded = [encode_prompt(tokenizer, prompt, model, max_new_tokens) for prompt in prompts]
    limit = len(prompts) if max_batch_size is None else min(max_batch_size, len(prompts))
    slots = 1 << (limit - 1).bit_length() if compile else limit
    # A growing layer's row holds at most its prompt and every decode token.
    longest = max(int(item["input_ids"].shape[1]) for item in encoded) + max_new_tokens + 1
    slot_capacity = bucket_up(longest) if compile else longest
    generated: list[list[int]] = [[] for _ in prompts]

    def prefill(prompt_index: int) -> tuple[KVHiveCache, torch.Tensor]:
        cache = make_cache(model, method, budget, **cache_options)
        if cache.positions != "original":
            raise ValueError("generate_batch needs positions='original' (rows sit at different positions)")
        return cache, samplings[prompt_index].next_token(_prefill_alone(model, encoded[prompt_index], cache)[0])

    def finished(prompt_index: int, token: int) -> bool:
        """Record a row's new token; whether the row ends with it."""
        tokens = generated[prompt_index]
        tokens.append(token)
        return (
            len(tokens) >= max_new_tokens
            or token in stop_ids
            or any(stop in tokenizer.decode(tokens, skip_special_tokens=True) for stop in row_stops[prompt_index])
        )

    # (Below torch 2.13 a compiled step needs the attention switched before the call: kvhive.static_step.)
    with compiling_attention(model, compile):
        waiting = list(range(len(prompts)))
        # The first batch: stacked whatever its first tokens (a method that cannot stack is refused
        # before any decoding, as when every prompt starts at once).
        starting = [waiting.pop(0) for _ in range(limit)]
        caches, first_tokens = zip(*(prefill(prompt_index) for prompt_index in starting), strict=True)
        stacked = KVHiveCache.stack(
            list(caches), decode_capacity=max_new_tokens + 1, batch_slots=slots, slot_capacity=slot_capacity
        )
        if compile and not stacked.is_compileable:
            problem = caches[0].compile_problem(int(encoded[starting[0]]["input_ids"].shape[1]))
            raise ValueError(
                f"compile=True with method {stacked.policy.name!r}: "
                + (problem or "its decode step over these rows does not compile to one graph")
            )
        del caches
        # The prompt in each slot (None: free).
        running: list[int | None] = list(starting) + [None] * (slots - limit)
        next_tokens = torch.zeros(slots, dtype=torch.long, device=first_tokens[0].device)
        next_tokens[:limit] = torch.stack(first_tokens)
        kwarg = cache_kwarg(model)

        def step(tokens, positions, cache):
            return model(input_ids=tokens, position_ids=positions, **{kwarg: cache}, use_cache=True).logits[:, -1]

        if compile:
            if isinstance(compile, str):
                options = {"backend": compile}
            else:
                options = {"mode": "reduce-overhead"} if next_tokens.device.type == "cuda" else {}
            step = torch.compile(step, fullgraph=True, dynamic=False, **options)
        with torch.no_grad():
            while True:
                tokens = next_tokens.tolist()  # one read per step: the stop checks
                leaving = [
                    slot
                    for slot, prompt_index in enumerate(running)
                    if prompt_index is not None and finished(prompt_index, tokens[slot])
                ]
                if leaving:
                    stacked.free_slots(leaving)
                    for slot in leaving:
                        running[slot] = None
                # Waiting prompts take the free slots. A prompt that ends with its first token never
                # needs the batch; the next one takes its place.
                for slot in [slot for slot, prompt_index in enumerate(running) if prompt_index is None]:
                    while waiting:
                        prompt_index = waiting.pop(0)
                        cache, token = prefill(prompt_index)
                        if not finished(prompt_index, int(token)):
                            stacked.fill_slots([slot], [cache])
                            running[slot] = prompt_index
                            next_tokens[slot] = token
                            break
                if all(prompt_index is None for prompt_index in running):
                    break
                # Each row's next position, from the layer's device counter (no host data sent per step).
                positions = stacked.layers[0].row_tokens_seen_device[:, None].clone()
                logits = step(next_tokens[:, None], positions, stacked)
                next_tokens = logits.argmax(dim=-1)
                for slot, prompt_index in enumerate(running):
                    if prompt_index is not None and samplings[prompt_index].do_sample:
                        next_tokens[slot] = samplings[prompt_index].next_token(logits[slot])
        return [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in generated]


class _RowSampling:
    """One row's choice of its next token: greedy, or a draw (temperature, top-k, top-p) from its
    own generator."""

    def __init__(self, do_sample: bool, temperature: float, top_k, top_p, seed, device) -> None:
        import torch

        self.do_sample = do_sample
        self.warpers = []
        self.generator = None
        if not do_sample:
            return
        from transformers.generation.logits_process import (
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k is not None:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p is not None and top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        if seed is None:
            seed = int(torch.randint(2**62, (), dtype=torch.int64))
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def next_token(self, logits):
        """``logits [V]`` of the row's last position: its next token (a 0-d long tensor)."""
        import torch

        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores = logits[None].float()
        for warper in self.warpers:
            scores = warper(None, scores)
        probabilities = torch.softmax(scores, dim=-1)
        return torch.multinomial(probabilities, 1, generator=self.generator)[0, 0]


def _row_samplings(rows: int, do_sample, temperature, top_k, top_p, seed, device) -> list[_RowSampling]:
    """One sampling per prompt, from values given once or as one per prompt; refuses bad values
    naming the parameter and its range."""

    def per_row(name, value):
        if isinstance(value, (list, tuple)):
            if len(value) != rows:
                raise ValueError(f"invalid {name}={value!r}: a list needs one value per prompt ({rows})")
            return list(value)
        return [value] * rows

    checks = {
        "do_sample": (lambda v: isinstance(v, bool), "True or False"),
        "temperature": (
            lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
            "a number > 0",
        ),
        "top_k": (
            lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 1),
            "an integer >= 1",
        ),
        "top_p": (
            lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1),
            "a number in (0, 1]",
        ),
        "seed": (lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0), "an integer >= 0"),
    }
    given = {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed}
    values = {}
    for name, value in given.items():
        values[name] = per_row(name, value)
        accepted, accepted_range = checks[name]
        for row, item in enumerate(values[name]):
            if not accepted(item):
                where = f"[{row}]" if isinstance(value, (list, tuple)) else ""
                raise ValueError(f"invalid {name}{where}={item!r}: expected {accepted_range}")
    return [
        _RowSampling(
            values["do_sample"][row],
            float(values["temperature"][row]),
            values["top_k"][row],
            values["top_p"][row],
            values["seed"][row],
            device,
        )
        for row in range(rows)
    ]


def _row_stop_strings(stop_strings, rows: int) -> list[list[str]]:
    if stop_strings is None:
        return [[] for _ in range(rows)]
    if isinstance(stop_strings, str):
        stop_strings = [stop_strings]
    if not isinstance(stop_strings, (list, tuple)):
        raise ValueError(f"invalid stop_strings={stop_strings!r}: expected a list of strings, or one list per prompt")
    if all(isinstance(stop, str) for stop in stop_strings):
        per_row = [list(stop_strings)] * rows
    elif len(stop_strings) == rows and all(isinstance(stops, (list, tuple)) for stops in stop_strings):
        per_row = [list(stops) for stops in stop_strings]
    else:
        raise ValueError(
            f"invalid stop_strings={stop_strings!r}: expected a list of strings, or one list of strings per prompt "
            f"({rows})"
        )
    for stops in per_row:
        if not all(isinstance(stop, str) and stop for stop in stops):
            raise ValueError(f"invalid stop_strings={stop_strings!r}: every stop string must be a non-empty string")
    return per_row
