"""The docs name only flags that exist, and say so when a flag they name is refused today.

Every `--flag` in docs/*.md must be an option of relax-train's parser (relax/config/parser.py), or one of the
few flags of other tools listed in FOREIGN (each with the tool it belongs to). docs/configuration.md is left out:
it is generated from the parser (tests/test_config_docs.py keeps it current).

In the hand-written guides (GUIDES), a relax-train flag whose feature is not built (outside
relax.config.support.IMPLEMENTED: a real run stops with `not supported yet: --flag`) may only be named in a
block (paragraph, list item or table row) that says it is refused, not supported yet, or being built; and such
a block names no flag that works. So a guide neither presents a refused flag as working nor keeps calling a
feature refused once it lands.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = {"configuration.md"}
GUIDES = {"quickstart.md", "architecture.md", "operations.md", "algorithms.md"}

# Flags of other programs that the docs show in their own commands. Each entry must still be used somewhere
# (test_foreign_flags_are_used), so the list cannot keep stale exceptions.
FOREIGN = {
    # ray start / ray job submit / ray job logs
    "--head": "ray start", "--port": "ray start", "--address": "ray start / ray job",
    "--num-gpus": "ray start", "--dashboard-host": "ray start",
    "--working-dir": "ray job submit", "--runtime-env-json": "ray job submit", "--submission-id": "ray job submit",
    "--follow": "ray job logs",
    # benchmarks/estimator_table.py
    "--steps": "benchmarks/estimator_table.py", "--estimators": "benchmarks/estimator_table.py",
    # the benchmark and example scripts docs/benchmarks.md runs (tests/test_readme_commands.py parses each
    # command with its script's own options)
    "--rounds": "benchmarks/plain_loop_bench.py, startup_bench.py, async_bench.py, trainer_threads_bench.py",
    "--against": "benchmarks/startup_bench.py", "--beside-engine": "benchmarks/trainer_threads_bench.py",
    "--extra": "benchmarks/plain_loop_bench.py, async_bench.py",
    "--chunks": "benchmarks/async_bench.py", "--skip-loop": "benchmarks/async_bench.py",
    "--model": "benchmarks/async_bench.py, examples/genrm/measure_judge.py",
    "--data": "benchmarks/async_bench.py", "--warm-runs": "benchmarks/startup_bench.py",
    "--only": "benchmarks/startup_bench.py", "--cpu": "benchmarks/startup_bench.py",
    "--keep": "benchmarks/startup_bench.py", "--out": "benchmarks/seed_sweep.py",
    "--prompts": "examples/genrm/measure_judge.py", "--n": "examples/genrm/measure_judge.py",
    "--models": "benchmarks/lora_bench.py, weight_sync_bench.py",
    "--repeats": "benchmarks/lora_bench.py, weight_sync_bench.py",
    "--paths": "benchmarks/weight_sync_bench.py",
    "--seeds": "benchmarks/seed_sweep.py", "--parallel": "benchmarks/seed_sweep.py",
    "--judge-len": "examples/genrm/measure_judge.py", "--template": "examples/genrm/measure_judge.py",
    "--parser": "examples/genrm/measure_judge.py",
    "--train": "benchmarks/grpo_replica.py", "--train-head": "benchmarks/grpo_replica.py",
    "--train-norms": "benchmarks/grpo_replica.py", "--head-cap": "benchmarks/grpo_replica.py",
    # pip
    "--no-deps": "pip install",
    # relax-status (relax/entrypoints/status.py)
    "--watch": "relax-status", "--last": "relax-status", "--json": "relax-status",
    # SGLang's own server command (python -m sglang.launch_server), see docs/sglang-cpu.md
    "--device": "sglang.launch_server", "--dtype": "sglang.launch_server",
    "--max-total-tokens": "sglang.launch_server",
    # its LoRA options, which Relax sets for adapter-only sync (docs/lora.md, relax.roles.engine.lora_server_args)
    "--enable-lora": "sglang.launch_server", "--max-lora-rank": "sglang.launch_server",
    "--max-loras-per-batch": "sglang.launch_server",
    # the placeholder in Relax's refusal message `not supported yet: --flag`
    "--flag": "placeholder",
}

FLAG = re.compile(r"(?<![\w/-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
REFUSED_WORDS = ("not supported yet", "refused", "being built")


def _parser_options() -> dict[str, str]:
    """option string -> dest, for every flag of relax-train (the built-in Megatron mirror, as in the docs)."""
    from relax.config.parser import build_parser

    parser, _ = build_parser(use_megatron_parser=False, use_sglang_parser=False)
    return {opt: action.dest for opt, action in parser._option_string_actions.items()}


def _blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each paragraph, list item and table row."""
    blocks: list[tuple[int, list[str]]] = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        starts_item = bool(re.match(r"([-*]|\d+\.|\|) ", stripped)) or stripped.startswith("|")
        if not stripped or stripped.startswith("```"):
            blocks.append((number + 1, []))
            continue
        if starts_item or not blocks:
            blocks.append((number, [line]))
        else:
            blocks[-1][1].append(line)
    return [(n, "\n".join(lines)) for n, lines in blocks if lines]


def flag_problems(name: str, text: str, options: dict[str, str], implemented: frozenset[str],
                  guide: bool) -> list[str]:
    from relax.config.support import is_sglang_server_flag

    problems = []
    for line_no, block in _blocks(text):
        says_refused = any(word in block.lower() for word in REFUSED_WORDS)
        for match in FLAG.finditer(block):
            flag = "--" + match.group(1)
            where = f"{name}:{line_no + block[:match.start()].count(chr(10))}"
            if flag in FOREIGN:
                continue
            dest = options.get(flag)
            if dest is None:
                problems.append(f"{where}: {flag} is not a relax-train flag (nor listed in FOREIGN)")
                continue
            refused = dest != "help" and dest not in implemented and not is_sglang_server_flag(dest)
            if guide and refused and not says_refused:
                problems.append(f"{where}: {flag} is refused today (not supported yet) but the text does not say so")
            if guide and says_refused and not refused and dest != "help":
                problems.append(f"{where}: {flag} works now, but the text around it says refused / not supported yet "
                                "/ being built (update the guide, or name working flags in a block of their own)")
    return problems


@pytest.fixture(scope="module")
def options():
    return _parser_options()


@pytest.fixture(scope="module")
def implemented():
    from relax.config.support import IMPLEMENTED

    return IMPLEMENTED


def _docs() -> list[Path]:
    return sorted(p for p in DOCS.glob("*.md") if p.name not in GENERATED)


def test_the_guides_exist():
    assert GUIDES <= {p.name for p in _docs()}


@pytest.mark.parametrize("doc", _docs(), ids=lambda p: p.name)
def test_every_flag_in_the_docs_exists(doc, options, implemented):
    problems = flag_problems(doc.name, doc.read_text(), options, implemented, guide=doc.name in GUIDES)
    assert not problems, "\n".join(problems)


def test_foreign_flags_are_used():
    text = "\n".join(p.read_text() for p in _docs())
    used = {"--" + m for m in FLAG.findall(text)}
    assert not set(FOREIGN) - used, f"FOREIGN lists flags no doc uses: {sorted(set(FOREIGN) - used)}"


def test_the_check_catches_wrong_flags_and_wrong_support_claims(options, implemented):
    refused = next(opt for opt, dest in options.items()
                   if opt.startswith("--") and dest not in implemented and dest == "train_memory_margin_bytes")
    text = f"Run with `--num-rollout 3`.\n\nAlso `--num-rolout 3`.\n\nUse `{refused}` for speed.\n\n" \
           f"- `{refused}` is being built.\n- `--num-rollout` is not supported yet.\n"
    problems = flag_problems("x.md", text, options, implemented, guide=True)
    assert len(problems) == 3, problems
    assert "x.md:3: --num-rolout is not a relax-train flag" in problems[0]
    assert f"x.md:5: {refused} is refused" in problems[1]
    assert "x.md:8: --num-rollout works now" in problems[2]
