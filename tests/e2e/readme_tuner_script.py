"""The README's Tuner example as a user's script of its own: ``python -m tests.e2e.readme_tuner_script
TUNE_DIR``, run from the user's directory.  Tune starts a local Ray of its own (the one the README's
user gets), so the trial actors inherit exactly this process's environment.

CI-sized (one iteration, small batches, sampled in the trial), into ``TUNE_DIR``.  Prints
``trials: <status>...`` and exits 0 when every trial terminated without error.
"""

from __future__ import annotations

import sys

from tests.tracking.test_callback import readme_tuner_example


def script(tune_dir: str) -> str:
    code = readme_tuner_example()
    edits = {
        'PPOConfig().environment("CartPole-v1")': 'PPOConfig().environment("CartPole-v1")'
        ".training(train_batch_size=128, minibatch_size=64, num_epochs=1)",
        "num_env_runners=1": "num_env_runners=0",
        'tune.RunConfig(stop={"training_iteration": 2})': 'tune.RunConfig(stop={"training_iteration": 1}, '
        f"storage_path={tune_dir!r}, verbose=0)",
        "\ntune.Tuner(": "\ngrid = tune.Tuner(",
    }
    for old, new in edits.items():
        assert code.count(old) == 1, old
        code = code.replace(old, new)
    return code


def main(tune_dir: str) -> None:
    namespace: dict = {}
    exec(compile(script(tune_dir), "README.md", "exec"), namespace)
    grid = namespace["grid"]
    done = " ".join(str(r.metrics.get("training_iteration")) for r in grid)
    sys.stdout.write(f"\ntrials: {done}\n")  # one write: Ray's forwarded trial output shares this stream
    sys.stdout.flush()
    sys.exit(1 if grid.errors else 0)


if __name__ == "__main__":
    main(*sys.argv[1:])
