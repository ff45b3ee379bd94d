"""A decode step over a layer stored quantized (``kv_bits``): attention that reads the byte buffers a
block of slots at a time, never a dequantized copy of the whole layer.

One new query over equal head counts (the steady step): :func:`blockwise_attention` dequantizes
``BLOCK_TOKENS`` slots of keys and values at a time and folds them into an online softmax (running
maximum, denominator and weighted sum, all float32), so what it holds beyond the byte buffers is one
block of float keys and values plus the logits ``[B, Hq, L]`` (a head size smaller than the keys).
The logits give the new query's weights to a method that scores by them, from the same numbers the
output was computed with. A method scores (``make_scoring``, only when the cache's decision asks for
it) from the dequantized view of the layer (``LayerStore.decode_view``): what attention read.

Everything else (a prompt chunk after the prefill, a method's estimated extra attention or key
probes, heads holding different counts) takes the routes of :mod:`kvhive.attention.decode` over the
dequantized view of the layer: one layer's copy, made for that step.
"""

from __future__ import annotations

import torch

from kvhive import static_step
from kvhive.attention.decode import decode_dense, decode_packed
from kvhive.attention.masks import dense_step_mask, row_logit_scale
from kvhive.attention.scoring import build_scoring, filled_count
from kvhive.cache.layers.quantized import code_planes, row_scales
from kvhive.methods.scoring import ScoringInputs

BLOCK_TOKENS = 256


class ScoringOverBytes(ScoringInputs):
    """The :class:`ScoringInputs` of a decode step over a quantized layer: ``keys`` and ``values``
    are dequantized (``dequantize``: the layer's ``decode_view``, one copy) when a method first reads
    them, so a method that scores by the attention's weights, positions or its own per-token scores
    never makes the copy. Their sizes come from the byte rows (``[B, H, L, row]``)."""

    dequantize = None
    dequantized = None

    def dequantized_view(self):
        if self.dequantized is None:
            self.dequantized = self.dequantize()[:2]
        return self.dequantized

    @property
    def keys(self) -> torch.Tensor:
        return self.dequantized_view()[0]

    @keys.setter
    def keys(self, rows: torch.Tensor) -> None:
        self.key_rows = rows

    @property
    def values(self) -> torch.Tensor:
        return self.dequantized_view()[1]

    @values.setter
    def values(self, rows: torch.Tensor) -> None:
        self.value_rows = rows

    @property
    def token_shape(self) -> torch.Size:
        return self.key_rows.shape[:3]

    @property
    def batch_size(self) -> int:
        return self.key_rows.shape[0]

    @property
    def num_heads(self) -> int:
        return self.key_rows.shape[1]

    @property
    def num_tokens(self) -> int:
        return self.key_rows.shape[2]

    @property
    def group_size(self) -> int:
        return self.queries.shape[1] // self.key_rows.shape[1]

    @property
    def valid(self) -> torch.Tensor:
        """As :attr:`ScoringInputs.valid`, its device read from the positions (the keys are not made)."""

        def compute() -> torch.Tensor:
            if self.mask is None:
                last_row = torch.ones(1, 1, self.num_tokens, dtype=torch.bool, device=self.positions.device)
            else:
                last_row = self.mask[:, :, -1, :]
            return last_row.expand(self.batch_size, self.num_heads, self.num_tokens)

        return self.once("valid", compute)


def decode_quantized(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs):
    """A forward after the prefill over a quantized layer; transformers' pair (module docstring)."""
    store = cache.layers[layer_index]
    traits = cache.traits
    if not store.is_uniform:
        return decode_packed(cache, layer_index, query, mask, scaling, compressed)
    needs_full_view = query.shape[2] != 1 or (
        compressed and (traits.attends_outside_cache or (traits.takes_key_probes and traits.has_decode))
    )
    if needs_full_view:
        return decode_dense(module, cache, layer_index, query, mask, scaling, dropout, compressed, kwargs)
    return decode_step_blockwise(cache, layer_index, query, mask, scaling, compressed)


def decode_step_blockwise(cache, layer_index, query, mask, scaling, compressed: bool):
    """One new query over a dense quantized layer (:func:`blockwise_attention`), then the decision."""
    store = cache.layers[layer_index]
    policy, traits = cache.policy, cache.traits
    key_rows, value_rows, positions, token_scores, filled = store.layout.decode_view()
    stored_mask, _, _ = dense_step_mask(store, positions, token_scores, filled, mask, 1, cache.layout_plan.compileable)
    if traits.changes_attention_logits:
        query = row_logit_scale(policy, stored_mask, key_rows.shape[2], query)
    wants_weights = compressed and traits.needs_decode_attention and traits.has_decode
    output, weights, logits, _ = blockwise_attention(
        query, store.codec, key_rows, value_rows, stored_mask, scaling, wants_weights
    )

    def make_scoring(phase: str):
        inputs = build_scoring(
            cache,
            layer_index,
            phase,
            (key_rows, value_rows, positions, token_scores),
            query,
            stored_mask,
            scaling,
            store.tokens_seen_device if static_step.in_static_step() else store.tokens_seen,
            last_query_weights=weights,
            last_query_logits=logits,
            filled=filled_count(store),
            known_filled=store.layout.known_length,
            stored_in_order=store.stored_in_order,
            inputs_class=ScoringOverBytes,
        )
        inputs.dequantize = store.decode_view
        return inputs

    cache.compressor.after_decode(cache, layer_index, make_scoring)
    return output, None


def blockwise_attention(
    query, codec, key_rows, value_rows, stored_mask, scaling: float, wants_weights: bool, keep_blocks: bool = False
):
    """``(output [B, 1, Hq, dv], weights [B, Hq, L] or None, logits [B, H, G, 1, L] or None, dequantized)``
    of one query per head over byte buffers ``[B, H, L, row]``, ``BLOCK_TOKENS`` slots at a time (online
    softmax in float32). ``stored_mask`` ``[B, 1|H, 1, L]`` (True: attended) or None; the logits are
    returned before it, as the explicit-softmax route returns them. ``keep_blocks``: the dequantized
    keys and values of every block, joined in the model's dtype (``dequantized``; else None).

    The products read the codes, not dequantized keys and values: a key is ``(codes x scale + minimum)
    x channel_scale``, so ``q . key = scale (q' . codes) + minimum sum(q')`` with ``q' = q x
    channel_scale`` (once a step), and the output's ``sum_j p_j value_j = (p x scale) @ codes +
    p . minimum``: the per-token scales apply to the ``[.., block]`` products, never to ``[block, d]``
    floats. At int4 the even and odd channels are two products over the two nibbles."""
    batch, query_heads, _, head_dim = query.shape
    heads, length = key_rows.shape[1], key_rows.shape[2]
    group = query_heads // heads
    bits = codec.bits
    rows = query.reshape(batch, heads, group, head_dim).float() * codec.channel_scale[:, :, None]
    query_planes = [rows] if bits == 8 else [rows[..., 0::2], rows[..., 1::2]]
    query_sum = rows.sum(dim=-1, keepdim=True)  # [B, H, G, 1]
    running_max = rows.new_full((batch, heads, group, 1), float("-inf"))
    denominator = rows.new_zeros(batch, heads, group, 1)
    planes = 1 if bits == 8 else 2
    numerators = [rows.new_zeros(batch, heads, group, codec.value_dim // planes) for _ in range(planes)]
    value_low_sum = rows.new_zeros(batch, heads, group, 1)
    all_logits, key_blocks, value_blocks = [], [], []
    for start in range(0, length, BLOCK_TOKENS):
        stop = min(length, start + BLOCK_TOKENS)
        key_block, value_block = key_rows[:, :, start:stop], value_rows[:, :, start:stop]
        if keep_blocks:
            keys, values = codec.dequantize_block(key_rows, value_rows, start, stop)
            key_blocks.append(keys.to(query.dtype))
            value_blocks.append(values.to(query.dtype))
        key_scale, key_low = row_scales(key_block)  # [B, H, b, 1]
        products = None
        for plane_query, plane in zip(query_planes, code_planes(key_block, bits), strict=True):
            product = torch.matmul(plane_query, plane.transpose(-1, -2))
            products = product if products is None else products + product
        logits = (products * key_scale.transpose(-1, -2) + query_sum * key_low.transpose(-1, -2)) * scaling
        if wants_weights:
            all_logits.append(logits)
        if stored_mask is not None:
            logits = torch.where(stored_mask[:, :, 0, start:stop].unsqueeze(2), logits, float("-inf"))
        block_max = torch.maximum(running_max, logits.amax(dim=-1, keepdim=True))
        safe_max = block_max.clamp_min(torch.finfo(torch.float32).min)
        correction = torch.exp(running_max - safe_max)
        exponentials = torch.exp(logits - safe_max)  # [B, H, G, b]
        value_scale, value_low = row_scales(value_block)
        denominator = denominator * correction + exponentials.sum(dim=-1, keepdim=True)
        value_low_sum = value_low_sum * correction + torch.matmul(exponentials, value_low)
        scaled = exponentials * value_scale.transpose(-1, -2)
        for index, plane in enumerate(code_planes(value_block, bits)):
            numerators[index] = numerators[index] * correction + torch.matmul(scaled, plane)
        running_max = block_max
    numerator = numerators[0] if bits == 8 else torch.stack(numerators, dim=-1).flatten(-2)
    output = (numerator + value_low_sum) / denominator
    output = output.to(query.dtype).reshape(batch, query_heads, 1, -1).transpose(1, 2)
    dequantized = (torch.cat(key_blocks, dim=2), torch.cat(value_blocks, dim=2)) if keep_blocks else None
    if not wants_weights:
        return output, None, None, dequantized
    logits = torch.cat(all_logits, dim=-1) if len(all_logits) > 1 else all_logits[0]
    masked = logits if stored_mask is None else torch.where(stored_mask[:, :, 0].unsqueeze(2), logits, float("-inf"))
    safe_max = running_max.clamp_min(torch.finfo(torch.float32).min)
    weights = (torch.exp(masked - safe_max) / denominator).reshape(batch, query_heads, length)
    return output, weights, logits.view(batch, heads, group, 1, length), dequantized
