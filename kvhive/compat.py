"""Spellings that differ across the transformers releases pyproject allows (``>=5.20,<6``).

transformers 5.24 renamed the keyword that hands a model its cache, in ``forward`` and in
``generate``, from ``past_key_values`` to ``cache``; the old name still works there but warns
(removal announced for 5.40 in ``forward``, 6.0 in ``generate``). 5.20 to 5.23 know only
``past_key_values``. kvhive passes its cache under the name the model's own ``forward`` declares,
so it warns on no release and runs on all of them.
"""

from __future__ import annotations

import inspect

CACHE = "cache"  # transformers >= 5.24
PAST_KEY_VALUES = "past_key_values"  # transformers < 5.24 (deprecated from 5.24 on)


def _library_spelling() -> str:
    # What the installed transformers' generation code calls the cache: the fallback for a model
    # whose forward takes only **kwargs (a wrapper), which hands the keyword on to a forward of
    # that same release.
    from transformers.generation.utils import GenerationMixin

    parameters = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return CACHE if CACHE in parameters else PAST_KEY_VALUES


def cache_kwarg(model) -> str:
    """The keyword ``model``'s forward and ``generate`` take a cache by: ``"cache"`` or ``"past_key_values"``.

    Use it as ``model(input_ids=ids, **{cache_kwarg(model): cache}, use_cache=True)``.
    """
    parameters = inspect.signature(model.forward).parameters
    if CACHE in parameters:
        return CACHE
    if PAST_KEY_VALUES in parameters:
        return PAST_KEY_VALUES
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return _library_spelling()
    raise TypeError(
        f"{type(model).__name__}.forward takes neither `{CACHE}` nor `{PAST_KEY_VALUES}` (nor **kwargs): "
        "it cannot be handed a cache"
    )
