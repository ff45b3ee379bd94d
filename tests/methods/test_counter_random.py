"""The counter-based uniforms behind random+local's priorities and subgen-attention's draws
(kvhive/methods/counter_random.py): deterministic, uniform, independent across indices, and
computed without a host read."""

from __future__ import annotations

import torch

from kvhive.diagnostics import HostReadCounter
from kvhive.methods.counter_random import uniform, uniform_float64


def test_draws_are_a_function_of_seed_and_indices_only():
    index = torch.arange(1000)
    assert torch.equal(uniform(3, index), uniform(3, index))
    assert torch.equal(uniform(3, 7, index), uniform(3, torch.tensor(7), index))
    assert not torch.equal(uniform(3, index), uniform(4, index))
    assert not torch.equal(uniform(3, 0, index), uniform(3, 1, index))
    # A seed's upper 32 bits count too (derived seeds go up to 2**63).
    assert not torch.equal(uniform(5, index), uniform(5 + (1 << 40), index))
    # Negative indices are allowed (taken modulo 2**32).
    assert uniform(0, torch.tensor([-1, -2])).unique().numel() == 2


def test_draws_are_uniform_and_neighbouring_indices_uncorrelated():
    u = uniform(11, torch.arange(200)[:, None], torch.arange(500)[None, :])
    assert u.dtype == torch.float32 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    counts = torch.histc(u, bins=20, min=0.0, max=1.0)
    expected = u.numel() / 20
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 50.0  # 19 degrees of freedom: p < 1e-4 beyond 45
    # Small consecutive inputs (seed 0, head 0, index 0, 1, 2...) must not map almost linearly:
    # one mixing round did (0.0, 0.03, 0.06, ...), which made the newest tokens always win.
    rows = torch.stack([uniform(seed, 0, torch.arange(64)) for seed in range(64)])
    lag = torch.corrcoef(torch.stack([rows[:, 1:].reshape(-1), rows[:, :-1].reshape(-1)]))[0, 1]
    assert abs(float(lag)) < 0.05
    across_seeds = torch.corrcoef(torch.stack([rows[1:].reshape(-1), rows[:-1].reshape(-1)]))[0, 1]
    assert abs(float(across_seeds)) < 0.05


def test_float64_draws_refine_the_float32_ones_below_2_to_the_minus_24():
    index = torch.arange(5000)
    coarse, fine = uniform(9, index), uniform_float64(9, index)
    assert fine.dtype == torch.float64 and float(fine.min()) >= 0.0 and float(fine.max()) < 1.0
    assert torch.equal(torch.floor(fine * 2**24), (coarse.double() * 2**24))
    low = fine * 2**24 - torch.floor(fine * 2**24)
    assert 0.45 < float(low.mean()) < 0.55  # the extra 24 bits are filled


def test_drawing_reads_nothing_on_the_host():
    index = torch.arange(64)
    with HostReadCounter() as counter:
        uniform(1, index[:, None], index[None, :])
        uniform_float64(1 << 50, 3, index)
    assert counter.total == 0, counter
