"""``gradmon-ray``: the command line.

Exit codes: 0 success, 2 bad usage or config (one line on stderr naming the field), 1 the
run failed (one line; ``--debug`` shows the traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import yaml

from gradmon_ray.config import ConfigError, GradmonConfig, config_advisories, load_config, load_yaml
from gradmon_ray.tracking.redact import OUTPUT_REDACTOR, redact_uri, uri_secrets
from gradmon_ray.tracking.spill import SpillFormatError
from gradmon_ray.viz.runs import RunLookupError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: status 2, no traceback
        command = " ".join(["gradmon-ray", *self.prog.split()[1:]])  # prog is "gradmon-ray [subcommand]"
        self.exit(EXIT_USAGE, f"gradmon-ray: {message}\n(run '{command} --help' for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``gradmon-ray`` argument parser."""
    parser = _Parser(prog="gradmon-ray", description="Per-head gradient health for multi-head PPO on Ray RLlib.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = sub.add_parser("train", help="train PPO with gradient telemetry, logging to MLflow")
    train.add_argument("--config", help="YAML run config (see tune_configs/default.yaml); defaults when omitted")
    train.add_argument("--iterations", type=int, help="training iterations (config: iterations)")
    train.add_argument("--num-learners", type=int, help="remote learner actors (config: resources.num_learners)")
    train.add_argument("--num-env-runners", type=int, help="EnvRunner actors (config: resources.num_env_runners)")
    train.add_argument(
        "--mlflow-uri", help="MLflow tracking URI (config: mlflow.tracking_uri; default $MLFLOW_TRACKING_URI)"
    )
    train.add_argument("--experiment", help="MLflow experiment (config: mlflow.experiment)")
    train.add_argument("--run-name", help="MLflow run name (config: mlflow.run_name)")
    train.add_argument("--seed", type=int, help="seed (config: seed)")
    train.add_argument("--ray-address", help="Ray cluster address (config: resources.ray_address)")
    _set_flag(train, "override any config field, e.g. --set ppo.lr=1e-3")
    train.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue this interrupted MLflow run from its last checkpoint (trained with checkpoint_every > 0), "
        "with its own config; --iterations may extend it",
    )
    train.add_argument("--debug", action="store_true", help="show tracebacks and Ray's logs")
    sweep = sub.add_parser("tune", help="run a Ray Tune sweep from a sweep file (see tune_configs/*_sweep.yaml)")
    sweep.add_argument("sweep_file", help="sweep YAML: base_config/base, search_space, num_samples, ...")
    sweep.add_argument("--mlflow-uri", help="MLflow tracking URI for the parent and trial runs")
    sweep.add_argument("--ray-address", help="Ray cluster address (default: local Ray or RAY_ADDRESS)")
    sweep.add_argument("--iterations", type=int, help="training iterations per trial (base config: iterations)")
    _set_flag(sweep, "override a base config field for every trial, e.g. --set ppo.train_batch_size=512")
    sweep.add_argument("--debug", action="store_true", help="show tracebacks")
    watch = sub.add_parser("watch", help="live terminal panel of a run's per-head gradient health (from MLflow)")
    which = watch.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="the MLflow run to follow")
    which.add_argument("--experiment", help="follow the newest run of this experiment (default: gradmon-ray)")
    _tracking_uri_flag(watch)
    watch.add_argument("--interval", type=float, default=3.0, help="seconds between refreshes (default 3)")
    watch.add_argument("--once", action="store_true", help="print one frame and exit (scripts, finished runs)")
    watch.add_argument("--debug", action="store_true", help="show tracebacks")
    report = sub.add_parser("report", help="write a run's plots and a Markdown summary to a directory")
    report.add_argument("run_id", help="the MLflow run id")
    report.add_argument("--out", default=None, help="output directory (default: gradmon-report-<run id>)")
    _tracking_uri_flag(report)
    report.add_argument("--debug", action="store_true", help="show tracebacks")
    replay = sub.add_parser("replay", help="write a spill file (iterations MLflow could not take) into MLflow")
    replay.add_argument("spill_file", help="a .jsonl file from mlflow.spill_dir")
    replay.add_argument("--tracking-uri", help="MLflow tracking URI (default: the one the run was writing to)")
    replay.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.set_defaults(subparsers=sub.choices)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; an unknown option is reported by its subcommand (so the usage hint names it)."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.subparsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def _replay(args: argparse.Namespace) -> int:
    from gradmon_ray.tracking.spill import replay_spill

    result = replay_spill(args.spill_file, args.tracking_uri)
    made = "created run" if result.created_run else "run"
    print(
        f"gradmon-ray: replayed {result.iterations} iterations ({result.metrics} metric points) into {made} "
        f"{result.run_id}" + (f", ended {result.status}" if result.status else ""),
        flush=True,
    )
    return EXIT_OK


def _tracking_uri_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    )


def _client(args: argparse.Namespace) -> Any:
    from mlflow.tracking import MlflowClient

    from gradmon_ray.config import default_tracking_uri
    from gradmon_ray.tracking.store_check import local_store_problem

    uri = args.tracking_uri or default_tracking_uri()
    problem = local_store_problem(uri, must_exist=True)  # a read-only command never creates a store
    if problem:
        raise ConfigError("--tracking-uri", problem)
    return MlflowClient(tracking_uri=uri)


def _watch(args: argparse.Namespace) -> int:
    from gradmon_ray.viz.panel import watch

    if args.interval <= 0:
        raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval}")
    watch(_client(args), run_id=args.run_id, experiment=args.experiment, interval_s=args.interval, once=args.once)
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from gradmon_ray.viz.report import write_report

    out = args.out or f"gradmon-report-{args.run_id}"
    files = write_report(_client(args), args.run_id, out)
    print(f"gradmon-ray: wrote {len(files)} files to {out}: " + ", ".join(f.name for f in files), flush=True)
    return EXIT_OK


def _set_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"{help_text} (VALUE is parsed as YAML)"
    )


def _set_overrides(items: Sequence[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` flags as dotted overrides (values parsed as YAML)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        try:
            out[key.strip()] = load_yaml(raw)
        except yaml.YAMLError:
            raise ConfigError(key, f"value {raw!r} is not valid YAML") from None
    return out


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    flags = {
        "iterations": args.iterations,
        "resources.num_learners": args.num_learners,
        "resources.num_env_runners": args.num_env_runners,
        "mlflow.tracking_uri": args.mlflow_uri,
        "mlflow.experiment": args.experiment,
        "mlflow.run_name": args.run_name,
        "seed": args.seed,
        "resources.ray_address": args.ray_address,
    }
    return {**{k: v for k, v in flags.items() if v is not None}, **_set_overrides(args.set)}


def _resume(args: argparse.Namespace) -> int:
    from gradmon_ray.config import default_tracking_uri
    from gradmon_ray.resume import resume_point
    from gradmon_ray.tracking import MlflowSink
    from gradmon_ray.tracking.spill import default_spill_path
    from gradmon_ray.tracking.store_check import uri_scheme_problem
    from gradmon_ray.train import plotter, run_training

    others = {k: v for k, v in vars(args).items() if k in ("config", "num_learners", "num_env_runners", "seed")}
    if any(v is not None for v in others.values()) or args.set:
        raise ConfigError("--resume", "takes the run's own config; only --iterations and --mlflow-uri may be given")
    uri = args.mlflow_uri or default_tracking_uri()
    _use_uri(uri)
    problem = uri_scheme_problem(uri)
    if problem:
        raise ConfigError("--mlflow-uri", problem)
    cfg, point = resume_point(uri, args.resume)
    cfg.mlflow.tracking_uri = uri
    if args.iterations is not None:
        cfg.iterations = args.iterations
    print(
        f"gradmon-ray: resuming run {args.resume} after iteration {point.iterations_done} of {cfg.iterations}",
        flush=True,
    )
    sink = MlflowSink(
        uri,
        cfg.mlflow.experiment,
        params=None,
        max_pending=cfg.mlflow.queue_size,
        plots_every=cfg.mlflow.plots_every,
        plot_fn=plotter(cfg.mlflow.plots_every),
        spill_path=default_spill_path(cfg.mlflow.spill_dir, args.resume),
        run_id=args.resume,
        end_run=True,
    )
    outcome = run_training(cfg, progress=lambda line: print(line, flush=True), sink=sink, resume=point)
    print(f"gradmon-ray: done. MLflow run {outcome.run_id} (resumed)", flush=True)
    return EXIT_OK


def _train(args: argparse.Namespace) -> int:
    if args.resume:
        return _resume(args)
    cfg = load_config(args.config, _overrides(args))
    _use_uri(cfg.mlflow.tracking_uri)  # the config file may hold it too
    from gradmon_ray.rllib.preflight import preflight
    from gradmon_ray.train import run_training

    if not args.debug:
        _filter_startup_noise()
    preflight(cfg)  # store, GPUs, env, model, restore point: before the banner, Ray or MLflow
    _check_tracking_server(cfg)
    _advise(cfg)
    shown = redact_uri(cfg.mlflow.tracking_uri)
    print(f"gradmon-ray: training {cfg.iterations} iterations on {cfg.env.id}; MLflow: {shown}", flush=True)
    outcome = run_training(cfg, progress=lambda line: print(line, flush=True), checked=True)
    if outcome.run_id is None:  # MLflow never answered (mlflow.offline_ok): everything is in the spill file
        where = f"; replay it with: gradmon-ray replay {outcome.spill_path}" if outcome.spill_path else ""
        print(f"gradmon-ray: done, but MLflow at {shown} never took the run{where}", flush=True)
        return EXIT_OK
    print(
        f"gradmon-ray: done. MLflow run {outcome.run_id} in experiment '{cfg.mlflow.experiment}'"
        + ("" if outcome.mlflow_complete else " (MLflow did not receive everything; see warnings)")
        + (f"; checkpoint {outcome.checkpoint_path}" if outcome.checkpoint_path else ""),
        flush=True,
    )
    hint = (
        f"open {shown} in a browser"
        if shown.startswith(("http://", "https://"))
        else f"mlflow ui --backend-store-uri {shown}"
    )
    print(f"gradmon-ray: view it with: {hint}", flush=True)
    return EXIT_OK


def _use_uri(uri: str) -> None:
    """Mask ``uri``'s credentials in this process's output from now on.  MLflow itself prints a
    run's URL, with them, to stdout when the run ends (``_log_url``): off for such a URI (the CLI
    prints its own, masked); set before Ray starts, so that a local Ray's workers inherit it."""
    OUTPUT_REDACTOR.add_uri(uri)
    if uri_secrets(uri):
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def _check_tracking_server(cfg: GradmonConfig) -> None:
    """A tracking server that does not answer now is refused before anything starts (one bounded
    request), unless ``mlflow.offline_ok``: then the run buffers, spills and is replayed later."""
    from gradmon_ray.tracking.store_check import tracking_server_problem

    problem = tracking_server_problem(cfg.mlflow.tracking_uri, offline_ok=cfg.mlflow.offline_ok)
    if problem:
        raise ConfigError("mlflow.tracking_uri", problem)


def _fail_fast_mlflow_http(timeout_s: int) -> None:
    """MLflow's REST client retries 7 times with backoff (minutes per call). ``watch``/``report``
    should fail in seconds; the training sink retries with its own backoff and spills what it
    cannot deliver, so MLflow's retries would only delay it. A user's own settings win."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))


_STARTUP_NOISE = (
    "Token authentication is enabled for this Ray cluster",  # and how to opt out of it: never do that
    "Started a local Ray instance",
    "You are running PPO on the new API stack",
    "Install gputil for GPU system monitoring",
    "Creating initial MLflow database tables",
    "Updating database tables",
    "DeprecationWarning: `RLModule(config=[RLModuleConfig object])` has been deprecated",  # RLlib's own call
)


class _StartupNoiseFilter(logging.Filter):
    """Drops Ray's and MLflow's start-up notices that ask nothing of the user (``--debug`` keeps them)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _STARTUP_NOISE)


def _filter_startup_noise() -> None:
    import warnings

    import mlflow  # noqa: F401  (the imports set up these loggers' own handlers)
    import ray.rllib  # noqa: F401

    for name in ("ray", "ray.rllib", "mlflow"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(_StartupNoiseFilter())
    # RLlib re-registers its own env wrapper on every EnvRunner build.
    warnings.filterwarnings("ignore", message=".*Overriding environment rllib-single-agent-env.*")


def _advise(cfg: Any) -> None:
    for line in config_advisories(cfg):
        print(f"gradmon-ray: warning: {line}", file=sys.stderr, flush=True)


def _tune(args: argparse.Namespace) -> int:
    from gradmon_ray.config import apply_overrides, config_from_dict
    from gradmon_ray.sweep import load_sweep, run_sweep

    sweep, base = load_sweep(args.sweep_file)
    flags = {
        "mlflow.tracking_uri": args.mlflow_uri,
        "resources.ray_address": args.ray_address,
        "iterations": args.iterations,
    }
    base = apply_overrides(base, {**{k: v for k, v in flags.items() if v is not None}, **_set_overrides(args.set)})
    cfg = config_from_dict(dict(base))  # the flags too are validated before Ray starts
    _use_uri(cfg.mlflow.tracking_uri)
    if not args.debug:
        _filter_startup_noise()
    _check_tracking_server(cfg)
    _advise(cfg)
    print(f"gradmon-ray: sweep '{sweep.name}' over {', '.join(sweep.search_space)}", flush=True)
    outcome = run_sweep(sweep, base, progress=lambda line: print(line, flush=True))
    best = f"best run {outcome.best.run_id} ({sweep.metric} {outcome.best.metric:.4g})" if outcome.best else "no best"
    print(f"gradmon-ray: sweep done; MLflow parent run {outcome.parent_run_id}; {best}", flush=True)
    return EXIT_OK if any(t.status != "failed" for t in outcome.trials) else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradmon-ray`` console script."""
    args = _parse(argv)
    logging.basicConfig(
        level=logging.INFO if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    # Every log record and warning of this process is masked from here on (MLflow's and Ray's too).
    OUTPUT_REDACTOR.install()
    for uri in (getattr(args, "mlflow_uri", None), getattr(args, "tracking_uri", None), os.environ.get(URI_ENV)):
        OUTPUT_REDACTOR.add_uri(uri)
    try:
        _fail_fast_mlflow_http(10 if args.command in ("train", "tune") else 5)
        if args.command == "train":
            return _train(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "watch":
            return _watch(args)
        if args.command == "report":
            return _report(args)
        if args.command == "replay":
            return _replay(args)
        raise AssertionError(args.command)
    except ConfigError as exc:
        _error(f"gradmon-ray: config error: {exc}")
        return EXIT_USAGE
    except SpillFormatError as exc:
        _error(f"gradmon-ray: {exc}")
        return EXIT_USAGE
    except RunLookupError as exc:
        _error(f"gradmon-ray: {exc}")
        return EXIT_FAILED if exc.unreachable else EXIT_USAGE
    except KeyboardInterrupt:
        _error("gradmon-ray: interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:  # the traceback, masked like everything else
            _error(traceback.format_exc().rstrip())
        _error(
            f"gradmon-ray: run failed: {type(exc).__name__}: {exc}"
            + ("" if args.debug else " (rerun with --debug for the traceback)")
        )
        return EXIT_FAILED


URI_ENV = "MLFLOW_TRACKING_URI"


def _error(text: str) -> None:
    """One message on stderr, credentials masked (an error may quote the URI it failed on)."""
    print(OUTPUT_REDACTOR(text), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
