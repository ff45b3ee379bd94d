"""The host-read counter itself (kvhive.diagnostics.HostReadCounter), and the whole prefill's reads.

On the CPU every tensor is on "the device"; the counter tells apart the tensors a GPU run would hold
in host memory (``.cpu()`` results, tensors made without a device, what is computed from them alone),
so host arithmetic on a value read back once is not counted, and sending such a tensor to the device
is (issue 23 item 4: ``.to(device)`` of a host tensor is a host-to-device copy).
"""

from __future__ import annotations

import pytest
import torch

import kvhive
from kvhive.diagnostics import HostReadCounter
from kvhive.models import tiny_model


def test_reads_of_device_tensors_count_and_host_arithmetic_does_not():
    device_values = torch.arange(10)  # made outside the counter: a device tensor to it
    with HostReadCounter() as counter:
        counts = (device_values > 3).sum().cpu()  # a read
        assert int(counts) + int(counts * 2) == 18  # host arithmetic on the copy: no read
        table = torch.tensor([1, 2, 3])  # a host tensor: no transfer
        moved = table.cumsum(0).to(device_values.device)  # a host-to-device copy
        torch.tensor([1, 2], device=device_values.device)  # a host-to-device copy
        assert bool(moved.sum() > 0)  # a read of a device value
        assert int(torch.arange(4).sum()) == 6  # host: no read
        device_values[device_values > 5]  # boolean-mask indexing of a device tensor: a read
        table[table > 1]  # of a host tensor: none
        torch.zeros(3).float().to(torch.float64)  # dtype changes on the host: none
    assert dict(counter.reads) == {
        "cpu": 1,
        "to(host tensor)": 1,
        "tensor(python data)": 1,
        "__bool__": 1,
        "index(boolean mask)": 1,
    }


def test_a_cpu_copy_is_not_the_device_tensor():
    # On the CPU .cpu() returns the tensor itself: the counter hands back a copy, so the device
    # tensor is not taken for a host one afterwards.
    device_values = torch.ones(3)
    with HostReadCounter() as counter:
        host = device_values.cpu()
        assert host is not device_values
        bool(device_values.sum())
        bool(host.sum())
    assert counter.total == 2  # the .cpu() and the bool of the device tensor


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", "gqa")


@pytest.mark.parametrize("method", [m for m in kvhive.method_names() if m != "full"])
def test_a_whole_prefill_reads_at_most_4_times_per_layer(model, method):
    # The cache's own work included (compaction, packing head-wise lengths): issue 25 item 3 over the
    # whole compression, at 256 and 2,048 tokens.
    layers = model.config.num_hidden_layers
    for length in (256, 2048):
        cache = kvhive.make_cache(model, method, ratio=0.25)
        prompt = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        with torch.no_grad(), HostReadCounter() as counter:
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
        assert counter.total <= 4 * layers, (length, dict(counter.reads))


def test_a_host_tensor_in_an_op_on_device_tensors_is_a_copy():
    device_values = torch.arange(10.0)
    with HostReadCounter() as counter:
        index = torch.tensor([1, 2])  # a host tensor
        device_values[index]  # indexing a device tensor with it copies it to the device
        device_values * torch.tensor(2.0)  # a 0-d host tensor is a scalar to a device op: no copy
    assert dict(counter.reads) == {"__getitem__(host tensor on the device)": 1}
