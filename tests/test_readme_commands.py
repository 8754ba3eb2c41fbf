"""Every command that README.md and docs/benchmarks.md name exists, and its flags parse.

The commands are read from the pages' code blocks and inline code spans. For each one that runs a script of this
repository (`benchmarks/...`, `scripts/...`, `examples/...`), the script must exist; a Python script's arguments
must parse with the script's own argparse options, rebuilt from its source (its `add_argument` calls) without
importing or running it, so this stays a fast unit test. Arguments after `--extra` (the benchmarks' pass-through)
or a bare `--`, the arguments of `relax-train` itself and of the repository's shell scripts (which hand theirs to
relax-train), and any flag named on its own in the README must be relax-train flags. Relative links (files and
`#anchors`) must resolve. The README stays a front page (at most MAX_README_LINES lines) and keeps the exact test
command that .ci/run runs.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/benchmarks.md")
MAX_README_LINES = 160
CI_COMMAND = "RELAX_SETUP_SGLANG=1 bash scripts/setup.sh && .venv/bin/python -m pytest -q tests"

SCRIPT = re.compile(r"^(?:\./)?((?:benchmarks|scripts|examples)/[\w./-]+\.(?:py|sh))$")
LAUNCHERS = {"bash", "sh", "python", "python3", ".venv/bin/python", "exec"}
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SEPARATORS = {"&&", "||", "|", ";"}
PLACEHOLDER_FLAGS = {"--flag"}  # the README quotes the refusal message `not supported yet: --flag`


# --- reading commands out of Markdown --------------------------------------------------------------------------


def code_pieces(text: str) -> list[tuple[int, str]]:
    """(line number, code) for every line of a fenced block (backslash continuations joined) and inline span."""
    pieces: list[tuple[int, str]] = []
    in_fence = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            if pending:
                number, line = pending[0], pending[1] + " " + line.strip()
                pending = None
            if line.rstrip().endswith("\\"):
                pending = (number, line.rstrip()[:-1])
                continue
            pieces.append((number, line.strip()))
        else:
            pieces.extend((number, span) for span in re.findall(r"`([^`\n]+)`", line))
    return pieces


@dataclass
class Command:
    where: str
    program: str  # a script path, or "relax-train"
    args: list[str] = field(default_factory=list)  # the program's own arguments
    train_args: list[str] = field(default_factory=list)  # arguments that go on to relax-train
    launched: bool = True  # False: the script is only named (`examples/launch/run-grpo-colocate.sh`), not run


def _tokens(code: str) -> list[str]:
    try:
        return shlex.split(code, comments=True)
    except ValueError:  # an unbalanced quote in prose: read it word by word
        return code.split()


def commands(text: str, name: str) -> tuple[list[Command], list[tuple[str, str]]]:
    """The script and relax-train invocations of a page, and (where, code) of the pieces that run nothing."""
    found: list[Command] = []
    other: list[tuple[str, str]] = []
    for line_no, code in code_pieces(text):
        where = f"{name}:{line_no}"
        segment: list[str] = []
        segments: list[list[str]] = []
        for token in _tokens(code):
            if token in SEPARATORS:
                segments.append(segment)
                segment = []
            else:
                segment.append(token)
        segments.append(segment)
        ran = False
        for tokens in segments:
            command = _command(tokens, where)
            if command:
                found.append(command)
                ran = True
        if not ran:
            other.append((where, code))
    return found, other


def _command(tokens: list[str], where: str) -> Command | None:
    for i, token in enumerate(tokens):
        is_script = SCRIPT.match(token)
        if not (is_script or token.endswith("relax-train")):
            continue
        # run, not only named: launched (`bash X`, `.venv/bin/python X`, `VAR=1 bash X`) or given arguments
        launched = all(t in LAUNCHERS or ENV_ASSIGNMENT.match(t) for t in tokens[:i]) and (i > 0 or len(tokens) > 1)
        args = tokens[i + 1:] if launched else []
        program = is_script.group(1) if is_script else "relax-train"
        if program == "relax-train":
            if not launched and not token.startswith(".venv/bin/"):
                return None  # the word in prose, not a command
            return Command(where, program, train_args=args)
        own, train = args, []
        for cut in ("--extra", "--"):
            if cut in own:
                j = own.index(cut)
                own, train = own[:j + (cut == "--extra")], own[j + 1:]
                break
        if program.endswith(".sh"):  # the repository's shell scripts hand their flags to relax-train
            own, train = [], own + train
        return Command(where, program, own, train, launched)
    return None


# --- a script's argparse, rebuilt from its source ---------------------------------------------------------------


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # raise instead of printing and exiting
        raise _Refused(message)


_TYPES = {"int": int, "float": float, "str": str}


@functools.lru_cache(maxsize=None)
def script_parser(path: Path) -> argparse.ArgumentParser | None:
    """The script's top-level options from its `add_argument` calls (None: it has none, it takes no flags)."""
    parser = _Parser(prog=path.name, add_help=True, allow_abbrev=False)
    calls = [node for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr == "add_argument"]
    if not calls:
        return None
    for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        if len(names) != len(call.args) or not names:
            continue
        kwargs = {}
        for kw in call.keywords:
            if kw.arg in (None, "help", "default", "metavar", "dest"):
                continue
            value = kw.value
            if kw.arg == "nargs" and isinstance(value, ast.Attribute) and value.attr == "REMAINDER":
                kwargs["nargs"] = argparse.REMAINDER
            elif kw.arg == "type":
                kwargs["type"] = _TYPES.get(value.id, str) if isinstance(value, ast.Name) else str
            else:
                try:
                    kwargs[kw.arg] = ast.literal_eval(value)
                except ValueError:
                    pass  # a computed setting (choices from a constant, ...): leave it out
        if "choices" in kwargs and "type" in kwargs:
            kwargs["choices"] = [kwargs["type"](c) for c in kwargs["choices"]]
        parser.add_argument(*names, **kwargs)
    return parser


@functools.lru_cache(maxsize=None)
def relax_train_options() -> frozenset[str]:
    from relax.config.parser import build_parser

    parser, _ = build_parser(use_megatron_parser=False)
    return frozenset(parser._option_string_actions)


def _flags(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if re.match(r"^--[a-z]", a)]


def command_problems(command: Command, root: Path = ROOT, train_options: frozenset[str] | None = None) -> list[str]:
    """What is wrong with one command: a missing script, arguments its parser refuses, unknown relax-train flags."""
    options = relax_train_options() if train_options is None else train_options
    problems = []
    if command.program != "relax-train":
        path = root / command.program
        if not path.is_file():
            return [f"{command.where}: {command.program} does not exist"]
        if path.suffix == ".py" and command.launched:
            parser = script_parser(path)
            if parser is None and command.args:
                problems.append(f"{command.where}: {command.program} takes no flags, given {command.args}")
            elif parser is not None:
                try:
                    parser.parse_args(command.args)
                except _Refused as e:
                    problems.append(f"{command.where}: {command.program} {' '.join(command.args)}: {e}")
    for flag in _flags(command.train_args):
        if flag not in options:
            problems.append(f"{command.where}: {flag} is not a relax-train flag (after {command.program})")
    return problems


def page_problems(text: str, name: str, root: Path = ROOT, train_options: frozenset[str] | None = None,
                  loose_flags: bool = False) -> list[str]:
    """Every command's problems; with loose_flags, also any flag named on its own that relax-train lacks."""
    options = relax_train_options() if train_options is None else train_options
    found, other = commands(text, name)
    problems = [p for c in found for p in command_problems(c, root, options)]
    if loose_flags:
        for where, code in other:
            for flag in _flags(_tokens(code)):
                if flag not in options and flag not in PLACEHOLDER_FLAGS:
                    problems.append(f"{where}: {flag} is not a relax-train flag")
    return problems


# --- links --------------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    out, in_fence = set(), False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence and (m := re.match(r"^#{1,6} (.+)$", line)):
            out.add(slug(m.group(1)))
    return out


def link_problems(text: str, page: Path) -> list[str]:
    problems = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            problems.append(f"{page.name}: link to {target}: {file} does not exist")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
            problems.append(f"{page.name}: link to {target}: no heading #{anchor} in {path.name}")
    return problems


# --- the tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAGES)
def test_every_command_exists_and_its_flags_parse(name):
    text = (ROOT / name).read_text()
    found, _ = commands(text, name)
    assert found, f"{name} names no command"
    problems = page_problems(text, name, loose_flags=name == "README.md")
    assert not problems, "\n".join(problems)


def test_the_benchmarks_page_names_the_benchmark_commands():
    found, _ = commands((ROOT / "docs/benchmarks.md").read_text(), "docs/benchmarks.md")
    programs = {c.program for c in found}
    for script in ("benchmarks/plain_loop_bench.py", "benchmarks/async_bench.py", "benchmarks/startup_bench.py",
                   "benchmarks/seed_sweep.py"):
        assert script in programs, f"docs/benchmarks.md runs no {script}"


@pytest.mark.parametrize("name", PAGES + ("docs/features.md",))
def test_links_resolve(name):
    page = ROOT / name
    problems = link_problems(page.read_text(), page)
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_and_keeps_the_ci_command():
    readme = (ROOT / "README.md").read_text()
    lines = readme.count("\n") + (not readme.endswith("\n"))
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"
    assert CI_COMMAND in readme, "README.md lost the test command that .ci/run runs"
    assert CI_COMMAND in (ROOT / ".ci" / "run").read_text()
    assert "docs/img/overview.png" in readme and "docs/benchmarks.md" in readme


def test_the_rebuilt_parser_matches_the_scripts_own():
    """The options rebuilt from a script's source are the ones its --help lists (seed_sweep imports nothing heavy)."""
    import subprocess
    import sys

    path = ROOT / "benchmarks" / "seed_sweep.py"
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60,
                           check=True).stdout
    listed = {flag for pair in re.findall(r"^  (-[\w-]+)(?: [A-Z_]+)?(?:, (--[\w-]+))?", shown, re.M)
              for flag in pair if flag}
    assert "--out" in listed and "--help" in listed
    assert set(script_parser(path)._option_string_actions) == listed


def test_the_check_catches_bad_commands():
    options = frozenset({"--num-rollout", "--output-dir", "--lr"})
    text = "\n".join([
        "Run `benchmarks/plain_loop_bench.py --steps 3` and `benchmarks/plain_loop_bench.py --stepz 3`.",
        "```bash",
        "bash scripts/setup.sh && .venv/bin/python benchmarks/no_such_bench.py --steps 2",
        ".venv/bin/python benchmarks/startup_bench.py --only gpu \\",
        "    --warm-runs two",
        ".venv/bin/python benchmarks/plain_loop_bench.py --steps 4 --extra --num-rollout 2 --lrr 1e-3",
        ".venv/bin/relax-train --output-dir runs/x --num-rolout 3",
        ".venv/bin/python benchmarks/seed_sweep.py --out runs/s -- --lr 1e-3 --seeed 1",
        "```",
        "Flags on their own: `--output-dir`, `--outptu-dir`.",
    ])
    problems = page_problems(text, "x.md", train_options=options, loose_flags=True)
    joined = "\n".join(problems)
    assert len(problems) == 7, joined
    assert "x.md:1: benchmarks/plain_loop_bench.py --stepz 3: unrecognized arguments: --stepz 3" in problems[0]
    assert "x.md:3: benchmarks/no_such_bench.py does not exist" in joined
    assert "x.md:4: benchmarks/startup_bench.py --only gpu --warm-runs two: argument --only: invalid choice" in joined
    assert "x.md:6: --lrr is not a relax-train flag" in joined
    assert "x.md:7: --num-rolout is not a relax-train flag" in joined
    assert "x.md:8: --seeed is not a relax-train flag" in joined
    assert "x.md:10: --outptu-dir is not a relax-train flag" in joined
    # and the good ones pass
    assert not page_problems("`benchmarks/plain_loop_bench.py --steps 3 --rounds 2`", "ok.md", train_options=options)


def test_the_link_check_catches_broken_links(tmp_path):
    page = tmp_path / "README.md"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Start-up\n\n```\n# not a heading\n```\n")
    page.write_text("[ok](docs/a.md#start-up) [gone](docs/b.md) [no anchor](docs/a.md#not-a-heading) "
                    "[web](https://example.com)\n")
    problems = link_problems(page.read_text(), page)
    assert len(problems) == 2, problems
    assert "docs/b.md does not exist" in problems[0] and "no heading #not-a-heading" in problems[1]
