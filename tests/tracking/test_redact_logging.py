"""``CredentialFilter`` / ``install_log_redaction``: credentials masked in gradmon-ray's own log
output without the CLI (a library call of the sink, a Tune trial's callback).

The expected texts are written out by hand (``user:pw@`` -> ``user:***@``, redact.py's rule).
Every test runs with the plain ``LogRecord`` factory and no filter on gradmon-ray's loggers, so
the CLI's process-wide ``OUTPUT_REDACTOR.install`` (other tests may have run it) cannot mask
anything in their place.  Realistic bugs these catch: the sink not installing the filter (the
plot failure's URL and traceback leak), only ``record.msg`` masked and not its ``%s`` args, the
traceback left raw, a second install stacking a second filter.
"""

from __future__ import annotations

import logging
import sys

import pytest

from gradmon_ray.tracking import GradmonMLflowCallback, MlflowSink
from gradmon_ray.tracking.redact import CredentialFilter, install_log_redaction

SECRET = "s3cret"
URL = f"http://user:{SECRET}@host:5000/api/2.0/mlflow-artifacts/artifacts/plots/heads.png"
SHOWN = "http://user:***@host:5000/api/2.0/mlflow-artifacts/artifacts/plots/heads.png"


def _gradmon_loggers() -> list[logging.Logger]:
    names = [n for n in logging.Logger.manager.loggerDict if n == "gradmon_ray" or n.startswith("gradmon_ray.")]
    return [logging.getLogger(n) for n in names]


def _credential_filters(log: logging.Logger) -> list[logging.Filter]:
    return [f for f in log.filters if isinstance(f, CredentialFilter)]


@pytest.fixture
def no_redaction_yet():
    """No process-wide record factory and no CredentialFilter on gradmon-ray's loggers; restored after."""
    factory = logging.getLogRecordFactory()
    logging.setLogRecordFactory(logging.LogRecord)
    removed = {}
    for log in _gradmon_loggers():
        removed[log] = _credential_filters(log)
        for f in removed[log]:
            log.removeFilter(f)
    yield
    logging.setLogRecordFactory(factory)
    for log in _gradmon_loggers():
        for f in _credential_filters(log):
            log.removeFilter(f)
    for log, filters in removed.items():
        for f in filters:
            log.addFilter(f)


def _failing_plot(client, run_id):
    raise RuntimeError(f"API request to endpoint {URL} failed with exception 401 Unauthorized")


def test_a_library_sink_masks_a_plot_failure_message_and_traceback(no_redaction_yet, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gradmon_ray"):
        sink = MlflowSink(f"sqlite:///{tmp_path / 'm.db'}", "exp", plots_every=1, plot_fn=_failing_plot)
        sink.log_iteration(1, {"loss": 1.0})
        assert sink.close() is True
    assert sink.plot_failures == 2  # at step 1 and at close; logged once
    text = caplog.text  # as the handler formats it: message and traceback
    assert "plots not written" in text and "Traceback (most recent call last)" in text
    assert SECRET not in text
    assert f"plots not written (RuntimeError: API request to endpoint {SHOWN} failed" in text
    assert f"RuntimeError: API request to endpoint {SHOWN} failed with exception 401" in text  # the traceback's
    assert all(SECRET not in r.getMessage() for r in caplog.records)


def test_installing_twice_adds_one_filter_per_logger(no_redaction_yet, caplog):
    first = install_log_redaction()
    assert "gradmon_ray" in first and "gradmon_ray.tracking.mlflow_sink" in first
    assert install_log_redaction() == []
    for log in _gradmon_loggers():
        assert len(_credential_filters(log)) == 1, log.name
    late = logging.getLogger("gradmon_ray.tracking.test_late_logger")  # a module imported afterwards
    assert install_log_redaction() == ["gradmon_ray.tracking.test_late_logger"]
    with caplog.at_level(logging.WARNING, logger="gradmon_ray"):
        late.warning("to %s", URL)
    assert caplog.records[-1].getMessage() == f"to {SHOWN}"


def test_the_callback_installs_it_where_it_is_made(no_redaction_yet, tmp_path):
    GradmonMLflowCallback.configured(tracking_uri=f"sqlite:///{tmp_path / 'm.db'}", experiment="x")()
    assert len(_credential_filters(logging.getLogger("gradmon_ray.tracking.callback"))) == 1
    assert len(_credential_filters(logging.getLogger("gradmon_ray.tracking.mlflow_sink"))) == 1


def _record(msg: str, args: tuple, with_exc: bool) -> logging.LogRecord:
    exc_info = None
    if with_exc:
        try:
            raise ConnectionError(f"Max retries exceeded with url: {URL}")
        except ConnectionError:
            exc_info = sys.exc_info()
    return logging.LogRecord("gradmon_ray.test", logging.WARNING, "f", 1, msg, args, exc_info)


def test_the_filter_masks_percent_args_and_the_traceback():
    record = _record("write to %s failed (%s: %s)", (URL, "ConnectionError", ValueError(URL)), with_exc=True)
    assert CredentialFilter().filter(record) is True  # masks, never drops
    assert record.getMessage() == f"write to {SHOWN} failed (ConnectionError: {SHOWN})"
    text = logging.Formatter("%(levelname)s %(message)s").format(record)
    assert SECRET not in text
    assert text.startswith(f"WARNING write to {SHOWN} failed")
    assert "Traceback (most recent call last)" in text
    assert text.endswith(f"ConnectionError: Max retries exceeded with url: {SHOWN}")


def test_a_record_without_credentials_is_left_as_it_is():
    record = _record("step %d: %s", (3, "http://host:5000/api"), with_exc=False)
    assert CredentialFilter().filter(record) is True
    assert record.msg == "step %d: %s" and record.args == (3, "http://host:5000/api")
    assert record.exc_text is None
