"""No host read per minibatch beyond stock RLlib's, and per-minibatch telemetry that does not grow
with the number of modules: counted op by op with a ``TorchDispatchMode`` (``telemetry.op_counts``).

On a CPU a host read costs nothing, but on a GPU the same op (``.item()``, ``bool(t)``,
``t.nonzero()``, ``data[bool_mask]``, a device->host copy) waits for the device to drain its
queue: one per minibatch and module is what made 8 modules cost 17% on an H200.  The counts are
taken inside ``Learner._update`` (one call per minibatch: forward, loss, backward, the
telemetry, the optimizer step) and over whole ``update`` calls, on the same batch, for:

* the baseline a competent user runs: stock ``PPOTorchLearner`` with fused Adam;
* ``with_gradmon`` of that same learner (the drop-in: stock's loss, so stock's host reads);
* ``GradmonPPOTorchLearner`` (its own sync-free loss: no host read per minibatch at all).

Bugs these catch: a ``bool(tensor)``/``.item()`` in the norm pass, the skip decision or the
records (one per minibatch and module), per-module kernels in the norm pass (the 8-module count
grows), a second norm pass or record per module.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner

from gradmon_ray.config import GradmonConfig
from gradmon_ray.rllib import with_gradmon
from gradmon_ray.rllib.local_learner import sample_episodes, train_batch, update
from gradmon_ray.telemetry.op_counts import OpCounter, counting_calls
from tests.rllib.arms import ARMS, FusedAdamPPOTorchLearner, count_update, drop_in, small_config

MODULES = [1, 2, 8]
MINIBATCHES = 2
"""32-row minibatches an update (RLlib adds one for the episodes' bootstrap rows): every count
below is per minibatch or per update, so two show it as well as more."""


def _ids(param: tuple[int, bool]) -> str:
    return f"{param[0]}-modules-vgs-{'on' if param[1] else 'off'}"


def _config(modules: int, vgs: bool = False) -> GradmonConfig:
    return small_config(modules, minibatches=MINIBATCHES, vgs=vgs)


@pytest.fixture(scope="module", params=[(m, True) for m in MODULES], ids=_ids)
def counted(request):
    """Per arm, the op counts of one update of ``MINIBATCHES`` minibatches on one shared batch, VGS on.
    (VGS off: ``test_op_budget.py`` counts those same arms at 1, 2 and 8 modules and checks its
    counts with the two functions below; its drop-in's norm pass is the one whose kernels it counts.)"""
    modules, vgs = request.param
    cfg = _config(modules, vgs)
    learners = {name: build(cfg) for name, build in ARMS.items()}
    weights = learners["gradmon"].module.get_state()
    for learner in learners.values():
        learner.module.set_state(weights)
    batch = train_batch(learners["gradmon"], sample_episodes(cfg, learners["gradmon"], cfg.ppo.train_batch_size))
    counts = {name: count_update(learner, batch, cfg) for name, learner in learners.items()}
    for learner in learners.values():
        learner.shutdown()
    return modules, vgs, counts


def test_no_host_read_per_minibatch_beyond_stock_rllib(counted):
    modules, _, counts = counted
    assert counts["stock-fused"][0].calls >= MINIBATCHES
    assert_no_host_read_per_minibatch_beyond_stock(modules, counts)


def test_whole_update_adds_one_host_read_outside_the_minibatches(counted):
    _, _, counts = counted
    assert_one_host_read_outside_the_minibatches(counts)


def assert_no_host_read_per_minibatch_beyond_stock(modules: int, counts: dict[str, Any]) -> None:
    """``counts``: per arm (``ARMS``' names), ``count_update``'s counters of one update."""
    stock, drop_in, gradmon = (counts[arm][0] for arm in ("stock-fused", "drop-in", "gradmon"))
    minibatches = stock.calls
    assert minibatches == gradmon.calls
    # Stock's masked means index with the loss mask (``data[mask]``, 5 terms and one backward
    # ``index_put``) besides RLlib's ``_compute_off_policyness`` (one ``data[mask]`` per module);
    # its loss also copies host data to the device twice: ``torch.tensor(0.0, device=...)`` for
    # the KL term when ``use_kl_loss`` is off, and ``explained_variance``'s
    # ``torch.tensor([-1.0]).to(pred.device)`` (RLlib 2.60's ``ppo_torch_learner.py`` and
    # ``utils/torch_utils.py``): pageable host->device copies, a wait on a GPU.
    per_module = modules * minibatches
    assert stock.host_reads == {
        "aten::index": 6 * per_module,
        "aten::index_put": per_module,
        "torch.tensor(device=)": per_module,
        "Tensor.to": per_module,
    }
    assert drop_in.host_reads == stock.host_reads, "the drop-in adds no host read to stock's loss and step"
    # GradmonPPOTorchLearner's loss masks with ``where``: only RLlib's ``_compute_off_policyness`` is left.
    assert gradmon.host_reads == {"aten::index": modules * minibatches}, dict(gradmon.host_reads)


def assert_one_host_read_outside_the_minibatches(counts: dict[str, Any]) -> None:
    """Outside the minibatches, gradmon reads the host exactly once more than stock RLlib (whose
    metric reduction reads it too): the once-per-step drain's one copy of one packed buffer
    (``Tensor.cpu``), whatever the number of modules, and nothing else."""
    outside = {arm: c[2].host_reads - c[0].host_reads for arm, c in counts.items()}
    stock = outside["stock-fused"]
    assert stock.total() > 0, stock
    for arm in ("drop-in", "gradmon"):
        assert outside[arm] - stock == {"Tensor.cpu": 1} and stock - outside[arm] == {}, (arm, outside)


def test_two_learners_add_one_host_read_per_update_for_the_gradient_average(world):
    """A drop-in as one of two learners (``num_learners=2``, a real one-process gloo world: RLlib's
    DDP modules, gradmon's own gradient average, ``rllib.module_sync``) against a stock single
    learner on the same batch: per update two host reads beyond stock's, whatever the number of
    minibatches: the presence exchange's one read of the learners' marks (``Tensor.tolist``, in
    the first minibatch) and the drain's one copy (``Tensor.cpu``); the per-minibatch average is
    one flat all-reduce, no read.  Bugs this catches: marks built
    from host data every update (a host->device copy: a second sync), a read per minibatch in the
    average."""
    from tests.peer.pairs import HEADS, build_pair, cartpole_config, sample_batch

    stock_config = cartpole_config("ppo", PPOTorchLearner, agents=2)
    config = cartpole_config("ppo", with_gradmon(PPOTorchLearner), agents=2, gradmon={"heads": HEADS})
    config.learners(num_learners=2)
    stock, learner = build_pair(stock_config, config)
    batch = sample_batch(stock_config, stock, num_timesteps=128)
    counts = {}
    for name, arm in (("stock", stock), ("two-learners", learner)):
        arm.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=32)  # the patterns' buffers
        per_minibatch = OpCounter()
        with counting_calls(arm, "_update", per_minibatch), OpCounter() as whole:
            arm.update(batch=batch, timesteps={}, num_epochs=1, minibatch_size=32)
        counts[name] = (per_minibatch, whole)
    (stock_mb, stock_whole), (mb, whole) = counts["stock"], counts["two-learners"]
    assert mb.calls == stock_mb.calls >= 4
    # The presence is exchanged in the update's first minibatch (then kept for the update).
    assert mb.host_reads - stock_mb.host_reads == {"Tensor.tolist": 1}, (dict(mb.host_reads), dict(stock_mb.host_reads))
    assert stock_mb.host_reads - mb.host_reads == {}
    assert whole.host_reads - stock_whole.host_reads == {"Tensor.tolist": 1, "Tensor.cpu": 1}
    assert stock_whole.host_reads - whole.host_reads == {}
    for arm in (stock, learner):
        arm.shutdown()


class _SeededRead(with_gradmon(FusedAdamPPOTorchLearner)):
    """The drop-in with one host read seeded into every minibatch's loss (``seed``, on the
    action-distribution inputs), for the counter's own test."""

    seed: Any = None

    def compute_loss_for_module(self, *, module_id: Any, config: Any, batch: dict, fwd_out: dict) -> Any:
        if type(self).seed is not None:
            type(self).seed(fwd_out["action_dist_inputs"])
        return super().compute_loss_for_module(module_id=module_id, config=config, batch=batch, fwd_out=fwd_out)


SEEDED_READS = {
    "tolist": (lambda x: x.tolist(), "Tensor.tolist"),
    "numpy": (lambda x: x.detach().numpy(), "Tensor.numpy"),
    "cpu": (lambda x: x.cpu(), "Tensor.cpu"),
    "item": (lambda x: x.sum().item(), "aten::_local_scalar_dense"),
    "float": (lambda x: float(x.sum()), "aten::_local_scalar_dense"),
    "to-cpu": (lambda x: x.to("cpu"), "Tensor.to(cpu)"),
    "copy-into-host": (lambda x: torch.tensor([0.0]).copy_(x.detach().sum().reshape(1)), "Tensor.copy_"),
    "tensor-on-device": (lambda x: torch.tensor([1.0], device=x.device), "torch.tensor(device=)"),
    "host-tensor-to-device": (lambda x: torch.tensor([1.0]).to(x.device), "Tensor.to"),
    "copy-from-host": (lambda x: x.new_zeros(1).copy_(torch.tensor([1.0])), "Tensor.copy_"),
}


@pytest.fixture(scope="module")
def seeded_learner():
    cfg = _config(1)
    learner = drop_in(cfg, _SeededRead)
    batch = train_batch(learner, sample_episodes(cfg, learner, cfg.ppo.train_batch_size))
    update(learner, batch, cfg)
    yield learner, batch, cfg
    learner.shutdown()


def _minibatch_reads(learner: Any, batch: Any, cfg: GradmonConfig) -> OpCounter:
    counter = OpCounter()
    with counting_calls(learner, "_update", counter):
        update(learner, batch, cfg)
    return counter


@pytest.mark.parametrize("kind", list(SEEDED_READS))
def test_the_counter_sees_every_kind_of_host_read_seeded_into_an_update(seeded_learner, kind):
    """Each way a GPU update waits for the device, seeded once into every minibatch of a CPU update,
    is counted once per minibatch under its name (``op_counts``): device->host reads that never
    reach the dispatcher on a CPU (``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``, a copy
    into a host tensor), those that do (``.item()``, ``float(t)``) and pageable host->device
    copies (a tensor made from host data on the device, moved there, or copied in)."""
    learner, batch, cfg = seeded_learner
    seed, name = SEEDED_READS[kind]
    _SeededRead.seed = None
    clean = _minibatch_reads(learner, batch, cfg)
    _SeededRead.seed = staticmethod(seed)
    try:
        seeded = _minibatch_reads(learner, batch, cfg)
    finally:
        _SeededRead.seed = None
    assert seeded.calls == clean.calls >= MINIBATCHES
    assert seeded.host_reads - clean.host_reads == {name: seeded.calls}, dict(seeded.host_reads - clean.host_reads)
