"""Baselines: TOVA, KNorm, Random+Local (new) and Local, StreamingLLM, H2O, SnapKV, Full."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from kvhive.api import make_cache
from kvhive.methods import make_policy
from kvhive.methods.base import DECODE, PREFILL, ScoringInputs
from kvhive.methods.h2o import SCORE as H2O_SCORE
from kvhive.methods.random_local import PRIORITY
from kvhive.models import TINY_ARCHITECTURES, TINY_ATTENTION_KINDS, load_model, tiny_model

from helpers import left_padded_batch, prefill_and_decode, reference_logits

ALL_TINY = [(a, k) for a in TINY_ARCHITECTURES for k in TINY_ATTENTION_KINDS]
DECODE_METHODS = ["tova", "random", "local", "streamingllm", "h2o"]
PREFILL_ONLY = ["knorm", "snapkv"]
EXTRA = {"snapkv": {"window": 8}}  # SnapKV's default window (32) is longer than the tiny prompts


def scoring(
    num_tokens: int,
    *,
    batch: int = 1,
    heads: int = 1,
    query_heads: int | None = None,
    keys: torch.Tensor | None = None,
    queries: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    last_query_weights: torch.Tensor | None = None,
    token_scores: dict | None = None,
    phase: str = PREFILL,
    layer_index: int = 0,
) -> ScoringInputs:
    """Hand-made ScoringInputs; unspecified tensors are zeros, every token valid."""
    query_heads = query_heads or heads
    if keys is None:
        keys = torch.zeros(batch, heads, num_tokens, 2)
    if queries is None:
        queries = torch.zeros(batch, query_heads, 1, keys.shape[-1])
    if valid is None:
        valid = torch.ones(batch, num_tokens, dtype=torch.bool)
    mask = valid[:, None, None, :].expand(batch, 1, queries.shape[2], num_tokens)
    return ScoringInputs(
        keys=keys,
        values=keys.clone(),
        queries=queries,
        positions=torch.arange(num_tokens).expand(batch, heads, -1),
        mask=mask,
        scaling=1.0,
        layer_index=layer_index,
        num_layers=1,
        sequence_length=num_tokens,
        phase=phase,
        token_scores=dict(token_scores or {}),
        last_query_weights=last_query_weights,
    )


def kept(mask: torch.Tensor) -> list:
    """Kept indices per row, nested like the mask's leading dimensions."""
    if mask.dim() == 1:
        return mask.nonzero().flatten().tolist()
    return [kept(row) for row in mask]


# ----------------------------------------------------------------------------------------------
# Kept sets on hand-checked cases
# ----------------------------------------------------------------------------------------------


def test_tova_keeps_top_attention_averaged_over_all_heads():
    # 2 KV heads, 4 query heads: the average over all 4 query heads decides, for both KV heads.
    weights = torch.tensor(
        [
            [
                [0.10, 0.00, 0.40, 0.20, 0.30, 0.00],
                [0.10, 0.50, 0.00, 0.10, 0.30, 0.00],
                [0.50, 0.00, 0.00, 0.10, 0.00, 0.40],
                [0.10, 0.10, 0.00, 0.40, 0.00, 0.40],
            ]
        ]
    )
    # mean over heads: [0.2, 0.15, 0.1, 0.2, 0.15, 0.2] -> top 3 = tokens 0, 3, 5
    policy = make_policy("tova")
    for phase, select in ((PREFILL, policy.select_prefill), (DECODE, policy.select_decode)):
        keep = select(scoring(6, heads=2, query_heads=4, last_query_weights=weights, phase=phase), 3, {})
        assert kept(keep) == [[[0, 3, 5], [0, 3, 5]]]
    # Decode: one over budget -> the single lowest averaged weight (token 2) goes.
    keep = policy.select_decode(scoring(6, heads=2, query_heads=4, last_query_weights=weights, phase=DECODE), 5, {})
    assert kept(keep) == [[[0, 1, 3, 4, 5], [0, 1, 3, 4, 5]]]


def test_tova_never_keeps_padding():
    weights = torch.tensor([[[0.9, 0.0, 0.05, 0.05]]])  # padding with a (spurious) high weight
    valid = torch.tensor([[False, True, True, True]])
    keep = make_policy("tova").select_prefill(scoring(4, last_query_weights=weights, valid=valid), 2, {})
    assert kept(keep) == [[[2, 3]]]


def test_knorm_keeps_smallest_key_norms_per_head():
    norms = torch.tensor([[[3.0, 1.0, 4.0, 1.5, 9.0, 2.0], [0.5, 7.0, 6.0, 0.7, 0.1, 8.0]]])
    directions = torch.nn.functional.normalize(
        torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    keys = directions * norms[..., None]
    keep = make_policy("knorm").select_prefill(scoring(6, heads=2, keys=keys), 3, {})
    assert kept(keep) == [[[1, 3, 5], [0, 3, 4]]]
    valid = torch.tensor([[False, True, True, True, True, True]])
    keep = make_policy("knorm").select_prefill(scoring(6, heads=2, keys=keys, valid=valid), 3, {})
    assert kept(keep) == [[[1, 3, 5], [2, 3, 4]]]  # head 1's smallest norm is padding: skipped


def test_local_keeps_most_recent():
    keep = make_policy("local").select_prefill(scoring(7, heads=2), 3, {})
    assert kept(keep) == [[[4, 5, 6], [4, 5, 6]]]


def test_streamingllm_keeps_first_real_tokens_and_window():
    valid = torch.tensor([[True] * 10, [False] * 3 + [True] * 7])
    keep = make_policy("streamingllm", sink=2).select_prefill(scoring(10, batch=2, valid=valid), 5, {})
    assert kept(keep) == [[[0, 1, 7, 8, 9]], [[3, 4, 7, 8, 9]]]
    keep = make_policy("streamingllm").select_decode(scoring(10, batch=2, valid=valid, phase=DECODE), 6, {})
    assert kept(keep) == [[[0, 1, 2, 3, 8, 9]], [[3, 4, 5, 6, 8, 9]]]


def test_h2o_keeps_heavy_hitters_and_recent_half():
    scores = torch.tensor([[[0.9, 0.1, 0.5, 0.2, 0.3, 0.05], [0.0, 0.8, 0.1, 0.7, 0.2, 0.6]]])
    policy = make_policy("h2o")
    for phase, select in ((PREFILL, policy.select_prefill), (DECODE, policy.select_decode)):
        inputs = scoring(6, heads=2, token_scores={H2O_SCORE: scores}, phase=phase)
        # budget 4: recent half = tokens 4, 5; heavy half = the two best of tokens 0..3
        assert kept(select(inputs, 4, {})) == [[[0, 2, 4, 5], [1, 3, 4, 5]]]


def test_h2o_accumulated_attention_is_the_causal_column_sum():
    # keys e_j * log(w_j) and all-ones queries make the logits log(w_j): softmax weights ∝ w_j.
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    keys = torch.diag(torch.log(w))[None, None]
    queries = torch.ones(1, 1, 4, 4)
    valid = torch.ones(1, 4, dtype=torch.bool)
    inputs = scoring(4, keys=keys, queries=queries, valid=valid)
    inputs.mask = torch.ones(4, 4, dtype=torch.bool).tril()[None, None]
    make_policy("h2o").initialize_decode(inputs, {})
    expected = torch.zeros(4)
    for i in range(4):
        expected[: i + 1] += w[: i + 1] / w[: i + 1].sum()
    torch.testing.assert_close(inputs.token_scores[H2O_SCORE][0, 0], expected)


def test_snapkv_keeps_top_observation_scores_and_window():
    # One query (the observation window, window=1) with weights ∝ w over 8 keys.
    w = torch.tensor([0.05, 0.30, 0.02, 0.01, 0.20, 0.03, 0.04, 0.35])
    keys = torch.diag(torch.log(w))[None, None]
    queries = torch.ones(1, 1, 1, 8)
    inputs = scoring(8, keys=keys, queries=queries)
    # No pooling: top 3 of the prefix are tokens 1 (0.30), 4 (0.20), 0 (0.05), plus the window (7).
    keep = make_policy("snapkv", window=1, kernel=1).select_prefill(inputs, 4, {})
    assert kept(keep) == [[[0, 1, 4, 7]]]
    # Max pooling (kernel 3) spreads token 1's score to 0 and 2: [.30, .30, .30, .20, .20, .20, .04].
    inputs = scoring(8, keys=keys, queries=queries)
    keep = make_policy("snapkv", window=1, kernel=3).select_prefill(inputs, 4, {})
    assert kept(keep) == [[[0, 1, 2, 7]]]
    # Average pooling (kernel 5, zero padding counted as in the SnapKV reference code):
    # [.074, .076, .116, .112, .060, .056, .054] -> tokens 2, 3, 1 (padding not counted would give
    # token 0 .123 and keep 0, 2, 3).
    inputs = scoring(8, keys=keys, queries=queries)
    keep = make_policy("snapkv", window=1, kernel=5, pooling="avg").select_prefill(inputs, 4, {})
    assert kept(keep) == [[[1, 2, 3, 7]]]


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("num_tokens", [3, 4])  # shorter than and as long as the window
def test_snapkv_prompt_within_the_window_is_scored_unpooled_and_kept_whole(pooling, num_tokens):
    # Every token of a prompt no longer than the observation window is in the window, which the
    # pooling leaves out (snapkv.observation_scores: "the window itself is excluded from the pooling
    # input"): the scores are the window's summed attention unchanged, and SnapKV keeps every token.
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, num_tokens, 2, generator=generator)
    queries = torch.randn(1, 1, num_tokens, 2, generator=generator)
    policy = make_policy("snapkv", window=4, kernel=3, pooling=pooling)
    inputs = scoring(num_tokens, keys=keys, queries=queries)
    summed = inputs.observation_attention(4).sum(dim=2)
    torch.testing.assert_close(policy.score(inputs, 4, {}), summed)
    keep = policy.select_prefill(scoring(num_tokens, keys=keys, queries=queries), 4, {})
    assert keep.dtype == torch.bool and keep.all()


def test_random_local_keeps_recent_half_and_random_older_real_tokens():
    valid = torch.tensor([[True] * 20, [False] * 6 + [True] * 14])
    policy = make_policy("random", seed=3)
    keep = policy.select_prefill(scoring(20, batch=2, heads=3, valid=valid), 8, {})
    assert (keep.sum(-1) == 8).all()
    assert keep[..., 16:].all()  # recent half: 8 - floor(8 * 0.5) = 4 tokens
    assert not keep[1, :, :6].any()  # never padding
    older = [kept(keep[b, h, :16]) for b in range(2) for h in range(3)]
    assert len({tuple(row) for row in older}) > 1  # independent draws per row
    # Reproducible for a seed, different for another seed.
    again = make_policy("random", seed=3).select_prefill(scoring(20, batch=2, heads=3, valid=valid), 8, {})
    other = make_policy("random", seed=4).select_prefill(scoring(20, batch=2, heads=3, valid=valid), 8, {})
    assert torch.equal(keep, again) and not torch.equal(keep, other)
    # recent_fraction sets the split.
    keep = make_policy("random", recent_fraction=0.25).select_prefill(scoring(20, heads=1), 8, {})
    assert keep[..., 18:].all() and int(keep[..., :18].sum()) == 6


def test_random_local_streaming_keeps_a_uniform_sample_of_older_tokens():
    # Priority sampling: after a stream, the kept older tokens are a uniform subset of all older
    # tokens seen, so the mean kept position is the middle of the older range.
    budget, steps, recent = 8, 40, 4
    means = []
    for seed in range(80):
        policy = make_policy("random", seed=seed)
        state, scores = {}, {}
        positions = torch.arange(budget)[None, None]
        for position in range(budget, budget + steps):
            positions = torch.cat([positions, torch.tensor([[[position]]])], dim=-1)
            if PRIORITY in scores:
                scores[PRIORITY] = torch.cat([scores[PRIORITY], torch.zeros(1, 1, 1)], dim=-1)
            inputs = scoring(positions.shape[-1], token_scores=scores, phase=DECODE)
            inputs.positions = positions  # the stored tokens' original positions (draws are indexed by them)
            keep = policy.select_decode(inputs, budget, state)
            scores = {PRIORITY: inputs.token_scores[PRIORITY][keep].view(1, 1, -1)}
            positions = positions[keep].view(1, 1, -1)
        older = positions[0, 0, :-recent].float()
        assert (positions[0, 0, -recent:] == torch.arange(budget + steps - recent, budget + steps)).all()
        means.append(older.mean())
    oldest_range = budget + steps - recent  # older tokens are positions 0 .. oldest_range - 1
    assert abs(float(torch.stack(means).mean()) - (oldest_range - 1) / 2) < 3.0
    # "Evict a random token each step" would put the mean near the end of the range instead.


def test_full_keeps_everything():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    cache = make_cache(model, "full")
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=5)
    assert all((lengths == input_ids.shape[1] + 5).all() for lengths in cache.kept_tokens().values())
    assert cache.nbytes() == cache.full_cache_nbytes()


# ----------------------------------------------------------------------------------------------
# Budgets: exact per head, per layer and in total
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", TINY_ATTENTION_KINDS)
@pytest.mark.parametrize("method", DECODE_METHODS + PREFILL_ONLY)
def test_budgets_exact_per_head_layer_and_total(method, attention):
    model = tiny_model("qwen2", attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=7)
    budget, steps = 12, 10
    cache = make_cache(model, method, budget=budget, **EXTRA.get(method, {}))
    heads, layers = model.config.num_key_value_heads, model.config.num_hidden_layers
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
        for layer, lengths in cache.kept_tokens().items():
            assert lengths.shape == (2, heads) and (lengths == budget).all(), (layer, lengths)
        mask = attention_mask
        for step in range(1, steps + 1):
            token = output.logits[:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            output = model(input_ids=token, attention_mask=mask, past_key_values=cache, use_cache=True)
            expected = budget if method in DECODE_METHODS else budget + step
            for lengths in cache.kept_tokens().values():
                assert (lengths == expected).all()
    expected = budget if method in DECODE_METHODS else budget + steps
    stats = cache.statistics()
    assert stats["kept_tokens_total"] == expected * heads * layers * 2
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert cache.nbytes() == expected * heads * layers * 2 * 2 * head_dim * 4  # keys + values, fp32
    for layer in range(layers):
        positions = cache.layers[layer].dense()[2]
        assert not (positions[1] < 7).any()  # the padded row spends nothing on padding
        if method in ("tova",):
            assert (positions == positions[:, :1]).all()  # one kept set shared by every head


@pytest.mark.parametrize("method", ["streamingllm", "tova", "random", "h2o"])
def test_decode_methods_on_sliding_model_keep_budget_on_full_layers(method):
    model = tiny_model("gemma3", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=7)
    cache = make_cache(model, method, budget=10)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=10)
    for layer, lengths in cache.kept_tokens().items():
        expected = 10 if not cache.layers[layer].is_sliding else model.config.sliding_window - 1
        assert (lengths == expected).all()


def test_streamingllm_keeps_sinks_and_window_in_a_model():
    model = tiny_model("llama", "mha")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=7)
    steps = 15
    cache = make_cache(model, "streamingllm", budget=12)
    prefill_and_decode(model, cache, input_ids, attention_mask, steps=steps)
    total = 30 + steps
    window = torch.arange(total - 8, total)
    for layer in cache.compressed_layers:
        # Sorted: a decode eviction writes the newest token into the freed slot (stored order is
        # not the tokens' order for StreamingLLM, Policy.reads_stored_order).
        positions = cache.layers[layer].dense()[2].sort(dim=-1).values
        assert (positions[0] == torch.cat([torch.arange(4), window])).all()
        assert (positions[1] == torch.cat([torch.arange(7, 11), window])).all()


def test_random_local_is_reproducible_in_a_model():
    model = tiny_model("llama", "gqa")
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size, length=30, pad=7)

    def positions(seed):
        cache = make_cache(model, "random", budget=10, seed=seed)
        prefill_and_decode(model, cache, input_ids, attention_mask, steps=8)
        return [cache.layers[i].dense()[2].clone() for i in cache.compressed_layers]

    first, again, other = positions(1), positions(1), positions(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    for p in first:  # the recent half of the budget (sorted: evictions fill the freed slot)
        assert (p.sort(dim=-1).values[..., -5:] == torch.arange(33, 38)).all()


# ----------------------------------------------------------------------------------------------
# Full budget: identical to plain transformers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture,attention", ALL_TINY)
def test_full_budget_identical_to_plain_transformers(architecture, attention):
    model = tiny_model(architecture, attention)
    input_ids, attention_mask = left_padded_batch(model.config.vocab_size)
    steps = 20
    expected = reference_logits(model, input_ids, attention_mask, steps=steps)
    for method in ["full"] + DECODE_METHODS + PREFILL_ONLY:
        budget = None if method == "full" else input_ids.shape[1] + steps + 1
        cache = make_cache(model, method, budget=budget, **EXTRA.get(method, {}))
        actual = prefill_and_decode(model, cache, input_ids, attention_mask, steps=steps)
        difference = (actual - expected).abs().max().item()
        assert difference <= 1e-5, (method, difference)


@pytest.fixture(scope="module")
def embedded():
    return load_model()


@pytest.mark.parametrize("method", ["tova", "knorm", "random", "streamingllm"])
def test_full_budget_identical_on_embedded_model(embedded, method):
    model, tokenizer = embedded
    inputs = tokenizer(["The capital of France is", "Bees make honey"], return_tensors="pt", padding=True)
    steps = 6
    key = "reference"
    if key not in _EMBEDDED_REFERENCE:
        _EMBEDDED_REFERENCE[key] = reference_logits(model, inputs["input_ids"], inputs["attention_mask"], steps)
    expected = _EMBEDDED_REFERENCE[key]
    cache = make_cache(model, method, budget=64)
    actual = prefill_and_decode(model, cache, inputs["input_ids"], inputs["attention_mask"], steps)
    # Logits reach |33| on this model; methods that need decode attention weights run the
    # framework's explicit softmax path instead of sdpa, which rounds differently in float32
    # (~1e-6 relative), so the bound is 1e-5 relative to the logit scale (1e-5 absolute for |logit| <= 1).
    scale = max(1.0, expected.abs().max().item())
    assert (actual - expected).abs().max().item() <= 1e-5 * scale


_EMBEDDED_REFERENCE: dict[str, torch.Tensor] = {}


# ----------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method,parameters,name",
    [
        ("random", {"recent_fraction": 1.5}, "recent_fraction"),
        ("random", {"recent_fraction": -0.1}, "recent_fraction"),
        ("random", {"seed": -1}, "seed"),
        ("random", {"seed": 1.5}, "seed"),
        ("tova", {"window": 3}, "window"),
        ("knorm", {"sink": 3}, "sink"),
    ],
)
def test_invalid_parameters_raise(method, parameters, name):
    with pytest.raises(ValueError, match=name):
        make_policy(method, **parameters)


def test_phases():
    assert make_policy("tova").phases == {PREFILL, DECODE}
    assert make_policy("random").phases == {PREFILL, DECODE}
    assert make_policy("knorm").phases == {PREFILL}


def _random_scoring(n: int, pad: int, batch_rows: int, token_scores=None) -> ScoringInputs:
    keys = torch.zeros(batch_rows, 2, n, 4)
    mask = torch.ones(batch_rows, 1, 1, n, dtype=torch.bool)
    if pad:
        mask[-1, ..., :pad] = False
    return ScoringInputs(
        keys=keys,
        values=keys,
        queries=torch.zeros(batch_rows, 2, 1, 4),
        positions=torch.arange(n).expand(batch_rows, 2, n),
        mask=mask,
        scaling=1.0,
        layer_index=1,
        num_layers=2,
        sequence_length=n,
        phase="prefill",
        token_scores=dict(token_scores or {}),
    )


def test_random_row_draws_what_it_draws_alone():
    # Fails on one generator per layer: the padded row's draws depended on the rows before it
    # and on its padding.
    from kvhive.methods.random_local import PRIORITY

    policy = make_policy("random", seed=3)
    batch_state, alone_state = {}, {}
    batch = _random_scoring(20, pad=6, batch_rows=2)
    alone = _random_scoring(14, pad=0, batch_rows=1)
    kept_batch = policy.select_prefill(batch, 8, batch_state)
    kept_alone = policy.select_prefill(alone, 8, alone_state)
    assert torch.equal(kept_batch[1, :, 6:], kept_alone[0])
    assert torch.equal(batch.token_scores[PRIORITY][1, :, 6:], alone.token_scores[PRIORITY][0])
    # A decode step: one new token per row draws the same priority in the batch as alone.
    new = torch.zeros(2, 2, 1)
    batch_step = _random_scoring(
        21, pad=6, batch_rows=2, token_scores={PRIORITY: torch.cat([batch.token_scores[PRIORITY], new], dim=-1)}
    )
    alone_step = _random_scoring(
        15, pad=0, batch_rows=1, token_scores={PRIORITY: torch.cat([alone.token_scores[PRIORITY], new[:1]], dim=-1)}
    )
    policy.observe_decode(batch_step, batch_state)
    policy.observe_decode(alone_step, alone_state)
    assert torch.equal(batch_step.token_scores[PRIORITY][1, :, -1], alone_step.token_scores[PRIORITY][0, :, -1])


def test_h2o_decode_adds_the_new_querys_attention_and_evicts_by_it():
    # Kills observe_decode as a no-op: Algorithm 1 adds each new query's weights to the running
    # scores, and the eviction follows the updated sums.
    previous = torch.tensor([[[0.9, 0.2, 0.5, 0.1, 0.3, 0.0]]]).expand(1, 2, 6).clone()
    weights = torch.full((1, 4, 6), 0.05)  # [B, Hq, N], group size 2
    weights[:, :, 1] = 3.0  # the new query attends token 1 heavily (without it token 2 would stay)
    weights[:, 1, 3] = 0.8  # one query head of the first group: mean 0.425 over the group
    keys = torch.zeros(1, 2, 6, 4)
    scoring = ScoringInputs(
        keys=keys,
        values=keys,
        queries=torch.zeros(1, 4, 1, 4),
        positions=torch.arange(6).expand(1, 2, 6),
        mask=None,
        scaling=1.0,
        layer_index=0,
        num_layers=1,
        sequence_length=6,
        phase="decode",
        token_scores={H2O_SCORE: previous.clone()},
        last_query_weights=weights,
    )
    policy = make_policy("h2o")
    policy.observe_decode(scoring, {})
    expected = previous + torch.stack([weights[:, 0:2].mean(1), weights[:, 2:4].mean(1)], dim=1)
    torch.testing.assert_close(scoring.token_scores[H2O_SCORE], expected)
    # Budget 4: the recent 2 (tokens 4, 5) plus the 2 best sums: token 1 (0.2 + 3.0) and token 0
    # (0.95); token 2 (0.55) and, in head 0, token 3 (0.1 + 0.425) go.
    keep = policy.select_decode(scoring, 4, {})
    assert [torch.nonzero(keep[0, h]).flatten().tolist() for h in range(2)] == [[0, 1, 4, 5], [0, 1, 4, 5]]
