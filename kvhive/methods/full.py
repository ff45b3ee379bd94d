"""Full cache: no eviction (the upper bound every paper compares against)."""

from __future__ import annotations

from dataclasses import dataclass

from kvhive.methods.base import Policy, PolicyConfig


@dataclass(frozen=True)
class FullConfig(PolicyConfig):
    pass


class Full(Policy):
    name = "full"
    phases = frozenset()
    config_class = FullConfig
    paper = "baseline: uncompressed cache"
