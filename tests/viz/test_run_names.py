"""A run's name where its id is taken (``report``, ``watch --run-id``; ``train --resume`` in
tests/app/test_resume_spill.py): a name one run has is that run; one that several have is refused
in one line listing their ids and start times; one nobody has, in one line.  Real sqlite stores,
the known run of ``known_run`` (its values checked by the panel and report tests)."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.app.cli import main
from gradmon_ray.viz.run_names import SHOWN_CANDIDATES
from gradmon_ray.viz.runs import RunLookupError, resolve_run
from tests.viz.known_run import make_known_run


@pytest.fixture
def known(tmp_path):
    return make_known_run(f"sqlite:///{tmp_path / 'mlflow.db'}")  # named "known", in experiment "viz"


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ms / 1000))


def test_a_name_one_run_has_is_that_run_in_any_experiment(known):
    client = MlflowClient(known.tracking_uri)
    other = client.create_experiment("elsewhere")
    client.create_run(other, run_name="someone-else")
    assert resolve_run(client, run_id="known").info.run_id == known.run_id
    assert resolve_run(client, run_id="someone-else").info.experiment_id == other
    assert resolve_run(client, run_id=known.run_id).info.run_name == "known"  # an id is still an id


def test_cli_watch_and_report_take_the_name(known, tmp_path, capsys):
    assert main(["watch", "--once", "--run-id", "known", "--tracking-uri", known.tracking_uri]) == 0
    assert capsys.readouterr().out.count("run known (finished)  ·  iteration 3") == 1
    out = tmp_path / "rep"
    assert main(["report", "known", "--out", str(out), "--tracking-uri", known.tracking_uri]) == 0
    assert capsys.readouterr().out.startswith(f"gradmon-ray: wrote 4 files to {out}: ")
    assert "| tempo | 7 | exploding | 7 | 9 | 0 | 3 | 0 | — | — |" in (out / "summary.md").read_text()


def test_cli_report_default_directory_is_named_by_the_resolved_id(known, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["report", "known", "--tracking-uri", known.tracking_uri]) == 0
    assert (tmp_path / f"gradmon-report-{known.run_id}" / "summary.md").is_file()


def test_a_name_several_runs_have_is_refused_listing_them(known, capsys):
    client = MlflowClient(known.tracking_uri)
    exp = client.create_experiment("again")
    twins = [client.create_run(exp, run_name="known", start_time=1_700_000_000_000 + i * 1000) for i in range(4)]
    assert main(["report", "known", "--tracking-uri", known.tracking_uri]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    runs = sorted([*twins, client.get_run(known.run_id)], key=lambda r: -r.info.start_time)  # newest first
    listed = ", ".join(f"{r.info.run_id} ({_utc(r.info.start_time)})" for r in runs[:SHOWN_CANDIDATES])
    assert line == f"gradmon-ray: 5 runs are named 'known', started: {listed} and 2 more; give the run id"
    assert len(line) <= 300


@pytest.mark.parametrize("ref", ["nobody", "0" * 32, 'it\'s "quoted"'])
def test_a_name_no_run_has_is_refused_in_one_line(known, capsys, ref):
    assert main(["watch", "--once", "--run-id", ref, "--tracking-uri", known.tracking_uri]) == 2
    assert capsys.readouterr().err == f"gradmon-ray: no run with id or name {ref!r} at {known.tracking_uri}\n"
    with pytest.raises(RunLookupError) as lookup:
        resolve_run(MlflowClient(known.tracking_uri), run_id=ref)
    assert not lookup.value.unreachable and not lookup.value.ambiguous
