"""Methods by registry name (docs/METHODS.md, "Registry names"; used by the CLI, the API and
results files). Adding a method: write its module and add one line below."""

from __future__ import annotations

import importlib
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
