"""docs/oracles.md: every metric and tag name has a row naming a real, independent test.

The rule is explained at the top of docs/oracles.md.  This test enforces the bookkeeping:
every name constant in ``gradmon_ray.metric_names`` has a row, every row names a test that
exists (``path::test_name``: the file exists and defines ``def test_name``), no row is
``MISSING``, and no row names something that is not (or no longer) a name constant.
"""

from __future__ import annotations

import re
from pathlib import Path

from gradmon_ray import metric_names as mn

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "oracles.md"

NOT_METRIC_NAMES = {"VALUE_HEAD"}
"""Upper-case ``str`` constants of metric_names that are not metric or tag names."""


def name_constants() -> dict[str, str]:
    """Every module-level upper-case ``str`` constant that is a metric name (has a ``/``) or a tag
    (``gradmon.``), templates included."""
    out = {}
    for attr, value in vars(mn).items():
        if not (attr.isupper() and isinstance(value, str)) or attr in NOT_METRIC_NAMES:
            continue
        out[attr] = value
    return out


def table_rows() -> list[dict[str, str]]:
    rows = []
    header = None
    for line in TABLE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        assert len(cells) == len(header), f"docs/oracles.md row with {len(cells)} cells: {line}"
        rows.append(dict(zip(header, cells, strict=True)))
    assert header == ["metric", "what it is", "oracle", "test"], header
    return rows


def _unquote(cell: str) -> str:
    match = re.fullmatch(r"`([^`]+)`", cell)
    assert match, f"expected one `backticked` value, got {cell!r}"
    return match.group(1)


ROWS = table_rows()


def test_every_name_constant_is_classified():
    """A new upper-case str constant is either a metric/tag name or listed as not one."""
    for attr, value in name_constants().items():
        assert "/" in value or value.startswith("gradmon."), (
            f"metric_names.{attr} = {value!r} looks like neither a metric nor a tag: add it to "
            "NOT_METRIC_NAMES in tests/test_oracle_table.py, or give it a row in docs/oracles.md"
        )


def test_every_metric_and_tag_name_has_a_row():
    documented = {_unquote(row["metric"]) for row in ROWS}
    missing = {attr: v for attr, v in name_constants().items() if v not in documented}
    assert not missing, f"no row in docs/oracles.md for {missing}"


def test_no_stale_or_duplicate_rows():
    names = [_unquote(row["metric"]) for row in ROWS]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    unknown = set(names) - set(name_constants().values())
    assert not unknown, f"docs/oracles.md rows for names not in metric_names.py: {sorted(unknown)}"


def _row_problems(row: dict[str, str]) -> list[str]:
    cell = row["test"]
    if "MISSING" in cell:
        return ["has no independent test: write one (see docs/oracles.md)"]
    target = _unquote(cell)
    path, sep, test_name = target.partition("::")
    if not (sep and re.fullmatch(r"test_\w+", test_name)):
        return [f"expected path::test_name, got {target!r}"]
    file = ROOT / path
    if not file.is_file():
        return [f"{path} does not exist"]
    problems = []
    if not re.search(rf"^\s*(async\s+)?def {re.escape(test_name)}\(", file.read_text(encoding="utf-8"), re.M):
        problems.append(f"{path} has no test {test_name}")
    if not (row["what it is"] and row["oracle"]):
        problems.append("the 'what it is' or 'oracle' cell is empty")
    return problems


def test_each_row_names_an_existing_test_and_none_is_missing():
    """Every row at once; the failure lists every row that names no real test."""
    assert len(ROWS) > 50, len(ROWS)
    failures = [f"{row['metric']}: {problem}" for row in ROWS for problem in _row_problems(row)]
    assert not failures, f"{len(failures)} of {len(ROWS)} rows of docs/oracles.md:\n" + "\n".join(failures)
