"""Every metric, tag and param name gradmon-ray writes, in one place.

``docs/metrics.md`` is generated from these docstrings (``docs/gen_metrics.py``; ``tests/test_docs.py``
fails when stale), ``docs/oracles.md`` names each one's independent test.  Per-head names use the
helpers of ``gradmon_ray.head_labels``, re-exported here, so the spelling lives only in these two
modules; ``gradmon_ray.metric_parsing`` is the one place that reads the names back.
"""

from __future__ import annotations

from collections.abc import Callable

# Re-exported: every reader says ``mn.head_metric``, ``mn.is_value_head``, ...
from gradmon_ray.head_labels import (
    VALUE_HEAD_NAMES,
    describe_head,  # noqa: F401
    format_value_heads,  # noqa: F401
    head_label,  # noqa: F401
    head_metric,  # noqa: F401
    is_value_head,  # noqa: F401
    module_metric,  # noqa: F401
    parse_value_heads,  # noqa: F401
    split_head_label,  # noqa: F401
    value_heads_among,  # noqa: F401
)

VALUE_HEAD = VALUE_HEAD_NAMES[0]
"""The reported name of gradmon's own modules' value head (an action head may not be called that)."""

# --- TELE-320: per-head gradient L2 norms (after backward, before clipping) ----------
HEAD_GRAD_NORM = "grad/head/{head}/norm"
"""Mean over the iteration's minibatches of the head's gradient L2 norm (NaN: no grads)."""
HEAD_GRAD_NORM_MAX = "grad/head/{head}/norm_max"
"""The largest of the iteration's minibatch norms of the head (a spike the mean averages away)."""
HEAD_GRAD_NORM_P95 = "grad/head/{head}/norm_p95"
"""95th percentile (linear interpolation, ``numpy.percentile``'s default) of the iteration's minibatch norms."""
HEAD_GRAD_NORM_ARGMAX = "grad/head/{head}/argmax_minibatch"
"""Index (from 0, over all epochs) of the minibatch with ``HEAD_GRAD_NORM_MAX``; the three left out without gradient."""
HEAD_GRAD_NORM_PREV = "grad/head/{head}/norm_prev"
"""The previous iteration's value of ``HEAD_GRAD_NORM`` (trend detection)."""
HEAD_GRAD_TREND = "grad/head/{head}/trend"
"""+1 rising (delta > 0.01), -1 falling (< -0.01), 0 steady (``trend_arrow``); APPO/IMPALA: a mean (note)."""
HEAD_GRAD_HEALTH = "grad/head/{head}/health"
"""Health band as a code, see ``HEALTH_CODES``."""
HEAD_NOISE_SCALE = "grad/head/{head}/noise_scale"
"""B_simple = EMA(tr Sigma) / EMA(|G|^2) over the head's parameters (one learner: its first epoch); left out
(never NaN) while EMA(|G|^2) <= 0 (``telemetry.noise_scale``; RLlib's result shows NaN for a key left out)."""
GLOBAL_NOISE_SCALE = "grad/noise_scale"
"""B_simple over all parameters: about the critical batch size; left out while undefined (``HEAD_NOISE_SCALE``)."""
HEAD_GRAD_NORM_CV = "grad/head_norm_cv"
"""Population std / mean of the finite action-head norms; left out (never NaN) with fewer than two."""

# --- how far each head moved in the iteration (telemetry.param_movement) -------------------
HEAD_UPDATE_RATIO = "grad/head/{head}/update_ratio"
"""|theta_end - theta_start| / |theta_start| of the head's weights over the iteration (all its updates)."""
UPDATE_RATIO = "grad/update_ratio"
"""``HEAD_UPDATE_RATIO`` over every trainable parameter of the module."""
HEAD_PARAM_NORM = "grad/head/{head}/param_norm"
"""L2 norm of the head's weights at the iteration's end."""
HEAD_ZERO_GRAD_FRACTION = "grad/head/{head}/zero_grad_fraction"
"""Fraction of the head's gradient elements exactly 0 in the iteration's last minibatch (dead units)."""
HEAD_UPDATE_BAND = "grad/head/{head}/update_band"
"""-1 below, 0 inside, 1 above ``telemetry.bands.update_ratio`` (update ratio / updates; CS231n: ~1e-3)."""

SHARED_GRAD_NORM = "grad/shared_norm"
"""Every ``telemetry.shared_gradients_every`` iterations: the norm of the module's own loss's gradient on the
parameters two or more modules' losses reach (a shared encoder)."""
SHARED_GRAD_COSINE_MIN = "grad/shared_cosine_min"
"""Its lowest cosine with another module's (-1: opposite pulls); every pair: tag ``TAG_SHARED_COSINES``."""

# --- TELE-310/300/301: global norm and non-finite gradient element counts -----------
GLOBAL_GRAD_NORM = "grad/global_norm"
"""Mean over minibatches of the L2 norm over all trainable parameters, before clipping."""
NAN_GRAD_COUNT = "grad/nan_count"
"""Number of NaN gradient elements summed over the iteration's minibatches."""
INF_GRAD_COUNT = "grad/inf_count"
"""Number of +-Inf gradient elements summed over the iteration's minibatches."""
CLIP_BINDING_FRACTION = "grad/clip_binding_fraction"
"""Fraction of the minibatches with a finite global norm above ``grad_clip`` before clipping (the clip
acted); only with ``grad_clip_by="global_norm"``, left out otherwise."""

# --- TELE-302/303: per-head OR-latches on the heads' log-probs ---------------------
HEAD_NAN_LATCH = "latch/nan/{head}"
"""1 once any NaN was seen in this head's log-probs during the run, else 0. Never resets."""
HEAD_INF_LATCH = "latch/inf/{head}"
"""1 once any +-Inf was seen in this head's log-probs during the run, else 0."""
HEAD_NAN_LATCH_FIRST_ITERATION = "latch/nan/{head}/first_iteration"
"""Training iteration at which the head's NaN latch first fired (logged once latched)."""
HEAD_INF_LATCH_FIRST_ITERATION = "latch/inf/{head}/first_iteration"
"""Training iteration at which the head's Inf latch first fired (logged once latched)."""

# --- policy head health: per-head entropy, KL and the collapse latch ---------------
# Heads: the action distribution's components (the log-prob latches' heads).  Measured once per
# telemetry step on the step's last minibatch: the same minibatch RLlib's own ``entropy`` and
# ``mean_kl_loss`` (logged with window=1) report; with several learners, the mean over learners.
HEAD_ENTROPY = "policy/head/{head}/entropy"
"""The head's policy entropy in nats, mean over the step's last minibatch's (unmasked) rows; the sum
over heads is RLlib's ``entropy`` for a factored distribution.  Left out of a step without a minibatch."""
HEAD_ENTROPY_NORM = "policy/head/{head}/entropy_norm"
"""``entropy / log(number of actions of the head)``: 1 uniform, 0 one action certain.  Left out for a
head with a single action (log 1 = 0: nothing to collapse)."""
HEAD_KL = "policy/head/{head}/kl"
"""KL(sampling policy || current policy) of the head in nats, RLlib's ``mean_kl_loss`` direction
(``prev_dist.kl(dist)``), same minibatch as ``HEAD_ENTROPY``; the sum over heads is ``mean_kl_loss``."""
HEAD_COLLAPSE_LATCH = "latch/collapse/{head}"
"""1 once the head's ``entropy_norm`` stayed below ``telemetry.bands.collapse.threshold`` for
``iterations`` consecutive telemetry steps, else 0. Never resets (restored from checkpoints)."""
HEAD_COLLAPSE_LATCH_FIRST_ITERATION = "latch/collapse/{head}/first_iteration"
"""Training iteration at which the head's collapse latch fired (logged once latched)."""

# --- update bookkeeping -----------------------------------------------------------
MINIBATCH_UPDATES = "update/minibatches"
"""Minibatch updates attempted this iteration (epochs x minibatches)."""
SKIPPED_UPDATES = "update/skipped"
"""Minibatch updates skipped this iteration because a gradient was NaN/Inf."""
SKIPPED_UPDATES_TOTAL = "update/skipped_total"
"""Skipped minibatch updates since the start of the run (restored from checkpoints)."""
SCALER_SKIPPED_UPDATES = "update/scaler_skipped"
"""Mixed precision: minibatch updates the grad scaler skipped (overflow; it backs off); not in ``update/skipped``."""
GRAD_SCALE = "update/grad_scale"
"""Mixed precision only: the grad scaler's loss scale at the iteration's last minibatch."""
TELEMETRY_ITERATION = "update/telemetry_iteration"
"""The learner's own 1-based count of training iterations (the latches' clock)."""
REPLICA_CHECKSUM_OK = "update/replica_checksum_ok"
"""1 when all learner replicas' parameters were bitwise identical (every ``distributed.replica_check_every``
iterations with 2+ learners; a mismatch stops training with ReplicaDivergenceError)."""
LEARNERS_UPDATED = "update/trained"
"""1 when the learners trained; 0 when they had nothing to train on (every EnvRunner down): no telemetry then."""

# --- training progress (copied from RLlib's result dict) --------------------------
EPISODE_RETURN_MEAN = "env/episode_return_mean"
EPISODE_LEN_MEAN = "env/episode_len_mean"
ENV_STEPS_SAMPLED_LIFETIME = "env/steps_sampled_lifetime"
POLICY_LOSS = "loss/policy"
VF_LOSS = "loss/value"
ENTROPY = "loss/entropy"
MEAN_KL = "loss/mean_kl"
TOTAL_LOSS = "loss/total"
VF_EXPLAINED_VAR = "loss/vf_explained_var"
"""RLlib's ``vf_explained_var``: 1 - Var(value targets - predictions) / Var(value targets), clamped at -1."""
ITERATION_TIME_S = "perf/iteration_time_s"
ENV_RUNNERS_HEALTHY = "env/runners_healthy"
"""Remote EnvRunners healthy at the end of the iteration (RLlib's fault-tolerance count)."""
ENV_RUNNER_RESTARTS = "env/runner_restarts"
"""EnvRunner restarts since the start of the algorithm (RLlib restarts crashed EnvRunners)."""

# --- Variance Gradient Scaler (seed 002's names, exactly) -------------------------
VGS_STOCHASTIC_VAR_P10 = "vgs/stochastic_var_p10"
"""10th percentile of the per-parameter normalized temporal variance."""
VGS_STOCHASTIC_VAR_P50 = "vgs/stochastic_var_p50"
VGS_STOCHASTIC_VAR_P90 = "vgs/stochastic_var_p90"
VGS_STOCHASTIC_VAR_MEAN = "vgs/stochastic_var_mean"
VGS_GRAD_NORM_EMA = "vgs/grad_norm_ema"
"""Spatial (legacy): EMA of the global gradient L2 norm, before VGS scaling (element granularity
on a model larger than the VGS sample: estimated from the sample's elements)."""
VGS_GRAD_MEAN_EMA = "vgs/grad_mean_ema"
"""Spatial (legacy): EMA of the mean over all gradient elements (or the VGS sample's, see above)."""
VGS_GRAD_VAR_EMA = "vgs/grad_var_ema"
"""Spatial (legacy): EMA of the variance across all gradient elements (not noise!; or the sample's)."""
VGS_GRAD_MAX_EMA = "vgs/grad_max_ema"
"""Spatial (legacy): EMA of the largest |gradient element| (or the VGS sample's largest)."""
VGS_NORMALIZED_VARIANCE = "vgs/normalized_variance"
"""The aggregated (p90 / mean / weighted_mean) normalized temporal variance VGS scales by."""
VGS_SCALING_FACTOR = "vgs/scaling_factor"
VGS_STEP_COUNT = "vgs/step_count"
VGS_WARMUP_ACTIVE = "vgs/warmup_active"
# fmt: off
VGS_DEVICE_METRICS: tuple[str, ...] = (VGS_STOCHASTIC_VAR_P10, VGS_STOCHASTIC_VAR_P50, VGS_STOCHASTIC_VAR_P90,
    VGS_STOCHASTIC_VAR_MEAN, VGS_GRAD_NORM_EMA, VGS_GRAD_MEAN_EMA, VGS_GRAD_VAR_EMA, VGS_GRAD_MAX_EMA,
    VGS_NORMALIZED_VARIANCE, VGS_SCALING_FACTOR)
# fmt: on
"""Order of ``VarianceGradientScaler.metrics_tensor()``."""
VGS_HOST_METRICS: tuple[str, ...] = (VGS_STEP_COUNT, VGS_WARMUP_ACTIVE)

# --- GradientProbe (seeds 004 + 003): logged by the probe actor, per bucket --------
# <bucket> is bucket_1 (lowest group reward std) .. bucket_K (highest); <component> is
# task, entropy, kl, value or a regularizer's name.  Step = the probed training iteration.
PROBE_COMPONENT_NORM = "grad_norm/{bucket}/{component}"
"""L2 norm over all parameters of the component's gradient (as it enters the loss, with its coefficient)."""
PROBE_PER_SAMPLE_NORM = "grad_norm/{bucket}/per_sample/{component}"
"""``PROBE_COMPONENT_NORM`` divided by the bucket's number of episodes."""
PROBE_PER_TOKEN_NORM = "grad_norm/{bucket}/per_token/{component}"
"""``PROBE_COMPONENT_NORM`` divided by the bucket's number of (unmasked) env steps."""
PROBE_LOSS = "grad_norm/{bucket}/loss/{loss}"
"""The bucket's PPO loss terms: policy, entropy, kl, value, total (unweighted, as RLlib logs them)."""
PROBE_REWARD_STD_MEAN = "grad_norm/{bucket}/reward_std_mean"
"""Mean over the bucket's groups of the group reward std."""
PROBE_NUM_GROUPS = "grad_norm/{bucket}/num_groups"
PROBE_NUM_EPISODES = "grad_norm/{bucket}/num_episodes"
PROBE_NUM_STEPS = "grad_norm/{bucket}/num_steps"
PROBE_HEAD_NORM = "grad_norm/{bucket}/head/{head}/{component}"
"""The PPO component's gradient norm over one head's parameters (action heads and value)."""
PROBE_SHARE = "grad_norm/{bucket}/share/{component}"
"""Signed share <g_c, g>/|g|^2 of a PPO component in their summed gradient g (the shares sum to 1)."""
PROBE_COSINE = "grad_norm/{bucket}/cosine/{pair}"
"""Cosine similarity of two PPO components' gradients, ``<a>_vs_<b>``."""
PROBE_REGULARIZER_GRAD_NORM = "grad_norm/{bucket}/regularizer/{regularizer}_grad_norm"
"""ADR-009: the weighted regularizer's gradient norm (NaN when it failed)."""
PROBE_REGULARIZER_ERROR = "grad_norm/{bucket}/regularizer/{regularizer}_grad_norm_error"
"""ADR-009: 1 when the regularizer raised or was not differentiable, else 0."""
PROBE_REGULARIZER_SHARE = "grad_norm/{bucket}/regularizer/{regularizer}_share"
"""Signed share of the regularizer in the regularizers' summed gradient."""
PROBE_REGULARIZER_TOTAL = "grad_norm/{bucket}/regularizer/total_grad_norm"
"""ADR-009: norm of the gradient of the weighted sum of the working regularizers."""
PROBE_DURATION_S = "probe/duration_s"
"""Wall time the probe actor spent on this iteration's analysis."""
PROBE_NUM_BUCKETS = "probe/num_buckets"
PROBE_NUM_GROUPS_TOTAL = "probe/num_groups"
"""Groups found in the probed batch (rank 0's shard with several learners)."""
# Counters kept by the learner (rank 0), cumulative over the run, logged every iteration.
PROBE_REQUESTS_SENT = "probe/requests_sent"
PROBE_REQUESTS_DROPPED = "probe/requests_dropped"
"""Probe iterations skipped because the previous probe was still running (never queued)."""
PROBE_COMPLETED = "probe/completed"
PROBE_SKIPPED = "probe/skipped"
"""Probes that ran but could not bucket the batch (fewer groups than buckets)."""
PROBE_FAILURES = "probe/failures"
"""Probe requests that failed: actor died or restarting, or the analysis raised."""

# --- diagnosis of a non-finite event (rllib.diagnosis; docs/diagnosis.md) ---------
DIAGNOSIS_REPRODUCED = "diagnosis/reproduced"
"""After a NaN/Inf gradient, skip or latch: 1 the re-run on a copy was non-finite again (data or weights),
0 not (transient); with several learners the fraction of them; left out when nothing was re-run."""
DIAGNOSIS_MINIBATCH = "diagnosis/minibatch"
"""The first minibatch (from 0, over all epochs of the iteration) with a non-finite gradient or row."""
TAG_DIAGNOSIS = "gradmon.diagnosis"
"""JSON list of the last event's ``Diagnosis`` per module; ``TAG_SKIPPED``: ``iteration 3: skipped 34/34``."""
TAG_SKIPPED = "gradmon.skipped"
TAG_SHARED_COSINES = "gradmon.shared_cosines"
"""JSON ``{"<a>_vs_<b>": cosine}`` of the modules' gradients on shared parameters (the last measurement)."""

# --- gradient-health early stopping (health_stop config) --------------------------
HEALTH_STOP_REASON = "health/stop_reason"
"""Logged once, at the iteration a health rule stopped the run: 1 dead, 2 exploding, 3 NaN latch, 4 Inf latch,
5 collapse latch, 6 spiking, 7 reproduced non-finite."""

# --- MLflow tags ------------------------------------------------------------------
TAG_NAN_LATCHED_HEADS = "gradmon.nan_latched_heads"
"""Comma-separated heads whose NaN latch fired (absent while none has)."""
TAG_INF_LATCHED_HEADS = "gradmon.inf_latched_heads"
TAG_HEAD_NAMES = "gradmon.head_names"
"""Comma-separated head names: the action heads in action-space order (a ``Dict`` space's sorted keys,
or ``model.head_names`` for ``MultiDiscrete``), then the value heads; the same in every run."""
TAG_VALUE_HEADS = "gradmon.value_heads"
"""Comma-separated value heads (judged by the value bands): ``value``, ``vf`` and those the module or the settings'
``value_heads`` declare; written with ``gradmon.head_names`` by a run that declares any (else: those two)."""
TAG_STATUS = "gradmon.status"
"""``running``, ``finished``, ``stopped`` (a health rule ended it) or ``failed``."""
TAG_STOP_REASON = "gradmon.stop_reason"
"""Why a health rule stopped the run, in words (head, rule, iteration)."""
TAG_SWEEP = "gradmon.sweep"
"""On a sweep's parent run and its trials' runs: the sweep's name."""
TAG_RESUMED_FROM = "gradmon.resumed_from_iteration"
"""Set when a run continued from a checkpoint (a Tune trial restart): the last checkpointed iteration."""
TAG_RESTORED_FROM = "gradmon.restored_from"
"""The ``restore_from`` checkpoint a run started from."""
TAG_CHECKPOINT_DIR = "gradmon.checkpoint_dir"
"""Where a ``checkpoint_every`` run keeps its resumable checkpoint (``gradmon-ray train --resume RUN_ID``)."""
TAG_RESUMED_STATE_DIGEST = "gradmon.resumed_state_digest"
"""SHA-256 of the learner's gradmon state right after the restore; equal to the checkpoint's, or the run stops."""
TAG_RECOMPUTED_ITERATIONS = "gradmon.recomputed_iterations"
"""Iterations (``a-b``) trained again after a resume that the failed attempt had already logged:
their MLflow points are the failed attempt's, kept once, never duplicated."""

# Health bands (``classify_grad_norm``) as numbers, because MLflow metrics are floats.
HEALTH_CODES: dict[str, int] = dict(missing=-1, dead=0, weak=1, healthy=2, elevated=3, exploding=4, spiking=5)
TREND_CODES: dict[str, int] = {"↘": -1, "→": 0, "↗": 1}


def _names_shaped(shape: Callable[[str], bool]) -> tuple[str, ...]:
    """Every name constant above (upper case, a ``str``) whose value has ``shape``, in source order:
    the groups below are read off the names, never a second list to keep in step with them."""
    return tuple(v for k, v in list(globals().items()) if k.isupper() and isinstance(v, str) and shape(v))


# The groups, for documentation checks and for readers (``metric_parsing``): per-head templates
# (a ``{head}``), probe templates (a ``{bucket}``), scalars (a path, no placeholder), tags.
PER_HEAD_TEMPLATES: tuple[str, ...] = _names_shaped(lambda n: "{head}" in n and "{bucket}" not in n)
PROBE_TEMPLATES: tuple[str, ...] = _names_shaped(lambda n: "{bucket}" in n)
SCALAR_NAMES: tuple[str, ...] = _names_shaped(lambda n: "/" in n and "{" not in n)
TAG_NAMES: tuple[str, ...] = _names_shaped(lambda n: n.startswith("gradmon."))
PROBE_COUNTERS = (PROBE_REQUESTS_SENT, PROBE_REQUESTS_DROPPED, PROBE_COMPLETED, PROBE_SKIPPED, PROBE_FAILURES)

ABSENT_WHEN_UNDEFINED = (HEAD_NOISE_SCALE, GLOBAL_NOISE_SCALE, HEAD_ENTROPY, HEAD_ENTROPY_NORM, HEAD_KL, HEAD_GRAD_NORM_CV, DIAGNOSIS_REPRODUCED, DIAGNOSIS_MINIBATCH)  # noqa: E501  # fmt: skip
"""Metrics left out of an iteration while undefined; RLlib fills a key missing from one with NaN, readers drop it."""

# The spelling of a probe template's ``{bucket}``: ``probe_bucket`` writes it, ``metric_parsing`` reads it.
_bucket_template = "bucket_{index}"


def probe_metric(template: str, bucket: str, **parts: str) -> str:
    """Fill a probe template, e.g. ``probe_metric(PROBE_COMPONENT_NORM, "bucket_1", component="task")``."""
    return template.format(bucket=bucket, **parts)


def probe_bucket(index: int) -> str:
    """The ``{bucket}`` of the probe templates: ``bucket_1`` (lowest reward std) .. ``bucket_K``;
    ``metric_parsing.bucket_index`` reads it back."""
    return _bucket_template.format(index=index)
