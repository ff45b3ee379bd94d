"""Which stored tokens a decision keeps: rankings and masks over the last dimension.

Every helper here works on plain tensors ``[..., N]`` (tokens stored oldest first unless told
otherwise), so a method and the cache's fast paths share one definition of "the top ``budget``
scores" and "the token that leaves".
"""

from __future__ import annotations

import torch


def top_indices(ranking: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` highest entries along the last dimension; among equal scores the
    later (more recent) token wins. ``topk``'s order among ties depends on the row's length, so a
    row of a padded batch could keep another tied token than the same row alone; a stable sort
    does not. (Later-wins is also what ``topk`` gave on the Ada-KV authors' fixtures.)"""
    last = ranking.shape[-1] - 1
    return last - ranking.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :count]


def keep_top_scores(
    scores: torch.Tensor,
    budget: int,
    valid: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean keep mask ``[..., N]`` with exactly ``min(budget, N)`` True per row.

    ``forced`` entries are kept first (e.g. the recent window), then the highest ``scores``;
    padding (``valid`` False) ranks below every real token, so it is kept only when a row has
    fewer real tokens than the budget (as the uncompressed cache would hold it too). ``positions``
    (when the stored order is not the tokens' order): among equal ranks the older position leaves
    when one token does.
    """
    num_tokens = scores.shape[-1]
    if budget >= num_tokens:
        return torch.ones_like(scores, dtype=torch.bool)
    if num_tokens - budget == 1:  # one token leaves, as at every steady decode step
        keep = torch.ones_like(scores, dtype=torch.bool)
        keep.scatter_(-1, lowest_ranked(scores, valid, forced, positions), False)
        return keep
    kept_indices = top_indices(_ranking(scores, valid, forced), budget)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(-1, kept_indices, True)
    return keep


def _ranking(scores: torch.Tensor, valid: torch.Tensor | None, forced: torch.Tensor | None) -> torch.Tensor:
    """:func:`keep_top_scores`'s ranks: the scores (float32), forced tokens above every score,
    padding below every real score but still ordered (so ``topk`` stays deterministic). A fresh
    tensor only where something is filled in (nothing writes into it)."""
    ranking = scores.float()
    if forced is not None:
        ranking = ranking.masked_fill(forced, float("inf"))
    if valid is not None:
        ranking = ranking.masked_fill(~valid, -1e30)
    return ranking


def lowest_ranked(
    scores: torch.Tensor,
    valid: torch.Tensor | None = None,
    forced: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[..., 1]``: the token :func:`keep_top_scores` drops when it keeps all but one, with no sort: the
    lowest-ranked and, among equal ranks, the oldest (the first, or the smallest of ``positions``)."""
    ranking = _ranking(scores, valid, forced)
    if positions is None:
        return ranking.argmin(dim=-1, keepdim=True)
    lowest = ranking == ranking.amin(dim=-1, keepdim=True)
    oldest = torch.where(lowest, positions.to(torch.int64), torch.iinfo(torch.int64).max)
    return oldest.argmin(dim=-1, keepdim=True)


def recency(like: torch.Tensor) -> torch.Tensor:
    """Score ``[..., N]`` that ranks newer stored tokens higher (tokens are stored oldest first)."""
    return torch.arange(like.shape[-1], device=like.device, dtype=torch.float32).expand(like.shape)


def first_real_tokens(valid: torch.Tensor, count: int) -> torch.Tensor:
    """``[..., N]`` True on the first ``count`` non-padding tokens of each row (attention sinks)."""
    return valid & (valid.long().cumsum(dim=-1) <= count)


def recent_mask(num_tokens: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """``[..., N]`` True on the last ``window`` stored tokens (tokens are stored oldest first)."""
    recent = torch.zeros(num_tokens, dtype=torch.bool, device=like.device)
    if window > 0:
        recent[max(0, num_tokens - window) :] = True
    return recent.expand(*like.shape[:-1], num_tokens)
