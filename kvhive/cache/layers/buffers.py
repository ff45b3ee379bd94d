"""The buffers a layer's tokens live in, and the small helpers every layout uses.

A token is four entries kept side by side: its key, its value, its original position and its
per-token scores (one float32 buffer per score name a method stores). :class:`TokenBuffers` holds
the four and moves them together, so no layout copies one and forgets another. The dense layouts
lay them out ``[B, H, capacity, ...]``; the packed layout flat ``[capacity, ...]``.
"""

from __future__ import annotations

import torch

POSITION_DTYPE = torch.int32
# Append reserve: a buffer re-allocated for ``n`` tokens gets room for ``reserve(n)`` more, so
# appends are amortised O(new tokens) while the over-allocation stays a small fraction.
MIN_RESERVE_TOKENS = 64
RESERVE_FRACTION = 16  # reserve n // 16 tokens on top of n
SEGMENT_RESERVE_TOKENS = 32  # per packed segment (at least; rounded up to whole pages)
# Packed segments are whole pages: every capacity is a multiple of PAGE_TOKENS and segments tile
# the buffer in order, so attention reads the buffer as [pages, PAGE_TOKENS, d] without a copy.
# At most one partly filled page per segment beyond the reserve (reported by reserved_nbytes).
PAGE_TOKENS = 64

# The per-token score the cache itself reads for every stored token, the newest included: the flag
# (1.0) of a padded prompt's left padding, which a static decode step's attention masks by. A new
# token's entry is reset (0: real) and moves with its token into a freed slot whatever its method
# reads (LayerStore.new_token_scores_read).
PADDING_SCORE = "_padding"


def reserve(tokens: int) -> int:
    return max(MIN_RESERVE_TOKENS, tokens // RESERVE_FRACTION)


def row_index(indices, batch: int) -> torch.Tensor:
    """Batch rows as a 1-D long tensor on the host: ``indices`` may be a boolean mask over the
    batch, a tensor of row numbers, or a list (transformers passes either)."""
    index = torch.as_tensor(indices).detach().to("cpu")
    if index.dtype == torch.bool:
        if index.shape != (batch,):
            raise IndexError(f"a boolean row mask must have {batch} entries, got shape {tuple(index.shape)}")
        return index.nonzero().reshape(-1)
    return index.to(torch.long).reshape(-1)


def first_false(mask: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """The index of the first False along the last dimension of a boolean ``mask`` (the last index
    where there is none: a one-token move from the last slot onto itself, a no-op).

    Not ``mask.to(torch.int8).argmin(-1)``: Inductor's CPU code gets an argmin over 8-bit integers
    wrong once the row is long enough to vectorise (16 or more; it answers 0 for rows whose first
    False is later), which moved the newest token into slot 0 in a compiled step. A min over the
    slot indices has no ties to break."""
    last = mask.shape[-1] - 1
    slots = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask, last, slots).amin(dim=-1, keepdim=keepdim)


def true_indices(mask: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The indices of ``mask``'s True entries (``[N]`` bool), in order, their number being the sum of
    the host tensor ``counts``: a stable sort puts them first, so the device's result has a size the
    host knows (boolean-mask indexing waits for the device to count them: a synchronisation)."""
    total = int(counts.sum())
    return torch.sort((~mask).to(torch.uint8), stable=True).indices[:total]


def to_device_at_once(device, *host_tensors: torch.Tensor) -> list[torch.Tensor]:
    """Host int64 tensors moved to ``device`` in one host-to-device copy (not one each), as tensors of
    their own (each owns its storage: buffers updated in place keep to themselves)."""
    if not host_tensors:
        return []
    moved = torch.cat([tensor.reshape(-1).long() for tensor in host_tensors]).to(device)
    pieces = moved.split([tensor.numel() for tensor in host_tensors])
    return [piece.view(tensor.shape).clone() for piece, tensor in zip(pieces, host_tensors, strict=True)]


def mark_static(buffer: torch.Tensor) -> torch.Tensor:
    """Mark a buffer's address as fixed, as transformers' StaticLayer does: a compiled decode step
    then reads and writes it in place (an unmarked buffer mutated in place makes CUDA graphs skip
    the step, or be copied in at every replay). The buffers a decode step uses are the ones
    allocated after the prefill; they keep their address while the budget is kept."""
    torch._dynamo.mark_static_address(buffer)
    return buffer


def new_score_buffer(shape: tuple[int, ...], device) -> torch.Tensor:
    """A new per-token score buffer. Only the slots a caller copies tokens' scores into are defined:
    no decision may read the rest (zeros here, so that a read of them would at least repeat; the
    unset-scores test fills them with NaN and requires every output unchanged)."""
    return torch.zeros(shape, dtype=torch.float32, device=device)


class TokenBuffers:
    """A layer's keys, values, positions and per-token scores (``scores``: name -> float32 buffer),
    one entry per slot in each. Dense: ``[B, H, C, d]``, ``[B, H, C]``; packed: ``[C, d]``, ``[C]``."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.keys = keys
        self.values = values
        self.positions = positions
        self.scores = {} if scores is None else scores

    @classmethod
    def dense(
        cls, like_keys: torch.Tensor, like_values: torch.Tensor, batch: int, heads: int, capacity: int, score_names=()
    ) -> TokenBuffers:
        """New dense buffers of ``capacity`` slots per row (uninitialised keys, values and positions;
        score buffers from :func:`new_score_buffer`), with the dtype, device and head sizes of
        ``like_keys`` / ``like_values``; every address fixed."""
        device = like_keys.device
        keys = torch.empty(batch, heads, capacity, like_keys.shape[-1], dtype=like_keys.dtype, device=device)
        values = torch.empty(batch, heads, capacity, like_values.shape[-1], dtype=like_values.dtype, device=device)
        positions = torch.empty(batch, heads, capacity, dtype=POSITION_DTYPE, device=device)
        scores = {name: mark_static(new_score_buffer(keys.shape[:3], device)) for name in score_names}
        return cls(mark_static(keys), mark_static(values), mark_static(positions), scores)

    @classmethod
    def zeros_like_rows(cls, like: TokenBuffers, capacity: int) -> TokenBuffers:
        """New dense buffers as ``like``'s, of ``capacity`` slots per row, every slot zero (empty slots
        of a layer of rows of different lengths are attended with weight 0: never uninitialised)."""
        made = cls.dense(like.keys, like.values, like.keys.shape[0], like.keys.shape[1], capacity)
        for buffer in made.tensors():
            buffer.zero_()
        made.scores = {name: made.zero_scores() for name in like.scores}
        return made

    def new_score(self) -> torch.Tensor:
        """A new dense score buffer of these buffers' shape (:func:`new_score_buffer`), its address fixed."""
        return mark_static(new_score_buffer(self.keys.shape[:3], self.keys.device))

    def zero_scores(self) -> torch.Tensor:
        """A zeroed dense score buffer of these buffers' shape, its address fixed."""
        return mark_static(torch.zeros(self.keys.shape[:3], dtype=torch.float32, device=self.keys.device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every buffer: keys, values, positions, then each score."""
        return (self.keys, self.values, self.positions, *self.scores.values())

    def window(self, start: int, stop: int):
        """``(keys, values, positions, scores)``: dense views of slots ``[start, stop)`` (no copy)."""
        span = slice(start, stop)
        return (
            self.keys[:, :, span],
            self.values[:, :, span],
            self.positions[:, :, span],
            {name: buffer[:, :, span] for name, buffer in self.scores.items()},
        )

    def flat(self):
        """``(keys [N, d], values [N, dv], positions [N], scores {name: [N]})``: every slot of every row,
        as flat views (slot ``j`` of segment ``s`` of a dense layout is row ``s * C + j``)."""
        return (
            self.keys.view(-1, self.keys.shape[-1]),
            self.values.view(-1, self.values.shape[-1]),
            self.positions.view(-1),
            {name: buffer.view(-1) for name, buffer in self.scores.items()},
        )

    def reset_score_names(self, read_all: bool) -> list[str]:
        """The per-token scores whose entry a new token resets to 0 when it is appended, and that move
        with the newest token into a freed slot: every score where the method reads a new token's
        before writing them (``read_all``), else only the cache's own (``PADDING_SCORE``: the
        attention reads it for the newest token too). The slot of a score left out holds whatever was
        there (a dropped token's entry, or a new buffer's unset slot)."""
        return [name for name in self.scores if read_all or name == PADDING_SCORE]

    def move_rows(
        self, destination_rows: torch.Tensor, source_rows: torch.Tensor, score_names: list[str] | None = None
    ) -> None:
        """Copy flat row ``source_rows[s]`` to row ``destination_rows[s]``: keys, values, position and
        the per-token scores (those of ``score_names`` where given)."""
        scores = self.scores.values() if score_names is None else [self.scores[name] for name in score_names]
        keys, values = self.keys.view(-1, self.keys.shape[-1]), self.values.view(-1, self.values.shape[-1])
        for buffer in (keys, values, self.positions.view(-1), *(score.view(-1) for score in scores)):
            buffer.index_copy_(0, destination_rows, buffer.index_select(0, source_rows))

    def gather_in_place(self, rows: torch.Tensor) -> None:
        """Every flat buffer takes its rows ``rows`` (one per slot, in order): a compaction that keeps
        every address."""
        flat = self.flat()
        buffers = (*flat[:3], *flat[3].values())
        gathered = [buffer.index_select(0, rows) for buffer in buffers]
        for buffer, moved in zip(buffers, gathered, strict=True):
            buffer.copy_(moved)

    def copy_front(self, source, length: int) -> None:
        """Dense: slots ``[0, length)`` of every row take ``source`` (``(keys, values, positions,
        scores)`` as :meth:`window` gives them, ``length`` slots each)."""
        keys, values, positions, scores = source
        self.keys[:, :, :length].copy_(keys)
        self.values[:, :, :length].copy_(values)
        self.positions[:, :, :length].copy_(positions)
        for name, score in scores.items():
            self.scores[name][:, :, :length].copy_(score)

    def zero_from(self, start: int) -> None:
        """Dense: zero slots ``[start, C)`` of every buffer (empty slots are attended with weight 0,
        and 0 x uninitialised memory can be NaN)."""
        for buffer in self.tensors():
            buffer[:, :, start:].zero_()

    def select_rows(self, device_index: torch.Tensor) -> TokenBuffers:
        """New buffers of batch rows ``device_index`` (dense), every address fixed."""
        return TokenBuffers(
            mark_static(self.keys.index_select(0, device_index)),
            mark_static(self.values.index_select(0, device_index)),
            mark_static(self.positions.index_select(0, device_index)),
            {name: mark_static(buffer.index_select(0, device_index)) for name, buffer in self.scores.items()},
        )

    def write_row(self, row: int, span: slice, keys, values, positions, scores: dict) -> None:
        """Dense: slots ``span`` of batch row ``row`` take one row's tokens (``[1, H, L, ...]``); every
        score of the row is zeroed first (a score the row does not bring is unset), a score only the
        row brings gets a buffer."""
        for buffer, source in ((self.keys, keys), (self.values, values), (self.positions, positions)):
            buffer[row, :, span].copy_(source[0])
        for name in scores.keys() - self.scores.keys():
            self.scores[name] = self.zero_scores()
        for name, buffer in self.scores.items():
            buffer[row].zero_()
            if name in scores:
                buffer[row, :, span].copy_(scores[name][0])

    def reserved_nbytes(self) -> int:
        """Bytes of the allocated key and value buffers."""
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    def bytes_per_token(self) -> int:
        """Key + value bytes of one token in one stored head."""
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    def metadata_bytes_per_token(self) -> int:
        """Bytes of one token's position and per-token scores."""
        return self.positions.element_size() + 4 * len(self.scores)
