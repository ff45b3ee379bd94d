"""Checks of a method's keep mask before the store applies it.

A decision is a boolean mask ``[B, H, N]`` over the stored tokens. Where the store lays the kept
tokens out on the host (a growing or packed layer), the counts it needs are the method's declared
count (``Policy.kept_per_row``, checked on the device without waiting) or read back once and
checked against the budget. Where the store compacts in place (a fixed capacity, stacked rows of
different lengths), nothing is read back: the counts stay on the device and are checked there
(``torch._assert_async``: a mismatch stops the device, an error at the next synchronisation).
"""

from __future__ import annotations

import torch


def check_keep(
    keep: torch.Tensor, method: str, layer_index: int, limits: list[int], known: int | None = None, uniform: bool = True
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(keep, counts)`` of a decision the store lays out (a growing or packed layer), after checking
    it keeps at most ``limits`` tokens per head (one limit per row): the counts are ``known`` when the
    method declared them (and the layer holds one count per head, ``uniform``), else the counts per
    row ``[B, H]``, read back once."""
    if keep.dtype != torch.bool:
        raise TypeError(f"{method}: a keep mask must be boolean, got {keep.dtype}")
    if known is not None and uniform:
        return keep, _declared_count(keep, method, layer_index, min(limits), known, None)
    return keep, _host_counts(keep, method, layer_index, limits)


def check_capacity_keep(
    keep: torch.Tensor | None,
    method: str,
    layer_index: int,
    bound: int,
    shape: tuple[int, ...],
    filled: torch.Tensor | None,
    known: int | None = None,
    fill_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(keep, kept)`` of a decision over a fixed capacity ``shape`` whose first ``filled`` slots hold
    tokens, compacted in place: ``known`` when given (an eager step over a full capacity), else the
    count every head keeps, a 0-d device tensor, checked there to be at most ``bound``; an empty slot
    kept is refused. ``fill_to``: the layer fills up to this budget, so while its tokens fit it every
    filled slot is kept whatever the decision says."""
    _check_shape(keep, method, shape, "a fixed capacity")
    if known is not None:
        return keep, _declared_count(keep, method, layer_index, bound, known, "its fixed_decode_capacity declared")
    empty = torch.arange(shape[-1], device=keep.device) >= filled
    if fill_to is not None:
        keep = torch.where(filled <= fill_to, ~empty, keep & ~empty)
    counts = keep.sum(dim=-1)
    kept = counts.reshape(-1)[0]
    _assert_kept(keep, empty, (counts == kept).all() & (kept <= bound), method, layer_index, bound, "per head")
    return keep, kept


def check_row_keep(
    keep: torch.Tensor | None,
    method: str,
    layer_index: int,
    bound: int,
    shape: tuple[int, ...],
    filled: torch.Tensor,
    fill_to: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keep, kept [B])`` of a decision over stacked rows of different lengths (``filled`` ``[B, 1, 1]``:
    each row's), compacted in place: each row's count, checked on the device to be one for the
    heads of the row and at most ``bound``; an empty slot kept is refused. ``fill_to``: each row
    fills up to this budget, so while a row's tokens fit it every filled slot of the row is kept."""
    _check_shape(keep, method, shape, "rows of different lengths")
    empty = torch.arange(shape[-1], device=keep.device) >= filled
    if fill_to is not None:
        keep = torch.where(filled <= fill_to, ~empty, keep & ~empty)
    counts = keep.sum(dim=-1)
    kept = counts[:, 0]
    within = (counts == kept[:, None]).all() & (kept <= bound).all()
    _assert_kept(keep, empty, within, method, layer_index, bound, "for the heads of a row")
    return keep, kept


def _check_shape(keep: torch.Tensor | None, method: str, shape: tuple[int, ...], over: str) -> None:
    if keep is None or keep.dtype != torch.bool or keep.shape != shape:
        raise TypeError(f"{method}: a decision over {over} must be a boolean mask of shape {tuple(shape)}")


def _declared_count(keep, method: str, layer_index: int, bound: int, known: int, declared: str | None) -> int:
    """``known``, the count the method declared, refused over ``bound`` and checked on the device."""
    if known > bound:
        raise RuntimeError(
            f"{method} declares {known} tokens kept per head in layer {layer_index}, "
            + (f"more than the {bound} {declared}" if declared else f"over its budget of {bound}")
        )
    torch._assert_async(
        (keep.sum(dim=-1) == known).all(),
        f"{method}: the keep mask of layer {layer_index} does not keep the {known} tokens per head "
        "its kept_per_row declared",
    )
    return known


def _assert_kept(keep, empty, within, method: str, layer_index: int, bound: int, heads: str) -> None:
    torch._assert_async(
        within & ~(keep & empty).any(),
        f"{method}: the keep mask of layer {layer_index} keeps an empty slot, different counts {heads}, "
        f"or more than the {bound} tokens its fixed_decode_capacity declared",
    )


def _host_counts(keep: torch.Tensor, method: str, layer_index: int, limits: list[int]) -> torch.Tensor:
    """Kept tokens per row ``[B, H]`` (read back once, on the host); refuses a mask over budget."""
    counts = keep.sum(dim=-1).cpu()
    kept_per_sequence = counts.reshape(counts.shape[0], -1).sum(-1)
    allowed = torch.tensor(limits) * keep.shape[1]
    over = kept_per_sequence > allowed
    if bool(over.any()):
        row = int(over.nonzero()[0])
        raise RuntimeError(
            f"{method} kept {int(kept_per_sequence[row])} tokens per sequence in layer "
            f"{layer_index}, over its budget of {int(allowed[row])}"
        )
    return counts
