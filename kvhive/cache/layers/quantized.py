"""Quantized storage: a layer's kept keys and values held as int8 or packed int4 codes with scales.

A token's key (and its value) is stored as one row of bytes: a float16 scale and a float16 minimum
(4 bytes, first), then its codes, one byte each (``kv_bits=8``) or two per byte (``kv_bits=4``, the
even channel in the low nibble). The row is what every layout moves: a compaction, a filled hole,
packing, row selection copy whole rows of the byte buffers, so a token's codes and its scales move
together and no kept token is ever re-quantized (a scale shared by a group of slots would have to be
recomputed each time an eviction reshuffles the group, and each recomputation adds error).

* **Keys: per channel, then per token.** Keys have outlier channels (KIVI), so each channel of each
  stored head is first divided by its absolute maximum over the layer's first update (the prompt, or
  its first chunk): ``channel_scale`` ``[B, H, d]`` float32, held per layer and moved with the rows
  of a batch. The normalised key is then quantized per token (asymmetric: scale and minimum).
* **Values: per token** (asymmetric), as KIVI found best.
* **Full-precision window: none.** Scales are per token, so a new token needs no group of newer
  tokens to be quantized: it is stored quantized as it arrives, and attention in its own step reads
  it dequantized like every other token (scoring sees the same numbers).

:class:`KVCodec` encodes on append and dequantizes what attention and scoring read: a whole view
(``dense_view``, a prefill's or a fallback route's copy of one layer), or a block of slots at a time
(``dequantize_block``, the decode attention of :mod:`kvhive.attention.quantized_decode`).
"""

from __future__ import annotations

import torch

ACCEPTED_KV_BITS = (4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SCALE_BYTES = 4
"""Per stored row (one token's key, or its value, in one head): float16 scale + float16 minimum."""
FULL_PRECISION_WINDOW = 0
"""Newest tokens kept unquantized (see the module docstring: per-token scales need none)."""
FLOAT16_MAX = 65504.0


def check_kv_bits(kv_bits) -> int | None:
    """``kv_bits`` as given (None: full precision), or a ValueError naming it and the accepted values."""
    if kv_bits is None:
        return None
    if isinstance(kv_bits, bool) or not isinstance(kv_bits, int) or kv_bits not in ACCEPTED_KV_BITS:
        raise ValueError(
            f"invalid kv_bits={kv_bits!r}: expected one of {', '.join(map(str, ACCEPTED_KV_BITS))} "
            "(or None for full precision)"
        )
    return kv_bits


def code_bytes(dim: int, bits: int) -> int:
    """Bytes of one row's codes for ``dim`` channels."""
    return dim if bits == 8 else dim // 2


def row_bytes(dim: int, bits: int) -> int:
    """Bytes of one stored row: scale and minimum, then the codes."""
    return SCALE_BYTES + code_bytes(dim, bits)


def quantize_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x [..., d]`` (float) as rows of bytes ``[..., row_bytes(d, bits)]`` (asymmetric, per row)."""
    levels = (1 << bits) - 1
    x = x.float()
    low = x.amin(dim=-1, keepdim=True).clamp(-FLOAT16_MAX, FLOAT16_MAX)
    high = x.amax(dim=-1, keepdim=True).clamp(-FLOAT16_MAX, FLOAT16_MAX)
    # The float16 numbers the row keeps, so the codes are computed with what dequantization reads.
    scale = ((high - low) / levels).clamp(min=1e-7, max=FLOAT16_MAX).half()
    low = low.half()
    codes = torch.round((x - low.float()) / scale.float()).clamp_(0, levels).to(torch.uint8)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    header = torch.cat([scale, low], dim=-1).view(torch.int16)
    header = torch.stack([(header & 0xFF).to(torch.uint8), ((header >> 8) & 0xFF).to(torch.uint8)], dim=-1)
    return torch.cat([header.flatten(-2), codes], dim=-1)


def row_scales(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, minimum)`` of rows of bytes, float32 ``[..., 1]`` each."""
    header = rows[..., :SCALE_BYTES].to(torch.int16)
    halves = (header[..., 0::2] | (header[..., 1::2] << 8)).view(torch.float16).float()
    return halves[..., 0:1], halves[..., 1:2]


def code_planes(rows: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """The codes of rows of bytes as float32: ``[codes [..., d]]`` (int8), or ``[even channels, odd
    channels]`` ``[..., d / 2]`` each (int4: the low and high nibbles, not interleaved)."""
    codes = rows[..., SCALE_BYTES:]
    if bits == 8:
        return [codes.float()]
    return [(codes & 0x0F).float(), (codes >> 4).float()]


def dequantize_rows(rows: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Rows of bytes (:func:`quantize_rows`) as float32 ``[..., dim]``."""
    scale, low = row_scales(rows)
    planes = code_planes(rows, bits)
    codes = planes[0] if bits == 8 else torch.stack(planes, dim=-1).flatten(-2)
    return torch.addcmul(low, codes, scale)


class KVCodec:
    """One layer's quantization: ``bits``, the model's head sizes and dtype (learned at the first
    encode, checked then), and the keys' per-channel scales ``[B, H, d]`` (float32)."""

    def __init__(self, bits: int) -> None:
        self.bits = check_kv_bits(bits)
        self.key_dim = self.value_dim = 0
        self.dtype: torch.dtype | None = None
        self.channel_scale: torch.Tensor | None = None

    def reset(self) -> None:
        """An emptied layer: the next update sets the channel scales again."""
        self.channel_scale = None

    def check_model(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Refuse, naming ``kv_bits``, a model dtype or a head size the packing cannot serve."""
        if keys.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"kv_bits={self.bits} needs a float32, float16 or bfloat16 model; its keys are {keys.dtype} "
                "(use kv_bits=None for this model)"
            )
        if self.bits == 4 and (keys.shape[-1] % 2 or values.shape[-1] % 2):
            raise ValueError(
                f"kv_bits=4 packs two channels per byte: head sizes must be even, got keys {keys.shape[-1]} and "
                f"values {values.shape[-1]} (use kv_bits=8, or None)"
            )

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens ``[B, H, n, d]`` as byte rows; the first update sets the channel scales."""
        if self.channel_scale is None:
            self.check_model(keys, values)
            self.dtype, self.key_dim, self.value_dim = keys.dtype, keys.shape[-1], values.shape[-1]
            largest = keys.detach().abs().amax(dim=2).float()
            self.channel_scale = torch.where(largest > 0, largest, torch.ones_like(largest))
        scale = self.channel_scale if keys.shape[:2] == self.channel_scale.shape[:2] else None
        if scale is None:
            raise RuntimeError(
                f"quantized keys of shape {tuple(keys.shape)} do not match the layer's channel scales "
                f"{tuple(self.channel_scale.shape)}"
            )
        return quantize_rows(keys.float() / scale[:, :, None], self.bits), quantize_rows(values, self.bits)

    # -- dequantization -------------------------------------------------------------------------
    def keys_of(self, rows: torch.Tensor, channel_scale: torch.Tensor) -> torch.Tensor:
        """Key rows ``[..., row]`` as float32 keys, times ``channel_scale`` (broadcast to them)."""
        return dequantize_rows(rows, self.bits, self.key_dim) * channel_scale

    def values_of(self, rows: torch.Tensor) -> torch.Tensor:
        return dequantize_rows(rows, self.bits, self.value_dim)

    def dequantize_block(self, key_rows, value_rows, start: int, stop: int):
        """Slots ``[start, stop)`` of dense byte buffers ``[B, H, C, row]`` as float32 keys and values."""
        keys = self.keys_of(key_rows[:, :, start:stop], self.channel_scale[:, :, None])
        return keys, self.values_of(value_rows[:, :, start:stop])

    def append(self, store, key_states: torch.Tensor, value_states: torch.Tensor, positions, new_tokens: int):
        """``LayerStore.update``'s append for byte rows: the new tokens encoded, appended and counted.
        A decode step's attention reads the bytes; a prompt's reads the stored rows dequantized."""
        keys, values = self.encode(key_states, value_states)
        views = store.layout.append(keys, values, positions, new_tokens)
        store.seen.advance(new_tokens)
        if store.row_seen is not None:
            store.row_seen.advance(new_tokens)
        return views if new_tokens == 1 and not store.in_prefill else self.dense_view(views)

    def dense_view(self, view: tuple) -> tuple:
        """A dense view (``(keys, values, ...)`` of byte rows ``[B, H, L, row]``) with the keys and values
        dequantized to the model's dtype (a copy of the view's tokens)."""
        keys, values, *rest = view
        keys = self.keys_of(keys, self.channel_scale[:, :, None]).to(self.dtype)
        return (keys, self.values_of(values).to(self.dtype), *rest)

    def flat_view(self, view: tuple, segment_capacity: torch.Tensor) -> tuple:
        """A packed view (``(keys [C, row], values [C, row], ...)``, segment ``s`` holding
        ``segment_capacity[s]`` slots in order) with keys and values dequantized to the model's dtype."""
        keys, values, *rest = view
        scale = self.channel_scale.reshape(-1, self.key_dim)
        slot_segment = torch.repeat_interleave(
            torch.arange(scale.shape[0], device=keys.device), segment_capacity, output_size=keys.shape[0]
        )
        keys = self.keys_of(keys, scale.index_select(0, slot_segment)).to(self.dtype)
        return (keys, self.values_of(values).to(self.dtype), *rest)

    def stored_keys(self, rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Key rows ``[T, row]`` of the stored tokens in segment order (segment ``s`` holding
        ``lengths[s]``, host) as keys in the model's dtype."""
        scale = self.channel_scale.reshape(-1, self.key_dim)
        segment = torch.repeat_interleave(torch.arange(scale.shape[0]), lengths, output_size=rows.shape[0])
        return self.keys_of(rows, scale.index_select(0, segment.to(rows.device))).to(self.dtype)

    # -- rows and heads -------------------------------------------------------------------------
    def select_rows(self, device_index: torch.Tensor) -> None:
        if self.channel_scale is not None:
            self.channel_scale = self.channel_scale.index_select(0, device_index)

    def expand_to_query_heads(self, heads_per_kv_head: int) -> None:
        if self.channel_scale is not None:
            self.channel_scale = self.channel_scale.repeat_interleave(heads_per_kv_head, dim=1)

    # -- accounting -----------------------------------------------------------------------------
    def full_precision_bytes_per_token(self) -> int:
        """Key + value bytes of one token in one head at the model's dtype (what it would hold unquantized)."""
        return (self.key_dim + self.value_dim) * torch.empty((), dtype=self.dtype).element_size()

    def metadata_nbytes(self) -> int:
        """Bytes of the per-channel key scales."""
        scale = self.channel_scale
        return 0 if scale is None else scale.numel() * scale.element_size()


def install_codecs(layers, kv_bits, positions: str) -> int | None:
    """Give every layer store a :class:`KVCodec` of ``kv_bits`` (checked; None: none). Re-indexed
    positions are refused: they rewrite the stored keys after every step, which quantized keys cannot
    take without re-quantizing them each time."""
    kv_bits = check_kv_bits(kv_bits)
    if kv_bits is not None and positions == "cache":
        raise ValueError(f"kv_bits={kv_bits} is not supported with positions='cache' (use positions='original')")
    for store in layers:
        store.codec = None if kv_bits is None else KVCodec(kv_bits)
    return kv_bits


def refuse_quantized_rows(caches) -> None:
    """Stacking or adding rows copies dequantized rows into full-precision buffers: refused by name."""
    for cache in caches:
        if getattr(cache, "kv_bits", None) is not None:
            raise ValueError(
                f"caches with kv_bits={cache.kv_bits} cannot be stacked or joined (kvhive.generate_batch, "
                "KVHiveCache.stack/add_rows): use kv_bits=None there"
            )
