"""``gradmon-ray tune``: a Ray Tune sweep from a sweep file, one MLflow child run per trial."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradmon_ray.app.cli_common import (
    EXIT_FAILED,
    EXIT_OK,
    add_set_flag,
    check_storage_path,
    check_tracking_server,
    filter_startup_noise,
    print_advisories,
    set_overrides,
    use_uri,
)
from gradmon_ray.config import ConfigError


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``gradmon-ray tune``."""
    parser.add_argument("sweep_file", help="sweep YAML: base_config/base, search_space, num_samples, ...")
    parser.add_argument("--mlflow-uri", help="MLflow tracking URI for the parent and trial runs")
    parser.add_argument("--ray-address", help="Ray cluster address (default: local Ray or RAY_ADDRESS)")
    parser.add_argument("--iterations", type=int, help="training iterations per trial (base config: iterations)")
    parser.add_argument(
        "--num-samples", metavar="N", help="samples of the search space, N >= 1 (sweep file: num_samples)"
    )
    add_set_flag(parser, "override a base config field for every trial, e.g. --set ppo.train_batch_size=512")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")


def num_samples_flag(raw: str | None) -> int | None:
    """``--num-samples``: a whole number >= 1 (None: the sweep file's); else a one-line ``ConfigError``."""
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError("--num-samples", f"must be a whole number >= 1, got {raw!r}") from None
    if value < 1:
        raise ConfigError("--num-samples", f"must be >= 1, got {value}")
    return value


def tune_command(args: argparse.Namespace) -> int:
    from gradmon_ray.app.sweep.config import load_sweep
    from gradmon_ray.app.sweep.progress import fmt4, trial_count
    from gradmon_ray.app.sweep.run import run_sweep
    from gradmon_ray.config import apply_overrides, config_from_dict

    num_samples = num_samples_flag(args.num_samples)  # before the sweep file is even read
    sweep, base = load_sweep(args.sweep_file)
    check_storage_path(sweep.storage_path)  # Tune creates it after the parent MLflow run: a FAILED run
    if num_samples is not None:
        sweep.num_samples = num_samples
    flags = {
        "mlflow.tracking_uri": args.mlflow_uri,
        "resources.ray_address": args.ray_address,
        "iterations": args.iterations,
    }
    base = apply_overrides(base, {**{k: v for k, v in flags.items() if v is not None}, **set_overrides(args.set)})
    cfg = config_from_dict(dict(base))  # the flags too are validated before Ray starts
    use_uri(cfg.mlflow.tracking_uri)
    if not args.debug:
        filter_startup_noise()
    check_tracking_server(cfg)
    print_advisories(cfg)
    trials = trial_count(sweep.search_space, sweep.num_samples)
    print(
        f"gradmon-ray: sweep '{sweep.name}' over {', '.join(sweep.search_space)}: {trials} trials "
        f"of {cfg.iterations} iterations",
        flush=True,
    )
    outcome = run_sweep(sweep, base, progress=lambda line: print(line, flush=True), cfg=cfg)
    best = f"best run {outcome.best.run_id} ({sweep.metric} {fmt4(outcome.best.metric)})" if outcome.best else "no best"
    print(f"gradmon-ray: sweep done; MLflow parent run {outcome.parent_run_id}; {best}", flush=True)
    code, failures = sweep_exit(outcome.trials)
    if failures:
        print(failures, file=sys.stderr, flush=True)
    return code


def sweep_exit(trials: list[Any]) -> tuple[int, str | None]:
    """The sweep's exit status and, when any trial failed, the one line that says which: a sweep
    succeeds only when every trial finished or was stopped by a health rule (a stop is a result)."""
    failed = [t for t in trials if t.status == "failed"]
    if not failed:
        return EXIT_OK, None
    names = ", ".join(f"{t.trial_id} (MLflow run {t.run_id})" if t.run_id else str(t.trial_id) for t in failed)
    return EXIT_FAILED, f"gradmon-ray: {len(failed)} of {len(trials)} trials failed: {names}"
