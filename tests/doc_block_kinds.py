"""Every fenced block of README.md and docs/*.md, read at test time, what kind it is, and what a test run changes.

A block is keyed by its file and a hash of its text (``README.md@1a2b3c4d``): a block added or changed
has no entry in ``tests/doc_blocks.py::KINDS`` until someone classifies it, and
``tests/test_readme.py`` fails in the fast lane until then.  The kinds:

- ``Script``: a python block run as a script, in a fresh namespace named ``__main__``: with Ray by
  ``tests/e2e/doc_block_runner.py`` (one process for all of them), without it in the fast lane.
- ``Commands``: shell commands, run through bash in a temporary working directory by the same runner
  after the scripts, each ``gradmon-ray`` in the runner's own (warm) process, on the suite's shared Ray.
- ``Output``: what a command printed (or a file it wrote); checked against the output of the block
  that makes it, or made by the test named.
- ``Config``: a config file or a fragment of one, loaded through the product's parser (gradmon's
  run config) or ``tomllib``.
- ``NotRun``: not runnable here, with the reason (a cloud cluster, a GPU, an hour of mutmut, a diagram).

An edit only shrinks numbers (batch sizes, iterations), points a directory at the test's own, fills a
placeholder the reader fills (``RUN_ID``: the run an earlier block made), or writes a file the prose
next to the block describes; what a script leaves to the reader (``config``: "your PPOConfig") the
edit's ``prelude`` supplies.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^( *)(```+)(.*)$")
RUN_CONFIG = re.compile(r"tune\.RunConfig\(([^()]*)\)")
RAY = "ray"
"""A command's expected end: run up to Ray, exit 2 at its Ray address check (``Commands.rcs``)."""
NUMBER = r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?"


@dataclass(frozen=True)
class Fence:
    """One fenced block as the markdown holds it (a fence indented in a list item: its indent removed)."""

    file: str
    line: int
    info: str
    text: str

    @property
    def key(self) -> str:
        return f"{self.file}@{hashlib.sha256(self.text.encode()).hexdigest()[:8]}"

    @property
    def first(self) -> str:
        return next((line for line in self.text.splitlines() if line.strip()), "")


def fences(files: list[Path] = DOC_FILES) -> list[Fence]:
    """Every fenced block of ``files``, in file order."""
    found = []
    for path in files:
        lines = path.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            match = FENCE.match(lines[i])
            if not match:
                i += 1
                continue
            indent, ticks = len(match.group(1)), match.group(2)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
            body = "".join(line[indent:] + "\n" for line in lines[i + 1 : end])
            found.append(Fence(str(path.relative_to(ROOT)), i + 1, match.group(3).strip(), body))
            i = end + 1
    return found


@dataclass(frozen=True)
class Edit:
    """What a test run of one block changes: ``replace`` (every occurrence, at least one), a ``prelude``
    (scripts), files written into the working directory first (``files``: name -> the key of the
    block whose text it is), and for scripts ``tune_dir`` (the block's RunConfig gets
    ``storage_path=<the test's directory>``)."""

    replace: dict[str, str] = field(default_factory=dict)
    prelude: str = ""
    tune_dir: bool = False
    files: dict[str, str] = field(default_factory=dict)

    def apply(self, key: str, code: str, tune_dir: str = "/tmp/tune") -> str:
        for old, new in self.replace.items():
            assert old in code, f"{key}: expected {old!r} in the block"
            code = code.replace(old, new)
        if self.tune_dir:
            assert len(RUN_CONFIG.findall(code)) == 1, f"{key}: expected one tune.RunConfig(...)"
            code = RUN_CONFIG.sub(lambda m: f"tune.RunConfig({m.group(1)}, storage_path={tune_dir!r}, verbose=0)", code)
        return self.prelude + code


@dataclass(frozen=True)
class Script:
    edit: Edit = Edit()
    fast: bool = False
    """No Ray: the fast lane runs it in-process (``tests/test_readme.py``)."""
    drop_in: str = ""
    """A drop-in block's old key (``README.md:APPOConfig``), by which tests/e2e/test_dropin_e2e.py finds it."""


@dataclass(frozen=True)
class Commands:
    edit: Edit = Edit()
    rcs: tuple[int | str, ...] = (0,)
    """Each ``gradmon-ray`` command's exit status, in order: 0, the status the docs give, or ``RAY``:
    run with a Ray address nothing answers, the command runs exactly as written up to its Ray address
    check (flags, the config or sweep file, every search-space value, the env and model built, the
    store), then exits 2; for lines whose full run would repeat another block's or test's (time)."""
    captures: dict[str, str] = field(default_factory=dict)
    """Placeholder -> a regex over this block's output whose group 1 fills it in later blocks."""

    def script(self, text: str) -> str:
        """The bash the block runs: a ``$ `` prompt block runs its prompt lines, others every line."""
        prompts = [line[2:] for line in text.splitlines() if line.startswith("$ ")]
        return "".join(f"{p}\n" for p in prompts) if prompts else text


@dataclass(frozen=True)
class Output:
    made_by: str
    """The key of the ``Commands`` block that prints it, or the test (``path::name``) that makes it."""
    command: int = 0
    """Which ``gradmon-ray`` command of that block."""
    lines: tuple[int, ...] | None = None
    """The sample's lines that must appear, in this order, in the command's output (None: all but ``...``)."""


@dataclass(frozen=True)
class Config:
    parser: str
    """``gradmon``: a run config (or part of one) through ``load_config``; ``toml``: ``tomllib``."""


@dataclass(frozen=True)
class NotRun:
    why: str


Kind = Script | Commands | Output | Config | NotRun


def shape(sample: str) -> re.Pattern[str]:
    """A regex for lines of a sample's shape: ids, run names, numbers, head names and bands vary, a
    ``...`` stands for anything, the rest is literal."""
    variable = {
        r"[0-9a-f]{32}|[0-9a-f]{4}\.\.\.": r"[0-9a-f]{32}",  # run and episode ids (1f0c... shortened)
        r"\S+-\d{8}-\d{6}-[a-z0-9]{4}": r"\S+-\d{8}-\d{6}-[a-z0-9]{4}",  # run names
        r"\b[0-9a-f]{5}_\d{5}\b": r"[0-9a-f]{5}_\d{5}",  # Tune trial ids
        r"(?<=worst head )\S+": r"\S+",
        r"\((?:dead|weak|healthy|elevated|exploding|spiking)\)": r"\(\w+\)",
        rf"(?<![\w.]){NUMBER}(?![\w.])|\binf\b|\bnan\b": rf"(?:{NUMBER}|inf|nan)",
        r"\.\.\.": ".*",
    }
    parts, pos = [], 0
    for match in re.finditer("|".join(f"({p})" for p in variable), sample):
        parts += [re.escape(sample[pos : match.start()]), list(variable.values())[match.lastindex - 1]]
        pos = match.end()
    return re.compile("".join([*parts, re.escape(sample[pos:])]))


def sample_lines(fence: Fence, kind: Output) -> list[str]:
    """The lines of an output sample that a run must reproduce in shape (a ``$ `` prompt line excluded)."""
    lines = [line for line in fence.text.splitlines() if not line.startswith("$ ")]
    if kind.lines is not None:
        return [lines[i] for i in kind.lines]
    return [line for line in lines if line.strip() not in ("", "...", "^C")]


def shows_in_order(samples: list[str], output: str) -> list[str]:
    """The sample lines that do not appear in shape, in order, among ``output``'s lines (empty: all do)."""
    lines, at, missing = output.splitlines(), 0, []
    for sample in samples:
        pattern = shape(sample)
        hit = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i].rstrip())), None)
        if hit is None:
            missing.append(sample)
        else:
            at = hit + 1
    return missing
