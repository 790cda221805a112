"""The README, .ci/run and metric_names stay in sync."""

from __future__ import annotations

import re
from pathlib import Path

from gradmon_ray import metric_names as mn

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text().splitlines()


def _readme_command(marker: str) -> str:
    match = re.search(rf"<!-- readme:{marker} -->\s*```bash\n(.+?)\n```", README, re.S)
    assert match, f"README has no <!-- readme:{marker} --> code block"
    lines = match.group(1).strip().splitlines()
    assert len(lines) == 1, f"the README's {marker} command must be one line"
    return lines[0]


def _ci_command(marker: str) -> str:
    i = CI.index(f"# readme:{marker}")
    return CI[i + 1]


def test_ci_runs_exactly_the_readme_install_and_test_commands():
    for marker in ("install", "test"):
        assert _ci_command(marker) == _readme_command(marker)


def test_readme_train_command_is_the_console_script():
    assert _readme_command("train").split()[0] == "gradmon-ray"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'gradmon-ray = "gradmon_ray.cli:main"' in pyproject


def _documented_form(template: str) -> str:
    """``grad/head/{head}/norm`` -> ``grad/head/<head>/norm``, as the README writes it."""
    return re.sub(r"\{(\w+)\}", r"<\1>", template)


ALL_METRICS = [_documented_form(t) for t in (*mn.PER_HEAD_TEMPLATES, *mn.PROBE_TEMPLATES)] + list(mn.SCALAR_NAMES)


def test_every_metric_and_tag_name_is_in_the_readme_table():
    documented = set(re.findall(r"^\| `([^`]+)` \|", README, re.M))
    names = ALL_METRICS
    missing = [n for n in names if n not in documented]
    assert not missing, f"add README table rows for {missing}"
    for tag in mn.TAG_NAMES:
        assert f"`{tag}`" in README, tag


def test_readme_table_has_no_stale_rows():
    documented = set(re.findall(r"^\| `([^`]+)` \|", README, re.M))
    known = set(ALL_METRICS)
    assert documented <= known, documented - known
