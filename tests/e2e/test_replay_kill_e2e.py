"""``gradmon-ray replay`` SIGKILLed and run again (issue #37 item 5): a real ``mlflow server`` with a
sqlite store, the replay a process of its own, killed twice (the run created, then half the metric
batches in), then run to the end; in the end one run, and every (key, step) once with the value the
spill file holds.  A retry reads back only the histories a point of it could be in (the proxy
counts them): none after the first kill (the run has no metric yet), one per key after the second
(the batch the store did unacknowledged holds every key).  The other cut points (the params, the
tags, the run ended but the file not renamed) and a retry that reads nothing because every batch is
recorded: ``tests/tracking/test_spill_replay.py``, on a sqlite and a file store.

The killed replays run ``replay_spill`` in a bare interpreter: the console script imports torch
(``gradmon_ray.app.cli``), about 1.5 CPU-seconds more each; the last replay runs the CLI's ``main``.

The kills are exact without a hook in gradmon-ray: the replay talks to the server through a proxy
in this test, which forwards each request and, for the one chosen, SIGKILLs the replay once the
server has answered and before the answer is passed on: the store has done it, the replay never
learned it, the worst moment for a kill."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray.tracking.spill import REPLAYED_SUFFIX, spill_records
from tests.e2e.in_process import run_cli
from tests.e2e.processes import BIN, MlflowServer, clean_env, free_port
from tests.tracking.test_spill_replay import assert_replayed_once, write_spill

pytestmark = pytest.mark.e2e

STEPS, KEYS = 250, 10  # 2500 points: the params, then 3 metric batches (1000, 1000, 500), then the tags
REPLAY = "import sys; from gradmon_ray.tracking.spill_replay import replay_spill; replay_spill(*sys.argv[1:])"
HISTORY = "/metrics/get-history"


class KillingProxy(ThreadingHTTPServer):
    """Forwards HTTP to ``target_port``; the ``nth`` request whose path ends with ``suffix`` is done by
    the server, then ``victim`` is SIGKILLed instead of getting the answer."""

    daemon_threads = True

    def __init__(self, target_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.target_port = target_port
        self.rule: tuple[str, int] | None = None
        self.seen = 0
        self.reads = 0
        """Metric histories read since ``arm``."""
        self.victim: int | None = None
        self.victim_known = threading.Event()

    def arm(self, suffix: str | None, nth: int = 0) -> None:
        """Kill at the ``nth`` request to ``suffix`` (None: forward every request)."""
        self.rule, self.seen, self.reads, self.victim = (suffix, nth) if suffix else None, 0, 0, None
        self.victim_known.clear()

    def set_victim(self, pid: int) -> None:
        self.victim = pid
        self.victim_known.set()


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: KillingProxy

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        upstream.request(self.command, self.path, body=body, headers=headers)
        answer = upstream.getresponse()
        data = answer.read()
        upstream.close()
        rule = self.server.rule
        self.server.reads += urlsplit(self.path).path.endswith(HISTORY)
        if rule is not None and urlsplit(self.path).path.endswith(rule[0]):
            self.server.seen += 1
            if self.server.seen == rule[1]:
                self.server.victim_known.wait(30)
                os.kill(self.server.victim, signal.SIGKILL)  # the store has it; the replay never hears
                self.close_connection = True
                return
        self.send_response(answer.status)
        for key, value in answer.getheaders():
            if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _forward

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test reads the store, not the log
        pass


def _replay_killed_at(proxy: KillingProxy, spill: str, suffix: str, nth: int, tmp_path) -> int:
    """Run a replay through ``proxy``, killed at the ``nth`` ``suffix`` request; the histories it read."""
    proxy.arm(suffix, nth)
    uri = f"http://127.0.0.1:{proxy.server_address[1]}"
    with (tmp_path / f"replay-{suffix.strip('/').replace('/', '-')}.err").open("w") as err:
        replay = subprocess.Popen(
            [str(BIN / "python"), "-c", REPLAY, spill, uri],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=clean_env(),
        )
        proxy.set_victim(replay.pid)
        replay.wait(timeout=120)
    assert replay.returncode == -signal.SIGKILL, (suffix, replay.returncode, (tmp_path / err.name).read_text())
    return proxy.reads


def test_a_replay_killed_twice_and_run_again_logs_one_run_and_each_point_once(tmp_path):
    server = MlflowServer(free_port(), tmp_path)
    server.start()
    proxy = KillingProxy(server.port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    spill = tmp_path / "cut.jsonl"
    write_spill(spill, STEPS, KEYS, uri=server.uri)
    try:
        server.wait(120)
        client = MlflowClient(server.uri)

        assert _replay_killed_at(proxy, str(spill), "/runs/create", 1, tmp_path) == 0  # a new run: nothing to read
        exp_id = client.get_experiment_by_name("replayed").experiment_id
        (run,) = client.search_runs([exp_id])  # created; the file does not have its id yet
        assert [r for r in spill_records(spill) if "replayed_into" in r] == []

        # Found by its tag: it has no metric, so no history is read. Killed after params, 2 metric batches.
        assert _replay_killed_at(proxy, str(spill), "/runs/log-batch", 3, tmp_path) == 0
        steps = sorted(p.step for p in client.get_metric_history(run.info.run_id, "m0"))
        assert steps == list(range(1, 201)), steps  # 1000 points a batch, 10 a step: the first two batches

        proxy.arm(None)
        done = run_cli(
            ["replay", str(spill), "--tracking-uri", f"http://127.0.0.1:{proxy.server_address[1]}"], tmp_path
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert proxy.reads == KEYS  # the first batch is recorded in the file, the second not: each key is read
        assert done.stdout.splitlines()[-1] == (  # before it, MLflow's own "View run" lines
            f"gradmon-ray: replayed {STEPS} iterations ({STEPS * KEYS} metric points) into created run "
            f"{run.info.run_id}, ended KILLED"
        )
        assert_replayed_once(server.uri, "replayed", STEPS, KEYS)
        assert not spill.exists() and spill.with_name(spill.name + REPLAYED_SUFFIX).exists()
    finally:
        proxy.shutdown()
        server.kill(grace_s=0)
