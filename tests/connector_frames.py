"""RLlib's ``ConnectorV2.__init__`` without reading source files: the same caller frame, found by
walking the frames instead of ``inspect.stack()``.

``ConnectorV2.__init__`` (RLlib 2.58 to 2.60) records its subclass's constructor arguments from
``inspect.stack()[1].frame``.  ``inspect.stack()`` also builds every frame's source context
(``findsource``, ``getmodule`` over ``sys.modules``), some 60 frames deep under pytest, for each of
the dozen connector pieces an EnvRunner or a learner builds: half the CPU of an in-process learner
build or EnvRunner (measured 2026-11-29, ``-n 0``: ``rllib/test_learner.py`` and
``peer/test_observe_only.py``'s fast tests 11.5 -> 5.7 CPU-s).  RLlib reads only the frames, so a
list of bare frames gives it the very same constructor arguments (``test_connector_frames.py``
compares them).  The connectors, learners and EnvRunners stay RLlib's own.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager

from ray.rllib.connectors import connector_v2


class _FramesOnly(types.ModuleType):
    """``inspect`` as ``connector_v2`` uses it, but ``stack()`` holds the frames only."""

    def __getattr__(self, name: str) -> object:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[types.SimpleNamespace]:
        frame, frames = sys._getframe(1), []  # [0]: the caller of stack(), as inspect.stack()
        while frame is not None:
            frames.append(types.SimpleNamespace(frame=frame))
            frame = frame.f_back
        return frames


@contextmanager
def connector_frames_only() -> Iterator[None]:
    """While open, RLlib's connectors find their caller's frame without reading source files
    (nothing changes where ``connector_v2`` does not use ``inspect`` as above)."""
    if getattr(connector_v2, "inspect", None) is not inspect:
        yield
        return
    connector_v2.inspect = _FramesOnly("inspect")
    try:
        yield
    finally:
        connector_v2.inspect = inspect
