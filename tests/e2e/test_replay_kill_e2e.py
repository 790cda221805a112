"""``gradmon-ray replay`` SIGKILLed and run again (issue #37 item 5): a real ``mlflow server`` with a
sqlite store, the replay a process of its own, killed at three points (the run created, half the
metric batches in, the run ended but the file not renamed yet), each time run again; in the end one
run, and every (key, step) once with the value the spill file holds.

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

STEPS, KEYS = 25, 100  # 2500 points: the params, then 3 metric batches (1000, 1000, 500), then the tags


class KillingProxy(ThreadingHTTPServer):
    """Forwards HTTP to ``target_port``; the ``nth`` request whose path ends with ``suffix`` is done by
    the server, then ``victim`` is SIGKILLed instead of getting the answer."""

    daemon_threads = True

    def __init__(self, target_port: int) -> None:
        super().__init__(("127.0.0.1", 0), _Forward)
        self.target_port = target_port
        self.rule: tuple[str, int] | None = None
        self.seen = 0
        self.victim: int | None = None
        self.victim_known = threading.Event()

    def arm(self, suffix: str, nth: int) -> None:
        self.rule, self.seen, self.victim = (suffix, nth), 0, None
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


def _replay_killed_at(proxy: KillingProxy, spill: str, suffix: str, nth: int, tmp_path) -> None:
    proxy.arm(suffix, nth)
    uri = f"http://127.0.0.1:{proxy.server_address[1]}"
    with (tmp_path / f"replay-{suffix.strip('/').replace('/', '-')}.err").open("w") as err:
        replay = subprocess.Popen(
            [str(BIN / "gradmon-ray"), "replay", spill, "--tracking-uri", uri],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=clean_env(),
        )
        proxy.set_victim(replay.pid)
        replay.wait(timeout=120)
    assert replay.returncode == -signal.SIGKILL, (suffix, replay.returncode, (tmp_path / err.name).read_text())


def test_a_replay_killed_three_times_and_run_again_logs_one_run_and_each_point_once(tmp_path):
    server = MlflowServer(free_port(), tmp_path)
    server.start()
    proxy = KillingProxy(server.port)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    spill = tmp_path / "cut.jsonl"
    write_spill(spill, STEPS, KEYS, uri=server.uri)
    try:
        server.wait(120)
        client = MlflowClient(server.uri)

        _replay_killed_at(proxy, str(spill), "/runs/create", 1, tmp_path)
        exp_id = client.get_experiment_by_name("replayed").experiment_id
        (run,) = client.search_runs([exp_id])  # created; the file does not have its id yet
        assert [r for r in spill_records(spill) if "replayed_into" in r] == []

        _replay_killed_at(proxy, str(spill), "/runs/log-batch", 3, tmp_path)  # params, 2 metric batches
        steps = sorted(p.step for p in client.get_metric_history(run.info.run_id, "m0"))
        assert steps == list(range(1, 21)), steps  # 1000 points a batch, 100 a step: half-way through

        _replay_killed_at(proxy, str(spill), "/runs/update", 1, tmp_path)  # ended KILLED, not renamed yet
        assert client.get_run(run.info.run_id).info.status == "KILLED" and spill.exists()

        done = run_cli(["replay", str(spill), "--tracking-uri", server.uri], tmp_path)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[-1] == (  # before it, MLflow's own "View run" lines
            f"gradmon-ray: replayed {STEPS} iterations ({STEPS * KEYS} metric points) into created run "
            f"{run.info.run_id}, ended KILLED"
        )
        assert_replayed_once(server.uri, "replayed", STEPS, KEYS)
        assert not spill.exists() and spill.with_name(spill.name + REPLAYED_SUFFIX).exists()
    finally:
        proxy.shutdown()
        server.kill(grace_s=0)
