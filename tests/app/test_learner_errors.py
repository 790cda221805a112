"""The CLI's line for a run that gradmon's learners stopped (learners that disagree, a collective that timed
out, replicas that diverged): the learner's own one-line message, whole, out of Ray's ``RayTaskError``.

Before, the line was Ray's traceback text cut in the middle ("RayTaskError(LearnerDisagreementError):
ray::_WrappedExecutable.apply() (pid=...) ... modules added in different orders ...")."""

from __future__ import annotations

import pytest
from ray.exceptions import RayTaskError

from gradmon_ray.app import cli
from gradmon_ray.distributed.agreement import CollectiveTimeoutError, LearnerDisagreementError
from gradmon_ray.distributed.replica_checksum import ReplicaDivergenceError

DISAGREE = (
    "gradmon: the learners disagree on the modules they average, update 3: learner 0 lacks ['p2'] (2 modules, 24 "
    "parameter tensors); learner 1 (this one): 3 modules ['p0', 'p1', 'p2'], 36 parameter tensors; a module was "
    "added or removed on some learners only (Algorithm.add_module/remove_module reach all)"
)


def _as_ray_raises_it(error: Exception) -> Exception:
    """What the driver gets from a learner actor that raised ``error``: Ray's dual-class ``RayTaskError``,
    whose text is the remote traceback (``as_instanceof_cause``), raised from a real frame."""
    try:
        raise error
    except Exception as exc:
        import traceback

        wrapped = RayTaskError("_WrappedExecutable.apply", traceback.format_exc(), exc)
    return wrapped.as_instanceof_cause()


@pytest.mark.parametrize(
    ("error", "name"),
    [
        (LearnerDisagreementError(DISAGREE), "LearnerDisagreementError"),
        (
            CollectiveTimeoutError("gradmon: learner 1 of 2 waited 300 s for the presence exchange"),
            "CollectiveTimeoutError",
        ),
        (ReplicaDivergenceError("learner replicas hold different parameters at step 4"), "ReplicaDivergenceError"),
    ],
)
def test_a_learners_own_error_is_printed_whole_out_of_rays_wrapper(error, name, monkeypatch, capsys, tmp_path):
    remote = _as_ray_raises_it(error)
    assert not str(remote).startswith(str(error)) and "(pid=" in str(remote)  # the premise: Ray's text first

    def fail(args):
        raise remote

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "train_command", fail)
    assert cli.main(["train"]) == cli.EXIT_FAILED
    assert capsys.readouterr().err == f"gradmon-ray: run failed: {name}: {error}\n"


def test_any_other_learner_error_keeps_the_short_line_and_the_hint(monkeypatch, capsys, tmp_path):
    remote = _as_ray_raises_it(ValueError("something else"))

    def fail(args):
        raise remote

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli, "train_command", fail)
    assert cli.main(["train"]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("gradmon-ray: run failed: RayTaskError(ValueError): ") and err.endswith("traceback)\n")
    assert len(err) <= 301
