"""BumbleBee's long prompts the streaming way (Algorithm 2 of the paper over a prompt's later tokens).

Above ``BumbleBeeConfig.streaming_above_tokens`` the prefill runs Algorithm 1 (the greedy) over the
first tokens only, then every later candidate joins the streaming summary one at a time, oldest
first, dropping the member of smallest marginal gain: what a chunked prefill's later chunks do, with
no ``candidates x candidates`` similarity matrix.
"""

from __future__ import annotations

import torch

from kvhive.methods.scoring import ScoringInputs
from kvhive.methods.submodular import Concave, StreamingSummary

# Joiners per block of a streamed prompt (stream_later_candidates): each block's keys are gathered
# beside the members' once, and the summary's step reads O(tau_s + block) keys per joiner.
STREAMING_JOINERS = 256


def stream_later_candidates(
    scoring: ScoringInputs,
    chosen_first: torch.Tensor,
    summary: StreamingSummary,
    accumulated: torch.Tensor,
    candidates: int,
    summary_size: int,
    mixture_weight: float,
    concave: Concave,
    normalise_mass: bool,
) -> torch.Tensor:
    """The later candidates of a prompt join ``summary`` (built by the greedy over the first
    ``chosen_first.shape[1]`` tokens, whose members ``chosen_first [R, first]`` marks) one at a time,
    oldest first, each dropping the member of smallest marginal gain. The joiners go in blocks of
    ``STREAMING_JOINERS`` beside the members (the summary's step reads ``O(tau_s + block)`` keys a
    joiner), so memory is ``O(tau_s + block)`` per row after the first greedy. ``accumulated``
    ``[B, H, N]``: the attention mass of each stored token. ``chosen [R, candidates]``."""
    batch, heads, _, dim = scoring.keys.shape
    rows, first = batch * heads, chosen_first.shape[1]
    device = scoring.keys.device
    chosen = torch.zeros(rows, candidates, dtype=torch.bool, device=device)
    chosen[:, :first] = chosen_first
    keys = scoring.keys[:, :, :candidates].reshape(rows, candidates, dim)
    valid = scoring.valid[:, :, :candidates].reshape(rows, candidates)
    positions = scoring.positions[:, :, :candidates].reshape(rows, candidates)
    weights = accumulated[:, :, :candidates].reshape(rows, candidates)
    # The members' stored indices by rank (oldest first): the summary's order.
    order = torch.arange(first, device=device)
    members = torch.where(chosen[:, :first], order, first).sort(dim=-1).values[:, :summary_size]
    for start in range(first, candidates, STREAMING_JOINERS):
        joiners = torch.arange(start, min(candidates, start + STREAMING_JOINERS), device=device)
        ground = torch.cat([members, joiners.expand(rows, -1)], dim=1)  # members first, then joiners
        dropped = summary.step(
            keys.gather(1, ground[:, :, None].expand(-1, -1, dim)),
            valid.gather(1, ground),
            weights.gather(1, ground),
            positions.gather(1, ground),
            summary_size,
            joiners.numel(),
            mixture_weight,
            concave,
            normalise_mass=normalise_mass,
        )
        stays = torch.ones_like(ground, dtype=torch.bool).scatter_(1, dropped, False)
        # tau_s survive in every row, in rank order (members by rank, then joiners by age).
        members = ground.masked_select(stays).view(rows, summary_size)
    return chosen.zero_().scatter_(1, members, True)
