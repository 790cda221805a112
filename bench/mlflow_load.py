"""Does one `mlflow server` hold the metric load of 8 and 32 concurrent trials, on sqlite and on PostgreSQL?

Issue #37 item 10. For each backend store (``sqlite``; ``postgresql`` when PostgreSQL's binaries
and the psycopg2 driver are here) this starts one ``mlflow server`` as ``cluster.yaml``'s head
does: MLflow's basic-auth app (its default config: no credential cache, so a password hash
check per request), ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false``, ``--artifacts-destination``,
on a loopback port, with one web worker (``--workers``: cluster.yaml passes none, and MLflow's
default is 4; ``--auth cached``: MLflow's credential cache on; ``--auth none``: no auth app).
PostgreSQL runs from a fresh ``initdb`` in a temporary directory, as ``nobody`` when we are root
(initdb refuses root), on a free loopback port, with a generated password, stopped at the end.

Each trial is a real process (``python bench/mlflow_load.py --worker``) with its own
``MlflowSink``, used exactly as ``gradmon-ray train`` uses it: 93 params at the start, one
``log_iteration`` per iteration (the head-names tag on the first), the status tag at the end,
then ``close`` (``--close-timeout-s``: 30 s, as ``gradmon-ray train``, which then leaves the
rest to the trial's spill file for ``gradmon-ray replay``). An iteration has 105 metrics for one
module (the names a real 2-iteration CLI run of the default FactoredOps-v0 config logged: 8
action heads and a value head) or 791 for 8 modules
(``module/<id>/...`` for everything per module, 7 run-wide names), built with
``gradmon_ray.metric_names``. Trials log at ``--rate`` iterations per second (phases spread
over the period, as unsynchronised trials would be; 0: flat out, no pause) after every trial's
run exists, then close. The processes start once and serve every configuration; before the
measured runs each server takes one unmeasured warm-up round.

Measured, by instrumentation from outside the sink (each worker wraps ``MlflowClient.log_batch``
and notes when each call with metrics returned):

* written metrics/s: metrics written by all trials / (last acknowledgement - start);
* latency p50 / p99 (ms): from ``log_iteration`` to the return of the last ``log_batch`` that
  carried that iteration's metrics, over every iteration of every trial;
* backlog: the most iterations a trial had logged but not yet seen acknowledged, when it logged
  the next one (0: the server kept up);
* close: the longest ``close``; failed writes: the sinks' failed (then retried) writes
  (``failed_writes``).

Afterwards every (run, key, step) is checked to be in the store exactly once with the value its
process logged, by one SQL query of the server's store per configuration (a full check:
``MlflowClient.get_metric_history`` would be 25,000 requests at 32 trials x 791 keys), and
through ``MlflowClient`` over the server for three keys per run; a value missing is "lost" unless
its step is in the trial's spill file (the sink's own account, which a replay would write). The
backends alternate within each repetition; each configuration runs ``--reps`` times and min /
median / max are printed. The trials share the machine's cores with the server.

The default is the bounded run (8 trials of one module, both stores, 3 repetitions: about 3
minutes on the 2-core box); docs/BENCHMARKS.md's adds ``--procs 8 32 --modules 1 8`` (about 30).

    python bench/mlflow_load.py [--backends sqlite postgresql] [--procs 8 [32]] [--modules 1 [8]]
        [--iterations 8] [--rate 1] [--reps 3] [--auth cluster|cached|none] [--workers 1]
        [--close-timeout-s 30]
"""

from __future__ import annotations

import argparse
import configparser
import contextlib
import json
import math
import os
import pwd
import queue
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gradmon_ray import metric_names as mn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the suite's helpers
from tests.e2e.processes import BIN, MLFLOW_SERVER_ENV, free_port, kill_group, wait_http

ACTION_HEADS = ("op", "slot", "blueprint", "style", "tempo", "alpha_target", "alpha_speed", "alpha_curve")
"""FactoredOps-v0's action heads (the default config's env), as a real run names them."""
ADMIN = "admin"
PG_USER = "gradmon"
PARAMS = 93  # the params a real `gradmon-ray train` run of the default config logs
SERVER_START_S = 180.0
STEP_STRIDE = 1000  # value = trial * 1e6 + step * 1e3 + key index: unique and exact as a float64


# --- what a trial logs ----------------------------------------------------------------------
def metric_names(modules: int) -> list[str]:
    """One iteration's metric names: 105 for one module, 7 + 98 per module for several."""
    per_head = (mn.HEAD_GRAD_NORM, mn.HEAD_GRAD_NORM_PREV, mn.HEAD_GRAD_TREND, mn.HEAD_GRAD_HEALTH)
    action_only = (mn.HEAD_NAN_LATCH, mn.HEAD_INF_LATCH, mn.HEAD_COLLAPSE_LATCH)
    action_only += (mn.HEAD_ENTROPY, mn.HEAD_ENTROPY_NORM, mn.HEAD_KL)
    module_wide = (mn.GLOBAL_GRAD_NORM, mn.HEAD_GRAD_NORM_CV, mn.INF_GRAD_COUNT, mn.NAN_GRAD_COUNT)
    module_wide += (mn.POLICY_LOSS, mn.VF_LOSS, mn.ENTROPY, mn.MEAN_KL, mn.TOTAL_LOSS, mn.VF_EXPLAINED_VAR)
    module_wide += (mn.MINIBATCH_UPDATES, mn.SKIPPED_UPDATES, mn.SKIPPED_UPDATES_TOTAL, mn.TELEMETRY_ITERATION)
    run_wide = [mn.LEARNERS_UPDATED, mn.EPISODE_RETURN_MEAN, mn.EPISODE_LEN_MEAN, mn.ENV_STEPS_SAMPLED_LIFETIME]
    run_wide += [mn.ENV_RUNNERS_HEALTHY, mn.ENV_RUNNER_RESTARTS, mn.ITERATION_TIME_S]
    names = list(run_wide)
    for index in range(modules):
        module = f"p{index}" if modules > 1 else None
        for head in (*ACTION_HEADS, mn.VALUE_HEAD):
            label = mn.head_label(module, head)
            templates = per_head + (action_only if head != mn.VALUE_HEAD else ())
            names += [mn.head_metric(template, label) for template in templates]
        names += [mn.module_metric(module, name) for name in module_wide]
    return names


def metric_value(trial: int, step: int, index: int) -> float:
    """The value trial ``trial`` logs for its ``index``-th metric at ``step``."""
    return float(trial * STEP_STRIDE * STEP_STRIDE + step * STEP_STRIDE + index)


@dataclass
class Task:
    """One trial: what a worker process logs, and where."""

    trial: int
    tracking_uri: str
    experiment: str
    modules: int
    iterations: int
    rate: float
    phase_s: float
    spill_dir: str
    close_timeout_s: float = 30.0


@dataclass
class TrialResult:
    """What one trial's process logged and saw (times: ``time.monotonic``, one clock for all processes)."""

    trial: int
    run_id: str
    logged: dict[int, dict[str, float]]
    log_times: dict[int, float]
    ack_times: dict[int, float]
    close_s: float
    close_ok: bool
    failed_writes: int
    spilled_iterations: int
    dropped_iterations: int
    requests: int
    spilled_steps: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# --- the worker process -----------------------------------------------------------------------
class _Acks:
    """Wraps ``MlflowClient.log_batch`` (the sink's only write) to note when each step was acknowledged."""

    def __init__(self) -> None:
        from mlflow.tracking import MlflowClient

        self.times: dict[int, float] = {}
        self.requests = 0
        original = MlflowClient.log_batch

        def log_batch(client: Any, run_id: str, *args: Any, **kwargs: Any) -> Any:
            out = original(client, run_id, *args, **kwargs)
            metrics = kwargs.get("metrics") or (args[0] if args else ())
            if metrics:
                now = time.monotonic()
                self.requests += 1
                for step in {m.step for m in metrics}:  # the last chunk carrying a step acknowledges it
                    self.times[step] = now
            return out

        MlflowClient.log_batch = log_batch  # type: ignore[method-assign]

    def reset(self) -> None:
        self.times, self.requests = {}, 0


def run_trial(task: Task, acks: _Acks, armed: Any) -> TrialResult:
    """Log ``task``'s iterations through an ``MlflowSink`` as ``gradmon-ray train`` does.

    ``armed()`` is called once the run exists and returns the shared start time (monotonic).
    """
    from gradmon_ray.tracking.mlflow_sink import MlflowSink

    acks.reset()
    names = metric_names(task.modules)
    params = {f"config.key_{i:02d}": f"value {i}" for i in range(PARAMS)}
    sink = MlflowSink(
        task.tracking_uri,
        task.experiment,
        run_name=f"trial-{task.trial:02d}",
        params=params,
        spill_path=Path(task.spill_dir) / f"trial-{task.trial:02d}.spill.jsonl",
    )
    run_id = sink.wait_for_run(SERVER_START_S)
    start = armed() + task.phase_s
    logged: dict[int, dict[str, float]] = {}
    log_times: dict[int, float] = {}
    for step in range(1, task.iterations + 1):
        if task.rate > 0:  # on a fixed schedule: a slow log_iteration does not shift the next one
            time.sleep(max(0.0, start + (step - 1) / task.rate - time.monotonic()))
        metrics = {name: metric_value(task.trial, step, i) for i, name in enumerate(names)}
        tags = {mn.TAG_HEAD_NAMES: ",".join((*ACTION_HEADS, mn.VALUE_HEAD))} if step == 1 else {}
        log_times[step] = time.monotonic()
        sink.log_iteration(step, metrics, tags)
        logged[step] = metrics
    sink.log_iteration(task.iterations, {}, {mn.TAG_STATUS: "finished"})  # as train ends a run
    t_close = time.monotonic()
    close_ok = sink.close(status="FINISHED", timeout_s=task.close_timeout_s)
    return TrialResult(
        trial=task.trial,
        run_id=run_id or "",
        logged=logged,
        log_times=log_times,
        ack_times=dict(acks.times),
        close_s=time.monotonic() - t_close,
        close_ok=close_ok,
        failed_writes=sink.failed_writes,
        spilled_iterations=sink.spilled_iterations,
        dropped_iterations=sink.dropped_iterations,
        requests=acks.requests,
        spilled_steps=_undelivered_steps(sink),
        errors=[sink.last_error] if sink.last_error else [],
    )


def _undelivered_steps(sink: Any) -> list[int]:
    """The steps in the sink's spill file that MLflow has not taken (what ``gradmon-ray replay`` writes).

    The sink's own bookkeeping (read-only): its public counter has the number, not the steps.
    """
    with sink._cond:
        return sorted({step for seq, step in sink._spilled_steps.items() if seq not in sink._delivered_seqs})


def _send(out: TextIO, kind: str, payload: Any = None) -> None:
    out.write(json.dumps({"kind": kind, "payload": payload}) + "\n")
    out.flush()


def worker_main() -> None:
    """A trial process: reads tasks (JSON lines) on stdin, answers on the stdout it started with."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr: stdout is the protocol's
    acks = _Acks()
    _send(proto, "ready")
    for line in sys.stdin:
        task = Task(**json.loads(line))

        def armed() -> float:
            _send(proto, "armed")
            return float(json.loads(sys.stdin.readline())["start"])

        try:
            _send(proto, "done", asdict(run_trial(task, acks, armed)))
        except Exception:
            _send(proto, "error", traceback.format_exc())


# --- the trial processes, seen from the bench -------------------------------------------------
class TrialPool:
    """``size`` worker processes, started once; ``run`` gives each of the first N one task.

    ``env``: the processes' environment (default: ours), e.g. with the MLflow login.
    """

    def __init__(self, size: int, log_path: Path, env: dict[str, str] | None = None) -> None:
        self._log = log_path.open("a")
        self._inbox: queue.Queue[tuple[int, dict[str, Any] | None]] = queue.Queue()
        self._procs = [
            subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                env=env,
                text=True,
                start_new_session=True,
            )
            for _ in range(size)
        ]
        for index, proc in enumerate(self._procs):
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()
        self._expect(range(size), "ready", timeout_s=300)

    def _read(self, index: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._inbox.put((index, json.loads(line)))
        self._inbox.put((index, None))  # the process ended

    def _expect(self, indices: range, kind: str, timeout_s: float) -> dict[int, Any]:
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(indices):
            try:
                index, message = self._inbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"trial processes: {len(answers)}/{len(indices)} said {kind!r}") from None
            if message is None or message["kind"] == "error":
                raise RuntimeError(f"trial process {index} failed: {message and message['payload']}")
            if message["kind"] == kind:
                answers[index] = message["payload"]
        return answers

    def _tell(self, index: int, payload: dict[str, Any]) -> None:
        stdin = self._procs[index].stdin
        assert stdin is not None
        stdin.write(json.dumps(payload) + "\n")
        stdin.flush()

    def run(self, tasks: list[Task], lead_s: float = 0.5) -> list[TrialResult]:
        """Every task at once: once all runs exist, all start ``lead_s`` later."""
        indices = range(len(tasks))
        for index, task in zip(indices, tasks, strict=True):
            self._tell(index, asdict(task))
        self._expect(indices, "armed", timeout_s=SERVER_START_S)
        start = time.monotonic() + lead_s
        for index in indices:
            self._tell(index, {"start": start})
        done = self._expect(indices, "done", timeout_s=max(t.close_timeout_s for t in tasks) + 600)
        results = []
        for index in indices:
            raw = done[index]
            for name in ("logged", "log_times", "ack_times"):
                raw[name] = {int(step): value for step, value in raw[name].items()}
            results.append(TrialResult(**raw))
        return results

    def close(self) -> None:
        for proc in self._procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()


# --- servers ----------------------------------------------------------------------------------
def postgres_bin_dir() -> Path | None:
    """Where ``initdb``, ``pg_ctl`` and ``postgres`` are: on PATH, or Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which("initdb")
    dirs = [Path(found).resolve().parent] if found else []
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: p.parent.name.zfill(4), reverse=True)
    for directory in dirs + versions:
        if all((directory / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return directory
    return None


def postgres_problem() -> str | None:
    """Why a PostgreSQL store cannot be benched here (None: it can)."""
    if postgres_bin_dir() is None:
        return "no PostgreSQL binaries (initdb, pg_ctl, postgres; Debian's postgresql package)"
    try:
        import psycopg2  # noqa: F401  (MLflow's PostgreSQL driver)
    except ImportError:
        return "no psycopg2 (pip install psycopg2-binary)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("nobody")
        except KeyError:
            return "running as root and there is no user 'nobody' to run PostgreSQL as"
    return None


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """A fresh PostgreSQL cluster on a free loopback port; yields the store URI of its ``mlflow`` db.

    In its own directory under the system's temporary one, removed afterwards: as root the cluster
    is nobody's, who must reach it (pytest's directories are root's alone).
    """
    bin_dir = postgres_bin_dir()
    assert bin_dir is not None, postgres_problem()
    with tempfile.TemporaryDirectory(prefix="gradmon-bench-pg-") as tmp:
        yield from _postgres(bin_dir, Path(tmp))


def _postgres(bin_dir: Path, root: Path) -> Iterator[str]:
    run_as: dict[str, Any] = {"cwd": root, "stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
    if os.geteuid() == 0:  # initdb refuses root: the cluster is nobody's
        user = pwd.getpwnam("nobody")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as.update(user=user.pw_uid, group=user.pw_gid, extra_groups=[])
    password, port = secrets.token_hex(16), free_port()
    pwfile = root / "pwfile"
    pwfile.write_text(password + "\n")
    os.chown(pwfile, *(run_as.get(k, -1) for k in ("user", "group")))
    pwfile.chmod(0o600)
    initdb = [str(bin_dir / "initdb"), "-D", str(root / "data"), "-U", PG_USER, "--pwfile", str(pwfile)]
    subprocess.run([*initdb, "-A", "scram-sha-256", "-E", "UTF8", "--locale=C"], check=True, **run_as)
    pwfile.unlink()
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {root}"
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(root / "data"), "-w", "-t", "120"]
    subprocess.run([*pg_ctl, "-l", str(root / "postgres.log"), "-o", options, "start"], check=True, **run_as)
    try:
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=port, user=PG_USER, password=password, dbname="postgres")
        conn.autocommit = True  # CREATE DATABASE cannot run in a transaction
        with conn.cursor() as cursor:
            cursor.execute("CREATE DATABASE mlflow")
        conn.close()
        yield f"postgresql+psycopg2://{PG_USER}:{password}@127.0.0.1:{port}/mlflow"
    finally:
        subprocess.run([*pg_ctl, "-m", "fast", "stop"], check=False, **run_as)


@dataclass
class Server:
    """One ``mlflow server`` on ``uri``, writing to ``store_uri``."""

    backend: str
    uri: str
    store_uri: str
    proc: subprocess.Popen


def _auth_config(path: Path, cache_s: int) -> Path:
    """MLflow's own basic_auth.ini with its credential cache on for ``cache_s`` seconds."""
    import mlflow.server.auth

    config = configparser.ConfigParser()
    config.read(Path(mlflow.server.auth.__file__).parent / "basic_auth.ini")
    config["mlflow"]["auth_cache_ttl_seconds"] = str(cache_s)
    with path.open("w") as f:
        config.write(f)
    return path


@contextlib.contextmanager
def mlflow_server(
    root: Path, backend: str, store_uri: str, auth: str, password: str, workers: int = 1
) -> Iterator[Server]:
    """``mlflow server`` as cluster.yaml's head runs it (``auth``: ``cluster``, ``cached`` or ``none``),
    with ``workers`` web workers (cluster.yaml passes none: MLflow's default is 4).

    The store URI goes in ``MLFLOW_BACKEND_STORE_URI`` (the flag's variable): a PostgreSQL one has a
    password, which a command line would show to ``ps``.
    """
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers)]
    argv += ["--artifacts-destination", str(root / "artifacts")]
    env = {**os.environ, **MLFLOW_SERVER_ENV, "MLFLOW_BACKEND_STORE_URI": store_uri}
    if auth != "none":
        argv[2:2] = ["--app-name", "basic-auth"]
        env.update(MLFLOW_AUTH_ADMIN_USERNAME=ADMIN, MLFLOW_AUTH_ADMIN_PASSWORD=password)
        env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = secrets.token_hex(32)
        if auth == "cached":
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(_auth_config(root / "auth.ini", 300))
    with (root / "server.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_http(f"http://127.0.0.1:{port}/health", SERVER_START_S, proc=proc)
        except Exception as exc:
            tail = (root / "server.log").read_text()[-3000:]
            raise RuntimeError(f"mlflow server ({backend}) did not start ({exc}):\n{tail}") from None
        yield Server(backend, f"http://127.0.0.1:{port}", store_uri, proc)
    finally:
        kill_group(proc)


@contextlib.contextmanager
def servers(root: Path, backends: list[str], auth: str, password: str, workers: int = 1) -> Iterator[list[Server]]:
    """One server per backend (``sqlite``, ``postgresql``), all up at once."""
    with contextlib.ExitStack() as stack:
        started = []
        for backend in backends:
            if backend == "sqlite":
                store = f"sqlite:///{root / 'sqlite' / 'mlflow.db'}"
            else:
                store = stack.enter_context(postgres())
            server = mlflow_server(root / backend, backend, store, auth, password, workers)
            started.append(stack.enter_context(server))
        yield started


# --- what the store holds afterwards ----------------------------------------------------------
@dataclass
class Check:
    """Every (run, key, step) a trial logged, against the store: each must be there once, with its value."""

    values: int = 0
    missing: int = 0
    lost: int = 0
    """Missing and not in the trial's spill file either (``missing`` less what a replay would write)."""
    duplicated: int = 0
    wrong: int = 0
    unexpected: int = 0
    client_checked: int = 0
    client_bad: int = 0

    @property
    def ok(self) -> bool:
        problems = self.missing + self.duplicated + self.wrong + self.unexpected + self.client_bad
        return problems == 0 and self.values > 0


def check_store(store_uri: str, results: list[TrialResult]) -> Check:
    """One query of the server's store (sqlite or PostgreSQL) for every metric row of these runs."""
    from sqlalchemy import bindparam, create_engine, text

    expected = {
        (r.run_id, key, step): value
        for r in results
        for step, metrics in r.logged.items()
        for key, value in metrics.items()
    }
    query = text("SELECT run_uuid, key, step, value FROM metrics WHERE run_uuid IN :runs")
    engine = create_engine(store_uri)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                query.bindparams(bindparam("runs", expanding=True)), {"runs": [r.run_id for r in results]}
            )
            stored = [(run, key, int(step), float(value)) for run, key, step, value in rows]
    finally:
        engine.dispose()
    counts = Counter((run, key, step) for run, key, step, _ in stored)
    check = Check(values=len(expected))
    check.missing = sum(1 for k in expected if k not in counts)
    spilled = {(r.run_id, step) for r in results for step in r.spilled_steps}
    check.lost = sum(1 for run, key, step in expected if (run, key, step) not in counts and (run, step) not in spilled)
    check.duplicated = sum(1 for k, n in counts.items() if n > 1)
    check.unexpected = sum(1 for k in counts if k not in expected)
    check.wrong = sum(1 for run, key, step, value in stored if expected.get((run, key, step), value) != value)
    return check


def check_client(tracking_uri: str, results: list[TrialResult], keys: list[str] | None, check: Check) -> Check:
    """Through ``MlflowClient`` over the server: each run's history of ``keys`` (None: every key)
    must be the steps and values its trial logged, each step once."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    for result in results:
        names = keys if keys is not None else list(result.logged[min(result.logged)])
        for key in names:
            history = sorted((m.step, m.value) for m in _history(client, result.run_id, key))
            want = sorted((step, metrics[key]) for step, metrics in result.logged.items() if key in metrics)
            check.client_checked += 1
            check.client_bad += history != want
    return check


def _history(client: Any, run_id: str, key: str, tries: int = 6) -> list[Any]:
    """``get_metric_history``, retried: abandoned trials' last writes may still keep the server busy."""
    for attempt in range(tries):
        try:
            return client.get_metric_history(run_id, key)
        except Exception:
            if attempt == tries - 1:
                raise
            time.sleep(5.0)
    return []


def sample_keys(modules: int) -> list[str]:
    """Three of an iteration's keys for the client check: the first, one in the middle, the last."""
    names = metric_names(modules)
    return [names[0], names[len(names) // 2], names[-1]]


# --- one configuration ------------------------------------------------------------------------
@dataclass
class Measure:
    """One repetition of one configuration."""

    backend: str
    procs: int
    metrics: int
    offered: float
    written: float
    p50_ms: float
    p99_ms: float
    backlog: int
    close_s: float
    failed_writes: int
    spilled: int
    requests: int
    check: Check


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def backlog(result: TrialResult) -> int:
    """The most iterations still unacknowledged when the trial logged another one."""
    acks = result.ack_times
    return max(
        (
            sum(1 for j in result.log_times if j < i and acks.get(j, float("inf")) > t)
            for i, t in result.log_times.items()
        ),
        default=0,
    )


def measure(server: Server, procs: int, modules: int, rate: float, results: list[TrialResult], check: Check) -> Measure:
    per_iteration = len(metric_names(modules))
    latencies = [r.ack_times[s] - t for r in results for s, t in r.log_times.items() if s in r.ack_times]
    start = min(t for r in results for t in r.log_times.values())
    end = max((t for r in results for t in r.ack_times.values()), default=start)
    acked = sum(len(r.logged[s]) for r in results for s in r.ack_times if s in r.logged)
    return Measure(
        backend=server.backend,
        procs=procs,
        metrics=per_iteration,
        offered=procs * per_iteration * rate,
        written=acked / max(end - start, 1e-9),
        p50_ms=1000 * percentile(latencies, 50) if latencies else float("nan"),
        p99_ms=1000 * percentile(latencies, 99) if latencies else float("nan"),
        backlog=max(backlog(r) for r in results),
        close_s=max(r.close_s for r in results),
        failed_writes=sum(r.failed_writes for r in results),
        spilled=sum(r.spilled_iterations + r.dropped_iterations for r in results),
        requests=sum(r.requests for r in results),
        check=check,
    )


def run_config(
    pool: TrialPool,
    server: Server,
    procs: int,
    modules: int,
    iterations: int,
    rate: float,
    spill_dir: Path,
    close_timeout_s: float = 30.0,
) -> tuple[Measure, list[TrialResult]]:
    """``procs`` trials at once into ``server``'s new experiment; then the store is checked."""
    from mlflow.tracking import MlflowClient

    experiment = f"load-{procs}x{modules}-{time.time_ns()}"
    MlflowClient(tracking_uri=server.uri).create_experiment(experiment)  # as `gradmon-ray tune` does, first
    spill_dir.mkdir(parents=True, exist_ok=True)
    period = 1 / rate if rate > 0 else 0.0
    tasks = [
        Task(i, server.uri, experiment, modules, iterations, rate, period * i / procs, str(spill_dir), close_timeout_s)
        for i in range(procs)
    ]
    results = pool.run(tasks)
    check = check_store(server.store_uri, results)
    check_client(server.uri, results, sample_keys(modules), check)
    return measure(server, procs, modules, rate, results, check), results


# --- the bench --------------------------------------------------------------------------------
def spread(values: list[float], fmt: str) -> str:
    """``min / median / max`` of the repetitions."""
    return " / ".join(format(v, fmt) for v in (min(values), statistics.median(values), max(values)))


COLUMNS = ("backend", "trials", "metrics/iter", "offered metrics/s", "written metrics/s", "latency p50 ms")
COLUMNS += ("latency p99 ms", "max backlog (iterations)", "longest close s", "failed writes")
COLUMNS += ("left to the spill files (iterations)", "lost values", "every value once")


def print_table(measures: list[Measure], rate: float) -> None:
    """One row per (backend, trials, metrics per iteration): min / median / max over the repetitions."""
    groups: dict[tuple[str, int, int], list[Measure]] = {}
    for m in measures:
        groups.setdefault((m.backend, m.procs, m.metrics), []).append(m)
    reps = max(len(ms) for ms in groups.values())
    print(f"\nmin / median / max of {reps} repetitions; {rate or 'flat out'} iterations/s per trial")
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for (backend, procs, metrics), ms in groups.items():
        offered = f"{ms[0].offered:.0f}" if rate > 0 else "flat out"
        ok = sum(m.check.ok for m in ms)
        cells = [backend, str(procs), str(metrics), offered, spread([m.written for m in ms], ".0f")]
        cells += [spread([m.p50_ms for m in ms], ".0f"), spread([m.p99_ms for m in ms], ".0f")]
        cells += [spread([m.backlog for m in ms], ".0f"), spread([m.close_s for m in ms], ".1f")]
        cells += [spread([m.failed_writes for m in ms], ".0f"), spread([m.spilled for m in ms], ".0f")]
        cells += [spread([m.check.lost for m in ms], ".0f"), f"{ok}/{len(ms)}"]
        print("| " + " | ".join(cells) + " |")


def describe(m: Measure) -> str:
    c = m.check
    return (
        f"{m.backend:10s} {m.procs:3d} trials x {m.metrics:3d} metrics: written {m.written:7.0f}/s "
        f"(offered {m.offered:.0f}), p50 {m.p50_ms:6.0f} ms, p99 {m.p99_ms:6.0f} ms, backlog {m.backlog}, "
        f"close {m.close_s:.1f} s, {m.requests} requests, failed writes {m.failed_writes}, spilled {m.spilled}; "
        f"values {c.values}: missing {c.missing} (lost {c.lost}), duplicated {c.duplicated}, wrong {c.wrong}, "
        f"unexpected {c.unexpected}; client {c.client_checked - c.client_bad}/{c.client_checked} histories right"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    # Defaults: the bounded run (minutes); docs/BENCHMARKS.md adds --procs 8 32 --modules 1 8 (30 minutes).
    parser.add_argument("--procs", nargs="+", type=int, default=[8], help="concurrent trial processes (8 32)")
    parser.add_argument("--modules", nargs="+", type=int, default=[1], help="1: 105 metrics/iteration, 8: 791 (1 8)")
    parser.add_argument("--iterations", type=int, default=8, help="iterations each trial logs")
    parser.add_argument("--rate", type=float, default=1.0, help="iterations per second per trial (0: flat out)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1, help="the server's web workers (cluster.yaml: MLflow's 4)")
    parser.add_argument("--close-timeout-s", type=float, default=30.0, help=(
        "each trial's MlflowSink.close timeout (30 s: gradmon-ray train's; what is left goes to the spill file)"
    ))  # fmt: skip
    parser.add_argument("--auth", default="cluster", choices=["cluster", "cached", "none"], help=(
        "cluster: basic-auth as cluster.yaml runs it (no credential cache); cached: with MLflow's credential cache; "
        "none: no auth app"))  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Measure]:
    args = parse_args(argv)
    backends = list(args.backends)
    if "postgresql" in backends and (problem := postgres_problem()) is not None:
        print(f"postgresql skipped: {problem}")
        backends.remove("postgresql")
    password = secrets.token_urlsafe(24)
    os.environ.update(MLFLOW_TRACKING_USERNAME=ADMIN, MLFLOW_TRACKING_PASSWORD=password)  # the trials inherit it
    measures: list[Measure] = []
    with tempfile.TemporaryDirectory(prefix="mlflow-load-") as tmp:
        root = Path(tmp)
        pool = TrialPool(max(args.procs), root / "trials.log")
        try:
            with servers(root, backends, args.auth, password, args.workers) as started:
                names = ", ".join(s.backend for s in started)
                print(
                    f"servers up ({args.auth} auth, {args.workers} workers): {names}; {max(args.procs)} trials",
                    flush=True,
                )
                for server in started:  # unmeasured: a fresh server's first requests pay for its lazy imports
                    run_config(pool, server, min(args.procs), 1, 2, args.rate, root / "spill" / "warm-up")
                for rep in range(args.reps):
                    for procs in args.procs:
                        for modules in args.modules:
                            for server in started if rep % 2 == 0 else started[::-1]:  # alternate who goes first
                                spill = root / "spill" / f"{server.backend}-{procs}-{modules}-{rep}"
                                m, _ = run_config(
                                    pool,
                                    server,
                                    procs,
                                    modules,
                                    args.iterations,
                                    args.rate,
                                    spill,
                                    args.close_timeout_s,
                                )
                                print(f"rep {rep + 1}: {describe(m)}", flush=True)
                                measures.append(m)
        finally:
            pool.close()
    print_table(measures, args.rate)
    return measures


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker_main()
    else:
        sys.exit(0 if all(m.check.ok for m in main()) else 1)
