"""Every method parameter refuses a value out of its range with a ValueError that names the
parameter (the standard for bad input; mutation testing found validators whose message named
another parameter or none without any test noticing)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvhive.methods.registry import make_policy, method_names, policy_class

# Values no parameter of that type accepts (counts >= 0 or >= 1, fractions in [0, 1] or (0, 1],
# choices from a fixed set, flags as real booleans).
INVALID = {int: [-1], float: [-0.5, math.nan], bool: ["no"], str: ["no_such_choice"]}
# Parameters whose whole type admits the invalid probe: they are not validated by range.
UNBOUNDED = {"seed"}


def _cases():
    for name in method_names():
        config = policy_class(name).config_class
        for field in dataclasses.fields(config):
            default = field.default
            if field.name in UNBOUNDED or default is dataclasses.MISSING or default is None:
                continue
            for value in INVALID.get(type(default), []):
                yield pytest.param(name, field.name, value, id=f"{name}-{field.name}-{value!r}")


@pytest.mark.parametrize(("method", "parameter", "value"), list(_cases()))
def test_out_of_range_parameter_is_refused_by_name(method, parameter, value):
    with pytest.raises(ValueError, match=rf"\b{parameter}\b"):
        make_policy(method, **{parameter: value})


def test_streamingllm_needs_its_sinks_and_one_recent_token():
    # StreamingLLM keeps the attention sinks plus a recent window: the smallest budget is sink + 1.
    import torch

    import kvhive
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa")
    for sink in (1, 4):
        assert make_policy("streamingllm", sink=sink).minimum_budget() == sink + 1
        cache = kvhive.make_cache(model, "streamingllm", sink + 1, sink=sink)
        with torch.no_grad():
            model(input_ids=torch.arange(3, 23)[None], past_key_values=cache, use_cache=True)
        assert cache.mean_kept_per_head() == sink + 1
        with pytest.raises(ValueError, match=f"budget={sink}"):
            kvhive.make_cache(model, "streamingllm", sink, sink=sink)


def _seeded_methods():
    return [
        name
        for name in method_names()
        if any(field.name == "seed" for field in dataclasses.fields(policy_class(name).config_class))
    ]


@pytest.mark.parametrize("method", _seeded_methods())
def test_seed_accepts_exactly_the_range_a_torch_generator_takes(method):
    # torch.Generator.manual_seed takes [0, 2**64) but the seeds derived from it must stay below
    # 2**63 where they are multiplied; each bound is checked on both sides.
    for seed in (0, 127, 2**63 - 1):
        make_policy(method, seed=seed)
    for seed in (-1, 2**63, 2**64):
        with pytest.raises(ValueError, match=rf"invalid seed={seed}: expected an integer in \[0, 2\*\*63\)"):
            make_policy(method, seed=seed)


@pytest.mark.parametrize("method", [name for name in method_names() if name != "full"])
def test_minimum_budget_is_usable_and_one_less_is_refused(method):
    # The smallest budget a method states is one it can run with (mutation testing: a minimum
    # raised by one went unnoticed for the methods with the base minimum of 1).
    import torch

    import kvhive
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa")
    minimum = make_policy(method).minimum_budget()
    cache = kvhive.make_cache(model, method, minimum)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 63)[None], past_key_values=cache, use_cache=True)
    assert 0 < cache.mean_kept_per_head() <= minimum
    with pytest.raises(ValueError, match=r"budget"):
        kvhive.make_cache(model, method, minimum - 1)


@pytest.mark.parametrize("method", ["local", "random", "h2o", "tova", "knorm", "bumblebee"])
def test_methods_without_a_fixed_window_honour_a_one_token_cache(method):
    # No sinks, observation or recent window of fixed size: one token per head is a valid budget.
    import torch

    import kvhive
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, method, 1)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 33)[None], past_key_values=cache, use_cache=True)
    assert cache.mean_kept_per_head() == 1


@pytest.mark.parametrize("method", method_names())
def test_a_layer_without_policy_state_reports_zero_state_bytes(method):
    # The bytes a policy adds to a layer are part of the memory kvhive reports (cache statistics,
    # bench); before prefill, or on a layer it does not compress, there are none.
    assert make_policy(method).state_nbytes({}) == 0


@pytest.mark.parametrize(
    ("low_open", "accepted", "refused", "expected"),
    [
        (False, (0, 0.0, 0.5, 1.0), (-0.5, 1.5, math.nan, True, "0.5"), r"a number in \[0, 1\]"),
        (True, (0.5, 1, 1.0), (0.0, -0.5, 1.5, math.nan), r"a number in \(0, 1\]"),
    ],
)
def test_a_fraction_is_checked_against_its_stated_interval(low_open, accepted, refused, expected):
    # require_probability validates fractions (H2O's heavy_fraction, Ada-KV's alpha, ...): the
    # closed interval [0, 1], or (0, 1] where a zero fraction is meaningless; both bounds are
    # checked on both sides, and the error names the parameter, the value and the interval.
    from kvhive.methods.base import require_probability

    for value in accepted:
        require_probability(value, "fraction", low_open=low_open)
    for value in refused:
        with pytest.raises(ValueError, match=rf"^invalid fraction={value!r}: expected {expected}$"):
            require_probability(value, "fraction", low_open=low_open)


def test_a_count_is_checked_against_its_minimum():
    # require_int_at_least validates counts (windows, sinks, strides, kernels): the minimum itself
    # is accepted, one less is not, nor a bool, a float or a string; the error names the parameter,
    # the value and the bound.
    from kvhive.methods.base import require_int_at_least

    for minimum in (0, 1, 2):
        for value in (minimum, minimum + 5):
            require_int_at_least(value, minimum, "count")
        for value in (minimum - 1, True, float(minimum), str(minimum)):
            with pytest.raises(ValueError, match=rf"^invalid count={value!r}: expected an integer >= {minimum}$"):
                require_int_at_least(value, minimum, "count")


def test_a_choice_outside_its_options_is_refused_with_the_options():
    # require_choice validates a parameter against its Literal options (SnapKV's pooling, Ada-KV's
    # allocation, the cache's positions) and the error lists them.
    from typing import Literal

    from kvhive.methods.base import require_choice

    pooling = Literal["max", "avg"]  # SnapKV's
    for value in ("max", "avg"):
        require_choice(value, "pooling", pooling)
    with pytest.raises(ValueError, match=r"^invalid pooling='sum': expected 'max' or 'avg'$"):
        require_choice("sum", "pooling", pooling)


def test_a_policy_takes_a_config_object_or_keyword_parameters_not_both():
    # Policy(config) or Policy(**parameters) (docs: a method's frozen config holds its paper's
    # defaults); both at once, or an unknown keyword, is refused by name, and a config object is
    # validated as keywords are.
    h2o = policy_class("h2o")
    config = h2o.config_class(heavy_fraction=0.25)
    assert h2o(config).config == config
    assert h2o(heavy_fraction=0.25).config == config
    with pytest.raises(ValueError, match=r"^pass either a config object or keyword parameters, not both$"):
        h2o(config, heavy_fraction=0.25)
    accepted = sorted(field.name for field in dataclasses.fields(h2o.config_class))
    with pytest.raises(
        ValueError, match=r"^unknown parameter\(s\) \['heavy'\] for method 'h2o'; accepted: \["
    ) as error:
        h2o(heavy=0.25)
    assert str(error.value).endswith(f"accepted: {accepted}")
    with pytest.raises(ValueError, match="heavy_fraction"):
        h2o(h2o.config_class(heavy_fraction=2.0))
