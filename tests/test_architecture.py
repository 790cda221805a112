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


class OwnNames:
    """The private names gradmon itself defines, per class and per module (never one global set:
    a name gradmon assigns somewhere must not make ``learner._module`` elsewhere look like ours)."""

    def __init__(self, trees: dict[Path, ast.Module]) -> None:
        self.attrs: dict[str, set[str]] = {}  # class name -> names its body and its methods define
        self.bases: dict[str, set[str]] = {}  # class name -> the names of its bases
        self.modules: dict[Path, set[str]] = {}  # file -> names bound at its top level, its classes' attributes
        for path, tree in trees.items():
            names = self.modules.setdefault(path, set())
            for node in tree.body:
                names.update(_bound_names(node))
            for n in ast.walk(tree):
                if isinstance(n, ast.ClassDef):
                    attrs = self.attrs.setdefault(n.name, set())
                    for stmt in n.body:
                        attrs.update(_bound_names(stmt))
                    for sub in ast.walk(n):
                        on_self = isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                        if on_self and isinstance(sub.ctx, ast.Store) and sub.value.id in ("self", "cls"):
                            attrs.add(sub.attr)
                    self.bases.setdefault(n.name, set()).update(_last_name(b) for b in n.bases)
                    names.update(attrs)

    def _ancestors(self, name: str) -> set[str]:
        seen, todo = {name}, [name]
        while todo:
            for base in self.bases.get(todo.pop(), ()):
                if base in self.attrs and base not in seen:
                    seen.add(base)
                    todo.append(base)
        return seen

    def of_class(self, name: str) -> set[str]:
        """What ``self._x`` may name in class ``name``: what it, its gradmon bases, and every gradmon
        class composed of it (a mixin's ``self`` is the composed learner) and their bases define."""
        composed = [c for c in self.attrs if name in self._ancestors(c)]
        return {a for c in composed for anc in self._ancestors(c) for a in self.attrs[anc]}


def _last_name(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _bound_names(node: ast.AST) -> set[str]:
    """The names a top-level (module or class body) statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.If, ast.Try)):
        inner = [*node.body, *node.orelse, *getattr(node, "finalbody", []), *getattr(node, "handlers", [])]
        return {name for stmt in inner for name in _bound_names(stmt)}
    if isinstance(node, ast.ExceptHandler):
        return {name for stmt in node.body for name in _bound_names(stmt)}
    return set()


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


def _walk(node: ast.AST, cls: str | None = None, bound: dict[str, str] | None = None, own: OwnNames | None = None):
    """Every node under ``node`` with its enclosing gradmon class and the function's names bound to
    a gradmon class (``x: Cls`` parameters, ``x = Cls(...)``)."""
    bound = bound or {}
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.ClassDef):
            yield child, cls, bound
            yield from _walk(child, child.name, {}, own)
            continue
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inner = dict(bound)
            for arg in [*child.args.posonlyargs, *child.args.args, *child.args.kwonlyargs]:
                for name in ast.walk(arg.annotation) if getattr(arg, "annotation", None) else ():
                    if isinstance(name, (ast.Name, ast.Attribute)) and own and _last_name(name) in own.attrs:
                        inner[arg.arg] = _last_name(name)
            yield child, cls, bound
            yield from _walk(child, cls, inner, own)
            continue
        if isinstance(child, ast.Assign) and isinstance(child.value, ast.Call) and own:
            made = _last_name(child.value.func)
            if made in own.attrs:
                bound.update({t.id: made for t in child.targets if isinstance(t, ast.Name)})
        yield child, cls, bound
        yield from _walk(child, cls, bound, own)


def private_uses(trees: dict[Path, ast.Module], rllib_privates: set[str], own: OwnNames | None = None) -> list[str]:
    """Every use of a private RLlib / Ray / torch name, as ``path:line: what``.

    A private name read on an object (``x._name``, or ``getattr``/``setattr``/``hasattr`` with
    ``"_name"``) passes only where gradmon defines it: on ``self`` in the class (or a class
    composed of it), on a name bound to a gradmon class, or at the top level of the same module."""
    own = own or OwnNames(trees)
    found = []

    def hit(path: Path, node: ast.AST, what: str) -> None:
        found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}: {what}")

    def ours(path: Path, base: ast.AST, name: str, cls: str | None, bound: dict[str, str]) -> bool:
        base_name = base.id if isinstance(base, ast.Name) else None
        if base_name in ("self", "cls") and cls is not None:
            return name in own.of_class(cls)
        if base_name in bound:
            return name in own.of_class(bound[base_name])
        if base_name in own.attrs:  # ClassName._x
            return name in own.of_class(base_name)
        return base_name not in THIRD_PARTY and name in own.modules[path]

    for path, tree in trees.items():
        for n, cls, bound in _walk(tree, own=own):
            if isinstance(n, ast.Attribute):
                base = n.value.id if isinstance(n.value, ast.Name) else None
                if _is_private(n.attr) and base in THIRD_PARTY:
                    hit(path, n, f"{base}.{n.attr}")
                elif _is_private(n.attr) and base == "self" and n.attr in rllib_privates and _in_learners(path):
                    hit(path, n, f"self.{n.attr} (an RLlib learner's private name)")
                elif _is_private(n.attr) and not ours(path, n.value, n.attr, cls, bound):
                    hit(path, n, f"{ast.unparse(n)} (not defined by gradmon there)")
                elif n.attr == "__class__" and isinstance(n.ctx, ast.Store):
                    hit(path, n, "__class__ assignment")
                elif n.attr == "__dict__" and path not in DICT_ALLOWED:
                    hit(path, n, f"{ast.unparse(n)} (copies another object's private state)")
            elif isinstance(n, ast.Import):
                for alias in n.names:
                    parts = alias.name.split(".")
                    if parts[0] in THIRD_PARTY and any(_is_private(part) for part in parts):
                        hit(path, n, f"import {alias.name}")
            elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in THIRD_PARTY:
                if any(_is_private(part) for part in n.module.split(".")):
                    hit(path, n, f"from {n.module} import ...")
                hit_names = [a.name for a in n.names if _is_private(a.name)]
                if hit_names:
                    hit(path, n, f"from {n.module} import {', '.join(hit_names)}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in REFLECTION:
                name = n.args[1] if len(n.args) > 1 else None
                literal = isinstance(name, ast.Constant) and isinstance(name.value, str)
                if literal and _is_private(name.value) and not ours(path, n.args[0], name.value, cls, bound):
                    hit(path, n, f"{n.func.id}(..., {name.value!r})")
            elif isinstance(n, ast.Compare) and isinstance(n.left, ast.Constant) and isinstance(n.left.value, str):
                # "<wording>" in str(exc): matching a library's error text
                right = n.comparators[0]
                if isinstance(right, ast.Call) and isinstance(right.func, ast.Name) and right.func.id == "str":
                    hit(path, n, f"error text {n.left.value!r} matched")
    return found


def test_private_third_party_names_are_used_only_in_compat():
    trees = _trees()
    uses = private_uses({p: t for p, t in trees.items() if p != COMPAT}, _rllib_learner_privates())
    assert not uses, "private RLlib/Ray/torch API outside gradmon_ray/compat.py:\n" + "\n".join(uses)


def test_the_check_sees_each_kind_of_private_use():
    """The scanner itself: each kind of private use in a snippet is reported, a public one (and a
    private name gradmon defines there) is not.  ``_module``, ``_params`` and ``_device`` are
    assigned on ``self`` in another gradmon module: read on a learner here, they are still RLlib's."""
    other = ast.parse(
        "class Mine:\n    def __init__(self):\n        self._module = self._params = self._device = None\n"
    )
    snippet = ast.parse(
        "import torch\n"
        "import ray._private.worker\n"
        "import torch._utils as tu\n"
        "import torch.nn.functional\n"
        "from ray._private import worker\n"
        "from torch.optim.optimizer import _use_grad_for_differentiable\n"
        "torch._foreach_norm([])\n"
        "trainable._storage\n"
        "getattr(trainable, '_storage', None)\n"
        "setattr(optimizer, '_step_count', 0)\n"
        "hasattr(dist, '_cats')\n"
        "learner._module\n"
        "learner._params\n"
        "getattr(learner, '_device')\n"
        "obj.__class__ = Other\n"
        "clone.__dict__.update(other.__dict__)\n"
        "'actor is restarting' in str(exc)\n"
        "torch.linalg.vector_norm(x)\n"
        "class Learner(Base):\n"
        "    _mine = None\n"
        "    def f(self, m: Mine):\n"
        "        self._make_batch_if_necessary()\n"
        "        mine = Mine()\n"
        "        return self._mine, getattr(self, '_mine'), m._module, mine._device, _helper()\n"
        "def _helper():\n"
        "    return sys.modules[__name__]._helper\n"
    )
    trees = {PACKAGE / "tracking" / "snippet.py": snippet, PACKAGE / "other.py": other}
    uses = private_uses(trees, {"_make_batch_if_necessary"})
    kinds = [u.split(": ", 1)[1] for u in uses]
    expected = [
        "import ray._private.worker",
        "import torch._utils",
        "from ray._private import ...",
        "from torch.optim.optimizer import _use_grad_for_differentiable",
        "torch._foreach_norm",
        "trainable._storage (not defined by gradmon there)",
        "getattr(..., '_storage')",
        "setattr(..., '_step_count')",
        "hasattr(..., '_cats')",
        "learner._module (not defined by gradmon there)",
        "learner._params (not defined by gradmon there)",
        "getattr(..., '_device')",
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


def test_telemetry_imports_nothing_from_vgs():
    """``telemetry/`` measures; VGS changes training (``gradmon_ray.vgs.VarianceGradientScaler``,
    never re-exported from ``telemetry``).  The layer contract alone allows that import."""
    imported = []
    for path, tree in _trees().items():
        if path.parent.name == "telemetry":
            for n in ast.walk(tree):
                names = [n.module or ""] if isinstance(n, ast.ImportFrom) else []
                names += [a.name for a in n.names] if isinstance(n, ast.Import) else []
                imported += [f"{path.relative_to(ROOT)}: {m}" for m in names if m.startswith("gradmon_ray.vgs")]
    assert not imported


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
