"""The parts a cache is made of: its options, its method's traits, its keep-mask checks."""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.cache.budget import Budget
from kvhive.cache.decisions import check_capacity_keep, check_keep, check_row_keep
from kvhive.cache.options import CacheOptions
from kvhive.cache.traits import MethodTraits
from kvhive.methods.base import DECODE, PREFILL, Policy
from kvhive.methods.registry import method_names, policy_class
from kvhive.models.tiny import tiny_model


@pytest.mark.parametrize("method", method_names())
def test_traits_read_the_phases_flags_and_overridden_hooks_of_every_method(method):
    policy = policy_class(method)()
    traits = MethodTraits.of(policy)
    assert traits.has_decode == (DECODE in policy.phases)
    assert traits.has_prefill == (PREFILL in policy.phases)
    assert traits.compresses == bool(policy.phases)
    assert traits.static_decode == policy.static_decode
    assert traits.drops_at_most_one == policy.drops_at_most_one
    assert traits.reads_stored_order == policy.reads_stored_order
    assert traits.declares_capacity == (type(policy).fixed_decode_capacity is not Policy.fixed_decode_capacity)
    assert traits.declares_kept_counts == (type(policy).kept_per_row is not Policy.kept_per_row)
    assert traits.attends_outside_cache == (type(policy).extra_attention is not Policy.extra_attention)


def test_options_parse_the_budget_and_refuse_bad_values_naming_them():
    assert CacheOptions(16).budget == Budget(tokens=16)
    assert CacheOptions(0.25).budget == Budget(ratio=0.25)
    with pytest.raises(ValueError, match="decode_every"):
        CacheOptions(16, decode_every=0)
    with pytest.raises(ValueError, match="cannot be combined"):
        CacheOptions(16, prefill_chunk=8, decode_capacity=8)
    with pytest.raises(ValueError, match="prefill_chunk is not supported with positions='cache'"):
        CacheOptions(16, prefill_chunk=8, positions="cache")


def test_a_cache_reads_its_options_back_as_they_are_now():
    model = tiny_model("llama", "gqa")
    cache = kvhive.make_cache(model, "tova", budget=16, decode_every=2)
    assert cache.options == CacheOptions(Budget(tokens=16), decode_every=2)
    assert cache.traits == MethodTraits.of(cache.policy)


def test_check_keep_counts_on_the_host_or_trusts_a_declared_count():
    keep = torch.tensor([[[True, False, True, True]]])
    assert check_keep(keep, "m", 0, [3])[1].tolist() == [[3]]
    assert check_keep(keep, "m", 0, [3], known=3)[1] == 3
    with pytest.raises(RuntimeError, match="kept 3 tokens per sequence in layer 0, over its budget of 2"):
        check_keep(keep, "m", 0, [2])
    with pytest.raises(RuntimeError, match="declares 3 tokens kept per head in layer 0, over its budget of 2"):
        check_keep(keep, "m", 0, [2], known=3)
    with pytest.raises(TypeError, match="must be boolean"):
        check_keep(keep.int(), "m", 0, [3])


def test_check_keep_over_a_capacity_checks_the_shape_and_keeps_the_counts_on_the_device():
    keep = torch.tensor([[[True, False, True, False]]])
    filled = torch.tensor(3)
    mask, kept = check_capacity_keep(keep, "m", 0, 3, keep.shape, filled)
    assert isinstance(kept, torch.Tensor) and int(kept) == 2 and mask is keep
    # Filling to a budget of 3: the three filled slots are kept whatever the decision says.
    mask, kept = check_capacity_keep(keep, "m", 0, 3, keep.shape, filled, fill_to=3)
    assert mask.tolist() == [[[True, True, True, False]]] and int(kept) == 3
    with pytest.raises(
        TypeError, match=r"a decision over a fixed capacity must be a boolean mask of shape \(1, 1, 5\)"
    ):
        check_capacity_keep(keep, "m", 0, 3, torch.Size([1, 1, 5]), filled)
    with pytest.raises(TypeError, match="a decision over rows of different lengths"):
        check_row_keep(None, "m", 0, 3, keep.shape, filled.view(1, 1, 1))
    # Rows of different lengths: each row's own count, and a row filling to its budget keeps its tokens.
    rows = torch.tensor([[[True, False, True, False]], [[False, True, False, False]]])
    row_filled = torch.tensor([3, 2]).view(2, 1, 1)
    mask, kept = check_row_keep(rows, "m", 0, 3, rows.shape, row_filled)
    assert kept.tolist() == [2, 1]
    mask, kept = check_row_keep(rows, "m", 0, 3, rows.shape, row_filled, fill_to=2)
    assert kept.tolist() == [2, 2] and mask[1, 0].tolist() == [True, True, False, False]
