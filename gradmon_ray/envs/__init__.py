"""The built-in multi-head environment and its registration."""

from gradmon_ray.envs.factored_ops import HEAD_NAMES, HEAD_SIZES, FactoredOpsEnv

BUILTIN_ENV_ID = "gradmon/FactoredOps-v0"
"""Name under which ``FactoredOpsEnv`` is registered with Gymnasium and Ray Tune."""
BUILTIN_MULTI_AGENT_ENV_ID = "gradmon/FactoredOpsMultiAgent-v0"
"""Name under which ``FactoredOpsMultiAgentEnv`` (two agents by default) is registered with Ray Tune."""
BUILTIN_ENV_IDS = (BUILTIN_ENV_ID, BUILTIN_MULTI_AGENT_ENV_ID)


def register_builtin_env() -> None:
    """Register ``FactoredOpsEnv`` with Gymnasium and Ray Tune's env registry, and
    ``FactoredOpsMultiAgentEnv`` with Ray Tune's (RLlib's multi-agent envs are not Gymnasium envs)."""
    import gymnasium as gym
    from ray.tune.registry import register_env

    from gradmon_ray.envs.factored_ops_multi import FactoredOpsMultiAgentEnv  # imports RLlib: only here
    from gradmon_ray.envs.tune_registry import tune_registry_follows_this_job

    if BUILTIN_ENV_ID not in gym.registry:
        gym.register(BUILTIN_ENV_ID, entry_point=FactoredOpsEnv)
    tune_registry_follows_this_job()  # else, after an earlier Ray job in this process, its workers see no env
    register_env(BUILTIN_ENV_ID, lambda cfg: FactoredOpsEnv(dict(cfg)))
    register_env(BUILTIN_MULTI_AGENT_ENV_ID, lambda cfg: FactoredOpsMultiAgentEnv(dict(cfg)))


__all__ = [
    "BUILTIN_ENV_ID",
    "BUILTIN_ENV_IDS",
    "BUILTIN_MULTI_AGENT_ENV_ID",
    "HEAD_NAMES",
    "HEAD_SIZES",
    "FactoredOpsEnv",
    "register_builtin_env",
]
