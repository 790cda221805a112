"""A new local ``sqlite:`` store is created by one process at a time.

MLflow creates a new sqlite store's tables (its schema migration, seconds) the first time a process
opens it, with no lock: Tune trials (or learners, probes) that start together on one new file all
migrate it at once and fail (``table params already exists``, ``duplicate column name``), and can
leave it broken.  gradmon creates a store only when a run is made (never when a config is pickled or
a build fails), so the sink calls ``create_store_once`` before its first contact with a store: the
first process creates the tables under a lock, the others wait for it, find them and go on
without holding the lock (opening an existing store is not serialised).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
from pathlib import Path

from gradmon_ray.tracking.store_check import local_store_path


def _has_tables(path: Path) -> bool:
    """Whether ``path`` is an sqlite file whose MLflow schema has been written (read-only look)."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)) as db:
            names = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not {"experiments", "alembic_version"} <= names:
                return False
            return db.execute("SELECT 1 FROM alembic_version").fetchone() is not None  # the migration ended
    except sqlite3.Error:
        return False  # MLflow, opening it next, says what is wrong with it


def create_store_once(uri: str) -> None:
    """Create ``uri``'s sqlite store (MLflow's tables) unless it exists; other URIs: nothing.

    The lock is ``flock`` on the store's directory: nothing is written to lock it (a lock file would
    be one more file a run leaves), and the kernel releases it if its holder dies.  A directory that
    cannot be opened is left to MLflow, which then fails on it and says why.
    """
    path = local_store_path(uri) if uri.startswith("sqlite:") else None
    if path is None or _has_tables(path):
        return
    try:
        fd = os.open(path.absolute().parent, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # blocks while another process creates it
        if not _has_tables(path):
            from mlflow.tracking import MlflowClient

            MlflowClient(uri).search_experiments(max_results=1)  # the first open creates the tables
    finally:
        os.close(fd)  # releases the flock
