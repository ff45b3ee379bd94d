"""ScoringInputs' attention statistics: padding rows count zero, a model NaN is not hidden, the
causal mask built on demand (no model mask) equals the materialised one, and chunked sums equal
the plain softmax sums; and the selection helpers every method shares (keep_top_scores,
top_indices, recent_mask)."""

import pytest
import torch

from kvhive.methods import base
from kvhive.methods import scoring as scoring_module
from kvhive.methods.base import DECODE, PREFILL, ScoringInputs, keep_top_scores, recent_mask, top_indices


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


def _scoring(batch, heads, query_heads, n, q, mask_kind, phase=PREFILL, seed=1):
    """ScoringInputs of ``q`` queries that are the newest of ``n`` stored keys at positions 0..n-1:
    ``mask_kind`` None (causal built on demand), "causal" (the model's mask) or "padded" (batch row
    1 left-padded by two tokens)."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, n, 8, generator=generator)
    queries = torch.randn(batch, query_heads, q, 8, generator=generator)
    mask = None
    if mask_kind is not None:
        mask = torch.ones(n, n, dtype=torch.bool).tril()[n - q :][None, None].repeat(batch, 1, 1, 1)
        if mask_kind == "padded":
            mask[1, :, :, :2] = False
    return ScoringInputs(
        keys=keys,
        values=keys,
        queries=queries,
        positions=torch.arange(n).expand(batch, heads, n),
        mask=mask,
        scaling=0.3,
        layer_index=0,
        num_layers=1,
        sequence_length=n,
        phase=phase,
    )


def _reference_summed_attention(scoring, first_row, multiplier):
    """Column sums of softmax(multiplier * scaling * q k^T) over the rows ``first_row..q-1``, each
    query seeing the keys at or before its own position (and no padding); a row that sees no key
    (a padding query) counts zero."""
    n, q = scoring.num_tokens, scoring.num_queries
    keys = scoring.keys.repeat_interleave(scoring.group_size, dim=1)
    logits = scoring.queries @ keys.transpose(-1, -2) * scoring.scaling * multiplier
    visible = torch.arange(n)[None, :] <= torch.arange(n - q, n)[:, None]
    if scoring.mask is not None:
        visible = visible & scoring.mask
    weights = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return weights[:, :, first_row:].sum(dim=2)


SUMMED_CASES = [
    # batch, stored heads, query heads, n, q, mask, phase, first_row, logit multiplier
    pytest.param(2, 2, 4, 9, 9, None, PREFILL, 0, 1.0, id="prefill-no-mask"),
    pytest.param(2, 2, 4, 9, 9, "padded", PREFILL, 0, 1.0, id="prefill-padded"),
    pytest.param(1, 1, 2, 9, 4, "causal", PREFILL, 1, 1.5, id="newest-queries-of-more-keys"),
    pytest.param(1, 2, 2, 8, 3, "causal", DECODE, 0, 1.0, id="decode-several-queries"),
    pytest.param(1, 1, 4, 3, 3, None, PREFILL, 1, 0.5, id="more-query-heads-than-tokens"),
]


@pytest.mark.parametrize("rows_per_chunk", [1, 2, 3, None])
@pytest.mark.parametrize(
    ("batch", "heads", "query_heads", "n", "q", "mask", "phase", "first_row", "multiplier"), SUMMED_CASES
)
def test_summed_attention_is_the_same_whatever_the_chunk_size(
    monkeypatch, rows_per_chunk, batch, heads, query_heads, n, q, mask, phase, first_row, multiplier
):
    # H2O's accumulated attention and AhaKV's recent sums (docs/METHODS.md) are column sums of the
    # softmax weights; chunking the query rows (so a long prompt never holds n x n weights) and
    # multiplying each chunk only against the keys it may see must not change them.
    scoring = _scoring(batch, heads, query_heads, n, q, mask, phase)
    if rows_per_chunk is not None:
        monkeypatch.setattr(scoring_module, "_CHUNK_ELEMENTS", rows_per_chunk * batch * query_heads * n)
    summed = scoring.summed_attention(first_row, multiplier)
    expected = _reference_summed_attention(scoring, first_row, multiplier)
    assert summed.shape == (batch, query_heads, n) and summed.dtype == torch.float32
    torch.testing.assert_close(summed, expected)
    # Memoised: asking again gives the same statistics.
    torch.testing.assert_close(scoring.summed_attention(first_row, multiplier), expected)


def test_attention_statistics_take_larger_chunks_on_a_gpu():
    # A GPU chunk costs its launches: a 32k prompt's padded column sums (32 query heads) in chunks of
    # the CPU's 4 rows would be 8,192 chunks a layer; there the bound is 128 rows.
    rows = {device: base.chunk_elements(torch.device(device)) // (32 * 32_768) for device in ("cpu", "cuda")}
    assert rows == {"cpu": 4, "cuda": 128}


def test_tied_scores_keep_the_most_recent_tokens():
    # top_indices' contract: among equal scores the later (more recent) token wins, whatever the
    # row's length (a stable sort; an unstable one reorders ties in rows of 17 tokens or more).
    n = 24
    tied = torch.zeros(2, 3, n)
    keep = keep_top_scores(tied, 5)
    assert torch.equal(keep, recent_mask(n, 5, tied))
    levels = torch.tensor([float(i % 3) for i in range(n)])  # 0, 1, 2, 0, 1, 2, ...
    twos, ones = torch.arange(n)[levels == 2].tolist(), torch.arange(n)[levels == 1].tolist()
    assert sorted(top_indices(levels, 5).tolist()) == twos[-5:]
    assert sorted(top_indices(levels, 11).tolist()) == sorted(twos + ones[-3:])


@pytest.mark.parametrize("budget", [6, 7, 100])
def test_a_budget_of_the_whole_row_keeps_every_token_as_a_bool_mask(budget):
    # keep_top_scores answers a boolean keep mask with exactly min(budget, N) True per row.
    scores = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(0))
    keep = keep_top_scores(scores, budget)
    assert keep.dtype == torch.bool and keep.shape == scores.shape
    assert bool(keep.all())


@pytest.mark.parametrize(("window", "expected"), [(0, 0), (2, 2), (5, 5), (6, 5)])
def test_recent_mask_marks_the_last_window_tokens_of_every_row(window, expected):
    # True on the last ``window`` stored tokens (all of them when the window reaches past the
    # oldest), shaped like ``like`` (the cache's [B, H, N]).
    like = torch.ones(2, 3, 5, dtype=torch.bool)
    recent = recent_mask(5, window, like)
    assert recent.shape == like.shape and recent.dtype == torch.bool
    row = torch.arange(5) >= 5 - expected
    assert torch.equal(recent, row.expand(2, 3, 5))


@pytest.mark.parametrize(("q", "mask"), [(4, "causal"), (7, None), (1, None)])
def test_last_query_attention_is_the_newest_query_row(q, mask):
    # TOVA's scores and decode-phase accumulation read the newest query's softmax weights
    # [B, Hq, N] (docs/METHODS.md); the weights the decode attention already computed are used
    # as they are.
    scoring = _scoring(2, 1, 2, 7, q, mask)
    newest = _reference_summed_attention(scoring, q - 1, 1.0)
    torch.testing.assert_close(scoring.last_query_attention(), newest)
    torch.testing.assert_close(scoring.last_query_attention(), newest)
    given = torch.rand(2, 2, 7, generator=torch.Generator().manual_seed(3))
    scoring.last_query_weights = given
    assert scoring.last_query_attention() is given
