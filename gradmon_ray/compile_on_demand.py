"""``torch.compile`` on demand, with an eager fallback, for the VGS kernels.

A compiled function fuses what eagerly is one pass over memory per line into one pass per
tensor (Inductor's C++/OpenMP code on CPU, Triton on CUDA).  Compiling costs 10-50 s on a
2-core CPU, so it happens lazily, on the first call, only where a caller asked for it; where
it fails (no C++ compiler, an unsupported device) one warning is logged and the function runs
eagerly from then on.  The eager and the compiled version are the same Python function, so
tests check both against the same worked answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

COMPILE_MODES = ("auto", "on", "off")
AUTO_COMPILE_MIN_PARAMETERS = 1_000_000
"""``compile="auto"`` compiles from this many parameters: below it a step costs well under a
millisecond eagerly, less than a compile can ever win back in a short run."""


class Kernel:
    """``fn`` run eagerly, or compiled with ``torch.compile`` on its first call.

    ``label`` names the caller in the one warning a failed compile logs; ``options`` go to
    Inductor (``torch.compile(options=)``); ``compiled`` says which version is in use.
    """

    def __init__(
        self, fn: Callable[..., Any], *, compile: bool, label: str = "VGS", options: dict[str, Any] | None = None
    ) -> None:
        self._eager = fn
        self._options = options
        self._fn: Callable[..., Any] = fn
        self._pending = compile
        self._label = label
        self.compiled = False

    def __call__(self, *args: Any) -> Any:
        if self._pending:
            self._pending = False
            try:
                compiled = torch.compile(self._eager, dynamic=False, fullgraph=True, options=self._options)
                result = compiled(*args)
            except Exception as exc:  # torch's compile errors have no common base class
                logger.warning(
                    "%s: torch.compile failed (%s); running the eager version", self._label, str(exc).splitlines()[0]
                )
                return self._eager(*args)
            self._fn, self.compiled = compiled, True
            return result
        return self._fn(*args)


def wants_compile(mode: str, num_parameters: int) -> bool:
    """``compile="on"`` always, ``"off"`` never, ``"auto"`` from ``AUTO_COMPILE_MIN_PARAMETERS``."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {COMPILE_MODES}, got {mode!r}")
    return mode == "on" or (mode == "auto" and num_parameters >= AUTO_COMPILE_MIN_PARAMETERS)
