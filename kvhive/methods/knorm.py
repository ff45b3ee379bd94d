"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression").

Sec. 3-4: a key with a low L2 norm tends to receive high attention, so compress by keeping, per
KV head, the ``budget`` keys with the **smallest** ``||k||_2`` (keys as stored, i.e. after RoPE,
which is a rotation and leaves the norm unchanged). No attention scores are needed (the point of
the method: it works with FlashAttention). Prefill phase only. Padding is never kept while real
tokens remain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvhive.methods.base import PREFILL, PolicyConfig, ScorerPolicy, ScoringInputs


@dataclass(frozen=True)
class KNormConfig(PolicyConfig):
    pass


class KNorm(ScorerPolicy):
    name = "knorm"
    phases = frozenset({PREFILL})
    config_class = KNormConfig
    paper = "Devoto et al. 2024, Sec. 4 (keep the keys with the lowest L2 norm)"

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return -torch.linalg.vector_norm(scoring.keys.float(), dim=-1)  # [B, H, N]
