"""BumbleBee's stored tokens by original position: the order its streaming summary ranks members
by, where the cache may store tokens out of order (a fixed decode capacity fills freed slots)."""

from __future__ import annotations

import torch

from kvhive.methods.scoring import ScoringInputs


def oldest_tokens(
    keys: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, order: torch.Tensor | None, size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys, validity and positions of the ``size`` oldest stored tokens, oldest first: the
    first ``size`` stored ones while the cache stores them in their order (``order`` None), else
    those ``order`` (:func:`rank_by_position`) ranks first."""
    if order is None:
        return keys[:, :size], valid[:, :size], positions[:, :size]
    first = order[:, :size]
    return (
        keys.gather(1, first[:, :, None].expand(-1, -1, keys.shape[-1])),
        valid.gather(1, first),
        positions.gather(1, first),
    )


def rank_by_position(
    scoring: ScoringInputs, positions: torch.Tensor, stored: torch.Tensor | None
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(order, ranked)``: ``order [R, N]`` the stored index of each stored token ranked by original
    position (the empty slots of a fixed capacity, where ``stored [N]`` is False, last), None while
    the cache stores the tokens in their order (the rank is the stored index); ``ranked`` their
    positions in that order. The sort's own values, not a gather from the stored positions: a
    compiled step moves a token into the freed slot later in the same graph, and the check reads
    what the step started from."""
    if scoring.stored_in_order:
        return None, positions
    if stored is not None:
        positions = torch.where(stored, positions, torch.iinfo(positions.dtype).max)
    ranked, order = positions.sort(dim=-1, stable=True)
    return order, ranked
