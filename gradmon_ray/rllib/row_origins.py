"""``RowOrigins``: where each row of a module's train batch came from (episode, agent, timestep).

RLlib's train batch has no episode id or timestep column (``BatchIndividualItems`` keeps the
episode-to-rows map in the connector's ``shared_data``, which the learner drops).  This learner
connector piece runs just before it and records, per module, the episodes in the order their rows
were added (``single_agent_episode_iterator``, as ``AddColumnsFromEpisodesToTrainBatch`` adds
them): a row index of the train batch maps back to its episode, agent and timestep.  Host-side
Python over the episodes, once per update; nothing enters the batch (an extra column would be
sliced on every minibatch).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Any

from ray.rllib.connectors.common.batch_individual_items import BatchIndividualItems
from ray.rllib.connectors.connector_v2 import ConnectorV2
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils.annotations import override

_SUFFIXED = re.compile(r"^([0-9a-f]{32})_\d+$")
"""RLlib's episode id (a uuid4 hex) with the ``_<index>`` PPO's ``AddOneTsToEpisodesAndTruncate``
appends in place before this piece runs: the id the EnvRunner gave the episode is the part before."""


@dataclass(frozen=True)
class EpisodeRows:
    """One single-agent episode's run of rows in a module's train batch."""

    episode_id: str
    agent_id: str | None
    t_started: int
    start: int
    """Its first row in the module's train batch."""
    length: int


class RowOrigins(ConnectorV2):
    """Records, per module, which episode rows of the train batch came from (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last: dict[str, list[EpisodeRows]] = {}

    @override(ConnectorV2)
    def __call__(self, *, rl_module: Any, batch: Any, episodes: list[Any], **kwargs: Any) -> Any:
        runs: dict[str, list[EpisodeRows]] = {}
        for episode in self.single_agent_episode_iterator(episodes, agents_that_stepped_only=False):
            module_id = str(episode.module_id if episode.module_id is not None else DEFAULT_MODULE_ID)
            rows = runs.setdefault(module_id, [])
            start = rows[-1].start + rows[-1].length if rows else 0
            agent = None if episode.agent_id is None else str(episode.agent_id)
            ma_id = getattr(episode, "multi_agent_episode_id", None)
            episode_id = _SUFFIXED.sub(r"\1", str(ma_id or episode.id_))
            rows.append(EpisodeRows(episode_id, agent, int(episode.t_started), start, len(episode)))
        self.last = runs
        return batch

    def origin(self, module_id: Any, row: int) -> dict[str, Any] | None:
        """``{"episode_id", "agent_id", "t", "row"}`` of row ``row`` of the last train batch (None: unknown)."""
        runs = self.last.get(str(module_id))
        if not runs or row < 0 or row >= runs[-1].start + runs[-1].length:
            return None
        run = runs[bisect.bisect_right([r.start for r in runs], row) - 1]
        return {
            "episode_id": run.episode_id,
            "agent_id": run.agent_id,
            "t": run.t_started + row - run.start,
            "row": row,
        }

    def rows(self, module_id: Any) -> int:
        """Rows recorded for ``module_id`` in the last train batch."""
        runs = self.last.get(str(module_id))
        return runs[-1].start + runs[-1].length if runs else 0


def install_row_origins(pipeline: Any) -> RowOrigins | None:
    """Put a ``RowOrigins`` just before the pipeline's ``BatchIndividualItems`` (None: there is none)."""
    if pipeline is None:
        return None
    for piece in getattr(pipeline, "connectors", []):
        if isinstance(piece, RowOrigins):
            return piece
    if not any(isinstance(piece, BatchIndividualItems) for piece in pipeline.connectors):
        return None
    origins = RowOrigins()
    pipeline.insert_before(BatchIndividualItems, origins)
    return origins
