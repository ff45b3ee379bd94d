"""Fixed batch slots (issue 24, with issue 23's static step): a batch of ``batch_slots`` rows whose
requests leave (``free_slots``) and join (``fill_slots``) in place.

Proxies for what a GPU needs: every buffer and counter keeps its address through leaves and joins
(a CUDA graph replays on them), the decode step right after a join reads nothing back, and a
compiled step (``fullgraph=True``, ``error_on_recompile``) serves steps before and after joins and
leaves. Every running row gives what its prompt gives alone.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import kvhive
from kvhive.cache import KVHiveCache
from kvhive.compat import cache_kwarg
from kvhive.diagnostics import HostReadCounter
from kvhive.methods.base import DECODE
from kvhive.methods.registry import method_names, policy_class
from kvhive.models import tiny_model, tiny_tokenizer

from helpers import REFUSED_BATCH_METHODS as REFUSED
from helpers import batch_budget as _budget

LENGTHS = (57, 40, 73, 45)  # rows 0 and 1 start in 3 slots; 2 and 3 join after row 0 leaves
SLOTS = 3
STEPS = 5
NEW_TOKENS = 2 * STEPS + 2
# Ada-KV keeps different counts per head: no dense row to put in a slot (stack refuses it).
SLOTTED = [name for name in method_names() if name not in REFUSED and not name.startswith("ada-")]
COMPILED = [name for name in SLOTTED if policy_class(name).static_decode or DECODE not in policy_class(name).phases]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


def _prompts(model):
    generator = torch.Generator().manual_seed(4)
    return [torch.randint(3, model.config.vocab_size, (1, n), generator=generator) for n in LENGTHS]


def _prefilled(model, method, prompt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = kvhive.make_cache(model, method, _budget(method))
        with torch.no_grad():
            logits = model(input_ids=prompt, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]
    return cache, logits.argmax(-1)


def _step(model, tokens, positions, cache):
    return model(input_ids=tokens, position_ids=positions, **{cache_kwarg(model): cache}, use_cache=True).logits[:, -1]


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _addresses(cache: KVHiveCache) -> list[int]:
    """Every buffer, counter and method-state tensor a decode step reads or writes."""
    found = []
    for layer in cache.layers:
        counters_ = (
            layer.tokens_seen_device,
            layer.row_tokens_seen_device,
            layer.row_lengths_device,
            layer.row_active_device,
            layer.length_device,
        )
        found += list(layer.token_buffers.tensors())  # keys, values, positions, per-token scores
        found += [counter for counter in counters_ if counter is not None]
        found += list(_tensors(layer.policy_state))
    return [tensor.data_ptr() for tensor in found]


class _Run:
    """A slotted batch beside each prompt decoded alone, fed the same tokens."""

    def __init__(self, model, method, step=_step):
        self.model, self.method, self.step = model, method, step
        self.prompts = _prompts(model)
        started = [_prefilled(model, method, self.prompts[index]) for index in (0, 1)]
        self.alone = {index: _prefilled(model, method, self.prompts[index])[0] for index in range(len(LENGTHS))}
        self.cache = KVHiveCache.stack(
            [cache for cache, _ in started],
            decode_capacity=NEW_TOKENS,
            batch_slots=SLOTS,
            slot_capacity=max(LENGTHS) + NEW_TOKENS + 1,
        )
        self.running = [0, 1, None]
        self.tokens = torch.zeros(SLOTS, dtype=torch.long)
        self.tokens[:2] = torch.cat([token for _, token in started])
        self.seen = {index: LENGTHS[index] for index in range(len(LENGTHS))}

    def join(self, slot: int, index: int) -> None:
        cache, token = _prefilled(self.model, self.method, self.prompts[index])
        self.cache.fill_slots([slot], [cache])
        self.running[slot] = index
        self.tokens[slot] = token[0]

    def leave(self, slot: int) -> None:
        self.cache.free_slots([slot])
        self.running[slot] = None

    def decode(self, steps: int) -> None:
        with torch.no_grad():
            for number in range(steps):
                positions = self.cache.layers[0].row_tokens_seen_device[:, None].clone()
                logits = self.step(self.model, self.tokens[:, None], positions, self.cache)
                for slot, index in enumerate(self.running):
                    if index is None:
                        continue
                    alone = _step(
                        self.model,
                        self.tokens[slot].reshape(1, 1),
                        torch.tensor([[self.seen[index]]]),
                        self.alone[index],
                    )
                    torch.testing.assert_close(
                        logits[slot : slot + 1],
                        alone,
                        atol=1e-5,
                        rtol=1e-5,
                        msg=f"{self.method} step {number} slot {slot}",
                    )
                    self.seen[index] += 1
                self.tokens = logits.argmax(-1)


@pytest.mark.parametrize("method", SLOTTED)
def test_rows_leave_and_join_in_place_and_decode_as_alone(model, method):
    run = _Run(model, method)
    assert run.cache.active_slots == [True, True, False]
    run.decode(STEPS)
    before = _addresses(run.cache)
    run.leave(0)
    run.join(0, 2)  # seen more than either running row
    run.join(2, 3)  # the slot free from the start
    assert run.cache.active_slots == [True, True, True]
    assert run.cache.row_tokens_seen() == [LENGTHS[2], LENGTHS[1] + STEPS, LENGTHS[3]]
    run.decode(STEPS)
    assert _addresses(run.cache) == before, "a leave or a join moved a buffer"


@pytest.mark.parametrize("method", SLOTTED)
def test_the_step_after_a_join_reads_nothing_back(model, method):
    run = _Run(model, method)
    run.decode(2)
    run.leave(1)
    run.join(1, 2)
    with torch.no_grad(), HostReadCounter() as reads:
        positions = run.cache.layers[0].row_tokens_seen_device[:, None].clone()
        _step(model, run.tokens[:, None], positions, run.cache)
    assert reads.total == 0, f"{method}: {reads}"


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


@pytest.mark.parametrize("method", COMPILED)
def test_one_compiled_step_serves_steps_across_joins_and_leaves(model, method, fresh_dynamo):
    compiled = torch.compile(_step, fullgraph=True, dynamic=False, backend="aot_eager")
    run = _Run(model, method, step=compiled)
    assert run.cache.is_compileable, run.cache.compile_problem(min(LENGTHS))
    run.decode(STEPS)  # each compiled step's logits equal each row decoded alone, eagerly
    run.leave(0)
    run.join(0, 2)
    run.decode(STEPS)
    run.leave(1)
    run.decode(2)
    run.join(1, 3)
    run.decode(2)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize("method", ["h2o", "full", "snapkv"])
def test_generate_batch_compiled_equals_eager(method, fresh_dynamo):
    model, tokenizer = tiny_model("llama", "gqa"), tiny_tokenizer()
    text = "the quick brown fox jumps over the lazy dog and keeps running far away " * 3
    prompts = [text[:n] for n in (60, 41, 75, 52, 66)]
    budget = _budget(method)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = kvhive.generate_batch(model, tokenizer, prompts, method, budget, 8, max_batch_size=3)
        compiled = kvhive.generate_batch(
            model, tokenizer, prompts, method, budget, 8, max_batch_size=3, compile="aot_eager"
        )
    assert compiled == eager
    assert counters["stats"]["unique_graphs"] == 1  # 3 slots round up to 4; one graph for every step


def test_slot_refusals(model):
    prompts = _prompts(model)
    first, _ = _prefilled(model, "h2o", prompts[0])
    second, _ = _prefilled(model, "h2o", prompts[1])
    with pytest.raises(ValueError, match="batch_slots=1: expected an integer >= 2"):
        KVHiveCache.stack([first, second], batch_slots=1)
    with pytest.raises(ValueError, match="slot_capacity=8: .*with batch_slots"):
        KVHiveCache.stack([first, second], slot_capacity=8)
    plain = KVHiveCache.stack([first, second])
    with pytest.raises(ValueError, match="no fixed batch slots"):
        plain.free_slots([0])
    slotted = KVHiveCache.stack([first, second], batch_slots=3)
    joiner, _ = _prefilled(model, "h2o", prompts[2])
    with pytest.raises(ValueError, match=r"slot\(s\) \[0\] are not free"):
        slotted.fill_slots([0], [joiner])
    with pytest.raises(ValueError, match=r"slot\(s\) \[2\] are not running"):
        slotted.free_slots([2])
    with pytest.raises(ValueError, match=r"distinct slot numbers in \[0, 3\)"):
        slotted.free_slots([3])
    with pytest.raises(ValueError, match="1 slot.* for 2 joining row"):
        slotted.fill_slots([2], [joiner, second])
    # A method that builds its state at its first eviction keeps one length per layer: a row below
    # its budget is refused, naming the method and why (H2O's slots take it: they keep a length per row).
    first, _ = _prefilled(model, "subgen", prompts[0])
    second, _ = _prefilled(model, "subgen", prompts[1])
    slotted = KVHiveCache.stack([first, second], batch_slots=3)
    short, _ = _prefilled(model, "subgen", prompts[0][:, :20])  # below the budget: another length
    with pytest.raises(ValueError, match="every running row holds.*'subgen' builds its state at its first eviction"):
        slotted.fill_slots([2], [short])
    assert slotted.active_slots == [True, True, False]  # refused before anything changed
    full_first, _ = _prefilled(model, "full", prompts[1])
    growing = KVHiveCache.stack([full_first], batch_slots=2, slot_capacity=50)
    long_joiner, _ = _prefilled(model, "full", prompts[2])
    with pytest.raises(ValueError, match="more than its slot capacity of 50"):
        growing.fill_slots([1], [long_joiner])


@pytest.mark.parametrize("method", ["h2o", "snapkv", "full"])
def test_bench_rows_alone_keeps_what_the_batch_keeps(model, method):
    # The serving path of the capacity benchmark (kvhive bench --rows-alone): each row prefilled
    # alone into fixed slots, then decoded together, keeps per row what one batched prefill keeps.
    from golden_kept import snapshot

    from kvhive.bench import timed_run

    input_ids = torch.randint(3, model.config.vocab_size, (3, 70), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batched, _, batched_steps, _ = timed_run(model, input_ids, method, _budget(method), 4, {})
        alone, _, alone_steps, _ = timed_run(model, input_ids, method, _budget(method), 4, {}, rows_alone=True)
    assert alone.is_slotted and alone.active_slots == [True, True, True]
    assert alone.row_tokens_seen() == [70 + 4] * 3
    assert len(alone_steps) == len(batched_steps) == 4
    assert snapshot(alone) == snapshot(batched)
