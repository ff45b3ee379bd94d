"""SubGen's candidate bookkeeping: distances between keys and the decode-phase maintenance of the
candidate set (:func:`maintain_candidates`, its steady one-in-one-out step :func:`steady_step`).

Each candidate's nearest-neighbour distance and position are per-token scores kept aligned with the
stored tokens by the cache (:data:`NEAREST_DISTANCE`, :data:`NEAREST_POSITION`, :data:`KEY_NORM`),
so a decode step costs ``O(N·d)`` per head, not ``O(k²·d)``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvhive.methods.scoring import ScoringInputs

# Per-token scores (kept aligned with the stored tokens by the cache).
NEAREST_DISTANCE = "subgen_nn_sqdist"  # squared L2 distance to the nearest other candidate
NEAREST_POSITION = "subgen_nn_position"  # original position of that candidate (-1: none)
KEY_NORM = "subgen_key_sqnorm"  # squared L2 norm of the key (current for the ready candidates)
# A candidate is *ready* (its entries above are current) once a decision saw it among the
# candidates: after a decision the layer holds the budget, so the candidates not ready at the next
# one are the newest ``N - budget`` (the tokens that left the recent window since).

# Elements of a distance block computed at once (rows x new tokens x stored tokens).
_BLOCK_ELEMENTS = 1 << 22


def after_every(positions: torch.Tensor) -> float | int:
    """A value above every position of ``positions``' dtype (the positions are float copies of the
    per-token scores' dtype in the decode bookkeeping)."""
    return float("inf") if positions.is_floating_point() else torch.iinfo(positions.dtype).max


def squared_distances(
    points: torch.Tensor, points_sq: torch.Tensor, centers: torch.Tensor, centers_sq: torch.Tensor
) -> torch.Tensor:
    """``[R, N, d] x [R, P, d] -> [R, N, P]`` squared L2 distances (clamped at 0)."""
    dots = torch.matmul(points, centers.transpose(-1, -2))
    return (points_sq[..., :, None] - 2 * dots + centers_sq[..., None, :]).clamp_min_(0)


def padded_indices(
    mask: torch.Tensor, width: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask [R, N]`` -> ``(index [R, width], present [R, width])``: the first ``width`` True
    columns of each row, in order (``width`` is a bound known on the host: no read of the counts).
    With ``positions [R, N]``: the ``width`` True columns of oldest positions, oldest first (the
    stored order need not be the tokens')."""
    width = min(width, mask.shape[-1])
    # A stable sort puts the True columns first, in order (of column, or of position).
    order = (~mask).to(torch.int8) if positions is None else positions.masked_fill(~mask, after_every(positions))
    index = torch.sort(order, dim=-1, stable=True).indices[:, :width]
    return index, mask.gather(1, index)


def _smallest_indices(values: torch.Tensor, mask: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [R, width], present [R, width])``: the ``width`` True columns of ``mask`` with the
    smallest ``values`` (fewer where a row has fewer; ``present`` marks the real ones)."""
    width = min(width, mask.shape[-1])
    index = torch.where(mask, values, float("inf")).topk(width, dim=-1, largest=False).indices
    return index, mask.gather(1, index)


def _pair_distances(
    rows: torch.Tensor, rows_sq: torch.Tensor, keys: torch.Tensor, columns_sq: torch.Tensor
) -> torch.Tensor:
    """``[R, c, d] x [R, N, d] -> [R, c, N]``: ``rows_sq - 2 rows·keys + columns_sq`` clamped at 0,
    the arithmetic of :func:`squared_distances` in the same order (so the same bits), done in place
    on the product. An ``inf`` in ``rows_sq`` / ``columns_sq`` makes its row / column ``inf``: the
    masks are folded into the norms instead of a masked pass over the block."""
    dots = torch.matmul(rows, keys.transpose(-1, -2))
    # -2·dot is exact, and x + (-y) is x - y in IEEE arithmetic.
    return dots.mul_(-2).add_(rows_sq[..., :, None]).add_(columns_sq[..., None, :]).clamp_min_(0)


def _nearest_among(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    members: torch.Tensor,
    index: torch.Tensor,
    present: torch.Tensor,
    gathered: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Yield ``(columns, distances [R, c, N])``: squared distances of the tokens ``index`` to
    every token, ``inf`` where the token is not in ``members`` or is the token itself, and on the
    rows not ``present``. ``keys_sq`` must be current for the members and the present tokens
    (other entries are not read). ``gathered``: the keys and squared norms of the tokens
    ``index`` when the caller has them (not gathered again)."""
    rows, num_tokens, dim = keys.shape
    columns_sq = torch.where(members, keys_sq, float("inf"))
    step = max(1, _BLOCK_ELEMENTS // max(1, rows * num_tokens))
    for start in range(0, index.shape[1], step):
        columns = slice(start, start + step)
        chosen = index[:, columns]
        if gathered is not None:
            chosen_keys, chosen_sq = (part[:, columns] for part in gathered)
        else:
            chosen_keys, chosen_sq = keys.gather(1, chosen[..., None].expand(-1, -1, dim)), keys_sq.gather(1, chosen)
        chosen_sq = torch.where(present[:, columns], chosen_sq, float("inf"))
        distances = _pair_distances(chosen_keys, chosen_sq, keys, columns_sq)
        distances.scatter_(2, chosen[..., None], float("inf"))
        yield columns, distances


def _first_true(mask: torch.Tensor, width: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`padded_indices` (the ``width`` oldest True columns of each row); one column is an
    ``argmax`` (a row's only True column when the bound is 1, column 0 in a row with none; its
    ``present`` is False then), not a sort of the row."""
    if min(width, mask.shape[-1]) == 1:
        index = mask.to(torch.int8).argmax(-1, keepdim=True)
        return index, mask.gather(1, index)
    return padded_indices(mask, width, positions)


def _oldest_minimum(
    values: torch.Tensor, positions: torch.Tensor, dim: int = -1, with_position: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(oldest position, index)`` along ``dim`` (kept) of the minimum of ``values``: among equal
    minima the oldest position, what ``min`` (the first minimum) gives when tokens are stored
    oldest first, whatever order they are stored in. ``positions`` broadcasts against ``values``.
    Without ``with_position``: ``(minimum, oldest position)`` (no index)."""
    low = values.amin(dim, keepdim=True)
    # One broadcasting where (a masked_fill of the expanded positions copies them first).
    at_low = torch.where(values == low, positions, after_every(positions))
    if with_position:
        return at_low.min(dim, keepdim=True)
    return low, at_low.amin(dim, keepdim=True)


# The approximate refresh's width used before the exact rule became the default (the value of
# ``SubGenConfig.stale_refresh_width`` that reproduces it). With a width, a removal refreshes the
# stale candidates (nearest neighbour dropped) of smallest recorded distance up to that many per
# row; a row with more keeps the rest as lower bounds, and when such a lower bound is the smallest
# recorded distance the removal drops its candidate instead of the newer member of the true closest
# pair (high-dimensional keys have hubs: on the kv-heavy benchmark model a row holds up to ~130
# stale candidates after a removal).
APPROXIMATE_STALE_REFRESH_WIDTH = 8


def refresh_width(stale_refresh_width: int | None, tokens: int) -> int:
    """The stale candidates refreshed per row and removal: every one (``tokens``, the stored tokens
    of a row, bounds them) for the exact rule (None), else ``stale_refresh_width``."""
    return tokens if stale_refresh_width is None else stale_refresh_width


class SteadyProbe(NamedTuple):
    """What :meth:`SubGen.decode_key_probes` derived before a steady step's attention, handed back
    to :meth:`SubGen.select_decode` with the attention's products of the probed rows."""

    split: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]  # SubGen._split: valid, forced, candidates
    positions: torch.Tensor  # [R, N] the stored positions, in nearest_position's dtype
    newcomer: torch.Tensor  # [R, 1] each row's newcomer (stored index)
    index: torch.Tensor  # [R, 1 + w] the probed rows (steady_rows)
    asked_sq: torch.Tensor  # [R, 1 + w] their squared norms
    products: torch.Tensor | None  # [R, 1 + w, N] their products with every stored key


def maintain_candidates(
    keys: torch.Tensor,
    positions: torch.Tensor,
    candidates: torch.Tensor,
    target: int,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    ready: torch.Tensor | None,
    *,
    newcomer_bound: int,
    removal_bound: int,
    stale_refresh_width: int | None = None,
    keys_sq: torch.Tensor | None = None,
    every_row_full: bool = False,
    probe: SteadyProbe | None = None,
):
    """Shrink each row's candidate set to ``target`` by repeatedly evicting the newer member of
    the closest pair. All ``[R, N]`` (keys ``[R, N, d]``); ``nearest_*`` are updated in place for
    the candidates; returns ``(survivors, dropped)``: the surviving candidates ``[R, N]`` bool and,
    for a steady step (:func:`steady_step`), the token it dropped (``[R, N]`` bool, one True per row
    where every row is full), else None.

    The tokens may be stored in any order (``positions``, distinct per row, say which is which):
    newcomers are taken oldest first, and among equal distances the oldest token is the closest
    pair's first member and a newcomer's nearest neighbour, which is what the first minimum gives
    when tokens are stored oldest first; so the kept sets do not depend on the stored order.

    Fixed work, no host read: ``newcomer_bound`` (a host-known bound on the candidates not yet
    ``ready`` in any row) and ``removal_bound`` (on the excess over ``target``) set the number of
    tensor steps; a row with less to do is masked. Before each removal every stale candidate
    (nearest neighbour gone) gets its nearest neighbour again, so the removal takes the true closest
    pair (the paper's rule): one batched block of rows, every stored token of a row a row of it
    (a fixed shape, whatever the number of stale candidates). A steady step (:func:`steady_step`)
    refreshes its removal's stale candidates at the start of the next step instead; those left here
    are refreshed before the first removal.

    ``stale_refresh_width`` (an approximation, opt in): refresh only that many stale candidates per
    row and removal, smallest recorded distance first; a stale candidate beyond it keeps its
    recorded distance, a lower bound of the true one, until a later removal refreshes it, and where
    that bound is the smallest recorded distance the removal drops its candidate (not the closest
    pair's newer member). The search is exact whenever no row has more stale candidates than the
    width at a removal (in 2 dimensions a token is the unique nearest neighbour of at most 6 others).

    Stale candidates are recorded with ``nearest_position = -1`` (the position of no token), so
    a removal finds them without searching for every candidate's neighbour: this needs every
    ready candidate's recorded position to be ``-1`` or a candidate's (what the prefill's record
    and every call here leave; a candidate leaves the set only by a removal here).

    ``ready`` (``[R, N]`` bool, updated in place to the survivors): the candidates whose entries are
    current; None: all but the ``newcomer_bound`` newest candidates of each row (what a decision
    leaves: see ``KEY_NORM``), and a steady step takes each row's newest candidate as its newcomer.

    ``keys_sq`` (``[R, N]``, optional): the keys' squared norms, current for the ready
    candidates; the newcomers' are computed and written into it (in place). Without it every
    key's norm is computed (a pass over all keys). ``every_row_full``: every row holds more than
    ``target`` candidates (known on the host), which the steady step uses to skip its row mask.
    ``probe`` (a steady step, ``ready`` None): what :meth:`SubGen.decode_key_probes` chose before the
    step's attention, with the attention's ``products``: the step computes no product of its own."""
    keys = keys.float()
    if keys_sq is None:
        keys_sq = (keys * keys).sum(-1)
    positions = positions.to(nearest_position.dtype)
    rows, _, dim = keys.shape
    stale_refresh_width = refresh_width(stale_refresh_width, keys.shape[1])
    if probe is None:  # (a probed step's candidates are the probe's own, made for this step)
        candidates = candidates.clone()
    # A steady step (one token joins, one leaves) whose refresh is one block of _nearest_among.
    if newcomer_bound == 1 and removal_bound == 1 and steady_block_fits(rows, keys.shape[1], stale_refresh_width):
        # Each row's newcomer; in a row that has none, a ready candidate (recomputed to the same
        # neighbour) or a non-candidate (no candidate is closer to it than to its own neighbour).
        probed = None
        if probe is not None:  # chosen before the attention, from the same state
            newcomer, probed = probe.newcomer, (probe.index, probe.asked_sq, probe.products)
        elif ready is None:  # the newest candidate
            newcomer = newest_candidate(candidates, positions)
        else:
            newcomer = (candidates & ~ready).to(torch.int8).argmax(-1, keepdim=True)
        dropped = steady_step(
            keys,
            keys_sq,
            positions,
            candidates,
            target,
            nearest_sq,
            nearest_position,
            newcomer,
            stale_refresh_width,
            every_row_full,
            probed,
        )
        if ready is not None:
            ready.copy_(candidates)
        return candidates, dropped
    if ready is None:
        width = min(newcomer_bound, candidates.shape[-1])
        newest = torch.where(candidates, positions, -1.0).topk(width, dim=-1).indices
        ready = candidates.clone().scatter_(1, newest, False)

    def recompute(index: torch.Tensor, present: torch.Tensor, update_others: bool, gathered=None) -> None:
        if index.shape[1] == 0:
            return
        for columns, distances in _nearest_among(keys, keys_sq, candidates, index, present, gathered):
            chosen, here = index[:, columns], present[:, columns]
            # Rows not present are all inf: no neighbour found there, nothing written below.
            best, best_position = (found.squeeze(-1) for found in _oldest_minimum(distances, positions[:, None, :]))
            new_pos = torch.where(torch.isfinite(best), best_position, -1.0)
            # Entries not present scatter their own current value back (indices are distinct).
            nearest_sq.scatter_(1, chosen, torch.where(here, best, nearest_sq.gather(1, chosen)))
            nearest_position.scatter_(1, chosen, torch.where(here, new_pos, nearest_position.gather(1, chosen)))
            if update_others:
                # The new tokens may be the nearest neighbour of candidates that were already there.
                if chosen.shape[1] == 1:  # one new token (a steady step): its own row, no reduction
                    column_best, source = distances[:, 0], positions.gather(1, chosen)
                else:
                    column_best, column_arg = distances.min(1)
                    source = positions.gather(1, chosen.gather(1, column_arg))
                closer = ready & (column_best < nearest_sq)
                nearest_sq.copy_(torch.where(closer, column_best, nearest_sq))
                nearest_position.copy_(torch.where(closer, source, nearest_position))

    # (No streaming read of the keys first any more: it paid while every step compacted the kept
    # window into place before the next one; with the freed slot filled the products find the
    # keys warm from the step's attention: kv-heavy 4k, 2 layers, seven runs each on a shared
    # machine, 1.34-1.43x SnapKV with it, 1.32-1.45x without, no difference to measure.)
    newcomers, present = _first_true(candidates & ~ready, newcomer_bound, positions)
    gathered = None
    if newcomers.shape[1] > 0:
        # The newcomers' norms (a row's own norm wherever an index is padding: true all the same).
        joining = keys.gather(1, newcomers[..., None].expand(-1, -1, dim))
        gathered = (joining, (joining * joining).sum(-1))
        keys_sq.scatter_(1, newcomers, gathered[1])
    recompute(newcomers, present, update_others=True, gathered=gathered)
    # The stale candidates a steady step left for the next one to refresh (it marks them and
    # refreshes at its start): the smallest first, as after each removal below.
    left_stale = candidates & ready & (nearest_position < 0)
    recompute(*_smallest_indices(nearest_sq, left_stale, stale_refresh_width), update_others=False)
    excess = candidates.sum(-1, keepdim=True) - target
    for removal in range(removal_bound):
        active = excess > 0
        value = torch.where(candidates, nearest_sq, float("inf"))
        first_position, first = _oldest_minimum(value, positions, with_position=True)
        partner_position = nearest_position.gather(1, first)
        partner_mask = candidates & (positions == partner_position)
        partner = partner_mask.to(torch.int8).argmax(-1, keepdim=True)
        # The partner's slot holds it iff there is one (positions are distinct), at partner_position.
        newer_is_partner = partner_mask.gather(1, partner) & (partner_position > first_position)
        drop = torch.where(newer_is_partner, partner, first)
        held = candidates.gather(1, drop)
        dropped = held & active
        candidates.scatter_(1, drop, held ^ dropped)
        # Stale now: the candidates recorded stale (-1) and those whose neighbour was just dropped.
        dropped_position = torch.where(newer_is_partner, partner_position, first_position)
        lost = candidates & (nearest_position == torch.where(dropped, dropped_position, -1.0))
        nearest_position.masked_fill_(lost, -1.0)
        stale = candidates & (nearest_position < 0)
        recompute(*_smallest_indices(nearest_sq, stale, stale_refresh_width), update_others=False)
        if removal + 1 < removal_bound:
            excess = excess - active.long()
    ready.copy_(candidates.to(ready.dtype))
    return candidates, None


def neighbours_recorded(scores: dict) -> bool:
    """Whether a decision (the prefill's included) recorded the candidates' nearest neighbours."""
    return scores.get(NEAREST_DISTANCE) is not None


def steady_block_fits(rows: int, tokens: int, stale_refresh_width: int) -> bool:
    """Whether a steady step's refresh (newcomer and stale candidates) is one block of distances."""
    return 0 < stale_refresh_width <= max(1, _BLOCK_ELEMENTS // max(1, rows * tokens))


def is_steady_step(scoring: ScoringInputs, budget: int, stale_refresh_width: int | None) -> bool:
    """Whether a decode step's decision is :func:`steady_step` (what :func:`maintain_candidates`
    takes after a decision, one token over the budget, the block fitting): the step whose rows
    :meth:`SubGen.decode_key_probes` asks for and whose dropped token :meth:`SubGen.select_decode_drop`
    names."""
    b, h, n, _ = scoring.keys.shape
    return (
        neighbours_recorded(scoring.token_scores)
        and n - budget == 1
        and steady_block_fits(b * h, n, refresh_width(stale_refresh_width, n))
    )


def newest_candidate(candidates: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``[R, 1]``: each row's candidate of the highest position (a steady step's newcomer)."""
    return torch.where(candidates, positions, -1.0).argmax(-1, keepdim=True)


def steady_rows(
    keys: torch.Tensor,
    candidates: torch.Tensor,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    newcomer: torch.Tensor,
    stale_refresh_width: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows whose distances :func:`steady_step` computes: ``(index [R, 1 + w], keys
    [R, 1 + w, d], squared norms [R, 1 + w])``, each row's newcomer first (the rows to compute),
    then its stale candidates (recorded ``nearest_position < 0``) of smallest recorded distance,
    then, where fewer are stale, the candidates of smallest recorded distance. Changes nothing."""
    inf = float("inf")
    order = torch.where(candidates & (nearest_position < 0), nearest_sq, inf).scatter_(1, newcomer, -inf)
    index = order.topk(min(1 + stale_refresh_width, order.shape[-1]), dim=-1, largest=False).indices
    asked = keys.gather(1, index[..., None].expand(-1, -1, keys.shape[-1]))
    return index, asked, torch.linalg.vecdot(asked, asked)


def steady_step(
    keys: torch.Tensor,
    keys_sq: torch.Tensor,
    positions: torch.Tensor,
    candidates: torch.Tensor,
    target: int,
    nearest_sq: torch.Tensor,
    nearest_position: torch.Tensor,
    newcomer: torch.Tensor,
    stale_refresh_width: int,
    every_row_full: bool,
    probe: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """:func:`maintain_candidates` for a steady decode step (at most one newcomer and one removal
    per row), the same decisions in about half the tensor ops and one product of the keys.

    The stale candidates (nearest neighbour dropped) are refreshed at the *start* of the next step
    instead of the end of this one, in the same product as the newcomer's distances: the
    ``stale_refresh_width`` stale candidates of smallest recorded distance and the newcomer are one
    ``[R, 1 + width, d]`` block of rows against the candidates (the newcomer among them). The removal
    then sees what the end-of-step refresh and the newcomer's update gave it before: each refreshed
    candidate's nearest neighbour among the candidates, newcomer included, and every other
    candidate's record lowered to the newcomer where it is closer (a stale one's recorded distance
    is a lower bound: a newcomer closer than it is its true nearest neighbour). Where a row has
    fewer stale candidates than the width (or no newcomer), the block's spare rows are the
    candidates of smallest recorded distance, whose records are exact: recomputing them changes
    nothing but rounding. After the removal the candidates whose neighbour it dropped are marked
    stale (``nearest_position = -1``) for the next step (or :func:`maintain_candidates`) to refresh.

    ``newcomer [R, 1]``: each row's newcomer (stored index). ``every_row_full``: every row holds
    more than ``target`` candidates (known on the host when every stored token is real), so every
    row drops one and every candidate has a neighbour: no row is masked. ``probe``:
    ``(index, asked_sq, products)``: :func:`steady_rows`'s rows with their products with every
    stored key computed elsewhere (the attention's, ``[R, 1 + w, N]``); None: chosen and computed
    here. Updates ``candidates`` (the survivors), ``nearest_*`` and ``keys_sq`` in place; returns the
    dropped token ``[R, N]`` (bool: one per row that drops one)."""
    inf = float("inf")
    if probe is None:
        index, asked, asked_sq = steady_rows(
            keys, candidates, nearest_sq, nearest_position, newcomer, stale_refresh_width
        )
        # [R, 1 + w, N] squared distances, |x|² - 2·dot + |y|² (-2·dot exact, so one rounding per
        # add); non-candidate columns inf through their norm, each row's own column inf. (baddbmm
        # reads the stored keys where they lie: matmul copies a slice of the cache's buffer first.)
        distances = torch.baddbmm(asked_sq[..., None], asked, keys.transpose(-1, -2), alpha=-2)
    else:  # the same rows' products, computed by the attention with its logits: the same sum
        index, asked_sq, products = probe
        distances = torch.add(asked_sq[..., None], products, alpha=-2)
    keys_sq.scatter_(1, index, asked_sq)  # the newcomer's norm (the others' are rewritten as they were)
    distances = distances.add_(torch.where(candidates, keys_sq, inf)[:, None, :]).clamp_min_(0)
    distances.scatter_(2, index[..., None], inf)
    best, best_position = _oldest_minimum(distances, positions[:, None, :])
    if not every_row_full:  # (else every candidate has another: every distance found is finite)
        best_position = torch.where(torch.isfinite(best), best_position, -1.0)
    # The newcomer may be the nearest neighbour of candidates already there (row 0 of the block).
    # Its non-candidate columns are inf: never closer. (Where the row has no newcomer, row 0 is a
    # non-candidate, all inf, or a candidate, which is no closer to any candidate than that one's
    # nearest neighbour, nor than a stale one's lower bound.)
    from_newcomer = distances[:, 0]
    closer = from_newcomer < nearest_sq
    nearest_position.copy_(torch.where(closer, positions.gather(1, newcomer), nearest_position))
    nearest_sq.clamp_max_(from_newcomer)  # the same values as where(closer, from_newcomer, nearest_sq)
    nearest_sq.scatter_(1, index, best.squeeze(-1))
    nearest_position.scatter_(1, index, best_position.squeeze(-1))
    # One removal: the newer member of the closest pair (first member: oldest among the minima).
    value = torch.where(candidates, nearest_sq, inf)
    first_position, first = _oldest_minimum(value, positions, with_position=True)
    dropped_position = torch.maximum(nearest_position.gather(1, first), first_position)
    # (A candidate's position: the first member's, or its recorded neighbour's, a candidate's. The
    # positions are distinct, so no other token is dropped.)
    drop = positions == dropped_position
    if not every_row_full:  # (a row with no candidate, or not over its target, drops none)
        drop &= candidates & (candidates.sum(-1, keepdim=True) > target)
        dropped_position = torch.where(drop.any(-1, keepdim=True), dropped_position, -2.0)
    candidates.logical_xor_(drop)
    # Stale for the next step: the candidates whose neighbour was just dropped (a non-candidate marked
    # too is rewritten when it joins).
    nearest_position.masked_fill_(nearest_position == dropped_position, -1.0)
    return drop
