"""``gradmon_ray.head_labels``: one definition of value heads, worked answers for heads named
``value``, ``vf`` and a declared ``critic`` (and every reader of it: the learner, the tags, watch,
the report, health_stop).

``value`` and ``vf`` are value heads in every run; ``critic`` is one only where the run declares it
(the module's ``value_heads`` attribute, or ``learner_config_dict["gradmon"]["value_heads"]``, per
module in ``per_module``), and the run records it in the ``gradmon.value_heads`` tag that every
reader reads back.  Each such head at norm 8 must be judged by the documented value edges
(dead < 0.01 <= weak < 0.1 <= healthy <= 10 < elevated <= 50 < exploding): healthy, where the
action edges (0.01 / 0.1 / 2 / 5) make it exploding; left out of the action-head ranking and of
health_stop's action-head rules; shown last (the value column) and healthy by watch and the report.
Every expected band, distance and string below is worked out by hand from those numbers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from ray.rllib.core.distribution.torch.torch_distribution import TorchCategorical
from rich.console import Console
from torch import nn

from gradmon_ray import metric_names as mn
from gradmon_ray.rllib.module_telemetry import ModuleTelemetry, resolve_module
from gradmon_ray.rllib.settings import GradmonSettings, VGSSettings
from gradmon_ray.telemetry.bands import BandSet, worst_head
from gradmon_ray.telemetry.health_stop import HealthStopMonitor, HealthStopRules
from gradmon_ray.tracking.result_metrics import latch_tags, progress_line, run_value_heads
from gradmon_ray.viz.panel import watch
from gradmon_ray.viz.report import summary_markdown
from gradmon_ray.viz.runs import ProbeView, load_history
from tests.band_oracle import ACTION_EDGES, VALUE_EDGES
from tests.viz.module_runs import log_run

HEALTHY, EXPLODING, DEAD = 2.0, 4.0, 0.0  # docs/metrics.md: HEALTH_CODES

# (head name, what the run declares besides value / vf): the three ways a head is a value head.
CASES = [("value", ()), ("vf", ()), ("critic", ("critic",))]
IDS = ["value", "vf", "critic"]


def _metrics(norms: dict[str, float], codes: dict[str, float] | None = None) -> dict[str, float]:
    out = {mn.LEARNERS_UPDATED: 1.0, mn.ENV_STEPS_SAMPLED_LIFETIME: 100.0, mn.EPISODE_RETURN_MEAN: 1.0}
    out.update({_name(h, "norm"): v for h, v in norms.items()})
    out.update({_name(h, "health"): c for h, c in (codes or {}).items()})
    return out


def _name(label: str, what: str) -> str:
    """``grad/head/<head>/<what>``, ``module/<m>/grad/head/<head>/<what>`` for a label ``<m>/<head>``."""
    module, _, head = label.rpartition("/")
    return f"module/{module}/grad/head/{head}/{what}" if module else f"grad/head/{head}/{what}"


# --- the definition --------------------------------------------------------------------------


def test_value_and_vf_always_are_value_heads_a_critic_only_where_declared():
    for head in ("value", "vf", "p1/value", "p2/vf"):
        assert mn.is_value_head(head) and mn.is_value_head(head, ("critic",))
    assert not mn.is_value_head("critic") and not mn.is_value_head("p1/critic")
    assert mn.is_value_head("critic", ("critic",)) and mn.is_value_head("p1/critic", ("critic",))  # a name: any module
    assert mn.is_value_head("p1/critic", ("p1/critic",)) and not mn.is_value_head("p2/critic", ("p1/critic",))
    assert not mn.is_value_head("op", ("critic",))
    assert mn.parse_value_heads("p1/critic,p2/vf") == ("p1/critic", "p2/vf")
    assert mn.parse_value_heads(None) == mn.parse_value_heads("") == ()


@pytest.mark.parametrize(("name", "declared"), CASES, ids=IDS)
def test_a_value_head_at_8_is_healthy_by_the_value_edges(name, declared):
    bands = BandSet(value_heads=declared)
    assert bands.for_head(name).edges == VALUE_EDGES and bands.for_head("op").edges == ACTION_EDGES
    assert bands.for_head(name).classify(8.0) == "healthy"  # 0.1 <= 8 <= 10
    assert bands.for_head("op").classify(8.0) == "exploding"  # 8 > 5
    assert bands.for_head(f"p1/{name}").classify(8.0) == "healthy"


def test_an_undeclared_critic_at_8_is_an_exploding_action_head():
    assert BandSet().for_head("critic").edges == ACTION_EDGES
    assert BandSet().for_head("critic").classify(8.0) == "exploding"


# --- the learner: settings, the module's declaration, its health codes ---------------------------


class _Module(nn.Module):
    """Heads ``pi`` (one categorical over 3 actions, latch ``policy``) and a value head ``name``."""

    action_space = gym.spaces.Discrete(3)

    def __init__(self, name: str, declares: bool = False) -> None:
        super().__init__()
        self.pi, self.v, self.name = nn.Linear(4, 3), nn.Linear(4, 1), name
        if declares:
            self.value_heads = (name,)

    def head_parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        return {"pi": list(self.pi.parameters()), self.name: list(self.v.parameters())}

    def get_train_action_dist_cls(self) -> type:
        return TorchCategorical


LEARNER_CASES = [
    ("value", False, {}),
    ("vf", False, {}),
    ("critic", True, {}),  # the module's own value_heads attribute
    ("critic", False, {"value_heads": ["critic"]}),  # the drop-in's settings key
    ("critic", False, {"per_module": {"default_policy": {"value_heads": ["critic"]}}}),
]


def _telemetry(module: nn.Module, gradmon: dict) -> ModuleTelemetry:
    settings = GradmonSettings.from_learner_config({"gradmon": gradmon})
    spec = resolve_module("default_policy", module, settings, ("policy",))
    return ModuleTelemetry(spec, module, device="cpu", grad_scaler=None, vgs=VGSSettings(), optimizers=[])


def _one_iteration(telemetry: ModuleTelemetry, norms: list[float]):
    layout = telemetry.tracker.layout
    lanes = np.zeros(layout.size)
    lanes[layout.norm_sum] = norms  # one minibatch per head: its norm is the sum
    lanes[layout.norm_count] = 1.0
    return telemetry.tracker.finish_iteration(lanes)


@pytest.mark.parametrize(
    ("name", "declares", "gradmon"),
    LEARNER_CASES,
    ids=["value", "vf", "critic-module", "critic-settings", "per-module"],
)
def test_the_learner_judges_the_value_head_by_the_value_edges(name, declares, gradmon):
    telemetry = _telemetry(_Module(name, declares), gradmon)
    assert telemetry.tracker.action_heads == ("pi",)
    it = _one_iteration(telemetry, [0.5, 8.0])
    assert it.health == {"pi": "healthy", name: "healthy"}
    metrics = it.to_metrics()
    assert metrics[f"grad/head/{name}/health"] == HEALTHY and metrics["grad/head/pi/health"] == HEALTHY
    # the norm CV is over the action heads only: one (pi) leaves it undefined, so it is left out (never
    # NaN); with the value head it would be std / mean of [0.5, 8] = 3.75 / 4.25
    assert mn.HEAD_GRAD_NORM_CV not in metrics and math.isnan(it.head_norm_cv)
    # distance from the healthy centre: pi |ln 0.5 - ln sqrt(0.2)| = 0.112, the value head |ln 8 - ln 1| = 2.079
    assert it.worst_head() == (name, "healthy")


def test_an_undeclared_critic_is_an_action_head_of_the_learner():
    it = _one_iteration(_telemetry(_Module("critic"), {}), [0.5, 8.0])
    assert it.health == {"pi": "healthy", "critic": "exploding"}


def test_declared_value_heads_are_checked_against_the_module():
    with pytest.raises(ValueError, match=r"module 'default_policy': value head 'critc' is not one of the reported"):
        _telemetry(_Module("critic"), {"value_heads": ["critc"]})
    with pytest.raises(ValueError, match=r"value head 'policy' is an action component"):
        _telemetry(_Module("policy"), {"value_heads": ["policy"]})  # the latch head's name
    with pytest.raises(ValueError, match=r"\['value_heads'\] must be a list of head names \(str\), got str 'critic'"):
        GradmonSettings.from_learner_config({"gradmon": {"value_heads": "critic"}})
    with pytest.raises(ValueError, match=r"\['value_heads'\]: head name 'p1/critic' cannot go into gradmon's metric"):
        GradmonSettings.from_learner_config({"gradmon": {"value_heads": ["p1/critic"]}})


# --- the run records its value heads ------------------------------------------------------------


def test_latch_tags_record_the_value_heads_the_run_declares():
    metrics = _metrics({"vf": 8.0, "critic": 8.0, "op": 0.5})
    assert latch_tags(metrics, False, (), ("critic",)) == {
        mn.TAG_HEAD_NAMES: "op,critic,vf",  # action heads, then the value heads (sorted)
        mn.TAG_VALUE_HEADS: "critic,vf",
    }
    assert latch_tags(metrics, False) == {mn.TAG_HEAD_NAMES: "critic,op,vf"}  # none declared: critic is an action head
    assert latch_tags(metrics, True, (), ("critic",)) == {}  # once only
    modules = _metrics({"p1/op": 0.5, "p1/critic": 8.0, "p2/op": 0.5, "p2/critic": 8.0})
    assert latch_tags(modules, False, (), ("p1/critic",)) == {
        mn.TAG_HEAD_NAMES: "p1/op,p1/critic,p2/critic,p2/op",
        mn.TAG_VALUE_HEADS: "p1/critic",
    }


class _Algorithm:
    def __init__(self, policies: list[str], gradmon: dict, modules: dict) -> None:
        self.config = SimpleNamespace(policies=policies, learner_config_dict={"gradmon": gradmon})
        self.modules = modules

    def get_module(self, module_id: str):
        return self.modules[module_id]


def test_run_value_heads_reads_what_the_learner_reads():
    one = _Algorithm(["default_policy"], {"value_heads": ["critic"]}, {"default_policy": SimpleNamespace()})
    assert run_value_heads(one) == ("critic",)
    own = _Algorithm(["default_policy"], {}, {"default_policy": SimpleNamespace(value_heads=("q",))})
    assert run_value_heads(own) == ("q",)
    gradmon = {"value_heads": ["critic"], "per_module": {"p2": {"value_heads": []}, "p3": {"heads": {}}}}
    several = _Algorithm(
        ["p1", "p2", "p3"], gradmon, {"p1": SimpleNamespace(value_heads=("q",)), "p2": None, "p3": SimpleNamespace()}
    )
    assert run_value_heads(several) == ("p1/q", "p1/critic", "p3/critic")  # p2's entry declares none
    assert run_value_heads(several, "p1") == ("q", "critic")  # one module's callback: plain names
    settings = GradmonSettings.from_learner_config({"gradmon": gradmon})
    assert [settings.for_module(m).value_heads for m in ("p1", "p2", "p3")] == [("critic",), (), ("critic",)]


# --- the progress line, worst_head and health_stop leave value heads out of the action heads ----


@pytest.mark.parametrize(("name", "declared"), CASES, ids=IDS)
def test_progress_line_and_worst_head(name, declared):
    metrics = _metrics({"op": 0.5, name: 8.0})
    assert "worst head op 0.500 (healthy)" in progress_line(1, 2, metrics, value_heads=declared)
    # competing: op 0.112 from its healthy centre, the value head 2.079 from its own (ln 8 - ln 1)
    line = progress_line(1, 2, metrics, include_value_head=True, value_heads=declared)
    assert f"worst head {name} 8.000 (healthy)" in line
    assert progress_line(1, 2, metrics, bands=BandSet(value_heads=declared), include_value_head=True) == line
    assert worst_head({"op": 0.5, name: 8.0}, bands=BandSet(value_heads=declared)) == (name, "healthy")
    assert worst_head({"op": 0.5, name: 8.0}) == (name, "exploding")  # one set of (action) edges for all


def test_progress_line_an_undeclared_critic_at_8_is_the_exploding_action_head():
    line = progress_line(1, 2, _metrics({"op": 0.5, "critic": 8.0}))
    assert "worst head critic 8.000 (exploding)" in line


@pytest.mark.parametrize(("name", "declared"), CASES, ids=IDS)
def test_health_stop_leaves_the_value_head_alone_unless_asked(name, declared):
    dead = _metrics({"op": 0.5, name: 0.001}, {"op": HEALTHY, name: DEAD})  # 0.001 < 0.01: dead by either edges
    quiet = HealthStopMonitor(HealthStopRules(dead_iterations=2), value_heads=declared)
    assert quiet.update(1, dead) is None and quiet.update(2, dead) is None
    strict = HealthStopMonitor(HealthStopRules(dead_iterations=2, include_value_head=True), value_heads=declared)
    assert strict.update(1, dead) is None
    decision = strict.update(2, dead)
    assert decision is not None and (decision.head, decision.rule) == (name, "dead")
    assert decision.message == f"head {name!r} dead for 2 consecutive iterations (norm 0.001)"


def test_health_stop_an_undeclared_critic_is_an_action_head():
    exploding = _metrics({"op": 0.5, "critic": 8.0}, {"op": HEALTHY, "critic": EXPLODING})
    monitor = HealthStopMonitor(HealthStopRules(exploding_iterations=1))
    decision = monitor.update(1, exploding)
    assert decision is not None and (decision.head, decision.rule) == ("critic", "exploding")


# --- watch and the report read the run's tag ------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    client = MlflowClient(f"sqlite:///{tmp_path_factory.mktemp('value_heads') / 'mlflow.db'}")
    # The head-names tag lists the value head first: the readers must still put it in the value column.
    made = {
        name: log_run(client, name, {"op": [8.0], name: [8.0]}, tag=[name, "op"], value_heads=declared)
        for name, declared in CASES
    }
    made["critic, old run"] = log_run(client, "old", {"op": [8.0], "critic": [8.0]}, tag=["critic", "op"])
    return client, made


def _panel(client: MlflowClient, run_id: str) -> tuple[list[str], list[str]]:
    """The heads table's column headers and its state row."""
    console = Console(record=True, width=200, color_system=None, force_terminal=False)
    watch(client, run_id=run_id, once=True, console=console)
    lines = console.export_text().splitlines()
    (header,) = [ln for ln in lines if ln.startswith("┃") and not ln.split("┃")[1].strip()]
    (state,) = [ln for ln in lines if ln.startswith("│") and ln.split("│")[1].strip() == "state"]
    return [c.strip() for c in header.split("┃")[2:-1]], [c.strip() for c in state.split("│")[2:-1]]


@pytest.mark.parametrize("name", IDS)
def test_watch_shows_the_value_head_last_and_healthy(runs, name):
    client, made = runs
    assert _panel(client, made[name]) == (["op", name], ["exploding", "healthy"])


@pytest.mark.parametrize("name", IDS)
def test_report_judges_the_value_head_by_the_value_edges(runs, name):
    client, made = runs
    text = summary_markdown(load_history(client, made[name]), ProbeView(None))
    assert f"value heads ({name}) 0.01 / 0.1 / 10 / 50" in text
    rows = {ln.split("|")[1].strip(): ln.split("|")[3].strip() for ln in text.splitlines() if "| 8 |" in ln}
    assert rows == {"op": "exploding", name: "healthy"}
    heads = [ln.split("|")[1].strip() for ln in text.splitlines() if "| 8 |" in ln]
    assert heads == ["op", name]  # worst first: op exploding, the value head healthy


def test_a_run_without_the_tag_reads_as_before_critic_an_action_head(runs):
    client, made = runs
    assert _panel(client, made["critic, old run"]) == (["critic", "op"], ["exploding", "exploding"])
    text = summary_markdown(load_history(client, made["critic, old run"]), ProbeView(None))
    assert "value heads (none) 0.01 / 0.1 / 10 / 50" in text
    assert {ln.split("|")[3].strip() for ln in text.splitlines() if "| 8 |" in ln} == {"exploding"}
