"""Issue 27 item 7, the fast lane: bad MLflow inputs and bad files are refused up front.

Each case goes through the CLI's ``main`` in-process (no Ray, no subprocess) from an empty
working directory, and must exit 2 with ONE line on stderr that names the problem, no
traceback, no banner, and nothing created in the directory (no ``mlflow.db``, no ``mlruns``).
The Ray-side checks (an unreachable address, a request over the cluster's total) need Ray:
``tests/e2e/test_up_front_checks_e2e.py``; their pure parts (``app/resource_wait.py``):
``test_resource_wait.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradmon_ray.app.cli import main
from tests.e2e.processes import free_port

SWEEP = str(Path(__file__).resolve().parents[2] / "tune_configs" / "vgs_sweep.yaml")
TINY = ["--iterations", "1", "--set", "ppo.train_batch_size=128", "--set", "ppo.minibatch_size=64"]


@pytest.fixture
def empty_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    monkeypatch.chdir(run_dir)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return run_dir


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], cwd: Path) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    err = err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("gradmon-ray: config error: "), err
    assert "Traceback" not in err and "training" not in out
    assert list(cwd.iterdir()) == []  # no mlflow.db, no mlruns, nothing
    return err


@pytest.mark.parametrize("command", ["train", "tune"])
@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("mlfow://localhost:5000", "mlfow://localhost:5000: unknown scheme 'mlfow'; MLflow tracks to file, sqlite,"),
        ("localhost:5000", "unknown scheme 'localhost' (a server is http://localhost:5000)"),
    ],
)
def test_an_unknown_tracking_uri_scheme(command, uri, expected, empty_cwd, capsys):
    target = [] if command == "train" else [SWEEP]
    err = _refused([command, *target, *TINY, "--mlflow-uri", uri], capsys, empty_cwd)
    assert "mlflow.tracking_uri: " in err and expected in err, err


@pytest.mark.parametrize("command", ["train", "tune"])
def test_a_tracking_server_that_is_not_there(command, empty_cwd, capsys):
    uri = f"http://alice:Zq9-not-shown@127.0.0.1:{free_port()}"
    target = [] if command == "train" else [SWEEP]
    err = _refused([command, *target, *TINY, "--mlflow-uri", uri], capsys, empty_cwd)
    assert "mlflow.tracking_uri: no MLflow tracking server answers at http://alice:***@127.0.0.1:" in err
    assert "set mlflow.offline_ok: true" in err and "Zq9-not-shown" not in err


def test_offline_ok_trains_anyway_and_says_where_the_metrics_are(empty_cwd, capsys, monkeypatch, caplog):
    """With ``mlflow.offline_ok`` a server that is not there is only a warning; a run MLflow never
    took ends with the replay command, not with 'MLflow run None' and a useless UI hint."""
    from types import SimpleNamespace

    import gradmon_ray.app.train.run

    seen = {}

    def fake_run_training(cfg, progress=None, checked=False):  # what an offline run returns
        seen["uri"] = cfg.mlflow.tracking_uri
        return SimpleNamespace(run_id=None, mlflow_complete=False, checkpoint_path=None, spill_path="s.jsonl")

    monkeypatch.setattr(gradmon_ray.app.train.run, "run_training", fake_run_training)
    uri = f"http://alice:Zq9-not-shown@127.0.0.1:{free_port()}"
    assert main(["train", *TINY, "--mlflow-uri", uri, "--set", "mlflow.offline_ok=true"]) == 0
    out, err = capsys.readouterr()
    assert seen["uri"] == uri  # the run connects with the real URI
    assert "mlflow.offline_ok: training anyway" in caplog.text  # a log warning (stderr from the console script)
    assert "MLflow run None" not in out and "view it with" not in out
    assert out.strip().endswith("never took the run; replay it with: gradmon-ray replay s.jsonl")
    assert "Zq9-not-shown" not in out + err + caplog.text and "http://alice:***@127.0.0.1:" in out


@pytest.mark.parametrize(
    ("text", "line", "column", "problem"),
    [
        ("iterations: 2\nppo: [1, 2\n", 3, 1, "expected ',' or ']', but got '<stream end>'"),
        ("iterations: 2\nppo:\n  lr: 1e-3\n   gamma: 0.9\n", 4, 9, "mapping values are not allowed here"),
        ('mlflow:\n  experiment: "open\n', 3, 1, "found unexpected end of stream"),
    ],
)
def test_a_yaml_error_names_its_line_and_column(text, line, column, problem, empty_cwd, tmp_path, capsys):
    bad = tmp_path / "run.yaml"
    bad.write_text(text)
    err = _refused(["train", "--config", str(bad)], capsys, empty_cwd)
    assert f"--config: {bad} is not valid YAML: line {line}, column {column}: {problem}" in err, err


def test_the_position_is_where_the_text_breaks(tmp_path, empty_cwd, capsys):
    """The oracle for line/column: the offending character's index in the text, counted by hand."""
    text = "iterations: 2\nppo:\n  lr: 0.001\n  gamma: [0.9, 0.99\n  lambda_: 0.95\n"
    bad = tmp_path / "run.yaml"
    bad.write_text(text)
    err = _refused(["train", "--config", str(bad)], capsys, empty_cwd)
    start = text.index("[")  # the flow sequence that never closes
    start_line = text[:start].count("\n") + 1
    start_column = start - text.rfind("\n", 0, start)
    assert f"(in the flow sequence started at line {start_line}, column {start_column})" in err, err


def test_a_sweep_file_given_to_train_says_to_use_tune(tmp_path, empty_cwd, capsys):
    sweep = tmp_path / "my_sweep.yaml"
    sweep.write_text("base: {iterations: 2}\nsearch_space: {ppo.lr: {choice: [1.0e-4, 3.0e-4]}}\n")
    err = _refused(["train", "--config", str(sweep)], capsys, empty_cwd)
    assert err == (
        f"gradmon-ray: config error: --config: {sweep} is a sweep file (it has search_space), not a run config; "
        f"run it with: gradmon-ray tune {sweep}"
    )


def test_a_sweep_file_reports_all_its_errors_at_once(tmp_path, empty_cwd, capsys):
    sweep = tmp_path / "three.yaml"
    sweep.write_text(
        "mode: maximum\n"  # 1: not max/min
        "base: {ppo: {num_epochs: 0}}\n"  # 2: the base config refuses it
        "search_space:\n"
        "  ppo.lr: {uniform: [0.1]}\n"  # 3: a range needs two numbers
        "  ppo.gamma: {choice: [0.9, 0.99]}\n"  # fine
    )
    err = _refused(["tune", str(sweep)], capsys, empty_cwd)
    assert err.startswith("gradmon-ray: config error: sweep: 3 problems: "), err
    problems = err.removeprefix("gradmon-ray: config error: sweep: 3 problems: ").split("; ")
    assert problems == [
        "mode: must be one of 'max', 'min', got 'maximum'",
        "ppo.num_epochs: must be >= 1, got 0",
        "search_space.ppo.lr: uniform needs [low, high] numbers, got [0.1]",
    ]


def test_search_space_values_are_each_checked_against_a_valid_base(tmp_path, empty_cwd, capsys):
    sweep = tmp_path / "two.yaml"
    sweep.write_text(
        "search_space:\n  ppo.lrr: {choice: [1]}\n  model.activation: {grid: [tanh, gelu]}\n  ppo.gamma: 0.9\n"
    )
    err = _refused(["tune", str(sweep)], capsys, empty_cwd)
    assert "sweep: 2 problems: search_space.ppo.lrr: ppo.lrr: unknown key" in err
    assert "; search_space.model.activation: model.activation: must be one of" in err and "gelu" in err


@pytest.mark.parametrize("command", [["report", "0123abcd"], ["watch", "--once", "--run-id", "0123abcd"]])
def test_read_only_commands_refuse_a_server_that_is_not_there(command, empty_cwd, capsys):
    """Issue #37 item 8: was exit 1 with MLflow's message cut at 200 characters, mid-sentence."""
    port = free_port()
    uri = f"http://alice:Zq9-not-shown@127.0.0.1:{port}"
    err = _refused([*command, "--tracking-uri", uri], capsys, empty_cwd)
    assert err == (
        f"gradmon-ray: config error: --tracking-uri: no MLflow tracking server answers at http://alice:***@127.0.0.1:"
        f"{port} within 5 s (ConnectionRefusedError: [Errno 111] Connection refused); check that the server is "
        "running and that --tracking-uri names its host and port"
    )


def test_tune_given_a_run_config_says_to_use_train(empty_cwd, capsys):
    """Issue #37 item 8: was one 3,355-character line, every run config key refused one by one."""
    run_config = str(Path(SWEEP).parent / "default.yaml")
    err = _refused(["tune", run_config], capsys, empty_cwd)
    assert err == (
        f"gradmon-ray: config error: sweep: {run_config} is a run config (it has no search_space), not a sweep file; "
        f"train it with: gradmon-ray train --config {run_config}, or name it in a sweep file's base_config"
    )


def test_many_problems_show_the_first_few_and_a_count(tmp_path, empty_cwd, capsys):
    """Every error line is at most 300 characters: a list shows the problems that fit and how many
    more there are; --debug shows them all."""
    sweep = tmp_path / "twelve.yaml"
    sweep.write_text("search_space:\n" + "".join(f"  ppo.x{i:02d}: {{uniform: [1]}}\n" for i in range(12)))
    err = _refused(["tune", str(sweep)], capsys, empty_cwd)
    problem = "search_space.ppo.x{:02d}: uniform needs [low, high] numbers, got [1]"  # 64 characters each
    assert err == (
        "gradmon-ray: config error: sweep: 12 problems: "  # 47
        + "; ".join(problem.format(i) for i in range(3))  # + 3 x 64 + 2 x 2 = 243; a 4th: 309 before the count
        + "; ... and 9 more (--debug lists all)"  # = 279
    )
    assert main(["tune", str(sweep), "--debug"]) == 2
    full = capsys.readouterr().err.strip()
    assert full == "gradmon-ray: config error: sweep: 12 problems: " + "; ".join(problem.format(i) for i in range(12))


def test_a_sweep_storage_path_that_can_never_be_written(tmp_path, empty_cwd, capsys):
    sweep = tmp_path / "stored.yaml"
    sweep.write_text("storage_path: /proc/version/tune\nsearch_space: {ppo.lr: 0.001}\n")
    err = _refused(["tune", str(sweep)], capsys, empty_cwd)
    assert err == (
        "gradmon-ray: config error: storage_path: /proc/version/tune can never be created: /proc/version is a file, "
        "not a directory; give the sweep file's storage_path a directory you can write to"
    )


def test_the_default_checkpoint_root_is_checked_unless_no_checkpoint_is_kept(monkeypatch, tmp_path):
    from gradmon_ray.app.cli_common import writable_dir_problem
    from gradmon_ray.app.train.command import check_checkpoint_dir
    from gradmon_ray.config import ConfigError, config_from_dict

    monkeypatch.chdir("/proc")  # the default ./gradmon-checkpoints can never be made here
    with pytest.raises(ConfigError) as info:
        check_checkpoint_dir(config_from_dict({}))
    assert str(info.value) == (
        "checkpoint_dir: /proc/gradmon-checkpoints can never be created: nothing can be created in /proc; give "
        "--checkpoint-dir a directory you can write to, or --set checkpoint_every=0 for no resumable checkpoints"
    )
    check_checkpoint_dir(config_from_dict({"checkpoint_every": 0}))  # nothing is ever written: not checked
    check_checkpoint_dir(config_from_dict({}), root=tmp_path)  # --resume's own root, which is writable
    assert writable_dir_problem(tmp_path / "a" / "b") is None
    assert list(tmp_path.iterdir()) == []  # tried, not created


@pytest.mark.parametrize(
    ("text", "limit", "line"),
    [
        ("short\nenough", 300, "short enough"),  # one line, whatever the exception held
        ("aaa bbb ccc ddd eee fff ggg hhh", 20, "aaa bbb ... ggg hhh"),  # the start and the end kept
    ],
)
def test_an_over_long_line_keeps_its_start_and_end(text, limit, line):
    from gradmon_ray.app.cli_common import clip_line

    assert clip_line(text, limit) == line and len(line) <= limit


def test_credentials_are_masked_before_a_line_is_cut():
    from gradmon_ray.app.cli_common import error_line

    secret = "s3cr3t-" + "x" * 40
    text = f"cannot reach {'y' * 100} http://u:{secret}@host {'z' * 100}"
    line = error_line("gradmon-ray: ", text, limit=140, mask=lambda t: t.replace(secret, "***"))
    assert "s3cr3t" not in line and len(line) <= 140 and line.endswith("z" * 60)
