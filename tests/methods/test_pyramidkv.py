"""PyramidKV: linear layer budgets with an exact total, SnapKV selection inside a layer."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch

import kvhive
from kvhive.methods import make_policy
from kvhive.methods.base import ScoringInputs
from kvhive.methods.pyramidkv import PyramidKV, pyramid_budgets
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits

VARIANTS = [(architecture, attention) for architecture in TINY_ARCHITECTURES for attention in TINY_ATTENTION_KINDS]


def _scoring(queries, keys, values=None, scaling=1.0):
    """ScoringInputs for one sequence with a plain causal mask (hand-made test inputs)."""
    n = keys.shape[2]
    q = queries.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[n - q :][None, None]
    return ScoringInputs(
        keys=keys,
        values=keys.clone() if values is None else values,
        queries=queries,
        positions=torch.arange(n).expand(keys.shape[:3]),
        mask=mask,
        scaling=scaling,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase="prefill",
    )


# -- layer budgets ------------------------------------------------------------------------------


def test_layer_budgets_hand_computed():
    # b = 72, window 32: pyramid over the selected 40 per layer: min 40/20 = 2, max 80 - 2 = 78,
    # step (78 - 2) / 4 = 19 -> 78, 59, 40, 21, 2; plus the window in every layer.
    assert PyramidKV().layer_budgets(72, 5) == [110, 91, 72, 53, 34]
    # b = 10, window 2, 3 layers: 2 + (15.6, 8, 0.4) = 17.6, 10, 2.4 -> floors 17, 10, 2 (29), the
    # missing token goes to the largest fraction (17.6).
    assert PyramidKV(window=2).layer_budgets(10, 3) == [18, 10, 2]
    # The literal reading (pyramid over the whole budget, window included): b = 800, beta 20:
    # min 40, max 1560, step 760 -> 1560, 800, 40.
    assert PyramidKV(window_in_pyramid=True).layer_budgets(800, 3) == [1560, 800, 40]
    assert PyramidKV().layer_budgets(64, 1) == [64]


@pytest.mark.parametrize("window_in_pyramid", [False, True])
def test_layer_budgets_exact_total_linear_and_at_least_window(window_in_pyramid):
    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        window = int(torch.randint(1, 40, (1,), generator=generator))
        beta = float(torch.empty(1).uniform_(1.05, 40, generator=generator))
        layers = int(torch.randint(1, 40, (1,), generator=generator))
        budget = int(torch.randint(window, window * 60, (1,), generator=generator))
        if window_in_pyramid:
            budget = max(budget, math.ceil(window * beta) + 1)
        budgets = pyramid_budgets(budget, layers, beta, window, window_in_pyramid)
        assert sum(budgets) == budget * layers
        assert len(budgets) == layers
        assert min(budgets) >= window
        assert all(a >= b for a, b in itertools.pairwise(budgets)), budgets
        if layers > 1:
            base = budget if window_in_pyramid else budget - window
            offset = 0 if window_in_pyramid else window
            smallest, largest = base / beta, 2 * base - base / beta
            targets = [offset + largest - i * (largest - smallest) / (layers - 1) for i in range(layers)]
            assert all(abs(b - t) < 1 for b, t in zip(budgets, targets, strict=True)), (budgets, targets)


def test_layer_budgets_errors_name_the_parameter():
    with pytest.raises(ValueError, match="budget"):
        PyramidKV().layer_budgets(31, 4)  # below the window of 32
    with pytest.raises(ValueError, match="window"):
        # 200 / 20 = 10 < window: the last layer cannot hold its observation window.
        PyramidKV(window_in_pyramid=True).layer_budgets(200, 4)


@pytest.mark.parametrize(
    "parameters, name",
    [
        ({"beta": 1}, "beta"),
        ({"beta": 0.5}, "beta"),
        ({"beta": -3.0}, "beta"),
        ({"beta": float("inf")}, "beta"),
        ({"beta": float("nan")}, "beta"),
        ({"beta": "20"}, "beta"),
        ({"window": 0}, "window"),
        ({"kernel": 4}, "kernel"),
        ({"pooling": "mean"}, "pooling"),
        ({"window_in_pyramid": 1}, "window_in_pyramid"),
    ],
)
def test_invalid_parameters(parameters, name):
    with pytest.raises(ValueError, match=name):
        make_policy("pyramidkv", **parameters)


@pytest.mark.parametrize("beta", [1, 1.0, 0.5, -3.0, float("inf"), float("nan"), "20", True, None])
def test_beta_error_names_the_parameter_its_value_and_range(beta):
    # PyramidKV's beta (last layer gets b / beta, Sec. 3.3) must be a finite number > 1; the error
    # names the parameter, the value given and the accepted range, from the config and from
    # pyramid_budgets alike.
    message = re.escape(f"invalid beta={beta!r}: expected a finite number > 1")
    with pytest.raises(ValueError, match=message):
        make_policy("pyramidkv", beta=beta)
    with pytest.raises(ValueError, match=message):
        pyramid_budgets(72, 5, beta, 32)


def test_budget_below_window_is_rejected_by_the_cache():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40)
    with pytest.raises(ValueError, match="budget"):  # at make_cache or at the first prefill
        cache = kvhive.make_cache(model, "pyramidkv", budget=8, window=16)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)


# -- selection ----------------------------------------------------------------------------------


def test_kept_set_hand_checked():
    # One head, d = 1, scaling 1: the two window queries (rows 8, 9) attend mostly to keys 1 and
    # 5 (logit 6 vs 0); with kernel 1 and budget 4 the layer keeps {1, 5} + the window {8, 9}.
    n = 10
    keys = torch.zeros(1, 1, n, 1)
    keys[0, 0, 1] = keys[0, 0, 5] = 6.0
    keys[0, 0, 3] = 2.0  # the third best, left out
    queries = torch.ones(1, 1, n, 1)
    policy = PyramidKV(window=2, kernel=1)
    keep = policy.select_prefill(_scoring(queries, keys), 4, {})
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [1, 5, 8, 9]


def _layer_compressed_model(architecture, attention):
    # Every layer full attention so that the pyramid spans all of them (tiny gemma3: 4 layers, one
    # of them full; with compress_sliding its sliding layers are compressed too).
    return tiny_model(architecture, attention)


@pytest.fixture(scope="module")
def models():
    return {variant: _layer_compressed_model(*variant) for variant in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_full_budget_matches_transformers(models, variant):
    model = models[variant]
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    reference = reference_logits(model, input_ids, attention_mask, steps=20)
    # Even the last layer (window + (b - window) / 20) holds the 24 + 20 tokens.
    cache = kvhive.make_cache(model, "pyramidkv", budget=1200)
    assert min(cache.policy.layer_budgets(1200, 4)) >= 44
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=20)
    assert (logits - reference).abs().max().item() <= 1e-5


@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(v) for v in VARIANTS])
def test_small_budget_prefill_and_50_decode_steps(models, variant):
    model = models[variant]
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40)
    cache = kvhive.make_cache(model, "pyramidkv", budget=12, window=4, compress_sliding=True)
    logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=50)
    assert torch.isfinite(logits).all()
    compressed = cache.compressed_layers
    assert sum(cache.layer_budgets.values()) == 12 * len(compressed)  # exact total over layers
    assert len(set(cache.layer_budgets.values())) == len(compressed)  # a real pyramid
    kept = cache.kept_tokens()
    for layer in compressed:
        # Exactly the layer's budget in every head and sequence after prefill (uniform within a
        # layer); prefill-only, so each of the 50 decode steps appended one token.
        expected = cache.layer_budgets[layer] + 50
        if cache.layers[layer].is_sliding:  # a sliding layer never holds more than its window (issue 9 item 8)
            expected = min(expected, model.config.sliding_window - 1)
        assert (kept[layer] == expected).all(), (layer, kept[layer], cache.layer_budgets)


# -- short prompts, as the reference code (issue: fail on the old "cap and push the excess on") ----


def test_short_prompt_falls_back_to_uniform_budgets():
    # n < 2 (b - w) = 80: every layer gets b, as the reference code's SnapKV branch.
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=79) == [72] * 5
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=50) == [72] * 5  # shorter than b: kept whole
    assert PyramidKV().layer_budgets(72, 5, 79) == [72] * 5
    # "shorter than 2 (b - w)": a prompt of exactly 80 takes the pyramid, clamped (n - w = 48):
    # 32 + (48, 44, 40, 36, 32)
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=80) == [80, 76, 72, 68, 64]


@pytest.mark.parametrize(
    "arguments, name",
    [
        ((True, 4), "budget"),
        ((72.0, 4), "budget"),
        ((0, 4), "budget"),
        ((72, True), "num_layers"),
        ((72, 4.0), "num_layers"),
        ((72, 0), "num_layers"),
    ],
)
def test_pyramid_budgets_refuse_non_integer_or_non_positive_sizes(arguments, name):
    with pytest.raises(ValueError, match=rf"invalid {name}="):
        pyramid_budgets(*arguments, 20.0, 32)


def test_pyramid_budgets_context_length_bounds():
    for context_length in (0, -5, True, 80.0):
        with pytest.raises(ValueError, match=r"invalid context_length=.*an integer >= 1 \(real tokens"):
            pyramid_budgets(72, 5, 20.0, 32, context_length=context_length)
    # the smallest sizes that are valid
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=1) == [72] * 5
    assert pyramid_budgets(1, 3, 20.0, 1) == [1, 1, 1]


def test_prompt_below_the_first_layer_share_clamps_it_and_raises_the_last():
    # b = 72, w = 32, n = 100: p_max = 78 >= n - w = 68 -> p_max = 68, p_min = 80 - 68 = 12, step 14:
    # 32 + (68, 54, 40, 26, 12). The old rule capped at 100 and pushed the excess on:
    # [100, 100, 73, 53, 34].
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=100) == [100, 86, 72, 58, 44]
    # Long enough: the full pyramid.
    assert pyramid_budgets(72, 5, 20.0, 32, context_length=200) == [110, 91, 72, 53, 34]


def test_layer_budgets_use_each_rows_real_length():
    model = tiny_model("llama", "gqa")  # 2 layers
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=80, pad=20)
    cache = kvhive.make_cache(model, "pyramidkv", budget=40, window=4)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=0)
    # Row 0: 80 real tokens >= 2 (40 - 4): pyramid 4 + (70.2, 1.8) -> 74, 6. Row 1: 60 real tokens:
    # uniform 40, 40 (on the padded length it got the pyramid too).
    assert cache.row_layer_budgets == {0: [74, 40], 1: [6, 40]}
    for layer, expected in ((0, [74, 40]), (1, [6, 40])):
        lengths = cache.layers[layer].lengths_host
        assert lengths.tolist() == [[expected[0]] * 2, [expected[1]] * 2]


@pytest.mark.parametrize("context_length", [0, -3, 2.5, True])
def test_context_length_error_names_the_parameter_its_value_and_range(context_length):
    """A context length that is not a positive integer is refused with its name, the value given and the range."""
    expected = re.escape(f"invalid context_length={context_length!r}: expected an integer >= 1")
    with pytest.raises(ValueError, match=expected):
        pyramid_budgets(72, 5, 20.0, 32, context_length=context_length)
