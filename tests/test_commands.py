"""Every command a user is shown works.

* ``--help`` of every console script in pyproject's ``[project.scripts]`` (as installed next
  to this interpreter), of every sub-command they have (argparse sub-parsers, and the
  ``SUBCOMMANDS = {name: (module, summary)}`` a CLI module dispatches by hand), of
  ``python -m PACKAGE`` for each installed package with a ``__main__``, and of every
  ``scripts/*.py``, ``scripts/*.sh`` and ``examples/*.py``: exit 0, a usage line, no
  traceback.
* Every shell command in a fenced ``bash``/``sh``/``shell``/``console`` block of README.md,
  SECURITY.md and docs/*.md runs and exits 0. Each block gets a scratch copy of the
  repository (its ``.venv`` linked in, ``.venv/bin`` first on ``PATH``); its commands run
  there one by one in order, so a later command may read what an earlier one wrote. A block
  whose first line is a comment naming a file (``# site-a.toml``) is written into the copies
  of its document first. Blocks run in parallel. A command that cannot run here is marked
  in the document, on the lines right before its block::

      <!-- not-run: REASON -->            every command of the next block

      <!-- commands:
      N PROGRAM not-run because REASON   command N (1-based) of the next block is not run
      N PROGRAM dry-run because REASON   run as ``make -n ...`` (make targets only)
      N PROGRAM append ARGS because REASON   run with ARGS appended (a short form)
      -->

  PROGRAM must be command N's first word, so a marker cannot silently drift onto another
  command. A command without a marker runs as shown; an unlabelled block that holds commands
  fails, so a new command cannot escape the check. A system tool that is not installed here
  (promtool) skips its command.
* Every command, run or not, and every command in a code span of the prose, and those of
  BENCHMARKS.md (never run: benchmarks take hours) names only files that exist, options its
  program's --help lists, and targets the Makefile has.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Generous: on a loaded 2-core machine one torch import can take a minute; they bound hangs.
HELP_TIMEOUT_S = 180
DOC_COMMAND_TIMEOUT_S = 240
WAIT_TIMEOUT_S = 900  # a test waits for its outcome at most this long
WORKERS = 6

DOCS = [ROOT / "README.md", ROOT / "SECURITY.md", *sorted((ROOT / "docs").glob("*.md"))]
# Documents whose commands are checked (files, options) but never run: benchmarks take hours.
# Their unlabelled blocks that hold commands are command listings.
CHECK_ONLY_DOCS = [ROOT / "BENCHMARKS.md"]
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# First words that make a line of an unlabelled block look like a command.
COMMAND_WORDS = {"python", "python3", "bash", "sh", "make", "pip", "torchrun", "prometheus"}


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: name -> ``module:function``."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@dataclass
class Outcome:
    """What one subprocess did."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float = 0.0

    def describe(self) -> str:
        tail = (self.stdout[-1500:] + "\n--- stderr ---\n" + self.stderr[-3000:]).strip()
        return f"$ {shlex.join(self.argv)}\nexit status {self.returncode}\n{tail}"


def run_command(argv: list[str], cwd: Path, timeout: float, env: dict | None = None) -> Outcome:
    start = time.monotonic()
    try:
        proc = subprocess.run(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:

        def text(b: bytes | str | None) -> str:
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")

        return Outcome(argv, None, text(err.stdout), text(err.stderr) + f"\ntimed out ({timeout}s)")
    return Outcome(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


# --- --help of every console script, sub-command and script --------------------------------


def sub_command_paths(parser: argparse.ArgumentParser) -> Iterator[list[str]]:
    """The argparse sub-parsers under ``parser``, as argv prefixes, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield [name]
                for rest in sub_command_paths(sub):
                    yield [name, *rest]


def module_sub_commands(module_name: str) -> Iterator[list[str]]:
    """Sub-command argv prefixes of a CLI module: its parser's sub-parsers, and the modules it
    dispatches by hand (``SUBCOMMANDS = {name: (module, summary)}``), recursively."""
    module = importlib.import_module(module_name)
    if hasattr(module, "build_parser"):
        yield from sub_command_paths(module.build_parser())
    for name, (sub_module, _summary) in getattr(module, "SUBCOMMANDS", {}).items():
        yield [name]
        for rest in module_sub_commands(sub_module):
            yield [name, *rest]


def runnable_packages() -> list[str]:
    """The packages pyproject installs that have a ``__main__`` (``python -m PACKAGE``)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    dirs = setuptools.get("package-dir", {})
    out = []
    for package in setuptools["packages"]:
        parent = next((p for p in sorted(dirs, key=len, reverse=True) if package.startswith(p)), "")
        folder = Path(dirs.get(parent, ".")) / package[len(parent) :].lstrip(".").replace(".", "/")
        if (ROOT / folder / "__main__.py").is_file():
            out.append(package)
    return out


def help_targets() -> dict[str, list[str]]:
    """Test id -> argv of every ``--help`` a user can ask for."""
    targets: dict[str, list[str]] = {}
    for script, entry in console_scripts().items():
        exe = str(BIN / script) if (BIN / script).exists() else shutil.which(script) or script
        targets[script] = [exe, "--help"]
        for path in module_sub_commands(entry.partition(":")[0]):
            targets[" ".join([script, *path])] = [exe, *path, "--help"]
    for package in runnable_packages():
        targets[f"python -m {package}"] = [sys.executable, "-m", package, "--help"]
    for path in sorted((ROOT / "scripts").glob("*.py")):
        targets[f"scripts/{path.name}"] = [sys.executable, str(path), "--help"]
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        targets[f"scripts/{path.name}"] = ["bash", str(path), "--help"]
    for path in sorted((ROOT / "examples").glob("*.py")):
        targets[f"examples/{path.name}"] = [sys.executable, str(path), "--help"]
    return targets


HELP_TARGETS = help_targets()
# ("help", target) -> its --help; ("doc", document, block line) -> {command key: outcome}.
Outcomes = dict[tuple, Future]


def check_help(outcome: Outcome) -> None:
    out = outcome.stdout + outcome.stderr
    assert outcome.returncode == 0, outcome.describe()
    assert "Traceback" not in out, outcome.describe()
    assert re.search(r"^usage:", outcome.stdout, re.M | re.I), outcome.describe()


@pytest.mark.timeout(WAIT_TIMEOUT_S)
@pytest.mark.parametrize("target", sorted(HELP_TARGETS))
def test_help(target: str, outcomes: Outcomes) -> None:
    check_help(outcomes["help", target].result())


@pytest.mark.timeout(60)
def test_every_script_takes_help() -> None:
    """A script that ignored --help would run for real when asked for help (setup.sh installs)."""
    for path in [*(ROOT / "scripts").glob("*.py"), *(ROOT / "scripts").glob("*.sh")]:
        text = path.read_text()
        assert "argparse" in text or "--help" in text, f"{path.name} must handle --help"


@pytest.mark.timeout(WAIT_TIMEOUT_S)
def test_manual_sub_commands_are_listed_in_the_help(outcomes: Outcomes) -> None:
    """A hand-dispatched sub-command is invisible to argparse: its parent's help must name it."""
    for script, entry in console_scripts().items():
        module = importlib.import_module(entry.partition(":")[0])
        for name in getattr(module, "SUBCOMMANDS", {}):
            assert f"{script} {name}" in outcomes["help", script].result().stdout, (script, name)


@pytest.mark.timeout(60)
def test_percent_in_a_config_description_is_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Help strings are %-formatted by argparse: any description must come out verbatim."""
    from gossipgrad.peer import cli

    fields = cli.iter_fields()
    key, annotation, _desc, default = fields[0]
    desc = "top-1% of 100%, not %(default)s, %s or %%"
    monkeypatch.setattr(cli, "iter_fields", lambda: [(key, annotation, desc, default)])
    text = cli.build_parser().format_help()
    assert " ".join(text.split()).count(desc) == 1, text


# --- shell commands shown in the documentation ----------------------------------------------

FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)\s*$")
MARKER = re.compile(r"<!--\s*(?P<kind>not-run|commands)\s*:(?P<body>.*?)-->", re.S)
DIRECTIVE = re.compile(
    r"^(?P<n>\d+) (?P<prog>\S+) "
    r"(?:(?P<action>not-run|dry-run)|append (?P<args>.+?)) because (?P<reason>\S.*)$"
)
FILE_COMMENT = re.compile(r"^#\s*(?P<name>[\w.-]+\.(?:toml|py))\b")


@dataclass
class DocCommand:
    """One shell command of a document, and how the test treats it."""

    doc: str  # path relative to the repository
    block: int  # 1-based line of its block's opening fence
    line: int  # 1-based line of its first line
    text: str  # as shown (continuation lines included)
    action: str = "run"  # run | not-run | dry-run | append
    args: str = ""  # appended for "append"
    reason: str = ""

    @property
    def key(self) -> str:
        return f"{self.doc}:{self.line}"

    def program(self) -> str:
        words = shlex.split(self.text, comments=True)
        while words and re.match(r"^\w+=", words[0]):  # VAR=value before the program
            words = words[1:]
        return words[0] if words else ""

    def shell_text(self) -> str:
        """What runs: the command as shown, or its marked short form."""
        if self.action == "append":
            return f"{without_comment(self.text)} {self.args}"
        if self.action == "dry-run":
            return re.sub(r"^make\b", "make -n", without_comment(self.text))
        return self.text


def without_comment(text: str) -> str:
    """A one-command shell line without its trailing ``# comment``."""
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    end = 0
    while lexer.get_token() is not None:
        end = lexer.instream.tell()
    return text[:end].rstrip()


@dataclass
class Doc:
    path: str
    commands: list[DocCommand] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # name -> content
    errors: list[str] = field(default_factory=list)
    inline: list[DocCommand] = field(default_factory=list)  # `commands` in the prose


def looks_like_command(line: str) -> bool:
    words = line.split()
    if not words:
        return False
    first = words[0]
    return (
        first in COMMAND_WORDS
        or first in console_scripts()
        or first.startswith(".venv/bin/")
        or first.startswith("$")
    )


def block_commands(lines: list[tuple[int, str]], lang: str) -> list[tuple[int, str]]:
    """(line, command) for each logical command; ``\\`` continues a line."""
    out: list[tuple[int, str]] = []
    start, parts = 0, []
    for number, raw in lines:
        line = raw.rstrip()
        if not parts:
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = number
        parts.append(line)
        if not line.endswith("\\"):
            out.append((start, "\n".join(parts)))
            parts = []
    return out


INLINE_CODE = re.compile(r"`([^`\n]+)`")
INLINE_PROGRAMS = {"make", "python", "python3", "bash"}


def inline_commands(rel: str, number: int, line: str) -> list[DocCommand]:
    """Commands with arguments in a prose line's code spans (checked, never run: they often
    hold placeholders such as SPEC.toml or ``...``)."""
    out = []
    for m in INLINE_CODE.finditer(line):
        words = m[1].split()
        first = words[0].removeprefix(".venv/bin/") if words else ""
        if len(words) > 1 and (first in INLINE_PROGRAMS or first in console_scripts()):
            out.append(DocCommand(rel, number, number, m[1], "not-run", reason="inline"))
    return out


def apply_marker(doc: Doc, path: str, marker: re.Match, commands: list[DocCommand]) -> None:
    body = marker["body"].strip()
    if marker["kind"] == "not-run":
        if not body:
            doc.errors.append(f"{path}: <!-- not-run: --> without a reason")
        for c in commands:
            c.action, c.reason = "not-run", body
        return
    for directive in filter(None, (d.strip() for d in body.splitlines())):
        m = DIRECTIVE.match(directive)
        if not m:
            doc.errors.append(f"{path}: bad directive {directive!r} (see tests/test_commands.py)")
            continue
        n = int(m["n"])
        if not 1 <= n <= len(commands):
            doc.errors.append(f"{path}: {directive!r}: the block has {len(commands)} commands")
            continue
        c = commands[n - 1]
        if c.program() != m["prog"]:
            doc.errors.append(
                f"{c.key}: marker {directive!r} names {m['prog']!r} but command {n} is "
                f"{c.program()!r}: update the marker"
            )
            continue
        c.action = m["action"] or "append"
        c.args, c.reason = m["args"] or "", m["reason"]
        if c.action == "dry-run" and c.program() != "make":
            doc.errors.append(f"{c.key}: dry-run is for make targets")


def parse_doc(path: Path, check_only: bool = False) -> Doc:
    rel = path.relative_to(ROOT).as_posix()
    doc = Doc(rel)
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            doc.inline += inline_commands(rel, i + 1, lines[i])
            i += 1
            continue
        start, indent, lang = i, len(m["indent"]), m["lang"].lower()
        i += 1
        body: list[tuple[int, str]] = []
        while i < len(lines) and not FENCE.match(lines[i]):
            body.append((i + 1, lines[i][indent:]))
            i += 1
        i += 1  # the closing fence
        if body and (f := FILE_COMMENT.match(body[0][1])):
            doc.files[f["name"]] = "\n".join(text for _, text in body) + "\n"
        texts = [text for _, text in body]
        if check_only:
            if lang in SHELL_LANGS or (not lang and any(map(looks_like_command, texts))):
                doc.commands += [
                    DocCommand(rel, start + 1, n, text, "not-run", reason="a benchmark")
                    for n, text in block_commands(body, "bash")
                ]
            continue
        if lang not in SHELL_LANGS:
            for number, text in body:
                if not lang and looks_like_command(text):
                    doc.errors.append(
                        f"{rel}:{number}: a command in an unlabelled block: label it ```bash"
                    )
                    break
            continue
        commands = [DocCommand(rel, start + 1, n, text) for n, text in block_commands(body, lang)]
        # A marker ends on the last non-blank line before the fence.
        above = start - 1
        while above >= 0 and not lines[above].strip():
            above -= 1
        if above >= 0 and lines[above].strip().endswith("-->"):
            opening = above
            while opening > 0 and "<!--" not in lines[opening]:
                opening -= 1
            marker = MARKER.search("\n".join(lines[opening : above + 1]))
            if marker:
                apply_marker(doc, f"{rel}:{start + 1}", marker, commands)
        doc.commands += commands
    return doc


PARSED = {
    d.path: d
    for d in [*map(parse_doc, DOCS), *(parse_doc(p, check_only=True) for p in CHECK_ONLY_DOCS)]
}
RUNNABLE = [c for d in PARSED.values() for c in d.commands if c.action != "not-run"]


def prepare_workspace(doc: Doc, block: int, base: Path) -> Path:
    """A scratch copy of the repository for one block, with its document's named blocks."""
    ws = base / f"{doc.path.replace('/', '_')}-{block}"
    shutil.copytree(
        ROOT,
        ws,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv*",
            "runs",
            "prom-data",  # what the commands themselves may leave in a checkout
            "__pycache__",
            "*.egg-info",
            ".*_cache",
            ".hypothesis",
        ),
    )
    (ws / ".venv").symlink_to(BIN.parent, target_is_directory=True)
    for name, content in doc.files.items():
        (ws / name).write_text(content, encoding="utf-8")
    return ws


SEARCH_PATH = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"


def not_installed(command: DocCommand) -> bool:
    """A system tool that is missing here (e.g. promtool without Prometheus installed)."""
    program = command.program()
    return "/" not in program and shutil.which(program, path=SEARCH_PATH) is None


def run_block(doc: Doc, block: int, base: Path) -> dict[str, Outcome]:
    """Run one block's commands in order, in a workspace of their own."""
    ws = prepare_workspace(doc, block, base)
    env = {**os.environ, "PATH": SEARCH_PATH}
    env.pop("PYTEST_CURRENT_TEST", None)
    return {
        c.key: run_command(["bash", "-c", c.shell_text()], ws, DOC_COMMAND_TIMEOUT_S, env)
        for c in doc.commands
        if c.block == block and c.action != "not-run" and not not_installed(c)
    }


@pytest.mark.timeout(60)
def test_doc_markers_are_valid() -> None:
    errors = [e for d in PARSED.values() for e in d.errors]
    assert not errors, "\n".join(errors)
    assert RUNNABLE, "no runnable command found: is the block parser broken?"


@pytest.mark.timeout(WAIT_TIMEOUT_S)
@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: c.key)
def test_doc_command_runs(command: DocCommand, outcomes: Outcomes) -> None:
    if not_installed(command):
        pytest.skip(f"{command.program()} is not installed")
    outcome = outcomes["doc", command.doc, command.block].result()[command.key]
    out = outcome.stdout + outcome.stderr
    assert outcome.returncode == 0, f"{command.key}\n{outcome.describe()}"
    assert "Traceback" not in out, f"{command.key}\n{outcome.describe()}"


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest) -> Iterator[Outcomes]:
    """Starts every --help and every selected document block at once, WORKERS at a time, the
    blocks with the most commands first (the longest chains)."""
    blocks = {
        (item.callspec.params["command"].doc, item.callspec.params["command"].block)
        for item in request.session.items
        if hasattr(item, "callspec") and "command" in item.callspec.params
    }

    def size(block: tuple[str, int]) -> int:
        return sum((c.doc, c.block) == block for c in RUNNABLE)

    with (
        tempfile.TemporaryDirectory(prefix="gossipgrad-docs-") as base,
        ThreadPoolExecutor(WORKERS) as pool,
    ):
        futures: Outcomes = {
            ("doc", path, block): pool.submit(run_block, PARSED[path], block, Path(base))
            for path, block in sorted(blocks, key=lambda b: (-size(b), b))
        }
        for target, argv in HELP_TARGETS.items():
            futures["help", target] = pool.submit(run_command, argv, ROOT, HELP_TIMEOUT_S)
        yield futures


# --- commands that are not run: their files and options must still exist -------------------

REPO_FILE = re.compile(
    r"^(?:\.venv/bin/)?(?P<path>(?:scripts|examples|tests|grafana|proto)/[\w./-]+)$"
)


def help_key(words: list[str]) -> tuple[str, int] | None:
    """The --help target a command's options belong to (a console script, maybe with its
    sub-command, or a script/example file), and where its arguments start."""
    for i, word in enumerate(words):
        name = word.removeprefix(".venv/bin/")
        for end in range(len(words), i, -1):
            key = " ".join([name, *words[i + 1 : end]])
            if key in HELP_TARGETS:
                return key, end
    return None


def static_problems(command: DocCommand, help_text: dict[str, str]) -> list[str]:
    """Files a command names that do not exist; options its program does not have; make
    targets the Makefile lacks."""
    words = shlex.split(command.text, comments=True)
    problems = []
    for word in words:
        m = REPO_FILE.match(word.split("=", 1)[-1])
        if m and "*" not in word and not (ROOT / m["path"]).exists():
            problems.append(f"{command.key}: {m['path']} does not exist")
    if command.program() == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        for word in words[1:]:
            if not word.startswith("-") and "=" not in word and word not in targets:
                problems.append(f"{command.key}: make has no target {word!r}")
    found = help_key(words)
    if found:
        key, start = found
        for word in words[start:]:
            option = word.split("=", 1)[0]
            if option.startswith("--") and not re.search(
                rf"(?<![\w.-]){re.escape(option)}(?![\w.-])", help_text[key]
            ):
                problems.append(f"{command.key}: {key} has no option {option}")
    return problems


@pytest.mark.timeout(WAIT_TIMEOUT_S)
def test_documented_commands_name_existing_files_and_options(outcomes: Outcomes) -> None:
    """Also for commands that are not run (BENCHMARKS.md, GPU sites, servers): a renamed
    script, option or make target fails here."""
    help_text = {key: outcomes["help", key].result().stdout for key in HELP_TARGETS}
    problems = [
        p
        for d in PARSED.values()
        for c in [*d.commands, *d.inline]
        for p in static_problems(c, help_text)
    ]
    assert not problems, "\n".join(problems)
