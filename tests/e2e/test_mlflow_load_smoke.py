"""Issue #37 item 10's smoke: ``bench/mlflow_load.py`` at a size CI affords.

Two trial processes of the bench (each its own ``MlflowSink``, as ``gradmon-ray train`` uses it)
log 2 iterations of a one-module run's 105 metrics into one ``mlflow server`` started by the bench
as cluster.yaml's head runs it (basic-auth app, here with its login cache on; one worker; no job
execution), on a sqlite store. Then every value each process logged must be in the server's store
exactly once (the bench's own check: one query for every metric row), and the bench's read-back
through ``MlflowClient`` over the server (three keys of each run) must give each history's steps
and values (reading all 105 keys of each run back over HTTP too read the same rows again through
MLflow's server, no path of gradmon's, for about 2 CPU-seconds of the suite).  Two writers show the
concurrency (a third trial process, importing MLflow, cost 3 CPU-seconds more).  The bench's
numbers are in docs/BENCHMARKS.md; this only checks that its path works.  One backend: what
gradmon's sink does is the same whatever store the server has (the PostgreSQL store is the
bench's own ``--backends postgresql``; running it here too cost about 13 CPU-seconds of the suite).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "bench" / "mlflow_load.py"
TRIALS, ITERATIONS, RATE = 2, 2, 4.0  # 4 iterations per second: a write per iteration, not one batch


def _load_bench() -> ModuleType:
    """bench/mlflow_load.py as a module (bench/ is no package); its trial processes run the file itself."""
    spec = importlib.util.spec_from_file_location("mlflow_load_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


bench = _load_bench()
PASSWORD = secrets.token_urlsafe(24)
LOGIN = {"MLFLOW_TRACKING_USERNAME": bench.ADMIN, "MLFLOW_TRACKING_PASSWORD": PASSWORD}


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """The trial processes (each imports MLflow: seconds of a 2-core box)."""
    trials = bench.TrialPool(TRIALS, tmp_path_factory.mktemp("trials") / "trials.log", env={**os.environ, **LOGIN})
    yield trials
    trials.close()


def test_the_bench_logs_a_real_runs_metric_names():
    one, eight = bench.metric_names(1), bench.metric_names(8)
    assert len(one) == len(set(one)) == 105  # what a real 2-iteration CLI run of the default config logs
    assert len(eight) == len(set(eight)) == 7 + 8 * 98
    assert "grad/head/op/norm" in one and "module/p7/latch/collapse/alpha_curve" in eight


def test_concurrent_trials_write_every_value_once(pool, tmp_path, monkeypatch):
    for name, value in LOGIN.items():
        monkeypatch.setenv(name, value)
    # MLflow's credential cache on: without it every request costs a password hash check (~0.1 s
    # of a loaded 2-core box), and each trial makes a request per iteration.
    with bench.servers(tmp_path, ["sqlite"], "cached", PASSWORD) as (server,):
        measure, results = bench.run_config(pool, server, TRIALS, 1, ITERATIONS, RATE, tmp_path / "spill")

    names = bench.metric_names(1)
    assert sorted(r.trial for r in results) == list(range(TRIALS))
    assert len({r.run_id for r in results}) == TRIALS
    for r in results:
        assert r.logged == {
            step: {name: bench.metric_value(r.trial, step, i) for i, name in enumerate(names)}
            for step in range(1, ITERATIONS + 1)
        }
        assert r.close_ok and r.failed_writes == 0 and r.spilled_iterations == r.dropped_iterations == 0
        assert sorted(r.ack_times) == list(range(1, ITERATIONS + 1))
    check = measure.check
    # The sampled keys' histories through the server: what each process logged, each step once.
    assert (check.client_checked, check.client_bad) == (TRIALS * len(bench.sample_keys(1)), 0)
    assert check.ok and check.values == TRIALS * ITERATIONS * len(names)
    assert (check.missing, check.duplicated, check.wrong, check.unexpected) == (0, 0, 0, 0)
    assert measure.written > 0 and 0 <= measure.p50_ms <= measure.p99_ms
