"""Methods by registry name (docs/METHODS.md, "Registry names"; used by the CLI, the API and
results files). Adding a method: write its module and add one line below."""

from __future__ import annotations

import importlib
import json
from typing import Any

from kvhive.methods.base import Policy

# name -> "module:Class"; imported lazily so a broken optional method cannot break the rest.
_METHODS: dict[str, str] = {
    "full": "kvhive.methods.full:Full",
    "local": "kvhive.methods.local:Local",
    "random": "kvhive.methods.random_local:RandomLocal",
    "streamingllm": "kvhive.methods.streamingllm:StreamingLLM",
    "h2o": "kvhive.methods.h2o:H2O",
    "snapkv": "kvhive.methods.snapkv:SnapKV",
    "pyramidkv": "kvhive.methods.pyramidkv:PyramidKV",
    "tova": "kvhive.methods.tova:TOVA",
    "knorm": "kvhive.methods.knorm:KNorm",
    "buzz": "kvhive.methods.buzz:Buzz",
    "buzz-logn": "kvhive.methods.buzz:BuzzLogN",
    "bumblebee": "kvhive.methods.bumblebee:BumbleBee",
    "bumblebee-power": "kvhive.methods.bumblebee:BumbleBeePower",
    "ada-snapkv": "kvhive.methods.adakv:AdaSnapKV",
    "ada-pyramidkv": "kvhive.methods.adakv:AdaPyramidKV",
    "ada-ahakv": "kvhive.methods.adakv:AdaAhaKV",
    "subgen": "kvhive.methods.subgen:SubGen",
    "subgen-attention": "kvhive.methods.subgen_attention:SubGenAttention",
    "ahakv": "kvhive.methods.ahakv:AhaKV",
    "vnorm": "kvhive.methods.vnorm:ValueNorm",  # kvhive example scorer (adding a method: this file + one line)
}


def method_names() -> list[str]:
    return list(_METHODS)


ADA_PREFIX = "ada-"


def policy_class(name: str) -> type[Policy]:
    """The class of registry name ``name``; ``ada-<scorer>`` is Ada-KV over any score-based method."""
    if not isinstance(name, str):
        raise ValueError(
            f"invalid method={name!r}: expected a method name, one of {', '.join(_METHODS)} (or {ADA_PREFIX}<any "
            "score-based method>, e.g. ada-tova), or a Policy instance"
        )
    if name not in _METHODS and name.startswith(ADA_PREFIX) and name[len(ADA_PREFIX) :] in _METHODS:
        from kvhive.methods.adakv import ada_class

        return ada_class(policy_class(name[len(ADA_PREFIX) :]))
    if name not in _METHODS:
        raise ValueError(
            f"unknown method={name!r}; available methods: {', '.join(_METHODS)} "
            f"(and {ADA_PREFIX}<any score-based method>, e.g. ada-tova)"
        )
    module_name, class_name = _METHODS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_policy(name: str, **parameters: Any) -> Policy:
    """Instantiate a method by registry name with paper defaults overridden by ``parameters``."""
    return policy_class(name)(**parameters)


# A method with options, as one token of a comma-separated list (``kvhive eval --methods``), in the
# syntax of task parameters: ``buzz:budget_form=peak``, ``ahakv:gain_input=scaled_qk:sink_tokens=4``.
SPEC_SEPARATOR = ":"


def parse_method_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``"buzz:budget_form=peak:stride=4"`` -> ``("buzz", {"budget_form": "peak", "stride": 4})``.
    A value is read as JSON when it parses as JSON (numbers, ``true``/``false``), else as text;
    the method's config then validates it."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"invalid method={spec!r}: expected a method name, optionally with :option=value parts")
    name, *pairs = (part.strip() for part in spec.strip().split(SPEC_SEPARATOR))
    parameters: dict[str, Any] = {}
    for pair in pairs:
        option, equals, text = pair.partition("=")
        if not equals or not option.strip() or not text.strip():
            raise ValueError(f"invalid method={spec!r}: option {pair!r} is not NAME=VALUE")
        if option.strip() in parameters:
            raise ValueError(f"invalid method={spec!r}: option {option.strip()!r} given twice")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text.strip()
        parameters[option.strip()] = value
    return name, parameters


def method_spec(name: str, parameters: dict[str, Any]) -> str:
    """The canonical spelling of a method with options (options sorted), so one setting has one name
    in results whatever order the options were typed in."""
    parts = [name]
    for option in sorted(parameters):
        value = parameters[option]
        parts.append(f"{option}={value if isinstance(value, str) else json.dumps(value)}")
    return SPEC_SEPARATOR.join(parts)


def make_policy_from_spec(spec: str) -> Policy:
    """The method a spec names, with its options validated by the method's config (an unknown
    option or a value out of range raises ValueError naming it)."""
    name, parameters = parse_method_spec(spec)
    return make_policy(name, **parameters)


def canonical_method_spec(spec: str) -> str:
    """``spec`` validated (the method exists, its options are accepted) and spelled canonically."""
    make_policy_from_spec(spec)
    return method_spec(*parse_method_spec(spec))
