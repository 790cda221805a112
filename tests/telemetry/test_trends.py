"""The host-side trend and CV live in a torch-free module; the old import paths still work."""

from __future__ import annotations

import ast
from pathlib import Path

TELEMETRY = Path(__file__).resolve().parents[2] / "gradmon_ray" / "telemetry"


def test_the_trends_module_does_not_import_torch():
    source = (TELEMETRY / "trends.py").read_text()
    imported = [
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(ast.parse(source))
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in n.names
    ]
    assert not [m for m in imported if m and m.split(".")[0] in ("torch", "numpy", "ray")], imported
