"""Two real processes in one gloo ``torch.distributed`` world, started once, running many jobs.

A test module starts them once (a module-scoped fixture) and sends them jobs: ``run(fn, args_0,
args_1)`` calls ``fn(rank, *args_r)`` in rank r's process and returns both results.  ``fn`` is a
module-level function (pickled by name, imported in the process); a job may keep objects for a
later job in ``STATE`` (the process's own dict).  The processes are forked from a forkserver
that imported torch (and ``preload``) once for both.

A failure in either rank (the traceback), or a rank still busy after ``timeout`` seconds (a
hang: the world's own collective timeout ends a rank stuck in an all-reduce first), fails the
job; the processes are then started again for the next job, whose world is a fresh one.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

WORLD_SIZE = 2
COLLECTIVE_TIMEOUT_S = 30
"""gloo's timeout for one collective: a rank waiting longer for the other raises (a hang ends)."""
ALWAYS_PRELOADED = ("torch", "torch._dynamo", "ray.rllib.algorithms.ppo", "gradmon_ray.rllib")
"""What every rank of the suite's learner jobs imports, whichever module starts the forkserver: only
its first start reads the preload (one forkserver per pytest process), and a module that preloaded
only torch left each later module's two ranks to import RLlib themselves (about 2 CPU-seconds a rank
process, each pair of ranks, on the 2-core box).  ``torch._dynamo``: what DDP's constructor imports
(RLlib's DDP wrapping, ``test_noise_hook``'s learners), 1.1 CPU-seconds a process otherwise."""
STATE: dict[str, Any] = {}
"""A rank's objects kept from one job to the next (learners, batches), in its own process."""


class JobFailed(AssertionError):
    """A rank raised, or hung, in a job (the message has each rank's traceback)."""


def _serve(rank: int, init_file: str, inbox: Any, outbox: Any) -> None:
    """A rank's loop: join the world, run jobs until ``None``; then a hard exit (interpreter
    teardown can deadlock deallocating DDP's reducer against gloo's threads)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    while (job := inbox.get()) is not None:
        fn, args = job
        try:
            outbox.put((rank, True, fn(rank, *args)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))
    os._exit(0)


class TwoRanks:
    """Two processes (ranks 0 and 1) of one gloo world; ``run`` a job in both, ``close`` them."""

    def __init__(self, preload: Sequence[str] = (), timeout: float = 90.0) -> None:
        self._preload = [*ALWAYS_PRELOADED, *preload]
        self._timeout = timeout
        self._processes: list[Any] = []

    def _start(self) -> None:
        context = multiprocessing.get_context("forkserver")
        # Only the forkserver's first start reads the preload (it is one per pytest process).
        context.set_forkserver_preload(self._preload)
        self._dir = tempfile.mkdtemp(prefix="two-ranks-")
        init_file = str(Path(self._dir) / "rendezvous")
        self._inboxes = [context.Queue() for _ in range(WORLD_SIZE)]
        self._outbox = context.Queue()
        self._processes = [
            context.Process(target=_serve, args=(rank, init_file, self._inboxes[rank], self._outbox), daemon=True)
            for rank in range(WORLD_SIZE)
        ]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], *per_rank: Sequence[Any]) -> list[Any]:
        """``[fn(0, *per_rank[0]), fn(1, *per_rank[1])]`` (no ``per_rank``: ``fn(rank)`` in each)."""
        if not self._processes:
            self._start()
        args = list(per_rank) or [()] * WORLD_SIZE
        for rank, inbox in enumerate(self._inboxes):
            inbox.put((fn, tuple(args[rank])))
        results: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + self._timeout
        while len(results) + len(errors) < WORLD_SIZE:
            try:
                rank, ok, value = self._outbox.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    busy = [r for r in range(WORLD_SIZE) if r not in results]
                    why = f"exited (codes {[self._processes[r].exitcode for r in dead]})" if dead else "a hang"
                    errors.append(f"rank(s) {busy} gave no result for {fn.__name__}: {why}")
                    break
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close()  # the world is out of step: the next job starts fresh processes
            raise JobFailed(f"{fn.__name__} failed:\n" + "\n".join(errors))
        return [results[r] for r in range(WORLD_SIZE)]

    def close(self) -> None:
        """Stop both processes (ask, then kill what is still running)."""
        for process, inbox in zip(self._processes, getattr(self, "_inboxes", []), strict=False):
            if process.is_alive():
                inbox.put(None)
        for process in self._processes:
            if process.pid is None:
                continue  # never started
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        self._processes = []
        if hasattr(self, "_dir"):
            shutil.rmtree(self._dir, ignore_errors=True)
