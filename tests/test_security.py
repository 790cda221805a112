"""Security invariants of the repository itself (issue [7/7], item 9), checked on every file we ship.

- Ray token authentication is never switched off (``RAY_AUTH_MODE`` is never set to disabled)
  in code, docs, configs or cluster.yaml.
- Nothing we start listens on all interfaces (no wildcard address in code or commands).
- YAML is only read with ``yaml.safe_load``; no pickle/eval/exec in the package.
- ``torch.load`` (if ever used) passes ``weights_only=True``.
- The only code a config can load is a dotted import path for a regularizer or an env class.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {
    ".venv",
    ".ci-venv",
    ".ci-venv-oldest-ray",
    ".git",
    "build",
    "dist",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    "mlruns",
}
DISABLED = "RAY_AUTH_MODE=" + "disabled"  # spelled in two parts so this file does not match itself
ALL_INTERFACES = "0.0.0." + "0"


def _files(*suffixes: str) -> list[Path]:
    out = []
    for directory, subdirs, names in os.walk(ROOT):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out += [Path(directory) / n for n in sorted(names) if Path(n).suffix in suffixes]
    return out


SHIPPED_TEXT = [*_files(".py", ".md", ".yaml", ".yml", ".toml", ".sh"), ROOT / ".ci" / "run"]
PACKAGE = [p for p in _files(".py") if p.relative_to(ROOT).parts[0] == "gradmon_ray"]


def test_the_file_lists_are_not_empty():
    assert len(PACKAGE) > 20 and ROOT / "cluster.yaml" in SHIPPED_TEXT and ROOT / "README.md" in SHIPPED_TEXT


def _assert_none_fail(check, paths: list[Path]) -> None:
    """Run ``check(path)`` (a list of problems) on every path; fail once, naming every problem."""
    failures = [f"{path.relative_to(ROOT)}: {problem}" for path in paths for problem in check(path)]
    assert not failures, f"{len(failures)} problem(s) in {len(paths)} files:\n" + "\n".join(failures)


def test_token_auth_is_never_disabled():
    _assert_none_fail(lambda path: [DISABLED] if DISABLED in path.read_text(errors="replace") else [], SHIPPED_TEXT)


def _code_lines(path: Path) -> list[str]:
    """Non-comment lines of Python files and YAML/shell commands (prose may name the wildcard address)."""
    lines = path.read_text(errors="replace").splitlines()
    return [ln for ln in lines if not ln.lstrip().startswith("#")]


def test_nothing_listens_on_all_interfaces():
    def offending(path: Path) -> list[str]:
        return [ln for ln in _code_lines(path) if ALL_INTERFACES in ln and "not " + ALL_INTERFACES not in ln]

    _assert_none_fail(offending, [*_files(".py", ".yaml", ".yml", ".sh"), ROOT / ".ci" / "run"])


def _calls(path: Path) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)]


def _name(call: ast.Call) -> str:
    return ast.unparse(call.func)


def test_yaml_is_safe_loaded_and_torch_load_is_weights_only():
    def unsafe(path: Path) -> list[str]:
        problems = []
        for call in _calls(path):
            name = _name(call)
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                problems.append(f"line {call.lineno}: {name}")
            if name == "torch.load":
                kw = {k.arg: ast.unparse(k.value) for k in call.keywords}
                if kw.get("weights_only") != "True":
                    problems.append(f"line {call.lineno}: torch.load without weights_only=True")
        return problems

    _assert_none_fail(unsafe, _files(".py"))


def test_no_pickle_eval_or_exec_in_the_package():
    imports = re.compile(r"^\s*(import pickle|from pickle|import dill)", re.M)
    calls = ("eval", "exec", "pickle.load", "pickle.loads")

    def unsafe(path: Path) -> list[str]:
        problems = [m.group(0).strip() for m in imports.finditer(path.read_text())]
        return problems + [f"line {c.lineno}: {_name(c)}" for c in _calls(path) if _name(c) in calls]

    _assert_none_fail(unsafe, PACKAGE)


def test_the_only_code_loaded_from_config_is_a_regularizer_or_env_import_path():
    sites = sorted(
        (str(p.relative_to(ROOT)), ast.unparse(c.args[0]) if c.args else "")
        for p in PACKAGE
        for c in _calls(p)
        if _name(c) in ("importlib.import_module", "__import__")
    )
    assert sites == [
        ("gradmon_ray/import_paths.py", "module_name"),  # regularizers[].fn: "pkg.module:function"
        ("gradmon_ray/rllib/__init__.py", "_EXPORTS[name]"),  # fixed table of our own modules (lazy exports)
        ("gradmon_ray/rllib/config.py", "module_name"),  # env.id: "pkg.module:Class"
        ("gradmon_ray/tracking/__init__.py", "_EXPORTS[name]"),  # fixed table of our own modules (lazy exports)
        # unpickling a callback class pinned on the driver: the class pickle named (no new trust)
        ("gradmon_ray/tracking/callback.py", "module"),
    ]


# Every slice with an end in app/, tracking/ and probe/ that is not a cut of a message: ids and
# digests, lists and batches, and redact.py's own parsing.  A message is cut by ``redact.short``
# (masked, then cut), never by a slice: a cut inside a password hides it from the masking (#46 item 3).
NOT_MESSAGES = {
    ("gradmon_ray/app/cli_common.py", "problems[:few]"),  # a list of problems, each masked by error_line
    # error_line masks its whole line before clip_line cuts it
    ("gradmon_ray/app/cli_common.py", "line[:limit - len(gap)]"),
    ("gradmon_ray/app/cli_common.py", "line[:(limit - len(gap) - 1) * 2 // 3]"),
    ("gradmon_ray/app/sweep/run.py", "parent_id[:8]"),
    ("gradmon_ray/app/train/checkpoints.py", "restored[:12]"),
    ("gradmon_ray/app/train/checkpoints.py", "expected[:12]"),
    ("gradmon_ray/app/train/command.py", "RESUME_FLAGS[:-1]"),
    ("gradmon_ray/probe/actor.py", "uuid.uuid4().hex[:12]"),
    ("gradmon_ray/probe/connectors.py", "hashlib.sha256(repr(value).encode()).digest()[:8]"),
    ("gradmon_ray/tracking/mlflow_io.py", "metric_list[i:i + MAX_METRICS_PER_BATCH]"),
    ("gradmon_ray/tracking/mlflow_io.py", "param_list[i:i + MAX_PARAMS_PER_BATCH]"),
    ("gradmon_ray/tracking/mlflow_io.py", "tag_list[i:i + MAX_TAGS_PER_BATCH]"),
    ("gradmon_ray/tracking/uri_credentials.py", "rest[:cut]"),
    ("gradmon_ray/tracking/spill_replay.py", "metrics[:done]"),  # the points a replay recorded as logged
    ("gradmon_ray/tracking/spill_replay.py", "pending[start:start + MAX_METRICS_PER_BATCH]"),  # a batch
    ("gradmon_ray/config/base.py", "loc[:used]"),  # pydantic's error location, not text
    ("gradmon_ray/rllib/module_groups.py", "x.shape[:-1]"),
}


def test_messages_are_masked_before_they_are_cut():
    def cuts(path: Path) -> list[str]:
        rel = str(path.relative_to(ROOT))
        # (viz/ cuts only head and run names to a column's width: the name rule keeps secrets out of them)
        if rel.split("/")[1] not in ("app", "tracking", "probe", "config", "rllib") or rel.endswith("/redact.py"):
            return []
        found = [
            (node.lineno, ast.unparse(node))
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice) and node.slice.upper is not None
        ]
        return [
            f"line {n}: {text}: cut a message with redact.short" for n, text in found if (rel, text) not in NOT_MESSAGES
        ]

    _assert_none_fail(cuts, PACKAGE)
