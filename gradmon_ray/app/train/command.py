"""``gradmon-ray train``: a new run (checked up front, then ``run_training``) or ``--resume RUN_ID``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli_common import (
    EXIT_OK,
    add_set_flag,
    check_tracking_server,
    filter_startup_noise,
    print_advisories,
    set_overrides,
    use_uri,
    writable_dir_problem,
)
from gradmon_ray.config import ConfigError, GradmonConfig, load_config

if TYPE_CHECKING:
    from gradmon_ray.app.cli_common import TrackingUri
    from gradmon_ray.app.train.resume import ResumePoint


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gradmon-ray train``."""
    parser.add_argument("--config", help="YAML run config (see tune_configs/default.yaml); defaults when omitted")
    parser.add_argument("--iterations", type=int, help="training iterations (config: iterations)")
    parser.add_argument("--num-learners", type=int, help="remote learner actors (config: resources.num_learners)")
    parser.add_argument("--num-env-runners", type=int, help="EnvRunner actors (config: resources.num_env_runners)")
    parser.add_argument(
        "--mlflow-uri", help="MLflow tracking URI (config: mlflow.tracking_uri; default $MLFLOW_TRACKING_URI)"
    )
    parser.add_argument("--experiment", help="MLflow experiment (config: mlflow.experiment)")
    parser.add_argument(
        "--run-name", help="MLflow run name (config: mlflow.run_name; default <env>-<YYYYmmdd-HHMMSS>-<4 random chars>)"
    )
    parser.add_argument("--seed", type=int, help="seed (config: seed)")
    parser.add_argument("--ray-address", help="Ray cluster address (config: resources.ray_address)")
    parser.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="checkpoint root: each run's resumable checkpoints go to DIR/<run id> (config: checkpoint_dir; "
        "default ./gradmon-checkpoints); with --resume, the root to load from (like $GRADMON_CHECKPOINT_DIR)",
    )
    add_set_flag(parser, "override any config field, e.g. --set ppo.lr=1e-3")
    parser.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue this interrupted MLflow run (its id, or a name only it has) from its last checkpoint, with its "
        "own config, after delivering what it spilled during an outage; --iterations may extend it",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and Ray's logs")


def train_overrides(args: argparse.Namespace) -> dict[str, Any]:
    flags = {
        "iterations": args.iterations,
        "resources.num_learners": args.num_learners,
        "resources.num_env_runners": args.num_env_runners,
        "mlflow.tracking_uri": args.mlflow_uri,
        "mlflow.experiment": args.experiment,
        "mlflow.run_name": args.run_name,
        "seed": args.seed,
        "resources.ray_address": args.ray_address,
        "checkpoint_dir": args.checkpoint_dir,
    }
    return {**{k: v for k, v in flags.items() if v is not None}, **set_overrides(args.set)}


RESUME_FLAGS = ("--iterations", "--mlflow-uri", "--checkpoint-dir", "--ray-address")
"""What ``--resume`` takes besides the run id; the run keeps its own config otherwise."""


def resumed_config(args: argparse.Namespace) -> tuple[GradmonConfig, ResumePoint, TrackingUri]:
    """The run's own config with ``--resume``'s flags applied, its resume point and its tracking URI
    (masked here, where it enters); checked before Ray or MLflow start (``ConfigError``), a local
    store is never created."""
    from gradmon_ray.app.train.resume import resume_point, resume_run_id
    from gradmon_ray.config import default_tracking_uri
    from gradmon_ray.tracking.store_check import local_store_problem

    own = ("config", "num_learners", "num_env_runners", "seed", "experiment", "run_name")  # the run keeps its own
    if any(getattr(args, k) is not None for k in own) or args.set:
        allowed = ", ".join(RESUME_FLAGS[:-1]) + f" and {RESUME_FLAGS[-1]}"
        raise ConfigError("--resume", f"takes the run's own config; only {allowed} may be given")
    uri = args.mlflow_uri or default_tracking_uri()
    tracking = use_uri(uri)
    problem = local_store_problem(uri, must_exist=True)  # the run is read from it: never create one
    if problem:
        raise ConfigError("--mlflow-uri", problem)
    args.resume = resume_run_id(tracking, args.resume)  # a run name only one run has is taken too; the id from here on
    cfg, point = resume_point(tracking, args.resume, args.checkpoint_dir, iterations=args.iterations)
    done = point.iterations_done
    if args.iterations is not None and args.iterations <= done:
        raise ConfigError(
            "--iterations",
            f"{args.iterations} is not more than the {done} iterations run {args.resume} has done; "
            f"give --iterations N with N > {done}, or leave it out to train to the run's own {cfg.iterations}",
        )
    cfg.mlflow.tracking_uri = uri
    if args.iterations is not None:
        cfg.iterations = args.iterations
    if args.ray_address is not None:
        cfg.resources.ray_address = args.ray_address
    return cfg, point, tracking


def check_checkpoint_dir(cfg: GradmonConfig, root: str | Path | None = None) -> None:
    """The checkpoint root a run writes to (``root``, else ``checkpoint_root(cfg)``), checked before
    Ray or MLflow start: else the first checkpoint fails after a whole iteration, leaving a FAILED run."""
    from gradmon_ray.app.train.checkpoints import checkpoint_root

    if cfg.checkpoint_every == 0 and not cfg.checkpoint_dir:  # no checkpoint is ever written
        return
    problem = writable_dir_problem(Path(root).absolute() if root is not None else checkpoint_root(cfg))
    if problem:
        off = "" if cfg.checkpoint_dir else ", or --set checkpoint_every=0 for no resumable checkpoints"
        raise ConfigError("checkpoint_dir", f"{problem}; give --checkpoint-dir a directory you can write to{off}")


def check_up_front(cfg: GradmonConfig, debug: bool, checkpoint_root: str | None = None) -> None:
    """What ``train`` and ``--resume`` check and set up before their banner, Ray or MLflow: Ray's
    and MLflow's start-up noise filtered, the checkpoint root (``checkpoint_root``, default the
    config's), ``preflight``, the tracking server, the advisories."""
    from gradmon_ray.rllib.preflight import preflight

    if not debug:
        filter_startup_noise()
    check_checkpoint_dir(cfg, checkpoint_root)
    preflight(cfg)  # store, GPUs, env, model, restore point: before the banner, Ray or MLflow
    check_tracking_server(cfg)
    print_advisories(cfg)


def resume_command(args: argparse.Namespace) -> int:
    from gradmon_ray.app.ray_start import ray_address_of
    from gradmon_ray.app.resource_wait import ray_address_problem
    from gradmon_ray.app.train.mlflow_run import plotter
    from gradmon_ray.tracking import MlflowSink
    from gradmon_ray.tracking.spill import default_spill_path

    cfg, point, tracking = resumed_config(args)
    own = cfg.model_copy(update={"restore_from": None})  # the resume point replaces restore_from
    check_up_front(own, args.debug, point.checkpoint_root)  # its checkpoints go on into the run's root
    # train finds an unreachable Ray before it opens its run; a resumed run's sink opens before Ray
    problem = ray_address_problem(ray_address_of(cfg))
    if problem:
        field = "--ray-address" if args.ray_address else "resources.ray_address"
        raise ConfigError(field if cfg.resources.ray_address else "RAY_ADDRESS", problem)
    print(
        f"gradmon-ray: resuming run {args.resume} after iteration {point.iterations_done} of {cfg.iterations}",
        flush=True,
    )
    _print_job_spill_line(cfg)
    sink = MlflowSink(
        tracking.uri,
        cfg.mlflow.experiment,
        run_name=cfg.mlflow.run_name,  # the spill file's header: a replay into another store keeps the name
        params=None,
        tags={mn.TAG_STATUS: "running"},  # with the run's status, set back to RUNNING (end_run)
        max_pending=cfg.mlflow.queue_size,
        plots_every=cfg.mlflow.plots_every,
        plot_fn=plotter(cfg.mlflow.plots_every),
        spill_path=default_spill_path(cfg.mlflow.spill_dir, args.resume),
        run_id=args.resume,
        end_run=True,
    )
    outcome = _train(cfg, tracking, sink=sink, resume=point)
    print(f"gradmon-ray: done. MLflow run {outcome.run_id} (resumed)", flush=True)
    return EXIT_OK


def _print_job_spill_line(cfg: GradmonConfig) -> None:
    """In a ``ray job submit`` job, under the banner: where its spill file goes (``messages.job_spill_line``)."""
    from gradmon_ray.app.train.messages import job_spill_line

    line = job_spill_line(cfg.mlflow.spill_dir)
    if line is not None:
        print(line, flush=True)


def _train(cfg: GradmonConfig, tracking: TrackingUri, **kwargs: Any) -> Any:
    """``run_training`` printing its progress; after Ctrl-C, the run id and how to resume it."""
    from gradmon_ray.app.train import run
    from gradmon_ray.app.train.interrupts import TrainingInterrupted
    from gradmon_ray.app.train.messages import ProgressPrinter, interrupted_lines

    try:
        return run.run_training(cfg, progress=ProgressPrinter(tracking), **kwargs)
    except TrainingInterrupted as stop:
        for line in interrupted_lines(stop.outcome, tracking, cfg.iterations):
            print(line, flush=True)
        raise


def train_command(args: argparse.Namespace) -> int:
    from gradmon_ray.app.train.messages import done_lines

    if args.resume:
        return resume_command(args)
    cfg = load_config(args.config, train_overrides(args))  # the one read: passed down from here
    tracking = use_uri(cfg.mlflow.tracking_uri)  # the config file may hold it too; masked once, here
    shown = tracking.shown
    check_up_front(cfg, args.debug)
    print(f"gradmon-ray: training {cfg.iterations} iterations on {cfg.env.id}; MLflow: {shown}", flush=True)
    _print_job_spill_line(cfg)
    outcome = _train(cfg, tracking, checked=True)
    for line in done_lines(outcome, cfg.mlflow.experiment, shown):
        print(line, flush=True)
    return EXIT_OK
