"""The README, the docs, .ci/run and metric_names stay in sync.

The README keeps the install / test / train commands; every metric and tag name is documented in
docs/metrics.md (generated from metric_names.py, see tests/test_docs.py); the plot artifacts in
docs/operations.md; every ``gradmon-ray`` command in the README and docs/*.md must parse.  Every
fenced block of the README and docs/*.md is classified in ``tests/doc_blocks.py`` (a new or changed
one fails here until it is); here, without Ray: the edits still apply, the config blocks load through
the product's parser, the Ray-free python blocks run, the samples of Ray-free messages have the shape
of what the call prints now, and every drop-in block fits 2 cores (tests/e2e/test_doc_commands_e2e.py
runs the rest).
"""

from __future__ import annotations

import ast
import contextlib
import logging
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import tomllib

from gradmon_ray import metric_names as mn
from gradmon_ray.app.cli import build_parser
from gradmon_ray.config import ConfigError, load_config
from gradmon_ray.rllib.settings import GradmonSettings
from gradmon_ray.viz.plots import ENTROPY_FILE, HEATMAP_FILE, LINES_FILE, PROBE_FILE
from gradmon_ray.viz.report import PLOTS_ARTIFACT_DIR
from tests.doc_block_kinds import Commands, Config, Output, Script, sample_lines, shape, shows_in_order
from tests.doc_blocks import KINDS, WITHOUT_RAY, classified, drop_in_blocks, fences
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


def _command_words(text: str) -> list[list[str]]:
    """The ``gradmon-ray`` commands of a shell block, split as bash does (a ``$ `` prompt, comments and
    leading ``NAME=value`` assignments dropped)."""
    commands = []
    for raw in text.splitlines():
        words: list[str] = []
        with contextlib.suppress(ValueError):  # a line continuing a quoted argument: not a command
            words = shlex.split(raw.removeprefix("$ "), comments=True)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
            words.pop(0)
        if words[:1] == ["gradmon-ray"]:
            commands.append(words)
    return commands


def test_every_gradmon_ray_command_in_the_readme_and_docs_parses():
    """Copy-pasted commands must not die on a usage error (placeholders are fine)."""
    parser = build_parser()
    shell = [f for f in fences() if f.info in ("", "bash")]
    commands = [(f.key, words) for f in shell for words in _command_words(f.text) if "..." not in words]
    assert sum(key.startswith("README.md@") for key, _ in commands) >= 3, commands
    assert len(commands) >= 8, commands
    for key, words in commands:
        args = parser.parse_args(words[1:])
        assert args.command in {"train", "tune", "watch", "report"}, (key, words)


def _entry(fence) -> str:
    return f'    # {fence.first[:100]}\n    "{fence.key}": ...,  (line {fence.line})'


def test_every_block_of_the_docs_is_classified():
    """A block added to or changed in README.md or docs/*.md has no entry in ``tests/doc_blocks.py``'s
    ``KINDS`` (keyed by file and a hash of its text) until someone says what it is: run, output,
    config or not runnable here, and why; an entry whose block is gone is stale."""
    found = classified()
    unclassified = [_entry(fence) for fence, kind in found if kind is None]
    stale = sorted(set(KINDS) - {fence.key for fence, _ in found})
    assert not unclassified and not stale, (
        "classify these blocks in tests/doc_blocks.py KINDS (a changed block has a new key):\n"
        + "\n".join(unclassified)
        + f"\nentries whose block is gone or changed: {stale}"
    )


def _is_test(node_id: str) -> bool:
    path, _, name = node_id.partition("::")
    return (ROOT / path).is_file() and f"def {name}(" in (ROOT / path).read_text()


def test_every_edit_applies_and_every_reference_resolves():
    """The edits still find their text, the scripts still parse, a command block runs as many
    ``gradmon-ray`` commands as it has exit statuses, a placeholder it uses is one a block captures,
    a file it writes is a block's, and an output names a command block or a test that exists."""
    captured = {name for kind in KINDS.values() if isinstance(kind, Commands) for name in kind.captures}
    failures = []
    for fence, kind in classified():
        if isinstance(kind, Script):
            ast.parse(kind.edit.apply(fence.key, fence.text))
        elif isinstance(kind, Commands):
            code = kind.edit.apply(fence.key, kind.script(fence.text))
            if len(_command_words(code)) != len(kind.rcs):
                failures.append(f"{fence.key}: {len(_command_words(code))} commands, {len(kind.rcs)} exit statuses")
            failures += [
                f"{fence.key}: no block captures {p}" for p in re.findall(r"\b[A-Z]+_ID\b", code) if p not in captured
            ]
            failures += [
                f"{fence.key}: {n} from {t}" for n, t in kind.edit.files.items() if ".md@" in t and t not in KINDS
            ]
        elif isinstance(kind, Output) and not (isinstance(KINDS.get(kind.made_by), Commands) or _is_test(kind.made_by)):
            failures.append(f"{fence.key}: made by {kind.made_by}, neither a command block nor a test")
    assert captured == {"RUN_ID"} and not failures, "\n".join(failures)


def _statements_before_training(code: str) -> str:
    """A block's statements up to (not including) the first that trains: they build ``config``, no Ray."""
    body = ast.parse(code).body
    first = next(i for i, s in enumerate(body) if "build_algo()" in ast.unparse(s) or "Tuner(" in ast.unparse(s))
    return ast.unparse(ast.Module(body=body[:first], type_ignores=[]))


def test_every_drop_in_block_fits_two_cores_by_rllibs_resource_request():
    """Each block's config, built by its own statements, asks Ray for at most 2 CPUs (RLlib's
    ``default_resource_request``: a Tune trial reserves every bundle, ``build_algo()`` its actors'):
    on a 2-core machine, where ``ray.init()`` offers 2, a block asking for 3 waits forever (the
    README's APPO block did, with APPO's default remote learner beside two EnvRunners)."""
    blocks = drop_in_blocks()
    assert {b.key for b in blocks} >= {"README.md:APPOConfig", "README.md:Tuner", "docs/callback.md:Tuner"}
    for block in blocks:
        namespace: dict = {"__name__": "__main__"}
        exec(compile(_statements_before_training(block.for_test("/tmp/tune")), block.key, "exec"), namespace)
        assert cpus_needed(namespace["config"], tuner="Tuner(" in block.code) <= 2, block.key


def test_every_config_block_loads_through_its_parser(tmp_path):
    """A run config block (or part of one) is what ``gradmon-ray train --config`` accepts: the product's
    own loader (YAML 1.2 numbers, every field validated); a TOML block is TOML."""
    failures = []
    for fence, kind in classified():
        if not isinstance(kind, Config):
            continue
        path = tmp_path / f"{fence.line}.{fence.info}"
        path.write_text(fence.text)
        try:
            if kind.parser == "gradmon":
                load_config(path)
            else:
                tomllib.loads(fence.text)
        except (ConfigError, tomllib.TOMLDecodeError) as exc:
            failures.append(f"{fence.key} ({fence.first}): {exc}")
    assert not failures, "\n".join(failures)


def _fast_scripts() -> dict[str, str]:
    return {fence.key: fence.text for fence, kind in classified() if isinstance(kind, Script) and kind.fast}


def test_the_value_heads_block_declares_a_critic_the_settings_parser_takes():
    """docs/heads.md's block runs as written: its ``learner_config_dict`` passes the learner's own settings
    parser with ``critic`` a value head, and its module class declares the same."""
    (key,) = [k for k, text in _fast_scripts().items() if "value_heads" in text]
    namespace: dict = {"__name__": "__main__"}
    exec(compile(_fast_scripts()[key], key, "exec"), namespace)
    settings = GradmonSettings.from_learner_config(namespace["learner_config_dict"])
    assert settings.value_heads == ("critic",) == namespace["MyModule"].value_heads
    assert sorted(settings.heads) == ["critic", "pi"]


def test_the_mutmut_shim_block_disables_compile_only_in_the_stats_pass(monkeypatch):
    """docs/mutation.md's shim, run as written: with ``MUTANT_UNDER_TEST=stats`` ``torch.compile`` hands the
    function back (decorator form too); otherwise it is torch's own compile, called with the same arguments."""
    import torch

    (key,) = [k for k, text in _fast_scripts().items() if "MUTANT_UNDER_TEST" in text]
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append((a, k)) or "compiled")
    exec(compile(_fast_scripts()[key], key, "exec"), {"__name__": "__main__"})

    def fn(x):
        return x

    monkeypatch.setenv("MUTANT_UNDER_TEST", "stats")
    assert torch.compile(fn) is fn and torch.compile(fullgraph=True)(fn) is fn and not calls
    monkeypatch.setenv("MUTANT_UNDER_TEST", "mutant_1")
    assert torch.compile(fn, fullgraph=True) == "compiled" and calls == [((fn,), {"fullgraph": True})]


@contextlib.contextmanager
def _warnings(name: str) -> Iterator[list[str]]:
    """The messages logger ``name`` warns with inside the block."""
    got: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: got.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(name).addHandler(handler)
    try:
        yield got
    finally:
        logging.getLogger(name).removeHandler(handler)


def _outputs_made_here() -> list[str]:
    """What the calls behind the docs' Ray-free samples print, made here: ``check_gradmon`` with a
    misspelled key, a head regex matching nothing on RLlib's default PPO module, and the zero-config
    heads of RLlib's LSTM example module (its warning line)."""
    import gymnasium as gym
    import numpy as np
    from ray.rllib.algorithms.ppo import PPOConfig
    from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec
    from ray.rllib.examples.rl_modules.classes.lstm_containing_rlm import LSTMContainingRLModule

    from gradmon_ray.rllib import with_gradmon
    from gradmon_ray.rllib.dropin import check_gradmon
    from gradmon_ray.rllib.zero_config_heads import zero_config_heads

    printed = []
    for settings in ({"heds": {"pi": r"^pi\."}}, {"heads": {"pi": r"^pi\.", "value": r"^value_head\."}}):
        config = PPOConfig().environment("CartPole-v1")
        config.learners(learner_class=with_gradmon(PPOTorchLearner), learner_config_dict={"gradmon": settings})
        try:
            check_gradmon(config)
        except ValueError as exc:
            printed += [f"ValueError: {exc}", str(exc)]
    spaces = {"observation_space": gym.spaces.Box(-1, 1, (4,), np.float32), "action_space": gym.spaces.Discrete(2)}
    lstm = RLModuleSpec(module_class=LSTMContainingRLModule, **spaces, model_config={"lstm_cell_size": 8}).build()
    with _warnings("gradmon_ray.rllib.zero_config_heads") as warned:
        zero_config_heads(lstm)
    return printed + warned


def test_the_outputs_the_docs_show_without_ray_have_their_shape():
    """Each sample the docs show of a message a Ray-free call makes is, in shape, what the call prints
    now (``WITHOUT_RAY``: the misspelled-key line, the regex error, the LSTM module's heads warning)."""
    made = "\n".join(_outputs_made_here())
    samples = [
        (fence, kind) for fence, kind in classified() if isinstance(kind, Output) and kind.made_by == WITHOUT_RAY
    ]
    assert len(samples) == 3, samples
    missing = [
        f"{fence.key}: {line}" for fence, kind in samples for line in shows_in_order(sample_lines(fence, kind), made)
    ]
    assert not missing, "\n".join(missing) + "\nprinted:\n" + made


def test_a_sample_line_matches_lines_of_its_shape_only():
    """The shape of a progress line lets ids, numbers, heads and bands vary, and nothing else."""
    sample = "iter 1/20 | env steps 1024 | return -0.781 | worst head slot 0.226 (healthy) | latched: none"
    assert shape(sample).fullmatch(
        "iter 3/3 | env steps 768 | return inf | worst head op 12.5 (exploding) | latched: none"
    )
    assert not shape(sample).fullmatch(
        "iter 3/3 | env steps 768 | return 1.0 | worst head op 0.2 (healthy) | latched: op"
    )
    assert not shape(sample).fullmatch("iter 3/3 | env steps 768 | worst head op 0.2 (healthy) | latched: none")
    assert shape("a 1f0c... b ...").fullmatch(f"a {'0' * 32} b anything at all")


def test_the_folders_the_internals_doc_draws_exist():
    """docs/internals.md's drawing of the repository: every folder and file it names is there."""
    (fence,) = [f for f in fences() if f.file == "docs/internals.md" and f.first == "gradmon_ray/"]
    named = []
    for line in fence.text.splitlines():
        if line.startswith("   "):
            continue  # a description's second line
        under = "gradmon_ray/" if line.startswith("  ") else ""
        named += [under + m for m in re.findall(r"(?:^|;)\s*([\w.]+/|[\w.]+\.(?:py|yaml))(?=\s)", line + " ")]
    assert len(named) >= 20, named
    missing = [name for name in named if not (ROOT / name).exists()]
    assert not missing, missing
