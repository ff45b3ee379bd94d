"""The evaluation backend backed by kvhive: a model plus compressed caches.

One prefill per item serves every (method, budget) whose decision is made from the prefill
(:func:`kvhive.api.shared_prefill`); each setting then decodes on its own compressed cache, all
settings together as the rows of one batch (:class:`~kvhive.cache.rows.CacheRows`): a decode step
of a small model costs about the same for one row as for twenty, and each row still computes
what its cache would alone.
"""

from __future__ import annotations

import copy
import math

import torch

from kvhive.api import context_length, make_cache, prefill_prompt, question_token_count, shared_prefill
from kvhive.cache.kv_cache import check_question_tokens
from kvhive.cache.rows import CacheRows
from kvhive.compat import cache_kwarg
from kvhive.evaluation.backend import (
    DEFAULT_DTYPE,
    FULL_METHOD,
    Setting,
    SettingFailure,
    compresses_sliding,
    split_cache_options,
    validate_dtype,
)
from kvhive.methods.base import DECODE
from kvhive.methods.registry import make_policy_from_spec


class _SizeTracker:
    """Cache size over a run: tokens per stored head (mean, final, peak) and the KV entries and
    bytes held in the layers the budget applies to (mean and peak), and the bytes the whole cache
    held (every layer, sliding-window ones included) as a fraction of what the full cache holds for
    the same tokens (``held_fraction_mean``/``_peak``: on Gemma 3 the sliding layers hold most of
    the cache whatever the method). A method whose size moves
    below its budget (BUZZ's beehive, SubGen's clusters) holds fewer tokens on average than one
    pinned at the budget, and one storing a copy per query head (Ada-KV on a one-KV-head model)
    holds more entries at the same tokens per head: a fair comparison needs what was held next
    to the score."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.entries: list[int] = []
        self.bytes: list[int] = []
        self.cache_bytes: list[int] = []
        self.full_bytes: list[int] = []
        self.stored_heads: set[int] = set()
        self.layers = 0

    def observe(self, cache) -> None:
        self.samples.append(cache.mean_kept_per_head())
        layers = [cache.layers[i] for i in cache.compressed_layers if cache.layers[i].is_initialized]
        self.entries.append(sum(int(layer.lengths_host.sum()) for layer in layers))
        self.bytes.append(sum(layer.nbytes() for layer in layers))
        self.stored_heads.update(int(layer.lengths_host.shape[1]) for layer in layers)
        self.layers = len(layers)
        # The whole cache (sliding-window layers included) and the full cache at the same tokens.
        self.cache_bytes.append(cache.nbytes())
        self.full_bytes.append(cache.full_cache_nbytes())

    def summary(self) -> dict[str, float]:
        if not self.samples:
            return {}
        summary = {
            "mean_kept_per_head": round(sum(self.samples) / len(self.samples), 3),
            "final_kept_per_head": round(self.samples[-1], 3),
            # The largest size held (a budget read as a peak, like BUZZ's peak form, bounds this one).
            "peak_kept_per_head": round(max(self.samples), 3),
            "kv_entries_mean": round(sum(self.entries) / len(self.entries), 3),
            "kv_entries_peak": max(self.entries),
            "kv_bytes_mean": round(sum(self.bytes) / len(self.bytes), 3),
            "kv_bytes_peak": max(self.bytes),
            "layers_counted": self.layers,
            # Every layer: what the cache held against what the full cache holds for the same tokens.
            "cache_bytes_mean": round(sum(self.cache_bytes) / len(self.cache_bytes), 3),
            "cache_bytes_peak": max(self.cache_bytes),
            "full_cache_bytes_mean": round(sum(self.full_bytes) / len(self.full_bytes), 3),
            "full_cache_bytes_peak": max(self.full_bytes),
        }
        fractions = [held / full for held, full in zip(self.cache_bytes, self.full_bytes, strict=True) if full]
        if fractions:
            summary["held_fraction_mean"] = round(sum(fractions) / len(fractions), 4)
            summary["held_fraction_peak"] = round(max(fractions), 4)
        if (
            len(self.stored_heads) == 1
        ):  # heads per compressed layer (query heads when Ada-KV stores a copy per query head)
            summary["stored_heads"] = next(iter(self.stored_heads))
        return summary


def _policy(setting: Setting):
    """The setting's method: a registry name, optionally with options (``buzz:budget_form=peak``);
    cache options (``:prefill_chunk=512``) are the cache's (:func:`_caches`)."""
    return make_policy_from_spec(split_cache_options(setting.method)[0])


class KVHiveBackend:
    """:class:`~kvhive.evaluation.backend.Backend` over a transformers model and kvhive caches."""

    def __init__(
        self, model, tokenizer, model_name: str = "", share_prefill: bool = True, share_decode: bool = True
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = context_length(model)
        self.share_prefill = share_prefill
        # Decode the settings of a call as rows of one batch (False: one setting after another).
        self.share_decode = share_decode
        self.cache_kwarg = cache_kwarg(model)  # the keyword forward takes the cache by (kvhive.compat)
        text_config = model.config.get_text_config(decoder=True)
        self.sliding_window = getattr(text_config, "sliding_window", None)
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.stop_tokens = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        # Per setting of the last call: _SizeTracker.summary() (the runner stores it with each result).
        self.last_cache_sizes: list[dict[str, float]] = []

    # -- helpers ---------------------------------------------------------------------------------
    def _encode(self, text: str) -> torch.Tensor:
        ids = self.tokenizer(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] > self.max_context:
            raise ValueError(f"prompt of {ids.shape[1]} tokens exceeds the model's context of {self.max_context}")
        return ids.to(self.model.device)

    def _caches(self, settings: list[Setting], question_tokens: int | None = None):
        # The full cache keeps everything: it takes no budget (one given would be ignored).
        return [
            make_cache(
                self.model,
                _policy(setting),
                None if setting.method == FULL_METHOD else setting.budget,
                prefill_chunk=setting.prefill_chunk,
                question_tokens=question_tokens if setting.prefill_question else None,
                kv_bits=setting.kv_bits,
            )
            for setting in settings
        ]

    @torch.no_grad()
    def _own_prefill(self, input_ids: torch.Tensor, cache) -> torch.Tensor:
        """The prompt through ``cache`` alone: in one forward, or in chunks of ``cache.prefill_chunk``
        tokens (budgets planned on the whole prompt first, as ``kvhive.generate`` does; each chunk
        followed by a copy of the question when the cache has ``question_tokens``,
        :func:`kvhive.api.prefill_prompt`). Returns the last position's logits."""
        return prefill_prompt(self.model, input_ids, cache)

    def _prefilled(self, input_ids: torch.Tensor, settings: list[Setting], question_tokens: int | None = None):
        """Each setting's cache filled with the prompt, and the logits of its last position. The
        one-shot settings share one prefill (``share_prefill``); a chunked prefill is a setting's
        own (its chunks are compressed as they come, so no other setting's forward is the same).
        ``question_tokens``: how many of the prompt's last tokens are its question (the settings
        with ``prefill_question`` score every chunk with it)."""
        caches = self._caches(settings, question_tokens)
        shared = [index for index, cache in enumerate(caches) if self.share_prefill and cache.prefill_chunk is None]
        logits: list = [None] * len(caches)
        if shared:
            for index, row_logits in zip(
                shared, shared_prefill(self.model, input_ids, [caches[i] for i in shared]), strict=True
            ):
                logits[index] = row_logits
        for index, cache in enumerate(caches):
            if logits[index] is None:
                logits[index] = self._own_prefill(input_ids, cache)
        return caches, logits

    @staticmethod
    def _rows(caches, active: list[int]):
        """The cache a forward pass of the ``active`` settings uses: the setting's own cache for one
        row (the plain path), else the rows of one batch."""
        if len(active) == 1:
            return caches[active[0]]
        return CacheRows([caches[index] for index in active])

    @torch.no_grad()
    def _greedy(
        self, caches: list, logits: list[torch.Tensor], max_new_tokens: int, sizes: list[_SizeTracker]
    ) -> list[list[int] | SettingFailure]:
        """Greedy decoding of every cache from its first logits: the caches still generating are
        the rows of one batch; a row leaves the batch where it stops (a stop token, the length
        limit, or non-finite logits: argmax over NaN picks an arbitrary token, so that row is a
        failure). With one cache this is plain decoding on that cache."""
        results: list[list[int] | SettingFailure | None] = [None] * len(caches)
        tokens: list[list[int]] = [[] for _ in caches]
        for cache, tracker in zip(caches, sizes, strict=True):
            tracker.observe(cache)
        active = list(range(len(caches)))
        step_logits = torch.cat([row_logits.reshape(1, -1) for row_logits in logits], dim=0)
        for step in range(max_new_tokens):
            # One host read per step for all rows (the tokens decide what runs next).
            finite = torch.isfinite(step_logits).all(dim=-1).tolist()
            chosen = step_logits.argmax(dim=-1).tolist()
            still = []
            for position, row in enumerate(active):
                if not finite[position]:
                    results[row] = SettingFailure(
                        f"non-finite model output: logits at generated token {step} are not finite"
                    )
                    continue
                token = chosen[position]
                if token in self.stop_tokens:
                    results[row] = tokens[row]
                    continue
                tokens[row].append(token)
                if step + 1 == max_new_tokens:
                    results[row] = tokens[row]
                    continue
                still.append((row, token))
            if not still:
                break
            active = [row for row, _ in still]
            input_ids = torch.tensor([[token] for _, token in still], device=self.model.device)
            output = self.model(input_ids=input_ids, **{self.cache_kwarg: self._rows(caches, active)}, use_cache=True)
            step_logits = output.logits[:, -1]
            for row in active:
                sizes[row].observe(caches[row])
        for row in active:  # max_new_tokens == 0 leaves nothing generated
            if results[row] is None:
                results[row] = tokens[row]
        return results

    # -- Backend protocol ------------------------------------------------------------------------
    def infeasible(self, setting: Setting, context_tokens: int) -> str | None:
        """Why ``setting`` cannot run on a context of ``context_tokens`` tokens (its budget resolves
        below what the method needs), or None."""
        if setting.method == FULL_METHOD:
            return None
        if isinstance(setting.budget, int):
            # A token budget below the minimum would make make_cache raise (aborting the grid).
            minimum = _policy(setting).minimum_budget()
            if setting.budget < minimum:
                return (
                    f"budget={setting.budget} tokens per head is below method {setting.method!r}'s minimum "
                    f"of {minimum} tokens per head"
                )
            return None
        return make_cache(self.model, _policy(setting), setting.budget).budget_problem(context_tokens)

    def not_applicable(self, setting: Setting, context_tokens: int, streaming: bool) -> str | None:
        """Why ``setting``'s method cannot keep its budget in this phase, or None: fed token by
        token (``streaming``), a method that compresses only a prompt (no decode phase) never
        compresses, so its score would be the full cache's under the method's name; and a stream
        has no prompt to chunk (a chunked setting would score as the one-shot one)."""
        if streaming and setting.prefill_chunk is not None:
            return (
                f"prefill_chunk={setting.prefill_chunk}: the text is fed one token at a time, there is no prompt "
                "to feed in chunks"
            )
        if setting.prefill_question and not streaming:
            try:  # a method that evicts while decoding, or never, takes no question (make_cache would refuse it)
                check_question_tokens(1, setting.prefill_chunk, _policy(setting))
            except ValueError as error:
                return f"prefill_question: {error}"
        if not streaming or setting.method == FULL_METHOD:
            return None
        policy = _policy(setting)
        fed_tokens = context_tokens - 1  # the last token is only predicted
        if DECODE in policy.phases or not isinstance(setting.budget, int) or setting.budget >= fed_tokens:
            return None
        phases = ", ".join(sorted(policy.phases)) or "none"
        return (
            f"method {setting.method!r} compresses only in phase(s) {phases}: fed {fed_tokens} tokens one by "
            f"one, its cache would grow past budget={setting.budget} uncompressed"
        )

    def generate(
        self, prompt: str, max_new_tokens: int, settings: list[Setting], question: str | None = None
    ) -> list[str]:
        input_ids = self._encode(prompt)
        question_tokens = None
        if any(setting.prefill_question for setting in settings):
            if not question:
                raise ValueError(
                    "a setting with prefill_question=true needs the prompt's question: pass question= (the prompt's "
                    "final part)"
                )
            question_tokens = question_token_count(self.tokenizer, prompt, question)
        caches, logits = self._prefilled(input_ids, settings, question_tokens)
        sizes = [_SizeTracker() for _ in caches]
        if self.share_decode:
            generated = self._greedy(caches, logits, max_new_tokens, sizes) if caches else []
        else:
            generated = [
                self._greedy([cache], [first_logits], max_new_tokens, [tracker])[0]
                for cache, first_logits, tracker in zip(caches, logits, sizes, strict=True)
            ]
        self.last_cache_sizes = [tracker.summary() for tracker in sizes]
        return [
            tokens if isinstance(tokens, SettingFailure) else self.tokenizer.decode(tokens, skip_special_tokens=True)
            for tokens in generated
        ]

    @torch.no_grad()
    def choice_loglikelihoods(
        self, context: str, continuations: list[str], settings: list[Setting]
    ) -> list[list[float]]:
        context_ids = self._encode(context)
        continuation_ids = []
        for continuation in continuations:
            full = self.tokenizer(context + continuation, return_tensors="pt")["input_ids"][0]
            continuation_ids.append(full[context_ids.shape[1] :].to(self.model.device))
        caches, logits = self._prefilled(context_ids, settings)
        results = []
        self.last_cache_sizes = []
        for cache, last_logits in zip(caches, logits, strict=True):
            sizes = _SizeTracker()
            sizes.observe(cache)  # the compressed context every continuation is scored against
            self.last_cache_sizes.append(sizes.summary())
            scores = []
            for tokens in continuation_ids:
                if tokens.numel() == 0:
                    scores.append(0.0)
                    continue
                step_logits = [last_logits]
                if tokens.numel() > 1:
                    own_cache = copy.deepcopy(cache)
                    output = self.model(input_ids=tokens[:-1][None], **{self.cache_kwarg: own_cache}, use_cache=True)
                    step_logits.append(output.logits[0])
                all_logits = torch.cat([step_logits[0].reshape(1, -1)] + step_logits[1:], dim=0)
                log_probs = torch.log_softmax(all_logits.float(), dim=-1)
                scores.append(float(log_probs.gather(1, tokens[:, None]).sum()))
            results.append(scores)
        return results

    def _streaming_cache(self, setting: Setting):
        budget = None if setting.method == FULL_METHOD else setting.budget
        compress_sliding = compresses_sliding(setting.method, setting.budget, self.sliding_window)
        return make_cache(
            self.model, _policy(setting), budget, compress_sliding=compress_sliding, kv_bits=setting.kv_bits
        )

    @torch.no_grad()
    def streaming_nll(
        self, token_ids: list[int], settings: list[Setting], prefill_tokens: int = 1
    ) -> list[tuple[float, int]]:
        """Each setting's summed NLL of ``token_ids[prefill_tokens:]`` (and the count): the first
        ``prefill_tokens`` tokens in one forward (a prompt: the method's prefill decision applies;
        1, the default, is the plain stream), then one token at a time; with ``share_decode`` the
        settings are the rows of one batch, each on its own cache. Cache sizes are observed after
        the prompt and after every later step."""
        if (
            isinstance(prefill_tokens, bool)
            or not isinstance(prefill_tokens, int)
            or not 1 <= prefill_tokens < len(token_ids)
        ):
            raise ValueError(
                f"invalid prefill_tokens={prefill_tokens!r}: expected an integer in [1, {len(token_ids) - 1}] "
                f"(at least one of the {len(token_ids)} tokens must be left to predict)"
            )
        ids = torch.tensor(token_ids, device=self.model.device)
        groups = [list(range(len(settings)))] if self.share_decode else [[index] for index in range(len(settings))]
        results: list = [None] * len(settings)
        sizes = [_SizeTracker() for _ in settings]
        for group in groups:
            caches = {index: self._streaming_cache(settings[index]) for index in group}
            totals = dict.fromkeys(group, 0.0)
            counts = dict.fromkeys(group, 0)
            active = list(group)
            first = prefill_tokens - 1  # the position whose logits predict the first scored token
            step_logits = None
            if prefill_tokens > 1:
                prompt = ids[:prefill_tokens].reshape(1, -1)
                if self.share_prefill:
                    prompt_logits = shared_prefill(self.model, prompt, [caches[index] for index in group])
                else:
                    prompt_logits = [self._own_prefill(prompt, caches[index]) for index in group]
                step_logits = torch.cat([row.reshape(1, -1) for row in prompt_logits], dim=0)
            for position in range(first, len(token_ids) - 1):
                if not active:
                    break
                if step_logits is None:
                    input_ids = ids[position].reshape(1, 1).expand(len(active), 1)
                    output = self.model(
                        input_ids=input_ids, **{self.cache_kwarg: self._rows(caches, active)}, use_cache=True
                    )
                    step_logits = output.logits[:, -1]
                log_probs = torch.log_softmax(step_logits.float(), dim=-1)
                step_logits = None
                # One host read per step for all rows.
                nlls = (-log_probs[:, ids[position + 1]]).tolist()
                still = []
                for index, nll in zip(active, nlls, strict=True):
                    sizes[index].observe(caches[index])
                    if not math.isfinite(nll):
                        # Recorded as this setting's failure; the other settings still run.
                        results[index] = SettingFailure(f"non-finite model output: NLL {nll!r} at position {position}")
                        continue
                    totals[index] += nll
                    counts[index] += 1
                    still.append(index)
                active = still
            for index in group:
                if results[index] is None:
                    results[index] = (totals[index], counts[index])
        self.last_cache_sizes = [tracker.summary() for tracker in sizes]
        return results


def make_backend(model_name: str, dtype: str = DEFAULT_DTYPE, device: str | None = None) -> KVHiveBackend:
    """Backend factory for the CLI: ``kvhive eval --model NAME [--dtype DTYPE] [--device DEVICE]``;
    without a device, a GPU when torch sees one (a Ray worker given a GPU, or a GPU machine)."""
    from kvhive.models import load_model

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_model(model_name, dtype=getattr(torch, validate_dtype(dtype)), device=device)
    return KVHiveBackend(model, tokenizer, model_name=model_name)
