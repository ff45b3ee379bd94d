"""What a method sees of one layer: :class:`ScoringInputs` and its lazily computed statistics.

The attention builds one :class:`ScoringInputs` per compressed layer and forward; a method reads
the keys, values, queries, positions and masks from it and asks it for attention statistics
(accumulated, observation-window, newest-query weights), computed on demand in query chunks and
memoised. :class:`KeyProbes` carries the extra key products a decode decision asks the attention
for; :class:`PrefillScratch` is the one large temporary a cache's prefill reuses across layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

import torch

from kvhive.methods.selection import first_real_tokens, recency, recent_mask

Phase = Literal["prefill", "decode"]
PREFILL: Final[Phase] = "prefill"
DECODE: Final[Phase] = "decode"

# Element count above which attention statistics are computed in query chunks, so that a long
# prompt never materialises a full n x n probability tensor per head. On the CPU a chunk is sized
# to stay in the caches (results/tuning_notes.md, "Scoring chunks").
_CHUNK_ELEMENTS = 1 << 22
# The same bound on a GPU, where a chunk costs its kernel launches rather than cache misses: the
# CPU's bound would split a long prompt's column sums into thousands of chunks of a few rows.
_DEVICE_CHUNK_ELEMENTS = 1 << 27


def chunk_elements(device: torch.device) -> int:
    """Elements of one chunk of attention statistics (query rows x keys x heads x batch) on ``device``."""
    return _DEVICE_CHUNK_ELEMENTS if device.type == "cuda" else _CHUNK_ELEMENTS


class PrefillScratch:
    """Large temporaries one cache's prefill reuses across its layers (and row chunks).

    A method that needs a big work tensor takes it here and gives it back when done: the next
    layer that asks for the same shape gets the same memory back instead of a fresh allocation.
    On the CPU a fresh tensor of that size is memory the kernel maps and zeroes page by page as
    it is first written, a sizeable part of the time of a layer that fills it (BumbleBee's
    similarity matrix). At most one tensor is held, and ``take`` drops a held tensor of
    another shape before allocating, so two are never alive at once. The cache clears it after
    its last compressed layer's prefill and when the model's forward ends: nothing is held past
    the prefill. One per cache (a cache runs one forward at a time), so no state is shared
    between caches or threads.
    """

    def __init__(self) -> None:
        self.held: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised: the caller writes every element)."""
        held, self.held = self.held, None
        if held is not None and held.shape == shape and held.dtype == dtype and held.device == torch.device(device):
            return held
        del held  # freed before the new allocation
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` for the next ``take`` (the caller no longer uses it)."""
        self.held = tensor

    def clear(self) -> None:
        self.held = None

    @property
    def nbytes(self) -> int:
        return 0 if self.held is None else self.held.nbytes


@dataclass
class KeyProbes:
    """Stored keys whose dot products with every stored key a method's decode decision reads
    (SubGen's newcomer and stale candidates, BumbleBee's joiner), asked for before the step's attention
    (:meth:`Policy.decode_key_probes`): the attention takes them as extra rows of the product that
    gives its logits, so the keys are read once a step, not again by the method, and hands the
    products back in :attr:`ScoringInputs.key_probes`.

    ``rows`` ``[B, H, P, d]`` (the keys' dtype); ``context``: the method's own, handed back
    unchanged (what it derived choosing the rows); ``products`` ``[B, H, P, N]`` ``rows · keysᵀ``
    over every stored slot, unscaled, written by the attention (None until then)."""

    rows: torch.Tensor
    context: Any = None
    products: torch.Tensor | None = None


class AttentionStatistics:
    """The softmax attention of ``queries`` over stored ``keys`` that scoring reads, computed in
    chunks of query rows and memoised: weights of selected rows, column sums, and the output with
    the column sums from one pass. The base of the classes that hold those tensors (the attributes
    ``keys``, ``values``, ``queries``, ``positions``, ``mask``, ``scaling``, ``sequence_length``,
    ``phase`` and the memo ``_memo``): :class:`ScoringInputs`, and :class:`AttentionOperands` for an
    attention that has no scoring of its own."""

    def once(self, key: Any, compute: Callable[[], Any]) -> Any:
        """``compute()``, computed at the first call with ``key`` for these inputs (one forward of a
        layer) and returned again after: a method whose hooks of one step (``observe_decode``, then
        ``select_decode``) need the same tensor computes it once."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def token_shape(self) -> torch.Size:
        """``(B, H, N)``: rows, stored heads and stored tokens (one read for all three)."""
        return self.keys.shape[:3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]

    @property
    def num_queries(self) -> int:
        return self.queries.shape[2]

    @property
    def group_size(self) -> int:
        """Query heads per stored head."""
        return self.queries.shape[1] // self.keys.shape[1]

    def mask_rows(self, query_rows: slice, num_keys: int | None = None) -> torch.Tensor:
        """Boolean mask ``[B, 1|H, rows, K]`` of the selected query rows over the first ``num_keys``
        stored tokens. Without a model mask (no padding) it is causal over original positions,
        built only for the rows asked for (a long prompt never materialises ``n x n``)."""
        num_keys = self.num_tokens if num_keys is None else num_keys
        if self.mask is not None:
            return self.mask[:, :, query_rows, :num_keys]
        start, stop, _ = query_rows.indices(self.num_queries)
        # sequence_length may be a device counter (a compiled decode step): positions as tensor work.
        first = self.sequence_length - self.num_queries + start
        query_positions = torch.arange(stop - start, device=self.positions.device) + first
        return self.positions[..., :num_keys][:, :, None, :] <= query_positions[None, None, :, None]

    def attention_weights(
        self,
        query_rows: slice,
        logit_multiplier: float | tuple[float, ...] = 1.0,
        num_keys: int | None = None,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Softmax weights ``[B, Hq, rows, K]`` (float32) of the selected query rows over the first
        ``num_keys`` stored tokens (default all), the model's mask applied.

        The one place that computes softmax attention for scoring. The product runs in the
        model's dtype (fp32 accumulation on every backend) except in float16, whose logits
        overflow past 65504 where the model's own attention (sdpa, fp32 accumulation inside) stays
        finite: there queries and keys are multiplied in float32. Softmax and
        everything after it run in float32. Keys are read once per stored head (GQA without
        repeating them). ``scratch``: a flat tensor of the keys' dtype, at least rows x K per query
        head, that the product is written into (a caller looping over chunks of rows reuses one
        allocation; the weights returned may then be a view of it)."""
        num_keys = self.num_tokens if num_keys is None else num_keys
        # The scale goes on the queries (rows x d), not on the logits (rows x K): one pass fewer.
        factor = _row_factor(logit_multiplier, self.queries.device, 3)
        if isinstance(factor, torch.Tensor):
            factor = (factor * self.scaling).to(self.queries.dtype)
        else:
            factor = self.scaling * factor
        queries = self.queries[:, :, query_rows] * factor
        keys = self._product_keys()[:, :, :num_keys]
        b, hq, rows, d = queries.shape
        h = self.num_heads
        group = hq // h
        # [B, H, G*rows, d] @ [B, H, d, K]: keys are read once per stored head.
        grouped = queries.reshape(b, h, group, rows, d).reshape(b, h, group * rows, d).to(keys.dtype)
        if scratch is not None:
            product = scratch[: b * h * group * rows * num_keys].view(b, h, group * rows, num_keys)
            torch.matmul(grouped, keys.transpose(-1, -2), out=product)
        else:
            product = torch.matmul(grouped, keys.transpose(-1, -2))
        logits = product.view(b, h, group, rows, num_keys).float()
        start, stop, _ = query_rows.indices(self.num_queries)
        first_future = self.num_tokens - self.num_queries + start + 1
        if self.mask is None and self.phase == "prefill" and first_future > 0 and num_keys == first_future + rows - 1:
            # Causal prefill rows over exactly the keys they may see (summed_attention's chunks):
            # only the square block of the chunk's own tokens has a future to mask.
            future = torch.ones(rows, rows, dtype=torch.bool, device=logits.device).triu_(1)
            logits[..., first_future - 1 :].masked_fill_(future, float("-inf"))
            return _softmax_of_fresh_logits(logits).reshape(b, hq, rows, num_keys)
        return self._masked_softmax(logits, query_rows, num_keys)

    def _masked_softmax(self, logits: torch.Tensor, query_rows: slice, num_keys: int) -> torch.Tensor:
        """Softmax ``[B, Hq, rows, K]`` of fresh float32 logits ``[B, H, G, rows, K]`` (overwritten)
        of the selected query rows, the model's mask applied."""
        b, h, group, rows, _ = logits.shape
        mask = self.mask_rows(query_rows, num_keys).unsqueeze(2)
        logits.masked_fill_(~mask, float("-inf"))  # in place: the product is a fresh tensor
        weights = _softmax_of_fresh_logits(logits)
        if self.mask is not None:
            # A padding query may see no key at all: its softmax row is NaN and carries no
            # evidence, so it becomes 0 (a NaN from the model itself stays NaN).
            weights = torch.where(mask.any(dim=-1, keepdim=True), weights, 0.0)
        return weights.reshape(b, h * group, rows, num_keys)

    def _product_keys(self) -> torch.Tensor:
        """The keys the scoring product reads: float32 copies for a float16 model (made once)."""
        if self.keys.dtype != torch.float16:
            return self.keys
        return self.once("float32_keys", self.keys.float)

    def summed_attention(self, first_row: int, logit_multiplier: float | tuple[float, ...] = 1.0) -> torch.Tensor:
        """Column sums ``[B, Hq, N]`` (float32) of the weights of query rows ``first_row..q-1``,
        chunked."""
        key = ("summed", first_row, logit_multiplier)
        return self.once(key, lambda: self._chunked_attention(first_row, logit_multiplier)[0])

    def attention_with_column_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention output ``[B, Hq, q, dv]`` (the values' dtype) and the column sums
        ``[B, Hq, N]`` (float32) of every query's weights, in one pass over query chunks.

        Each chunk's rows see every key they may attend, so their softmax is exact: the output
        rows are ``P V`` (weights cast to the values' dtype, the product accumulating in fp32, as
        sdpa's kernels do) and the column sums add ``P`` over the rows, from the same
        :meth:`attention_weights` as :meth:`summed_attention` (bit for bit the same sums). The
        sums are memoised as :meth:`accumulated_attention`'s. A fully masked query row (left
        padding) gets weights 0, hence an output of 0."""
        total, output = self._chunked_attention(0, 1.0, with_output=True)
        self._memo[("summed", 0, 1.0)] = total
        return output, total

    def _chunked_attention(
        self, first_row: int, logit_multiplier: float | tuple[float, ...], with_output: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, hq, q, _ = self.queries.shape
        rows_per_chunk = max(1, chunk_elements(self.keys.device) // max(1, b * hq * self.num_tokens))
        total = torch.zeros(b, hq, self.num_tokens, dtype=torch.float32, device=self.keys.device)
        output = None
        if with_output:
            values = self.values
            h, dv = values.shape[1], values.shape[-1]
            output = torch.empty(b, h, hq // h, q, dv, dtype=values.dtype, device=values.device)
        # In prefill the queries are the newest q stored tokens (appended last, oldest first), so query row r cannot see keys past ``offset + r``: each chunk only multiplies
        # against the keys it may see. Known from the shapes alone (no host read).
        offset = self.num_tokens - q
        causal = self.phase == "prefill" and offset >= 0
        # One allocation for every chunk's logits: a fresh one per chunk fragments the CPU heap,
        # which then keeps more memory resident than is live.
        # (Not under autograd: a product written into a buffer cannot be differentiated, and a
        # model run with gradients on, e.g. a training loop's forward, would fail.)
        scratch_rows = min(rows_per_chunk, q - first_row)
        tracked = torch.is_grad_enabled() and (self.queries.requires_grad or self.keys.requires_grad)
        scratch = (
            None
            if tracked
            else torch.empty(
                b * hq * scratch_rows * self.num_tokens, dtype=self._product_keys().dtype, device=self.keys.device
            )
        )
        for start in range(first_row, q, rows_per_chunk):
            stop = min(q, start + rows_per_chunk)
            visible = offset + stop if causal else self.num_tokens
            weights = self.attention_weights(slice(start, stop), logit_multiplier, num_keys=visible, scratch=scratch)
            total[..., :visible] += weights.sum(dim=2)
            if output is not None:
                # [B, H, G*rows, K] @ [B, H, K, dv]: values read once per stored head.
                rows = stop - start
                grouped = weights.reshape(b, h, (hq // h) * rows, visible).to(values.dtype)
                product = torch.matmul(grouped, values[:, :, :visible])
                output[:, :, :, start:stop] = product.view(b, h, hq // h, rows, dv)
        if output is not None:
            output = output.view(b, hq, q, -1)
        return total, output


@dataclass
class ScoringInputs(AttentionStatistics):
    """What a policy may look at for one layer when it decides what to keep.

    Tensors: ``keys``/``values`` ``[B, H, N, d]`` (stored heads, after RoPE), ``queries``
    ``[B, Hq, q, d]`` (the queries of this forward pass, after RoPE), ``positions`` ``[B, H, N]``
    original token positions, ``mask`` ``[B, 1|H, q, N]`` boolean (True = the query may attend the
    key; the model's causal, padding and sliding-window mask) and ``valid`` ``[B, H, N]`` (False for
    padding). Statistics are computed lazily and memoised (:class:`AttentionStatistics`).
    """

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None  # None: causal over original positions, no padding, no window in reach
    scaling: float
    layer_index: int
    num_layers: int
    sequence_length: int
    phase: Phase
    token_scores: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    last_query_weights: torch.Tensor | None = None
    # The one new query's logits [B, H, G, 1, N] (float32, the model's ``scaling`` applied, no
    # mask; query head ``h * G + g`` at ``[:, h, g]``, the layout of the grouped product), from the
    # attention that computed ``last_query_weights`` with them: a method that scores the new query
    # with other logits (AhaKV's multiplied ones) rescales these instead of reading every stored
    # key a second time. None: computed here from the queries and keys.
    last_query_logits: torch.Tensor | None = None
    # Column sums [B, Hq, N] (float32) of every query's weights, computed by the attention in the
    # pass that produced its output (a policy with ``prefill_column_sums``); None: computed here.
    accumulated_weights: torch.Tensor | None = None
    # A layer held in a fixed decode capacity (``Policy.fixed_decode_capacity``): the tensors cover
    # every slot of the capacity, the first ``filled`` (a 0-d int64 device tensor, the same for
    # every row and head; ``[B, 1, 1]``, each row's own count, for stacked rows of different lengths
    # in a method that ``decodes_rows_of_different_lengths``) hold the stored tokens oldest first,
    # the rest are empty (masked out of ``mask``, so never ``valid``). None: every slot holds a token.
    filled: torch.Tensor | None = None
    # ``filled`` as a host int where the host knows it without asking the device (an eager step after
    # eager steps whose method declared what it keeps); None otherwise (always in a compiled step).
    # ``known_filled == num_tokens``: every slot holds a token, nothing is empty.
    known_filled: int | None = None
    # Whether the stored order is the order of original positions (oldest first). A decode step
    # that evicts one token may write the newest into the freed slot instead of moving every later
    # token down (``Policy.reads_stored_order`` False): from then on, recency is read from
    # ``positions`` (:meth:`recent_tokens`, :meth:`recency_scores`, :meth:`first_real`).
    stored_in_order: bool = True
    # The cache's buffers reused across the layers of one prefill (:class:`PrefillScratch`); None
    # outside a prefill's scoring.
    scratch: PrefillScratch | None = None
    # The key probes the method asked for before this decode step's attention, their products
    # written by it (:class:`KeyProbes`); None: none asked for, or an attention that took none.
    key_probes: KeyProbes | None = None
    _memo: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def valid(self) -> torch.Tensor:
        """``[B, H, N]``: the key is a real token for the newest query (not padding)."""

        def compute() -> torch.Tensor:
            if self.mask is None:
                last_row = torch.ones(1, 1, self.num_tokens, dtype=torch.bool, device=self.keys.device)
            else:
                last_row = self.mask[:, :, -1, :]
            return last_row.expand(self.batch_size, self.num_heads, self.num_tokens)

        return self.once("valid", compute)

    def recent_tokens(self, window: int) -> torch.Tensor:
        """``[B, H, N]`` True on the ``window`` most recent stored tokens (:func:`recent_mask`), by
        original position when the stored order is not theirs: the tokens within ``window`` of the
        newest position. The same tokens as long as the method keeps its ``window`` newest tokens
        (a protected recent window), which is what the methods that read it do."""
        if self.stored_in_order:
            return recent_mask(self.num_tokens, window, self.valid)
        real = self.positions if self.mask is None else self.positions.masked_fill(~self.valid, -1)
        newest = real.amax(dim=-1, keepdim=True)
        return self.positions > newest - window

    def recency_scores(self) -> torch.Tensor:
        """Scores ``[B, H, N]`` that rank newer tokens higher (:func:`recency`; the positions when the
        stored order is not theirs: the same ranking)."""
        if self.stored_in_order:
            return recency(self.valid)
        return self.positions.float().expand(self.batch_size, self.num_heads, self.num_tokens)

    def first_real(self, count: int) -> torch.Tensor:
        """``[B, H, N]`` True on the first ``count`` real tokens of each row (:func:`first_real_tokens`),
        by position when the stored order is not theirs (a method keeping them as sinks keeps the
        first real position, so the sinks are the ``count`` positions from it)."""
        valid = self.valid
        if self.stored_in_order:
            return first_real_tokens(valid, count)
        first = self.positions.masked_fill(~valid, torch.iinfo(self.positions.dtype).max).amin(dim=-1, keepdim=True)
        return valid & (self.positions < first + count)

    def to_kv_heads(self, per_query_head: torch.Tensor) -> torch.Tensor:
        """Mean over the query heads of each group: ``[B, Hq, ...] -> [B, H, ...]`` (docs/METHODS.md)."""
        b, hq = per_query_head.shape[:2]
        grouped = per_query_head.reshape(b, self.num_heads, hq // self.num_heads, *per_query_head.shape[2:])
        return grouped.mean(dim=2)

    def observation_attention(self, window: int) -> torch.Tensor:
        """Weights ``[B, Hq, w, N]`` of the last ``window`` queries (SnapKV's observation window)."""
        start = max(0, self.num_queries - window)
        return self.attention_weights(slice(start, self.num_queries))

    def accumulated_attention(self) -> torch.Tensor:
        """H2O's accumulated attention ``[B, Hq, N]``: column sums over all current queries (the
        attention's own when it computed them with its output, ``accumulated_weights``)."""
        if self.accumulated_weights is not None:
            return self.accumulated_weights
        return self.summed_attention(0)

    def recent_accumulated_attention(
        self, rows: int, logit_multiplier: float | tuple[float, ...] = 1.0
    ) -> torch.Tensor:
        """Column sums over the last ``rows`` queries, logits multiplied (AhaKV, Eq. 5 and 12) by
        one factor or one per batch row."""
        return self.summed_attention(max(0, self.num_queries - rows), logit_multiplier)

    def last_query_attention(self, logit_multiplier: float | tuple[float, ...] | torch.Tensor = 1.0) -> torch.Tensor:
        """Weights ``[B, Hq, N]`` of the newest query (TOVA; decode-phase accumulation), its logits
        multiplied by ``logit_multiplier`` (AhaKV, Eq. 12: one factor, or one per batch row), from the
        attention's own weights or logits where it gave them (``last_query_logits``)."""
        unscaled = isinstance(logit_multiplier, (int, float)) and logit_multiplier == 1.0
        if unscaled and self.last_query_weights is not None:
            return self.last_query_weights
        last_row = slice(self.num_queries - 1, self.num_queries)
        if unscaled:
            return self.once("last", lambda: self.attention_weights(last_row)[:, :, 0])
        if self.last_query_logits is None:
            return self.attention_weights(last_row, logit_multiplier)[:, :, 0]
        factor = _row_factor(logit_multiplier, self.queries.device, 4)
        logits = self.last_query_logits * factor  # fresh: the softmax may overwrite it
        b, h, group, _, n = logits.shape
        if self.mask is None:
            # The attention masked nothing (every stored key precedes the new query): neither does its softmax.
            return _softmax_of_fresh_logits(logits).view(b, h * group, n)
        return self._masked_softmax(logits, last_row, n)[:, :, 0]


@dataclass
class AttentionOperands(AttentionStatistics):
    """The tensors of one softmax attention over stored tokens, for an attention that computes its
    output the way scoring computes its weights (:func:`attention_with_column_sums`). The fields
    mean what :class:`ScoringInputs`' fields of the same names mean."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    scaling: float
    sequence_length: int
    phase: Phase
    _memo: dict[Any, torch.Tensor] = dataclasses.field(default_factory=dict, repr=False)


def attention_with_column_sums(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    sequence_length: int,
    phase: Phase,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [B, Hq, q, dv] in the values' dtype, column sums [B, Hq, N] float32)`` of the
    queries' softmax attention over the stored tokens, from one pass over query chunks: bit for bit
    what a :class:`ScoringInputs` of these tensors in ``phase`` computes
    (:meth:`AttentionStatistics.attention_with_column_sums`)."""
    operands = AttentionOperands(keys, values, queries, positions, mask, scaling, sequence_length, phase)
    return operands.attention_with_column_sums()


def _row_factor(
    logit_multiplier: float | tuple[float, ...] | torch.Tensor, device: torch.device, trailing_dims: int
) -> float | torch.Tensor:
    """A logit multiplier as a float, or as float32 factors (one, or one per batch row: AhaKV's n
    is per row) shaped to broadcast over ``trailing_dims`` dimensions after the batch."""
    if isinstance(logit_multiplier, tuple):
        logit_multiplier = torch.tensor(logit_multiplier, dtype=torch.float32, device=device)
    if not isinstance(logit_multiplier, torch.Tensor):
        return logit_multiplier
    factor = logit_multiplier.to(torch.float32)
    return factor.view(-1, *([1] * trailing_dims)) if factor.dim() else factor


def _softmax_of_fresh_logits(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dimension of logits no one else holds. On CPU it overwrites them (the
    same kernel, bit for bit torch.softmax): a chunk of scoring rows then holds one rows x keys
    float32 tensor instead of two. Elsewhere, while
    compiling and under autograd, torch.softmax."""
    in_place = logits.device.type == "cpu" and logits.is_contiguous() and not logits.requires_grad
    if in_place and not torch.compiler.is_compiling():
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return torch.softmax(logits, dim=-1)


def causal_mask(key_positions: torch.Tensor, first_query: int, stop_query: int) -> torch.Tensor:
    """``[B, H, q, K]``: query at position ``p`` in ``[first_query, stop_query)`` may attend the
    stored key at original position ``key_positions[b, h, k]`` iff it is not in the future."""
    query_positions = torch.arange(first_query, stop_query, device=key_positions.device)
    return key_positions[:, :, None, :] <= query_positions[None, None, :, None]
