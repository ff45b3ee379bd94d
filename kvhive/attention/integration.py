"""The one place that touches transformers' attention and mask interfaces.

``kvhive`` is registered as an attention implementation (``AttentionInterface``) together with
its mask function (``AttentionMaskInterface``; without it transformers would silently drop the
sliding-window pattern). The attention function:

* runs the model's attention over what the layer stores (dense sdpa when every head holds the
  same number of tokens, a vectorised variable-length path otherwise),
* hands the policy what it needs (observation-window / accumulated / last-query attention,
  keys, values, queries after RoPE) through :class:`~kvhive.methods.base.ScoringInputs`,
* lets a method change the attention itself (logit scaling, an estimated extra term),
* and calls the cache right after each layer's attention, so a layer is cut as soon as its own
  prefill is done.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvhive import static_step
from kvhive.attention.column_sums import (
    column_sums,
    flash_attention_with_column_sums_by_row,
    flash_attention_with_lse,
    flash_runs_on,
)
from kvhive.attention.column_sums import kernel_supports as column_sums_kernel_supports
from kvhive.attention.varlen import (
    kernel_runs_on,
    kernel_supports,
    varlen_attention,
    varlen_attention_kernel,
    varlen_attention_paged,
)
from kvhive.cache.kv_cache import CACHE_POSITIONS, ORIGINAL_POSITIONS, KVHiveCache, active_update
from kvhive.cache.rows import CacheRows
from kvhive.cache.storage import PADDING_SCORE, PAGE_TOKENS
from kvhive.memory import trim_heap
from kvhive.methods.base import DECODE, PREFILL, KeyProbes, ScoringInputs, causal_mask
from kvhive.static_step import in_static_step

ATTENTION_NAME = "kvhive"

# kvhive picks its own sdpa backends: cuDNN's sdpa re-plans for every new key length (milliseconds
# of host time per call on torch 2.11 / H100), so a decode step would depend on it.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _backends(device: torch.device):
    return sdpa_kernel(_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def kvhive_mask(*args, **kwargs):
    """transformers' sdpa mask. It is None when nothing needs masking (no padding, no window in
    reach), which the attention reads as "causal over original positions"; otherwise it spans
    every original position and kept tokens are gathered from it by position.

    In a compiled decode step (one new query) there is no mask at all: a mask over every original
    position grows by one column per step (a new graph each step); kvhive's attention masks the
    stored tokens of a static decode step itself (padding recorded at prefill, the window by
    position)."""
    q_length = kwargs.get("q_length", args[1] if len(args) > 1 else None)
    if q_length == 1 and in_static_step():
        return None  # no mask is built inside a compiled step (kvhive's attention masks it)
    if (
        q_length == 1
        and kwargs.get("kv_length") == 1
        and kwargs.get("kv_offset") == 0
        and (kwargs.get("q_offset") or 0) > 0
    ):
        # The fixed unused column KVHiveCache.get_mask_sizes asks for in a static decode step, run
        # eagerly (a mask over the positions seen would span q_offset + 1 columns): kvhive's attention
        # masks the stored tokens itself, so the ten ops that build this column are not spent
        # (transformers >= 5.24 passes q_offset; older versions build the column, unused).
        return None
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Make ``attn_implementation="kvhive"`` available (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvhive_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvhive_mask)


class _ModelAttachment:
    """What :func:`attach` added to one model: how many forwards with a kvhive cache are running
    (a lock guards the count, so concurrent kvhive forwards switch and restore once) and the
    attention implementation of each config they switched, restored when the last one ends."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.switched: list[tuple[object, object]] = []


_ATTACHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ATTACHED_LOCK = threading.Lock()


def attach(model) -> None:
    """Let ``model`` run kvhive's attention for the calls given a kvhive cache, and only for them.

    transformers picks the attention function from ``model.config``; a forward that is given a
    :class:`KVHiveCache` (or ``CacheRows``) switches the model's configs to ``"kvhive"`` for that
    forward and restores what they held after it (a forward pre-hook and an always-called forward
    hook). Calls with another cache or none run the model's own implementation (eager, sdpa,
    flash-attention) and its own mask, as if kvhive had never seen the model; the configs read as
    before between calls. The one caveat: a forward with a kvhive cache and one without running
    at the same time in two threads on the *same* model object both see ``"kvhive"`` (which is
    plain sdpa for other caches).

    ``generate`` also shows a kvhive cache the full token sequence before each step
    (:class:`_ReuseCheckingPrepare`), so a reused cache refuses a prompt that does not continue
    it. Idempotent."""
    register()
    with _ATTACHED_LOCK:
        if model in _ATTACHED:
            return
        _ATTACHED[model] = _ModelAttachment()
    if _enter_forward in model._forward_pre_hooks.values():  # a copy of an attached model
        return
    model.register_forward_pre_hook(_enter_forward, with_kwargs=True)
    model.register_forward_hook(_leave_forward, with_kwargs=True, always_call=True)
    if callable(getattr(model, "prepare_inputs_for_generation", None)):
        model.prepare_inputs_for_generation = _ReuseCheckingPrepare(model)


def _kvhive_caches_in(args, kwargs) -> list[KVHiveCache]:
    """The kvhive caches a forward was given (each row's cache for ``CacheRows``)."""
    # transformers >= 5.24 names the forward argument ``cache`` (``past_key_values`` before).
    for value in (kwargs.get("cache"), kwargs.get("past_key_values"), *args):
        if isinstance(value, KVHiveCache):
            return [value]
        if isinstance(value, CacheRows):
            return list(value.caches)
    return []


# The attached models whose forward this thread entered with a kvhive cache, innermost last: the
# always-called forward hook also runs when the pre-hook raised, and must then restore nothing.
_ENTERED = threading.local()


def _attention_configs(model) -> list:
    """The configs whose ``_attn_implementation`` the model's attention layers and masks read."""
    configs = [model.config]
    text_config = model.config.get_text_config(decoder=True)
    if text_config is not model.config:
        configs.append(text_config)
    return configs


def _attachment(model) -> _ModelAttachment:
    # A deep copy or an unpickled copy of an attached model carries the hooks but no entry yet.
    with _ATTACHED_LOCK:
        return _ATTACHED.setdefault(model, _ModelAttachment())


def _enter_forward(model, args, kwargs):
    caches = _kvhive_caches_in(args, kwargs)
    if not caches:
        return None
    for cache in caches:
        cache.check_model(model.config)  # before anything is stored: an empty cache refuses too
    if torch.compiler.is_compiling():
        # Inside a compiled step (one thread, traced once): switch without the lock and the
        # thread-local bookkeeping, which dynamo cannot trace; the switch is replayed as a side effect.
        if not static_step.TORCH_COMPILES_KVHIVE and model.config._attn_implementation_internal != ATTENTION_NAME:
            # Older dynamo does not trace the switch below (kvhive.static_step).
            raise RuntimeError(
                f"torch {torch.__version__} compiles a kvhive decode step only with kvhive's attention switched "
                "before the compiled call: run it inside kvhive.compression(model) (kvhive.generate(compile=True) "
                f"does), or use torch >= {static_step.COMPILE_MIN_TORCH}"
            )
        for config in _attention_configs(model):
            config._kvhive_previous_attention = config._attn_implementation_internal
            config._attn_implementation_internal = ATTENTION_NAME
        return None
    attachment = _attachment(model)
    with attachment.lock:
        if attachment.running == 0:
            configs = _attention_configs(model)
            attachment.switched = [(config, config._attn_implementation_internal) for config in configs]
            for config in configs:
                config._attn_implementation_internal = ATTENTION_NAME
        attachment.running += 1
    _ENTERED.__dict__.setdefault("models", []).append(model)
    return None


def _leave_forward(model, args, kwargs, output):
    caches = _kvhive_caches_in(args, kwargs)
    if not caches:  # calls without a kvhive cache touch nothing else
        return None
    if torch.compiler.is_compiling():
        for config in _attention_configs(model):
            config._attn_implementation_internal = config._kvhive_previous_attention
        return None
    for cache in caches:
        cache.prefill_scratch.clear()  # held for one prefill only, also when the forward raised
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        # Large captured prefill loops likewise (BumbleBee's similarity matrix at long prompts): not
        # held through the decode. Never waits for another thread's prefill.
        static_step.release_captured_loops(larger_than=static_step.HELD_LOOP_BYTES, wait=False)
    entered = _ENTERED.__dict__.get("models")
    if not entered or entered[-1] is not model:
        return None
    entered.pop()
    if _ENTERED.__dict__.pop("ran_chunk_on_cpu", False):
        trim_heap()  # the chunk's last temporaries (the last layers' MLP) before the next chunk
    attachment = _attachment(model)
    with attachment.lock:
        attachment.running -= 1
        if attachment.running == 0:
            for config, previous in attachment.switched:
                config._attn_implementation_internal = previous
            attachment.switched = []
    return None


class _ReuseCheckingPrepare:
    """The model's own ``prepare_inputs_for_generation``, called unchanged, after showing a kvhive
    cache the full token sequence (transformers passes the model only the tokens the cache has
    not seen, so this is where a reused cache can refuse a prompt that does not continue it).

    ``__wrapped__`` is the model's own bound method, so ``inspect.signature`` (which transformers
    reads to decide, e.g., whether ``generate(inputs_embeds=...)`` is supported) sees exactly the
    stock signature; other caches go straight through. A class, not a closure, so the model still
    pickles and deep-copies (a copy's hook calls the copy's method)."""

    def __init__(self, model) -> None:
        self.model = model

    @property
    def __wrapped__(self):
        return types.MethodType(type(self.model).prepare_inputs_for_generation, self.model)

    def __call__(self, input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVHiveCache) and cache.positions == ORIGINAL_POSITIONS:
            new_tokens = kwargs.get("next_sequence_length")
            if new_tokens is None and not cache.get_seq_length():
                new_tokens = input_ids.shape[-1]
            cache.check_generation_inputs(input_ids, bool(kwargs.get("is_first_iteration")), new_tokens)
        return self.__wrapped__(input_ids, *args, **kwargs)


def _model_mask(attention_mask):
    """The model's mask as boolean (True = may attend), or None."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    return attention_mask


def _full_mask(attention_mask, batch_size, num_queries, tokens_seen, sliding_window, device):
    """``[B, 1, q, N]`` boolean mask over every original position."""
    if attention_mask is not None:
        return _model_mask(attention_mask)
    key_positions = torch.arange(tokens_seen, device=device)
    query_positions = key_positions[tokens_seen - num_queries :]
    allowed = key_positions[None, :] <= query_positions[:, None]
    if sliding_window is not None:
        allowed &= (query_positions[:, None] - key_positions[None, :]) < sliding_window
    return allowed[None, None].expand(batch_size, 1, num_queries, tokens_seen)


def _gather_mask(mask: torch.Tensor | None, positions: torch.Tensor, store, num_queries: int) -> torch.Tensor | None:
    """The mask over the stored tokens: ``[B, H|1, q, L]``, or None when nothing is masked.

    The model's mask (padding, a window in reach) is gathered at the stored tokens' positions.
    Without one (no padding, no window in reach) a single new query sees every stored token
    (None, so sdpa keeps its fast kernels); several new queries are causal among themselves."""
    batch, heads, length = positions.shape
    if mask is None:
        if num_queries == 1:
            return None
        return _stored_causal_rows(store, positions, num_queries, 0, num_queries)
    tokens_seen = store.tokens_seen
    if length == tokens_seen:  # nothing was ever evicted: the stored order is the original one
        return mask
    index = positions.long()[:, :, None, :].expand(batch, heads, num_queries, length)
    return mask.expand(batch, heads, num_queries, mask.shape[-1]).gather(3, index)


def _stored_causal_rows(store, positions: torch.Tensor, num_queries: int, start: int, stop: int) -> torch.Tensor:
    """``[B, H, stop - start, L]``: rows ``start..stop-1`` of the mask of ``num_queries`` new queries
    (the newest tokens seen) over the stored tokens when the model gives none: causal by the
    stored tokens' positions, and the window of a sliding layer."""
    first = store.tokens_seen - num_queries
    allowed = causal_mask(positions, first + start, first + stop)
    if store.is_sliding:  # positions="cache" gives no model mask: apply the window here
        query_positions = torch.arange(first + start, first + stop, device=positions.device)
        allowed &= (query_positions[None, None, :, None] - positions[:, :, None, :]) < store.sliding_window
    return allowed


def _stored_decode_mask(store, positions: torch.Tensor, token_scores: dict) -> torch.Tensor | None:
    """``[B, H, 1, L]`` mask of one new query of a static decode step (``cache.is_compileable``:
    transformers' mask is not used, see ``KVHiveCache.get_mask_sizes``), from what the layer knows
    on the device: left padding recorded at prefill, and the sliding window by the stored tokens'
    positions. None when neither applies."""
    allowed = None
    padding = token_scores.get(PADDING_SCORE)  # aligned with ``positions`` (the view attention reads)
    if padding is not None:
        allowed = padding == 0
    if store.is_sliding:
        # The new token sits at tokens_seen - 1; the window reaches back window - 1 tokens.
        seen = store.tokens_seen_device
        if store.row_tokens_seen_device is not None:  # stacked rows: each row its own count
            seen = store.row_tokens_seen_device[:, None, None]
        in_window = positions >= seen - store.sliding_window
        allowed = in_window if allowed is None else allowed & in_window
    return None if allowed is None else allowed[:, :, None, :]


def _record_padding(store, mask: torch.Tensor | None) -> None:
    """Remember which prompt tokens are left padding (a compiled decode step masks them itself).
    One read per layer at prefill; nothing is stored for a batch without padding."""
    if mask is None:
        return
    padding = ~mask[:, 0].any(dim=-2)  # [B, N]: keys no query of the prompt may attend
    if bool(padding.any()):
        store.has_padding = True
        store.set_token_scores(PADDING_SCORE, padding[:, None, :].expand(-1, store.num_heads, -1).float())


def _refuse_padding(model_mask: torch.Tensor | None, causal: torch.Tensor, layer_index: int) -> None:
    """positions="cache" re-indexes every row to the same contiguous positions, which has no
    place for padding: the rebuilt mask would let real tokens attend the padding (the padded
    row's logits were off by 0.24 even with the full cache). Refuse instead of answering wrong."""
    if model_mask is None:
        return
    masked = ~model_mask.expand_as(causal) & causal
    if bool(masked.any()):
        rows = sorted({int(r) for r in masked.nonzero()[:, 0].tolist()})
        raise ValueError(
            f"positions='cache' does not support padded batches: the attention mask hides tokens of row(s) {rows} "
            f"(layer {layer_index}); run rows of equal length without padding (or one at a time), or use "
            "positions='original'"
        )


def _row_logit_scale(policy, mask: torch.Tensor | None, num_keys: int, queries: torch.Tensor) -> torch.Tensor:
    """Queries times the policy's logit multiplier. It gets ``[B, q]`` key counts: the keys each
    query row may attend in its own batch row (padding excluded, so a row's factor is what it
    would be alone); without a mask the queries are the newest ``q`` of ``num_keys`` causal keys."""
    batch, _, num_queries, _ = queries.shape
    if mask is None:
        newest = torch.arange(num_keys - num_queries + 1, num_keys + 1, device=queries.device)
        key_counts = newest.expand(batch, num_queries)
    else:
        key_counts = mask[:, 0].sum(dim=-1).expand(batch, num_queries)
    scale = policy.logit_scale(key_counts)
    if scale is None:
        return queries
    return queries * scale.to(queries.dtype)[:, None, :, None]


def kvhive_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention over a :class:`KVHiveCache` layer; plain sdpa for any other cache."""
    cache, layer_index = active_update(key, kwargs)
    if cache is None:
        with _backends(query.device):
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
            )
    if isinstance(cache, CacheRows):
        return _attention_by_row(
            module, cache, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs
        )
    cache.check_attention_module(layer_index, module)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    store = cache.layers[layer_index]
    policy = cache.policy
    batch, _, num_queries, _ = query.shape
    if cache.positions == CACHE_POSITIONS:
        # transformers built its mask over re-indexed positions, which says nothing of the stored
        # tokens' true positions. The prompt gets the causal mask over true positions (padding is
        # refused); later forwards get theirs from the stored positions alone (_gather_mask), whose
        # size follows the kept tokens, not every token ever seen (a long stream stays flat).
        mask = None
        if store.in_prefill:
            mask = _full_mask(None, batch, num_queries, store.tokens_seen, store.sliding_window, query.device)
            _refuse_padding(_model_mask(attention_mask), mask, layer_index)
    elif store.in_prefill or store.has_padding or not store.is_uniform:
        mask = _model_mask(attention_mask)
    else:
        # After an unpadded prompt the model's mask says nothing the stored positions do not (causal
        # order, the window): kvhive masks by position, and transformers builds a chunk-sized mask
        # instead of one over every token seen (KVHiveCache.get_mask_sizes), so a long stream stays flat.
        mask = None
    compressed = cache.is_compressed(layer_index)

    # A chunk of a chunked prefill on CPU: the heap's free pages go back to the OS before the
    # attention, after it, and at the end of the model's forward, so the temporaries of one step (the
    # projections and RoPE, the attention, the MLP) do not stay resident on top of what the next
    # holds (kvhive.memory.trim_heap). (No hook on the model's modules: kvhive leaves them as found.)
    chunk_on_cpu = num_queries > 1 and query.device.type == "cpu" and cache.takes_prompt_chunks
    if chunk_on_cpu:
        _ENTERED.ran_chunk_on_cpu = True  # and once more when the model's forward ends
        trim_heap()
    result = None
    with _backends(query.device):
        if store.in_prefill:
            result = _prefill(module, cache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs)
        elif store.is_uniform:
            result = _decode_dense(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs)
    if result is not None:
        if chunk_on_cpu:
            trim_heap()
        return result
    if policy.changes_attention_logits:
        raise RuntimeError(
            f"method {policy.name!r} scales the attention logits, which the variable-length path "
            "does not support; keep its heads at equal lengths"
        )
    if compressed and policy.extra_attention(store.policy_state, query, scaling) is not None:
        raise RuntimeError(
            f"method {policy.name!r} adds estimated attention, which the variable-length "
            "path does not support; keep its heads at equal lengths"
        )
    if num_queries == 1 and cache.static_decode:
        # A static decode step (transformers' mask is a fixed unused column, get_mask_sizes): shapes
        # fixed by the layout, the layer masks its tokens itself.
        output = _decode_packed_static(cache, layer_index, query, scaling)
    else:
        output = _decode_variable_length(cache, layer_index, query, mask, scaling)
    cache.after_variable_length_decode(layer_index)
    return output, None


def _attention_by_row(
    module, rows: CacheRows, layer_index, query, key, value, attention_mask, scaling, dropout, kwargs
):
    """Row ``i`` of the batch through its own cache: the cache stores the row's new tokens and its
    method runs as if the row were alone. The projections before and after attention (the cost of
    a small model's decode step) ran once for all rows."""
    outputs = []
    for row, cache in enumerate(rows.caches):
        row_kwargs = dict(kwargs)
        row_keys, row_values = cache.update(key[row : row + 1], value[row : row + 1], layer_index, kwargs=row_kwargs)
        # Every row sees the same positions (CacheRows checks it), so a mask shared by the batch
        # (first dimension 1) serves each row as it is.
        row_mask = attention_mask
        if attention_mask is not None and attention_mask.shape[0] > 1:
            row_mask = attention_mask[row : row + 1]
        output, _ = kvhive_attention(
            module, query[row : row + 1], row_keys, row_values, row_mask, scaling=scaling, dropout=dropout, **row_kwargs
        )
        outputs.append(output)
    return torch.cat(outputs, dim=0), None


def _prefill(module, cache: KVHiveCache, layer_index, query, key, value, mask, scaling, dropout, compressed, kwargs):
    policy = cache.policy
    attended_queries = query
    if policy.changes_attention_logits:  # every layer (BUZZ log n), compressed or not
        attended_queries = _row_logit_scale(policy, mask, key.shape[2], query)
    accumulated = None
    if (
        compressed
        and policy.prefill_column_sums
        and _fusable(module, attended_queries, key, value, mask, dropout, kwargs)
    ):
        # The policy scores by the prompt's column sums: one pass computes them with the output.
        output, accumulated = _attention_with_column_sums(attended_queries, key, value, mask, scaling)
    else:
        # No mask (no padding, no window in reach): transformers' sdpa runs its causal kernels.
        output, _ = sdpa_attention_forward(
            module, attended_queries, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )

    _record_padding(cache.layers[layer_index], mask)
    if cache.record_prefill:
        cache.prefill_records[layer_index] = (attended_queries, mask, scaling)
    # Policies score with the queries the model attended with (as in decode).
    make_scoring = _prefill_scoring(cache, layer_index, attended_queries, mask, scaling, accumulated)
    cache.after_prefill(
        layer_index, _question_scoring(cache, layer_index, attended_queries, mask, scaling, make_scoring)
    )
    return output, None


# Keywords of transformers' attention call that change what sdpa computes: with any of them set,
# the prefill runs sdpa and the scoring computes its column sums itself.
_ATTENTION_CHANGES = ("softcap", "position_bias", "s_aux", "sinks", "head_mask")


def _fusable(module, query, key, value, mask, dropout, kwargs) -> bool:
    """Whether the prefill attention may be computed by kvhive's pass with column sums: plain
    causal softmax attention (what sdpa_attention_forward computes for these arguments) with the
    queries the newest of the keys, no dropout, nothing that changes the logits."""
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    num_queries, num_keys = query.shape[2], key.shape[2]
    return (
        dropout == 0.0
        and bool(is_causal)
        and num_queries > 1
        # Without a mask sdpa's causal kernels align the queries with the first keys: only a
        # prompt over exactly its own keys reads the same both ways.
        and (mask is not None or num_keys == num_queries)
        and (mask is None or (mask.dim() == 4 and mask.shape[-2:] == (num_queries, num_keys)))
        and query.shape[1] % key.shape[1] == 0
        and key.shape[1] == value.shape[1]
        and all(kwargs.get(name) is None for name in _ATTENTION_CHANGES)
    )


def _attention_with_column_sums(query, key, value, mask, scaling):
    """``(output [B, q, Hq, dv], column sums [B, Hq, N] float32)`` of causal softmax attention
    over ``mask`` (None: causal). The computation is :meth:`ScoringInputs.attention_with_column_sums`
    (chunked: every chunk's softmax exact, the output ``P V`` and the sums ``P`` from one ``QK^T``),
    except on CUDA in half precision without a mask or with a left-padded batch's: there sdpa's
    flash kernel gives the output with each row's log-sum-exp (a padded batch row by row over its
    real tokens) and the Triton kernel sums ``exp(q.k * scale - lse)`` per key
    (``kvhive.attention.column_sums``; its reference is the torch path)."""
    if flash_runs_on(query) and column_sums_kernel_supports(query, key):
        if mask is None:
            flash = flash_attention_with_lse(query, key, value, scaling)
            if flash is not None:
                output, lse = flash
                return output.transpose(1, 2).contiguous(), column_sums(query, key, lse, scaling)
        else:  # a left-padded batch: row by row over each row's real tokens (None: another mask)
            by_row = flash_attention_with_column_sums_by_row(query, key, value, mask, scaling)
            if by_row is not None:
                output, sums = by_row
                return output.transpose(1, 2).contiguous(), sums
    batch, heads, num_keys, _ = key.shape
    positions = torch.arange(num_keys, device=key.device).expand(batch, heads, num_keys)
    output, sums = _one_pass_attention_with_column_sums(query, key, value, positions, mask, scaling, num_keys, PREFILL)
    return output.contiguous(), sums


def _scored_view(cache: KVHiveCache, store):
    """A layer's stored ``(keys, values, positions, token_scores)`` as a prefill decision scores
    them: repeated to the query heads when the method stores one copy per query head and the layer
    has not been expanded yet."""
    keys, values, positions, token_scores = store.dense()
    if cache.stores_query_heads and cache.num_query_heads != keys.shape[1]:
        factor = cache.num_query_heads // keys.shape[1]
        keys = keys.repeat_interleave(factor, dim=1)
        values = values.repeat_interleave(factor, dim=1)
        positions = positions.repeat_interleave(factor, dim=1)
    return keys, values, positions, token_scores


def _prefill_scoring(cache: KVHiveCache, layer_index: int, query, mask, scaling, accumulated=None):
    """A factory of the :class:`ScoringInputs` of one layer right after its prefill (``accumulated``:
    the column sums the attention computed with its output, or None)."""
    store = cache.layers[layer_index]

    def make_scoring(phase: str) -> ScoringInputs:
        keys, values, positions, token_scores = _scored_view(cache, store)
        return ScoringInputs(
            keys=keys,
            values=values,
            queries=query,
            positions=positions,
            mask=mask,
            scaling=scaling,
            layer_index=layer_index,
            num_layers=len(cache.layers),
            sequence_length=store.tokens_seen,
            phase=phase,
            token_scores=dict(token_scores),
            accumulated_weights=accumulated,
            scratch=cache.prefill_scratch,
        )

    return make_scoring


def replay_prefill(recorded: KVHiveCache, target: KVHiveCache) -> None:
    """Fill ``target`` as if it had run the prefill that ``recorded`` ran.

    Prefill-phase compression does not change the prefill forward pass (a layer is cut after its
    own attention ran), so one recorded prefill (keys, values, queries, masks of every layer)
    serves every method and budget whose decision is made from the prefill. Methods that change
    the attention itself (``logit_scale``) cannot share a prefill.
    """
    if not recorded.record_prefill:
        raise ValueError("the source cache did not record its prefill (make it with record_prefill=True)")
    for layer_index, source in enumerate(recorded.layers):
        keys, values, _, _ = source.dense()
        if source.tokens_seen != keys.shape[2]:
            raise ValueError(
                "the recording cache evicted tokens; record with the 'full' method and compress_sliding=True"
            )
        target.layers[layer_index].update(keys, values)
        query, mask, scaling = recorded.prefill_records[layer_index]
        target.after_prefill(layer_index, _prefill_scoring(target, layer_index, query, mask, scaling))


def _decode_dense(module, cache: KVHiveCache, layer_index, query, mask, scaling, dropout, compressed, kwargs):
    store = cache.layers[layer_index]
    policy = cache.policy
    # With a fixed decode capacity: the whole buffers and which slots hold a token.
    keys, values, positions, token_scores, filled = store.decode_view()
    batch, query_heads, num_queries, head_dim = query.shape
    # Several new queries (a prompt chunk) without a model mask over a growing layer: causal by the
    # stored positions, built for one block of queries at a time where it is needed (sdpa's blocks,
    # the scoring's rows) instead of for the whole chunk at once (2,048 queries over ~3,700 stored
    # tokens, 8 heads: 60 MB, the largest tensor of a later chunk).
    causal_by_position = num_queries > 1 and mask is None and filled is None and not store.is_sliding
    if num_queries == 1 and (cache.static_decode or mask is None):
        # A static decode step (transformers' mask is a fixed unused column, get_mask_sizes) or no
        # model mask to gather (none needed, or positions="cache"): the layer masks its tokens itself.
        stored_mask = _stored_decode_mask(store, positions, token_scores)
    elif causal_by_position:
        stored_mask = None  # ScoringInputs reads None as causal over the stored positions
    else:
        stored_mask = _gather_mask(mask, positions, store, num_queries)
    # kvhive's split-K kernel reads the layer's buffers in place and masks only past each row's
    # length: one new query, nothing else masked, eager (a compiled step stays torch, for inductor).
    kernel_eligible = stored_mask is None and num_queries == 1 and not torch.compiler.is_compiling()
    if filled is not None:  # empty slots of a fixed capacity are never attended
        # [C] (one length for every row) or [B, C] (stacked rows of different lengths)
        filled = filled.view(1, 1, 1, -1) if filled.dim() == 1 else filled[:, None, None, :]
        stored_mask = filled if stored_mask is None else stored_mask & filled
    heads = keys.shape[1]
    group = query_heads // heads
    # The new query's weights come with the attention when there is one new query; a prompt chunk
    # (several) runs sdpa and a method's scoring computes what it needs in query chunks instead of
    # materialising [B, H, G, q, L] weights here.
    wants_weights = compressed and DECODE in policy.phases and policy.needs_decode_attention and num_queries == 1
    extra = policy.extra_attention(store.policy_state, query, scaling) if compressed else None
    if policy.changes_attention_logits:  # every layer (BUZZ log n), compressed or not
        query = _row_logit_scale(policy, stored_mask, keys.shape[2], query)

    last_weights = None
    last_logits = None
    accumulated = None

    def make_scoring(phase: str) -> ScoringInputs:
        return ScoringInputs(
            keys=keys,
            values=values,
            queries=query,
            positions=positions,
            mask=stored_mask,
            scaling=scaling,
            layer_index=layer_index,
            num_layers=len(cache.layers),
            sequence_length=store.tokens_seen_device if in_static_step() else store.tokens_seen,
            phase=phase,
            token_scores=dict(token_scores),
            last_query_weights=last_weights,
            last_query_logits=last_logits,
            accumulated_weights=accumulated,
            filled=_filled_count(store),
            known_filled=store.known_length,
            stored_in_order=store.stored_in_order,
            key_probes=probes,
        )

    # Stored keys the method's decision will take products of with every stored key (SubGen's distance
    # block, BumbleBee's joiner): on the CPU they join the rows of the logits' product, so the keys are
    # read once this step (a second pass over them, cold from memory by then, cost SubGen about what
    # the attention's own costs). Float32 only: the methods form float32 products, which a narrower
    # attention product is not.
    probes = None
    if compressed and num_queries == 1 and keys.device.type == "cpu" and keys.dtype == query.dtype == torch.float32:
        probes = cache.decode_key_probes(layer_index, make_scoring)
    # The decision after these queries reads their column sums (H2O's chunk of a chunked prefill):
    # one pass computes them with the output, as a one-shot prefill does, not sdpa and a second QK^T.
    sums_phase = cache.chunk_column_sums_phase(layer_index) if compressed and causal_by_position else None
    if not wants_weights and extra is None and probes is None:
        output = None
        if sums_phase is not None and _plain_softmax_attention(dropout, kwargs):
            output, accumulated = _chunk_attention_with_column_sums(
                query, keys, values, positions, store.tokens_seen, scaling, sums_phase
            )
        elif kernel_eligible and (
            cache.dense_decode == "kernel" or (cache.dense_decode == "auto" and filled is not None)
        ):
            # "auto": a fixed capacity's empty slots would be an sdpa mask, and a masked sdpa has no
            # split-K decode path (one query over 32k masked slots: ~1.7 ms a layer on an H200).
            output = _dense_decode_by_kernel(store, query, scaling)
        if output is None:
            causal_rows = None
            if causal_by_position:

                def causal_rows(start: int, stop: int) -> torch.Tensor:
                    return _stored_causal_rows(store, positions, num_queries, start, stop)

            output = _sdpa_in_query_blocks(query, keys, values, stored_mask, scaling, group, causal_rows)
            output = output.transpose(1, 2)
    elif (
        kernel_eligible
        and extra is None
        and probes is None
        and (by_kernel := _dense_decode_by_kernel(store, query, scaling, True))
    ):
        # The new query's weights from the attention's own pass (issue 23 item 2): on CUDA, where
        # the alternative is the torch pass below (about ten kernels a layer).
        output, weights, logits = by_kernel
        last_weights = weights.view(batch, query_heads, -1)
        last_logits = logits.view(batch, heads, group, 1, -1)  # before any mask, as below
    elif probes is not None and not wants_weights and extra is None and stored_mask is None:
        output = _attention_with_key_probes(query, keys, values, scaling, probes)
    else:
        # [B, H, G*q, d] @ [B, H, d, L]: one matmul per stored head, keys and values read once.
        grouped = query.reshape(batch, heads, group * num_queries, head_dim)
        if keys.dtype == torch.float16:
            # fp16's range ends at 65504: a large q.k overflows before it is scaled (stock sdpa
            # accumulates in fp32 and stays finite), so the logits are formed in fp32. bf16 has
            # fp32's range and keeps the model's dtype.
            logits = torch.matmul(grouped.float(), keys.float().transpose(-1, -2)) * scaling
        else:
            rows = grouped if probes is None else torch.cat([grouped, probes.rows], dim=2)
            logits = torch.matmul(rows, keys.transpose(-1, -2))
            if probes is not None:  # the probes' products, unscaled; the queries' logits go on
                probes.products = logits[:, :, group * num_queries :]
                logits = logits[:, :, : group * num_queries]
            logits = (logits if logits.dtype == torch.float32 else logits.float()) * scaling
        logits = logits.view(batch, heads, group, num_queries, -1)
        # The one new query's logits before the mask (the select below is out of place, so they
        # stay as they are), for a method that scores with other logits (AhaKV's multiplied ones).
        last_logits = logits
        if stored_mask is not None:
            logits = torch.where(stored_mask.unsqueeze(2), logits, float("-inf"))
        row_max = logits.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(logits.dtype).min)
        exponentials = torch.exp(logits - row_max)
        denominator = exponentials.sum(dim=-1)
        # (No .to / .float() calls that change nothing: a float32 model's step skips four.)
        product = exponentials.view(batch, heads, group * num_queries, -1)
        numerator = torch.matmul(product if product.dtype == values.dtype else product.to(values.dtype), values)
        numerator = numerator.view(batch, heads, group, num_queries, head_dim)
        numerator = numerator if numerator.dtype == torch.float32 else numerator.float()
        if extra is not None:
            extra_numerator, extra_denominator, extra_max = (
                t.reshape(batch, heads, group, num_queries, *t.shape[3:]).float() for t in extra
            )
            # An estimate whose denominator (the evicted tokens' estimated mass) is 0 contributes
            # nothing: its max must not set the common scale (exp of the gap would underflow the
            # exact part to 0 and leave 0 / 0, as fp16-sized logits showed).
            extra_max = torch.where(extra_denominator > 0, extra_max, float("-inf"))
            common = torch.maximum(row_max.squeeze(-1), extra_max)
            exact_weight = torch.exp(row_max.squeeze(-1) - common)
            extra_weight = torch.exp(extra_max - common)
            numerator = numerator * exact_weight[..., None] + extra_numerator * extra_weight[..., None]
            denominator = denominator * exact_weight + extra_denominator * extra_weight
            output = numerator / denominator[..., None]
            weights = exponentials * (exact_weight / denominator)[..., None]
            last_weights = weights[:, :, :, -1].reshape(batch, query_heads, -1)
        else:
            denominator = denominator.unsqueeze(-1)
            output = numerator / denominator
            # Only the newest query's weights are read (with one query: all of them, no select); a
            # method here only for its key probes reads none.
            if probes is None or wants_weights:
                if num_queries == 1:
                    last_weights = (exponentials / denominator).view(batch, query_heads, -1)
                else:
                    last_weights = (exponentials[:, :, :, -1:] / denominator[:, :, :, -1:]).view(batch, query_heads, -1)
        output = output if output.dtype == query.dtype else output.to(query.dtype)
        output = output.reshape(batch, query_heads, num_queries, head_dim).transpose(1, 2)

    cache.after_decode(layer_index, _question_scoring(cache, layer_index, query, stored_mask, scaling, make_scoring))
    return output, None


def _attention_with_key_probes(query, keys, values, scaling: float, probes: KeyProbes) -> torch.Tensor:
    """One new query's attention output ``[B, 1, Hq, d]`` over every stored token (nothing masked),
    the key probes' products computed with its logits: ``[G queries; P probes] @ keysᵀ`` per stored
    head, so the keys are read once (``probes.products`` ``[B, H, P, N]``, unscaled), then a softmax
    and the product with the values: what sdpa computes, in the few operations of a one-row
    attention (a method that reads no weights needs no separate exponentials and sums)."""
    batch, query_heads, _, head_dim = query.shape
    heads = keys.shape[1]
    group = query_heads // heads
    rows = torch.cat([query.reshape(batch, heads, group, head_dim), probes.rows], dim=2)
    products = torch.matmul(rows, keys.transpose(-1, -2))
    probes.products = products[:, :, group:]
    weights = torch.softmax(products[:, :, :group] * scaling, dim=-1)
    output = torch.matmul(weights, values)  # [B, H, G, d]: query head h * G + g at [:, h, g]
    return output.reshape(batch, query_heads, 1, head_dim).transpose(1, 2)


def _filled_count(store) -> torch.Tensor | None:
    """``ScoringInputs.filled`` of a decode step: the tokens a fixed capacity holds (0-d), each
    row's (``[B, 1, 1]``) when stacked rows hold different numbers; None for a growing layer."""
    if not store.fixed_capacity:
        return None
    if store.row_lengths_device is not None:
        return store.row_lengths_device.view(-1, 1, 1)
    return store.length_device


def _question_scoring(cache: KVHiveCache, layer_index: int, query, mask, scaling, make_scoring):
    """The scoring factory of a layer after its attention ran. Question-aware chunked prefill
    (``cache.question_copy_tokens`` > 0: the forward is a prompt chunk followed by a copy of the
    prompt's question at the positions right after it): the copy's entries are dropped from the
    layer first (``KVHiveCache.drop_question_copy``), then the method scores what the layer keeps
    (the kept tokens and the chunk) with the copy's queries, which attended them and the copy itself
    as the prompt's question will: SnapKV's observation window is then the question's last queries
    (all of them when the question is shorter than the window), not the chunk's own. The softmax
    of those queries runs over the kept tokens and the chunk only (the question's own entries are
    neither candidates nor in its denominator). Otherwise ``make_scoring`` unchanged.

    ``mask``: the attention's mask over the stored tokens ``[B, 1|H, q, N]`` (its last rows are the
    copy's queries, its first columns the tokens that stay), or None (causal, no padding: the copy
    sees every token before it)."""
    count = cache.question_copy_tokens
    if not count:
        return make_scoring
    store = cache.layers[layer_index]
    sequence_length = store.tokens_seen  # the copy's last position + 1
    cache.drop_question_copy(layer_index)
    questions = query[:, :, -count:]

    def make_question_scoring(phase: str) -> ScoringInputs:
        keys, values, positions, token_scores = _scored_view(cache, store)
        num_keys = keys.shape[2]
        if mask is None:
            # An explicit mask: the copy's queries follow every key (a causal mask read from the
            # shapes would take the last keys for the queries' own tokens).
            rows = torch.ones(1, 1, count, num_keys, dtype=torch.bool, device=keys.device)
        else:
            rows = mask[:, :, -count:, :num_keys]
        return ScoringInputs(
            keys=keys,
            values=values,
            queries=questions,
            positions=positions,
            mask=rows,
            scaling=scaling,
            layer_index=layer_index,
            num_layers=len(cache.layers),
            sequence_length=sequence_length,
            phase=phase,
            token_scores=dict(token_scores),
        )

    return make_question_scoring


def _plain_softmax_attention(dropout, kwargs) -> bool:
    """Whether transformers asked for plain softmax attention (what kvhive's pass with column sums
    computes): no dropout, nothing that changes the logits."""
    return dropout == 0.0 and all(kwargs.get(name) is None for name in _ATTENTION_CHANGES)


def _chunk_attention_with_column_sums(query, keys, values, positions, tokens_seen: int, scaling, phase: str):
    """``(output [B, q, Hq, dv], column sums [B, Hq, L] float32)`` of ``q`` new queries (the newest
    of the ``L`` stored tokens, stored oldest first) over a dense layer's stored tokens, causal by
    their positions, from one pass of query chunks (:meth:`ScoringInputs.attention_with_column_sums`).

    ``phase`` is the phase of the scoring that reads the sums (``KVHiveCache.chunk_column_sums_phase``):
    its chunks and key ranges are the ones that scoring would use for itself, so the sums are its own
    bit for bit and the kept tokens are those of sdpa followed by a second ``QK^T`` pass."""
    return _one_pass_attention_with_column_sums(query, keys, values, positions, None, scaling, tokens_seen, phase)


def _one_pass_attention_with_column_sums(query, keys, values, positions, mask, scaling, sequence_length, phase: str):
    """``(output [B, q, Hq, dv] in the queries' dtype, column sums [B, Hq, L] float32)`` from the
    scoring's own one-pass attention (:meth:`ScoringInputs.attention_with_column_sums`)."""
    scoring = ScoringInputs(
        keys=keys,
        values=values,
        queries=query,
        positions=positions,
        mask=mask,
        scaling=scaling,
        layer_index=0,
        num_layers=1,
        sequence_length=sequence_length,
        phase=phase,
    )
    output, sums = scoring.attention_with_column_sums()
    return output.to(query.dtype).transpose(1, 2), sums


QUERY_BLOCK = 256


def _sdpa_in_query_blocks(query, keys, values, mask, scaling, group: int, block_mask=None) -> torch.Tensor:
    """sdpa of a prompt chunk's queries over the stored tokens, ``QUERY_BLOCK`` queries at a time.

    With a mask, sdpa's CPU path (and CUDA's math fallback) materialises [B, H, q, L] scores and
    their softmax: for a chunk of 2,048 queries over ~2,900 kept + new tokens, 16 heads, that was
    ~750 MB, the whole prefill peak of a chunked prompt. Blocks of queries bound it to a block's
    share; a decode step (one query) is one block. ``block_mask(start, stop)``: the mask of query
    rows ``start..stop-1``, built for each block (``mask`` is then None), so no mask of the whole
    chunk exists at once."""
    heads, query_heads, num_queries = keys.shape[1], query.shape[1], query.shape[2]
    outputs = []
    for start in range(0, num_queries, QUERY_BLOCK):
        block_mask_rows = mask
        if block_mask is not None:
            block_mask_rows = block_mask(start, min(num_queries, start + QUERY_BLOCK))
        elif mask is not None and mask.shape[2] != 1:
            block_mask_rows = mask[:, :, start : start + QUERY_BLOCK]
        if block_mask_rows is not None and block_mask_rows.shape[1] not in (1, query_heads):
            block_mask_rows = block_mask_rows.repeat_interleave(group, dim=1)
        # Stored heads may be query heads (Ada-KV on GQA): sdpa regroups by its own head counts.
        outputs.append(
            torch.nn.functional.scaled_dot_product_attention(
                query[:, :, start : start + QUERY_BLOCK],
                keys,
                values,
                attn_mask=block_mask_rows,
                scale=scaling,
                enable_gqa=heads != query_heads,
            )
        )
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)


def _dense_decode_by_kernel(store, query, scaling, weights: bool = False):
    """One new query over a dense layer through kvhive's split-K kernel, reading the buffer's
    stored slice in place (a fixed capacity: its filled slots, by the device lengths, no host
    read); None when the kernel does not handle these shapes/dtypes. ``weights``: ``(output,
    weights [B * H, G, L])`` with the new query's softmax weights over the slots the attention
    reads (the stored tokens; a fixed capacity's every slot, 0 on the empty ones), and their logits
    before any mask (0 on the empty slots)."""
    if not kernel_runs_on(query):  # (the CPU: no views made for nothing at every step)
        return None
    batch, query_heads, _, head_dim = query.shape
    segments = batch * store.num_heads
    rows = query.reshape(segments, query_heads // store.num_heads, head_dim)
    buffer_keys, buffer_values = store.buffers()
    keys, values = buffer_keys.view(-1, head_dim), buffer_values.view(-1, buffer_values.shape[-1])
    if not kernel_supports(rows, keys, values):
        return None
    capacity = buffer_keys.shape[2]
    if store.fixed_capacity:
        if store.row_lengths_device is not None:  # stacked rows: each row its own length, all its heads
            lengths = store.row_lengths_device.repeat_interleave(store.num_heads, output_size=segments)
        else:
            lengths = store.length_device.expand(segments).contiguous()  # the kernel reads one per segment
        starts = torch.arange(segments, device=query.device) * capacity
        result = varlen_attention_kernel(
            rows, keys, values, scaling, capacity, segment_start=starts, segment_length=lengths, return_weights=weights
        )
    else:
        length = store.dense_length
        result = varlen_attention_kernel(
            rows, keys, values, scaling, length, uniform=(capacity, store.slice_start, length), return_weights=weights
        )
    output = (result[0] if weights else result).view(batch, query_heads, 1, -1).transpose(1, 2)
    return (output, *result[1:]) if weights else output


def _decode_packed_static(cache: KVHiveCache, layer_index, query, scaling):
    """One new query over a packed layer (heads holding different counts) with shapes that do not
    change from step to step, so a compiled step serves every later one: attention reads every page
    of the buffers (or, on CUDA, each segment up to the largest capacity) and masks the slots past
    each segment's device length, and the left padding recorded at prefill. No host value is read."""
    store = cache.layers[layer_index]
    batch, query_heads, _, head_dim = query.shape
    heads = store.num_heads
    keys, values, _, segment_start, segment_length, slot_scores = store.packed_buffers()
    page_segment, page_offset, bound = store.packed_pages()
    padding = slot_scores.get(PADDING_SCORE)  # [C], aligned with the buffers' slots (0 when empty)
    output = varlen_attention_paged(
        query.reshape(batch * heads, query_heads // heads, head_dim),
        keys,
        values,
        segment_start,
        segment_length,
        page_segment,
        page_offset,
        bound,
        scaling,
        allowed=None if padding is None else padding == 0,
    )
    return output.reshape(batch, query_heads, 1, -1).transpose(1, 2)


def _decode_variable_length(cache: KVHiveCache, layer_index, query, mask, scaling):
    """Attention when heads hold different numbers of tokens, without padding them: each
    (batch, head) segment is attended by its group's query rows (``kvhive.attention.varlen``)."""
    store = cache.layers[layer_index]
    batch, query_heads, num_queries, head_dim = query.shape
    heads = store.num_heads
    group = query_heads // heads
    keys, values, positions, segment_start, segment_length, max_length = store.packed()
    rows = query.reshape(batch, heads, group, num_queries, head_dim).reshape(
        batch * heads, group * num_queries, head_dim
    )
    if mask is None and num_queries > 1:
        mask = _full_mask(None, batch, num_queries, store.tokens_seen, None, query.device)
    flat_mask = None if mask is None else mask[:, 0]
    output = varlen_attention(
        rows,
        keys,
        values,
        segment_start,
        segment_length,
        store.lengths_host.reshape(-1),
        max_length,
        scaling,
        positions=positions,
        mask=flat_mask,
        heads=heads,
        num_queries=num_queries,
        segment_capacity_host=store.segment_capacity_host,
        page=PAGE_TOKENS,
    )
    output = output.reshape(batch, query_heads, num_queries, -1)
    return output.transpose(1, 2)
