"""The health-band sections of a run config (``telemetry.bands``): frozen, strictly increasing edges."""

from __future__ import annotations

import itertools

from pydantic import ConfigDict, Field, model_validator

from gradmon_ray.config.base import ConfigError, ConfigModel


class BandEdges(ConfigModel):
    """Health band edges: each positive, finite and strictly increasing."""

    model_config = ConfigDict(frozen=True)

    @model_validator(mode="after")
    def _edges_strictly_increase(self) -> BandEdges:
        names = list(type(self).model_fields)
        for lower, name in itertools.pairwise(names):
            value, below = getattr(self, name), getattr(self, lower)
            if not value > below:
                raise ConfigError(name, f"must be > {lower} ({below!r}; edges strictly increase), got {value!r}")
        return self


_EDGE_DOCS = {
    "dead_below": "Below this a head is dead.",
    "weak_below": "Below this (and >= dead_below) a head is weak.",
    "healthy_max": "Up to this (and >= weak_below) a head is healthy.",
    "elevated_max": "Up to this (and > healthy_max) a head is elevated; above it, exploding.",
}


def _edge(default: float, name: str) -> float:
    return Field(default, gt=0.0, description=_EDGE_DOCS[name])


class ActionBandsSection(BandEdges):
    """Health band edges of the action heads' gradient norms (TELE-320: 10 x the 0.5 clip norm explodes)."""

    dead_below: float = _edge(0.01, "dead_below")
    weak_below: float = _edge(0.1, "weak_below")
    healthy_max: float = _edge(2.0, "healthy_max")
    elevated_max: float = _edge(5.0, "elevated_max")


class ValueBandsSection(BandEdges):
    """Health band edges of the value head's gradient norm (a squared-error critic runs larger)."""

    dead_below: float = _edge(0.01, "dead_below")
    weak_below: float = _edge(0.1, "weak_below")
    healthy_max: float = _edge(10.0, "healthy_max")
    elevated_max: float = _edge(50.0, "elevated_max")


class CollapseSection(ConfigModel):
    """Entropy collapse of an action-distribution head (``latch/collapse/<head>``): the head's
    normalised entropy (entropy / log(number of actions), 1 = uniform, 0 = one action) stayed
    below ``threshold`` for ``iterations`` consecutive training iterations.  The latch never resets."""

    model_config = ConfigDict(frozen=True)

    threshold: float = Field(
        0.05,
        ge=0.0,
        description="Normalised entropy below which a head counts as collapsed this iteration (0: the latch is off).",
    )
    iterations: int = Field(
        5, ge=1, description="Consecutive iterations below the threshold before the collapse latch fires."
    )


class UpdateRatioSection(ConfigModel):
    """Where ``grad/head/<head>/update_ratio`` divided by the iteration's minibatch updates should lie:
    CS231n's rule of thumb is about 1e-3 an update (Karpathy); below ``low`` the head barely learns,
    above ``high`` it moves too fast."""

    model_config = ConfigDict(frozen=True)

    low: float = Field(1e-4, ge=0.0, description="Below this ratio an update, update_band is -1.")
    high: float = Field(1e-2, gt=0.0, description="Above this ratio an update, update_band is 1.")

    @model_validator(mode="after")
    def _ordered(self) -> UpdateRatioSection:
        if not self.low < self.high:
            raise ValueError(f"update_ratio: low ({self.low}) must be below high ({self.high})")
        return self


class BandsSection(ConfigModel):
    """Health band edges: dead < dead_below <= weak < weak_below <= healthy <= healthy_max < elevated
    <= elevated_max < exploding.  Each set must be positive, finite and strictly increasing.  ``collapse``:
    when a head's policy entropy counts as collapsed."""

    model_config = ConfigDict(frozen=True)

    action: ActionBandsSection = Field(default_factory=ActionBandsSection, description="The action heads' edges.")
    value: ValueBandsSection = Field(default_factory=ValueBandsSection, description="The value head's edges.")
    collapse: CollapseSection = Field(
        default_factory=CollapseSection, description="The per-head entropy collapse latch (latch/collapse/<head>)."
    )
    update_ratio: UpdateRatioSection = Field(
        default_factory=UpdateRatioSection,
        description="The update-to-weight ratio per update a learning head is expected in "
        "(grad/head/<head>/update_band).",
    )
