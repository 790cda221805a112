"""The docs: docs/metrics.md is generated and current, links resolve, labels are explained.

- docs/metrics.md equals what ``python docs/gen_metrics.py`` writes from metric_names.py and
  docs/metric_notes.yaml, and lists every name constant with its constant name.
- Every relative link and image in README.md and docs/*.md points at a file that exists and, with
  ``#anchor``, at a heading of that file.
- An internal label (TELE-320, ADR-009, "seed 002") appears only in a file that links to the
  glossary, and the glossary explains it.
- The README stays short, its Python examples parse, and its drop-in example does what it says on
  RLlib's own APPO module (checked on the README's text, not on a copy).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from collections import Counter
from pathlib import Path

from gradmon_ray import metric_names as mn

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DOC_FILES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
README_MAX_BYTES = 12 * 1024


def _generator():
    spec = importlib.util.spec_from_file_location("gen_metrics", DOCS / "gen_metrics.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


GEN = _generator()


def test_metrics_md_is_up_to_date():
    current = (DOCS / "metrics.md").read_text()
    assert current == GEN.render(), (
        "docs/metrics.md is stale (metric_names.py or docs/metric_notes.yaml changed): "
        f"run `{GEN.COMMAND}` and commit the result"
    )


def test_metrics_md_lists_every_name_constant_with_its_constant_name():
    text = (DOCS / "metrics.md").read_text()
    for attr, value in vars(mn).items():
        if attr.isupper() and isinstance(value, str):
            shown = re.sub(r"\{(\w+)\}", r"<\1>", value)
            assert f"| `{shown}` | `{attr}` |" in text, f"docs/metrics.md has no row for {attr}"


def test_metrics_md_carries_each_docstring_and_code():
    """The generator writes the source's docstrings and code tables, not just the names."""
    text = (DOCS / "metrics.md").read_text()
    entries = [e for section in GEN._source_entries() for e in section.entries]
    documented = [e for e in entries if e.doc]
    assert len(documented) > 50, len(documented)
    for e in documented:
        assert GEN._cell(GEN._prose(e.doc)) in text, f"docs/metrics.md lacks the docstring of {e.constant}"
    for band, code in mn.HEALTH_CODES.items():
        assert f"| {band} | {code} |" in text


def test_every_metric_note_is_keyed_by_a_known_name():
    import yaml

    notes = yaml.safe_load((DOCS / "metric_notes.yaml").read_text())
    unknown = set(notes) - GEN.known_note_keys()
    assert not unknown, f"docs/metric_notes.yaml has notes for names metric_names.py does not define: {unknown}"


def _prose_lines(text: str) -> list[str]:
    """Lines outside fenced code blocks, with inline code spans blanked out."""
    out, in_block = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        if not in_block:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    anchors = set()
    in_block = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
            continue
        match = None if in_block else re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if match:
            slug = _slug(match.group(1))
            anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _links(path: Path) -> list[str]:
    return [target for line in _prose_lines(path.read_text()) for target in LINK.findall(line)]


def test_the_link_checker_sees_links_and_anchors():
    assert "drop-in-new-in-this-release" in _anchors(ROOT / "README.md")
    assert "docs/metrics.md" in _links(ROOT / "README.md")
    assert _slug("Installing torch (read this if you have a GPU)") == "installing-torch-read-this-if-you-have-a-gpu"


def test_every_relative_link_resolves():
    """Every relative link and image of README.md and docs/*.md; the failure lists every broken one."""
    broken = []
    for path in DOC_FILES:
        for target in _links(path):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(ROOT)}: {target}"
            if not dest.exists():
                broken.append(f"{where}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{len(broken)} broken links:\n" + "\n".join(broken)


LABEL = re.compile(r"\b(TELE-\d{3}|ADR-\d{3})\b|\bseeds? (\d{3})(?: (?:and|\+) (\d{3}))?")


def _labels(text: str) -> set[str]:
    found = set()
    for tele_or_adr, seed, other_seed in LABEL.findall(text):
        found |= {tele_or_adr} if tele_or_adr else {f"seed {seed}"} | ({f"seed {other_seed}"} if other_seed else set())
    for group in re.findall(r"TELE-(\d{3}(?:/\d{3})+)", text):  # TELE-310/300/301
        found |= {f"TELE-{n}" for n in group.split("/")}
    return found


def test_every_internal_label_is_in_the_glossary_and_linked_to_it():
    glossary = (DOCS / "glossary.md").read_text()
    explained = _labels(glossary)
    for path in DOC_FILES:
        if path.name == "glossary.md":
            continue
        text = path.read_text()
        labels = _labels(text)
        if labels:
            assert "glossary.md" in text, f"{path.relative_to(ROOT)} uses {sorted(labels)} without linking the glossary"
        assert labels <= explained, f"{path.relative_to(ROOT)}: {sorted(labels - explained)} not in docs/glossary.md"


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail to docs/ (limit {README_MAX_BYTES})"


def test_python_examples_parse():
    failures = []
    for path in DOC_FILES:
        for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S):
            try:
                ast.parse(block)
            except SyntaxError as error:
                failures.append(f"{path.relative_to(ROOT)}: {error}")
    assert not failures, "\n".join(failures)


README_TRAIN = [
    "algo = config.build_algo()",
    "result = algo.train()",
    "while 'learners' not in result:\n    result = algo.train()",
]
"""The README block's training statements (APPO's first ``train()`` may hold no learner results)."""


def _readme_drop_in_example() -> tuple[list[ast.stmt], list[ast.stmt], ast.stmt]:
    """The README's drop-in block: (the statements that build ``config``, the training ones, the read)."""
    readme = (ROOT / "README.md").read_text()
    blocks = [
        b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "with_gradmon(" in b and "build_algo()" in b
    ]
    assert len(blocks) == 1, blocks
    *setup, build, first, loop, read = ast.parse(blocks[0]).body
    return setup, [build, first, loop], read


def test_the_readme_drop_in_example_monitors_rllibs_own_appo_module_as_it_says():
    """The README's example, not a copy of it: its config is built here (without Ray), and
    - its ``learner_class`` is gradmon's monitor over RLlib's ``APPOTorchLearner``;
    - its ``heads`` regexes, through gradmon's head resolution, select exactly the parameters of
      the ``pi`` and ``vf`` submodules of RLlib's default APPO module for CartPole (fetched by
      attribute name: the oracle), and no other;
    - the key it reads is RLlib's learner-results key, RLlib's default module id and gradmon's
      metric name for head ``pi`` (RLlib's and gradmon's constants, not strings typed here)."""
    import gymnasium as gym
    from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.utils.metrics import LEARNER_RESULTS

    from gradmon_ray.rllib.heads import head_parameter_groups
    from gradmon_ray.rllib.monitor import GradmonMonitor

    setup, train, read = _readme_drop_in_example()
    namespace: dict = {}
    exec(compile(ast.Module(body=setup, type_ignores=[]), "README.md", "exec"), namespace)
    config = namespace["config"]
    assert [ast.unparse(stmt) for stmt in train] == README_TRAIN
    assert issubclass(config.learner_class, APPOTorchLearner) and issubclass(config.learner_class, GradmonMonitor)

    spec = config.get_default_rl_module_spec()
    env = gym.make(config.env)
    spec.observation_space, spec.action_space, spec.model_config = env.observation_space, env.action_space, {}
    module = spec.build()
    groups = head_parameter_groups(module, config.learner_config_dict["gradmon"]["heads"])
    assert set(groups) == {"pi", "vf"}
    for head in ("pi", "vf"):
        want = {id(p) for p in getattr(module, head).parameters()}
        assert want and {id(p) for p in groups[head]} == want, head

    keys = []
    node = read.value
    while isinstance(node, ast.Subscript):
        keys.insert(0, ast.literal_eval(node.slice))
        node = node.value
    assert ast.unparse(node) == "result"
    assert keys == [LEARNER_RESULTS, DEFAULT_MODULE_ID, mn.head_metric(mn.HEAD_GRAD_NORM, "pi")]


def test_readme_has_a_short_tuner_example():
    readme = (ROOT / "README.md").read_text()
    tuner = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "GradmonMLflowCallback" in b)
    assert "config.callbacks(GradmonMLflowCallback)" in tuner and "Tuner(" in tuner
    assert len([ln for ln in tuner.splitlines() if ln.strip()]) <= 10, tuner
