"""The README, the docs, .ci/run and metric_names stay in sync.

The README keeps the install / test / train commands; every metric and tag name is documented in
docs/metrics.md (generated from metric_names.py, see tests/test_docs.py); the plot artifacts in
docs/operations.md; every ``gradmon-ray`` command in the README and docs/*.md must parse; every
drop-in python block is known to the test that runs it, and fits 2 cores.
"""

from __future__ import annotations

import ast
import re
import shlex
from pathlib import Path

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import build_parser
from gradmon_ray.viz.plots import ENTROPY_FILE, HEATMAP_FILE, LINES_FILE, PROBE_FILE
from gradmon_ray.viz.report import PLOTS_ARTIFACT_DIR
from tests.doc_blocks import EDITS, drop_in_blocks
from tests.e2e.doc_block_runner import cpus_needed

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
METRICS_DOC = (ROOT / "docs" / "metrics.md").read_text()
OPERATIONS_DOC = (ROOT / "docs" / "operations.md").read_text()
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CI = (ROOT / ".ci" / "run").read_text().splitlines()
TABLE_ROW = re.compile(r"^\| `([^`]+)` \|", re.M)


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
    assert 'gradmon-ray = "gradmon_ray.app.cli:main"' in pyproject


def _documented_form(template: str) -> str:
    """``grad/head/{head}/norm`` -> ``grad/head/<head>/norm``, as the docs write it."""
    return re.sub(r"\{(\w+)\}", r"<\1>", template)


ALL_METRICS = [_documented_form(t) for t in (*mn.PER_HEAD_TEMPLATES, *mn.PROBE_TEMPLATES)] + list(mn.SCALAR_NAMES)


def test_every_metric_and_tag_name_is_in_the_metrics_doc():
    documented = set(TABLE_ROW.findall(METRICS_DOC))
    missing = [n for n in ALL_METRICS if n not in documented]
    assert not missing, f"docs/metrics.md has no rows for {missing}: run `python docs/gen_metrics.py`"
    for tag in mn.TAG_NAMES:
        assert tag in documented, f"docs/metrics.md has no row for the tag {tag}"


def test_metrics_doc_has_no_stale_rows():
    documented = set(TABLE_ROW.findall(METRICS_DOC))
    known = set(ALL_METRICS) | set(mn.TAG_NAMES) | {mn.VALUE_HEAD}
    assert documented <= known, (
        f"docs/metrics.md rows for names in no group of metric_names.py: {documented - known} "
        "(add them to PER_HEAD_TEMPLATES, PROBE_TEMPLATES, SCALAR_NAMES or TAG_NAMES)"
    )


ARTIFACTS = [f"{PLOTS_ARTIFACT_DIR}/{name}" for name in (HEATMAP_FILE, LINES_FILE, ENTROPY_FILE, PROBE_FILE)]


def test_every_plot_artifact_is_documented_and_no_stale_one():
    documented = {row for row in TABLE_ROW.findall(OPERATIONS_DOC) if row.startswith(f"{PLOTS_ARTIFACT_DIR}/")}
    assert documented == set(ARTIFACTS), f"docs/operations.md plot rows {documented} != {ARTIFACTS}"


def test_readme_metric_overview_names_real_metrics():
    """Each name in the README's overview is a documented name, or a family ``prefix/*`` of some."""
    section = README.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (`.+?`) \|", section, re.M)
    names = [n for row in rows for n in re.findall(r"`([^`]+)`", row)]
    assert len(names) >= 10, names
    known = set(ALL_METRICS)
    for name in names:
        if name.endswith("/*"):
            prefix = name[:-1]
            assert any(k.startswith(prefix) for k in known), f"README overview family {name} matches no metric"
        else:
            assert name in known, f"README overview names {name}, which metric_names.py does not define"


def _commands(text: str) -> list[str]:
    commands, in_block = [], False
    for raw in text.splitlines():
        if raw.startswith("```"):
            in_block = not in_block
            continue
        line = raw.split(" #")[0].strip()
        if in_block and line.startswith("gradmon-ray ") and "..." not in line:
            commands.append(line)
    return commands


def test_every_gradmon_ray_command_in_the_readme_and_docs_parses():
    """Copy-pasted commands must not die on a usage error (placeholders are fine)."""
    parser = build_parser()
    per_file = {p.relative_to(ROOT): _commands(p.read_text()) for p in DOC_FILES}
    commands = [c for cs in per_file.values() for c in cs]
    assert len(per_file[Path("README.md")]) >= 3, per_file
    assert len(commands) >= 8, per_file
    for line in commands:
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command in {"train", "tune", "watch", "report"}, line


def _statements_before_training(code: str) -> str:
    """A block's statements up to (not including) the first that trains: they build ``config``, no Ray."""
    body = ast.parse(code).body
    first = next(i for i, s in enumerate(body) if "build_algo()" in ast.unparse(s) or "Tuner(" in ast.unparse(s))
    return ast.unparse(ast.Module(body=body[:first], type_ignores=[]))


def test_every_drop_in_block_has_its_test_edits_and_they_still_apply():
    """tests/e2e/test_dropin_e2e.py runs every drop-in block; here, without Ray: the blocks the
    markdown holds are exactly those ``EDITS`` knows, and each edit still finds its text once."""
    blocks = drop_in_blocks()
    assert sorted(b.key for b in blocks) == sorted(EDITS), [b.key for b in blocks]
    for block in blocks:
        ast.parse(block.for_test("/tmp/tune"))


def test_every_drop_in_block_fits_two_cores_by_rllibs_resource_request():
    """Each block's config, built by its own statements, asks Ray for at most 2 CPUs (RLlib's
    ``default_resource_request``: a Tune trial reserves every bundle, ``build_algo()`` its actors'):
    on a 2-core machine, where ``ray.init()`` offers 2, a block asking for 3 waits forever (the
    README's APPO block did, with APPO's default remote learner beside two EnvRunners)."""
    for block in drop_in_blocks():
        namespace: dict = {"__name__": "__main__"}
        exec(compile(_statements_before_training(block.for_test("/tmp/tune")), block.key, "exec"), namespace)
        assert cpus_needed(namespace["config"], tuner="Tuner(" in block.code) <= 2, block.key
