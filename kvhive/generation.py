"""Text generation with a compressed cache: one prompt (:func:`generate`, through
``model.generate``) or many decoded together in fixed batch slots (:func:`generate_batch`, whose
continuous-batching loop is :class:`SlotScheduler`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvhive.api import (
    compiling_attention,
    encode_prompt,
    make_cache,
    prefill_prompt,
    question_token_count,
    static_decode_methods,
)
from kvhive.cache import KVHiveCache
from kvhive.cache.budget import bucket_up
from kvhive.compat import cache_kwarg
from kvhive.methods import Policy
from kvhive.row_logits import apply_processors, refuse_unapplied_settings, row_processors


def generate(
    model,
    tokenizer,
    prompt: str,
    method: str | Policy = "full",
    budget: int | float | str | None = None,
    max_new_tokens: int = 32,
    compile: bool | None = None,
    question: str | None = None,
    streamer: Any = None,
    **cache_options: Any,
) -> tuple[str, KVHiveCache]:
    """Greedy generation with a compressed cache; returns the generated text and the cache.

    ``compile``: None follows transformers (its compiled decode on an accelerator when the cache is
    compileable, ``KVHiveCache.is_compileable``); True compiles the decode step on any device and
    refuses a cache whose step cannot compile to one graph, and resolves a ratio budget up to one of a
    few sizes (``bucket_budget``, at most 25% more tokens; pass ``bucket_budget=False`` for the
    exact ratio, one graph per prompt length); False decodes eagerly.

    ``question`` (with ``prefill_chunk``): the prompt's final part, its question (the prompt must
    end with it): a question-aware chunked prefill (``question_tokens``, :func:`kvhive.make_cache`),
    each chunk scored with the question's queries instead of the chunk's own.

    ``streamer``: handed to ``model.generate`` (a transformers streamer, e.g. ``TextStreamer``, or
    :class:`kvhive.progress.GenerationProgress` for a progress bar)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"invalid max_new_tokens={max_new_tokens!r}: expected an integer >= 1")
    if compile not in (None, True, False):
        raise ValueError(f"invalid compile={compile!r}: expected True, False or None")
    encoded = encode_prompt(tokenizer, prompt, model, max_new_tokens)
    if question is not None:
        cache_options["question_tokens"] = _question_tokens(tokenizer, prompt, question, cache_options)
    if compile is True and "decode_capacity" not in cache_options and not cache_options.get("prefill_chunk"):
        # Layers that grow while decoding (the full cache, prefill-only methods) get room for every
        # new token, so the compiled step keeps one shape (used only by such layers); bucketed, so
        # requests of different lengths share it.
        cache_options["decode_capacity"] = bucket_up(max_new_tokens + 1)
    if compile is True:
        # A ratio of each prompt would be a new shape, and so a new graph, per prompt length.
        cache_options.setdefault("bucket_budget", True)
    cache = make_cache(model, method, budget, **cache_options)
    compile, compile_options = _prefill_in_chunks(model, cache, encoded, compile)
    # (Below torch 2.13 a compiled step needs the attention switched before the call: kvhive.static_step.)
    with compiling_attention(model, compile is True):
        if compile is True:
            compile_options["compile_config"] = _compile_config(cache, int(encoded["input_ids"].shape[1]))
        if compile is False:
            compile_options["disable_compile"] = True
        with torch.no_grad():
            output = model.generate(
                **encoded,
                **{cache_kwarg(model): cache},
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                streamer=streamer,
                **compile_options,
            )
    new_tokens = output[0, encoded["input_ids"].shape[1] :]
    return tokenizer.decode(new_tokens, skip_special_tokens=True), cache


def _question_tokens(tokenizer, prompt: str, question: str, cache_options: dict[str, Any]) -> int:
    """The token count of ``question`` at the end of ``prompt``, refused where it cannot apply."""
    if cache_options.get("question_tokens") is not None:
        raise ValueError("give either question (its text) or question_tokens (its token count), not both")
    if not cache_options.get("prefill_chunk"):
        raise ValueError(
            "question needs prefill_chunk: it makes a chunked prefill question-aware (without chunks the prompt's "
            "own last queries are the question already)"
        )
    return question_token_count(tokenizer, prompt, question)


def _prefill_in_chunks(model, cache: KVHiveCache, encoded, compile: bool | None) -> tuple[bool | None, dict]:
    """For a cache made with ``prefill_chunk``: plan the prompt (and feed all but its last chunk
    when the prefill is question-aware); returns ``compile`` (chunks decode eagerly unless asked)
    and the options ``model.generate`` needs for the chunks."""
    options: dict[str, Any] = {}
    if cache.prefill_chunk is None:
        return compile, options
    if compile is True:
        raise ValueError(
            "compile=True with prefill_chunk: transformers would compile the prompt chunks too, whose compression "
            "is not one static graph; compile the decode without chunks, or chunk without compile"
        )
    if cache.question_tokens is not None:
        # Question-aware: kvhive feeds every chunk but the last, each followed by a copy of the
        # question (plans the prompt too); model.generate feeds the last chunk, which ends with
        # the real question, in one forward (it is at most prefill_chunk tokens).
        prefill_prompt(model, encoded["input_ids"], cache, encoded.get("attention_mask"), last_chunk=False)
    else:
        row_lengths = encoded["attention_mask"].sum(dim=-1).tolist() if "attention_mask" in encoded else None
        cache.plan_prompt(int(encoded["input_ids"].shape[1]), row_lengths)
        options["prefill_chunk_size"] = cache.prefill_chunk
    return (False if compile is None else compile), options


def _compile_config(cache: KVHiveCache, prompt_length: int):
    """transformers' ``CompileConfig`` for a decode step compiled to one graph on any device;
    refuses, naming why, a cache whose step cannot compile so."""
    if cache.static_decode and not cache.is_compileable:  # the installed torch (kvhive.static_step)
        raise ValueError(f"compile=True: {cache.compile_problem(prompt_length)}")
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
    problem = cache.compile_problem(prompt_length)
    if problem is not None:
        raise ValueError(f"compile=True with method {cache.policy.name!r}: {problem}")
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, dynamic=False)
    config._compile_all_devices = True  # transformers compiles only on accelerators otherwise
    return config


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
    (:meth:`KVHiveCache.fill_slots`; continuous batching, :class:`SlotScheduler`), between two
    decode steps. Slots are fixed: rows leaving and joining move no buffer (a free slot decodes a
    placeholder until a prompt takes it), so the decode step keeps one shape.

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

    Every method decodes stacked rows, of prompts of any lengths: a sliding layer keeps each row's
    window, a method keeping ``min(budget, N)`` (H2O, TOVA, ...) fills a short prompt's row up to its
    budget beside rows that evict, a free slot takes any prompt. Refused with a ValueError naming the
    method and why: Ada-KV when heads keep different counts; rows below the budget of subgen,
    BumbleBee or vnorm (one length per layer). Decode those one at a time with ``kvhive.generate``."""
    _check_batch_arguments(prompts, max_new_tokens, max_batch_size, compile, cache_options)
    if compile:
        cache_options.setdefault("bucket_budget", True)  # one shape for prompts of nearby lengths
        cache_options["decode_capacity"] = bucket_up(max_new_tokens + 1)
    row_stops = _row_stop_strings(stop_strings, len(prompts))
    samplings = _row_samplings(len(prompts), do_sample, temperature, top_k, top_p, seed, model.device)
    stop_ids = _stop_ids(model, eos_token_id)
    generation_config = getattr(model, "generation_config", None)
    refuse_unapplied_settings(generation_config)
    encoded = [_encode_row(tokenizer, prompt, model, max_new_tokens, index) for index, prompt in enumerate(prompts)]
    processors = [
        row_processors(generation_config, int(item["input_ids"].shape[1]), stop_ids, model.device) for item in encoded
    ]
    scheduler = SlotScheduler(
        model,
        tokenizer,
        encoded,
        lambda: make_cache(model, method, budget, **cache_options),
        samplings,
        stop_ids,
        row_stops,
        max_new_tokens,
        processors,
    )
    rows = len(prompts) if max_batch_size is None else min(max_batch_size, len(prompts))
    # (Below torch 2.13 a compiled step needs the attention switched before the call: kvhive.static_step.)
    with compiling_attention(model, compile):
        scheduler.start(rows, compile)
        return scheduler.run(decode_step(model, compile, scheduler.device))


def _check_batch_arguments(prompts, max_new_tokens, max_batch_size, compile, cache_options: dict[str, Any]) -> None:
    """Refuse, naming the argument, what :func:`generate_batch` cannot run."""
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


def decode_step(model, compile: bool | str, device: torch.device) -> Callable:
    """One decode step of ``model`` over a cache of batch slots: ``step(tokens [S, 1], positions
    [S, 1], cache)`` gives the last position's logits ``[S, V]``. ``compile``: compiled to one graph
    (``compile`` a backend name, or True: CUDA graphs on CUDA, the default backend elsewhere)."""
    kwarg = cache_kwarg(model)

    def step(tokens, positions, cache):
        return model(input_ids=tokens, position_ids=positions, **{kwarg: cache}, use_cache=True).logits[:, -1]

    if not compile:
        return step
    if isinstance(compile, str):
        options = {"backend": compile}
    else:
        options = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
    return torch.compile(step, fullgraph=True, dynamic=False, **options)


class SlotScheduler:
    """The continuous-batching loop of :func:`generate_batch`: prompts wait in order, each is
    prefilled alone into its own cache and takes a free slot of one cache of fixed batch slots
    (:meth:`KVHiveCache.stack`, then :meth:`KVHiveCache.fill_slots`), all slots decode together,
    and a row that ends (an end-of-sequence token, a stop string, ``max_new_tokens``) frees its
    slot (:meth:`KVHiveCache.free_slots`) for the next prompt, between two decode steps.

    ``new_cache`` makes one prompt's cache; ``samplings``, ``row_stops`` hold each prompt's
    sampling and stop strings, ``stop_ids`` the tokens that end any row; ``processors`` each prompt's
    logits processors from the model's generation config (:mod:`kvhive.row_logits`; none: the
    logits as they come)."""

    def __init__(
        self,
        model,
        tokenizer,
        encoded: list,
        new_cache: Callable[[], KVHiveCache],
        samplings: list[_RowSampling],
        stop_ids: set[int],
        row_stops: list[list[str]],
        max_new_tokens: int,
        processors: list[list] | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.encoded = encoded
        self.new_cache = new_cache
        self.samplings = samplings
        self.stop_ids = stop_ids
        self.row_stops = row_stops
        self.max_new_tokens = max_new_tokens
        self.processors = processors or [[] for _ in encoded]
        self.generated: list[list[int]] = [[] for _ in encoded]
        self.waiting = list(range(len(encoded)))
        self.running: list[int | None] = []  # the prompt in each slot (None: free)
        self.cache: KVHiveCache | None = None
        self.next_tokens: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.next_tokens.device

    def prefill(self, prompt_index: int) -> tuple[KVHiveCache, torch.Tensor]:
        """Prompt ``prompt_index`` prefilled alone (in chunks where its cache says so): its cache
        and its first token."""
        cache = self.new_cache()
        if cache.positions != "original":
            raise ValueError("generate_batch needs positions='original' (rows sit at different positions)")
        encoded = self.encoded[prompt_index]
        logits = prefill_prompt(self.model, encoded["input_ids"], cache, encoded.get("attention_mask"))
        return cache, self.samplings[prompt_index].next_token(self.scores(prompt_index, logits[0]))

    def scores(self, prompt_index: int, logits: torch.Tensor) -> torch.Tensor:
        """A row's next-token ``logits [V]`` after its generation-config processors (as they come
        when it has none), given its prompt and the tokens it generated so far."""
        processors = self.processors[prompt_index]
        if not processors:
            return logits
        sequence = self.encoded[prompt_index]["input_ids"][0].tolist() + self.generated[prompt_index]
        return apply_processors(processors, sequence, logits)

    def finished(self, prompt_index: int, token: int) -> bool:
        """Record a row's new token; whether the row ends with it."""
        tokens = self.generated[prompt_index]
        tokens.append(token)
        return (
            len(tokens) >= self.max_new_tokens
            or token in self.stop_ids
            or any(
                stop in self.tokenizer.decode(tokens, skip_special_tokens=True) for stop in self.row_stops[prompt_index]
            )
        )

    def start(self, rows: int, compile: bool | str) -> None:
        """Prefill the first ``rows`` prompts and stack them into the batch slots: ``rows`` of
        them, rounded up to a power of two where ``compile`` (so batches of similar size share a
        graph), each with room for the longest prompt and every decode token. The first batch is
        stacked whatever its first tokens: a method that cannot stack is refused before any
        decoding, as when every prompt starts at once."""
        slots = 1 << (rows - 1).bit_length() if compile else rows
        longest = max(int(item["input_ids"].shape[1]) for item in self.encoded) + self.max_new_tokens + 1
        starting = [self.waiting.pop(0) for _ in range(rows)]
        caches, first_tokens = zip(*(self.prefill(prompt_index) for prompt_index in starting), strict=True)
        self.cache = KVHiveCache.stack(
            list(caches),
            decode_capacity=self.max_new_tokens + 1,
            batch_slots=slots,
            slot_capacity=bucket_up(longest) if compile else longest,
        )
        if compile and not self.cache.is_compileable:
            problem = caches[0].compile_problem(int(self.encoded[starting[0]]["input_ids"].shape[1]))
            raise ValueError(
                f"compile=True with method {self.cache.policy.name!r}: "
                + (problem or "its decode step over these rows does not compile to one graph")
            )
        self.running = list(starting) + [None] * (slots - rows)
        self.next_tokens = torch.zeros(slots, dtype=torch.long, device=first_tokens[0].device)
        self.next_tokens[:rows] = torch.stack(first_tokens)

    def leave(self, tokens: list[int]) -> None:
        """Record each running row's new token; free the slots of the rows that end with it."""
        leaving = [
            slot
            for slot, prompt_index in enumerate(self.running)
            if prompt_index is not None and self.finished(prompt_index, tokens[slot])
        ]
        if leaving:
            self.cache.free_slots(leaving)
            for slot in leaving:
                self.running[slot] = None

    def join(self) -> None:
        """Waiting prompts take the free slots. A prompt that ends with its first token never
        needs the batch; the next one takes its place."""
        for slot in [slot for slot, prompt_index in enumerate(self.running) if prompt_index is None]:
            while self.waiting:
                prompt_index = self.waiting.pop(0)
                cache, token = self.prefill(prompt_index)
                if not self.finished(prompt_index, int(token)):
                    self.cache.fill_slots([slot], [cache])
                    self.running[slot] = prompt_index
                    self.next_tokens[slot] = token
                    break

    def choose(self, logits: torch.Tensor) -> None:
        """Each slot's next token from its logits ``[S, V]``: greedy, or its row's draw, after the
        row's generation-config processors."""
        self.next_tokens = logits.argmax(dim=-1)
        for slot, prompt_index in enumerate(self.running):
            if prompt_index is None:
                continue
            if self.samplings[prompt_index].do_sample or self.processors[prompt_index]:
                self.next_tokens[slot] = self.samplings[prompt_index].next_token(
                    self.scores(prompt_index, logits[slot])
                )

    def run(self, step: Callable) -> list[str]:
        """Decode with ``step`` (:func:`decode_step`) until every prompt has ended; one text each."""
        with torch.no_grad():
            while True:
                self.leave(self.next_tokens.tolist())  # one read per step: the stop checks
                self.join()
                if all(prompt_index is None for prompt_index in self.running):
                    break
                logits = step(self.next_tokens[:, None], self.cache.next_position_ids(), self.cache)
                self.choose(logits)
        return [self.tokenizer.decode(tokens, skip_special_tokens=True) for tokens in self.generated]


def _encode_row(tokenizer, prompt, model, max_new_tokens: int, index: int):
    """:func:`encode_prompt` for ``prompts[index]``, its refusals naming the prompt's index."""
    try:
        return encode_prompt(tokenizer, prompt, model, max_new_tokens)
    except ValueError as error:
        raise ValueError(f"prompts[{index}]: {error}") from None


def _stop_ids(model, eos_token_id) -> set[int]:
    """The token ids that end a row: ``eos_token_id`` (a token id or a list of them) or the model's
    generation config's (as ``model.generate`` stops). A given id must be an integer in
    ``[0, vocabulary size)``."""
    if eos_token_id is None:
        config = getattr(model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
        return {eos_token_id} if isinstance(eos_token_id, int) else {int(token) for token in eos_token_id}
    vocabulary = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    tokens = [eos_token_id] if not isinstance(eos_token_id, (list, tuple, set)) else list(eos_token_id)

    def is_token(token) -> bool:
        return (
            isinstance(token, int)
            and not isinstance(token, bool)
            and token >= 0
            and (vocabulary is None or token < vocabulary)
        )

    if not tokens or not all(is_token(token) for token in tokens):
        accepted = f"[0, {vocabulary})" if vocabulary is not None else "[0, vocabulary size)"
        raise ValueError(
            f"invalid eos_token_id={eos_token_id!r}: expected a token id (an integer in {accepted}) or a non-empty "
            "list of them; for a text that ends a row, pass stop_strings="
        )
    return set(tokens)


class _RowSampling:
    """One row's choice of its next token: greedy, or a draw (temperature, top-k, top-p) from its
    own generator."""

    def __init__(self, do_sample: bool, temperature: float, top_k, top_p, seed, device) -> None:
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
        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores = logits[None].float()
        for warper in self.warpers:
            scores = warper(None, scores)
        probabilities = torch.softmax(scores, dim=-1)
        return torch.multinomial(probabilities, 1, generator=self.generator)[0, 0]


SEED_LIMIT = 2**64  # a torch generator takes seeds below this (and above -2**63; kvhive takes >= 0)


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
        "seed": (
            lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < SEED_LIMIT),
            "an integer >= 0 and < 2**64 (a torch generator's seed range), or None",
        ),
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
    _refuse_sampling_without_sampling(given, values)
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


# The sampling parameters and the values that mean "not given" (what a greedy row has). A seed is
# not among them: it changes nothing without sampling, and a row's seed may be given with it off.
SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": None, "top_p": None}


def _refuse_sampling_without_sampling(given: dict[str, Any], values: dict[str, list]) -> None:
    """Refuse sampling parameters given where no row samples (they would change nothing). With some
    rows sampling, a value for every row (or a greedy row's entry of a per-row list) is theirs."""
    if any(values["do_sample"]):
        return
    for name, default in SAMPLING_DEFAULTS.items():
        for row, value in enumerate(values[name]):
            if value == default:
                continue
            where = f"[{row}]" if isinstance(given[name], (list, tuple)) else ""
            raise ValueError(
                f"{name}{where}={value!r} is given but do_sample is False for every prompt: sampling parameters "
                "(temperature, top_k, top_p) apply only to rows that sample; pass do_sample=True (or one "
                f"value per prompt), or leave {name} at {default!r}"
            )


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
