"""Drop known, harmless lines that native code writes straight to this process's standard error.

Ray's C++ core worker logs its ERROR-level lines to the process's file descriptor 2, below Python:
no ``logging`` filter sees them, and Ray's only knob (``RAY_BACKEND_LOG_LEVEL``) would silence
every error with them.  ``filtered_stderr(patterns)`` puts a pipe on fd 2 for the duration of a
``with`` block and a small child process on the other end, which copies every line to the real
standard error except those matching one of ``patterns``.  A child process, not a thread, so that
nothing is lost when this process dies abruptly (a native ``abort`` after a FATAL log line, a
SIGKILL): the child drains the pipe until every writer is gone.  Line by line, in order; a final
line without a newline is passed on when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

# Run with -I -S: no site, no user paths, nothing of this package imported; stdout is the real stderr.
_FILTER_SOURCE = """
import re, sys
drop = [re.compile(p.encode()) for p in sys.argv[1:]]
out = sys.stdout.buffer
for line in sys.stdin.buffer:
    if not any(p.search(line) for p in drop):
        out.write(line)
        out.flush()
"""

FILTER_WAIT_S = 5.0
"""How long leaving the block waits for the child to pass on what is still in the pipe."""


@contextlib.contextmanager
def filtered_stderr(patterns: Sequence[str]) -> Iterator[bool]:
    """Within the block, lines written to fd 2 (by Python or native code) that match one of
    ``patterns`` (regular expressions, searched in each line) are dropped; everything else reaches
    the real standard error.  Yields whether the filter is on (False when fd 2 cannot be
    redirected, e.g. it is closed: then nothing is filtered)."""
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError) as exc:  # no fd 2 to filter
        logger.debug("stderr filter off: %s", exc)
        yield False
        return
    child = None
    try:
        read_end, write_end = os.pipe()
        try:
            child = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _FILTER_SOURCE, *patterns],
                stdin=read_end,
                stdout=real,
                stderr=real,
                start_new_session=True,  # a Ctrl-C to our terminal must not kill it before it has drained
            )
        finally:
            os.close(read_end)
        os.dup2(write_end, 2)
        os.close(write_end)
    except OSError as exc:
        logger.debug("stderr filter off: %s", exc)
        os.dup2(real, 2)
        os.close(real)
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.flush()
        os.dup2(real, 2)  # the pipe's last writer in this process is gone: the child sees EOF
        os.close(real)
        try:
            child.wait(timeout=FILTER_WAIT_S)
        except subprocess.TimeoutExpired:  # another process still holds the pipe: the child outlives it
            logger.debug("stderr filter: a process still writes to the pipe; the filter keeps draining it")
