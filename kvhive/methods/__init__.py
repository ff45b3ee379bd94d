"""Compression methods: scoring and selection, model-agnostic."""

from kvhive.methods.base import Policy, PolicyConfig, ScoringInputs
from kvhive.methods.registry import make_policy, method_names, policy_class

__all__ = ["Policy", "PolicyConfig", "ScoringInputs", "make_policy", "method_names", "policy_class"]
