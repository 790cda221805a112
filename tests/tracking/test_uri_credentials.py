"""A password given to the callback travels in MLflow's environment variables, never in a pickle.

The oracle for "never in a pickle" is the pickled bytes themselves (what Tune writes to
``params.pkl``, ``tuner.pkl`` and RLlib to ``class_and_ctor_args.pkl``): the password must not
be among them, raw or percent-encoded, and loading them back must give a class whose URI, with
the variables the driver now holds, is the one the user gave.
"""

from __future__ import annotations

import os
import pickle
from urllib.parse import quote

import cloudpickle
import pytest
from ray import cloudpickle as ray_cloudpickle
from ray.rllib.algorithms.ppo import PPOConfig

from gradmon_ray.tracking import GradmonMLflowCallback
from gradmon_ray.tracking.uri_credentials import (
    PASSWORD_VAR,
    USERNAME_VAR,
    credentials_to_environment,
    split_credentials,
    uri_for_this_process,
)

SECRET = "pw:w/ith@odd%chars"
USER_URI = f"http://alice:{quote(SECRET, safe='')}@127.0.0.1:5999/base?x=1"


@pytest.fixture
def clean_env(monkeypatch):
    for var in (USERNAME_VAR, PASSWORD_VAR, "MLFLOW_TRACKING_URI"):
        monkeypatch.setenv(var, "")  # recorded, so what the product sets is undone after the test
        monkeypatch.delenv(var)


def test_split_credentials_returns_the_uri_byte_for_byte_without_its_user_info():
    assert split_credentials(USER_URI) == ("http://127.0.0.1:5999/base?x=1", "alice", SECRET)
    assert split_credentials("https://tok@host/p#f") == ("https://host/p#f", "tok", None)
    assert split_credentials("http://host/a@b") == ("http://host/a@b", None, None)  # '@' in the path
    for plain in ("sqlite:///mlflow.db", "/abs/mlruns", "databricks"):
        assert split_credentials(plain) == (plain, None, None)


def test_the_credentials_move_to_mlflows_variables(clean_env):
    """Into the variables MLflow's own client reads (named by ``mlflow.environment_variables``, not
    by the product's constants: a misspelt name would log in as nobody)."""
    from mlflow.environment_variables import MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_USERNAME

    env: dict[str, str] = {}
    assert credentials_to_environment(USER_URI, env) == "http://127.0.0.1:5999/base?x=1"
    assert env == {MLFLOW_TRACKING_USERNAME.name: "alice", MLFLOW_TRACKING_PASSWORD.name: SECRET}
    again = dict(env)  # the same credentials again (a second callback): accepted, nothing changes
    assert credentials_to_environment(USER_URI, again) == "http://127.0.0.1:5999/base?x=1" and again == env


@pytest.mark.parametrize(
    ("uri", "env", "message"),
    [
        ("http://alice:other@h:1", {PASSWORD_VAR: SECRET}, "differs from $MLFLOW_TRACKING_PASSWORD"),
        ("http://bob:x@h:1", {USERNAME_VAR: "alice"}, "differs from $MLFLOW_TRACKING_USERNAME"),
        ("http://tok3n@h:1", {}, "a token without a password cannot be kept out of Tune's files"),
        ("http://h:1/?access_token=abc", {}, "a secret in its query string"),
    ],
)
def test_what_cannot_travel_in_the_variables_is_one_line_without_the_secret(uri, env, message):
    with pytest.raises(ValueError) as info:
        credentials_to_environment(uri, env)
    text = str(info.value)
    assert message in text and "\n" not in text
    assert all(s not in text for s in ("other", "tok3n", "abc", "x@"))


def test_a_worker_started_before_the_move_uses_its_inherited_uri_in_memory():
    clean = "http://127.0.0.1:5999/base?x=1"
    assert uri_for_this_process(clean, {"MLFLOW_TRACKING_URI": USER_URI}) == USER_URI
    assert uri_for_this_process(clean, {"MLFLOW_TRACKING_URI": USER_URI, PASSWORD_VAR: "p"}) == clean
    assert uri_for_this_process(clean, {"MLFLOW_TRACKING_URI": "http://a:b@other:1"}) == clean
    assert uri_for_this_process(clean, {}) == clean


def _secret_bytes() -> list[bytes]:
    return [SECRET.encode(), quote(SECRET, safe="").encode()]


@pytest.mark.parametrize("pickler", [cloudpickle, ray_cloudpickle], ids=lambda m: m.__name__)
@pytest.mark.parametrize("given", ["configured", "MLFLOW_TRACKING_URI"])
def test_no_pickle_of_the_config_holds_the_password(given, pickler, clean_env, monkeypatch, tmp_path):
    """The issue's reproducer, ``cloudpickle.dumps(PPOConfig().callbacks(cls))``, both ways of
    giving the password: the bytes Tune would write hold neither the password nor its encoding."""
    monkeypatch.chdir(tmp_path)
    if given == "configured":
        cls = GradmonMLflowCallback.configured(tracking_uri=USER_URI, spill_dir=None)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", USER_URI)
        cls = GradmonMLflowCallback
    blob = pickler.dumps(PPOConfig().callbacks(cls))
    assert [s for s in _secret_bytes() if s in blob] == []
    shipped = pickle.loads(blob).callbacks_class
    assert shipped.settings.tracking_uri == "http://127.0.0.1:5999/base?x=1"
    assert (os.environ[USERNAME_VAR], os.environ[PASSWORD_VAR]) == ("alice", SECRET)  # for Ray's workers


def test_credentials_moved_while_ray_runs_are_named_in_a_warning(clean_env, monkeypatch, caplog):
    """Ray's workers got their environment when Ray started: variables set afterwards never reach
    them, so the move says so (Ray's state is the only thing stubbed here)."""
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.uri_credentials"):
        credentials_to_environment(USER_URI)
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "gradmon: MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD set now, but Ray is already running"
    )
    caplog.clear()
    with caplog.at_level("WARNING", logger="gradmon_ray.tracking.uri_credentials"):
        credentials_to_environment(USER_URI)  # already set: nothing new, nothing to say
    assert caplog.records == []
