"""RLlib's checkpoint of a run's end (for ``restore_from``): ``<checkpoint_dir>/<run id>/final``.

In the run's own directory, beside its resumable versions, so runs sharing a root never overwrite
each other's.  The run id may not exist yet when training ends (MLflow creates the run on the
sink's thread), so the checkpoint is saved into a hidden staging directory under the root first
and moved into place once the sink has closed, when the id is known.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

FINAL = "final"
"""The name of a run's end-of-run RLlib checkpoint in its directory."""


def final_checkpoint_dir(checkpoint_dir: str, run_id: str | None, run_name: str | None) -> Path:
    """``<checkpoint_dir>/<run id>/final``; when MLflow never created the run,
    ``unnamed-<run name>-<UTC time>-<6 random hex digits>``: two offline runs of one name (a config's
    ``mlflow.run_name``) never share it, and the CLI's last line says which it is."""
    if run_id is None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in (run_name or "run"))
        run_id = f"unnamed-{safe}-{stamp}-{os.urandom(3).hex()}"
    return Path(os.path.abspath(checkpoint_dir)) / run_id / FINAL


def stage_final_checkpoint(checkpoint_dir: str, algo: Any) -> Path:
    """Save ``algo`` into a hidden staging directory under the root; ``publish_final_checkpoint`` moves it."""
    staging = Path(os.path.abspath(checkpoint_dir)) / f".final-{os.getpid()}-{time.time_ns():x}"
    algo.save_to_path(str(staging))
    return staging


def publish_final_checkpoint(staging: Path, checkpoint_dir: str, run_id: str | None, run_name: str | None) -> Path:
    """Move the staged checkpoint to ``final_checkpoint_dir`` (a resumed run's earlier ``final`` replaced)."""
    target = final_checkpoint_dir(checkpoint_dir, run_id, run_name)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # the same run ended before (it was resumed): its newer end wins
        shutil.rmtree(target)
    os.rename(staging, target)
    return target
