"""Optimizers offered beside Adam."""

from gradmon_ray.optim.upgd import UPGD

__all__ = ["UPGD"]
