"""The house rules, checked on the code itself: the layer contract and "private APIs only in compat".

Fast lane: no Ray is started (RLlib's learner modules are parsed from their source files, never
imported), no subprocess.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradmon_ray"
COMPAT = PACKAGE / "compat.py"
# RLlib classes gradmon's learners subclass: a private name they define must not be used as
# ``self._x`` in a gradmon learner outside compat.py (it would be RLlib's, not ours).
RLLIB_LEARNER_SOURCES = (
    "ray.rllib.core.learner.learner",
    "ray.rllib.core.learner.torch.torch_learner",
    "ray.rllib.algorithms.ppo.ppo_learner",
    "ray.rllib.algorithms.ppo.torch.ppo_torch_learner",
    "ray.rllib.algorithms.appo.appo_learner",
    "ray.rllib.algorithms.appo.torch.appo_torch_learner",
    "ray.rllib.algorithms.impala.impala_learner",
    "ray.rllib.algorithms.impala.torch.impala_torch_learner",
)
THIRD_PARTY = ("ray", "torch")
REFLECTION = ("getattr", "setattr", "hasattr")
# pydantic's own models keep their fields in __dict__ (config/base.py restores them after a refused
# assignment): that is our object, not a third-party one.
DICT_ALLOWED = {PACKAGE / "config" / "base.py"}


def _trees() -> dict[Path, ast.Module]:
    return {f: ast.parse(f.read_text(), filename=str(f)) for f in sorted(PACKAGE.rglob("*.py"))}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(trees: dict[Path, ast.Module]) -> set[str]:
    """Every name gradmon itself defines (functions, classes, attributes it assigns, imports' aliases)."""
    own: set[str] = set()
    for tree in trees.values():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                own.update((a.asname or a.name).split(".")[0] for a in n.names)
    return own


def _rllib_learner_privates() -> set[str]:
    names: set[str] = set()
    for module in RLLIB_LEARNER_SOURCES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        for n in ast.walk(ast.parse(Path(spec.origin).read_text())):
            if isinstance(n, ast.Attribute) and _is_private(n.attr):
                names.add(n.attr)
            elif isinstance(n, ast.FunctionDef) and _is_private(n.name):
                names.add(n.name)
    return names


def _in_learners(path: Path) -> bool:
    """gradmon's RLlib subclasses (learners, monitor) live in rllib/; elsewhere ``self._device`` is ours."""
    return path.parent.name == "rllib" or path.name == "snippet.py"


def private_uses(trees: dict[Path, ast.Module], own: set[str], rllib_privates: set[str]) -> list[str]:
    """Every use of a private RLlib / Ray / torch name, as ``path:line: what``."""
    found = []

    def hit(path: Path, node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {what}")

    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                base = n.value.id if isinstance(n.value, ast.Name) else None
                if _is_private(n.attr) and base in THIRD_PARTY:
                    hit(path, n, f"{base}.{n.attr}")
                elif _is_private(n.attr) and base == "self" and n.attr in rllib_privates and _in_learners(path):
                    hit(path, n, f"self.{n.attr} (an RLlib learner's private name)")
                elif _is_private(n.attr) and n.attr not in own:
                    hit(path, n, f"{ast.unparse(n)} (defined nowhere in gradmon_ray)")
                elif n.attr == "__class__" and isinstance(n.ctx, ast.Store):
                    hit(path, n, "__class__ assignment")
                elif n.attr == "__dict__" and path not in DICT_ALLOWED:
                    hit(path, n, f"{ast.unparse(n)} (copies another object's private state)")
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in THIRD_PARTY:
                if any(_is_private(part) for part in n.module.split(".")):
                    hit(path, n, f"from {n.module} import ...")
                hit_names = [a.name for a in n.names if _is_private(a.name)]
                if hit_names:
                    hit(path, n, f"from {n.module} import {', '.join(hit_names)}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in REFLECTION:
                name = n.args[1] if len(n.args) > 1 else None
                literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
                if literal and _is_private(name.value) and name.value not in own:
                    hit(path, n, f"{n.func.id}(..., {name.value!r})")
            elif isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and isinstance(n.left.value, str):
                # "<wording>" in str(exc): matching a library's error text
                right = n.comparators[0]
                if isinstance(right, ast.Call) and isinstance(right.func, ast.Name) and right.func.id == "str":
                    hit(path, n, f"error text {n.left.value!r} matched")
    return found


def test_private_third_party_names_are_used_only_in_compat():
    trees = _trees()
    uses = private_uses({p: t for p, t in trees.items() if p != COMPAT}, _own_names(trees), _rllib_learner_privates())
    assert not uses, "private RLlib/Ray/torch API outside gradmon_ray/compat.py:\n" + "\n".join(uses)


def test_the_check_sees_each_kind_of_private_use():
    """The scanner itself: each kind of private use in a snippet is reported, a public one is not."""
    snippet = ast.parse(
        "import torch\n"
        "from ray._private import worker\n"
        "from torch.optim.optimizer import _use_grad_for_differentiable\n"
        "torch._foreach_norm([])\n"
        "trainable._storage\n"
        "getattr(trainable, '_storage', None)\n"
        "self._make_batch_if_necessary()\n"
        "obj.__class__ = Other\n"
        "clone.__dict__.update(other.__dict__)\n"
        "'actor is restarting' in str(exc)\n"
        "torch.linalg.vector_norm(x)\n"
        "self._mine\n"
    )
    uses = private_uses({PACKAGE / "snippet.py": snippet}, {"_mine", "self", "torch"}, {"_make_batch_if_necessary"})
    kinds = [u.split(": ", 1)[1] for u in uses]
    expected = [
        "from ray._private import ...",
        "from torch.optim.optimizer import _use_grad_for_differentiable",
        "torch._foreach_norm",
        "trainable._storage (defined nowhere in gradmon_ray)",
        "getattr(..., '_storage')",
        "self._make_batch_if_necessary (an RLlib learner's private name)",
        "__class__ assignment",
        "clone.__dict__ (copies another object's private state)",
        "other.__dict__ (copies another object's private state)",
        "error text 'actor is restarting' matched",
    ]
    assert sorted(kinds) == sorted(expected)


def test_compat_imports_nothing_from_gradmon():
    tree = ast.parse(COMPAT.read_text())
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [n.module or "" for n in imports if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in imports if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in names if m.startswith("gradmon_ray")]


def test_the_layer_contract_holds():
    """pyproject.toml's [tool.importlinter] contracts (layers, no cycles) hold: 0 broken."""
    pytest.importorskip("importlinter")
    import logging

    from importlinter.cli import lint_imports

    # import-linter configures logging with dictConfig, which disables every logger that exists
    # already (gradmon's among them): later tests' caplog would see nothing.  Put them back.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = {lg: lg.disabled for lg in loggers}
    try:
        assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
    finally:
        for lg in logging.root.manager.loggerDict.values():
            if isinstance(lg, logging.Logger):
                lg.disabled = disabled.get(lg, False)


def test_no_module_is_over_300_lines():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 300}
    assert not long, f"modules over 300 lines (split them by job): {long}"


def long_functions(trees: dict[Path, ast.Module], limit: int = 80) -> list[str]:
    """Every function or method (nested ones too) longer than ``limit`` lines, decorators and
    docstring included, as ``name:path:lines``."""
    found = []
    for path, tree in trees.items():
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([n.lineno, *(d.lineno for d in n.decorator_list)])
                lines = (n.end_lineno or n.lineno) - first + 1
                if lines > limit:
                    found.append(f"{n.name}:{path.relative_to(ROOT)}:{lines}")
    return found


def test_no_function_is_over_80_lines():
    long = long_functions(_trees())
    assert not long, "functions over 80 lines (split them by stage, named by what each does):\n" + "\n".join(long)


def test_the_length_check_counts_a_method_whole():
    """A method of 81 lines (decorator to last line) is reported with its length; one of 80 is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(78))
    snippet = ast.parse(
        f"class C:\n    @staticmethod\n    def long():\n{body.replace('    ', '        ')}        return 1\n"
        f"def short():\n{body}"
    )
    assert long_functions({PACKAGE / "snippet.py": snippet}) == ["long:gradmon_ray/snippet.py:81"]
