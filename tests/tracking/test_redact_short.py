"""``redact.short``: every message gradmon-ray cuts is masked first, then cut (issue #46 item 3).

A message cut before it is masked (``API request to http://user:pa`` + the cut) has no ``@`` left
for the URI masking to find: 52 of a 64-character password were printed.  Each place that cuts a
message is fed one whose cut falls inside a password, at several offsets into it, and what it
shows (a ``ConfigError`` the CLI prints, a log line, a stored MLflow param, a run name) must hold
no 4 characters of the password in a row.  The messages are MLflow's own where a real failure
makes one (a dead server on 127.0.0.1, MLflow's HTTP retries off); elsewhere an error worded as
MLflow words it.  The oracle is the password itself: a substring search, nothing of the product's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from gradmon_ray.app.cli_common import TrackingUri
from gradmon_ray.app.sweep.progress import MAX_RUN_NAME_LEN, trial_run_name
from gradmon_ray.app.train.resume import deliver_spill, resume_point
from gradmon_ray.config import ConfigError
from gradmon_ray.tracking import MlflowSink
from gradmon_ray.tracking.mlflow_sink import MAX_PARAM_VALUE_LEN
from gradmon_ray.tracking.redact import MASK, OUTPUT_REDACTOR, short
from gradmon_ray.tracking.spill import SpillWriter
from gradmon_ray.tracking.store_check import tracking_server_problem
from tests.e2e.in_process import run_cli
from tests.e2e.processes import free_port

SECRET = "7QXZK2WPJ9VRMB4HTN8CYLD3FG6S5AEU" * 2  # 64 characters, none of them lower case
PREFIX = "API request to http://"  # how MLflow's HTTP errors start, the URL with its login in it
OFFSETS = (4, 26, 52)
"""How many characters of the password came before the old cut (4 or more: a leak the test can see)."""


def leaks(text: str) -> list[str]:
    """Every 4 characters in a row of ``SECRET`` that ``text`` holds."""
    return sorted({SECRET[i : i + 4] for i in range(len(SECRET) - 3) if SECRET[i : i + 4] in text})


def user_for(cut: int, offset: int, before: int = len(PREFIX)) -> str:
    """A user name that puts ``offset`` characters of the password before position ``cut`` of a message
    with ``before`` characters ahead of the login."""
    return "u" * (cut - before - 1 - offset)


@pytest.fixture(autouse=True)
def _redactor_as_it_was() -> Iterator[None]:
    """The process's redactor knows no password of this module's (the CLI's row adds one): what is
    masked here is masked by the text's own URI."""
    before = set(OUTPUT_REDACTOR.secrets)
    yield
    OUTPUT_REDACTOR.secrets.clear()
    OUTPUT_REDACTOR.secrets.update(before)


def _dead(user: str) -> str:
    return f"http://{user}:{SECRET}@127.0.0.1:{free_port()}"


def _deliver_spill(offset: int, tmp_path: Path) -> str:
    """``train --resume`` delivering an outage's spill into a server that is down: MLflow's error, cut to 80."""
    uri = _dead(user_for(80, offset))
    spill = tmp_path / "s.jsonl"
    SpillWriter(spill, {"experiment": "e"}).write_iterations([(1, 1, {"m": 1.0}, {})], None, [1])
    with pytest.raises(ConfigError) as caught:
        deliver_spill(TrackingUri.of(uri), "r" * 32, [spill])
    return str(caught.value)


def _resume_point(offset: int, tmp_path: Path) -> str:
    """``train --resume`` reading the run from a server that is down: MLflow's error, cut to 200."""
    with pytest.raises(ConfigError) as caught:
        resume_point(_dead(user_for(200, offset)), "r" * 32)
    return str(caught.value)


def _raising(message: str) -> Callable[..., None]:
    def fail(*args: object, **kwargs: object) -> None:
        raise MlflowException(message)

    return fail


def _server_check(
    offset: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> str:
    """The tracking-server check at start: the problem ``train`` prints, and with ``offline_ok`` its
    warning (the error's innermost cause, cut to 200: ``last_cause``)."""
    import mlflow.utils.rest_utils

    uri = _dead(user_for(200, offset))
    monkeypatch.setattr(mlflow.utils.rest_utils, "http_request", _raising(f"API request to {uri}/api/2.0/x failed"))
    problem = tracking_server_problem(uri) or ""
    with caplog.at_level(logging.WARNING, logger="gradmon_ray"):
        assert tracking_server_problem(uri, offline_ok=True) is None
    assert "no MLflow tracking server answers" in problem and "no MLflow tracking server answers" in caplog.text
    return problem + "\n" + caplog.text


def _cli_resume(offset: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``gradmon-ray train --resume`` whose run lookup fails with MLflow's error (viz.runs' ``last_cause``)."""
    uri = _dead(user_for(200, offset))
    monkeypatch.setattr(MlflowClient, "get_run", _raising(f"API request to {uri}/api/2.0/mlflow/runs/get failed"))
    result = run_cli(["train", "--resume", "r" * 32, "--mlflow-uri", uri], tmp_path)
    assert result.returncode == 2 and "--resume: no run" in result.stderr, result.stderr
    return result.stdout + result.stderr


def _sink_param(offset: int, tmp_path: Path) -> str:
    """A run param longer than MLflow takes, cut to 6000 characters: the value MLflow stores."""
    pad = MAX_PARAM_VALUE_LEN - len("http://u:") - offset
    store = f"sqlite:///{tmp_path / 'm.db'}"
    sink = MlflowSink(store, "e", params={"note": "p" * pad + f"http://u:{SECRET}@host/x"})
    assert sink.close(timeout_s=120) is True
    return MlflowClient(store).get_run(sink.run_id).data.params["note"]


def _trial_name(offset: int, tmp_path: Path) -> str:
    """A sweep trial's run name over ``MAX_RUN_NAME_LEN`` characters, a sampled value a URI with a login."""
    head = "s-t_0 (x=http://u:"
    name = "s" * (MAX_RUN_NAME_LEN - 3 - len(head) - offset + 1)
    return trial_run_name(name, "t_0", {"x": f"http://u:{SECRET}@host"})


SITES = {
    "resume.deliver_spill": _deliver_spill,
    "resume.resume_point": _resume_point,
    "store_check.last_cause": _server_check,
    "cli.train_resume": _cli_resume,
    "mlflow_sink.params": _sink_param,
    "sweep.trial_run_name": _trial_name,
}


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("site", list(SITES))
def test_a_cut_inside_a_password_shows_none_of_it(site, offset, tmp_path, monkeypatch, caplog, fast_failing_http):
    fn = SITES[site]
    extra = {"monkeypatch": monkeypatch, "caplog": caplog} if site == "store_check.last_cause" else {}
    extra = {"monkeypatch": monkeypatch} if site == "cli.train_resume" else extra
    shown = fn(offset, tmp_path, **extra)
    assert "http://" in shown, shown  # the URI was there (cut, or its login masked)
    assert leaks(shown) == [], shown


def test_short_masks_then_cuts_and_marks_the_cut():
    user, tail = user_for(80, 40), "@h:5000/api failed with exception " + "x" * 60
    text = f"{PREFIX}{user}:{SECRET}{tail}"
    assert text[:80].endswith(SECRET[:40])  # the premise: an 80-character cut falls inside the password
    assert short(text, 80) == f"{PREFIX}{user}:{MASK}{tail}"[:77] + "..."
    assert short(text, 200) == f"{PREFIX}{user}:{MASK}{tail}"  # short enough once masked: whole
    assert short("first\n  second", 80, one_line=True) == "first" and short("\n \n", 5, one_line=True) == ""
    assert short("abc", 3) == "abc" and short(f"said {SECRET[:10]} twice", 100, [SECRET[:10]]) == f"said {MASK} twice"
