"""A real Ray Tune sweep: `gradmon-ray tune` as a user runs it (progress while it runs, nested MLflow
runs named after their trials, the health stopper ending the broken trials).  A trial whose learner
is lost (Tune restarts it from its checkpoint, byte-equal, in the same MLflow run, each iteration
once): test_multinode_fault_e2e.py, where a learner's node goes."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from gradmon_ray.app.sweep.trials import PARENT_RUN_TAG
from gradmon_ray.envs import HEAD_NAMES
from gradmon_ray.telemetry.bands import worst_head
from tests.e2e.in_process import run_cli

pytestmark = pytest.mark.e2e

ITERATIONS, SAMPLES, GRID = 2, 1, 2
TRIALS = SAMPLES * GRID
# op's logits x100 make its gradient explode (norm ~17 > 5) from the first iteration on; the
# stopper ends such a trial after 1 exploding iteration, before its second.
SWEEP_FILE = """\
name: heads
base:
  iterations: 4
  seed: 0
  ppo: {train_batch_size: 256, minibatch_size: 128, num_epochs: 1}
  model: {trunk_hiddens: [32]}
  resources: {num_env_runners: 0}
  health_stop: {exploding_iterations: 1}
search_space:
  model.head_logit_scale: {grid: [{}, {op: 100.0}]}
num_samples: 1
storage_path: tune
"""
PROGRESS = re.compile(r"^trial (\S+) \| iter (\d+)/(\d+) \| return (\S+) \| worst head (\S+) (\S+) \((\w+)\)(.*)$")


def _child_runs(client: MlflowClient, parent_id: str | None = None) -> list:
    experiment = client.get_experiment_by_name("sweep")
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id])
    return [r for r in runs if PARENT_RUN_TAG in r.data.tags and parent_id in (None, r.data.tags[PARENT_RUN_TAG])]


@pytest.fixture(scope="module")
def sweep(ray_session, tmp_path_factory):
    """``gradmon-ray tune heads.yaml --num-samples 1 --iterations 2`` through the CLI's ``main`` in this
    process, on the session's Ray (2 grid points x 1 sample = 2 trials, one after the other); every
    line it prints is recorded as it comes, with the time and how many trial runs MLflow held then.
    The console script itself, in a process of its own, is tests/e2e/test_console_script_e2e.py."""
    from gradmon_ray.app.sweep import command as tune_command

    tmp = tmp_path_factory.mktemp("sweep")
    (tmp / "heads.yaml").write_text(SWEEP_FILE)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    argv = ["tune", "heads.yaml", "--num-samples", str(SAMPLES), "--iterations", str(ITERATIONS)]
    argv += ["--mlflow-uri", uri, "--set", "mlflow.experiment=sweep"]
    lines: list[tuple[float, str]] = []  # (seconds since start, line)
    runs_at_first_progress: list[int] = []
    start = time.monotonic()

    def recording_print(*args: object, **_: object) -> None:
        line = " ".join(str(a) for a in args)
        lines.append((time.monotonic() - start, line))
        if PROGRESS.match(line) and not runs_at_first_progress:
            runs_at_first_progress.append(_runs_now(MlflowClient(uri)))

    sigint_before = signal.getsignal(signal.SIGINT)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tune_command, "print", recording_print, raising=False)
        result = run_cli(argv, tmp)
    exited = time.monotonic() - start
    sigint_after = signal.getsignal(signal.SIGINT)
    (tmp / "stdout.txt").write_text("".join(f"{t:7.1f} {line}\n" for t, line in lines))  # for a failing test
    return {
        "tmp": tmp,
        "uri": uri,
        "rc": result.returncode,
        "lines": lines,
        "exited": exited,
        "stderr": result.stderr,
        "sigint_handler_before": sigint_before,
        "sigint_handler_after": sigint_after,
        "runs_at_first_progress": runs_at_first_progress[0] if runs_at_first_progress else None,
    }


def _runs_now(client: MlflowClient) -> int:
    for _ in range(20):  # the sweep writes to the same sqlite file: a busy read is retried
        try:
            return len(_child_runs(client))
        except Exception:
            time.sleep(0.25)
    return -1


def _tune_results(storage: Path) -> dict[str, list[dict]]:
    """Tune's own record of every trial (``result.json`` in each trial directory): trial id -> results."""
    out: dict[str, list[dict]] = {}
    for path in storage.glob("*/*/result.json"):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if rows:
            out[rows[0]["trial_id"]] = rows
    return out


def test_the_cli_sweep_runs_every_trial_as_a_nested_mlflow_run_with_telemetry(sweep):
    assert sweep["rc"] == 0, sweep["stderr"][-3000:]
    client = MlflowClient(sweep["uri"])
    (parent,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("sweep").experiment_id])
        if PARENT_RUN_TAG not in r.data.tags
    ]
    assert parent.info.status == "FINISHED" and parent.data.tags[mn.TAG_SWEEP] == "heads"
    children = _child_runs(client, parent.info.run_id)
    results = _tune_results(sweep["tmp"] / "tune")
    assert len(children) == TRIALS == len(results)
    assert {c.info.run_id for c in children} == {rows[-1]["mlflow_run_id"] for rows in results.values()}
    for child in children:
        assert child.info.status == "FINISHED"
        assert "trial.model.head_logit_scale" in child.data.params and child.data.params["ppo.num_epochs"] == "1"
        for head in ("op", "slot", "value"):
            history = client.get_metric_history(child.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head))
            assert len(history) >= 1 and all(m.value > 0 for m in history)


def test_each_trials_run_is_named_after_the_sweep_its_trial_id_and_its_values(sweep):
    client = MlflowClient(sweep["uri"])
    names = {}
    for trial_id, rows in _tune_results(sweep["tmp"] / "tune").items():
        run = client.get_run(rows[-1]["mlflow_run_id"])
        scale = json.dumps(rows[-1]["config"]["model.head_logit_scale"], separators=(",", ":"), sort_keys=True)
        assert run.info.run_name == f"heads-{trial_id} (model.head_logit_scale={scale})"
        names[trial_id] = run.info.run_name
    assert len(set(names.values())) == TRIALS


def test_progress_lines_arrive_while_the_sweep_runs_and_match_mlflow(sweep):
    lines = sweep["lines"]
    progress = [(t, PROGRESS.match(line)) for t, line in lines if PROGRESS.match(line)]
    assert progress, [line for _, line in lines]
    first_t, _ = progress[0]
    # Printed as results arrive: the first line came while the sweep ran, before the second trial
    # had even created its MLflow run (they run one after the other).
    assert first_t < sweep["exited"] - 1.0
    assert sweep["runs_at_first_progress"] == 1 < TRIALS
    client = MlflowClient(sweep["uri"])
    results = _tune_results(sweep["tmp"] / "tune")
    seen = {}
    for _, m in progress:
        trial_id, iteration, total = m.group(1), int(m.group(2)), int(m.group(3))
        run_id = results[trial_id][-1]["mlflow_run_id"]
        assert total == ITERATIONS
        history = {p.step: p.value for p in client.get_metric_history(run_id, mn.EPISODE_RETURN_MEAN)}
        assert m.group(4) == (f"{history[iteration]:.4g}" if iteration in history else "n/a")
        norms = {}  # the built-in env's action heads, as MLflow holds them at this step
        for h in HEAD_NAMES:
            points = client.get_metric_history(run_id, mn.head_metric(mn.HEAD_GRAD_NORM, h))
            norms[h] = next(p.value for p in points if p.step == iteration)
        head, band = worst_head(norms)
        assert (m.group(5), m.group(6), m.group(7)) == (head, f"{norms[head]:.4g}", band)
        seen[(trial_id, iteration)] = m.group(8)
    # one line per trial iteration, every trial named: the healthy ones both iterations, the broken ones 1
    expected = {(t, i) for t, rows in results.items() for i in range(1, len(rows) + 1)}
    assert set(seen) == expected and len({t for t, _ in seen}) == TRIALS
    for (trial_id, iteration), rest in seen.items():
        broken = results[trial_id][-1]["config"]["model.head_logit_scale"] == {"op": 100.0}
        assert ("stopped: iteration 1" in rest) == (broken and iteration == 1)


def test_health_stopper_ends_the_exploding_trials_and_spares_the_healthy_ones(sweep):
    client = MlflowClient(sweep["uri"])
    results = _tune_results(sweep["tmp"] / "tune")
    parent = client.get_run(_child_runs(client)[0].data.tags[PARENT_RUN_TAG])
    healthy, broken = [], []
    for rows in results.values():
        run_id = rows[-1]["mlflow_run_id"]
        steps = [p.step for p in client.get_metric_history(run_id, mn.LEARNERS_UPDATED)]
        run = client.get_run(run_id)
        if rows[-1]["config"]["model.head_logit_scale"] == {"op": 100.0}:
            broken.append(run_id)
            assert steps == [1]  # stopped after its first iteration, of 2
            assert run.data.tags[mn.TAG_STATUS] == "stopped"
            assert "head 'op' exploding for 1 consecutive iterations" in run.data.tags[mn.TAG_STOP_REASON]
            assert run.data.metrics[mn.HEALTH_STOP_REASON] == 2.0  # exploding
        else:
            healthy.append(run_id)
            assert steps == [1, 2] and mn.HEALTH_STOP_REASON not in run.data.metrics
    assert len(healthy) == len(broken) == SAMPLES
    assert parent.data.tags["gradmon.best_run_id"] in healthy  # a stopped trial is never the best


def test_the_sweep_prints_no_ray_noise_and_puts_the_ctrl_c_handler_back(sweep):
    out = "\n".join(line for _, line in sweep["lines"]) + sweep["stderr"]
    assert "max_restarts > 0" not in out and "core_worker.cc" not in out
    assert sweep["sigint_handler_after"] is sweep["sigint_handler_before"]  # Tune's own is not left installed
