"""Every runnable block of README.md and docs/*.md, run as written (``tests/doc_blocks.py`` classifies
each block; its edits only shrink numbers, point directories at the test's, fill ``RUN_ID``).

One process runs them all (``tests/e2e/doc_block_runner.py``), on the suite's shared Ray, beside the
other worker's Ray jobs: first the python blocks, each as a script; then the shell blocks through bash
in a working directory of their own, every ``gradmon-ray`` in that same warm process.  The module's
fixture runs it once and records what each block did; the tests read the record:

- each script finishes within its time, asks Ray for at most the 2 CPUs of a 2-core box (RLlib's own
  resource request), the MLflow blocks wrote the runs their docs promise, and the process ends;
- each command exits with 0 or the status its docs give, and a ``$ `` block prints its own lines;
- each output the docs show is, line by line in shape, what its command printed (the checkpoint
  layout and the diagnosis artifact: what the run wrote on disk and into MLflow).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from gradmon_ray import metric_names as mn
from tests.doc_block_kinds import RAY, Commands, Output, sample_lines, shows_in_order
from tests.doc_blocks import DIAGNOSIS, ROOT, TRAIN, classified, plan, working_copy
from tests.e2e.doc_block_runner import NO_RAY
from tests.e2e.processes import kill_group

pytestmark = pytest.mark.e2e

TWO_CORES = 2.0
BLOCK_S = 120.0
"""Most seconds one python block may take on the loaded 2-core box (about 15-40 s when measured)."""
EXIT_S = 30.0
"""Most seconds from the runner's last block to the end of its process."""
RUNNER_S = 900.0
CHECKPOINT_LAYOUT = "docs/checkpoints.md@0f007914"
DIAGNOSIS_JSON = "docs/diagnosis.md@9b7c2852"


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """``argv`` to its end (killed, with its group, after ``RUNNER_S``): return code, output, end time."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=RUNNER_S)
    except subprocess.TimeoutExpired:
        kill_group(proc, grace_s=5)
        out, _ = proc.communicate()
        pytest.fail(f"the doc blocks did not end within {RUNNER_S} s:\n{out[-6000:]}")
    return proc.returncode, out, time.time()


@pytest.fixture(scope="module")
def record(lasting_ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The runner's record of every block, its output, and the directories it ran in."""
    tmp = tmp_path_factory.mktemp("doc_blocks")
    shell_dir = tmp / "shell"
    shell_dir.mkdir()
    working_copy(tmp)
    working_copy(shell_dir)
    (tmp / "plan.json").write_text(json.dumps({**plan(str(tmp / "tune")), "shell_dir": str(shell_dir)}))
    env = {**os.environ, "RAY_ADDRESS": lasting_ray_address, "PYTHONPATH": str(ROOT)}
    env.setdefault(
        "OMP_NUM_THREADS", "1"
    )  # as the suite's workers (tests/conftest.py): 2 threads per op crawl when loaded
    rc, output, ended = _run(
        [sys.executable, "-m", "tests.e2e.doc_block_runner", "plan.json", "results.json"], tmp, env
    )
    assert rc == 0, output[-6000:]
    results = json.loads((tmp / "results.json").read_text())
    return {**results, "output": output, "ended": ended, "dir": tmp, "shell_dir": shell_dir}


def test_every_python_block_runs_as_written_and_the_script_exits(record):
    """All python blocks in one script (a fresh namespace each, in the user's directory): each
    finishes, its config fits 2 cores by RLlib's own resource request (the README's APPO block asked
    for 3 actor CPUs and waited forever), the MLflow blocks wrote the runs their docs promise into the
    directory the script ran in, and the process ends after the last block."""
    assert [r["key"] for r in record["scripts"]] == [s["key"] for s in plan("")["scripts"]]
    for r in record["scripts"]:
        assert r["cpus"] is None or r["cpus"] <= TWO_CORES, r
        assert r["seconds"] < BLOCK_S, r
    (done,) = re.findall(r"doc blocks done at ([\d.]+)", record["output"])
    assert record["ended"] - float(done) < EXIT_S

    client = MlflowClient(f"sqlite:///{record['dir'] / 'mlflow.db'}")
    for experiment, n_runs, head in (("gradmon-ray", 1, "pi"), ("my-ppo", 2, "action")):  # README's, callback.md's
        runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
        assert len(runs) == n_runs and {r.info.status for r in runs} == {"FINISHED"}, experiment
        for run in runs:
            assert client.get_metric_history(run.info.run_id, mn.head_metric(mn.HEAD_GRAD_NORM, head)), experiment


def _commands(record) -> dict[str, dict[str, Any]]:
    return {c["key"]: c for c in record["commands"]}


def _end(run: dict[str, Any]) -> int | str:
    """A command's exit status, or ``RAY`` for its exit 2 at the Ray address check."""
    at_ray = run["rc"] == 2 and f"gradmon-ray: config error: RAY_ADDRESS: cannot reach Ray at {NO_RAY}" in run["stderr"]
    return RAY if at_ray else run["rc"]


def test_every_command_exits_as_its_docs_say(record):
    """Each shell block through bash: every ``gradmon-ray`` in it ran, with exit status 0 or the one its
    docs give (a finished run's ``--resume`` is refused, 2), or, in a block run up to Ray, exit 2 at
    the Ray address check and nowhere before it; bash found every command, and a ``$ `` block printed
    its own lines."""
    ran = _commands(record)
    failures = []
    for fence, kind in classified():
        if not isinstance(kind, Commands):
            continue
        block = ran[fence.key]
        printed = "\n".join(r["stdout"] + r["stderr"] for r in block["runs"])
        why = f"{fence.key} ({fence.first}): {[r['argv'] for r in block['runs']]}\n{printed[-3000:]}"
        ends = [_end(r) for r in block["runs"]]
        if ends != list(kind.rcs) or block["rc"] != (2 if kind.rcs[-1] == RAY else kind.rcs[-1]):
            failures.append(f"ended {ends} (bash {block['rc']}), not {list(kind.rcs)}: {why}")
        if "command not found" in block["stderr"]:
            failures.append(f"bash: {block['stderr']}: {why}")
        if fence.text.startswith("$ "):
            missing = shows_in_order(sample_lines(fence, Output(fence.key)), printed)
            failures += [f"printed no line like {line!r}: {why}" for line in missing]
    assert not failures, "\n".join(failures)


def _listing(root: Path) -> str:
    """The checkpoint root as docs/checkpoints.md draws it: ``<checkpoint_dir>/...``, ``/`` after a
    directory, ``-> target`` after a symbolic link."""
    lines = []
    for path in sorted(root.rglob("*")):
        shown = f"<checkpoint_dir>/{path.relative_to(root)}"
        lines.append(f"{shown} -> {os.readlink(path)}" if path.is_symlink() else shown + "/" * path.is_dir())
    return "\n".join(lines)


def _layout_lines(sample: str) -> list[str]:
    """The paths a layout sample draws (its comments dropped), placeholders as regexes."""
    paths = [re.split(r"\s{2,}", line)[0] for line in sample.splitlines() if line.startswith("<checkpoint_dir>")]
    return [p.replace("<run id>", "0" * 32).replace("<nonce>", "0") for p in paths]


def _key_paths(value: Any, prefix: tuple = ()) -> set[tuple]:
    if not isinstance(value, dict):
        return set()
    return {(*prefix, k) for k in value} | {p for k, v in value.items() for p in _key_paths(v, (*prefix, k))}


def test_every_output_the_docs_show_is_what_its_command_printed(record):
    """Each output sample made by a block run here, line by line in shape (ids, names, numbers and
    heads vary; ``...`` is anything): the README's first ``train`` lines, the sweep lines, the
    diagnosis lines; the checkpoint layout against the README run's checkpoint directory on disk; the
    diagnosis artifact's fields against the one the diagnosis run logged (the docs shorten its
    re-run counts, so the sample's fields must all be there and the top level must be the same)."""
    ran, failures = _commands(record), []
    for fence, kind in classified():
        if not isinstance(kind, Output) or kind.made_by not in ran:
            continue
        if fence.key == CHECKPOINT_LAYOUT:
            printed = _listing(record["shell_dir"] / "gradmon-checkpoints")
            printed = re.sub(r"[0-9a-f]{32}", "0" * 32, re.sub(r"ckpt-(\d{8})-\w+", r"ckpt-\1-0", printed))
            missing = shows_in_order(_layout_lines(fence.text), printed)
        elif fence.key == DIAGNOSIS_JSON:
            client = MlflowClient(f"sqlite:///{record['shell_dir'] / 'mlflow.db'}")
            printed = ran[DIAGNOSIS]["runs"][0]["stdout"]
            (run_id,) = re.findall(r"^gradmon-ray: MLflow run ([0-9a-f]{32})", printed, re.M)
            local = client.download_artifacts(run_id, "diagnosis/iter_1_default_policy.json", str(record["dir"]))
            logged, shown = json.loads(Path(local).read_text()), json.loads(fence.text)
            missing = [str(p) for p in sorted(_key_paths(shown) - _key_paths(logged))]
            missing += [f"top level {sorted(shown)} != {sorted(logged)}"] if set(shown) != set(logged) else []
        else:
            run = ran[kind.made_by]["runs"][kind.command]
            missing = shows_in_order(sample_lines(fence, kind), run["stdout"] + run["stderr"])
        failures += [f"{fence.key} ({fence.first[:60]}): no {line!r}" for line in missing]
    assert not failures, "\n".join(failures)
    assert {TRAIN, DIAGNOSIS} <= set(ran)
