"""The example scorer ``vnorm``: a new score-based method is one small module plus a registry line."""

from __future__ import annotations

from pathlib import Path

import torch

import kvhive
from kvhive.methods import make_policy
from kvhive.methods.base import ScoringInputs

from helpers import left_padded_batch, prefill_and_decode


def _scoring(values: torch.Tensor, valid_from: int = 0) -> ScoringInputs:
    b, h, n, d = values.shape
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    mask[..., :valid_from] = False
    return ScoringInputs(
        keys=torch.randn(b, h, n, d),
        values=values,
        queries=torch.randn(b, h, 1, d),
        positions=torch.arange(n).expand(b, h, n),
        mask=mask,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase="prefill",
    )


def test_keeps_the_largest_value_norms_plus_the_window():
    values = torch.zeros(1, 2, 10, 4)
    values[0, 0, :, 0] = torch.tensor([5.0, 1, 9, 2, 8, 3, 0, 0, 0, 0])
    values[0, 1, :, 0] = torch.tensor([0.0, 7, 0, 6, 0, 5, 4, 0, 0, 0])
    keep = make_policy("vnorm", window=2).select_prefill(_scoring(values), 5, {})
    assert torch.nonzero(keep[0, 0]).flatten().tolist() == [0, 2, 4, 8, 9]
    assert torch.nonzero(keep[0, 1]).flatten().tolist() == [1, 3, 5, 8, 9]
    # Padding (first 3 tokens of the row) is never kept while real tokens remain.
    keep = make_policy("vnorm", window=2).select_prefill(_scoring(values, valid_from=3), 5, {})
    assert not keep[0, :, :3].any() and (keep.sum(-1) == 5).all()


def test_runs_both_phases_and_under_ada_kv():
    from kvhive.models import tiny_model

    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=40)
    for method in ("vnorm", "ada-vnorm"):
        cache = kvhive.make_cache(model, method, budget=12)
        logits = prefill_and_decode(model, cache, input_ids, attention_mask, steps=5)
        assert torch.isfinite(logits).all()
        for layer in cache.compressed_layers:
            kept = cache.layers[layer].lengths_host
            assert int(kept.sum(-1).max()) <= (12 + (0 if method == "vnorm" else 5)) * kept.shape[1]


def test_module_is_at_most_40_lines():
    import kvhive.methods.vnorm as module

    assert len(Path(module.__file__).read_text().splitlines()) <= 40
