"""Keep credentials out of everything gradmon-ray writes or prints.

A tracking URI can carry a secret (``http://user:pw@host``, ``postgresql://u:pw@db/x``,
``https://host?token=...``), and MLflow reads others from the environment.  The run still
connects with the real URI; only what is *shown or stored* (MLflow params and tags, banners,
warnings, error messages, spill headers, resume files, checkpoints) goes through
:func:`redact_uri` or :func:`redact_text`.  No MLflow import: this module is string work, plus
``OUTPUT_REDACTOR``, which the CLI installs so that every log record and warning of the process
is masked too (messages it does not write itself: MLflow's, Ray's, the sink's), and
``CredentialFilter``, which the sink, the callback and ``run_training`` put on gradmon-ray's own
loggers, CLI or not (a Tune trial's actor, a library call).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import quote, unquote

MASK = "***"
MIN_BARE_SECRET_LEN = 4
"""A secret shorter than this is masked inside URIs only: masking a one-letter password wherever the
letter occurs ("htt***://", "De***recationWarning") garbled every line and defeated the noise filters."""

#: Environment variables whose values are credentials (MLflow 3.17's
#: ``mlflow/environment_variables.py`` and the Databricks/cloud-storage variables its clients read).
#: ``MLFLOW_TRACKING_USERNAME`` is left out on purpose: a user name is not a secret, and masking a
#: common word such as "admin" everywhere would garble messages.
CREDENTIAL_ENV_VARS: tuple[str, ...] = (
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
    "MLFLOW_AUTH_ADMIN_PASSWORD",
    "MLFLOW_UC_OSS_TOKEN",
    "MLFLOW_FLASK_SERVER_SECRET_KEY",
    "MLFLOW_WEBHOOK_SECRET_ENCRYPTION_KEY",
    "DATABRICKS_TOKEN",
    "DATABRICKS_PASSWORD",
    "DATABRICKS_CLIENT_SECRET",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AZURE_STORAGE_ACCESS_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
)

# Query-string keys whose value is a credential (matched case-insensitively, anywhere in the key:
# "access_token", "X-Amz-Signature", "sas_key", "db_password", ...).
_SECRET_QUERY_KEY = re.compile(r"token|passw|pwd|secret|key|auth|credential|signature|sig$", re.IGNORECASE)
# A URI inside free text: scheme "://" then everything up to whitespace or a quote/bracket.
_URI_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()\[\]{}`,]+")


def _split(uri: str) -> tuple[str, str, str, str, str] | None:
    """``(scheme_and_slashes, userinfo, hostpart, query, rest)`` of ``scheme://...``, else None.

    Hand-split rather than ``urllib.parse.urlsplit`` + ``urlunsplit`` so that everything outside
    the secret is returned byte for byte (urlunsplit normalises, e.g. drops an empty ``?``).
    """
    head, sep, tail = uri.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*", head):
        return None
    end = len(tail)
    for ch in "/?#":
        i = tail.find(ch)
        if i != -1:
            end = min(end, i)
    authority, after = tail[:end], tail[end:]
    userinfo, at, hostpart = authority.rpartition("@")
    if not at:
        userinfo, hostpart = "", authority
    path, qmark, query_and_frag = after.partition("?")
    query, hash_, frag = query_and_frag.partition("#")
    return head + "://", (userinfo + "@") if at else "", hostpart + path, qmark + query, hash_ + frag


def _redact_userinfo(userinfo_at: str) -> str:
    """``user:pw@`` -> ``user:***@``; ``token@`` (a lone token) -> ``***@``."""
    if not userinfo_at:
        return ""
    user, colon, _password = userinfo_at[:-1].partition(":")
    return f"{user}:{MASK}@" if colon else f"{MASK}@"


def _redact_query(query: str) -> str:
    """``?a=1&token=x`` -> ``?a=1&token=***`` (order, separators and other values untouched)."""
    if not query:
        return ""
    parts = re.split(r"([&;])", query[1:])
    for i in range(0, len(parts), 2):
        key, eq, value = parts[i].partition("=")
        if eq and value and _SECRET_QUERY_KEY.search(unquote(key)):
            parts[i] = f"{key}={MASK}"
    return "?" + "".join(parts)


def redact_uri(uri: str) -> str:
    """``uri`` with its credentials shown as ``***``; a URI without secrets comes back unchanged.

    >>> redact_uri("http://alice:s3cret@mlflow:5000")
    'http://alice:***@mlflow:5000'
    >>> redact_uri("https://host/api?token=abc&x=1")
    'https://host/api?token=***&x=1'
    >>> redact_uri("sqlite:///mlflow.db")
    'sqlite:///mlflow.db'
    """
    parts = _split(uri)
    if parts is None:
        return uri
    scheme, userinfo_at, hostpath, query, frag = parts
    return scheme + _redact_userinfo(userinfo_at) + hostpath + _redact_query(query) + frag


def uri_secrets(uri: str) -> list[str]:
    """The secret values inside ``uri`` (password or lone user token, secret query values), raw and
    percent-decoded, so that text quoting them without the URI around them can be masked too."""
    parts = _split(uri)
    if parts is None:
        return []
    _, userinfo_at, _, query, _ = parts
    found: list[str] = []
    if userinfo_at:
        user, colon, password = userinfo_at[:-1].partition(":")
        found.append(password if colon else user)
    if query:
        for item in re.split(r"[&;]", query[1:]):
            key, eq, value = item.partition("=")
            if eq and value and _SECRET_QUERY_KEY.search(unquote(key)):
                found.append(value)
    return sorted({v for s in found if s for v in (s, unquote(s))})


def env_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The non-empty values of :data:`CREDENTIAL_ENV_VARS` in ``environ`` (default: ``os.environ``)."""
    env = os.environ if environ is None else environ
    return [env[name] for name in CREDENTIAL_ENV_VARS if env.get(name, "").strip()]


def redact_text(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every URI in it passed through :func:`redact_uri`, and every value in
    ``secrets`` and in the credential environment variables (:data:`CREDENTIAL_ENV_VARS`) replaced
    by ``***``, both as written and percent-encoded (a password with ``@`` is ``%40`` in a URI);
    values shorter than :data:`MIN_BARE_SECRET_LEN` only inside URIs."""
    text = _URI_IN_TEXT.sub(lambda m: redact_uri(m.group(0)), text)
    values = {s for s in (*secrets, *env_secrets()) if len(s.strip()) >= MIN_BARE_SECRET_LEN}
    values |= {quote(s, safe="") for s in values}
    # Longest first, so that a secret containing another one is masked whole.
    for value in sorted(values, key=len, reverse=True):
        text = text.replace(value, MASK)
    return text


def short(text: str, limit: int, secrets: Iterable[str] = (), *, one_line: bool = False) -> str:
    """``text`` masked, then cut to at most ``limit`` characters (``...`` at the end): the one rule for
    every message gradmon-ray shortens.  Masking first is the point: a cut inside a URI's password
    (``http://user:pa``) leaves no ``@`` for :func:`redact_uri` to find, and printed the rest of it.

    Masked as :func:`redact_text` does, with ``secrets`` and every secret :data:`OUTPUT_REDACTOR`
    was given; ``one_line``: only its first non-empty line (``""`` when it has none).
    """
    masked = redact_text(text, {*secrets, *OUTPUT_REDACTOR.secrets})
    if one_line:
        masked = next((line.strip() for line in masked.splitlines() if line.strip()), "")
    return masked if len(masked) <= limit else masked[: max(limit - 3, 0)] + "..."


class OutputRedactor:
    """Masks credentials in every log record and warning this process emits, once ``install``-ed.

    Log records are masked where they are made (``logging.setLogRecordFactory``), so a logger or
    handler that MLflow or Ray sets up later is covered too; warnings through
    ``warnings.formatwarning``.  ``add_uri`` adds a URI's secrets, which are then masked even where
    a message quotes them without the URI around them.
    """

    def __init__(self) -> None:
        self.secrets: set[str] = set()
        self._installed = False

    def add_uri(self, uri: str | None) -> None:
        """Mask ``uri``'s password/token (see :func:`uri_secrets`) from now on."""
        if uri:
            self.secrets.update(uri_secrets(uri))

    def __call__(self, text: str) -> str:
        """``redact_text(text)`` with the secrets added so far."""
        return redact_text(text, self.secrets)

    def install(self) -> None:
        """Mask log records and warnings from now on (idempotent: the CLI's ``main`` may run many times)."""
        if self._installed:
            return
        self._installed = True
        make_record = logging.getLogRecordFactory()

        def masked_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            return mask_record(make_record(*args, **kwargs), self)

        logging.setLogRecordFactory(masked_record)
        format_warning = warnings.formatwarning

        def masked_warning(*args: Any, **kwargs: Any) -> str:
            return self(format_warning(*args, **kwargs))

        warnings.formatwarning = masked_warning


OUTPUT_REDACTOR = OutputRedactor()
"""The process's one redactor (the CLI installs it and adds every tracking URI it is given)."""

GRADMON_LOGGER = "gradmon_ray"


class CredentialFilter(logging.Filter):
    """A ``logging.Filter`` that masks credentials in a record: its message with its ``%`` args,
    its traceback (``exc_text``) and its stack; the rule is :data:`OUTPUT_REDACTOR`'s (``redact_text``
    plus the URIs added to it).  It never drops a record.

    Unlike ``OUTPUT_REDACTOR.install`` (the CLI's, process-wide), it needs no CLI: the sink, the
    callback (in a Tune trial's actor) and ``run_training`` put it on gradmon-ray's loggers.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        mask_record(record, OUTPUT_REDACTOR)
        return True


def mask_record(record: logging.LogRecord, redact: Callable[[str], str]) -> logging.LogRecord:
    """``record`` with credentials masked by ``redact`` in its message (``%`` args filled in), its
    traceback and its stack: the one masking of a log record, for the CLI's record factory and for
    :class:`CredentialFilter`."""
    try:
        message = record.getMessage()
    except Exception:  # a malformed record: logging reports it itself, unchanged
        return record
    clean = redact(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and record.exc_info[0] is not None and not record.exc_text:
        # Formatter.format prints exc_text when set, instead of formatting exc_info again.
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redact(record.exc_text)
    if record.stack_info:
        record.stack_info = redact(record.stack_info)
    return record


def install_log_redaction() -> list[str]:
    """Put a :class:`CredentialFilter` on ``gradmon_ray`` and each ``gradmon_ray.*`` logger made so far.

    A logger's filters see only the records logged *on it* (not those propagated from children),
    hence one per logger.  Idempotent: a logger that has one already gets none; call it again
    after importing more of gradmon-ray.  Returns the names of the loggers it added one to.
    """
    names = [GRADMON_LOGGER] + [
        name
        for name, obj in list(logging.Logger.manager.loggerDict.items())
        if name.startswith(GRADMON_LOGGER + ".") and isinstance(obj, logging.Logger)
    ]
    added = []
    for name in names:
        log = logging.getLogger(name)
        if not any(isinstance(f, CredentialFilter) for f in log.filters):
            log.addFilter(CredentialFilter())
            added.append(name)
    return added
