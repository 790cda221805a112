"""``GradmonSettings``: what each learner kind accepts, refuses and how per-module settings fall back.

Pure parsing (no Ray, no learner).  The oracles are the inputs themselves (a field set in the
dict must come back as given, a field not set must come back as the top level's), the
dataclass fields of ``HealthBands`` / ``UPGD``'s signature for the allowed keys, and what
``build_ppo_config`` writes for the full learner.
"""

from __future__ import annotations

from dataclasses import fields

import pytest

from gradmon_ray.config import config_from_dict
from gradmon_ray.rllib.config import build_ppo_config
from gradmon_ray.rllib.settings import (
    FULL_LEARNER_KEYS,
    LEARNER_CONFIG_KEY,
    GradmonSettings,
    ModuleSettings,
)
from gradmon_ray.telemetry.bands import ACTION_BANDS, VALUE_BANDS, BandSet, CollapseBand, HealthBands

WIDE = {"action": {"healthy_max": 3.0, "elevated_max": 9.0}}
NARROW = {"value": {"healthy_max": 4.0, "elevated_max": 8.0}}


def parse(gradmon: dict, *, full_learner: bool = False) -> GradmonSettings:
    return GradmonSettings.from_learner_config({"gradmon": gradmon}, full_learner=full_learner)


def error(gradmon: dict, *, full_learner: bool = False) -> str:
    with pytest.raises(ValueError) as raised:
        parse(gradmon, full_learner=full_learner)
    message = str(raised.value)
    assert "\n" not in message  # one line
    return message


def listed(message: str) -> list[str]:
    """The list after 'allowed: ' in an unknown-key message."""
    return eval(message.split("allowed: ", 1)[1])  # a Python list literal of str


# --- the drop-in refuses what only GradmonPPOTorchLearner implements -----------------------


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("optimizer", "upgd", "override configure_optimizers_for_module"),
        ("fused_optimizer", False, "override configure_optimizers_for_module"),
        ("upgd", {"sigma": 0.01}, "override configure_optimizers_for_module"),
        ("regularizers", [{"name": "logit_l2"}], "use learner_class=gradmon_ray.rllib.GradmonPPOTorchLearner"),
        ("probe", {"every": 2, "actor_name": "p"}, "use learner_class=gradmon_ray.rllib.GradmonPPOTorchLearner"),
    ],
)
def test_drop_in_refuses_each_full_learner_key_naming_it_and_what_to_do(key, value, instead):
    message = error({"heads": {"pi": "^pi"}, key: value})
    assert message.startswith(f"learner_config_dict['gradmon'][{key!r}] is read only by GradmonPPOTorchLearner")
    assert instead in message and "GradmonPPOTorchLearner" in message
    # the same key is honoured by the full learner
    assert getattr(parse({key: value}, full_learner=True), key) != getattr(GradmonSettings(), key)


def test_a_default_valued_full_learner_key_is_refused_too():
    # The user who writes it believes it does something; with_gradmon would silently ignore it.
    assert "'fused_optimizer'" in error({"fused_optimizer": True})
    assert "'probe'" in error({"probe": {}})


def test_from_learner_config_defaults_to_the_drop_in():
    with pytest.raises(ValueError, match="read only by GradmonPPOTorchLearner"):
        GradmonSettings.from_learner_config({"gradmon": {"optimizer": "adam"}})
    assert GradmonSettings.from_learner_config(None) == GradmonSettings()
    assert GradmonSettings.from_learner_config({}) == GradmonSettings()


# --- unknown keys list the allowed ones, for that learner --------------------------------


def test_unknown_key_lists_the_drop_ins_allowed_keys():
    message = error({"head": {"pi": "^pi"}})
    assert message.startswith("learner_config_dict['gradmon']: unknown keys ['head']; allowed: ")
    allowed = listed(message)
    assert "heads" in allowed and "modules" in allowed and "per_module" in allowed
    assert not set(allowed) & set(FULL_LEARNER_KEYS)  # never offer what would be refused next
    assert allowed == sorted(f.name for f in fields(GradmonSettings) if f.name not in FULL_LEARNER_KEYS)


def test_unknown_key_lists_the_full_learners_allowed_keys():
    allowed = listed(error({"hedas": 1}, full_learner=True))
    assert allowed == sorted(f.name for f in fields(GradmonSettings))
    assert set(FULL_LEARNER_KEYS) <= set(allowed)


@pytest.mark.parametrize(
    ("gradmon", "where", "allowed"),
    [
        ({"bands": {"actoin": {}}}, "['bands']", ["action", "collapse", "update_ratio", "value"]),
        ({"bands": {"action": {"healthy": 1.0}}}, "['bands']['action']", [f.name for f in fields(HealthBands)]),
        ({"bands": {"collapse": {"iters": 3}}}, "['bands']['collapse']", [f.name for f in fields(CollapseBand)]),
        ({"per_module": {"a": {"head": {}}}}, "['per_module']['a']", ["bands", "heads", "value_heads"]),
        ({"per_module": {"a": {"bands": {"value": {"max": 1}}}}}, "['per_module']['a']['bands']['value']", None),
        ({"vgs": {"betta": 0.9}}, "['vgs']", None),
    ],
)
def test_a_typo_in_a_nested_section_lists_that_sections_keys(gradmon, where, allowed):
    message = error(gradmon)
    assert message.startswith(f"learner_config_dict['gradmon']{where}: unknown keys ")
    if allowed is not None:
        assert listed(message) == sorted(allowed)
    if "vgs" in gradmon:  # VarianceGradientScaler's keyword arguments plus the two gradmon adds
        assert {"beta", "alpha", "eps", "warmup_steps", "granularity", "apply_to", "enabled"} <= set(listed(message))


def test_typos_in_the_full_learners_sections_list_their_keys():
    message = error({"probe": {"evry": 2}}, full_learner=True)
    assert message == (
        "learner_config_dict['gradmon']['probe']: unknown keys ['evry']; allowed: ['actor_name', 'every', 'modules']"
    )
    message = error({"upgd": {"sigmaa": 1}}, full_learner=True)
    assert listed(message) == ["beta_utility", "sigma", "weight_decay"]  # UPGD's own, less what the learner passes
    message = error({"regularizers": [{"name": "logit_l2", "wieght": 1}]}, full_learner=True)
    assert message.startswith("learner_config_dict['gradmon']['regularizers'][0]: unknown keys ['wieght']")


# --- wrong types say what is expected ----------------------------------------------------


@pytest.mark.parametrize(
    ("gradmon", "expected"),
    [
        ({"telemetry": "false"}, "['telemetry'] must be a bool, got str 'false'"),
        ({"report_every": 2.5}, "['report_every'] must be an int >= 0, got float 2.5"),
        ({"report_every": True}, "['report_every'] must be an int >= 0, got bool True"),
        ({"replica_check_every": -1}, "['replica_check_every'] must be an int >= 0, got int -1"),
        ({"noise_ema_beta": "0.9"}, "['noise_ema_beta'] must be a number, got str '0.9'"),
        ({"collective_group": 3}, "['collective_group'] must be a str or None, got int 3"),
        ({"heads": ["pi"]}, "['heads'] must be a mapping (dict), got list ['pi']"),
        ({"heads": {"pi": 1}}, "['heads']: expected {head name (str): regex (str)}, got 'pi': int"),
        ({"heads": {"pi": "("}}, "['heads']['pi']: invalid regular expression '('"),
        ({"modules": "agent_0"}, "['modules'] must be a list of module ids (str), got str 'agent_0'"),
        ({"modules": []}, "['modules'] must be a non-empty list of module ids (str)"),
        ({"per_module": ["a"]}, "['per_module'] must be a mapping (dict), got list"),
        ({"per_module": {"a": {"heads": "pi"}}}, "['per_module']['a']['heads'] must be a mapping (dict), got str"),
        ({"vgs": {"enabled": "yes"}}, "['vgs']['enabled'] must be a bool, got str 'yes'"),
        ({"vgs": {"apply_to": "grads"}}, "['vgs']['apply_to'] must be one of ('update', 'gradient')"),
        ({"bands": {"action": {"healthy_max": 0.05}}}, "['bands']: band edges must be positive and strictly"),
    ],
)
def test_wrong_types_say_what_is_expected(gradmon, expected):
    assert error(gradmon).startswith("learner_config_dict['gradmon']" + expected)


def test_full_learner_value_checks():
    assert error({"optimizer": "sgd"}, full_learner=True).endswith("must be one of ('adam', 'upgd'), got 'sgd'")
    assert "['probe']['every'] must be an int >= 0" in error({"probe": {"every": "2"}}, full_learner=True)
    assert "['probe']['actor_name'] is required" in error({"probe": {"every": 2}}, full_learner=True)
    assert "['regularizers'] must be a list" in error({"regularizers": {"name": "x"}}, full_learner=True)


# --- multi-agent: modules, per_module, for_module, check_modules ---------------------------


def test_modules_and_per_module_parse():
    settings = parse(
        {
            "heads": {"pi": r"^pi\."},
            "bands": WIDE,
            "modules": ["a", "b"],
            "per_module": {"a": {"heads": {"x": "^x"}, "bands": NARROW}, "b": {"bands": NARROW}, "c": {}},
        }
    )
    assert settings.modules == ("a", "b")
    assert settings.per_module["a"] == ModuleSettings(heads={"x": "^x"}, bands=BandSet.from_dict(NARROW))
    assert settings.per_module["b"].heads is None  # not given: falls back in for_module
    assert settings.per_module["c"] == ModuleSettings(heads=None, bands=None)
    assert GradmonSettings().modules is None and dict(GradmonSettings().per_module) == {}


def test_for_module_falls_back_field_by_field_to_the_top_level():
    top_heads = {"pi": r"^pi\.", "vf": r"^vf\."}
    settings = parse(
        {
            "heads": top_heads,
            "bands": WIDE,
            "per_module": {
                "both": {"heads": {"x": "^x"}, "bands": NARROW},
                "heads_only": {"heads": {"y": "^y"}},
                "bands_only": {"bands": NARROW},
                "empty_heads": {"heads": {}},
            },
        }
    )
    wide = BandSet(action=HealthBands(0.01, 0.1, 3.0, 9.0), value=VALUE_BANDS)  # WIDE worked out by hand
    narrow = BandSet(action=ACTION_BANDS, value=HealthBands(0.01, 0.1, 4.0, 8.0))
    assert settings.bands == wide

    assert settings.for_module("both") == ModuleSettings(heads={"x": "^x"}, bands=narrow, value_heads=())
    assert settings.for_module("heads_only") == ModuleSettings(heads={"y": "^y"}, bands=wide, value_heads=())
    assert settings.for_module("bands_only") == ModuleSettings(heads=top_heads, bands=narrow, value_heads=())
    # an explicit empty heads mapping is the entry's own choice (the module's own / zero-config heads)
    assert settings.for_module("empty_heads") == ModuleSettings(heads={}, bands=wide, value_heads=())
    assert settings.for_module("no_entry") == ModuleSettings(heads=top_heads, bands=wide, value_heads=())
    # an entry's bands replace the top level's whole: the action edges are the defaults, not WIDE's
    assert settings.for_module("bands_only").bands.action == ACTION_BANDS != wide.action
    assert GradmonSettings().for_module("default_policy") == ModuleSettings(heads={}, bands=BandSet(), value_heads=())


def test_ids_the_module_does_not_have_are_accepted_and_named_once_by_the_unseen_note():
    """A league adds its modules later: ``modules``, ``per_module`` and ``probe.modules`` may name ids
    (or patterns) no module has yet; ``check_modules`` accepts them, ``unseen_note`` names those that
    no module the learner has had matches, in one line (None once every one matched)."""
    have = ["agent_0", "agent_1"]
    settings = parse(
        {
            "modules": ["agent_1", "agent_2", "league_*"],
            "per_module": {"agnet_0": {"heads": {}}, "agent_1": {}},
            "probe": {"every": 1, "actor_name": "p", "modules": ["agent_2"]},
        },
        full_learner=True,
    )
    settings.check_modules(have)  # no error: agent_2, league_* and agnet_0 may come later
    GradmonSettings().check_modules(have)
    assert settings.unseen_note(have) == (
        "gradmon: learner_config_dict['gradmon']['modules'] names ['agent_2', 'league_*']; "
        "learner_config_dict['gradmon']['per_module'] names ['agnet_0']; "
        "learner_config_dict['gradmon']['probe']['modules'] names ['agent_2'], matching no module this learner "
        "has had (['agent_0', 'agent_1']); a module added later under such an id is monitored from its first "
        "update, a typo never is"
    )
    assert settings.unseen_note([*have, "agent_2", "league_7", "agnet_0"]) is None
    assert [settings.monitors(m) for m in ("agent_0", "agent_1", "agent_2", "league_7", "league")] == [
        False,
        True,
        True,
        True,
        False,
    ]


# --- the full learner still parses what build_ppo_config writes ----------------------------


def test_full_learner_parses_what_build_ppo_config_writes():
    cfg = config_from_dict(
        {
            "optimizer": "upgd",
            "upgd": {"sigma": 0.002},
            "telemetry": {"fused_optimizer": False, "bands": {"value": {"healthy_max": 20.0, "elevated_max": 80.0}}},
            "vgs": {"enabled": True, "beta": 0.95, "apply_to": "gradient"},
            "regularizers": [{"name": "logit_l2", "weight": 0.1}],
            "probe": {"gradient_analysis_every": 2},
            "distributed": {"replica_check_every": 3, "collective_timeout_s": 42.5},
        }
    )
    written = build_ppo_config(cfg).learner_config_dict
    data = written[LEARNER_CONFIG_KEY]
    settings = GradmonSettings.from_learner_config(written, full_learner=True)
    assert settings.optimizer == "upgd" and dict(settings.upgd) == data["upgd"] and settings.upgd["sigma"] == 0.002
    assert settings.fused_optimizer is False
    assert settings.bands == BandSet(ACTION_BANDS, HealthBands(0.01, 0.1, 20.0, 80.0))
    assert settings.vgs.enabled and settings.vgs.apply_to == "gradient" and settings.vgs.kwargs["beta"] == 0.95
    assert "accept_old_checkpoint" not in settings.vgs.kwargs and "apply_to" not in settings.vgs.kwargs
    assert [dict(r) for r in settings.regularizers] == data["regularizers"]
    assert settings.regularizers[0]["name"] == "logit_l2" and settings.regularizers[0]["weight"] == 0.1
    assert settings.probe.every == 2 and settings.probe.actor_name == data["probe"]["actor_name"]
    assert settings.collective_group == data["collective_group"] and settings.replica_check_every == 3
    assert settings.collective_timeout_s == 42.5  # distributed.collective_timeout_s reaches the learners
    # and the drop-in refuses that very dict, naming the first key it cannot honour
    with pytest.raises(ValueError, match=r"\['fused_optimizer'\] is read only by GradmonPPOTorchLearner"):
        GradmonSettings.from_learner_config(written)
