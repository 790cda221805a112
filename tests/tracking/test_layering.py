"""Layering: ``gradmon_ray.tracking`` sits below ``gradmon_ray.viz`` and never imports it.

An AST scan of every module of the package (module-level and function-local imports,
relative imports, and ``importlib.import_module`` / ``__import__`` with a literal name), so
a lazy import inside a function cannot hide an upward dependency.  Plots reach the sink as
a ``plot_fn`` passed in by a higher layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gradmon_ray.tracking

TRACKING = Path(gradmon_ray.tracking.__file__).resolve().parent
FORBIDDEN = "gradmon_ray.viz"


def _absolute(module: str | None, level: int, package: str) -> str:
    if level == 0:
        return module or ""
    base = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join([*base, module] if module else base)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` for every import in ``path`` (``from a import b`` gives ``a.b`` too)."""
    package = "gradmon_ray.tracking"
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level, package)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant):
                found.append((node.lineno, str(node.args[0].value)))
    return found


def _is_viz(module: str) -> bool:
    return module == FORBIDDEN or module.startswith(FORBIDDEN + ".")


MODULES = sorted(TRACKING.glob("*.py"))


def test_the_scan_sees_every_tracking_module_and_catches_each_kind_of_import(tmp_path):
    assert {p.name for p in MODULES} >= {
        "__init__.py",
        "mlflow_sink.py",
        "mlflow_io.py",
        "result_metrics.py",
        "callback.py",
    }
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import gradmon_ray.viz.plots\n"
        "from gradmon_ray import viz\n"
        "from ..viz.report import log_plots\n"
        "def f():\n"
        "    from gradmon_ray.viz import runs\n"
        "    importlib.import_module('gradmon_ray.viz.report')\n",
        encoding="utf-8",
    )
    hits = sorted({line for line, module in imported_modules(probe) if _is_viz(module)})
    assert hits == [1, 2, 3, 5, 6]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_tracking_imports_nothing_from_viz(path):
    bad = [(line, module) for line, module in imported_modules(path) if _is_viz(module)]
    assert not bad, f"{path.name} imports from gradmon_ray.viz (tracking sits below viz; pass a plot_fn): {bad}"
