"""The budget module: one set of rules for the cache, the API and the evaluation."""

from __future__ import annotations

import pytest

import kvhive
from kvhive.cache.budget import Budget, budget_label, layer_budgets, minimum_budget_problem
from kvhive.evaluation.backend import budget_to_tokens
from kvhive.methods import make_policy
from kvhive.models import tiny_model


def test_labels_never_confuse_a_ratio_with_tokens():
    assert budget_label(0.2) == "ratio 0.2" and budget_label(1.0) == "ratio 1"
    assert budget_label(40) == "40 tok" and budget_label(1) == "1 tok"
    assert budget_label(Budget(ratio=0.5)) == "ratio 0.5"
    model = tiny_model("llama", "gqa")
    assert kvhive.make_cache(model, "h2o", ratio=1.0).statistics()["budget"] == "ratio 1"  # was "1", like 1 token
    assert kvhive.make_cache(model, "h2o", budget=1).statistics()["budget"] == "1 tok"


def test_evaluation_resolves_budgets_with_the_same_rule():
    for budget, tokens in ((0.5, 100), (0.004, 100), (128, 100), (1.0, 7)):
        assert budget_to_tokens(budget, tokens) == Budget.parse(budget).resolve(tokens)


def test_minimum_and_layer_budgets():
    snapkv = make_policy("snapkv")
    assert minimum_budget_problem(snapkv, 31) is not None and "32" in minimum_budget_problem(snapkv, 31)
    assert minimum_budget_problem(snapkv, 32) is None
    assert layer_budgets(make_policy("h2o"), 10, 3, 50) == [10, 10, 10]
    assert layer_budgets(make_policy("pyramidkv", window=4), 40, 2, 60) == [40, 40]  # short prompt: uniform

    class Broken(type(make_policy("local"))):
        def layer_budgets(self, budget, num_layers, context_length=None):
            return [budget] * (num_layers - 1)

    with pytest.raises(ValueError, match="layer_budgets"):
        layer_budgets(Broken(), 10, 3, 50)
