"""Tracking URIs as MLflow should be handed them: a relative local store made absolute."""

from __future__ import annotations

import os


def absolute_tracking_uri(uri: str) -> str:
    """``uri`` with a relative ``sqlite:///`` or local file path made absolute against this process's
    working directory (other URIs unchanged).

    Why: MLflow caches a store (and its database engine) per URI string for the life of the
    process, so a relative ``sqlite:///mlflow.db`` opened from a second directory would reuse the
    first directory's database; and Tune runs trials in directories of their own.
    """
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////") and uri != "sqlite:///:memory:":
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if "://" not in uri and not os.path.isabs(uri):
        return os.path.abspath(uri)
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file://" + os.path.abspath(uri[len("file:") :])
    return uri
