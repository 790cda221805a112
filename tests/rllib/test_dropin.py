"""``check_gradmon``: a drop-in's settings refused on the driver in one line; its exit hook.  No Ray."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import ray
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
from ray.rllib.algorithms.ppo import PPOConfig
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole

from gradmon_ray.rllib import GradmonPPOTorchLearner, dropin, with_gradmon
from gradmon_ray.rllib.dropin import check_gradmon

MISTAKES = {  # what a user wrote -> the start of the one line they get
    "misspelled key": ({"heds": {"pi": r"^pi\."}}, "learner_config_dict['gradmon']: unknown keys ['heds']; allowed: ["),
    "bad regex": ({"heads": {"pi": "(["}}, "learner_config_dict['gradmon']['heads']['pi']: invalid regular expression"),
    "band as a string": ({"bands": {"action": "0.1"}}, "learner_config_dict['gradmon']['bands']['action'] must be"),
    "full learner's key": (
        {"optimizer": "upgd"},
        "learner_config_dict['gradmon']['optimizer'] is read only by Gradmon",
    ),
}


def _appo(settings: dict, learner: type = APPOTorchLearner, *, wrap: bool = True) -> APPOConfig:
    cls = with_gradmon(learner) if wrap else learner
    return APPOConfig().learners(learner_class=cls, learner_config_dict={"gradmon": settings})


@pytest.mark.parametrize("mistake", sorted(MISTAKES))
def test_a_settings_mistake_is_one_value_error_line_with_what_is_allowed(mistake, monkeypatch):
    settings, start = MISTAKES[mistake]
    # No Ray: an earlier test module in this worker may have connected one, so starting one is refused.
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("check_gradmon started Ray"))
    with pytest.raises(ValueError) as info:
        check_gradmon(_appo(settings))
    message = str(info.value)
    assert message.startswith(start) and "\n" not in message, message
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained parser traceback


def test_the_allowed_keys_are_named_in_the_unknown_key_message():
    with pytest.raises(ValueError, match=r"allowed: \[.*'bands'.*'heads'.*\]"):
        check_gradmon(_appo({"heds": {}}))


def test_good_settings_return_the_same_config_unchanged():
    config = _appo({"heads": {"pi": r"^pi\.", "vf": r"^vf\."}, "bands": {"action": {"dead_below": 0.02}}})
    before = config.to_dict()
    assert check_gradmon(config) is config
    assert config.to_dict() == before


def test_the_full_learner_accepts_its_own_keys():
    """``GradmonPPOTorchLearner`` reads ``optimizer``: accepted there, refused for ``with_gradmon``
    (the parametrized case above), so the check asks the learner class which it is."""
    config = PPOConfig().learners(
        learner_class=GradmonPPOTorchLearner, learner_config_dict={"gradmon": {"optimizer": "upgd"}}
    )
    assert check_gradmon(config) is config


def test_settings_for_a_learner_that_is_not_gradmons_are_refused_naming_with_gradmon():
    """Settings under ``"gradmon"`` beside RLlib's own learner would be ignored without a word."""
    with pytest.raises(ValueError) as info:
        check_gradmon(_appo({"heads": {"pi": r"^pi\."}}, wrap=False))
    assert str(info.value).startswith("config.learner_class is 'APPOTorchLearner', not a gradmon learner")
    assert "with_gradmon(" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match="'PPOTorchLearner', not a gradmon learner"):
        check_gradmon(PPOConfig())  # RLlib's default learner class
    assert check_gradmon(PPOConfig().learners(learner_class=with_gradmon(PPOTorchLearner)))  # no settings: defaults


class _Held:
    pass


def _uncaught_with(held: _Held) -> None:
    """What the interpreter keeps after a script's uncaught exception: ``sys.last_*``, whose traceback
    holds the frame that held ``held`` (as RLlib's ``LearnerGroup.__init__`` frame holds ``self``).
    The frame also keeps the exception: a reference cycle, which only the garbage collector frees."""
    try:
        _ = held
        raise ValueError("boom")
    except ValueError as exc:
        caught = exc
        sys.last_type, sys.last_value, sys.last_traceback = type(caught), caught, caught.__traceback__


def test_the_exit_hook_frees_what_an_uncaught_exception_holds(monkeypatch):
    monkeypatch.setattr(sys, "last_value", None, raising=False)  # restored after the test
    monkeypatch.setattr(sys, "last_type", None, raising=False)
    monkeypatch.setattr(sys, "last_traceback", None, raising=False)
    held = _Held()
    ref = weakref.ref(held)
    _uncaught_with(held)
    del held
    gc.collect()
    assert ref() is not None  # the traceback keeps it: at exit it would outlive Ray's shutdown
    dropin._drop_uncaught_traceback()
    assert ref() is None and sys.last_value is None


def test_the_exit_hook_is_registered_once(monkeypatch):
    registered = []
    monkeypatch.setattr(dropin.atexit, "register", registered.append)
    monkeypatch.setattr(dropin, "_EXIT_HOOK", [])
    config = _appo({})
    check_gradmon(config)
    check_gradmon(config)
    assert registered == [dropin._drop_uncaught_traceback]


def test_a_head_regex_matching_nothing_is_refused_on_modules_built_here_without_ray(monkeypatch):
    """The module is built on the driver from the config (an EnvRunner made here gives the spaces): the
    learner's own head check, before any Ray (it took a learner actor, 21-23 s, before)."""
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("check_gradmon started Ray"))
    config = _appo({"heads": {"pi": r"^pi\.", "value": r"^value_head\."}}).environment("CartPole-v1")
    with pytest.raises(ValueError) as info:
        check_gradmon(config)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "module 'default_policy': gradmon head 'value' (regex '^value_head\\\\.') matches no trainable parameter of "
        "DefaultAPPOTorchRLModule; its parameters: encoder.actor_encoder: ["
    ), message


def test_a_module_id_no_policy_has_is_one_warning_line_not_an_error(caplog):
    """A league adds modules later: an id the settings name that the config's modules lack is accepted,
    and said once (a typo shows here, before Ray)."""
    config = (
        PPOConfig()
        .environment(MultiAgentCartPole, env_config={"num_agents": 2})
        .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda aid, *a, **k: f"p{aid}")
        .learners(
            learner_class=with_gradmon(PPOTorchLearner), learner_config_dict={"gradmon": {"modules": ["p0", "p9"]}}
        )
    )
    with caplog.at_level("WARNING", logger="gradmon_ray.rllib.dropin"):
        assert check_gradmon(config) is config
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gradmon_ray.rllib.dropin"]
    assert line.startswith("gradmon: learner_config_dict['gradmon']['modules'] names ['p9'], matching no module"), line


def test_an_env_the_driver_cannot_make_leaves_the_modules_to_the_learner():
    config = _appo({"heads": {"pi": r"^nomatch\."}}).environment("no.such.module:Env")
    assert check_gradmon(config) is config  # the learner raises it where the env exists
