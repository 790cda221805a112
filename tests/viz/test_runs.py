"""``gradmon_ray.viz.runs``: a head's band as the displays show it (``head_band``), worked answers.

Bugs caught: the displays re-judging a norm the learner already judged by the run's own edges (a
run with tighter edges shown healthy), a value head judged by the action heads' edges, a head that
logged nothing shown with a band."""

from __future__ import annotations

import pytest

from gradmon_ray.viz.runs import head_band

# The codes written out (metric_names.HEALTH_CODES is what the learner logs).
CODES = {-1: "missing", 0: "dead", 1: "weak", 2: "healthy", 3: "elevated", 4: "exploding"}


@pytest.mark.parametrize("code", sorted(CODES))
def test_the_logged_health_code_wins_over_the_default_edges(code):
    # norm 0.5 is "healthy" by the default edges; a run with its own edges logged another code
    assert head_band(float(code), 0.5, "op") == CODES[code]
    assert head_band(float(code), 0.5, "value") == CODES[code]


def test_without_a_code_the_head_is_judged_by_its_own_default_edges():
    assert head_band(None, 5.0, "value") == "healthy"  # value head: healthy up to 10
    assert head_band(None, 5.0, "op") == "elevated"  # action heads: healthy up to 2
    assert head_band(None, None, "op") == "missing"


def test_a_server_that_stops_answering_is_named_with_the_innermost_cause(monkeypatch):
    """``watch`` on a server that died meanwhile: one line naming the store (password masked) and
    the connection error itself; MLflow's own message cut at 200 characters ended mid-URL."""
    from mlflow.tracking import MlflowClient

    from gradmon_ray.viz.runs import RunLookupError, resolve_run
    from tests.e2e.processes import free_port

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    uri = f"http://u:secret1@127.0.0.1:{free_port()}"
    with pytest.raises(RunLookupError) as info:
        resolve_run(MlflowClient(uri), run_id="0" * 32)
    assert info.value.unreachable
    shown = uri.replace("secret1", "***")
    assert str(info.value) == f"cannot read MLflow at {shown}: ConnectionRefusedError: [Errno 111] Connection refused"
