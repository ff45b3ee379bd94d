"""Every method parameter refuses a value out of its range with a ValueError that names the
parameter (the standard for bad input; mutation testing found validators whose message named
another parameter or none without any test noticing)."""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import NamedTuple

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


def test_a_phase_a_method_lacks_is_refused_naming_the_method_and_repr_names_the_class():
    """A method without a prefill (or decode) phase refuses that phase naming itself, and its repr names its
    class and config: the base class's defaults that every method without the phase inherits."""
    from kvhive.methods.base import Policy

    class PhaseLess(Policy):
        name = "phase-less"

    policy = PhaseLess()
    with pytest.raises(NotImplementedError, match="^phase-less has no prefill phase$"):
        policy.select_prefill(None, 1, {})
    with pytest.raises(NotImplementedError, match="^phase-less has no decode phase$"):
        policy.select_decode(None, 1, {})
    assert repr(policy) == f"PhaseLess({policy.config})"


# Each validated parameter's stated range (the text after "expected" in its error), with the values
# at and just past every bound (integer +-1, math.nextafter for floats): the accepted ones are taken,
# the refused ones are refused with exactly that text (mutation testing: bounds moved by one and
# errors reading "expected None" went unnoticed while only far-out values and the name were checked).
class Refused(NamedTuple):
    """A refused value whose error states another (earlier-checked) part of the range."""

    value: object
    text: str


class Range(NamedTuple):
    text: str
    accepted: tuple
    refused: tuple
    context: dict = {}  # other parameters set with it (so that only this one is out of range)


_TINY = math.nextafter(0.0, 1.0)
_BIG = sys.float_info.max


def _below(x):
    return math.nextafter(x, -math.inf)


def _above(x):
    return math.nextafter(x, math.inf)


def _int_at_least(minimum, more=()):
    text = f"an integer >= {minimum}"
    return Range(text, (minimum, minimum + 1, *more), (minimum - 1, -(2**70), True, float(minimum), str(minimum)))


def _fraction(text, low_open, high_open, **context):
    accepted = (_TINY if low_open else 0, _below(1.0) if high_open else 1, 0.5)
    refused = (0 if low_open else _below(0.0), 1.0 if high_open else _above(1.0), -0.5, 1.5, math.nan, True, "0.5")
    if not low_open:
        accepted += (0.0,)
    if not high_open:
        accepted += (1.0,)
    return Range(text, accepted, refused, context)


def _choice(*options):
    text = " or ".join(repr(option) for option in options)
    return Range(text, options, ("no_such_choice", options[0].upper(), None))


_BOOL = (True, False)
_NOT_BOOL = (0, 1, "True", None)
_SEED = Range("an integer in [0, 2**63)", (0, 2**63 - 1), (-1, 2**63, True, 1.0))
_PROBABILITY = _fraction("a number in [0, 1]", low_open=False, high_open=False)


def _odd_kernel(purpose):
    return Range(f"an odd integer >= 1 ({purpose})", (1, 3, 7, 9), (2, 4, 8, 0, -1, True, 7.0, "7"))


RANGES = {
    "random": {"recent_fraction": _PROBABILITY, "seed": _SEED},
    "streamingllm": {"sink": _int_at_least(0)},
    "h2o": {"heavy_fraction": _PROBABILITY},
    "snapkv": {
        "window": _int_at_least(1),
        "kernel": _odd_kernel("centred pooling"),
        "pooling": _choice("max", "avg"),
        "group_pooling": _choice("pool_then_mean", "mean_then_pool"),
    },
    "pyramidkv": {
        "beta": Range(
            "a finite number > 1 (last layer gets budget / beta; beta = 1 would be uniform SnapKV)",
            (_above(1.0), 20.0, 2, _BIG),
            (1, 1.0, _below(1.0), 0, math.inf, math.nan, True, "20"),
        ),
        "window_in_pyramid": Range("True or False", _BOOL, _NOT_BOOL),
    },
    "buzz": {
        "sink": _int_at_least(0),
        # Stride 1 and 2 never thin the old samples, and the largest stride bounds the layout search:
        # every refusal states the range and the reasons.
        "stride": Range(
            "an integer in [3, 1024] (stride 1 evicts nothing and stride 2 gives the small stride "
            "floor((2+1)/2) = 1, which never thins the old samples, so the cache would grow without bound; "
            "1024 bounds the search for the window and threshold a budget gives)",
            (3, 4, 5, 1024),
            (2, 1, 0, 1025, 2**70, True, 5.0, "5"),
        ),
        "budget_form": _choice("mean", "peak"),
        # Remark 2's two readings in the mean form (issue 26); the refusal says what each one means.
        "prefill_fit": Range(
            "'budget' (Remark 2 thins a long prompt's samples until the layer fits the budget C) or 'peak' "
            "(until they fit the paper's literal container T + k + w, above C in the mean form)",
            ("budget", "peak"),
            ("no_such_choice", "BUDGET", "literal", None),
        ),
    },
    "buzz-logn": {"log_base": _int_at_least(2, (512,)), "log_count": _choice("key-length", "attended")},
    "bumblebee": {
        "mixture_weight": _PROBABILITY,
        "concave": _choice("log", "power"),
        "power_alpha": _fraction("a number in (0, 1]", low_open=True, high_open=False),
        "power_beta": Range(
            "a finite number >= 0", (0, 0.0, _TINY, 1.0, _BIG), (_below(0.0), -1, math.inf, math.nan, True, "1")
        ),
        "local_fraction": _fraction("a number in [0, 1)", low_open=False, high_open=True),
        "local_window": _int_at_least(0, (None,)),
        "importance_scale": _choice("raw", "normalised"),
        "greedy": Range(
            "'stochastic', 'lazy' or 'plain'", ("stochastic", "lazy", "plain"), ("no_such_choice", "STOCHASTIC", None)
        ),
        "epsilon": _fraction("a number in (0, 1)", low_open=True, high_open=True),
        "seed": _SEED,
        "streaming_above_tokens": _int_at_least(1, (None, 8192)),
    },
    "ada": {
        "alpha": _PROBABILITY,
        "allocation": _choice("authors", "kvpress"),
        "head_granularity": _choice("kv", "query", "auto"),
    },
    "ahakv": {
        "recent": _int_at_least(1),
        "kernel": _odd_kernel("centred mean filter"),
        "gain_input": Range(
            "one of ('raw_qk', 'scaled_qk')", ("raw_qk", "scaled_qk"), ("no_such_choice", "RAW_QK", None)
        ),
        "decode_n": Range("one of ('seen', 'stored')", ("seen", "stored"), ("no_such_choice", "SEEN", None)),
    },
    "subgen": {"recent": _int_at_least(0), "stale_refresh_width": _int_at_least(1, more=(None, 8))},
    "subgen-attention": {
        "cluster_radius": Range(
            "a finite number > 0 (cluster radius delta)",
            (_TINY, 0.5, 1, _BIG),
            (0, 0.0, -0.5, math.inf, math.nan, True, "0.5"),
        ),
        "relative_radius": Range("a bool", _BOOL, _NOT_BOOL),
        "samples_per_cluster": _int_at_least(1),
        # Each fraction in (0, 1); the other one is made tiny so that their sum (checked next) stays < 1.
        "value_sample_fraction": _fraction("a number in (0, 1)", True, True, cluster_fraction=_TINY),
        "cluster_fraction": _fraction("a number in (0, 1)", True, True, value_sample_fraction=_TINY),
        "seed": _SEED,
    },
    "vnorm": {"window": _int_at_least(0)},
}
# Which of the tables above each registered method's config is made of.
FAMILIES = {
    "full": (),
    "local": (),
    "tova": (),
    "knorm": (),
    "random": ("random",),
    "streamingllm": ("streamingllm",),
    "h2o": ("h2o",),
    "snapkv": ("snapkv",),
    "pyramidkv": ("snapkv", "pyramidkv"),
    "buzz": ("buzz",),
    "buzz-logn": ("buzz", "buzz-logn"),
    "bumblebee": ("bumblebee",),
    "bumblebee-power": ("bumblebee",),
    "ada-snapkv": ("snapkv", "ada"),
    "ada-pyramidkv": ("snapkv", "pyramidkv", "ada"),
    "ada-ahakv": ("ahakv", "ada"),
    "subgen": ("subgen",),
    "subgen-attention": ("subgen-attention",),
    "ahakv": ("ahakv",),
    "vnorm": ("vnorm",),
}


def _stated_range(method):
    return {parameter: spec for family in FAMILIES[method] for parameter, spec in RANGES[family].items()}


def test_every_method_parameter_has_a_stated_range():
    # The tables cover every registered method and every parameter of its config.
    assert sorted(FAMILIES) == sorted(method_names())
    for method in method_names():
        fields = {field.name for field in dataclasses.fields(policy_class(method).config_class)}
        assert set(_stated_range(method)) == fields, method


def _range_cases():
    for method in sorted(FAMILIES):
        for parameter in _stated_range(method):
            yield pytest.param(method, parameter, id=f"{method}-{parameter}")


@pytest.mark.parametrize(("method", "parameter"), list(_range_cases()))
def test_a_parameter_accepts_exactly_its_stated_range(method, parameter):
    spec = _stated_range(method)[parameter]
    assert spec.text not in ("None", "") and spec.text == spec.text.strip()
    for value in spec.accepted:
        policy = make_policy(method, **spec.context, **{parameter: value})
        assert getattr(policy.config, parameter) is value
    for entry in spec.refused:
        value, text = (entry.value, entry.text) if isinstance(entry, Refused) else (entry, spec.text)
        with pytest.raises(ValueError) as error:
            make_policy(method, **spec.context, **{parameter: value})
        assert str(error.value) == f"invalid {parameter}={value!r}: expected {text}"


@pytest.mark.parametrize(
    ("value_sample_fraction", "cluster_fraction", "accepted"),
    [
        (0.25, 0.25, True),
        (0.25, _below(0.75), True),
        (_below(0.75), 0.25, True),
        (0.25, 0.75, False),
        (0.5, 0.5, False),
        (0.75, 0.25, False),
        (0.5, _above(0.5), False),
        (0.75, 0.75, False),
    ],
)
def test_subgen_attention_fractions_leave_room_for_the_window(value_sample_fraction, cluster_fraction, accepted):
    # SubGen's value samples and clusters share the budget with the exact window: their fractions
    # must sum to < 1 (a sum of exactly 1 is refused, the nearest float below it accepted).
    total = value_sample_fraction + cluster_fraction
    assert (total < 1) is accepted
    parameters = {"value_sample_fraction": value_sample_fraction, "cluster_fraction": cluster_fraction}
    if accepted:
        make_policy("subgen-attention", **parameters)
        return
    with pytest.raises(ValueError) as error:
        make_policy("subgen-attention", **parameters)
    expected = (
        f"invalid value_sample_fraction + cluster_fraction={total!r}: expected a sum < 1 (the window needs the rest)"
    )
    assert str(error.value) == expected
