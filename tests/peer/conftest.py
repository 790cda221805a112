"""Peer-suite fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread while a peer test runs, restored after it.

    The models are tiny (CartPole, 256x256): extra intra-op threads only spin-wait.  Measured on
    the 2-core box under load: the PPO observe-only cases took 8 s with one thread, 50 s to 120 s
    with two.  Both arms of every comparison run under the same setting.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
