"""A layer's steady decode route (kvhive.attention.routes): chosen once after a transition, taken at
every eager step after it, and giving what the general attention gives, logits and kept tokens alike."""

from __future__ import annotations

import warnings

import pytest
import torch

import kvhive
from kvhive.attention import integration, routes
from kvhive.cache import BudgetNotKeptWarning
from kvhive.cache.compressor import Compressor
from kvhive.compat import cache_kwarg
from kvhive.models import tiny_model

BUDGET = 36  # SnapKV needs at least its window (32)
PROMPT = 56


def _model():
    torch.manual_seed(0)
    return tiny_model("llama", "gqa")


def _cache(model, method, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kvhive.make_cache(model, method, budget=None if method == "full" else BUDGET, **options)


@torch.no_grad()
def _run(model, cache, steps: int, general: bool):
    """Logits of the prompt and ``steps`` greedy steps; ``general``: every step through the general
    attention (each layer's route reset to it before the step)."""
    key = cache_kwarg(model)
    ids = torch.randint(3, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    logits = [model(input_ids=ids, **{key: cache}, use_cache=True).logits[:, -1]]
    for _ in range(steps):
        if general:
            for layer in cache.layers:
                layer.decode_route = integration.attend
        token = logits[-1].argmax(-1, keepdim=True)
        logits.append(model(input_ids=token, **{key: cache}, use_cache=True).logits[:, -1])
    return torch.stack(logits)


def _kept(cache):
    return [layer.dense()[2].sort(dim=-1).values for layer in cache.layers]


@pytest.mark.parametrize(
    ("method", "route"),
    [
        ("tova", routes.weights_route),
        ("h2o", routes.weights_route),
        ("full", routes.sdpa_route),
        ("snapkv", routes.sdpa_route),  # cut at prefill: the step only attends
        ("streamingllm", integration.attend),  # evicts without weights: the general attention
    ],
)
def test_a_steady_step_takes_its_route_and_matches_the_general_attention(method, route):
    model = _model()
    routed, general = _cache(model, method), _cache(model, method)
    steps = BUDGET + 6  # past the budget: every evicting method evicts at the last steps
    expected = _run(model, general, steps, general=True)
    actual = _run(model, routed, steps, general=False)
    assert all(layer.decode_route is route for layer in routed.layers), method
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for kept, reference in zip(_kept(routed), _kept(general), strict=True):
        assert torch.equal(kept, reference)


def test_a_prefill_only_layer_never_cut_reports_its_growth_through_its_route():
    model = _model()
    cache = _cache(model, "snapkv")
    key = cache_kwarg(model)
    ids = torch.randint(3, model.config.vocab_size, (1, BUDGET - 4), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), pytest.warns(BudgetNotKeptWarning):
        token = model(input_ids=ids, **{key: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(8):
            token = model(input_ids=token, **{key: cache}, use_cache=True).logits[:, -1:].argmax(-1)
        assert all(layer.decode_route is routes.prefill_only_route for layer in cache.layers)


def test_a_transition_forgets_the_route_and_the_steady_shape():
    model = _model()
    cache = _cache(model, "tova")
    _run(model, cache, 3, general=False)
    layer = cache.layers[0]
    assert layer.decode_route is routes.weights_route and layer.steady_key_shape is not None
    cache.batch_select_indices(torch.tensor([0]))
    assert layer.decode_route is None and layer.steady_key_shape is None
    cache.reset()
    assert cache.layers[0].decode_route is None


def test_the_evict_step_is_the_one_decode_decision_of_a_growing_layer(monkeypatch):
    # The route and the general attention both decide through Compressor.evict_step.
    calls = []
    original = Compressor.evict_step

    def counted(self, cache, layer_index, store, scoring):
        calls.append(layer_index)
        return original(self, cache, layer_index, store, scoring)

    monkeypatch.setattr(Compressor, "evict_step", counted)
    model = _model()
    cache = _cache(model, "tova")
    _run(model, cache, 2, general=False)
    assert len(calls) == 2 * len(cache.layers)
