"""Helpers for end-to-end tests that drive real servers and CLIs in subprocesses.

Every server is started in its own process group (``start_new_session=True``) so that
``kill_group`` takes down its children too, even when a test fails.
"""

from __future__ import annotations

import configparser
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent
"""The virtualenv's bin directory: ``gradmon-ray``, ``ray`` and ``mlflow`` of this interpreter."""

SMALL_TRAIN_ARGS = ["--iterations", "2", "--set", "ppo.train_batch_size=256", "--set", "ppo.minibatch_size=128"]
SMALL_TRAIN_ARGS += ["--set", "ppo.num_epochs=1", "--set", "model.trunk_hiddens=[32]"]
SMALL_TRAIN_ARGS += ["--set", "resources.num_env_runners=0"]
"""``gradmon-ray train`` arguments for a two-iteration, CI-sized run, sampled in the driver: an
EnvRunner actor is a process importing torch and RLlib (seconds of a loaded 2-core box), and the
tests using these are about stores and servers (the embedded defaults have tests of their own)."""


MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
"""What every test's ``mlflow server`` runs with, as cluster.yaml's head does: without MLflow 3's
job execution (GenAI scorers; gradmon uses none), whose job runner and huey consumers are 8 more
processes that keep polling: an idle server used about 0.7 of a core with them on the 2-core box
(bench/mlflow_server_idle.py)."""


def mlflow_server_argv(port: int, *store: str) -> list[str]:
    """``mlflow server`` on 127.0.0.1:``port``, one worker, then ``store`` (its store arguments)."""
    return [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1", *store]


FREE_PORT_RANGE = (22000, 32767)
"""Where ``free_port`` looks: above Ray's worker ports (10002-19999 by default; 20100-20999 for
``test_job_submit_e2e``'s head node) and below Linux's
ephemeral range (32768-60999), from which every outgoing connection and every port-0 bind of Ray and
MLflow takes its port: a port handed out from the ephemeral range could be taken by one of those
between the test's choice and the server's bind (a server that never came up, seen once in CI)."""


_PORTS = random.SystemRandom()  # not the global generator: pytest-randomly seeds it alike in every worker


def free_port() -> int:
    """A TCP port on 127.0.0.1, outside the ports the OS and Ray hand out, that was free a moment ago."""
    for _ in range(200):
        port = _PORTS.randint(*FREE_PORT_RANGE)  # random: two xdist workers rarely pick the same one
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {FREE_PORT_RANGE} after 200 tries")


def wait_http(
    url: str,
    timeout_s: float,
    headers: dict[str, str] | None = None,
    ok_codes: tuple[int, ...] = (),
    proc: subprocess.Popen | None = None,
) -> None:
    """Wait until ``url`` answers 2xx (or one of ``ok_codes``); re-raise the last error after ``timeout_s``,
    or as soon as ``proc`` (the server, if given) has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2):
                return
        except urllib.error.HTTPError as err:
            if err.code in ok_codes:
                return
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise
        except Exception:
            if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
                raise
        time.sleep(0.5)


def session_commands(session: int) -> list[str]:
    """The command lines of the live processes in ``session`` (a ``start_new_session`` child's pid), from /proc."""
    commands = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) == session:  # field 6: the session id
                commands.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip())
        except (OSError, ValueError):  # ended meanwhile
            continue
    return commands


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (one that ended but was not waited for yet), from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class MlflowServer:
    """``mlflow server`` on one loopback port and one store (``server.db``, ``art/``), which a test may
    kill and start again."""

    def __init__(self, port: int, store: Path) -> None:
        self.port, self.store = port, store
        self.uri = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []

    def start(self) -> None:
        """Start a server process (not waited for: see ``wait``)."""
        log = (self.store / f"server-{time.monotonic_ns()}.log").open("w")  # read when a test fails
        store = ["--backend-store-uri", f"sqlite:///{self.store / 'server.db'}"]
        store += ["--default-artifact-root", str(self.store / "art")]
        self.processes.append(
            subprocess.Popen(
                mlflow_server_argv(self.port, *store),
                env={**os.environ, **MLFLOW_SERVER_ENV},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def wait(self, timeout_s: float = 120) -> None:
        """Until the server answers; a server that ended instead fails the test at once, with its log."""
        process = self.processes[-1]
        try:
            wait_http(f"{self.uri}/health", timeout_s, proc=process)
        except Exception as err:
            ended = process.poll()
            logs = sorted(self.store.glob("server-*.log"))
            tail = logs[-1].read_text()[-3000:] if logs else "(no log)"
            raise AssertionError(f"mlflow server on {self.uri} not up (exit code {ended}): {err}\n{tail}") from err

    def kill(self, grace_s: float = 20) -> None:
        """End every server process this object started (a SIGKILL at once when ``grace_s`` is 0)."""
        for process in self.processes:
            kill_group(process, grace_s=grace_s)
        self.processes.clear()


def kill_group(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM the process group ``proc`` leads, SIGKILL whatever is left after ``grace_s``."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    try:  # children that outlived the leader are still in its group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    proc.wait(timeout=20)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray address/auth variables, this venv's bin first on PATH."""
    drop = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def mlflow_auth_config(path: Path) -> Path:
    """MLflow's own basic_auth.ini with its credential cache on: a PBKDF2 check per request costs
    about a second on a loaded 2-core box, and a run makes dozens of requests."""
    import mlflow.server.auth

    config = configparser.ConfigParser()
    config.read(Path(mlflow.server.auth.__file__).parent / "basic_auth.ini")
    config["mlflow"]["auth_cache_ttl_seconds"] = "300"
    with path.open("w") as f:
        config.write(f)
    return path
