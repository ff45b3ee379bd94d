"""Shared test utilities: run prefill + greedy decode steps and compare with plain transformers."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers import DynamicCache

from kvhive.compat import cache_kwarg


def left_padded_batch(vocab_size: int, length: int = 24, pad: int = 5, seed: int = 0):
    """Two rows of random token ids; the second is left-padded by ``pad`` tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :pad] = 0
    input_ids[1, :pad] = 0
    return input_ids, attention_mask


@torch.no_grad()
def prefill_and_decode(model, cache, input_ids, attention_mask, steps: int = 20, forced_tokens=None):
    """Logits ``[steps + 1, B, V]`` of the prompt's last position and ``steps`` greedy decode steps.

    ``forced_tokens[step]`` (``[B, 1]``) replaces the greedy token, so two runs can be compared
    on the same inputs even when their predictions differ.
    """
    logits = []
    key = cache_kwarg(model)
    output = model(input_ids=input_ids, attention_mask=attention_mask, **{key: cache}, use_cache=True)
    logits.append(output.logits[:, -1])
    mask = attention_mask
    for step in range(steps):
        next_token = output.logits[:, -1].argmax(-1, keepdim=True)
        if forced_tokens is not None:
            next_token = forced_tokens[step]
        mask = torch.cat([mask, torch.ones_like(next_token)], dim=1)
        output = model(input_ids=next_token, attention_mask=mask, **{key: cache}, use_cache=True)
        logits.append(output.logits[:, -1])
    return torch.stack(logits)


def reference_logits(model, input_ids, attention_mask, steps: int = 20):
    """The same run with plain transformers (sdpa attention, DynamicCache)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        return prefill_and_decode(model, DynamicCache(config=model.config), input_ids, attention_mask, steps)
    finally:
        model.set_attn_implementation(previous)


def materialised_mask(*args, **kwargs):
    """transformers' sdpa mask, always materialised (for reference attention functions that mask
    evicted keys by hand)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def solo_runs(model, new_cache, input_ids, attention_mask, offsets, steps: int, batch_logits, atol: float = 1e-4):
    """Run each batch row alone (row ``r`` without its first ``offsets[r]`` padding tokens), fed the
    tokens the batch run chose, and check its logits equal the row's in ``batch_logits``; yields
    ``(row, offset, solo_cache)`` for further checks on what the caches hold."""
    tokens = batch_logits[:-1].argmax(-1)[:, :, None]
    for row, offset in enumerate(offsets):
        alone = new_cache()
        solo = prefill_and_decode(
            model,
            alone,
            input_ids[row : row + 1, offset:],
            attention_mask[row : row + 1, offset:],
            steps,
            forced_tokens=tokens[:, row : row + 1],
        )
        assert (solo[:, 0] - batch_logits[:, row]).abs().max().item() <= atol, row
        yield row, offset, alone


def result_record(method, budget, item, value, task="needle", metric="m", **fields) -> dict:
    """One scored record of ``results.jsonl`` (what the runner writes), for report and claims tests."""
    return {
        "task": task,
        "item_id": item,
        "method": method,
        "budget": budget,
        "metrics": {metric: value},
        "kind": "generate",
        "main_metric": metric,
        "higher_is_better": True,
        "chance": 0.0,
        "model": "fake",
        "seed": 0,
        **fields,
    }


def scoring_inputs(queries, keys, values, scaling=None, sequence_length=None, mask=None, phase="prefill"):
    """Hand-made ``ScoringInputs`` of one layer: keys at positions 0..n-1 and, unless a ``mask`` is
    given, a causal mask for the last ``q`` of them (the queries)."""
    from kvhive.methods.base import ScoringInputs

    n, q = keys.shape[2], queries.shape[2]
    if mask is None:
        mask = torch.ones(n, n, dtype=torch.bool).tril()[n - q :][None, None].expand(keys.shape[0], 1, q, n)
    return ScoringInputs(
        keys=keys,
        values=values,
        queries=queries,
        positions=torch.arange(n).expand(keys.shape[:3]),
        mask=mask,
        scaling=keys.shape[-1] ** -0.5 if scaling is None else scaling,
        layer_index=0,
        num_layers=1,
        sequence_length=n if sequence_length is None else sequence_length,
        phase=phase,
    )


def run_in_threads(work: Callable[[int], object], count: int) -> dict[int, object]:
    """``{index: work(index)}`` from ``count`` threads started together (a barrier); an exception in
    any thread fails the caller with every thread's error."""
    results, errors = {}, []
    start = threading.Barrier(count)

    def run(index):
        try:
            start.wait()
            results[index] = work(index)
        except BaseException as error:  # noqa: BLE001 - reported below with its thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return results


def record_greedy_calls(monkeypatch, module, record: Callable[[object], None]) -> None:
    """Patch ``module.greedy_maximize`` (BumbleBee's, as its module imported it) to pass each call's
    objective to ``record`` before running the greedy as before."""
    greedy = module.greedy_maximize

    def recorded(objective, *args, **kwargs):
        record(objective)
        return greedy(objective, *args, **kwargs)

    monkeypatch.setattr(module, "greedy_maximize", recorded)


# Methods generate_batch refuses to stack, with the reason its error names (empty: every method stacks).
REFUSED_BATCH_METHODS: dict[str, str] = {}


def batch_budget(name: str) -> int | None:
    """A budget every method accepts for the batching tests (None for methods without a budget)."""
    from kvhive.methods.registry import policy_class

    policy = policy_class(name)()
    return max(32, policy.minimum_budget()) if policy.phases else None


def random_objective(rows=4, n=10, dim=4, lam=0.3, phi=None, seed=0, padding=True):
    """Random keys (some near-duplicates, so facility location matters) and attention weights
    spanning three orders of magnitude; row 1 starts with 3 padding elements."""
    from kvhive.methods.submodular import Concave, Mixture, relu_cosine_similarity

    phi = Concave("log") if phi is None else phi
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(rows, n, dim, generator=generator)
    keys[:, 1::3] = keys[:, 0::3][:, : keys[:, 1::3].shape[1]] + 0.1 * torch.randn(
        rows, keys[:, 1::3].shape[1], dim, generator=generator
    )
    weights = torch.rand(rows, n, generator=generator) ** 3 * 20
    valid = torch.ones(rows, n, dtype=torch.bool)
    if padding and rows > 1:
        valid[1, :3] = False
    return Mixture(relu_cosine_similarity(keys, valid), weights, valid, lam, phi)
