"""The README, .ci/run and metric_names stay in sync."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from gradmon_ray import metric_names as mn
from gradmon_ray.cli import build_parser
from gradmon_ray.viz.plots import HEATMAP_FILE, LINES_FILE, PROBE_FILE
from gradmon_ray.viz.report import PLOTS_ARTIFACT_DIR

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


ARTIFACTS = [f"{PLOTS_ARTIFACT_DIR}/{name}" for name in (HEATMAP_FILE, LINES_FILE, PROBE_FILE)]


def test_readme_table_has_no_stale_rows():
    documented = set(re.findall(r"^\| `([^`]+)` \|", README, re.M))
    known = set(ALL_METRICS) | set(ARTIFACTS)
    assert documented <= known, documented - known


def test_every_plot_artifact_is_documented():
    documented = set(re.findall(r"^\| `([^`]+)` \|", README, re.M))
    assert set(ARTIFACTS) <= documented


def test_every_gradmon_ray_command_in_the_readme_parses():
    """Copy-pasted README commands must not die on a usage error (placeholders are fine)."""
    parser = build_parser()
    commands, in_block = [], False
    for raw in README.splitlines():
        if raw.startswith("```"):
            in_block = not in_block
            continue
        line = raw.split(" #")[0].strip()
        if in_block and line.startswith("gradmon-ray ") and "..." not in line:
            commands.append(line)
    assert len(commands) >= 8, commands
    for line in commands:
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command in {"train", "tune", "watch", "report"}, line
