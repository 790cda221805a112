"""``gradmon-ray`` commands run through the CLI's ``main`` in the test process, on the session's Ray.

A subprocess would import torch, Ray, RLlib and MLflow again and start a Ray of its own (about
15 s on a 2-core box, each time); the console script in a process of its own is exercised once,
by tests/e2e/test_console_script_e2e.py (Ctrl-C included), and by tests/e2e/test_job_submit_e2e.py.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    """Python's writes to ``sys.stderr`` and what native code (Ray's C++ core) wrote to fd 2."""


@contextlib.contextmanager
def _captured(cwd: Path) -> Iterator[Callable[[], tuple[str, str]]]:
    """Run the block in ``cwd`` with stdout and stderr captured (fd 2 too) and the environment put
    back afterwards: ``main`` sets process-wide variables meant for a process that exits.  The root
    logger's handlers (pytest's) are set aside, so that ``main``'s own ``logging.basicConfig``
    writes its warnings to the captured stderr, as in a process of its own."""
    out, err = io.StringIO(), io.StringIO()
    environ, saved_cwd = dict(os.environ), os.getcwd()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers = []
    with tempfile.TemporaryFile(mode="w+") as native:
        sys.stderr.flush()
        saved_fd2 = os.dup(2)
        try:
            os.chdir(cwd)
            os.dup2(native.fileno(), 2)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield lambda: (out.getvalue(), err.getvalue() + _read(native))
        finally:
            os.dup2(saved_fd2, 2)
            os.close(saved_fd2)
            os.chdir(saved_cwd)
            root.handlers, root.level = handlers, level
            for key in set(os.environ) - set(environ):
                del os.environ[key]
            os.environ.update(environ)


def _read(file: IO[str]) -> str:
    file.seek(0)
    return file.read()


def run_cli(argv: list[str], cwd: Path) -> CliResult:
    """``gradmon-ray <argv>`` from ``cwd``: its exit code, standard output and standard error."""
    from gradmon_ray.app.cli import main

    with _captured(cwd) as read:
        code = main(argv)
        stdout, stderr = read()
    return CliResult(code, stdout, stderr)
