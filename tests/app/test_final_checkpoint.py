"""``app/train/final_checkpoint.py``: RLlib's end-of-run checkpoint lands in the run's own directory.

The algorithm is a stand-in whose ``save_to_path`` writes a payload the test chose, so the oracle is
the bytes found at the path built by hand (``<root>/<run id>/final``), never the product's own path
function.  Runs sharing a root used to overwrite each other's checkpoint in the root itself.
"""

from __future__ import annotations

from pathlib import Path

from gradmon_ray.app.train.final_checkpoint import publish_final_checkpoint, stage_final_checkpoint


class _Algo:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload

    def save_to_path(self, path: str) -> str:
        (Path(path) / "algo").mkdir(parents=True)
        (Path(path) / "algo" / "state.pkl").write_bytes(self.payload)
        return path


def _payload(path: Path) -> bytes:
    return (path / "algo" / "state.pkl").read_bytes()


def test_two_runs_sharing_a_root_each_keep_their_own_end_of_run_checkpoint(tmp_path):
    root = str(tmp_path / "ckpt")
    first = publish_final_checkpoint(stage_final_checkpoint(root, _Algo(b"run-a")), root, "a" * 32, "name-a")
    second = publish_final_checkpoint(stage_final_checkpoint(root, _Algo(b"run-b")), root, "b" * 32, "name-b")
    assert (first, second) == (tmp_path / "ckpt" / ("a" * 32) / "final", tmp_path / "ckpt" / ("b" * 32) / "final")
    assert _payload(first) == b"run-a" and _payload(second) == b"run-b"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["a" * 32, "b" * 32]  # no staging left


def test_a_resumed_run_that_ends_again_replaces_its_own_final_and_no_other(tmp_path):
    root = str(tmp_path / "ckpt")
    publish_final_checkpoint(stage_final_checkpoint(root, _Algo(b"first end")), root, "r" * 32, "n")
    (tmp_path / "ckpt" / ("r" * 32) / "ckpt-00000003-x").mkdir()  # a resumable version beside it
    again = publish_final_checkpoint(stage_final_checkpoint(root, _Algo(b"second end")), root, "r" * 32, "n")
    assert _payload(again) == b"second end"
    assert sorted(p.name for p in (tmp_path / "ckpt" / ("r" * 32)).iterdir()) == ["ckpt-00000003-x", "final"]


def test_two_offline_runs_of_one_name_keep_both_checkpoints_and_say_where(tmp_path, monkeypatch, capsys):
    """``gradmon-ray train --run-name same`` twice, MLflow never taking either run (``offline_ok``; the
    training itself is a stand-in that stages and publishes a payload as ``run_training`` does): each
    run's last line names its own end-of-run checkpoint, and each holds its own payload."""
    import gradmon_ray.app.train.run
    import gradmon_ray.rllib.preflight
    from gradmon_ray.app.cli import main
    from gradmon_ray.app.train.run import TrainingOutcome

    monkeypatch.chdir(tmp_path)
    payloads = iter([b"first offline run", b"second offline run"])

    def offline_run(cfg, progress=None, checked=False):
        staged = stage_final_checkpoint(cfg.checkpoint_dir, _Algo(next(payloads)))
        final = publish_final_checkpoint(staged, cfg.checkpoint_dir, None, cfg.mlflow.run_name)
        return TrainingOutcome(run_id=None, iterations_done=1, checkpoint_path=str(final), spill_path="s.jsonl")

    monkeypatch.setattr(gradmon_ray.app.train.run, "run_training", offline_run)
    # the env and model checks (test_up_front_checks' subject) build the model: 1.5 s a run here
    monkeypatch.setattr(gradmon_ray.rllib.preflight, "preflight", lambda cfg: None)
    finals = []
    for _ in range(2):
        argv = ["train", "--iterations", "1", "--run-name", "same", "--checkpoint-dir", "ckpt"]
        assert main([*argv, "--mlflow-uri", f"sqlite:///{tmp_path / 'm.db'}"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert "never took the run; replay it with: gradmon-ray replay s.jsonl; checkpoint " in last, last
        finals.append(Path(last.rsplit("; checkpoint ", 1)[1]))
    first, second = finals
    assert first != second and first.parent.parent == second.parent.parent == tmp_path / "ckpt"
    assert first.parent.name.startswith("unnamed-same-") and second.parent.name.startswith("unnamed-same-")
    assert (_payload(first), _payload(second)) == (b"first offline run", b"second offline run")
