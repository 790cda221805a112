"""``filtered_stderr``: native writes to fd 2 are filtered line by line, nothing else is lost.

Each case runs a small Python program in a subprocess (the filter rewires the process's fd 2, and
starts its own child) and reads what reached that program's real standard error.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.e2e  # subprocesses

# Ray 2.60's line, as the driver printed it in a real run.
NOTICE = (
    "[2026-11-26 00:18:09,773 E 18303 18303] core_worker.cc:2465: Actor with class name: 'SingleAgentEnvRunner' "
    "and ID: 'db3170a7cfc28bbd6f52090701000000' has constructor arguments in the object store and max_restarts > 0. "
    "If the arguments in the object store go out of scope or are lost, the actor restart will fail. "
    "See https://github.com/ray-project/ray/issues/53727 for more details."
)
OTHER_ERROR = "[2026-11-26 00:18:09,774 E 18303 18303] core_worker.cc:2500: Failed to register actor: some real error"


def _run(body: str) -> subprocess.CompletedProcess:
    program = textwrap.dedent(
        f"""
        import os, sys
        from gradmon_ray.app.ray_noise import RAY_ACTOR_RESTART_NOTICE
        from gradmon_ray.app.stderr_filter import filtered_stderr
        NOTICE = {NOTICE!r}.encode() + b"\\n"
        OTHER = {OTHER_ERROR!r}.encode() + b"\\n"
        """
    ) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=60)


def test_only_the_restart_notice_is_dropped_everything_else_passes_in_order():
    proc = _run(
        """
        os.write(2, b"before\\n")
        with filtered_stderr([RAY_ACTOR_RESTART_NOTICE]) as on:
            os.write(2, b"first\\n")
            os.write(2, NOTICE)
            print("from python", file=sys.stderr, flush=True)
            os.write(2, OTHER)
            os.write(2, NOTICE.replace(b"SingleAgentEnvRunner", b"MultiAgentEnvRunner"))
            os.write(2, b"no newline at the end")
        print(f"on={on}", file=sys.stderr, flush=True)
        os.write(2, NOTICE)  # after the block: not filtered
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.decode().splitlines() == [
        "before",
        "first",
        "from python",
        OTHER_ERROR,
        "no newline at the endon=True",
        NOTICE,
    ]


def test_what_was_written_before_an_abort_still_arrives():
    """A native FATAL log line is followed by ``abort()``: the filter's own process drains the pipe."""
    proc = _run(
        """
        with filtered_stderr([RAY_ACTOR_RESTART_NOTICE]):
            os.write(2, NOTICE)
            os.write(2, b"F core_worker.cc:1: Check failed: fatal\\n")
            os.abort()
        """
    )
    assert proc.returncode < 0  # killed by SIGABRT
    assert proc.stderr.decode().splitlines() == ["F core_worker.cc:1: Check failed: fatal"]


def test_a_closed_stderr_turns_the_filter_off_instead_of_failing():
    proc = _run(
        """
        saved = os.dup(2)
        os.close(2)
        with filtered_stderr([RAY_ACTOR_RESTART_NOTICE]) as on:
            pass
        os.write(saved, f"on={on}\\n".encode())
        """
    )
    assert proc.returncode == 0 and proc.stderr.decode() == "on=False\n"
