"""What does MLflow 3's job execution cost an idle `mlflow server`?

`mlflow server` (MLflow 3.x, a sqlite store) also starts a job runner and its huey consumer
processes (for GenAI scorers; gradmon-ray uses none) unless ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION``
is false. For each arm, in each of ``--repeats`` repetitions (the arms alternate), this starts a
server on a fresh store and a free loopback port, waits for ``/health``, then idles ``--idle-s``
seconds, and reads from /proc the CPU time of every process in the server's session: spent
until healthy, spent while idle, the number of processes and their summed resident memory.
Prints min / median / max of each over the repetitions.

    python bench/mlflow_server_idle.py [--repeats 3] [--idle-s 20]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ARMS = {
    "jobs on (MLflow's default)": {},
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false": {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
}
TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session(sid: int) -> list[tuple[float, int]]:
    """(CPU seconds, resident bytes) of every live process in session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # fields[3]: the session id (field 6 of /proc/PID/stat)
            found.append(((int(fields[11]) + int(fields[12])) / TICKS, int(fields[21]) * PAGE))
    return found


def _cpu(sid: int) -> float:
    return sum(cpu for cpu, _ in _session(sid))


def one(extra_env: dict[str, str], idle_s: float) -> tuple[float, float, float, int, float]:
    """(seconds to healthy, CPU-s until healthy, CPU-s idle, processes, resident MiB)."""
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        mlflow = str(Path(sys.executable).parent / "mlflow")
        argv = [mlflow, "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        argv += ["--backend-store-uri", f"sqlite:///{tmp}/s.db", "--default-artifact-root", f"{tmp}/art"]
        t0 = time.monotonic()
        proc = subprocess.Popen(
            argv,
            env={**os.environ, **extra_env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # the session id is proc.pid: every process it starts is in it
        )
        try:
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except Exception:
                    if time.monotonic() - t0 > 180:
                        raise
                    time.sleep(0.2)
            up_s = time.monotonic() - t0
            # The ones that ended before this (short start-up helpers) are not counted: a slight undercount.
            start_cpu = _cpu(proc.pid)
            time.sleep(idle_s)
            processes = _session(proc.pid)
            idle_cpu = sum(cpu for cpu, _ in processes) - start_cpu
            return up_s, start_cpu, idle_cpu, len(processes), sum(rss for _, rss in processes) / 2**20
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _spread(values: list[float], fmt: str) -> str:
    return f"min {min(values):{fmt}}  median {statistics.median(values):{fmt}}  max {max(values):{fmt}}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--idle-s", type=float, default=20.0)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, float, float, int, float]]] = {arm: [] for arm in ARMS}
    for rep in range(args.repeats):
        for arm, env in ARMS.items():
            results[arm].append(one(env, args.idle_s))
            print(f"rep {rep + 1} {arm}: {results[arm][-1]}", flush=True)
    print(f"\n{os.cpu_count()} CPUs; idle {args.idle_s:g} s; {args.repeats} repetitions per arm")
    for arm, rows in results.items():
        up, start, idle, procs, rss = zip(*rows, strict=True)
        print(f"{arm}:")
        print(f"  healthy after     {_spread(list(up), '.1f')} s")
        print(f"  CPU until healthy {_spread(list(start), '.1f')} s")
        print(f"  CPU while idle    {_spread(list(idle), '.1f')} s  ({args.idle_s:g} s)")
        print(f"  processes         {_spread([float(p) for p in procs], '.0f')}")
        print(f"  resident memory   {_spread(list(rss), '.0f')} MiB")


if __name__ == "__main__":
    main()
