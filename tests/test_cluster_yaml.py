"""cluster.yaml: valid for Ray's own cluster launcher, and shaped the way docs/operations.md promises.

What cannot be tested here: launching it (no cloud account on CI). The schema check is the one
`ray up` runs before it touches the cloud, on the config with the launcher's defaults filled in.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import ValidationError
from ray.autoscaler._private.util import prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"
GPU_INSTANCE_FAMILIES = ("g4dn.", "g5.", "g6.", "g6e.", "p3.", "p4d.", "p5.")
CREDENTIALS_FILE = "~/.gradmon-ray/mlflow.env"
# A password, token or key written into the file: an assignment or option whose value is not a
# variable ($X), a command's output ($(...)) or a printf placeholder (%s).
LITERAL_CREDENTIAL = re.compile(
    r"(PASSWORD|TOKEN|SECRET_KEY|password|token)[\"']?\s*[=:]\s*(?![\"']?[$%])[\"']?[A-Za-z0-9+/_.-]{4,}"
)


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def _validated(config: dict[str, Any]) -> dict[str, Any]:
    filled = prepare_config(copy.deepcopy(config))  # what `ray up` does first: merge the provider's defaults
    validate_config(filled)
    return filled


def _ray_start_lines(cluster: dict[str, Any]) -> list[str]:
    lines = cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"]
    return [line for line in lines if "ray start" in line]


def test_cluster_yaml_passes_rays_own_validation(cluster):
    filled = _validated(cluster)
    assert filled["head_node_type"] == "head"
    assert sum(t.get("min_workers", 0) for t in filled["available_node_types"].values()) <= filled["max_workers"]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda c: c["available_node_types"]["head"].update(bogus=1),
        lambda c: c.update(head_node_type="nope"),
        lambda c: c.update(max_workers=0),  # below the sum of min_workers
        lambda c: c["provider"].pop("type"),
    ],
    ids=["unknown-key", "unknown-head-type", "min-over-max", "no-provider-type"],
)
def test_the_validation_is_live_a_broken_copy_fails(cluster, mutate):
    broken = copy.deepcopy(cluster)
    mutate(broken)
    with pytest.raises((ValidationError, ValueError, KeyError)):
        _validated(broken)


def test_head_takes_no_training_work_and_jobs_land_on_a_worker(cluster):
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    assert "min_workers" not in head or head["min_workers"] == 0
    # With CPU 0 on the head, the job driver needs --entrypoint-num-cpus to be placed on a worker,
    # and a worker with a free CPU must exist from the start.
    text = CLUSTER_YAML.read_text()
    assert "ray job submit" in text and "--entrypoint-num-cpus 1" in text
    assert sum(t.get("min_workers", 0) for name, t in cluster["available_node_types"].items() if name != "head") >= 1


def test_gpu_workers_for_learners_and_spot_cpu_workers_for_env_runners(cluster):
    workers = {n: t for n, t in cluster["available_node_types"].items() if n != cluster["head_node_type"]}
    gpu = [t for t in workers.values() if t["node_config"]["InstanceType"].startswith(GPU_INSTANCE_FAMILIES)]
    cpu = [t for t in workers.values() if not t["node_config"]["InstanceType"].startswith(GPU_INSTANCE_FAMILIES)]
    assert gpu and cpu
    # Learners on-demand (one lost learner stalls DDP), env runners on spot (RLlib restarts them).
    assert all("InstanceMarketOptions" not in t["node_config"] for t in gpu)
    assert all(t["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot" for t in cpu)
    assert all(t["resources"].get("gpu_learner") == 1 for t in gpu)


def test_token_auth_stays_on_and_the_file_holds_no_secret(cluster):
    text = CLUSTER_YAML.read_text()
    assert "RAY_AUTH_MODE=" + "disabled" not in text  # split: tests/test_security.py greps for it
    assert all("RAY_AUTH_MODE=token" in line for line in _ray_start_lines(cluster))
    assert len(_ray_start_lines(cluster)) == 2  # one head, one worker
    assert cluster["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert not re.search(r"RAY_AUTH_TOKEN\s*=|[0-9a-f]{32,}|aws_secret", text, re.IGNORECASE)
    assert not LITERAL_CREDENTIAL.search(text), LITERAL_CREDENTIAL.search(text)
    # The dashboard/job server is reached through `ray dashboard` (SSH), never on a public interface.
    assert "--dashboard-host=127.0.0.1" in cluster["head_start_ray_commands"][-1]
    commands = [c for key, v in cluster.items() if key.endswith("_commands") for c in v]
    assert commands and not any("0.0.0." + "0" in c for c in commands)


def test_every_node_installs_this_checkout(cluster):
    assert cluster["file_mounts"]["~/gradmon-ray"] == "."
    assert any(re.search(r"pip install .*~/gradmon-ray\b", c) for c in cluster["setup_commands"])
    assert ".gitignore" in cluster["rsync_filter"]


def test_mlflow_server_on_the_head_and_every_node_points_at_it(cluster):
    head_cmds = " ".join(cluster["head_start_ray_commands"])
    assert "mlflow server --app-name basic-auth --host $HEAD_IP --port 5000" in head_cmds
    assert "--artifacts-destination" in head_cmds
    head_start, worker_start = _ray_start_lines(cluster)
    assert "MLFLOW_TRACKING_URI=http://$HEAD_IP:5000" in head_start
    assert "MLFLOW_TRACKING_URI=http://$RAY_HEAD_IP:5000" in worker_start


def _mlflow_server_command(cluster: dict[str, Any]) -> str:
    (command,) = [c for c in cluster["head_start_ray_commands"] if "mlflow server" in c and "pkill" not in c]
    return command


def test_mlflow_asks_for_a_login_that_comes_from_the_environment(cluster):
    """Issue 27: the MLflow server on the head asks for a login (MLflow's basic-auth app), its admin
    is created from the credentials file copied from the user's machine, and every node exports
    the same login for MLflow's client, which reads MLFLOW_TRACKING_USERNAME/_PASSWORD."""
    server = _mlflow_server_command(cluster)
    assert "--app-name basic-auth" in server
    source = f"set -a && . {CREDENTIALS_FILE} && set +a"
    assert server.index(source) < server.index("mlflow server")
    assert 'MLFLOW_AUTH_ADMIN_USERNAME="$MLFLOW_TRACKING_USERNAME"' in server
    assert 'MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD"' in server
    assert "MLFLOW_FLASK_SERVER_SECRET_KEY=" in server  # the auth app refuses to start without one
    # The login reaches every process Ray starts: sourced (exported) before each `ray start`.
    for line in _ray_start_lines(cluster):
        assert line.index(f"set -a; . {CREDENTIALS_FILE}; set +a;") < line.index("ray start"), line
    # From the user's machine, never written into the repository; readable by its owner only.
    assert cluster["file_mounts"][CREDENTIALS_FILE] == CREDENTIALS_FILE
    assert f"chmod 600 {CREDENTIALS_FILE}" in cluster["setup_commands"]
    assert any("mlflow[auth]" in c for c in cluster["head_setup_commands"])  # Flask-WTF: the auth app's CSRF
    # Still on the head's private address only, and no credential in a URI.
    assert "--host $HEAD_IP" in server and not re.search(r"://[^\s/]*@", CLUSTER_YAML.read_text())


@pytest.mark.parametrize(
    "line",
    [
        "MLFLOW_TRACKING_PASSWORD=hunter2hunter2",
        "MLFLOW_AUTH_ADMIN_PASSWORD='s3cretpass'",
        "MLFLOW_FLASK_SERVER_SECRET_KEY=abcd1234",
        "admin_password: topsecret",
    ],
)
def test_the_literal_credential_check_is_live(line):
    assert LITERAL_CREDENTIAL.search(line)
    assert not LITERAL_CREDENTIAL.search('MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_TRACKING_PASSWORD"')
    assert not LITERAL_CREDENTIAL.search("MLFLOW_TRACKING_PASSWORD=%s")


def test_no_job_submit_command_in_the_docs_carries_a_login_in_its_entrypoint():
    """Ray stores a job's entrypoint and shows it in its job table and dashboard, and writes a job's
    runtime environment into runtime_env_agent.log (tests/e2e/test_job_submit_e2e.py): every ``ray
    job submit`` command in the docs keeps credentials out of both (MLflow's variables in the
    nodes' environment), and the docs show how."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = []
    for path in docs:
        joined = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuation lines as one line
        commands += [(path.name, line) for line in joined.splitlines() if "ray job submit" in line]
    assert len(commands) >= 3, commands
    login_url = re.compile(r"://[^/\s:@]+:[^/\s@]+@")
    for name, line in commands:
        entrypoint = line.split(" -- ", 1)[1] if " -- " in line else ""
        assert not login_url.search(line), (name, line)
        assert "PASSWORD" not in entrypoint and "USERNAME" not in entrypoint, (name, line)
        assert "PASSWORD" not in line and "USERNAME" not in line, (name, line)  # nor in its runtime env
    ops = (ROOT / "docs" / "operations.md").read_text()
    # The way they show instead: the login from the credentials file into every node's `ray start`.
    source = r"set -a; \. ~/\.gradmon-ray/mlflow\.env; set \+a"
    assert re.search(source + r"\n\s*RAY_AUTH_MODE=token MLFLOW_TRACKING_URI=\S+ ray start", ops)
