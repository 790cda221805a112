"""What every ``gradmon-ray`` command shares: exit codes, ``--set`` flags, the tracking URI's
masking and up-front check, Ray's and MLflow's start-up noise."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gradmon_ray.config import ConfigError, GradmonConfig, config_advisories, load_yaml
from gradmon_ray.tracking.redact import OUTPUT_REDACTOR, redact_uri, uri_secrets

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

MAX_ERROR_CHARS = 300
"""The longest error line the CLI prints (``--debug``: whole) for a list of problems (the first few
that fit and how many more) and for text from elsewhere (an exception's; cut in the middle)."""

MAX_OWN_ERROR_CHARS = 1000
"""The same for one ``ConfigError``: ours are under 300 characters but for the paths and URIs they
quote, which must stay whole to be fixed or copied; this is the net for anything unforeseen."""


def error_line(
    prefix: str, error: BaseException | str, limit: int = MAX_ERROR_CHARS, mask: Callable[[str], str] = str
) -> str:
    """``prefix`` and ``error`` as one line (see ``MAX_ERROR_CHARS``), ``mask`` (credentials) applied
    before anything is cut, so that no secret is cut in half."""
    problems = [mask(p) for p in getattr(error, "problems", [])]
    if len(problems) > 1:
        field = getattr(error, "field_path", "config")
        return _first_problems(mask(f"{prefix}{field}: {len(problems)} problems: "), problems, limit)
    return clip_line(
        mask(f"{prefix}{error}"), max(limit, MAX_OWN_ERROR_CHARS) if isinstance(error, ConfigError) else limit
    )


def _first_problems(head: str, problems: list[str], limit: int, few: int = 3) -> str:
    """``head``, the first problems and the count of the rest: as many whole problems as fit, else
    the first ``few`` each cut to a share of the room (so that a long one does not hide the next)."""
    shown: list[str] = []
    for problem in problems:
        rest = len(problems) - len(shown) - 1
        if len(head + "; ".join([*shown, problem]) + _more(rest)) > limit:
            break
        shown.append(problem)
    if len(shown) < min(few, len(problems)):
        shown = _shares(problems[:few], limit - len(head) - len(_more(len(problems) - few)) - 2 * (few - 1))
    return head + "; ".join(shown) + _more(len(problems) - len(shown))


def _more(rest: int) -> str:
    return f"; ... and {rest} more (--debug lists all)" if rest > 0 else ""


def _shares(problems: list[str], room: int) -> list[str]:
    """``problems`` cut to fit ``room`` together: the shorter ones whole, the rest an even share each."""
    out = list(problems)
    for n, i in enumerate(sorted(range(len(problems)), key=lambda j: len(problems[j]))):
        share = max(room // (len(problems) - n), 40)
        out[i] = clip_line(problems[i], share, keep_end=False)  # an item's start names the field and the problem
        room -= len(out[i])
    return out


def clip_line(text: str, limit: int = MAX_ERROR_CHARS, keep_end: bool = True) -> str:
    """``text`` on one line; over ``limit``, cut at spaces: its middle (the start names the problem,
    the end usually says what to do), or with ``keep_end`` False its end."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    gap = " ..."
    if not keep_end:
        return line[: limit - len(gap)].rsplit(" ", 1)[0].rstrip(",;") + gap
    head = line[: (limit - len(gap) - 1) * 2 // 3].rsplit(" ", 1)[0]
    tail_room = limit - len(gap) - 1 - len(head)
    tail = line[-tail_room:].split(" ", 1)[-1] if tail_room > 0 else ""
    return f"{head}{gap} {tail}"


def add_set_flag(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help=f"{help_text} (VALUE is parsed as YAML)"
    )


def set_overrides(items: Sequence[str]) -> dict[str, Any]:
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


@dataclass(frozen=True)
class TrackingUri:
    """A command's tracking URI as given (``uri``) and as it is shown (``shown``: credentials masked),
    masked once where it enters (``use_uri``) and passed down with it."""

    uri: str
    shown: str

    @classmethod
    def of(cls, uri: str | TrackingUri) -> TrackingUri:
        """``uri`` with its shown form (a ``TrackingUri`` as it is)."""
        return uri if isinstance(uri, TrackingUri) else cls(uri, redact_uri(uri))


def use_uri(uri: str) -> TrackingUri:
    """Mask ``uri``'s credentials in this process's output from now on, and return it with its shown
    form.  MLflow itself prints a run's URL, with them, to stdout when the run ends (``_log_url``):
    off for such a URI (the CLI prints its own, masked); set before Ray starts, so that a local Ray's
    workers inherit it."""
    OUTPUT_REDACTOR.add_uri(uri)
    if uri_secrets(uri):
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    return TrackingUri.of(uri)


def check_tracking_server(cfg: GradmonConfig) -> None:
    """A tracking server that does not answer now is refused before anything starts (one bounded
    request), unless ``mlflow.offline_ok``: then the run buffers, spills and is replayed later."""
    from gradmon_ray.tracking.store_check import tracking_server_problem

    problem = tracking_server_problem(cfg.mlflow.tracking_uri, offline_ok=cfg.mlflow.offline_ok)
    if problem:
        raise ConfigError("mlflow.tracking_uri", problem)


def fail_fast_mlflow_http(timeout_s: int) -> None:
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
    # Tune's advice when building the algorithm (a Trainable) took over 10 s; reuse_actors is a Tune
    # setting that no ``train`` run has, and a sweep trial's own log never reaches the terminal.
    "consider setting reuse_actors=True to reduce actor creation overheads",
)


class StartupNoiseFilter(logging.Filter):
    """Drops Ray's and MLflow's start-up notices that ask nothing of the user (``--debug`` keeps them).

    Ray's one-time ``Generated new authentication token and saved to ~/.ray/auth_token`` stays: it
    says where a credential was written."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in _STARTUP_NOISE)


def filter_startup_noise() -> None:
    """Python-level: the ``_STARTUP_NOISE`` log records and RLlib's env re-registration warning.
    Native: Ray's C++ actor restart notice, dropped while the algorithm is built (``ray_noise``)."""
    import warnings

    import mlflow  # noqa: F401  (the imports set up these loggers' own handlers)
    import ray.rllib  # noqa: F401

    from gradmon_ray.app.ray_noise import want_quiet_ray

    for name in ("ray", "ray.rllib", "mlflow"):
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(StartupNoiseFilter())
    # RLlib re-registers its own env wrapper on every EnvRunner build.
    warnings.filterwarnings("ignore", message=".*Overriding environment rllib-single-agent-env.*")
    want_quiet_ray()


def print_advisories(cfg: Any) -> None:
    for line in config_advisories(cfg):
        print(f"gradmon-ray: warning: {line}", file=sys.stderr, flush=True)


def check_read_server(given: str | None) -> None:
    """``watch``/``report``: a tracking server that does not answer (or refuses the credentials) is
    refused at once, in one line naming the URI (masked), before MLflow's client retries or cuts it."""
    from gradmon_ray.config import default_tracking_uri
    from gradmon_ray.tracking.store_check import tracking_server_problem

    field = "--tracking-uri" if given else "MLFLOW_TRACKING_URI"
    uri = given or default_tracking_uri()
    problem = tracking_server_problem(
        uri, advice=f"check that the server is running and that {field} names its host and port"
    )
    if problem:
        raise ConfigError(field, problem)


def writable_dir_problem(path: Path) -> str | None:
    """Why directory ``path`` cannot be created (where missing, with its parents) and written to, in
    one line (None: it can).  Tried in a temporary directory removed at once: nothing is left behind."""
    from gradmon_ray.tracking.store_check import _can_create_in, _existing_ancestor

    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a directory"
    where = path if path.exists() else _existing_ancestor(path)
    if where == path:
        return None if _can_create_in(path) else f"{path} is a directory nothing can be written to"
    if not where.is_dir():
        return f"{path} can never be created: {where} is a file, not a directory"
    return None if _can_create_in(where) else f"{path} can never be created: nothing can be created in {where}"


def check_storage_path(storage_path: str | None) -> None:
    """A sweep's Tune storage (``storage_path``, null: ``./tune_results``), checked like the checkpoint root."""
    problem = writable_dir_problem(Path(os.path.abspath(storage_path or "tune_results")))
    if problem:
        raise ConfigError("storage_path", f"{problem}; give the sweep file's storage_path a directory you can write to")
