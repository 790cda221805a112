"""Reward-variance buckets over groups of episodes (seed 004, RAGEN).

A *group* is the set of episodes sharing a ``group_id`` (the same task).  Its reward std is
the population standard deviation of the episode returns in the group; a group with a
single episode uses the std of that episode's per-step rewards instead (there is no spread
of returns to measure), so every group has a number.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

from gradmon_ray import metric_names as mn


def split_into_buckets(reward_std: Sequence[float], num_buckets: int) -> list[list[int]]:
    """Group indices per bucket, ascending reward std (``bucket_1`` = lowest variance).

    Each bucket gets ``len(reward_std) // num_buckets`` groups; the remainder goes to the
    LAST (highest-variance) bucket, so the early buckets have equal sizes.  Ties keep the
    groups' original order (stable sort).  Raises ``ValueError`` when ``num_buckets < 1``,
    when there are fewer groups than buckets, or when a std is NaN.
    """
    if num_buckets < 1:
        raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
    n = len(reward_std)
    if n < num_buckets:
        raise ValueError(f"need at least as many groups as buckets: {n} groups for {num_buckets} buckets")
    if any(math.isnan(float(s)) for s in reward_std):
        raise ValueError("reward_std contains NaN")
    order = sorted(range(n), key=lambda i: float(reward_std[i]))  # sorted() is stable
    size = n // num_buckets
    buckets = [order[b * size : (b + 1) * size] for b in range(num_buckets - 1)]
    buckets.append(order[(num_buckets - 1) * size :])
    return buckets


def bucket_names(num_buckets: int) -> list[str]:
    """``["bucket_1", ..., "bucket_K"]``, low to high reward variance (``metric_names.probe_bucket``)."""
    return [mn.probe_bucket(i + 1) for i in range(num_buckets)]


def group_reward_stds(
    group_ids: Sequence[Hashable],
    episode_returns: Sequence[float],
    episode_step_rewards: Sequence[Sequence[float]],
) -> tuple[list[Hashable], list[float]]:
    """``(groups, stds)``: each group in first-seen order and its reward std (see module doc)."""
    if not len(group_ids) == len(episode_returns) == len(episode_step_rewards):
        raise ValueError("group_ids, episode_returns and episode_step_rewards must have one entry per episode")
    members: dict[Hashable, list[int]] = {}
    for i, gid in enumerate(group_ids):
        members.setdefault(gid, []).append(i)
    stds = []
    for idx in members.values():
        if len(idx) == 1:
            steps = np.asarray(episode_step_rewards[idx[0]], dtype=np.float64)
            stds.append(float(steps.std()) if steps.size else 0.0)
        else:
            stds.append(float(np.asarray([episode_returns[i] for i in idx], dtype=np.float64).std()))
    return list(members), stds
