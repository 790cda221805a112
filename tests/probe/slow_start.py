"""A regularizer whose module takes 3 s to import: a probe actor that uses it (re)starts slowly.

The probe actor resolves its regularizers in ``__init__``, so every start of such an actor,
and every restart by Ray, lasts at least this long: a window in which the actor is
restarting that a test can hit deterministically.
"""

from __future__ import annotations

import time

IMPORT_DELAY_S = 3.0

time.sleep(IMPORT_DELAY_S)


def logit_l2(module, batch, fwd_out):
    """Same as the built-in ``logit_l2``."""
    return fwd_out["action_dist_inputs"].pow(2).mean()
