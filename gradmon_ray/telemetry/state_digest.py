"""A canonical SHA-256 of a nested state dict (tensors, arrays, numbers, strings).

Used to prove that a restored learner holds exactly the checkpointed telemetry state: the
digest is taken when the checkpoint is written and again right after it is restored.
Tensors and arrays count by dtype, shape and bytes, so a torch tensor and the numpy array
it was saved as digest alike; Python and numpy numbers digest by their numpy value.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def state_digest(state: Any) -> str:
    """Hex SHA-256 of ``state``; dict keys are visited in sorted order."""
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def _feed(digest: Any, value: Any) -> None:
    if isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=str):
            digest.update(repr(str(key)).encode())
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, str):
        digest.update(repr(value).encode())
    else:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        array = np.ascontiguousarray(np.asarray(value))
        if array.dtype == object:
            raise TypeError(f"state_digest cannot digest a value of type {type(value).__name__}")
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
