"""``distributed/replica_checksum.py``: the replica checksum against a worked answer in exact Python integers."""

from __future__ import annotations

import numpy as np
import torch

from gradmon_ray.distributed import parameter_checksum


def _python_checksum(arrays: list[np.ndarray]) -> tuple[float, float]:
    """sum_i bits_i * w_i mod 2^48 over the float32 bit patterns, w_i = (i * 2654435761 + 1) | 1."""
    bits = np.concatenate([np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]).view(np.int32)
    total = sum(int(b) * ((i * 2654435761 + 1) | 1) for i, b in enumerate(bits.tolist())) % (1 << 48)
    return float(total >> 24), float(total & ((1 << 24) - 1))


def test_parameter_checksum_equals_exact_integer_arithmetic_on_the_bit_patterns():
    rng = np.random.default_rng(3)
    arrays = [rng.normal(size=(7, 5)).astype(np.float32), (rng.normal(size=11) * 1e-3).astype(np.float32)]
    arrays[1][0] = -0.0  # a bit pattern that is not 0
    digits = parameter_checksum([torch.from_numpy(a) for a in arrays])
    assert digits.dtype == torch.float64
    assert tuple(digits.tolist()) == _python_checksum(arrays)


def test_one_ulp_in_one_element_changes_the_checksum():
    rng = np.random.default_rng(4)
    base = (rng.normal(size=64) * 1e-2).astype(np.float32)
    nudged = base.copy()
    nudged[17] = np.nextafter(nudged[17], np.float32(1.0))
    a = parameter_checksum([torch.from_numpy(base)])
    b = parameter_checksum([torch.from_numpy(nudged)])
    assert tuple(b.tolist()) == _python_checksum([nudged]) != tuple(a.tolist())
