"""The contract between a compression method and the cache.

A method is a :class:`Policy` subclass with a frozen dataclass config holding its paper's
defaults. It sees plain tensors through :class:`ScoringInputs` and answers with boolean keep
masks; it never sees a model class, and the cache never sees which method runs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal, get_args

import torch

Phase = Literal["prefill", "decode"]
PREFILL: Final[Phase] = "prefill"
DECODE: Final[Phase] = "decode"

HeadGranularity = Literal["kv", "query", "auto"]
"""Stored entry per KV head (``"kv"``), per query head (``"query"``: each query head keeps its own
copy of its group's keys/values), or ``"auto"``: per query head on a model with one KV head (where
per-KV-head allocation has nothing to allocate across), per KV head otherwise."""
KV_HEADS: Final[HeadGranularity] = "kv"
QUERY_HEADS: Final[HeadGranularity] = "query"
AUTO_HEADS: Final[HeadGranularity] = "auto"


def require_choice(value: Any, parameter: str, options: Any) -> None:
    """Raise a ValueError naming ``parameter`` unless ``value`` is one of the ``Literal`` ``options``."""
    accepted = get_args(options)
    require(value in accepted, parameter, " or ".join(repr(option) for option in accepted), value)


# Element count above which attention statistics are computed in query chunks, so that a long
# prompt never materialises a full n x n probability tensor per head. 2**22 float32 (16 MiB): on
# CPU the prefill pass with column sums (kv-heavy shape, 4k prompt: 64-row chunks) ran 1.15x
# flash sdpa's time, against 1.5x with 2**24 (chunks past the caches) and 1.2x with 2**21.
_CHUNK_ELEMENTS = 1 << 22
# The same bound on a GPU (512 MiB of float32 logits a chunk), where a chunk costs its ~10 kernel
# launches rather than cache misses: the CPU's bound split a 32k prompt's column sums (32 query heads,
# a padded batch, which the column-sum kernel's flash path does not take) into 8,192 chunks of 4 rows.
_DEVICE_CHUNK_ELEMENTS = 1 << 27


def chunk_elements(device: torch.device) -> int:
    """Elements of one chunk of attention statistics (query rows x keys x heads x batch) on ``device``."""
    return _DEVICE_CHUNK_ELEMENTS if device.type == "cuda" else _CHUNK_ELEMENTS


@dataclass(frozen=True)
class PolicyConfig:
    """Base of every method config. Subclasses add fields with their paper's defaults."""

    def validate(self) -> None:
        """Raise ValueError naming the parameter when a value is out of range."""


def require(condition: bool, parameter: str, accepted: str, value: Any) -> None:
    """Raise a ValueError naming ``parameter`` and the accepted values unless ``condition``."""
    if not condition:
        raise ValueError(f"invalid {parameter}={value!r}: expected {accepted}")


def require_int_at_least(value: Any, minimum: int, parameter: str) -> None:
    require(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        parameter,
        f"an integer >= {minimum}",
        value,
    )


SEED_LIMIT = 2**63


def require_seed(value: Any, parameter: str = "seed") -> None:
    """A seed is an integer in [0, 2**63): what every derived generator seed below stays within."""
    require(
        isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEED_LIMIT,
        parameter,
        "an integer in [0, 2**63)",
        value,
    )


def derived_seed(seed: int, layer_index: int, head: int | None = None) -> int:
    """The generator seed of one layer (and head): distinct for every (seed, layer, head) of a real
    model, in [0, 2**63) whatever the user's seed (torch.Generator.manual_seed overflows above 2**64)."""
    derived = seed * 1_000_003 + layer_index
    if head is not None:
        derived = derived * 1_009 + head
    return derived % SEED_LIMIT


def require_probability(value: Any, parameter: str, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    ok = ok and (0.0 < value <= 1.0 if low_open else 0.0 <= value <= 1.0)
    require(ok, parameter, "a number in (0, 1]" if low_open else "a number in [0, 1]", value)


class PrefillScratch:
    """Large temporaries one cache's prefill reuses across its layers (and row chunks).

    A method that needs a big work tensor takes it here and gives it back when done: the next
    layer that asks for the same shape gets the same memory back instead of a fresh allocation.
    On the CPU a fresh tensor of that size is memory the kernel maps and zeroes page by page as
    it is first written (BumbleBee's similarity matrix of a kv-heavy layer at 4k, 484 MB: 0.2 s
    of page faults of its 0.6 s). At most one tensor is held, and ``take`` drops a held tensor of
    another shape before allocating, so two are never alive at once. The cache clears it after
    its last compressed layer's prefill and when the model's forward ends: nothing is held past
    the prefill. One per cache (a cache runs one forward at a time), so no state is shared
    between caches or threads.
    """

    def __init__(self) -> None:
        self._held: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A tensor of ``shape`` (uninitialised: the caller writes every element)."""
        held, self._held = self._held, None
        if held is not None and held.shape == shape and held.dtype == dtype and held.device == torch.device(device):
            return held
        del held  # freed before the new allocation
        return torch.empty(shape, dtype=dtype, device=device)

    def give(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` for the next ``take`` (the caller no longer uses it)."""
        self._held = tensor

    def clear(self) -> None:
        self._held = None

    @property
    def nbytes(self) -> int:
        return 0 if self._held is None else self._held.nbytes


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
        finite (issue 27 item 5): there queries and keys are multiplied in float32. Softmax and
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
        # In prefill the queries are the newest q stored tokens (they were just appended, oldest
        # first), so query row r cannot see keys past ``offset + r``: each chunk only multiplies
        # against the keys it may see. Known from the shapes alone (no host read).
        offset = self.num_tokens - q
        causal = self.phase == "prefill" and offset >= 0
        # One allocation for every chunk's logits: a fresh one per chunk (16 MB at 71 rows x 3,700
        # keys x 16 heads) fragmented the CPU heap, which kept ~70 MB more resident than was live.
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
        multiplied by ``logit_multiplier`` (AhaKV, Eq. 12: one factor, or one per batch row).

        With a multiplier and the attention's own logits (``last_query_logits``) the weights are
        the softmax of those logits times the factor: the keys are not read again (the step's
        largest cost after the model's own matmuls: one more pass over every stored key)."""
        last_row = slice(self.num_queries - 1, self.num_queries)
        if isinstance(logit_multiplier, (int, float)) and logit_multiplier == 1.0:
            if self.last_query_weights is not None:
                return self.last_query_weights
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
    float32 tensor instead of two (16 MB less at 71 rows x 3,700 keys x 16 heads). Elsewhere, while
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
    """``[..., 1]``: the index of the token :func:`keep_top_scores` drops when it keeps all but one:
    the lowest-ranked one and, among equal ranks, the oldest (what the stable sort of more drops
    would leave out): the first minimum (``argmin``) when tokens are stored oldest first, else the
    smallest of ``positions`` among the minima. No sort over the stored tokens."""
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


class Policy:
    """A KV-cache compression method. Subclasses set ``name``, ``phases`` and ``config_class``."""

    name: ClassVar[str] = ""
    phases: ClassVar[frozenset[str]] = frozenset()
    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig
    paper: ClassVar[str] = ""
    head_granularity: HeadGranularity = KV_HEADS  # see HeadGranularity (Ada-KV offers the others)

    def __init__(self, config: PolicyConfig | None = None, **parameters: Any) -> None:
        if config is not None and parameters:
            raise ValueError("pass either a config object or keyword parameters, not both")
        if config is None:
            known = {field.name for field in dataclasses.fields(self.config_class)}
            unknown = sorted(set(parameters) - known)
            if unknown:
                raise ValueError(f"unknown parameter(s) {unknown} for method {self.name!r}; accepted: {sorted(known)}")
            config = self.config_class(**parameters)
        config.validate()
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config})"

    # -- budgets -----------------------------------------------------------------------------
    def minimum_budget(self) -> int:
        """Smallest budget (tokens per head) the method can honour."""
        return 1

    def layer_budgets(self, budget: int, num_layers: int, context_length: int | None = None) -> list[int]:
        """Per-layer budgets for one sequence of ``context_length`` real tokens (None: long enough
        for any split); uniform unless the method allocates across layers (PyramidKV). The cache
        calls it through ``kvhive.cache.budget.layer_budgets``."""
        return [budget] * num_layers

    # -- prefill -----------------------------------------------------------------------------
    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} has no prefill phase")

    prefill_column_sums: ClassVar[bool] = False
    """The prefill decision (or ``initialize_decode``) reads :meth:`ScoringInputs.accumulated_attention`,
    the column sums of the prompt's causal attention: a compressed layer's prefill attention then
    computes them in the pass that computes its output (``ScoringInputs.attention_with_column_sums``
    on CPU, the column-sum kernel after flash attention on CUDA) instead of a second ``QK^T``
    pass for scoring."""

    chunk_column_sums: ClassVar[bool] = False
    """Several new queries after a layer's prefill (a later chunk of a chunked prefill) are scored by
    :meth:`ScoringInputs.accumulated_attention` over those queries (H2O's ``observe_decode`` of a
    chunk; the prefill decision over kept + new tokens of a prefill-only method that reads it): the
    attention computes the sums with its output (``ScoringInputs.attention_with_column_sums``,
    causal by the stored positions) instead of sdpa and a second ``QK^T`` pass. A method that reads
    only the newest query's weights of a chunk (BUZZ, BumbleBee) leaves it False: sdpa is faster
    than the pass with column sums, and its one row costs what a decode step's does."""

    # -- decode ------------------------------------------------------------------------------
    needs_decode_attention: ClassVar[bool] = False

    def initialize_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """Called once per layer before the first decode-phase decision (e.g. seed running
        scores from the prompt into ``scoring.token_scores``). ``budget`` is the layer's budget,
        the same number the cache passes to ``select_*`` (None: no budget, nothing evicted)."""

    def observe_decode(self, scoring: ScoringInputs, state: dict, budget: int | None = None) -> None:
        """Called after every decode step's attention (e.g. to accumulate scores); ``budget`` as
        in :meth:`initialize_decode`."""

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        raise NotImplementedError(f"{self.name} has no decode phase")

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """A steady decode step that drops one token: the layer holds ``budget + 1`` stored tokens
        (left padding included). The stored index ``[B, H]`` (long) of the token each row drops, decided as
        :meth:`select_decode` decides (same state changes, same token), or None to decide through
        :meth:`select_decode`'s keep mask (changing nothing here). The cache asks for it only where
        it then moves the newest token into the freed slot (``reads_stored_order`` False): naming the
        token spares the keep mask, its count check and the search for its one False (about ten small
        operations per layer and step, each a kernel launch in an eager GPU step)."""
        return None

    def decode_eviction_due(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """Over a fixed decode capacity, before :meth:`select_decode`: a 0-d bool tensor on the
        scores' device, False where this step's decision keeps every filled slot and changes no state
        (so a captured step may skip it and the compaction: ``kvhive.static_step.run_if``), or None
        (the default: any step may evict). Device work only, no host read; asked only while a CUDA
        graph captures the step."""
        return None

    takes_key_probes: ClassVar[bool] = False
    """The method may ask for :meth:`decode_key_probes` (the cache skips the call otherwise)."""

    def decode_key_probes(self, scoring: ScoringInputs, budget: int, state: dict) -> KeyProbes | None:
        """Before a decode step's attention (``scoring`` has no weights yet): stored keys whose dot
        products with every stored key this step's :meth:`select_decode` will read, or None. The
        attention computes them with its logits where it can (float32 keys on the CPU, where a
        second pass over the keys costs as much as the attention's own) and hands them back in
        ``ScoringInputs.key_probes``; where it does not, ``key_probes`` is None and the method
        computes what it needs itself. Asking changes no state: a step that decides nothing
        (or an attention that takes no probes) leaves everything as it was."""
        return None

    def prefill_limit(self, budget: int) -> int:
        """The most tokens per (row, head) a layer may hold right after its prefill decision at
        ``budget`` (the cache refuses more): the budget itself, unless a method's option says
        otherwise (BUZZ's ``prefill_fit="peak"``, Remark 2's literal container ``T + k + w``).
        Decode decisions always keep the budget."""
        return budget

    def state_nbytes(self, state: dict) -> int:
        """Bytes a method holds per layer beside the cached tokens (e.g. SubGen's clusters)."""
        return 0

    # -- batch rows of the per-layer state ------------------------------------------------------
    def select_state_rows(self, state: dict, index: torch.Tensor, num_heads: int) -> dict:
        """The per-layer ``state`` of batch rows ``index`` (1-D, on the host; rows may repeat or be
        reordered: beam search, ``batch_select_indices``, ``batch_repeat_interleave``). ``num_heads``
        is the layer's stored heads. A new dict; ``state`` is left as it was.

        The default serves a method that keeps nothing per layer (its per-token scores live in the
        cache, which selects them itself); a method with per-row state overrides it."""
        if not state:
            return {}
        raise NotImplementedError(
            f"method {self.name!r} keeps per-layer state ({', '.join(sorted(state))}) that it cannot select by "
            "batch row: reordering or selecting the rows of its cache (beam search, batch_select_indices) is not "
            "supported"
        )

    def stack_states(self, states: list[dict], tokens_seen: list[int]) -> dict:
        """One layer's state for caches prefilled separately and stacked as the rows of one batch
        (``KVHiveCache.stack``): ``states[i]`` is row ``i``'s (a batch of one: a row of a cache of
        several rows comes from :meth:`select_state_rows`), ``tokens_seen[i]`` the tokens seen of the
        layer it came from, its ``sequence_length`` (a row's own count for a cache of one row; for a
        row of a stacked cache, the most any of its rows has seen, which its state may be relative
        to). The stacked layer's ``sequence_length`` is their maximum. Raises ValueError when the
        method cannot decode such rows together."""
        if not any(states):
            return {}
        raise ValueError(
            f"method {self.name!r} keeps per-layer state ({', '.join(sorted(states[0]))}) that cannot be stacked "
            "from caches prefilled separately"
        )

    decodes_rows_of_different_lengths: ClassVar[bool] = False
    """Rows that hold different numbers of tokens (caches prefilled separately and stacked,
    ``KVHiveCache.stack``) may decode together in a layer that evicts: the cache holds them in slots
    of a common capacity (``fixed_decode_capacity`` of the stacked state, plus the new token), each
    row its own length, and every decode step calls ``observe_decode`` and ``select_decode`` with
    ``ScoringInputs.filled`` the ``[B, 1, 1]`` lengths (the keep mask must be False on each row's
    empty slots and keep one count for every head of a row). Each row's decision must depend only
    on that row's tokens and state (BUZZ: per-row schedule counters on the device). False: the
    stacked rows of such a layer must keep one length (the cache refuses others)."""

    reads_stored_order: ClassVar[bool] = True
    """Whether the method's decisions read the order tokens are stored in (recent windows, sinks
    and ties by stored index). False for a method that reads recency from ``ScoringInputs`` only
    (:meth:`ScoringInputs.recent_tokens`, ``recency_scores``, ``first_real``, ties by position in
    :meth:`ScorerPolicy.keep`): a decode step that evicts one of its tokens writes the newest token
    into the freed slot (one token per head moved) instead of moving every later token down."""

    reads_newest_token_scores: ClassVar[bool] = True
    """Whether the method reads the per-token scores of the newest stored token before writing them:
    the cache then zeroes a token's scores when it arrives and, where a decode eviction writes the
    newest token into the freed slot (:attr:`reads_stored_order` False), moves its scores with it.
    False for a method that writes a token's scores before it reads them, and not while the token
    is the newest (SubGen with a recent window: a token's neighbour bookkeeping is written when it
    leaves the window): the cache does neither, three fewer small ops per score and step (but for its
    own padding flag, ``kvhive.cache.storage.PADDING_SCORE``; tests/test_unset_scores.py fills the
    slots left unset with NaN)."""

    static_decode: ClassVar[bool] = False
    """A decode decision keeps exactly the layer's budget at every step (or, with
    :meth:`fixed_decode_capacity`, a number that varies within a declared bound), computed by tensor
    work of fixed shape without host reads, so a decode step compiles to one graph that serves every
    later step (``KVHiveCache.is_compileable``; tests/test_compiled_decode.py holds every such method
    to it)."""

    compiles_below_budget: ClassVar[bool] = True
    """With :attr:`static_decode`: a layer left below its budget by a short prompt also decodes in
    one graph (the cache holds it in a capacity of the budget while it fills). False for a method
    that builds state at its first eviction (a new buffer, a new structure), which changes the graph."""

    drops_at_most_one: ClassVar[bool] = False
    """With :meth:`fixed_decode_capacity`: every decode decision over the capacity drops at most one
    filled slot per row (the method keeps ``min(budget, filled)``, as BumbleBee does). The cache then
    compacts without a sort and, for a method that reads no stored order
    (:attr:`reads_stored_order` False), writes the newest token into the freed slot."""

    def fixed_decode_capacity(self, keys: torch.Tensor, budget: int, state: dict) -> int | None:
        """For a method whose kept count varies from one decode step to the next (BUZZ's schedule,
        BumbleBee filling up to its budget): the most tokens per row the layer holds after any later
        decode decision, given its stored ``keys [B, H, N, d]`` right after the prefill (their shape
        and device; ``N`` is at most the bound) and ``state`` as the prefill left it. None (the
        default): every decision keeps ``kept_per_row`` tokens, the budget once the layer is full.

        The cache (when its decode step is static, ``KVHiveCache.is_compileable``) then holds the
        layer in fixed buffers of that bound plus one new token, and every decode step calls
        ``observe_decode`` and ``select_decode`` with ``ScoringInputs.filled`` set: the inputs cover
        the whole capacity, the keep mask must be False on the empty slots, and nothing the method
        reads from ``state`` on the host may change from step to step (counters live on the device;
        this hook, called once per layer, is where the method moves them there). The cache counts
        the kept tokens on the device and keeps them compacted, oldest first. An eager step (not
        compiling) may return None where the method knows on the host that it evicts nothing (the
        cache then compacts nothing)."""
        return None

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        """Tokens every (batch row, head) keeps after ``select_prefill`` (``phase="prefill"``) or
        ``select_decode`` (``"decode"``) on a layer holding ``num_tokens`` per row, known on the host
        without reading the device; None when the count depends on the data.

        The cache trusts this count to lay out what is kept, so a decision costs no host
        synchronisation (it checks the mask against it on the device, asynchronously, and a
        mismatch is a device-side assertion). With None the cache reads the counts back: one
        synchronisation per decision. It is asked only when ``num_tokens > budget``, before the
        decision (``state`` as the decision will see it)."""
        return None

    # -- attention changes -------------------------------------------------------------------
    @property
    def changes_attention_logits(self) -> bool:
        """Whether :meth:`logit_scale` is overridden (the attention skips the hook otherwise, so
        an unchanged method costs no per-layer work)."""
        return type(self).logit_scale is not Policy.logit_scale

    def logit_scale(self, key_counts: torch.Tensor) -> torch.Tensor | None:
        """Per-query multiplier of the model's attention logits (BUZZ log n); None = unchanged."""
        return None

    def extra_attention(self, state: dict, queries: torch.Tensor, scaling: float):
        """Estimated attention over evicted tokens (SubGen): ``(numerator, denominator, max_logit)``."""
        return None

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """Registry name, phases, the paper (or the label of a kvhive combination/example) and the
        parameters with their defaults."""
        fields = dataclasses.fields(cls.config_class)
        return {
            "name": cls.name,
            "phases": sorted(cls.phases),
            "paper": cls.paper,
            "parameters": {field.name: field.default for field in fields},
        }


class ScorerPolicy(Policy):
    """A method that is "a score per token plus protected tokens" (modelled on kvpress's ScorerPress).

    Subclasses implement :meth:`score` and, where they always keep some tokens (sinks, a recent
    window), :meth:`protected`; selection in both phases comes from here: the protected tokens,
    then the highest scores, exactly ``min(budget, N)`` per row, padding never kept while a row
    has real tokens left (:func:`keep_top_scores`). Ada-KV (:mod:`kvhive.methods.adakv`) wraps
    any scorer: it reads the same two methods and allocates the budget across heads instead.
    """

    def score(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        """``[B, H, N]`` float scores of the stored tokens, higher = keep. ``budget`` is the layer's
        budget (a score may depend on it: AhaKV's step gain)."""
        raise NotImplementedError

    def protected(self, scoring: ScoringInputs, budget: int) -> torch.Tensor | None:
        """``[B, H, N]`` (or broadcastable) bool: tokens kept whatever their score; None = none."""
        return None

    def keep(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        scores = self.score(scoring, budget, state)
        positions = None if scoring.stored_in_order else scoring.positions
        return keep_top_scores(
            scores, budget, scoring.valid, forced=self.protected(scoring, budget), positions=positions
        )

    def kept_per_row(self, phase: str, num_tokens: int, budget: int, state: dict) -> int | None:
        # keep_top_scores keeps exactly min(budget, N) per row, padding included when it must.
        return min(budget, num_tokens)

    def select_prefill(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self.keep(scoring, budget, state)

    def select_decode(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor:
        return self.keep(scoring, budget, state)

    def select_decode_drop(self, scoring: ScoringInputs, budget: int, state: dict) -> torch.Tensor | None:
        """:meth:`keep`'s one dropped token (:func:`lowest_ranked`), where :meth:`keep` and
        :meth:`select_decode` are this class's own (a subclass or an instance that decides otherwise
        is asked for its mask). Without a model mask every stored token is real: no validity to fill in."""
        own = (getattr(self.keep, "__func__", None), getattr(self.select_decode, "__func__", None))
        if own != (ScorerPolicy.keep, ScorerPolicy.select_decode):  # (an instance's own too)
            return None
        scores = self.score(scoring, budget, state)
        valid = None if scoring.mask is None else scoring.valid
        positions = None if scoring.stored_in_order else scoring.positions
        return lowest_ranked(scores, valid, self.protected(scoring, budget), positions).squeeze(-1)
