"""redact_uri / redact_text / OutputRedactor: worked cases, checked against urllib's own parser.

Each case is written out by hand; ``urllib.parse.urlsplit`` (a second parser, not the one in
``redact.py``) then checks that only the secret changed: same scheme, host, port, path and
non-secret query values.  Realistic bugs these catch: the password kept when the user name is
also present, a host or port mangled by the rewrite, a ``?token=`` left in, a percent-encoded
password (``p%40ss``) missed, an ``@`` inside the password splitting the URI at the wrong place.
"""

from __future__ import annotations

import logging
import re
import warnings
from urllib.parse import parse_qsl, urlsplit

import pytest

from gradmon_ray.tracking.redact import (
    CREDENTIAL_ENV_VARS,
    MASK,
    OutputRedactor,
    env_secrets,
    redact_text,
    redact_uri,
    uri_secrets,
)

CASES = [
    ("http://alice:s3cret@mlflow.internal:5000", "http://alice:***@mlflow.internal:5000"),
    ("https://alice:s3cret@host/prefix/api?x=1", "https://alice:***@host/prefix/api?x=1"),
    ("postgresql://u:pw@db.example:5432/mlflow", "postgresql://u:***@db.example:5432/mlflow"),
    ("mysql+pymysql://u:p%40ss@h/db?charset=utf8", "mysql+pymysql://u:***@h/db?charset=utf8"),
    ("http://ghp_TOKEN123@host:5000", "http://***@host:5000"),  # a lone token as the user part
    ("http://u:p@ss@h:5000/x", "http://u:***@h:5000/x"),  # an unencoded "@" in the password
    ("https://host/api?token=abc&x=1", "https://host/api?token=***&x=1"),
    ("https://host/?access_token=a&b=2#frag", "https://host/?access_token=***&b=2#frag"),
    ("https://h/p?X-Amz-Signature=deadbeef&X-Amz-Date=1", "https://h/p?X-Amz-Signature=***&X-Amz-Date=1"),
    ("https://h/p?password=pw&api_key=k&secret=s", "https://h/p?password=***&api_key=***&secret=***"),
]

UNCHANGED = [
    "sqlite:///mlflow.db",
    "sqlite:////abs/path/mlflow.db",
    "file:///tmp/mlruns",
    "mlruns",
    "databricks",
    "databricks://my-profile",
    "http://127.0.0.1:5000",
    "https://host/api?x=1&y=",
    "http://host:5000/?",
    "",
]


@pytest.mark.parametrize(("uri", "expected"), CASES)
def test_redact_uri_worked_cases(uri, expected):
    shown = redact_uri(uri)
    assert shown == expected
    before, after = urlsplit(uri), urlsplit(shown)
    assert (after.scheme, after.hostname, after.port, after.path) == (
        before.scheme,
        before.hostname,
        before.port,
        before.path,
    )
    if before.password is not None:
        assert after.username == before.username and after.password == MASK
    secret_keys = {"token", "access_token", "X-Amz-Signature", "password", "api_key", "secret"}
    for (k1, v1), (k2, v2) in zip(parse_qsl(before.query), parse_qsl(after.query), strict=True):
        assert k1 == k2 and v2 == (MASK if k1 in secret_keys else v1)
    assert redact_uri(shown) == shown  # idempotent


@pytest.mark.parametrize("uri", UNCHANGED)
def test_a_uri_without_secrets_comes_back_byte_for_byte(uri):
    assert redact_uri(uri) == uri
    assert uri_secrets(uri) == []


def test_a_semicolon_separated_query_too():  # urllib no longer splits on ";", so by hand
    assert redact_uri("https://host/?access_token=a;b=2") == "https://host/?access_token=***;b=2"


def test_uri_secrets_raw_and_decoded():
    assert uri_secrets("http://u:p%40ss@h") == ["p%40ss", "p@ss"]
    assert uri_secrets("http://tok@h") == ["tok"]
    assert uri_secrets("https://h/?token=abc&x=1") == ["abc"]
    assert uri_secrets("http://u:@h") == []  # an empty password is no secret


def test_redact_text_masks_uris_given_secrets_and_credential_env_vars(monkeypatch):
    for name in CREDENTIAL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "tok-from-env-123")
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")  # not a secret: left alone
    text = (
        "API request to http://admin:hunter2@h:5000/api/2.0/mlflow/runs/create failed; "
        "retrying with hunter2 (p%40ss) and bearer tok-from-env-123 as admin"
    )
    assert redact_text(text, ["hunter2", "p@ss"]) == (
        "API request to http://admin:***@h:5000/api/2.0/mlflow/runs/create failed; "
        "retrying with *** (***) and bearer *** as admin"
    )
    assert redact_text("no secrets in sqlite:///mlflow.db") == "no secrets in sqlite:///mlflow.db"
    assert env_secrets({"MLFLOW_TRACKING_PASSWORD": "pw12", "DATABRICKS_TOKEN": " ", "OTHER": "x"}) == ["pw12"]


def test_every_credential_variable_mlflow_defines_is_masked(monkeypatch):
    """The oracle is MLflow's own ``mlflow.environment_variables``: each public variable it defines
    whose value is a secret (a password, token or secret key, by its name) is masked in text when
    set, through the product's path (``redact_text`` reading the environment); and every MLFLOW_
    name the product lists is one MLflow defines (a typo would mask nothing).  Catches a variable
    missing from (or misspelt in) ``CREDENTIAL_ENV_VARS``, and one a new MLflow adds."""
    from mlflow import environment_variables as ev

    defined = {v.name for v in vars(ev).values() if isinstance(getattr(v, "name", None), str)}
    secret = re.compile(r"(PASSWORD|TOKEN|SECRET_KEY|SECRET_ENCRYPTION_KEY)$")
    credentials = sorted(n for n in defined if n.startswith("MLFLOW_") and secret.search(n))
    assert {"MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"} <= set(credentials)  # the premise
    for name in CREDENTIAL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    for i, name in enumerate(credentials):
        value = f"v{i}-Zq7Kp2"
        with monkeypatch.context() as patch:
            patch.setenv(name, value)
            assert redact_text(f"before {value} after") == f"before {MASK} after", name
    assert {n for n in CREDENTIAL_ENV_VARS if n.startswith("MLFLOW_")} <= defined


@pytest.fixture
def restore_logging_and_warnings():
    factory, formatwarning = logging.getLogRecordFactory(), warnings.formatwarning
    yield
    logging.setLogRecordFactory(factory)
    warnings.formatwarning = formatwarning


def test_output_redactor_masks_log_records_tracebacks_and_warnings(restore_logging_and_warnings, caplog):
    redactor = OutputRedactor()
    redactor.add_uri("http://u:Zq9-secret@h:5000")
    redactor.install()
    redactor.install()  # idempotent: one wrapping, not two
    logger = logging.getLogger("gradmon.test.redact")
    with caplog.at_level(logging.WARNING, logger="gradmon.test.redact"):
        logger.warning("write to %s failed (%s)", "http://u:Zq9-secret@h:5000/api", "auth Zq9-secret")
        try:
            raise RuntimeError("API request to http://u:Zq9-secret@h:5000 failed")
        except RuntimeError:
            logger.exception("sink")
    text = caplog.text
    assert "Zq9-secret" not in text
    assert "write to http://u:***@h:5000/api failed (auth ***)" in text
    assert "RuntimeError: API request to http://u:***@h:5000 failed" in text
    shown = warnings.formatwarning("cannot reach http://u:Zq9-secret@h:5000", UserWarning, "x.py", 1)
    assert "Zq9-secret" not in shown and "http://u:***@h:5000" in shown


def test_a_one_letter_password_is_masked_in_its_uri_and_nowhere_else():
    """A short password masked wherever its letters occur garbled every line ("htt***://") and let
    RLlib's deprecation notice past the noise filter ("De***recationWarning")."""
    text = "DeprecationWarning at http://u:p@host:5000/api while posting"
    assert redact_text(text, ["p"]) == "DeprecationWarning at http://u:***@host:5000/api while posting"
    assert redact_text("key abcd here", ["abcd"]) == "key *** here"  # four characters: masked everywhere
