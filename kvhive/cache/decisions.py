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
    keep: torch.Tensor | None,
    method: str,
    layer_index: int,
    limits: list[int],
    known: int | None = None,
    *,
    uniform: bool = True,
    shape: tuple[int, ...] | None = None,
    filled: torch.Tensor | None = None,
    fill_to: int | None = None,
    per_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | int]:
    """``(keep, counts)``: the mask the store applies and its kept counts, after checking it keeps at
    most ``limits`` tokens per head (one limit per row; one bound over a capacity).

    * ``shape`` None (the store lays the kept tokens out): the counts are ``known`` when the method
      declared them (and the layer holds one count per head, ``uniform``), else the counts per row
      ``[B, H]``, read back once.
    * ``shape`` given (a decision over a whole capacity whose first ``filled`` slots hold tokens;
      ``per_row``: ``filled`` is ``[B, 1, 1]``, each row's own): ``known`` when given (an eager step
      over a full capacity), else the count every head keeps, a 0-d device tensor (with ``per_row``,
      each row's ``[B]``); an empty slot kept is refused. ``fill_to``: the layer fills up to this
      budget, so while its tokens fit it every filled slot is kept whatever the decision says."""
    if shape is None:
        if keep.dtype != torch.bool:
            raise TypeError(f"{method}: a keep mask must be boolean, got {keep.dtype}")
    elif keep is None or keep.dtype != torch.bool or keep.shape != shape:
        over = "rows of different lengths" if per_row else "a fixed capacity"
        raise TypeError(f"{method}: a decision over {over} must be a boolean mask of shape {tuple(shape)}")
    bound = min(limits)
    if known is not None and (uniform or shape is not None):
        if known > bound:
            declared = "its fixed_decode_capacity declared" if shape is not None else None
            raise RuntimeError(
                f"{method} declares {known} tokens kept per head in layer {layer_index}, "
                + (f"more than the {bound} {declared}" if declared else f"over its budget of {bound}")
            )
        torch._assert_async(
            (keep.sum(dim=-1) == known).all(),
            f"{method}: the keep mask of layer {layer_index} does not keep the {known} tokens per head "
            "its kept_per_row declared",
        )
        return keep, known
    if shape is None:
        return keep, _host_counts(keep, method, layer_index, limits)
    empty = torch.arange(shape[-1], device=keep.device) >= filled
    if fill_to is not None:
        keep = torch.where(filled <= fill_to, ~empty, keep & ~empty)
    counts = keep.sum(dim=-1)
    kept = counts[:, 0] if per_row else counts.reshape(-1)[0]
    same = (counts == kept[:, None]).all() if per_row else (counts == kept).all()
    within = (kept <= bound).all() if per_row else kept <= bound
    heads = "for the heads of a row" if per_row else "per head"
    torch._assert_async(
        same & within & ~(keep & empty).any(),
        f"{method}: the keep mask of layer {layer_index} keeps an empty slot, different counts {heads}, "
        f"or more than the {bound} tokens its fixed_decode_capacity declared",
    )
    return keep, kept


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
