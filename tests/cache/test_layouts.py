"""A layer's storage layouts (kvhive.cache.layers): one LayerStore object whose layout changes only at
its transitions, handing its buffers over, with the layout's traits read off the store."""

from __future__ import annotations

import copy

import pytest
import torch

from kvhive.cache.layers import CapacityLayout, GrowingLayout, LayerStore, PackedLayout, RowsLayout


def _tokens(batch, heads, length, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, length, 4, generator=generator), torch.randn(
        batch, heads, length, 4, generator=generator
    )


def test_reserve_decode_keeps_the_buffers_and_a_chunk_grows_again():
    store = LayerStore(0)
    store.update(*_tokens(1, 2, 9))
    store.update(*_tokens(1, 2, 1, seed=3))  # the buffers grow: 10 tokens plus the append reserve
    keys_before = store.buffers()[0]
    store.reserve_decode(8)  # fits those buffers: they are kept
    assert type(store.layout) is CapacityLayout and store.fixed_capacity and not store.bounded_capacity
    assert store.buffers()[0].data_ptr() == keys_before.data_ptr()
    store.update(*_tokens(1, 2, 1, seed=1))
    assert store.known_length == 11 and int(store.length_device) == 11
    store.update(*_tokens(1, 2, 3, seed=2))  # a multi-token update: the growing layout again
    assert type(store.layout) is GrowingLayout and not store.fixed_capacity
    assert store.dense_length == 14 and store.tokens_seen == 14
    assert store.dense()[2][0, 0].tolist() == list(range(14))


def test_an_exact_capacity_is_bounded_and_fills_to_budget_is_its_parameter():
    store = LayerStore(0)
    store.update(*_tokens(1, 2, 10))
    store.fills_to_budget = True  # the cache's plan, set before it reserves
    store.reserve_decode(3, exact=True)
    assert type(store.layout) is CapacityLayout and store.layout.fills_to_budget and store.fills_to_budget
    assert store.bounded_capacity and store.buffers()[0].shape[2] == 13
    keys, values, positions, _, filled = store.decode_view()
    assert keys.shape[2] == 13 and filled.tolist() == [True] * 10 + [False] * 3
    store.reset()
    assert type(store.layout) is GrowingLayout and not store.fills_to_budget and store.length_device is None


def test_an_unbounded_capacity_overflowed_eagerly_grows():
    store = LayerStore(0)
    store.update(*_tokens(1, 1, 4))
    store.reserve_decode(1)
    capacity = store.buffers()[0].shape[2]
    for step in range(capacity - 4 + 1):
        store.update(*_tokens(1, 1, 1, seed=step + 1))
    assert type(store.layout) is GrowingLayout and store.dense_length == capacity + 1
    assert store.dense()[2][0, 0].tolist() == list(range(capacity + 1))


def test_rows_of_different_lengths_and_their_bound():
    store = LayerStore(0)
    rows = [_tokens(1, 2, length, seed=length) for length in (3, 5)]
    positions = [torch.arange(length, dtype=torch.int32).expand(1, 2, length) for length in (3, 5)]
    store.set_rows([k for k, _ in rows], [v for _, v in rows], positions, [{}, {}], [3, 5], decode_room=4)
    assert type(store.layout) is RowsLayout and store.has_row_lengths and not store.bounded_capacity
    assert store.row_lengths == [3, 5] and store.row_lengths_device.tolist() == [3, 5]
    store.reserve_rows(7)
    assert type(store.layout) is RowsLayout and store.bounded_capacity and store.buffers()[0].shape[2] == 7
    store.update(*_tokens(2, 2, 1, seed=9))
    assert store.row_lengths == [4, 6] and store.row_tokens_seen == [4, 6]
    with pytest.raises(RuntimeError, match="rows of different lengths"):
        store.fill_hole(torch.zeros(2, 2, dtype=torch.long))
    selected = copy.deepcopy(store)
    selected.select_rows(torch.tensor([1]))
    assert selected.row_lengths == [6] and selected.row_tokens_seen == [6] and store.row_lengths == [4, 6]


def test_a_packed_layer_refuses_the_dense_views_and_rows_naming_its_layout():
    store = LayerStore(3)
    store.update(*_tokens(1, 2, 6))
    mask = torch.ones(1, 2, 6, dtype=torch.bool)
    mask[0, 0, :2] = False
    store.keep(mask)
    assert type(store.layout) is PackedLayout and not store.is_uniform
    with pytest.raises(RuntimeError, match="layer 3 holds a different number of tokens per head"):
        store.decode_view()
    with pytest.raises(NotImplementedError, match="packed, head-wise layout"):
        store.batch_select_indices(torch.tensor([0]))
    store.reserve_decode(40)
    assert type(store.layout) is PackedLayout and store.fixed_capacity
    assert (store.segment_capacity_host - store.lengths_host.reshape(-1) >= 40).all()
