"""A learner connector that tags every train-batch row with its episode's group and index.

The gradient probe groups episodes by a task id (the built-in env puts ``group_id`` in its
infos) and buckets groups by reward variance; the learner batch carries no infos, so this
piece adds two integer columns per timestep:

* ``gradmon_group_id``: the episode chunk's first ``infos[group_key]`` as an int (a
  non-integer id is hashed to int64), or -1 when the env reports none (the probe then treats
  each episode as its own group);
* ``gradmon_episode``: the index of the episode chunk within this train batch.

RLlib runs user learner connectors after PPO's ``AddOneTsToEpisodesAndTruncate``, so the
columns line up with every other column, the extra (masked) timestep included.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core.rl_module.rl_module import RLModule
from ray.rllib.utils.annotations import override

GROUP_ID_COLUMN = "gradmon_group_id"
EPISODE_COLUMN = "gradmon_episode"
NO_GROUP = -1


def _as_int(value: Any) -> int:
    if isinstance(value, bool):
        return int(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        # Stable across processes (Python's hash() is salted per process).
        return int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:8], "little", signed=True)


class AddGroupIdsToTrainBatch(ConnectorV2):
    """Adds ``gradmon_group_id`` and ``gradmon_episode`` columns (see the module docstring)."""

    def __init__(
        self,
        input_observation_space: Any = None,
        input_action_space: Any = None,
        *,
        group_key: str = "group_id",
        **kwargs: Any,
    ) -> None:
        super().__init__(input_observation_space, input_action_space, **kwargs)
        self.group_key = group_key

    @override(ConnectorV2)
    def __call__(
        self,
        *,
        rl_module: RLModule,
        batch: dict[str, Any],
        episodes: list[Any],
        explore: bool | None = None,
        shared_data: dict | None = None,
        **kwargs: Any,
    ) -> Any:
        for index, episode in enumerate(self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False)):
            n = len(episode)
            group = NO_GROUP
            if n > 0:
                infos = episode.get_infos(0)
                if isinstance(infos, dict) and self.group_key in infos:
                    group = _as_int(infos[self.group_key])
            self.add_n_batch_items(batch, GROUP_ID_COLUMN, [group] * n, num_items=n, single_agent_episode=episode)
            self.add_n_batch_items(batch, EPISODE_COLUMN, [index] * n, num_items=n, single_agent_episode=episode)
        return batch
