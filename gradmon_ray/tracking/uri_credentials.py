"""A tracking URI's ``user:password@``, moved into the environment variables MLflow reads.

Whatever carries a URI gets pickled with it: ``GradmonMLflowCallback``'s settings travel inside
the algorithm config, which Tune writes to ``params.pkl``, ``tuner.pkl`` and every checkpoint's
``class_and_ctor_args.pkl`` (possibly on S3).  MLflow's REST client reads
``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` on every request, and the processes
Ray starts inherit the environment of the process that starts Ray.  So the callback keeps the URI
without its credentials and puts them into those variables, in the driver, before Tune starts
Ray: the password then lives in process environments only, never in a file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from urllib.parse import unquote

from gradmon_ray.tracking.redact import redact_uri, uri_secrets

USERNAME_VAR = "MLFLOW_TRACKING_USERNAME"
PASSWORD_VAR = "MLFLOW_TRACKING_PASSWORD"
URI_VAR = "MLFLOW_TRACKING_URI"

logger = logging.getLogger(__name__)


def split_credentials(uri: str) -> tuple[str, str | None, str | None]:
    """``(uri without user info, user, password)``, user and password percent-decoded (None: absent).

    >>> split_credentials("http://alice:s%40cret@mlflow:5000/x")
    ('http://mlflow:5000/x', 'alice', 's@cret')
    >>> split_credentials("sqlite:///mlflow.db")
    ('sqlite:///mlflow.db', None, None)
    """
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri, None, None
    cut = min((i for i in (rest.find(c) for c in "/?#") if i != -1), default=len(rest))
    userinfo, at, host = rest[:cut].rpartition("@")
    if not at:
        return uri, None, None
    user, colon, password = userinfo.partition(":")
    return f"{scheme}://{host}{rest[cut:]}", unquote(user), unquote(password) if colon else None


def credentials_to_environment(uri: str, environ: MutableMapping[str, str] | None = None) -> str:
    """``uri`` without its ``user:password@``, which go to ``MLFLOW_TRACKING_USERNAME/PASSWORD`` in
    ``environ`` (default ``os.environ``); a URI without credentials comes back unchanged.

    ``ValueError`` (one line) for what cannot travel that way: a lone token (``token@host``), a
    secret in the query string, or credentials that differ from the variables already set.
    """
    env = os.environ if environ is None else environ
    clean, user, password = split_credentials(uri)
    if uri_secrets(clean):
        raise ValueError(
            f"tracking URI {redact_uri(uri)}: a secret in its query string would be written into Tune's and "
            f"RLlib's pickles; give it through MLflow's own variables (e.g. MLFLOW_TRACKING_TOKEN) instead"
        )
    if user is None:
        return uri
    if password is None:
        raise ValueError(
            f"tracking URI {redact_uri(uri)}: a token without a password cannot be kept out of Tune's files; "
            f"set MLFLOW_TRACKING_TOKEN to it and give the URI without it"
        )
    newly_set = []
    for var, value in ((USERNAME_VAR, user), (PASSWORD_VAR, password)):
        have = env.get(var)
        if have and have != value:
            raise ValueError(
                f"tracking URI {redact_uri(uri)}: its user name or password differs from ${var}; "
                f"give the credentials one way (the variables, or the URI)"
            )
        if not have:
            env[var] = value
            newly_set.append(var)
    if newly_set and environ is None:
        _warn_if_ray_started_without(newly_set)
    return clean


def uri_for_this_process(uri: str, environ: MutableMapping[str, str] | None = None) -> str:
    """The URI to connect with here: ``uri``, or, when this process has no ``MLFLOW_TRACKING_PASSWORD``
    but its ``MLFLOW_TRACKING_URI`` is ``uri`` with credentials, that one (a Ray worker started before
    the driver moved the credentials inherits the driver's old ``MLFLOW_TRACKING_URI``, not the moved
    variables).  Used in memory only, never stored."""
    env = os.environ if environ is None else environ
    if env.get(PASSWORD_VAR):
        return uri
    inherited = env.get(URI_VAR, "")
    clean, _, password = split_credentials(inherited)
    return inherited if password is not None and clean == uri else uri


def _warn_if_ray_started_without(variables: list[str]) -> None:
    """Ray's workers got their environment when Ray started: variables set later never reach them."""
    import ray

    if ray.is_initialized():
        logger.warning(
            "gradmon: %s set now, but Ray is already running and its workers do not see them: set them "
            "in the environment before Ray starts (on a cluster: in its nodes' environment, as cluster.yaml does)",
            " and ".join(variables),
        )
