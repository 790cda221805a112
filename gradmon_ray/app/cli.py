"""``gradmon-ray``: the command line (the parser and the dispatch; each command in its own module).

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

from gradmon_ray.app.cli_common import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    MAX_OWN_ERROR_CHARS,
    check_read_server,
    error_line,
    fail_fast_mlflow_http,
)
from gradmon_ray.app.read_commands import (
    add_tracking_uri_flag,
    check_report_out,
    replay_command,
    report_command,
    watch_command,
)
from gradmon_ray.app.sweep.command import add_tune_arguments, tune_command
from gradmon_ray.app.train.command import add_train_arguments, train_command
from gradmon_ray.config import ConfigError
from gradmon_ray.distributed.agreement import LearnerCollectiveError
from gradmon_ray.distributed.replica_checksum import ReplicaDivergenceError
from gradmon_ray.tracking.redact import OUTPUT_REDACTOR
from gradmon_ray.tracking.spill import SpillFormatError
from gradmon_ray.viz.runs import RunLookupError

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: status 2, no traceback
        command = " ".join(["gradmon-ray", *self.prog.split()[1:]])  # prog is "gradmon-ray [subcommand]"
        self.exit(EXIT_USAGE, f"gradmon-ray: {message}\n(run '{command} --help' for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``gradmon-ray`` argument parser."""
    parser = _Parser(prog="gradmon-ray", description="Per-head gradient health for multi-head PPO on Ray RLlib.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_train_arguments(sub.add_parser("train", help="train PPO with gradient telemetry, logging to MLflow"))
    add_tune_arguments(
        sub.add_parser("tune", help="run a Ray Tune sweep from a sweep file (see tune_configs/*_sweep.yaml)")
    )
    watch = sub.add_parser("watch", help="live terminal panel of a run's per-head gradient health (from MLflow)")
    which = watch.add_mutually_exclusive_group()
    which.add_argument("--run-id", help="the MLflow run to follow")
    which.add_argument("--experiment", help="follow the newest run of this experiment (default: gradmon-ray)")
    add_tracking_uri_flag(watch)
    watch.add_argument("--interval", type=float, default=3.0, help="seconds between refreshes (default 3)")
    watch.add_argument("--once", action="store_true", help="print one frame and exit (scripts, finished runs)")
    watch.add_argument("--debug", action="store_true", help="show tracebacks")
    report = sub.add_parser("report", help="write a run's plots and a Markdown summary to a directory")
    report.add_argument("run_id", help="the MLflow run id")
    report.add_argument("--out", default=None, help="output directory (default: gradmon-report-<run id>)")
    add_tracking_uri_flag(report)
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
        fail_fast_mlflow_http(10 if args.command in ("train", "tune") else 5)
        if args.command == "train":
            return train_command(args)
        if args.command == "tune":
            return tune_command(args)
        if args.command == "report":  # where it writes, before MLflow is asked anything
            check_report_out(args)
        if args.command in ("watch", "report"):  # a server that is not there: one line, before MLflow's client
            check_read_server(args.tracking_uri)
        if args.command == "watch":
            return watch_command(args)
        if args.command == "report":
            return report_command(args)
        if args.command == "replay":
            return replay_command(args)
        raise AssertionError(args.command)
    except ConfigError as exc:
        _error("gradmon-ray: config error: ", exc, args.debug)
        return EXIT_USAGE
    except SpillFormatError as exc:
        _error("gradmon-ray: ", exc, args.debug)
        return EXIT_USAGE
    except RunLookupError as exc:
        _error("gradmon-ray: ", exc, args.debug)
        return EXIT_FAILED if exc.unreachable else EXIT_USAGE
    except KeyboardInterrupt:
        _error("gradmon-ray: interrupted", "", args.debug)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if args.debug:  # the traceback, masked like everything else
            print(OUTPUT_REDACTOR(traceback.format_exc().rstrip()), file=sys.stderr)
        hint = "" if args.debug else " (rerun with --debug for the traceback)"
        if (own := learners_own_error(exc)) is not None:  # whole, not Ray's traceback text around it
            print(error_line("gradmon-ray: run failed: ", own, MAX_OWN_ERROR_CHARS, OUTPUT_REDACTOR), file=sys.stderr)
        else:
            _error("gradmon-ray: run failed: ", f"{type(exc).__name__}: {exc}{hint}", args.debug)
        return EXIT_FAILED


LEARNERS_ONE_LINE_ERRORS = (LearnerCollectiveError, ReplicaDivergenceError)
"""gradmon's errors from the learners whose message is the whole story, in one line."""


def learners_own_error(exc: BaseException) -> str | None:
    """``Name: message`` of the gradmon error a learner raised (``LEARNERS_ONE_LINE_ERRORS``), found inside
    Ray's ``RayTaskError`` around it (whose text starts with Ray's traceback); None for any other error."""
    found, node = None, exc
    for _ in range(5):  # RayTaskError.cause, then Python's own chain
        if node is None:
            break
        if isinstance(node, LEARNERS_ONE_LINE_ERRORS):
            found = node
        node = getattr(node, "cause", None) or node.__cause__
    if found is None:
        return None
    name = next(
        c.__name__ for c in type(found).__mro__ if issubclass(c, LEARNERS_ONE_LINE_ERRORS) and "(" not in c.__name__
    )
    return f"{name}: {found}"


URI_ENV = "MLFLOW_TRACKING_URI"


def _error(prefix: str, error: BaseException | str, debug: bool) -> None:
    """One line on stderr, credentials masked (an error may quote the URI it failed on), at most
    ``MAX_ERROR_CHARS`` long unless ``--debug`` (then whole)."""
    if debug:
        print(OUTPUT_REDACTOR(f"{prefix}{error}"), file=sys.stderr)
    else:
        print(error_line(prefix, error, mask=OUTPUT_REDACTOR), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
