"""`kernels.host_copy`: host values on the device, with the values and dtype of `torch.tensor`."""
from __future__ import annotations

import pytest
import torch

from kernels.host_copy import host_to_device, to_device

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("asynchronous", [True, False])
def test_to_device_holds_the_values(device, asynchronous):
    values = [[3, -1, 7], [2**40, 0, 5]]
    got = to_device(values, torch.long, torch.device(device), asynchronous)
    assert got.device.type == device and got.dtype == torch.long
    assert torch.equal(got.cpu(), torch.tensor(values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pinned", [False, True])
def test_host_to_device_holds_the_values(device, pinned):
    host = torch.arange(1000, dtype=torch.int32).reshape(10, 100)
    if pinned and device == "cuda":
        host = host.pin_memory()
    got = host_to_device(host, torch.device(device))
    assert got.device.type == device and got.dtype == torch.int32
    assert torch.equal(got.cpu(), torch.arange(1000, dtype=torch.int32).reshape(10, 100))
