"""Counter-based random numbers computed on the tensors' device (random+local's priorities,
subgen-attention's reservoir and ℓ2 draws).

A draw is a pure function of integers: ``uniform(seed, a, b, ...)`` hashes the seed and the index
tensors ``a, b, ...`` (broadcast together) into floats in ``[0, 1)``. Nothing is read back to the
host and no generator state advances, so a decode step that draws makes no host read and launches
a fixed number of integer kernels (a CUDA graph can capture it); a draw depends only on what it is
indexed by (e.g. layer, head, the token's index in its row's stream), so a row of a padded batch
draws what it draws alone whatever the rest of the batch.

The mixer is Wellons' "lowbias32" finaliser (two multiply-xorshift steps over 32-bit words, applied
twice per input),
computed in int64 with every product below ``2**63`` (the multipliers are < ``2**31``), so no
integer overflow happens on any device. Each index is folded in by xor-ing it into the running
hash, adding a constant and mixing, so every index changes every bit of the result.
"""

from __future__ import annotations

import torch

_WORD = 0xFFFFFFFF
# Odd multipliers below 2**31 (products with a 32-bit word stay below 2**63 in int64).
_MULTIPLIER_A = 0x7FEB352D
_MULTIPLIER_B = 0x46CA68B7
# Added before mixing, so a zero input does not stay zero (the mixer maps 0 to 0).
_INCREMENT = 0x9E3779B9  # 2**32 / golden ratio
_UNIFORM_BITS = 24  # float32 holds 24 significant bits: every value k / 2**24 is exact


def _mix(word: torch.Tensor) -> torch.Tensor:
    """One 32-bit avalanche round over int64 tensors holding values in ``[0, 2**32)``."""
    word = word ^ (word >> 16)
    word = (word * _MULTIPLIER_A) & _WORD
    word = word ^ (word >> 15)
    word = (word * _MULTIPLIER_B) & _WORD
    return word ^ (word >> 16)


def fold(word: torch.Tensor, *indices: torch.Tensor | int) -> torch.Tensor:
    """Continue a hash: mix each of ``indices`` (int tensors or ints, broadcast with ``word``;
    negative values allowed) into ``word`` (int64 words in ``[0, 2**32)``)."""
    for index in indices:
        if isinstance(index, torch.Tensor):
            index = index.to(torch.int64) & _WORD
        else:
            index = index & _WORD
        # Two rounds per input: one round maps small inputs almost linearly (x -> 2x doubles the
        # output), two avalanche.
        word = _mix(_mix(((word ^ index) + _INCREMENT) & _WORD))
    return word


def hashed_words(seed: int, *indices: torch.Tensor | int) -> torch.Tensor:
    """``int64`` words in ``[0, 2**32)``: a hash of ``seed`` (any non-negative int) and the
    ``indices`` (int tensors or ints, broadcast together; negative values are allowed)."""
    tensors = [index for index in indices if isinstance(index, torch.Tensor)]
    if not tensors:
        raise ValueError("hashed_words needs at least one index tensor (the shape and device of the draw)")
    word = torch.full((), seed & _WORD, dtype=torch.int64, device=tensors[0].device)
    return fold(word, (seed >> 32) & _WORD, *indices)


def uniforms_of(word: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uniforms in ``[0, 1)`` on a grid of ``2**-24`` from hashed words."""
    return (word >> (32 - _UNIFORM_BITS)).to(dtype) * (1.0 / (1 << _UNIFORM_BITS))


def second_word(word: torch.Tensor) -> torch.Tensor:
    """Another word, independent of ``word`` in practice: two uniforms from one hash."""
    return _mix(_mix((word + _INCREMENT) & _WORD))


def uniform(seed: int, *indices: torch.Tensor | int) -> torch.Tensor:
    """``float32`` uniforms in ``[0, 1)`` on a grid of ``2**-24``, indexed by ``indices``."""
    return uniforms_of(hashed_words(seed, *indices))


def uniform_float64(seed: int, *indices: torch.Tensor | int) -> torch.Tensor:
    """``float64`` uniforms in ``[0, 1)`` on a grid of ``2**-48`` (two 24-bit draws), for
    probabilities that may be far below ``2**-24`` (a reservoir coin ``1/n`` of a long stream)."""
    word = hashed_words(seed, *indices)
    low = second_word(word)
    high_part = (word >> (32 - _UNIFORM_BITS)).to(torch.float64)
    low_part = (low >> (32 - _UNIFORM_BITS)).to(torch.float64)
    return (high_part + low_part * (1.0 / (1 << _UNIFORM_BITS))) * (1.0 / (1 << _UNIFORM_BITS))
