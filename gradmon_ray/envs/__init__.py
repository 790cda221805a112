"""The built-in multi-head environment and its registration."""

from gradmon_ray.envs.factored_ops import HEAD_NAMES, HEAD_SIZES, FactoredOpsEnv

BUILTIN_ENV_ID = "gradmon/FactoredOps-v0"
"""Name under which ``FactoredOpsEnv`` is registered with Gymnasium and Ray Tune."""


def register_builtin_env() -> None:
    """Register ``FactoredOpsEnv`` with Gymnasium and with Ray Tune's env registry."""
    import gymnasium as gym
    from ray.tune.registry import register_env

    if BUILTIN_ENV_ID not in gym.registry:
        gym.register(BUILTIN_ENV_ID, entry_point=FactoredOpsEnv)
    register_env(BUILTIN_ENV_ID, lambda cfg: FactoredOpsEnv(dict(cfg)))


__all__ = ["BUILTIN_ENV_ID", "HEAD_NAMES", "HEAD_SIZES", "FactoredOpsEnv", "register_builtin_env"]
