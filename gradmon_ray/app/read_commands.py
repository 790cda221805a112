"""The commands that read a run back: ``watch``, ``report`` and ``replay`` (spill file into MLflow)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from gradmon_ray.app.cli_common import EXIT_OK, writable_dir_problem
from gradmon_ray.config import ConfigError
from gradmon_ray.tracking.store_uri import absolute_tracking_uri


def add_tracking_uri_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)"
    )


def read_client(args: argparse.Namespace) -> Any:
    from mlflow.tracking import MlflowClient

    from gradmon_ray.config import default_tracking_uri
    from gradmon_ray.tracking.store_check import local_store_problem

    uri = args.tracking_uri or default_tracking_uri()
    problem = local_store_problem(uri, must_exist=True)  # a read-only command never creates a store
    if problem:
        raise ConfigError("--tracking-uri", problem)
    return MlflowClient(tracking_uri=absolute_tracking_uri(uri))


def watch_command(args: argparse.Namespace) -> int:
    from gradmon_ray.viz.panel import watch

    if args.interval <= 0:
        raise ConfigError("--interval", f"must be > 0 seconds, got {args.interval}")
    watch(read_client(args), run_id=args.run_id, experiment=args.experiment, interval_s=args.interval, once=args.once)
    return EXIT_OK


def check_report_out(args: argparse.Namespace, run_id: str | None = None) -> None:
    """``report``'s output directory (``--out``, else ``gradmon-report-<run id>`` here), checked before
    MLflow is asked anything: else a run is read, its plots drawn, and the first write fails with a
    traceback.  ``run_id``: the resolved id, for the default directory (until then: this directory)."""
    if args.out is None and run_id is None:
        where = Path.cwd()
    else:
        where = Path(os.path.abspath(args.out or f"gradmon-report-{run_id}"))
    problem = writable_dir_problem(where)
    if problem:
        raise ConfigError("--out", f"{problem}; give --out a directory you can write to")


def report_command(args: argparse.Namespace) -> int:
    from gradmon_ray.viz.report import write_report
    from gradmon_ray.viz.runs import resolve_run

    client = read_client(args)
    run_id = resolve_run(client, run_id=args.run_id).info.run_id  # a run name only one run has is taken too
    out = args.out or f"gradmon-report-{run_id}"
    if args.out is None:  # main checked --out, or this directory: now the default directory in it
        check_report_out(args, run_id)
    files = write_report(client, run_id, out)
    print(f"gradmon-ray: wrote {len(files)} files to {out}: " + ", ".join(f.name for f in files), flush=True)
    return EXIT_OK


def replay_command(args: argparse.Namespace) -> int:
    from gradmon_ray.tracking.spill import REPLAYED_SUFFIX
    from gradmon_ray.tracking.spill_replay import replay_spill

    done = Path(args.spill_file + REPLAYED_SUFFIX)
    if not Path(args.spill_file).exists() and done.is_file():  # e.g. `train --resume` delivered it first
        print(f"gradmon-ray: {args.spill_file} was replayed already (it is now {done}); nothing to do", flush=True)
        return EXIT_OK
    result = replay_spill(args.spill_file, args.tracking_uri)
    made = "created run" if result.created_run else "run"
    print(
        f"gradmon-ray: replayed {result.iterations} iterations ({result.metrics} metric points) into {made} "
        f"{result.run_id}" + (f", ended {result.status}" if result.status else ""),
        flush=True,
    )
    return EXIT_OK
