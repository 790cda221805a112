"""One probe: bucket a postprocessed batch's episode groups by reward std, analyse each bucket.

Pure torch + numpy (no Ray, no MLflow): the ``GradientProbe`` actor calls ``analyse_batch``
and logs what it returns; tests call it directly.

Episodes are rebuilt from the learner connector's columns: ``gradmon_episode`` (the episode
chunk's index in the batch), ``gradmon_group_id`` (-1: no group, the episode is its own
group), ``rewards`` and ``loss_mask`` (RLlib's extra bootstrap timestep is masked out and
counts for nothing).  A chunk cut by the batch boundary counts as an episode with the
return it has in this batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import tree  # dm-tree, an RLlib dependency: the actions column is nested for Dict spaces
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.losses.regularizers import RegularizerSpec
from gradmon_ray.probe.client import LossSettings
from gradmon_ray.probe.components import component_gradients
from gradmon_ray.probe.connectors import EPISODE_COLUMN, GROUP_ID_COLUMN, NO_GROUP
from gradmon_ray.telemetry.buckets import bucket_names, group_reward_stds, split_into_buckets

__all__ = ["EpisodeTable", "LossSettings", "TooFewGroupsError", "analyse_batch", "episodes_from_batch"]


@dataclass
class EpisodeTable:
    """The batch's episodes: group key, undiscounted return, per-step rewards and row indices."""

    group_keys: list[Hashable]
    returns: list[float]
    step_rewards: list[np.ndarray]
    rows: list[np.ndarray]
    """All rows of the episode (masked ones included: the loss needs the same layout)."""
    valid_steps: list[int]


class TooFewGroupsError(ValueError):
    """The batch has fewer groups than buckets: this iteration cannot be bucketed."""


def episodes_from_batch(batch: Mapping[str, Any]) -> EpisodeTable:
    """Rebuild the episodes of ``batch`` (numpy columns) in order of first appearance."""
    for column in (EPISODE_COLUMN, GROUP_ID_COLUMN, Columns.REWARDS):
        if column not in batch:
            raise KeyError(
                f"the probe needs the {column!r} column; build the config with gradmon_ray.rllib.build_ppo_config "
                "(its learner connector adds the group and episode columns)"
            )
    episode = np.asarray(batch[EPISODE_COLUMN]).reshape(-1)
    group = np.asarray(batch[GROUP_ID_COLUMN]).reshape(-1)
    rewards = np.asarray(batch[Columns.REWARDS], dtype=np.float64).reshape(-1)
    mask = batch.get(Columns.LOSS_MASK)
    valid = np.ones_like(episode, dtype=bool) if mask is None else np.asarray(mask, dtype=bool).reshape(-1)
    _, first = np.unique(episode, return_index=True)
    table = EpisodeTable([], [], [], [], [])
    for start in np.sort(first):
        index = int(episode[start])
        rows = np.flatnonzero(episode == index)
        steps = rewards[rows[valid[rows]]]
        gid = int(group[start])
        # An episode without a group id is a group of its own (keyed apart from every real id).
        table.group_keys.append(("episode", index) if gid == NO_GROUP else gid)
        table.returns.append(float(steps.sum()))
        table.step_rewards.append(steps)
        table.rows.append(rows)
        table.valid_steps.append(int(steps.size))
    return table


def _take(batch: Mapping[str, Any], rows: np.ndarray, device: torch.device) -> dict[str, Any]:
    def take(column: Any) -> Any:
        return torch.as_tensor(np.asarray(column)[rows], device=device)

    return {key: tree.map_structure(take, value) for key, value in batch.items()}


def analyse_batch(
    module: torch.nn.Module,
    batch: Mapping[str, Any],
    *,
    num_buckets: int,
    loss: LossSettings,
    regularizers: Sequence[RegularizerSpec] = (),
) -> dict[str, float]:
    """Every probe metric of one batch, named as in ``metric_names`` (``PROBE_*``).

    Raises ``TooFewGroupsError`` when the batch has fewer groups than ``num_buckets``.
    The module's parameters, gradients and any optimizer are left untouched
    (``component_gradients`` only calls ``torch.autograd.grad``).
    """
    table = episodes_from_batch(batch)
    groups, stds = group_reward_stds(table.group_keys, table.returns, table.step_rewards)
    try:
        buckets = split_into_buckets(stds, num_buckets)
    except ValueError as exc:
        raise TooFewGroupsError(str(exc)) from None
    device = next(module.parameters()).device
    metrics = {mn.PROBE_NUM_BUCKETS: float(num_buckets), mn.PROBE_NUM_GROUPS_TOTAL: float(len(groups))}
    for name, members in zip(bucket_names(num_buckets), buckets, strict=True):
        chosen = {groups[i] for i in members}
        episodes = [e for e, key in enumerate(table.group_keys) if key in chosen]
        rows = np.sort(np.concatenate([table.rows[e] for e in episodes]))
        steps = sum(table.valid_steps[e] for e in episodes)
        report = component_gradients(module, _take(batch, rows, device), regularizers=regularizers, **asdict(loss))
        metrics.update(_bucket_metrics(name, report, len(episodes), steps))
        metrics[mn.probe_metric(mn.PROBE_REWARD_STD_MEAN, name)] = float(np.mean([stds[i] for i in members]))
        metrics[mn.probe_metric(mn.PROBE_NUM_GROUPS, name)] = float(len(members))
    return metrics


def _bucket_metrics(bucket: str, report: Any, episodes: int, steps: int) -> dict[str, float]:
    out: dict[str, float] = {
        mn.probe_metric(mn.PROBE_NUM_EPISODES, bucket): float(episodes),
        mn.probe_metric(mn.PROBE_NUM_STEPS, bucket): float(steps),
    }
    norms = dict(report.norms)
    for key, value in report.regularizers.items():
        if key.endswith("_grad_norm") and key != "total_grad_norm":
            norms[key.removesuffix("_grad_norm")] = value
    for component, norm in norms.items():
        out[mn.probe_metric(mn.PROBE_COMPONENT_NORM, bucket, component=component)] = norm
        out[mn.probe_metric(mn.PROBE_PER_SAMPLE_NORM, bucket, component=component)] = norm / max(episodes, 1)
        out[mn.probe_metric(mn.PROBE_PER_TOKEN_NORM, bucket, component=component)] = norm / max(steps, 1)
    for loss_name, value in report.losses.items():
        out[mn.probe_metric(mn.PROBE_LOSS, bucket, loss=loss_name)] = value
    for component, heads in report.per_head.items():
        for head, norm in heads.items():
            out[mn.probe_metric(mn.PROBE_HEAD_NORM, bucket, head=head, component=component)] = norm
    for component, share in report.shares.items():
        out[mn.probe_metric(mn.PROBE_SHARE, bucket, component=component)] = share
    for pair, cosine in report.cosines.items():
        out[mn.probe_metric(mn.PROBE_COSINE, bucket, pair=pair)] = cosine
    for key, value in report.regularizers.items():
        out[_regularizer_metric(bucket, key)] = value
    return out


def _regularizer_metric(bucket: str, key: str) -> str:
    """ADR-009's key (``<name>_grad_norm``, ``<name>_grad_norm_error``, ``<name>_share``,
    ``total_grad_norm``) as a probe metric name."""
    if key == "total_grad_norm":
        return mn.probe_metric(mn.PROBE_REGULARIZER_TOTAL, bucket)
    for suffix, template in (
        ("_grad_norm_error", mn.PROBE_REGULARIZER_ERROR),
        ("_grad_norm", mn.PROBE_REGULARIZER_GRAD_NORM),
        ("_share", mn.PROBE_REGULARIZER_SHARE),
    ):
        if key.endswith(suffix):
            return mn.probe_metric(template, bucket, regularizer=key.removesuffix(suffix))
    raise ValueError(f"unexpected regularizer key {key!r}")
