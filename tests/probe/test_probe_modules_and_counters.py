"""``probe.modules`` and the probe counters in a multi-module run, on the real ``GradmonPPOTorchLearner``
(in-process, the built-in two-agent env: modules ``agent_0`` and ``agent_1``).

The client's ``submit`` records the request and counts it as the real one does after a successful
send (no actor is needed for the hand-off); the learner's own result then goes through RLlib's real
driver-side ``MetricsLogger`` (``aggregate`` + ``reduce``, as ``Algorithm.train`` does) and
``result_to_metrics``.

Bugs these catch: ``probe.modules`` ignored (both modules sent), read as the modules to leave out, or
not passed from the run config to the learner, or a glob pattern read as an id; a module id the run
does not have accepted without a word (never probed), or refused (a league adds it later); the probe
counters filed under the first module (``module/agent_0/probe/requests_sent``: RLlib's set order
decides which, and it changes when that module is removed) or logged once per module;
``result_to_metrics`` not turning them into the plain names the final counters and every reader use.
"""

from __future__ import annotations

from typing import Any

import pytest
from ray.rllib.core import ALL_MODULES
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from gradmon_ray import metric_names as mn
from gradmon_ray.config import ConfigError, config_from_dict
from gradmon_ray.rllib.config import build_ppo_config
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from gradmon_ray.rllib.settings import LEARNER_CONFIG_KEY, GradmonSettings
from gradmon_ray.tracking import result_to_metrics

AGENTS = ("agent_0", "agent_1")


def _cfg(probe_modules: list[str] | None) -> Any:
    return config_from_dict(
        {
            "seed": 3,
            "env": {"id": "gradmon/FactoredOpsMultiAgent-v0"},
            "ppo": {"train_batch_size": 128, "minibatch_size": 128, "num_epochs": 1},
            "model": {"trunk_hiddens": [8]},
            "probe": {"gradient_analysis_every": 1, "num_buckets": 2, "modules": probe_modules},
        }
    )


def _driver_result(learner_results: dict[str, Any]) -> dict[str, Any]:
    """One learner's update results as RLlib's driver reports them in ``result["learners"]``."""
    driver = MetricsLogger(root=True)
    driver.aggregate([learner_results], key="learners")
    return driver.reduce(compile=True)


def test_only_the_listed_modules_are_probed_and_the_counters_are_logged_once_under_all_modules():
    cfg = _cfg(["*_1"])  # a glob pattern (a league's modules): agent_1 only
    learner = build_local_learner(cfg)
    client, sent = learner._probe, []

    def submit(request: Any) -> None:  # what ProbeClient.submit does after a successful send
        sent.append(request)
        client.counters[mn.PROBE_REQUESTS_SENT] += 1

    client.submit = submit
    try:
        update(learner, train_batch(learner, sample_episodes(cfg, learner, 128)), cfg)
        client.record_failure("a request that could not be built")  # as the hand-off counts one
        results = update(learner, train_batch(learner, sample_episodes(cfg, learner, 128)), cfg)
    finally:
        learner.shutdown()
    assert [[p.module_id for p in r.modules] for r in sent] == [["agent_1"], ["agent_1"]]
    assert all(r.per_module_names for r in sent)  # two monitored modules: names stay module/<id>/...
    counters = {name: results[ALL_MODULES][name].peek() for name in mn.PROBE_COUNTERS}
    assert counters == {
        mn.PROBE_REQUESTS_SENT: 2.0,
        mn.PROBE_REQUESTS_DROPPED: 0.0,
        mn.PROBE_COMPLETED: 0.0,
        mn.PROBE_SKIPPED: 0.0,
        mn.PROBE_FAILURES: 1.0,
    }
    for mid in AGENTS:
        assert not [k for k in results[mid] if k.startswith("probe/")], mid  # no module holds them
    result = _driver_result(results)
    result["env_runners"] = {"num_env_steps_sampled_lifetime": 256}
    metrics = result_to_metrics(result)
    assert {name: metrics[name] for name in mn.PROBE_COUNTERS} == counters  # plain names, the same values
    assert not [n for n in metrics if "/probe/" in n], "no module/<id>/probe/... name"
    assert metrics[mn.module_metric("agent_1", mn.TELEMETRY_ITERATION)] == 2.0  # the modules' own metrics stay


def test_a_probe_module_the_run_does_not_have_is_accepted_and_named_once_in_the_log(caplog):
    """A league adds modules later: ``probe.modules`` naming one the run does not have (yet) builds,
    and the log names it in one line, once (the learner asks at every step: here twice)."""
    learner = build_local_learner(_cfg(["agent_9"]))
    try:
        with caplog.at_level("WARNING"):
            learner.warn_unseen_modules()
            learner.warn_unseen_modules()
    finally:
        learner.shutdown()
    notes = [r.getMessage() for r in caplog.records if "matching no module" in r.getMessage()]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0].startswith("gradmon: learner_config_dict['gradmon']['probe']['modules'] names ['agent_9'], ")


@pytest.mark.parametrize(
    ("probe", "monitored", "message"),
    [
        (["a/b"], None, "['probe']['modules']: module id 'a/b' cannot go into gradmon's metric names"),
        ([], None, "['probe']['modules'] must be a non-empty list of module ids (str)"),
        ("agent_1", None, "['probe']['modules'] must be a list of module ids (str), got str 'agent_1'"),
        (["agent_1"], ["agent_0"], "['probe']['modules'] names module ids ['agent_1'] that "),
    ],
)
def test_bad_probe_modules_settings_are_one_line(probe, monitored, message):
    data = {"probe": {"every": 1, "actor_name": "p", "modules": probe}, "modules": monitored}
    with pytest.raises(ValueError) as error:
        GradmonSettings.from_dict(data, full_learner=True).check_modules(AGENTS)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_run_config_passes_probe_modules_to_the_learner_and_refuses_a_bad_id():
    learner_config = build_ppo_config(_cfg(["agent_1"])).learner_config_dict[LEARNER_CONFIG_KEY]
    assert GradmonSettings.from_dict(learner_config, full_learner=True).probe.modules == ("agent_1",)
    assert "modules" not in build_ppo_config(_cfg(None)).learner_config_dict[LEARNER_CONFIG_KEY]["probe"]
    with pytest.raises(ConfigError, match=r"^probe\.modules: module id 'x y' cannot go into"):
        _cfg(["x y"])
