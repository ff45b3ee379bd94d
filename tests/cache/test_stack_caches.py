"""``KVHiveCache.stack``: caches prefilled separately (prompts of different lengths) become the rows
of one batch cache, each row at its own position; decoding the batch gives each row what its cache
gives alone. Caches that cannot be stacked are refused by name."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.models import tiny_model

LENGTHS = (40, 57, 73)
STEPS = 8


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def _prompts(seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (1, n), generator=generator) for n in LENGTHS]


def _prefilled(model, method, budget, prompt, **options):
    cache = kvhive.make_cache(model, method, budget, **options)
    with torch.no_grad():
        model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True)
    return cache


def _decode(model, cache, tokens: torch.Tensor, stacked: bool) -> torch.Tensor:
    """Forced tokens ``[B, n]``, one per forward; ``[B, n, V]`` logits. A stacked cache gets each
    row's own position ids."""
    logits = []
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            extra = {}
            if stacked:
                extra["position_ids"] = torch.tensor(cache.row_tokens_seen())[:, None]
            out = model(input_ids=tokens[:, step : step + 1], **{cache_kwarg(model): cache}, use_cache=True, **extra)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, dim=1)


@pytest.mark.parametrize(
    "method,budget",
    [
        ("full", None),
        ("snapkv", 32),
        ("pyramidkv", 32),
        ("h2o", 32),
        ("tova", 32),
        ("streamingllm", 32),
        ("subgen", 33),
        ("random", 32),
        ("ahakv", 32),
        ("buzz", 32),
        ("buzz-logn", 32),
        # 40 is below the peak (84): one row has not evicted yet, the others have, at other steps
        ("buzz", 60),
        ("bumblebee", 32),
        ("bumblebee-power", 32),
        ("bumblebee", 40),  # the 40-token prompt fits exactly: no summary yet beside summarised rows
        ("subgen-attention", 40),
        ("subgen-attention", 78),  # window 40: the 40-token prompt inserted nothing yet
    ],
)
def test_stacked_rows_decode_as_each_cache_alone(model, method, budget):
    prompts = _prompts()
    steps = torch.randint(3, 250, (len(prompts), STEPS), generator=torch.Generator().manual_seed(9))
    caches = [_prefilled(model, method, budget, prompt) for prompt in prompts]
    before = [[layer.lengths_host.tolist() for layer in cache.layers] for cache in caches]
    stacked = KVHiveCache.stack(caches, decode_capacity=4)  # fewer than the steps: the capacity grows
    # The inputs are left as they were.
    assert [[layer.lengths_host.tolist() for layer in cache.layers] for cache in caches] == before
    assert stacked.row_tokens_seen() == list(LENGTHS)
    assert stacked.get_seq_length() == max(LENGTHS)
    got = _decode(model, stacked, steps, stacked=True)
    for row, cache in enumerate(caches):
        expected = _decode(model, cache, steps[row : row + 1], stacked=False)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-4, atol=1e-5)
        for layer, alone in zip(stacked.layers, cache.layers, strict=True):
            assert layer.lengths_host[row].tolist() == alone.lengths_host[0].tolist()
            assert layer.row_tokens_seen[row] == alone.tokens_seen
    # Accounting counts each row's own tokens (kept and seen), as the caches alone do.
    assert stacked.nbytes() == sum(cache.nbytes() for cache in caches)
    assert stacked.full_cache_nbytes() == sum(cache.full_cache_nbytes() for cache in caches)
    if method == "full":  # rows of different lengths in slots of a common capacity
        assert all(layer.has_row_lengths for layer in stacked.layers)
        assert stacked.kept_tokens()[0][:, 0].tolist() == [n + STEPS for n in LENGTHS]
    if method.startswith("buzz"):  # each row its own schedule: a length per row, in a bounded capacity
        assert all(layer.has_row_lengths and layer.bounded_capacity for layer in stacked.layers)


def test_buzz_rows_evict_at_their_own_steps(model):
    """BUZZ's schedule follows each row's own stored tokens: rows of different lengths evict at
    different steps and keep what each keeps alone (kept positions, step by step)."""
    prompts = _prompts()
    caches = [_prefilled(model, "buzz", 60, prompt) for prompt in prompts]
    stacked = KVHiveCache.stack(caches)
    alone = [_prefilled(model, "buzz", 60, prompt) for prompt in prompts]
    steps = torch.randint(3, 250, (len(prompts), 50), generator=torch.Generator().manual_seed(3))
    lengths_seen = set()
    for step in range(steps.shape[1]):
        _decode(model, stacked, steps[:, step : step + 1], stacked=True)
        for row, cache in enumerate(alone):
            _decode(model, cache, steps[row : row + 1, step : step + 1], stacked=False)
        for index, layer in enumerate(stacked.layers):
            keys, _, positions, _ = layer.dense()
            lengths = layer.row_lengths
            lengths_seen.add(tuple(lengths))
            for row, cache in enumerate(alone):
                expected = cache.layers[index].dense()[2][0]
                if cache.layers[index].fixed_capacity:
                    expected = cache.layers[index].decode_view()[2][0][:, : cache.layers[index].dense_length]
                assert positions[row, :, : lengths[row]].tolist() == expected.tolist()
    assert any(len(set(lengths)) > 1 for lengths in lengths_seen)
    stats = kvhive.methods.buzz.kept_size_statistics(stacked)
    assert stats["peak_kept"] <= 84 + 1


@pytest.mark.parametrize("method,budget", [("buzz", 32), ("bumblebee", 40), ("subgen-attention", 40)])
def test_stacked_rows_reordered_like_beams_decode_as_alone(model, method, budget):
    """reorder_cache / batch_select_indices (beam search) select the method's per-row state
    (select_state_rows): a row copied twice goes on in both copies independently, each exactly as
    its prompt decodes alone with the same tokens."""
    prompts = _prompts()
    steps = torch.randint(3, 250, (3, 12), generator=torch.Generator().manual_seed(5))
    stacked = KVHiveCache.stack([_prefilled(model, method, budget, prompt) for prompt in prompts])
    _decode(model, stacked, steps[:, :4], stacked=True)
    beams = [2, 0, 0]  # new row i continues old row beams[i]; row 0 twice, row 1 dropped
    stacked.reorder_cache(torch.tensor(beams))
    assert stacked.row_tokens_seen() == [LENGTHS[2] + 4, LENGTHS[0] + 4, LENGTHS[0] + 4]
    later = torch.randint(3, 250, (3, 12), generator=torch.Generator().manual_seed(6))
    got = _decode(model, stacked, later, stacked=True)
    for row, prompt_index in enumerate(beams):
        alone = _prefilled(model, method, budget, prompts[prompt_index])
        _decode(model, alone, steps[prompt_index : prompt_index + 1, :4], stacked=False)
        expected = _decode(model, alone, later[row : row + 1], stacked=False)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-4, atol=1e-5)


def test_stacked_rows_can_be_selected(model):
    """A finished row leaves the batch (batch_select_indices) and the others go on unchanged."""
    prompts = _prompts(6)
    steps = torch.randint(3, 250, (3, 6), generator=torch.Generator().manual_seed(2))
    stacked = KVHiveCache.stack([_prefilled(model, "full", None, prompt) for prompt in prompts])
    _decode(model, stacked, steps[:, :3], stacked=True)
    stacked.batch_select_indices(torch.tensor([2, 0]))
    assert stacked.row_tokens_seen() == [LENGTHS[2] + 3, LENGTHS[0] + 3]
    got = _decode(model, stacked, steps[[2, 0], 3:], stacked=True)
    for row, prompt_index in enumerate((2, 0)):
        alone = _prefilled(model, "full", None, prompts[prompt_index])
        _decode(model, alone, steps[prompt_index : prompt_index + 1, :3], stacked=False)
        expected = _decode(model, alone, steps[prompt_index : prompt_index + 1, 3:], stacked=False)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-4, atol=1e-5)


def test_stack_refusals(model):
    prompts = _prompts()
    snapkv = [_prefilled(model, "snapkv", 32, prompt) for prompt in prompts[:2]]
    with pytest.raises(ValueError, match="method"):
        KVHiveCache.stack([snapkv[0], _prefilled(model, "knorm", 32, prompts[1])])
    with pytest.raises(ValueError, match="budget"):
        KVHiveCache.stack([snapkv[0], _prefilled(model, "snapkv", 33, prompts[1])])
    with pytest.raises(ValueError, match="window"):  # method options differ
        KVHiveCache.stack([snapkv[0], _prefilled(model, "snapkv", 32, prompts[1], window=8)])
    with pytest.raises(ValueError, match="another model"):
        KVHiveCache.stack([snapkv[0], _prefilled(tiny_model("llama", "mha"), "snapkv", 32, prompts[1])])
    other = tiny_model("llama", "gqa")
    single = _prefilled(other, "snapkv", 32, prompts[0])
    other.to(torch.bfloat16)  # the same modules, now in bf16
    with pytest.raises(ValueError, match="dtype"):
        KVHiveCache.stack([single, _prefilled(other, "snapkv", 32, prompts[1])])
    with pytest.raises(ValueError, match="holds no prompt"):
        KVHiveCache.stack([snapkv[0], kvhive.make_cache(model, "snapkv", 32)])
    padded = kvhive.make_cache(model, "snapkv", 32)
    mask = torch.ones(2, LENGTHS[1], dtype=torch.long)
    mask[0, :5] = 0  # row 0 left-padded: its tokens seen count the padding
    with torch.no_grad():
        model(
            input_ids=torch.cat([prompts[1]] * 2), attention_mask=mask, **{cache_kwarg(model): padded}, use_cache=True
        )
    with pytest.raises(ValueError, match="caches\\[1\\] holds a left-padded batch of 2 rows"):
        KVHiveCache.stack([snapkv[0], padded])
    with pytest.raises(ValueError, match="non-empty list"):
        KVHiveCache.stack([])
    stacked = KVHiveCache.stack(snapkv)
    with pytest.raises(ValueError, match="one token per row"):
        with torch.no_grad():
            model(input_ids=torch.ones(2, 2, dtype=torch.long), **{cache_kwarg(model): stacked}, use_cache=True)


@pytest.mark.parametrize(
    "method,budget,why",
    [
        ("subgen", 48, "builds its state at its first eviction"),
        ("bumblebee", 48, "holds a layer in a capacity of its own bound"),
        ("vnorm", 48, "ranks its tokens by their stored order"),
    ],
)
def test_evicting_layer_of_different_lengths_is_refused(model, method, budget, why):
    """A prompt shorter than the budget keeps fewer tokens than the others: a method that builds its
    state at its first eviction, or holds a layer in its own bound, decodes its rows with one length,
    so the rows cannot share the layer; the error names the method, the budget and why."""
    caches = [_prefilled(model, method, budget, prompt) for prompt in _prompts()]  # 40 < 48 < 57
    with pytest.raises(ValueError, match=f"different numbers of tokens.*budget of {budget}.*'{method}' {why}"):
        KVHiveCache.stack(caches)


@pytest.mark.parametrize("method", ["h2o", "tova", "streamingllm", "random", "ahakv", "local"])
def test_rows_below_the_budget_decode_with_rows_above_it(model, method):
    """A method that keeps ``min(budget, N)`` decodes a row whose prompt is shorter than the budget
    beside rows that evict: each row fills up to the budget in a capacity of the budget plus the new
    token, then drops one token a step, as it does alone (the 40-token row reaches 48 in 8 steps)."""
    prompts = _prompts()
    steps = torch.randint(3, 250, (len(prompts), 2 * STEPS), generator=torch.Generator().manual_seed(9))
    caches = [_prefilled(model, method, 48, prompt) for prompt in prompts]  # 40 < 48 < 57
    stacked = KVHiveCache.stack(caches)
    assert [layer.has_row_lengths and layer.bounded_capacity for layer in stacked.layers] == [True, True]
    got = _decode(model, stacked, steps, stacked=True)
    for row, cache in enumerate(caches):
        expected = _decode(model, cache, steps[row : row + 1], stacked=False)
        torch.testing.assert_close(got[row : row + 1], expected, rtol=1e-4, atol=1e-5)
        for layer, alone in zip(stacked.layers, cache.layers, strict=True):
            assert layer.lengths_host[row].tolist() == alone.lengths_host[0].tolist()


def test_packed_layout_is_refused(model):
    caches = [_prefilled(model, "ada-snapkv", 32, prompt) for prompt in _prompts()]
    layer = caches[1].layers[0]
    keep = torch.ones(1, layer.num_heads, layer.dense_length, dtype=torch.bool)
    keep[0, 0, :2] = False
    layer.keep(keep)
    with pytest.raises(ValueError, match="'ada-snapkv'.*head-wise"):
        KVHiveCache.stack(caches)


@pytest.mark.parametrize("method,budget", [("full", None), ("h2o", 32), ("snapkv", 32), ("tova", 32)])
def test_stacked_decode_step_makes_no_host_read(model, method, budget):
    """A decode step of a stacked cache (per-row positions from the device counter, rows of
    different lengths written at device indices) reads nothing back, like a cache alone
    (tests/cache/test_decode_host_reads.py)."""
    from kvhive.diagnostics import HostReadCounter

    stacked = KVHiveCache.stack([_prefilled(model, method, budget, prompt) for prompt in _prompts()])
    token = torch.ones(len(LENGTHS), 1, dtype=torch.long)
    with torch.no_grad():
        for step in range(3):
            positions = stacked.layers[0].row_tokens_seen_device[:, None].clone()
            with HostReadCounter() as reads:
                model(input_ids=token + step, position_ids=positions, **{cache_kwarg(model): stacked}, use_cache=True)
            if step:
                assert reads.total == 0, f"{method}: {reads}"


@pytest.mark.parametrize("method,budget", [("buzz", 32), ("buzz", 60), ("bumblebee", 32), ("subgen-attention", 40)])
def test_stacked_decode_step_of_per_row_state_makes_no_host_read(model, method, budget):
    """A stacked decode step of the methods with per-row state reads nothing back: BUZZ's per-row
    schedule and each row's length after an eviction stay on the device (the host lengths are read
    when next asked for, outside the step)."""
    from kvhive.diagnostics import HostReadCounter

    stacked = KVHiveCache.stack([_prefilled(model, method, budget, prompt) for prompt in _prompts()])
    _decode(model, stacked, torch.ones(3, 3, dtype=torch.long), stacked=True)
    positions = stacked.layers[0].row_tokens_seen_device[:, None].clone()
    tokens = torch.ones(3, 1, dtype=torch.long)  # made outside the count: the model's input, not the step's work
    with torch.no_grad(), HostReadCounter() as reads:
        for _ in range(3):
            model(
                input_ids=tokens,
                position_ids=positions,
                **{cache_kwarg(model): stacked},
                use_cache=True,
            )
            positions = positions + 1
    assert reads.total == 0, f"{method}: {reads}"


def test_next_position_ids_are_each_rows_tokens_seen(model):
    """``next_position_ids`` gives the ``[B, 1]`` position ids of every row's next token from the
    device counters: each row's own count in a stacked cache, and one count for every row of a
    cache whose rows advance together."""
    prompts = _prompts()
    caches = [_prefilled(model, "tova", 32, prompt) for prompt in prompts]
    stacked = KVHiveCache.stack(caches)
    assert stacked.next_position_ids().tolist() == [[n] for n in LENGTHS]
    _decode(model, stacked, torch.randint(3, 250, (len(prompts), 2)), stacked=True)
    assert stacked.next_position_ids().tolist() == [[n + 2] for n in LENGTHS]
    alone = _prefilled(model, "tova", 32, torch.randint(3, 250, (2, 20)))
    assert alone.next_position_ids().tolist() == [[20], [20]]
    with pytest.raises(ValueError, match="prefilled cache"):
        kvhive.make_cache(model, "tova", 32).next_position_ids()
