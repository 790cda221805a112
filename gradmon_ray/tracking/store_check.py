"""Will the MLflow store work?  Checked before Ray or MLflow start, without creating anything.

MLflow only finds out that ``sqlite:////etc/hostname/mlflow.db`` or ``file:///proc/mlruns`` can
never work when it first writes, after training has started; a read-only command pointed at a
directory without a store would create an empty one; and a URI whose scheme MLflow does not
know (``mlfow://host:5000``) only fails in the sink's background thread, once per iteration.
``local_store_problem`` reads the filesystem only (and checks the scheme first).
``tracking_server_problem`` asks an ``http(s)://`` server one bounded question at start; an
outage *after* the start is buffered, spilled and replayed by the sink.  Every message shows
the URI through ``redact_uri``: no password reaches the terminal.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from urllib.parse import unquote, urlparse

from gradmon_ray.tracking.redact import redact_uri, short, uri_secrets

TRACKING_SCHEMES = ("file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks")
"""The URI schemes MLflow 3.17 can track to (its ``_register_tracking_stores``; ``databricks-uc`` and
``uc`` are registered there only to refuse them).  A database scheme may name a driver
(``postgresql+psycopg2``); a plain path is a file store; plugins add their own schemes."""

DATABASE_SCHEMES = ("postgresql", "mysql", "mssql", "sqlite")
"""MLflow's SQL stores: one row per metric point (key, step, timestamp, value), a point logged again ignored."""

logger = logging.getLogger(__name__)


def _plugin_schemes() -> tuple[str, ...]:
    """Schemes that installed MLflow plugins register (entry point group ``mlflow.tracking_store``)."""
    return tuple(ep.name for ep in entry_points(group="mlflow.tracking_store"))


def tracking_scheme(uri: str) -> str:
    """The scheme MLflow picks a store by: lower case, a database driver dropped, ``""`` for a path."""
    if uri in ("databricks", "databricks-uc", "uc"):  # MLflow's own special case: bare names, no "://"
        return uri
    scheme = urlparse(uri).scheme.lower()
    if len(scheme) == 1:  # a Windows drive letter (C:\\runs): a path, as MLflow reads it
        return ""
    engine = scheme.split("+", 1)[0]
    return engine if engine in DATABASE_SCHEMES else scheme


def uri_scheme_problem(uri: str) -> str | None:
    """Why MLflow cannot track to ``uri`` by its scheme alone, in one line (None: the scheme is known)."""
    scheme = tracking_scheme(uri)
    known = (*TRACKING_SCHEMES, *_plugin_schemes())
    if scheme == "" or scheme in known:
        return None
    if scheme in ("databricks-uc", "uc"):
        what = f"{scheme!r} is a model registry scheme, not a tracking one"
    elif urlparse(uri).path.isdigit():  # "localhost:5000": a host and port without http://
        what = f"unknown scheme {scheme!r} (a server is http://{uri})"
    else:
        what = f"unknown scheme {scheme!r}"
    return f"{redact_uri(uri)}: {what}; MLflow tracks to {', '.join(known)} URIs or a local directory path"


def local_store_path(uri: str) -> Path | None:
    """The filesystem path of a local store (``sqlite:///x.db``, ``file:///dir``, a plain path), else None."""
    if tracking_scheme(uri) == "databricks":
        return None
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
    directory must exist and be writable.  An unknown scheme is a problem for any URI.
    """
    scheme_problem = uri_scheme_problem(uri)
    if scheme_problem:
        return scheme_problem
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


SERVER_PROBE_ENDPOINT = "/api/2.0/mlflow/experiments/search"
"""What ``tracking_server_problem`` asks: a real, authenticated REST call (``/health`` answers without
credentials, so a wrong password would only show up mid-run)."""


TRAIN_ADVICE = "start it, fix the URI, or set mlflow.offline_ok: true to train now and replay the metrics later"
"""What to do about a tracking server that does not answer, for a run (``watch``/``report`` have their own)."""


def tracking_server_problem(
    uri: str,
    timeout_s: float = 5.0,
    *,
    offline_ok: bool = False,
    answer_timeout_s: float = 30.0,
    advice: str = TRAIN_ADVICE,
) -> str | None:
    """Why the tracking server at an ``http(s)://`` ``uri`` cannot take this run now, in one line
    (None: it answered, or ``uri`` is not an HTTP server).  ``offline_ok`` (``mlflow.offline_ok``):
    a server that does not answer is only logged, the run buffers and spills; one that answers
    with an error (refused credentials, not MLflow) is still a problem.

    One request, no retries, through MLflow's own HTTP client so that the credentials (in the URI
    or ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``) and TLS settings are exactly the ones
    the run will use.  ``timeout_s`` bounds the connection; a server that accepted it gets
    ``answer_timeout_s`` to reply (its first authenticated request after a start can take seconds).
    ``advice``: what to do about a server that does not answer.
    """
    if tracking_scheme(uri) not in ("http", "https"):
        return None
    from mlflow.tracking._tracking_service.utils import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    shown = redact_uri(uri)
    try:
        response = http_request(
            get_default_host_creds(uri),
            SERVER_PROBE_ENDPOINT,
            "GET",
            max_retries=0,
            timeout=(timeout_s, answer_timeout_s),  # requests' (connect, read)
            raise_on_status=False,
            params={"max_results": 1},
        )
    except Exception as exc:
        reason = last_cause(exc, uri_secrets(uri))
        if offline_ok:
            logger.warning(
                "no MLflow tracking server answers at %s (%s); mlflow.offline_ok: training anyway, the metrics "
                "wait in memory and in mlflow.spill_dir (gradmon-ray replay)",
                shown,
                reason,
            )
            return None
        return f"no MLflow tracking server answers at {shown} within {timeout_s:g} s ({reason}); {advice}"
    if response.status_code in (401, 403):
        return (
            f"the MLflow server at {shown} refused the credentials (HTTP {response.status_code}); give them in the URI "
            "(http://USER:PASSWORD@host) or in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
        )
    if response.status_code != 200:
        return (
            f"{shown} answered HTTP {response.status_code} to {SERVER_PROBE_ENDPOINT}: not a working MLflow tracking "
            "server (check the host, port and path)"
        )
    return None


def last_cause(exc: BaseException, secrets: Iterable[str] = ()) -> str:
    """The innermost cause's first line (MLflow wraps the connection error; its repr names the host),
    masked (``secrets`` too) before it is cut to 200 characters (``redact.short``)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    first = short(str(exc), 200, secrets, one_line=True) or type(exc).__name__
    return f"{type(exc).__name__}: {first}"
