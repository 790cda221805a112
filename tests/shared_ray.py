"""One local Ray for both pytest-xdist workers of a test session.

Each worker used to start a Ray of its own: two GCS servers, two raylets, two sets of agents, log
monitors and idle workers, which cost about a sixth of a core each while idle (measured on the
2-core box: 15-17 % of one core per idle instance), on a box the suite keeps busy.  Now the first
worker that needs Ray starts one *shared* instance in a helper process of its own (this module
run as a script) and both workers connect to it as drivers: each stays its own Ray job, with its
own actors and its own named-actor namespace.

- The xdist controller makes an empty directory for the session and names it in
  ``GRADMON_TEST_SHARED_RAY_DIR`` (``tests/conftest.py``); the workers inherit it.
- ``address(directory)`` starts the helper under a file lock unless it runs already, and returns
  the GCS address it wrote.  A session that never asks (the fast lane) starts nothing.
- The controller ends the helper, by the process id it wrote, when the session ends
  (``stop(directory)``); the helper also ends by itself once the controller is gone.

With ``-n 0`` the one test process is both controller and worker: the same helper serves it, so
that a test can disconnect and connect again as a new Ray job (``lasting_ray_address``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.processes import alive

DIRECTORY_ENV = "GRADMON_TEST_SHARED_RAY_DIR"
"""Set by the xdist controller (or the ``-n 0`` process): the session's directory for the shared Ray."""
CONTROLLER_ENV = "GRADMON_TEST_CONTROLLER_PID"
"""Set with it: that process's id (the helper ends when that process is gone)."""
NUM_CPUS = 8
"""Logical CPUs of the shared Ray: both workers' tests at once (4 each before, one Ray per worker)."""
START_TIMEOUT_S = 120.0


def address(directory: str | Path) -> str:
    """The shared Ray's GCS address, after starting it if no worker has yet."""
    directory = Path(directory)
    with (directory / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits here while this one starts it
        written = directory / "address"
        if not (written.exists() and alive(int((directory / "pid").read_text()))):
            written.unlink(missing_ok=True)  # a helper that died: start another
            _start(directory)
        return written.read_text()


def _start(directory: Path) -> None:
    log = (directory / "helper.log").open("w")
    helper = subprocess.Popen(
        [sys.executable, "-m", "tests.shared_ray", str(directory), os.environ[CONTROLLER_ENV]],
        cwd=Path(__file__).resolve().parents[1],
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},  # not one worker's test state
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group: Ray's processes go with it, and no Ctrl-C of the worker's
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (directory / "address").exists():
        if helper.poll() is not None or time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(helper.pid, signal.SIGKILL)  # not left running beside the next try
            raise RuntimeError(f"the shared Ray did not start: {(directory / 'helper.log').read_text()[-3000:]}")
        time.sleep(0.2)


def stop(directory: str | Path, grace_s: float = 20.0) -> None:
    """End the helper (and its Ray) if one was started for ``directory``."""
    pid_file = Path(directory) / "pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)  # the helper shuts its Ray down
    deadline = time.monotonic() + grace_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)  # whatever of its group is left


def _serve(directory: Path, controller_pid: int) -> None:
    import ray

    ray.init(
        num_cpus=NUM_CPUS,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(directory / "t"),  # short: Ray's socket paths stay under ~107 characters
    )
    stopping = False

    def on_term(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)  # after ray.init, which installs a handler of its own
    (directory / "pid").write_text(str(os.getpid()))
    written = directory / "address.tmp"
    written.write_text(ray.get_runtime_context().gcs_address)
    written.rename(directory / "address")  # whole, or not there
    try:
        while not stopping:
            try:
                os.kill(controller_pid, 0)
            except ProcessLookupError:  # the test session is gone (killed): do not outlive it
                break
            time.sleep(1.0)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), int(sys.argv[2]))
