"""Property tests (issue 27): every value of every task parameter and every method parameter is
either refused with a ValueError that names the parameter, or it runs.

"Runs" is, for a task, loading an item (limit 1, the scripted tokenizer, the shared data) and
scoring an output; for a method, building the policy, a cache on a tiny model and a prefill plus
two decoding steps through it. Before issue 27, ``needle:lengths=-5`` built a haystack from
``tokens[:-5]``, ``synthetic_recall:max_new_tokens=-3`` recorded empty outputs as scores and
``needle:lengths=abc`` failed with "invalid literal for int()" naming nothing.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import torch
from fake_backend import FakeTokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhive.evaluation.runner import resolve_tasks
from kvhive.evaluation.tasks import TASKS, TaskDataError, get_task
from kvhive.methods.registry import make_policy, method_names, policy_class

DATA_DIR = Path(os.environ.get("KVHIVE_DATA_DIR") or Path(__file__).resolve().parents[3] / "shared" / "data")
if not DATA_DIR.exists():
    DATA_DIR = Path("/work/shared/data")

PROPERTY = settings(
    max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)  # fmt: skip

# Values a user can type or pass: small and negative integers (kept small where they are
# accepted, so a load stays fast), integers far out of any range, fractions, non-finite floats,
# booleans, words, None and lists of these.
SCALARS = st.one_of(
    st.integers(-5, 400),
    st.sampled_from([0, -1, 10**7, -(10**7), 2**63]),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
    st.text(max_size=6),
    st.sampled_from(["middle", "first", "last", "abc", "", "none"]),
    st.none(),
)
VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3))


def _task_parameters():
    return [(name, parameter) for name, cls in TASKS.items() for parameter in cls.default_params()]


def test_every_task_parameter_says_what_it_accepts():
    for name, cls in TASKS.items():
        assert set(cls.parameters()) == set(cls.default_params()), name


@pytest.mark.parametrize(("task_name", "parameter"), _task_parameters())
@PROPERTY
@given(value=VALUES)
def test_a_task_parameter_is_refused_by_name_or_runs(task_name, parameter, value):
    try:
        task = get_task(task_name, **{parameter: value})
        items = task.load(DATA_DIR, 1, 0, FakeTokenizer())
    except TaskDataError:
        raise
    except ValueError as error:
        assert f"'{task_name}'" in str(error) and f"'{parameter}'" in str(error), str(error)
        return
    assert len(items) == 1
    item = items[0]
    if task.kind == "generate":
        assert 1 <= item.max_new_tokens <= 65_536 and item.prompt
        metrics = task.score(item, item.references[0])
    elif task.kind == "choice":
        metrics = task.score(item, [0.0] * len(item.choices))
    else:
        assert len(item.token_ids) >= 2
        metrics = task.score(item, (1.0, len(item.token_ids) - 1))
    assert metrics and all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("needle:lengths=-5", ["'needle'", "'lengths'", "-5", "1..1048576"]),
        ("needle:lengths=0", ["'needle'", "'lengths'", "0 is out of range"]),
        ("needle:lengths=abc", ["'needle'", "'lengths'", "'abc' is not a number"]),
        ("needle:depths=101", ["'needle'", "'depths'", "0..100"]),
        ("needle:lengths=256+256", ["'lengths'", "more than once"]),
        ("synthetic_recall:max_new_tokens=-3", ["'synthetic_recall'", "'max_new_tokens'", "1..65536"]),
        ("needle_multikey:num_needles=0", ["'needle_multikey'", "'num_needles'"]),
        ("needle_multikey:num_needles=1000", ["'num_needles'", "1..625"]),  # the key loop never ended
        ("lines:lengths=250", ["'lines'", "'lengths'", "one of [200, 300"]),
        ("ppl:window=1", ["'ppl'", "'window'"]),
        ("piqa:num_shots=-1", ["'piqa'", "'num_shots'"]),
        ("mdqa:num_documents=0", ["'mdqa'", "'num_documents'"]),
        ("mdqa:gold_positions=12", ["'mdqa'", "'gold_positions'", "0..9"]),
    ],
)
def test_the_cases_of_the_issue_are_refused_when_the_task_is_made(spec, words):
    with pytest.raises(ValueError) as caught:
        resolve_tasks([spec])  # before any model is loaded or data read
    for word in words:
        assert word in str(caught.value), (word, str(caught.value))


# --------------------------------------------------------------------------- methods


def _method_parameters():
    for name in method_names():
        for field in dataclasses.fields(policy_class(name).config_class):
            yield name, field.name


_MODEL = {}


def _tiny_model():
    if "model" not in _MODEL:
        from kvhive.models import tiny_model

        torch.manual_seed(0)
        _MODEL["model"] = tiny_model("llama", "gqa")
    return _MODEL["model"]


# Method values stay small where they are integers: a stride or a window runs a prompt of a
# few dozen tokens (a bounded search over large strides is the cache half of issue 27).
METHOD_VALUES = st.one_of(
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.booleans(),
    st.text(max_size=6),
    st.sampled_from(["mean", "max", "mean_then_pool", "authors", "kvpress", "auto", "kv", "query", "peak"]),
    st.none(),
)


@pytest.mark.parametrize(("method", "parameter"), list(_method_parameters()))
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(value=METHOD_VALUES)
def test_a_method_parameter_is_refused_by_name_or_runs(method, parameter, value):
    import kvhive

    try:
        make_policy(method, **{parameter: value})
    except ValueError as error:
        assert parameter in str(error), str(error)
        return
    model = _tiny_model()
    try:
        cache = kvhive.make_cache(model, method, 24, **{parameter: value})
    except ValueError as error:  # a budget this parameter raises above 24 tokens: named as such
        assert "budget" in str(error) and parameter in str(error), str(error)
        return
    prompt = torch.arange(3, 51)[None]
    with torch.no_grad():
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True)
        for _ in range(2):
            token = out.logits[:, -1:].argmax(-1)
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
    assert torch.isfinite(out.logits).all()
