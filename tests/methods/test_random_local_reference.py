"""Random+Local's kept tokens against a brute-force reference written from its description
(kvhive/methods/random_local.py), outside the golden file: of a budget ``b`` the most recent
``b - floor(b * (1 - recent_fraction))`` real tokens, and of the older real tokens seen so far the
ones with the highest priorities, a token's priority being ``1 - u`` with ``u`` the counter hash of
``(derived seed of (seed, layer), head, the token's index among its row's real tokens)``.

The reference recomputes the hash in plain Python integers (Wellons' lowbias32 finaliser, two
rounds per folded index; kvhive/methods/counter_random.py) and the derived seed from its formula,
so a change to the recent split, to what a draw is indexed by (head, layer, seed, the index among
real tokens), or to the hash itself fails here, whatever the golden file records.
"""

from __future__ import annotations

import pytest
import torch

from kvhive import make_cache
from kvhive.models.tiny import tiny_model
from tests.helpers import left_padded_batch

WORD = 0xFFFFFFFF


def mix(word: int) -> int:
    word ^= word >> 16
    word = (word * 0x7FEB352D) & WORD
    word ^= word >> 15
    word = (word * 0x46CA68B7) & WORD
    return word ^ (word >> 16)


def fold(word: int, *indices: int) -> int:
    for index in indices:
        word = mix(mix(((word ^ (index & WORD)) + 0x9E3779B9) & WORD))
    return word


def priority(seed: int, layer: int, head: int, index: int) -> float:
    """``1 - u``: u the 24-bit uniform of (seed derived for the layer, head, index)."""
    layer_seed = (seed * 1_000_003 + layer) % 2**63
    word = fold(layer_seed & WORD, (layer_seed >> 32) & WORD, head, index)
    return 1.0 - (word >> 8) / 2**24


def reference_kept(seed: int, layer: int, head: int, first_real: int, seen: int, budget: int, fraction: float):
    """The positions a row keeps after ``seen`` tokens, its first real one at ``first_real``."""
    real = list(range(first_real, seen))
    if len(real) <= budget:
        return real
    recent_count = budget - int(budget * (1.0 - fraction))
    older = real[: len(real) - recent_count]
    # Highest priority first; among equal ones the later token (kvhive.methods.base.top_indices).
    ranked = sorted(older, key=lambda p: (priority(seed, layer, head, p - first_real), p), reverse=True)
    return sorted(ranked[: budget - recent_count] + real[len(real) - recent_count :])


def test_the_reference_hash_is_the_counter_hash():
    """The plain-integer hash equals kvhive's tensor one on a few indices (so the tests below
    compare kept sets, not two hash implementations that happen to differ)."""
    from kvhive.methods.base import derived_seed
    from kvhive.methods.counter_random import fold as tensor_fold
    from kvhive.methods.counter_random import hashed_words, uniforms_of

    index = torch.arange(50)
    for seed, layer, head in [(0, 0, 0), (3, 1, 1), (2**40 + 5, 7, 3)]:
        words = tensor_fold(hashed_words(derived_seed(seed, layer), torch.tensor(head)), index)
        expected = [priority(seed, layer, head, i) for i in range(50)]
        assert (1.0 - uniforms_of(words)).tolist() == expected


@torch.no_grad()
@pytest.mark.parametrize(
    "seed,budget,fraction",
    # recent counts: 10 - int(10 * 0.5) = 5; 10 - int(10 * 0.7) = 3 (0.7 * 10 is 7.000000000000001);
    # 13 - int(13 * 0.75) = 4 (int(13 * 0.25) would be 3); fraction 0: 9 - int(9 * 1.0) = 0 (no recent
    # window); fraction 1: 9 - int(9 * 0.0) = 9 (all recent).
    [(1, 10, 0.5), (5, 10, 0.3), (2**40 + 7, 13, 0.25), (0, 9, 0.0), (4, 9, 1.0)],
)
def test_prefill_and_every_decode_step_keep_the_reference_tokens(seed, budget, fraction):
    model = tiny_model("llama", "gqa")
    pad = 7
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=pad)
    cache = make_cache(model, "random", budget=budget, seed=seed, recent_fraction=fraction)
    first_real = [0, pad]  # row 1 is left-padded: its draws are indexed from its first real token
    output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    mask = attention_mask
    for step in range(12):
        seen = input_ids.shape[1] + step
        for layer in cache.compressed_layers:
            positions = cache.layers[layer].dense()[2]
            for row in range(2):
                for head in range(positions.shape[1]):
                    kept = sorted(positions[row, head].tolist())
                    expected = reference_kept(seed, layer, head, first_real[row], seen, budget, fraction)
                    assert kept == expected, (step, layer, row, head)
        token = output.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)


def test_heads_and_layers_draw_differently():
    """The reference's draws differ across heads and layers for the same token (so the comparison
    above would see a hash that ignored either)."""
    assert len({priority(1, layer, head, 3) for layer in range(2) for head in range(2)}) == 4
