"""What a model's generation config does to the logits of one row of ``kvhive.generate_batch``.

``model.generate`` (and so ``kvhive.generate``) applies the logits processors its generation config
asks for (a repetition penalty, suppressed tokens, a minimum length, ...); ``generate_batch`` decodes
its rows itself, so it builds the same transformers processors for each row here, applied to the
row's own sequence (its prompt and the tokens it generated), in the order ``model.generate`` applies
them. A setting it does not apply is refused by name (:func:`refuse_unapplied_settings`) rather than
ignored.
"""

from __future__ import annotations

from typing import Any

import torch

# Settings of a generation config that change a greedy ``model.generate``'s tokens and that
# ``generate_batch`` does not apply: refused when they differ from transformers' defaults.
UNAPPLIED_SETTINGS = {
    "num_beams": "beam search",
    "guidance_scale": "classifier-free guidance",
    "sequence_bias": "a bias on token sequences",
    "bad_words_ids": "banned token sequences",
    "forced_bos_token_id": "a forced first token",
    "forced_eos_token_id": "a forced last token",
    "exponential_decay_length_penalty": "a length penalty",
    "watermarking_config": "watermarking",
}

# The settings generate_batch applies, as model.generate does.
APPLIED_SETTINGS = (
    "repetition_penalty",
    "no_repeat_ngram_size",
    "min_length",
    "min_new_tokens",
    "remove_invalid_values",
    "suppress_tokens",
    "begin_suppress_tokens",
    "renormalize_logits",
)


def refuse_unapplied_settings(generation_config) -> None:
    """Refuse, naming the setting, a generation config that asks ``model.generate`` for something
    ``generate_batch`` does not apply (:data:`UNAPPLIED_SETTINGS`)."""
    if generation_config is None:
        return
    from transformers import GenerationConfig

    defaults = GenerationConfig()
    for name, what in UNAPPLIED_SETTINGS.items():
        value = getattr(generation_config, name, None)
        default = getattr(defaults, name, None)
        if value is None or value == default or (name == "guidance_scale" and value == 1):
            continue
        raise ValueError(
            f"the model's generation config sets {name}={value!r} ({what}), which generate_batch does not apply "
            f"(it applies {', '.join(APPLIED_SETTINGS)}): decode these prompts one at a time with kvhive.generate, "
            f"or set model.generation_config.{name} = {default!r}"
        )


def row_processors(generation_config, prompt_length: int, stop_ids: set[int], device) -> list[Any]:
    """The logits processors ``model.generate`` would build from ``generation_config`` for a row whose
    prompt has ``prompt_length`` tokens and whose end-of-sequence tokens are ``stop_ids`` (the
    minimum lengths hold those back); an empty list when the config asks for none."""
    if generation_config is None:
        return []
    from transformers.generation import logits_process as lp

    config = generation_config
    eos = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device) if stop_ids else None
    processors: list[Any] = []
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        processors.append(lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if eos is not None and config.min_length is not None and config.min_length > 0:
        processors.append(lp.MinLengthLogitsProcessor(config.min_length, eos, device=device))
    if eos is not None and config.min_new_tokens is not None and config.min_new_tokens > 0:
        processors.append(
            lp.MinNewTokensLengthLogitsProcessor(prompt_length, config.min_new_tokens, eos, device=device)
        )
    if config.remove_invalid_values is True:
        processors.append(lp.InfNanRemoveLogitsProcessor())
    if config.suppress_tokens is not None:
        processors.append(lp.SuppressTokensLogitsProcessor(config.suppress_tokens, device=device))
    if config.begin_suppress_tokens is not None:
        processors.append(
            lp.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, prompt_length, device=device)
        )
    if config.renormalize_logits is True and processors:
        processors.append(lp.LogitNormalization())
    return processors


def apply_processors(processors: list[Any], sequence: list[int], logits: torch.Tensor) -> torch.Tensor:
    """``logits [V]`` of a row after ``processors``, given the row's ``sequence`` so far (prompt and
    generated tokens): float32 scores ``[V]``, as ``model.generate`` scores them."""
    scores = logits[None].float()
    if not processors:
        return scores[0]
    input_ids = torch.tensor([sequence], dtype=torch.long, device=logits.device)
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores[0]
