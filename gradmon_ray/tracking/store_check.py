"""Will a local MLflow store work?  Checked before Ray or MLflow start, without creating anything.

MLflow only finds out that ``sqlite:////etc/hostname/mlflow.db`` or ``file:///proc/mlruns`` can
never work when it first writes, after training has started; and a read-only command pointed
at a directory without a store would create an empty one.  These checks read the filesystem
only.  Server URIs (``http(s)://``, ``databricks``, database URLs other than sqlite) are not
checked here: a server outage is buffered, spilled and replayed by the sink.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse


def local_store_path(uri: str) -> Path | None:
    """The filesystem path of a local store (``sqlite:///x.db``, ``file:///dir``, a plain path), else None."""
    if uri.startswith("sqlite:///"):
        path = uri[len("sqlite:///") :].split("?", 1)[0]
        return None if path in ("", ":memory:") else Path(path)
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path))
    if parsed.scheme == "" and uri:  # MLflow treats a bare path as a file store
        return Path(uri)
    return None


def _can_create_in(directory: Path) -> bool:
    """Whether something can be created in ``directory``: tried (a temporary directory, removed
    at once), since permission bits do not tell (root passes ``os.access`` on ``/proc``)."""
    if not directory.is_dir():
        return False
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gradmon-store-check-", dir=directory))
    except OSError:
        return False
    return True


def local_store_problem(uri: str, *, must_exist: bool) -> str | None:
    """Why the local store at ``uri`` cannot work, in one line (None: it can, or it is not local).

    ``must_exist``: for commands that only read (``watch``, ``report``): a store that is not
    there is a problem (and is never created).  Otherwise the store may be created, so its
    directory must exist and be writable.
    """
    path = local_store_path(uri)
    if path is None:
        return None
    is_sqlite = uri.startswith("sqlite:")
    if path.exists():
        if is_sqlite and path.is_dir():
            return f"{uri} is a directory, not an sqlite database file"
        if not is_sqlite and not path.is_dir():
            return f"{uri} is a file, not a directory (a file store is a directory)"
        if not must_exist and not (_can_create_in(path) if path.is_dir() else os.access(path, os.W_OK)):
            return f"{uri} is not writable"
        return None
    if must_exist:
        return f"no MLflow store at {uri} (nothing to read here; pass --tracking-uri or set MLFLOW_TRACKING_URI)"
    parent = path.parent if is_sqlite else _existing_ancestor(path)
    if not _can_create_in(parent):
        if not parent.exists():
            reason = "does not exist"
        elif not parent.is_dir():
            reason = "is not a directory"
        else:
            reason = "is a directory nothing can be created in"
        return f"{uri}: {parent} {reason}, so the store can never be created"
    return None


def _existing_ancestor(path: Path) -> Path:
    """The nearest existing ancestor (a file store's directories are created as needed)."""
    for candidate in path.parents:
        if candidate.exists():
            return candidate
    return Path("/")


def ephemeral_store_problem(uri: str, cwd: Path) -> str | None:
    """A relative local store inside a ``ray job submit`` working directory, which Ray unpacks
    under ``.../runtime_resources/working_dir_files/`` and deletes: the run would be lost."""
    path = local_store_path(uri)
    if path is None or path.is_absolute() or "working_dir_files" not in cwd.parts:
        return None
    return (
        f"{uri} would be written inside this job's temporary working directory ({cwd}), which Ray deletes; "
        "pass --mlflow-uri with an absolute path or a tracking server, or set MLFLOW_TRACKING_URI on the cluster"
    )
