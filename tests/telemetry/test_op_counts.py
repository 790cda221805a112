"""``telemetry/op_counts.py``: what counts as a host read, on plain tensors (the learner-level seeds
are in ``tests/rllib/test_host_reads.py``)."""

from __future__ import annotations

import torch

from gradmon_ray.telemetry.op_counts import HOST_CALLS, OpCounter


def test_a_host_copy_is_read_once_and_host_data_is_no_device_read():
    """``.cpu()`` is the one read; reading its result (or a view of it) again is host memory, as on a
    GPU.  A tensor made from host data without a device is host memory too: reading it, or
    converting its dtype, is no read; moving it to the device (``.to(device)``) is one."""
    device_tensor = torch.arange(6.0)
    with OpCounter() as counter:
        host = device_tensor.cpu()
        host.numpy()
        host[2:].tolist()
        made = torch.tensor([1.0, 2.0])
        made.tolist()
        made.to(torch.float64)
        made.to("cpu")  # host data kept on the host: no copy
        made.to(torch.device("cpu"))  # a torch.device: the learner's device, a GPU in production
    assert counter.host_reads == {"Tensor.cpu": 1, "Tensor.to": 1}


def test_every_counted_name_is_declared():
    """The names the tests and the bench read are the declared ones (a renamed call would count
    under a name no assertion expects)."""
    with OpCounter() as counter:
        x = torch.ones(2)
        torch.tensor([0.0]).copy_(x[:1])
        x.tolist()
        x.numpy()
        torch.tensor([1.0], device="cpu")
        torch.as_tensor([1.0], device="cpu")
        torch.asarray([1.0], device="cpu")
        x.to("cpu")  # last: on a CPU it returns x itself, which is a host tensor from then on
    assert set(counter.host_reads) <= HOST_CALLS
    assert counter.num_host_reads == 7, dict(counter.host_reads)


def test_a_named_move_to_the_host_counts_positional_or_keyword():
    """``.to("cpu")`` and ``.to(device="cpu")`` of a device tensor are device->host copies."""
    with OpCounter() as counter:
        torch.ones(2).to("cpu")
        torch.ones(2).to(device="cpu", dtype=torch.float64)
    assert counter.host_reads == {"Tensor.to(cpu)": 2}


def test_a_non_blocking_upload_from_pinned_memory_is_no_host_read(monkeypatch):
    """From pinned memory with ``non_blocking=True`` a host->device copy does not wait; from pageable
    memory, or blocking, it does.  (A CPU-only torch cannot pin: ``is_pinned`` is stood in.)"""
    device = torch.device("cpu")  # the learner's device: a GPU in production
    with OpCounter() as counter:
        host = torch.tensor([1.0, 2.0])
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
        host.to(device, non_blocking=True)
        torch.zeros(2).copy_(host, non_blocking=True)
        host.to(device)  # blocking
        monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
        host.to(device, non_blocking=True)  # pageable
    assert counter.host_reads == {"Tensor.to": 2}
