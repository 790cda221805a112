"""Regularizers that make a probe actor busy or slow to restart, for ``test_actor.py`` (not a test module).

The probe actor resolves its regularizers in ``__init__``, so this module is imported at every
start of an actor that uses one of them.  In a *restarted* actor (Ray's
``was_current_actor_reconstructed``) the import lasts ``RESTART_DELAY_S``: a window in which the
actor is restarting that a test can hit deterministically.  A first start is not slowed (it is
not what the tests wait for).
"""

from __future__ import annotations

import time

RESTART_DELAY_S = 2.0
"""Lower bound of a restart: the client sees the failure and resends within ~0.1 s of the death."""
FIRST_INCARNATION_CALL_S = 5.0
"""``logit_l2``'s sleep per call before any restart: a kill 0.3 s into a probe lands inside it, and
the kill cuts it short (no test waits it out)."""
BUSY_CALL_S = 0.2
"""``busy_logit_l2``'s sleep per call: a 5-bucket probe is busy for >= 1 s, against the tests'
0.2 s give-up and their immediate ``reserve`` calls."""


def _reconstructed() -> bool:
    try:
        import ray

        return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # not in an actor (an import on the driver): never slowed
        return False


RECONSTRUCTED = _reconstructed()
if RECONSTRUCTED:
    time.sleep(RESTART_DELAY_S)


def logit_l2(module, batch, fwd_out):
    """The built-in ``logit_l2``; in an actor's first incarnation it sleeps first, so the actor is
    killed mid-probe, and in a restarted one it answers at once."""
    if not RECONSTRUCTED:
        time.sleep(FIRST_INCARNATION_CALL_S)
    return fwd_out["action_dist_inputs"].pow(2).mean()


def busy_logit_l2(module, batch, fwd_out):
    """The built-in ``logit_l2`` after ``BUSY_CALL_S`` (once per bucket): keeps the probe busy."""
    time.sleep(BUSY_CALL_S)
    return fwd_out["action_dist_inputs"].pow(2).mean()
