"""Integration with transformers' attention and mask interfaces."""

from kvhive.attention.integration import ATTENTION_NAME, kvhive_attention, register

__all__ = ["ATTENTION_NAME", "kvhive_attention", "register"]
