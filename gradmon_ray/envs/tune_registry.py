"""Ray Tune's env registry on this driver's current Ray job, after every ``ray.init``.

The registry keys every entry by a job id it reads once per process and keeps: after
``ray.shutdown()`` and a new ``ray.init()`` against the same cluster (a second run from one
notebook or test process), it still writes under the first job's id, and the new job's EnvRunners
find no registered env (RLlib falls back to ``gym.make``: "Namespace gradmon not found", and
building the algorithm fails with an ``IndexError`` in ``EnvRunnerGroup.get_spaces``).
``tune_registry_follows_this_job`` sets the id now and puts ``follow_the_new_job`` first among
Ray's post-``ray.init`` hooks (where Tune's own flush of the entries queued before ``ray.init``
runs), so entries anyone registers after a reconnect land in the new job too.  (Ray client,
``ray://``, runs no post-init hooks; an earlier job's entries stay in the cluster's key-value
store, as Tune leaves them.)  The private names it needs: ``compat.set_tune_registry_job``,
``compat.add_first_post_init_hook``.
"""

from __future__ import annotations

from gradmon_ray import compat


def tune_registry_follows_this_job() -> None:
    """Make Ray Tune's registry (envs, trainables) write under this driver's current Ray job, now
    and after every later ``ray.init`` in this process (see the module docstring)."""
    import ray.tune.registry  # noqa: F401  (Tune's registry exists before the hook goes in)

    compat.add_first_post_init_hook(follow_the_new_job)
    follow_the_new_job()


def follow_the_new_job() -> None:
    """Tune's registry on this process's current Ray job; unset (read at first use) without Ray."""
    import ray

    compat.set_tune_registry_job(ray.get_runtime_context().get_job_id() if ray.is_initialized() else None)
