"""``rllib/monitor_step.py``: once per telemetry step, the metrics the learner LOGS (by name).

Every expected value is counted by the test itself: the gradients of each minibatch are captured
by tensor hooks on ``module.parameters()`` (norms recomputed in numpy over parameters fetched by
module attribute name; NaN/Inf elements, non-finite minibatches and backward passes counted in
numpy), the iteration clock is the test's own loop counter, latches come from known
constructions (a NaN bias on one head, a -inf logit on one action, a -inf logit on loss-masked
rows only), the replica checksum is recomputed in exact Python integers, and the ``vgs/*``
metrics come from the numpy re-implementation in ``tests/vgs/vgs_oracle.py``.  Nothing here
reads ``head_parameter_groups``, ``GradientNormPlan`` or the tracker.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns

from gradmon_ray import metric_names as mn
from gradmon_ray.config import config_from_dict
from gradmon_ray.distributed import ReplicaDivergenceError
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.local_learner import build_local_learner, sample_episodes, train_batch, update
from tests.band_oracle import ACTION_EDGES, VALUE_EDGES, band_code
from tests.peer.pairs import HEADS, cartpole_config, sample_batch, spaces_of
from tests.vgs.vgs_oracle import assert_vgs_metrics_close, numpy_vgs_metrics

MID = DEFAULT_MODULE_ID
NO_KL = {"use_kl_loss": False}


ACTION_HEADS = ("alpha_curve", "alpha_speed", "alpha_target", "blueprint", "op", "slot", "style", "tempo")


def _cfg(**extra):
    data = {
        "seed": 5,
        "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2},
        "model": {"trunk_hiddens": [16, 16]},
    }
    data.update(extra)
    return config_from_dict(data)


def _one_epoch_cfg(**over):
    data = {
        "seed": 11,
        "ppo": {"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 1},
        "model": {"trunk_hiddens": [16, 16]},
    }
    data.update(over)
    return config_from_dict(data)


def _hooks_cfg(**ppo):
    base = {"train_batch_size": 256, "minibatch_size": 256, "num_epochs": 1, "grad_clip": None}
    base.update(ppo)
    return config_from_dict({"seed": 3, "ppo": base, "model": {"trunk_hiddens": [32, 32]}})


@pytest.fixture(scope="module")
def episodes_cfg():
    cfg = _hooks_cfg()
    learner = build_local_learner(cfg)
    return cfg, sample_episodes(cfg, learner, 256)


@pytest.fixture(scope="module")
def one_epoch_batch():
    cfg = _one_epoch_cfg()
    learner = build_local_learner(cfg)
    return train_batch(learner, sample_episodes(cfg, learner, 256))


def _module(learner):
    return learner.module[MID].unwrapped()


class GradientRecorder:
    """Tensor hooks on every parameter: each backward pass's gradients, as float64 numpy."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = list(module.parameters())
        self.captured: dict[int, list[np.ndarray]] = {}
        self.handles = [p.register_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, slot: int):
        def hook(grad: torch.Tensor) -> None:
            self.captured.setdefault(slot, []).append(grad.detach().double().numpy().copy())

        return hook

    def take(self) -> list[list[np.ndarray]]:
        """The minibatches since the last call: per minibatch, one array per parameter."""
        counts = {len(v) for v in self.captured.values()}
        assert len(counts) == 1 and len(self.captured) == len(self.params), "a parameter missed a backward"
        (count,) = counts
        out = [[self.captured[slot][k] for slot in range(len(self.params))] for k in range(count)]
        self.captured.clear()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _logged(results) -> dict[str, float]:
    out = {}
    for key, value in results[MID].items():
        if isinstance(key, str) and "/" in key:
            out[key] = float(value.peek() if hasattr(value, "peek") else value)
    return out


def _first_valid_row(batch) -> int:
    mask = batch.policy_batches[MID].get(Columns.LOSS_MASK)
    return 0 if mask is None else int(np.flatnonzero(np.asarray(mask))[0])


# --- the iteration's aggregation: mean over minibatches, prev, trend, band, CV -------------------


def test_iteration_metrics_equal_per_minibatch_gradients_captured_by_hooks(episodes_cfg):
    """Two iterations of 2 epochs x 4 minibatches: every minibatch's gradient is captured by tensor
    hooks on parameters fetched by attribute name, and the reported norms, previous values, trends,
    bands and CV are recomputed from those captures in numpy."""
    cfg, episodes = episodes_cfg
    cfg = _hooks_cfg(minibatch_size=64, num_epochs=2)
    learner = build_local_learner(cfg)
    module = _module(learner)
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    captured: dict[int, list[np.ndarray]] = {}  # parameter slot -> its gradient at each backward
    params = list(module.parameters())
    slot_of = {id(p): i for i, p in enumerate(params)}

    def capture(slot: int):
        def hook(grad: torch.Tensor) -> None:
            captured.setdefault(slot, []).append(grad.detach().double().numpy().copy())

        return hook

    handles = [p.register_hook(capture(slot_of[id(p)])) for p in params]
    batch = train_batch(learner, episodes)
    reported = []
    try:
        for _ in range(2):
            results = learner.update(batch=batch, timesteps={}, num_epochs=2, minibatch_size=64)
            count = len(captured[0])
            assert all(len(v) == count for v in captured.values())
            minibatches = [{slot: captured[slot][k] for slot in captured} for k in range(count)]
            reported.append((results[MID], minibatches))
            captured.clear()
    finally:
        for h in handles:
            h.remove()

    prev = {h: math.nan for h in owners}
    for logged, minibatches in reported:
        assert len(minibatches) >= 2 * 4 and all(len(m) == len(params) for m in minibatches)
        assert float(logged["update/minibatches"]) == len(minibatches)
        assert "grad/clip_binding_fraction" not in logged  # no clip configured: nothing to bind
        means, peaks = {}, {}
        for head, ps in owners.items():
            per_mb = [math.sqrt(sum(float((m[slot_of[id(p)]] ** 2).sum()) for p in ps)) for m in minibatches]
            means[head], peaks[head] = float(np.mean(per_mb)), max(per_mb)
        global_mean = float(np.mean([math.sqrt(sum(float((g**2).sum()) for g in m.values())) for m in minibatches]))
        assert float(logged["grad/global_norm"]) == pytest.approx(global_mean, rel=1e-4)
        for head, mean in means.items():
            assert float(logged[f"grad/head/{head}/norm"]) == pytest.approx(mean, rel=1e-4), head
            got_prev = float(logged[f"grad/head/{head}/norm_prev"])
            assert (math.isnan(got_prev) and math.isnan(prev[head])) or got_prev == pytest.approx(prev[head], rel=1e-6)
            delta = mean - prev[head]
            trend = 1 if delta > 0.01 else -1 if delta < -0.01 else 0
            assert float(logged[f"grad/head/{head}/trend"]) == trend, head
            edges = VALUE_EDGES if head == "value" else ACTION_EDGES
            assert float(logged[f"grad/head/{head}/health"]) == band_code(mean, edges, peaks[head]), head
        action = np.array([means[h] for h in owners if h != "value"])
        assert float(logged["grad/head_norm_cv"]) == pytest.approx(float(action.std(ddof=0) / action.mean()), rel=1e-4)
        prev = means


def test_the_iterations_max_p95_argmax_and_clip_fraction_equal_numpy_on_hook_captured_gradients(episodes_cfg):
    """#45 item 2: 2 epochs x 4 minibatches with a global-norm clip: every minibatch's
    gradient is captured by tensor hooks (before RLlib's clipping) on parameters fetched by
    attribute name; per head the largest and the 95th-percentile minibatch norm and the index of
    the largest, and the fraction of minibatches whose global norm exceeded the clip, in numpy."""
    _, episodes = episodes_cfg
    clip = 1.2  # this run's global norms are about 0.9-1.9: the clip binds in some minibatches
    cfg = _hooks_cfg(minibatch_size=64, num_epochs=2, grad_clip=clip)
    learner = build_local_learner(cfg)
    module = _module(learner)
    owners = {name: list(head.parameters()) for name, head in module.heads.items()}
    owners["value"] = list(module.value_head.parameters())
    params = list(module.parameters())
    captured: dict[int, list[np.ndarray]] = {}

    def capture(slot: int):
        def hook(grad: torch.Tensor) -> None:
            captured.setdefault(slot, []).append(grad.detach().double().numpy().copy())

        return hook

    handles = [p.register_hook(capture(slot)) for slot, p in enumerate(params)]
    try:
        logged = learner.update(batch=train_batch(learner, episodes), timesteps={}, num_epochs=2, minibatch_size=64)
    finally:
        for h in handles:
            h.remove()
    logged = logged[MID]
    count = len(captured[0])
    slot_of = {id(p): i for i, p in enumerate(params)}
    assert count >= 8 and float(logged["update/minibatches"]) == count
    for head, ps in owners.items():
        per_mb = np.array(
            [math.sqrt(sum(float((captured[slot_of[id(p)]][k] ** 2).sum()) for p in ps)) for k in range(count)]
        )
        assert float(logged[f"grad/head/{head}/norm_max"]) == pytest.approx(per_mb.max(), rel=1e-4), head
        assert float(logged[f"grad/head/{head}/norm_p95"]) == pytest.approx(np.percentile(per_mb, 95), rel=1e-4), head
        assert float(logged[f"grad/head/{head}/argmax_minibatch"]) == int(np.argmax(per_mb)), head
    global_norms = np.array(
        [math.sqrt(sum(float((captured[s][k] ** 2).sum()) for s in captured)) for k in range(count)]
    )
    fraction = float(np.mean(global_norms > clip))
    assert 0.0 < fraction < 1.0, global_norms  # the clip binds in some minibatches, not all
    assert float(logged["grad/clip_binding_fraction"]) == pytest.approx(fraction)


def test_a_per_tensor_clip_logs_no_binding_fraction(episodes_cfg):
    _, episodes = episodes_cfg
    learner = build_local_learner(_hooks_cfg(grad_clip=0.3, grad_clip_by="norm"))  # no clip at all: the test above
    logged = learner.update(batch=train_batch(learner, episodes), timesteps={}, num_epochs=1, minibatch_size=256)
    assert "grad/clip_binding_fraction" not in logged[MID]
    assert "grad/head/value/norm_max" in logged[MID]


# --- latches, skips, counts and the clock, across a checkpoint restore ------------------------------


def test_latches_first_iteration_skips_counts_and_clock_across_a_checkpoint_restore():
    """Five iterations, the fifth on a learner restored from the fourth's state:
    1 clean, 2 tempo's bias NaN, 3 one slot logit -inf, 4 poisoned gradients, 5 clean again."""
    # vf_loss_coeff 5: the value head's norm lands between the action heads' healthy_max (2) and
    # its own (10), so judging it by the wrong edges would show.
    cfg = _cfg(ppo={"train_batch_size": 256, "minibatch_size": 64, "num_epochs": 2, "vf_loss_coeff": 5.0})
    learner = build_local_learner(cfg)
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    row = _first_valid_row(batch)
    value_norms = []
    taken_slot = int(batch.policy_batches[MID][Columns.ACTIONS]["slot"][row])

    expected_nan = {h: 0.0 for h in ACTION_HEADS}
    expected_inf = {h: 0.0 for h in ACTION_HEADS}
    first_nan: dict[str, int] = {}
    first_inf: dict[str, int] = {}
    skipped_total = 0

    def run(learner, iteration: int) -> None:
        nonlocal skipped_total
        recorder = GradientRecorder(_module(learner))
        try:
            logged = _logged(update(learner, batch, cfg))
            minibatches = recorder.take()
        finally:
            recorder.remove()
        nonfinite = [not all(np.isfinite(g).all() for g in mb) for mb in minibatches]
        skipped_total += sum(nonfinite)
        assert logged[mn.TELEMETRY_ITERATION] == iteration
        assert logged[mn.MINIBATCH_UPDATES] == len(minibatches) >= 2 * (256 // 64)
        assert logged[mn.SKIPPED_UPDATES] == sum(nonfinite), iteration
        assert logged[mn.SKIPPED_UPDATES_TOTAL] == skipped_total, iteration
        assert logged[mn.NAN_GRAD_COUNT] == sum(int(np.isnan(g).sum()) for mb in minibatches for g in mb)
        assert logged[mn.INF_GRAD_COUNT] == sum(int(np.isinf(g).sum()) for mb in minibatches for g in mb)
        for head in ACTION_HEADS:
            assert logged[mn.head_metric(mn.HEAD_NAN_LATCH, head)] == expected_nan[head], (iteration, head)
            assert logged[mn.head_metric(mn.HEAD_INF_LATCH, head)] == expected_inf[head], (iteration, head)
            for template, first in (
                (mn.HEAD_NAN_LATCH_FIRST_ITERATION, first_nan),
                (mn.HEAD_INF_LATCH_FIRST_ITERATION, first_inf),
            ):
                name = mn.head_metric(template, head)
                if head in first:
                    assert logged[name] == first[head], (iteration, name)
                else:
                    assert name not in logged, (iteration, name)
        # The value head has no log-probs, hence no latch.
        assert mn.head_metric(mn.HEAD_NAN_LATCH, "value") not in logged
        if all(np.isfinite(g).all() for mb in minibatches for g in mb):
            # The value head, judged by its own edges (written out here): mean over minibatches of
            # the norm over module.value_head's parameters, fetched by attribute name.
            value_ids = {id(p) for p in _module(learner).value_head.parameters()}
            slots = [i for i, p in enumerate(recorder.params) if id(p) in value_ids]
            per_mb = [np.sqrt(sum(float((mb[i] ** 2).sum()) for i in slots)) for mb in minibatches]
            norm = float(np.mean(per_mb))
            assert logged[mn.head_metric(mn.HEAD_GRAD_NORM, "value")] == pytest.approx(norm, rel=1e-4)
            assert logged[mn.head_metric(mn.HEAD_GRAD_HEALTH, "value")] == band_code(norm, VALUE_EDGES, max(per_mb))
            value_norms.append(norm)

    run(learner, 1)

    bias = _module(learner).heads["tempo"][-1].bias
    saved = bias.detach().clone()
    with torch.no_grad():
        bias.fill_(float("nan"))
    expected_nan["tempo"], first_nan["tempo"] = 1.0, 2
    run(learner, 2)
    with torch.no_grad():
        bias.copy_(saved)

    bias = _module(learner).heads["slot"][-1].bias
    saved = bias.detach().clone()
    with torch.no_grad():
        bias[taken_slot] = float("-inf")  # that action's log-prob is -inf: an Inf, not a NaN
    expected_inf["slot"], first_inf["slot"] = 1.0, 3
    run(learner, 3)
    with torch.no_grad():
        bias.copy_(saved)

    # Iteration 4: +Inf, -Inf and NaN written into one gradient by a tensor hook (registered
    # before the recorder's, so the recorder sees the poisoned gradient): counts, not latches.
    def poison(grad: torch.Tensor) -> torch.Tensor:
        out = grad.clone().reshape(-1)
        out[:4] = torch.tensor([float("inf"), float("-inf"), float("-inf"), float("nan")])
        return out.reshape(grad.shape)

    handle = _module(learner).heads["op"][0].weight.register_hook(poison)
    try:
        run(learner, 4)
    finally:
        handle.remove()
    assert skipped_total >= 2 * 2 * (256 // 64)  # iterations 2 and 4 skipped every minibatch

    restored = build_local_learner(cfg)
    restored.set_state(learner.get_state())
    run(restored, 5)  # latches, first iterations, skipped_total and the clock carry on
    assert len(value_norms) >= 2 and any(2.0 < v <= 10.0 for v in value_norms), value_norms


def test_a_minus_inf_log_prob_on_a_loss_masked_row_never_latches(one_epoch_batch):
    """RLlib's bootstrap rows are loss-masked.  A -inf logit on the taken ``slot`` action of
    masked rows only must not latch (and costs no gradient); on one valid row it must."""
    batch = one_epoch_batch
    cfg = _one_epoch_cfg()
    learner = build_local_learner(cfg)
    module = learner.module[MID].unwrapped()
    space = module.action_space  # a Dict of Discrete heads: logits are concatenated in sorted-key order
    names = sorted(space.spaces)
    start = sum(space[h].n for h in names[: names.index("slot")])
    original = module.forward_train
    target = {"rows": "masked"}

    def forward_train(b, **kw):
        out = dict(original(b, **kw))
        logits = out[Columns.ACTION_DIST_INPUTS]
        mask = b[Columns.LOSS_MASK].bool()
        rows = ~mask if target["rows"] == "masked" else (mask & (mask.cumsum(0) == 1))
        col = start + b[Columns.ACTIONS]["slot"].long()
        hit = torch.zeros_like(logits, dtype=torch.bool)
        hit[torch.arange(logits.shape[0]), col] = True
        out[Columns.ACTION_DIST_INPUTS] = torch.where(hit & rows.unsqueeze(-1), float("-inf"), logits)
        return out

    module.forward_train = forward_train
    mask = np.asarray(batch.policy_batches[MID][Columns.LOSS_MASK], dtype=bool)
    assert (~mask).sum() > 0 and mask.sum() > 0  # the batch has masked (bootstrap) rows

    def logged():
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        return {k: float(v.peek()) for k, v in results[MID].items() if isinstance(k, str) and "/" in k}

    first = logged()
    assert first[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] == 0.0
    assert first[mn.head_metric(mn.HEAD_NAN_LATCH, "slot")] == 0.0
    assert first[mn.SKIPPED_UPDATES] == 0.0 and first[mn.INF_GRAD_COUNT] == 0.0 and first[mn.NAN_GRAD_COUNT] == 0.0
    target["rows"] = "one valid row"
    second = logged()
    assert second[mn.head_metric(mn.HEAD_INF_LATCH, "slot")] == 1.0
    assert second[mn.head_metric(mn.HEAD_INF_LATCH_FIRST_ITERATION, "slot")] == 2.0
    assert all(second[mn.head_metric(mn.HEAD_INF_LATCH, h)] == 0.0 for h in names if h != "slot")


# --- the replica check: cadence and a diverged twin ------------------------------------------------


def _python_checksum(params) -> tuple[float, float]:
    """The replica checksum in exact integers: sum_i bits_i * ((i * 2654435761 + 1) | 1) mod 2^48."""
    bits = np.concatenate([p.detach().float().numpy().reshape(-1) for p in params]).view(np.int32)
    total = sum(int(b) * ((i * 2654435761 + 1) | 1) for i, b in enumerate(bits.tolist())) % (1 << 48)
    return float(total >> 24), float(total & ((1 << 24) - 1))


def _pair_at(values: np.ndarray, pair: tuple[float, float]) -> list[int]:
    return [i for i in range(len(values) - 1) if (values[i], values[i + 1]) == pair]


class _TwinReplicaCollective:
    """Stands in for a 2-learner collective whose other replica is bitwise identical: the
    SUM all-reduce of identical inputs is 2x this learner's own tensor.  ``perturb`` (a digit
    pair) makes the twin's checksum differ by one in its low digit."""

    world_size, rank, active, backend = 2, 0, True, "gloo"

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []
        self.perturb: tuple[float, float] | None = None

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        own = tensor.detach().double().numpy().copy()
        self.seen.append(own)
        tensor.mul_(2)
        if self.perturb is not None:
            (at,) = _pair_at(own, self.perturb)
            tensor[at + 1] += 1
        return tensor

    def destroy(self) -> None:
        pass


def test_replica_check_runs_every_nth_iteration_and_a_diverged_twin_stops_the_run(one_epoch_batch):
    """``replica_check_every: 2``: this learner's parameter checksum (exact integers, computed
    here) rides in the reduction at iterations 2 and 4 only (the test's own counter); an
    identical twin reads 1, a twin one off in the checksum raises ``ReplicaDivergenceError``."""
    batch = one_epoch_batch
    cfg = _one_epoch_cfg(distributed={"replica_check_every": 2})
    learner = build_local_learner(cfg)
    params = [p for p in learner.module[MID].unwrapped().parameters() if p.requires_grad]
    learner._collective = twin = _TwinReplicaCollective()
    for iteration in range(1, 5):
        results = learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        logged = {k: float(v.peek()) for k, v in results[MID].items() if isinstance(k, str) and "/" in k}
        assert len(twin.seen) == iteration  # one reduction per iteration
        digits = _python_checksum(params)
        assert bool(_pair_at(twin.seen[-1], digits)) == (iteration % 2 == 0), iteration
        assert logged[mn.MINIBATCH_UPDATES] == 1.0 and logged[mn.SKIPPED_UPDATES] == 0.0  # not 2x
        assert logged[mn.TELEMETRY_ITERATION] == iteration
        if iteration % 2 == 0:
            assert logged[mn.REPLICA_CHECKSUM_OK] == 1.0, iteration
    learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)  # 5: no check
    # iteration 6 is a check: the twin's checksum is one off
    original = twin.allreduce_sum

    def perturbing(tensor: torch.Tensor) -> torch.Tensor:
        twin.perturb = _python_checksum(params)
        return original(tensor)

    twin.allreduce_sum = perturbing
    with pytest.raises(ReplicaDivergenceError):
        learner.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)


# --- vgs/*: the numpy VGS on hook-captured raw gradients --------------------------------------------


@pytest.mark.parametrize(
    ("granularity", "method"), [("element", "p90"), ("tensor", "mean")], ids=["element-p90", "tensor-mean"]
)
def test_logged_vgs_metrics_equal_numpy_vgs_on_hook_captured_gradients(granularity, method):
    """Two iterations of 8 minibatches with warmup 10: iteration 1 logs warmup, iteration 2 the
    factor; every ``vgs/*`` metric equals the numpy VGS fed the raw (pre-scaling) gradients."""
    settings = {"beta": 0.9, "alpha": 2.0, "eps": 1e-8, "warmup_steps": 10}
    cfg = _cfg(vgs={"enabled": True, "aggregation_method": method, "granularity": granularity, **settings})
    learner = build_local_learner(cfg)
    module = _module(learner)
    assert sum(p.numel() for p in module.parameters()) <= learner.vgs.quantile_sample_size  # exact percentiles
    batch = train_batch(learner, sample_episodes(cfg, learner, 256))
    recorder = GradientRecorder(module)
    seen: list[list[np.ndarray]] = []
    try:
        for iteration in (1, 2):
            logged = _logged(update(learner, batch, cfg))
            seen += recorder.take()
            expected = numpy_vgs_metrics(seen, aggregation_method=method, granularity=granularity, **settings)
            assert expected[mn.VGS_WARMUP_ACTIVE] == float(iteration == 1)
            assert_vgs_metrics_close(logged, expected)
    finally:
        recorder.remove()
    assert expected[mn.VGS_SCALING_FACTOR] < 0.999  # the factor acted in iteration 2


def _cartpole_learner(agents: int, **gradmon):
    config = cartpole_config(
        "ppo", with_gradmon(PPOTorchLearner), agents=agents, gradmon={"heads": HEADS, **gradmon}, training=NO_KL
    )
    return config, config.build_learner(spaces=spaces_of(config))


def _trackers(learner) -> dict[str, dict]:
    return {mid: monitor.tracker.state_dict() for mid, monitor in learner.gradmon_modules.items()}


def test_a_checkpoint_of_other_modules_loads_the_modules_both_have(tmp_path, caplog):
    """A three-module checkpoint (RLlib's own ``save_to_path``) restored into a learner that monitors
    fewer (``modules`` narrowed on resume; ``remove_module`` since) loads those it has, their state
    exactly as saved, and names the others in one log line; a one-module checkpoint restored into a
    three-module learner loads that module and starts the other two fresh, their clock at the
    restored one (the next step is iteration 2 for every module: the test's own count)."""
    config, saved = _cartpole_learner(3)
    narrowed = fresh = None
    try:
        batch = sample_batch(config, saved, num_timesteps=128)
        saved.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        written = _trackers(saved)
        saved.save_to_path(tmp_path / "three")
        _, narrowed = _cartpole_learner(3, modules=["p0"])
        with caplog.at_level("WARNING"):
            narrowed.restore_from_path(tmp_path / "three")
        assert _trackers(narrowed) == {"p0": written["p0"]} and narrowed.gradmon_iteration == 1
        notes = [r.getMessage() for r in caplog.records if "not loaded" in r.getMessage()]
        assert len(notes) == 1 and "module(s) ['p1', 'p2']" in notes[0] and "\n" not in notes[0], notes
        saved.remove_module("p2")
        saved.restore_from_path(tmp_path / "three")
        assert _trackers(saved) == {mid: written[mid] for mid in ("p0", "p1")}

        _, fresh = _cartpole_learner(3)
        before = _trackers(fresh)
        fresh.set_state(narrowed.get_state())  # only p0's gradmon state
        after = _trackers(fresh)
        assert after["p0"] == written["p0"]
        for mid in ("p1", "p2"):
            assert after[mid] == {**before[mid], "iteration": 1}, mid
        results = fresh.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=None)
        assert {mid: results[mid][mn.TELEMETRY_ITERATION].peek() for mid in ("p0", "p1", "p2")} == dict.fromkeys(
            ("p0", "p1", "p2"), 2.0
        )
    finally:
        for learner in (saved, narrowed, fresh):
            if learner is not None:
                learner.shutdown()
