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


def test_a_run_mlflow_never_created_keeps_its_checkpoint_under_its_name(tmp_path):
    root = str(tmp_path / "ckpt")
    final = publish_final_checkpoint(stage_final_checkpoint(root, _Algo(b"offline")), root, None, "my-run")
    assert final == tmp_path / "ckpt" / "unnamed-my-run" / "final" and _payload(final) == b"offline"
