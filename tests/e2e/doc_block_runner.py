"""Run the docs' blocks as a user does, all in one process: ``python -m tests.e2e.doc_block_runner PLAN.json
RESULTS.json`` (``tests/e2e/test_doc_commands_e2e.py``; the plan: ``tests/doc_blocks.py::plan``).

1. The python blocks (``scripts``), one after the other in this process's working directory, each in
   a fresh namespace named ``__main__``; what one built is dropped before the next (its actors end
   with their handles).  Per block: its seconds and the CPUs its config asks of Ray, by RLlib's own
   resource request (a ``Tuner`` trial reserves every bundle, ``build_algo()`` only the actors').
2. The shell blocks (``commands``), each through ``bash -c`` in ``PLAN["shell_dir"]``.  ``gradmon-ray``
   there is a stand-in on ``PATH`` that hands its arguments, environment and working directory over a
   unix socket to this process, which runs the CLI's ``main`` (the console script's own function)
   and sends back the exit status, stdout and stderr: torch, Ray, RLlib and MLflow are imported and
   Ray is joined once, not per command (about 15 s each on the loaded 2-core box).  A placeholder
   (``RUN_ID``) is filled from an earlier block's output (``captures``); a command expected to end at
   Ray (``RAY``) runs disconnected, with ``RAY_ADDRESS`` naming a port nothing listens on.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.doc_block_kinds import RAY

NO_RAY = "127.0.0.1:9"
"""A Ray address nothing answers (the discard port): the CLI's address check refuses it at once."""
BLOCK_TIMEOUT_S = 300.0
STAND_IN = """#!{python} -I
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect({socket!r})
s.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode())
s.shutdown(socket.SHUT_WR)
reply = json.loads(b"".join(iter(lambda: s.recv(65536), b"")))
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply["stderr"])
sys.exit(reply["rc"])
"""


def cpus_needed(config: Any, *, tuner: bool) -> float:
    one = config.copy(copy_frozen=False)
    if isinstance(one.lr, dict):  # a Tune search space: RLlib validates lr, so one value of it
        one.training(lr=1e-4)
    bundles = one.algo_class.default_resource_request(one).bundles
    return sum(b.get("CPU", 0.0) for b in (bundles if tuner else bundles[1:]))


def run_scripts(scripts: list[dict[str, str]]) -> list[dict[str, Any]]:
    results = []
    for block in scripts:
        start = time.monotonic()
        namespace: dict[str, Any] = {"__name__": "__main__"}
        exec(compile(block["code"], block["key"], "exec"), namespace)
        seconds = time.monotonic() - start
        config = namespace.get("config")
        cpus = cpus_needed(config, tuner="Tuner(" in block["code"]) if hasattr(config, "algo_class") else None
        results.append({"key": block["key"], "seconds": seconds, "cpus": cpus})
        print(f"doc block {block['key']}: {seconds:.1f} s, {cpus} CPUs", flush=True)
        namespace.clear()
        gc.collect()
    return results


def _serve_one(conn: socket.socket, runs: list[dict[str, Any]], until_ray: bool) -> None:
    """One ``gradmon-ray`` command of the stand-in: ``main(argv)`` in its environment and directory;
    ``until_ray``: disconnected, with ``RAY_ADDRESS`` naming a port nothing listens on."""
    import ray

    from tests.e2e.in_process import run_cli

    request = json.loads(b"".join(iter(lambda: conn.recv(65536), b"")))
    if until_ray:
        ray.shutdown()  # the CLI joins an initialized Ray without checking the address
        request["env"]["RAY_ADDRESS"] = NO_RAY
    elif not ray.is_initialized():
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)  # once: a new Ray job per command costs
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(request["env"])
    start = time.monotonic()
    try:
        result = run_cli(request["argv"], Path(request["cwd"]))
        rc, out, err = result.returncode, result.stdout, result.stderr
    except SystemExit as exc:  # argparse's usage errors
        rc, out, err = exc.code if isinstance(exc.code, int) else 1, "", f"SystemExit({exc.code!r})\n"
    except BaseException as exc:
        rc, out, err = 1, "", f"runner: {type(exc).__name__}: {exc}\n"
    finally:
        os.environ.clear()
        os.environ.update(saved)
    runs.append({"argv": request["argv"], "rc": rc, "stdout": out, "stderr": err, "seconds": time.monotonic() - start})
    conn.sendall(json.dumps({"rc": rc, "stdout": out, "stderr": err}).encode())


def _bash(code: str, cwd: Path, env: dict[str, str], server: socket.socket, rcs: list, runs: list[dict]) -> dict:
    """``bash -c code``, serving its ``gradmon-ray`` commands here until it ends (the ``n``-th one up
    to Ray if ``rcs[n]`` says so)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(["bash", "-c", code], cwd=cwd, env=env, stdout=out, stderr=err, text=True)
        deadline = time.monotonic() + BLOCK_TIMEOUT_S
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn, _ = server.accept()
                with conn:
                    _serve_one(conn, runs, until_ray=len(runs) < len(rcs) and rcs[len(runs)] == RAY)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.seek(0)
        err.seek(0)
        return {"rc": proc.returncode, "stdout": out.read(), "stderr": err.read()}


def run_commands(blocks: list[dict[str, Any]], shell_dir: Path) -> list[dict[str, Any]]:
    results, filled = [], {}
    with tempfile.TemporaryDirectory(prefix="gdb") as tmp, socket.socket(socket.AF_UNIX) as server:
        server.bind(f"{tmp}/s")  # short: a unix socket's path has at most 107 characters
        server.listen()
        server.settimeout(0.1)
        stand_in = Path(tmp) / "gradmon-ray"
        stand_in.write_text(STAND_IN.format(python=sys.executable, socket=f"{tmp}/s"))
        stand_in.chmod(0o755)
        for block in blocks:
            code = block["code"]
            for name, value in filled.items():
                code = re.sub(rf"\b{name}\b", value, code)
            for name, text in block["files"].items():
                (shell_dir / name).write_text(text)
            env = {**os.environ, "PATH": f"{tmp}:{os.environ['PATH']}"}
            start, runs = time.monotonic(), []
            result = {"key": block["key"], **_bash(code, shell_dir, env, server, block["rcs"], runs), "runs": runs}
            result["seconds"] = time.monotonic() - start
            results.append(result)
            print(f"doc block {block['key']}: {result['seconds']:.1f} s, {len(runs)} commands", flush=True)
            printed = "\n".join(r["stdout"] + r["stderr"] for r in runs) + result["stdout"]
            for name, pattern in block["captures"].items():
                found = re.search(pattern, printed)
                if found:
                    filled[name] = found.group(1)
    return results


def main(plan_file: str, results_file: str) -> None:
    plan = json.loads(Path(plan_file).read_text())
    results = {"scripts": run_scripts(plan["scripts"])}
    results["commands"] = run_commands(plan["commands"], Path(plan["shell_dir"])) if plan["commands"] else []
    Path(results_file).write_text(json.dumps(results))
    print(f"doc blocks done at {time.time()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
