"""ScoringInputs' attention statistics: padding rows count zero, a model NaN is not hidden, and
the causal mask built on demand (no model mask) equals the materialised one."""

import torch

from kvhive.methods.base import PREFILL, ScoringInputs


def _inputs(mask, queries=None, n=6):
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, n, 8, generator=generator)
    queries = torch.randn(1, 2, n, 8, generator=generator) if queries is None else queries
    return ScoringInputs(
        keys=keys,
        values=keys,
        queries=queries,
        positions=torch.arange(n).expand(1, 1, n),
        mask=mask,
        scaling=0.3,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=PREFILL,
    )


def test_causal_mask_on_demand_equals_the_materialised_mask():
    causal = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    with_mask, without = _inputs(causal), _inputs(None)
    torch.testing.assert_close(without.accumulated_attention(), with_mask.accumulated_attention())
    assert torch.equal(without.mask_rows(slice(2, 5), 4), causal[:, :, 2:5, :4])


def test_fully_masked_padding_rows_count_zero_but_a_model_nan_stays():
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None].clone()
    mask[..., :2] = False  # two padding tokens: query rows 0 and 1 see nothing
    weights = _inputs(mask).attention_weights(slice(0, 6))
    assert torch.isfinite(weights).all()
    assert float(weights[:, :, :2].abs().sum()) == 0.0
    torch.testing.assert_close(weights[:, :, 2:].sum(-1), torch.ones(1, 2, 4))
    queries = torch.randn(1, 2, 6, 8)
    queries[0, 1, 4] = float("nan")
    poisoned = _inputs(mask, queries).attention_weights(slice(0, 6))
    assert torch.isnan(poisoned[0, 1, 4]).all()
