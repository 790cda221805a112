"""Turn a ``GradmonConfig`` into an RLlib ``PPOConfig`` on the new API stack."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env.multi_agent_env import MultiAgentEnv

from gradmon_ray.config import ConfigError, GradmonConfig
from gradmon_ray.distributed import new_group_name
from gradmon_ray.envs import BUILTIN_ENV_IDS, BUILTIN_MULTI_AGENT_ENV_ID, register_builtin_env
from gradmon_ray.probe.client import probe_actor_name
from gradmon_ray.probe.connectors import AddGroupIdsToTrainBatch
from gradmon_ray.rllib.learner import GradmonPPOTorchLearner
from gradmon_ray.rllib.module import FactoredActorCritic
from gradmon_ray.rllib.settings import LEARNER_CONFIG_KEY


def resolve_env(env_id: str) -> Any:
    """What ``PPOConfig.environment(env=...)`` takes: a registered name or a class.

    ``"package.module:ClassName"`` imports the class; anything else is passed through as a
    registered Gymnasium / Ray Tune name (the built-in env is registered here).
    """
    if env_id in BUILTIN_ENV_IDS:
        register_builtin_env()
        return env_id
    if ":" in env_id:
        module_name, _, attr = env_id.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError("env.id", f"cannot import {env_id!r}: {exc}") from None
    return env_id


def multi_agent_ids(cfg: GradmonConfig) -> list[str] | None:
    """The agent ids of ``cfg``'s env when it is an RLlib ``MultiAgentEnv`` (the built-in
    multi-agent variant or a ``package.module:Class``), else None.  Creates the env once on the
    driver to read ``possible_agents``; each agent gets its own policy, named like the agent."""
    env = resolve_env(cfg.env.id)
    if env == BUILTIN_MULTI_AGENT_ENV_ID:
        from gradmon_ray.envs.factored_ops_multi import FactoredOpsMultiAgentEnv

        env = FactoredOpsMultiAgentEnv
    if not (isinstance(env, type) and issubclass(env, MultiAgentEnv)):
        return None
    return [str(agent) for agent in env(dict(cfg.env.config)).possible_agents]


def _same_id(agent_id: Any, *args: Any, **kwargs: Any) -> str:
    """The policy mapping of a multi-agent run: each agent trains the module named like it."""
    return str(agent_id)


def _plain(value: Any) -> Any:
    """A config section as plain data through attribute access only (a dataclass or a pydantic model)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return {k: _plain(v) for k, v in vars(value).items() if not k.startswith("_")}


def build_ppo_config(cfg: GradmonConfig, *, probe_actor: str | None = None) -> PPOConfig:
    """A ``PPOConfig`` that trains ``FactoredActorCritic`` with ``GradmonPPOTorchLearner``.

    With ``probe.gradient_analysis_every > 0`` rank 0's learner looks for the GradientProbe
    actor named ``probe_actor`` (default: a fresh run-unique name; read it back with
    ``probe_actor_name_of``); whoever runs the algorithm starts that actor
    (``gradmon_ray.probe.start_probe_actor``), as ``run_training`` does.
    """
    probe = _probe_settings(cfg, probe_actor)
    config = _with_env_and_runners(PPOConfig(), cfg)
    config = _with_gradmon_learners(config, cfg, probe)
    config = _with_ppo_training(config, cfg).debugging(seed=cfg.seed)
    return _with_modules(config, cfg)


def _probe_settings(cfg: GradmonConfig, probe_actor: str | None) -> dict[str, Any]:
    """The learners' ``probe`` entry: the GradientProbe actor's name and period ({}: probe off)."""
    if cfg.probe.gradient_analysis_every <= 0:
        return {}
    probe: dict[str, Any] = {
        "actor_name": probe_actor or probe_actor_name(new_group_name()),
        "every": cfg.probe.gradient_analysis_every,
    }
    if cfg.probe.modules is not None:
        probe["modules"] = list(cfg.probe.modules)
    return probe


def _with_env_and_runners(config: PPOConfig, cfg: GradmonConfig) -> PPOConfig:
    """Torch (a non-finite minibatch skipped), the env, the EnvRunners and their restarts."""
    res = cfg.resources
    return (
        config.framework("torch", torch_skip_nan_gradients=True)  # skip a non-finite minibatch
        .environment(env=resolve_env(cfg.env.id), env_config=dict(cfg.env.config))
        .env_runners(
            num_env_runners=res.num_env_runners,
            num_envs_per_env_runner=res.num_envs_per_env_runner,
            custom_resources_per_env_runner=dict(res.custom_resources_per_env_runner),
        )
        .fault_tolerance(
            # A crashed EnvRunner is replaced and sampling goes on; the learners never notice.
            restart_failed_env_runners=True,
            max_num_env_runner_restarts=res.max_env_runner_restarts,
            delay_between_env_runner_restarts_s=res.env_runner_restart_delay_s,
        )
    )


def _with_gradmon_learners(config: PPOConfig, cfg: GradmonConfig, probe: dict[str, Any]) -> PPOConfig:
    """The learners: their number and resources, ``GradmonPPOTorchLearner``, the probe's connector
    and the ``learner_config_dict["gradmon"]`` settings."""
    res, group_key = cfg.resources, cfg.probe.group_key
    return config.learners(
        num_learners=res.num_learners,
        num_gpus_per_learner=res.num_gpus_per_learner,
        custom_resources_per_learner=dict(res.custom_resources_per_learner),
        learner_class=GradmonPPOTorchLearner,
        # Per-row group ids and episode indices, for the gradient probe's buckets.
        learner_connector=lambda obs_space, act_space: AddGroupIdsToTrainBatch(
            obs_space, act_space, group_key=group_key
        ),
        learner_config_dict={LEARNER_CONFIG_KEY: _learner_settings(cfg, probe)},
    )


def _learner_settings(cfg: GradmonConfig, probe: dict[str, Any]) -> dict[str, Any]:
    """``learner_config_dict["gradmon"]`` (read by ``GradmonSettings``) from the run config."""
    return {
        "telemetry": cfg.telemetry.enabled,
        "shared_gradients_every": cfg.telemetry.shared_gradients_every,
        "fused_optimizer": cfg.telemetry.fused_optimizer,
        "bands": _plain(cfg.telemetry.bands),  # {"action": {edges}, "value": {edges}}
        "optimizer": cfg.optimizer,
        "upgd": _plain(cfg.upgd),
        "vgs": _plain(cfg.vgs),
        "collective_group": new_group_name(),
        "collective_backend": cfg.distributed.backend,
        "reduce_telemetry": cfg.distributed.reduce_telemetry,
        "noise_scale": cfg.distributed.noise_scale,
        "noise_scale_one_learner": cfg.distributed.noise_scale_one_learner,
        "replica_check_every": cfg.distributed.replica_check_every,
        "collective_timeout_s": cfg.distributed.collective_timeout_s,
        "regularizers": [_plain(r) for r in cfg.regularizers],
        "probe": probe,
    }


def _with_ppo_training(config: PPOConfig, cfg: GradmonConfig) -> PPOConfig:
    """PPO's hyperparameters; the train batch is split evenly over the learners."""
    ppo, res = cfg.ppo, cfg.resources
    return config.training(
        lr=ppo.lr,
        gamma=ppo.gamma,
        lambda_=ppo.lambda_,
        clip_param=ppo.clip_param,
        vf_clip_param=ppo.vf_clip_param,
        vf_loss_coeff=ppo.vf_loss_coeff,
        entropy_coeff=ppo.entropy_coeff,
        use_kl_loss=ppo.use_kl_loss,
        kl_coeff=ppo.kl_coeff,
        kl_target=ppo.kl_target,
        train_batch_size_per_learner=max(1, ppo.train_batch_size // max(1, res.num_learners)),
        minibatch_size=ppo.minibatch_size,
        num_epochs=ppo.num_epochs,
        grad_clip=ppo.grad_clip,
        grad_clip_by=ppo.grad_clip_by,
    )


def _model_config(cfg: GradmonConfig) -> dict[str, Any]:
    """``FactoredActorCritic``'s ``model_config`` from the run config's ``model`` section."""
    model_config: dict[str, Any] = {
        "trunk_hiddens": list(cfg.model.trunk_hiddens),
        "head_hiddens": list(cfg.model.head_hiddens),
        "value_hiddens": list(cfg.model.value_hiddens),
        "vf_share_layers": cfg.model.vf_share_layers,
        "activation": cfg.model.activation,
        "head_logit_scale": dict(cfg.model.head_logit_scale),
    }
    if cfg.model.head_names is not None:
        model_config["head_names"] = list(cfg.model.head_names)
    return model_config


def _with_modules(config: PPOConfig, cfg: GradmonConfig) -> PPOConfig:
    """One ``FactoredActorCritic``; for a multi-agent env one per agent, each agent its own policy."""
    model_config = _model_config(cfg)
    module_spec = RLModuleSpec(module_class=FactoredActorCritic, model_config=model_config)
    agents = multi_agent_ids(cfg)
    if agents is None:
        return config.rl_module(rl_module_spec=module_spec)
    config.multi_agent(policies=set(agents), policy_mapping_fn=_same_id)
    specs = {agent: RLModuleSpec(module_class=FactoredActorCritic, model_config=model_config) for agent in agents}
    return config.rl_module(rl_module_spec=MultiRLModuleSpec(rl_module_specs=specs))


def probe_actor_name_of(config: PPOConfig) -> str | None:
    """The GradientProbe actor name the learners of ``config`` will look for (None: probe off)."""
    probe = config.learner_config_dict.get(LEARNER_CONFIG_KEY, {}).get("probe") or {}
    return probe.get("actor_name")
