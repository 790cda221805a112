"""The README's Tuner example as a user's script of its own: ``python -m tests.e2e.readme_tuner_script
TUNE_DIR RESULT_JSON``, run from the user's directory.  Tune starts a local Ray of its own (the one
the README's user gets), so the trial actors inherit exactly this process's environment.

CI-sized (the README's 2 iterations, small batches, sampled in the trial), into ``TUNE_DIR``; the
trial's output kept in its working directory under Ray's session directory (``log_to_file``).
Writes each trial's directory name and its last result as Tune kept it (``result_to_metrics``, the
oracle of what MLflow holds at its last step) to ``RESULT_JSON``, prints ``trials: <iterations>...``
and exits 0 when every trial terminated without error.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
USER_CONFIG = 'PPOConfig().environment("CartPole-v1")'
RUN_CONFIG = 'tune.RunConfig(stop={"training_iteration": 2})'
ONE_ENV_RUNNER = "num_env_runners=1"
"""What the README's Tuner example asks for; the tests sample in the trial instead (the block as
written, its EnvRunner and its 2 CPUs, runs in tests/e2e/test_doc_commands_e2e.py)."""


def readme_tuner_example() -> str:
    """The README's ``<!-- readme:tuner -->`` python block (here, not in a test module: this script
    imports only what the block does)."""
    match = re.search(r"<!-- readme:tuner -->\s*```python\n(.+?)\n```", README.read_text(encoding="utf-8"), re.S)
    assert match, "README.md has no <!-- readme:tuner --> python block"
    return match.group(1)


def script(tune_dir: str) -> str:
    code = readme_tuner_example()
    edits = {
        USER_CONFIG: USER_CONFIG + ".training(train_batch_size=128, minibatch_size=64, num_epochs=1)",
        ONE_ENV_RUNNER: "num_env_runners=0",
        RUN_CONFIG: RUN_CONFIG[:-1] + f", storage_path={tune_dir!r}, verbose=0, log_to_file=True)",
        "\ntune.Tuner(": "\ngrid = tune.Tuner(",
    }
    for old, new in edits.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    return code


def main(tune_dir: str, result_json: str) -> None:
    from gradmon_ray.tracking.result_metrics import result_to_metrics

    namespace: dict = {}
    exec(compile(script(tune_dir), "README.md", "exec"), namespace)
    grid = namespace["grid"]
    trials = [{"dir": Path(r.path).name, "metrics": result_to_metrics(r.metrics)} for r in grid]
    Path(result_json).write_text(json.dumps(trials))  # NaN and +-Inf as JSON's extensions: read back alike
    done = " ".join(str(r.metrics.get("training_iteration")) for r in grid)
    sys.stdout.write(f"\ntrials: {done}\n")  # one write: Ray's forwarded trial output shares this stream
    sys.stdout.flush()
    sys.exit(1 if grid.errors else 0)


if __name__ == "__main__":
    main(*sys.argv[1:])
