"""`relax-train --help` tells the truth (issue 17, item 5).

The default each flag's help states is compared with the value a run really gets when the flag is
not given, taken from `parse_config` itself: once for a run with a model and prompts, once for the
embedded default (no model, no data). So the help cannot drift from the overrides, presets and
derivation rules, wherever they live.
"""

import argparse
import subprocess
import sys

import pytest

from conftest import ROOT

from relax.config import parse_config
from relax.config.help_text import MEGATRON_HELP, RelaxHelpFormatter, format_value
from relax.config.parser import actions_by_dest, build_parser
from relax.config.support import IMPLEMENTED, is_sglang_server_flag, same_value
from relax.config.support_megatron import NO_EFFECT_REASONS
from relax.config.validate import DERIVED_FROM


def _help_texts() -> dict[str, str]:
    """dest -> the help line `relax-train --help` prints for it (before line wrapping)."""
    parser, _ = build_parser()
    formatter = RelaxHelpFormatter(prog="relax-train")
    return {dest: " ".join(formatter._expand_help(a).split()) for dest, a in actions_by_dest(parser).items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("help")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text('{"input": "1+1=", "label": "2"}\n')
    model = ["--hf-checkpoint", str(tmp / "model"), "--prompt-data", str(prompts), "--rollout-batch-size", "1",
             "--num-rollout", "1", "--output-dir", str(tmp / "a")]
    return {"model": parse_config(model), "embedded": parse_config(["--output-dir", str(tmp / "b")])}


def test_help_runs_and_never_says_none():
    proc = subprocess.run([sys.executable, "-m", "relax.entrypoints.train", "--help"], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
    assert "default: None" not in " ".join(proc.stdout.split()) and "(mirrored)" not in proc.stdout
    entries = _entries(proc.stdout)
    assert entries["--lr"].endswith("(default: 1e-06; the embedded default run uses 0.002)")
    from relax.config.presets import EMBEDDED_PRESET

    preset_mbs = EMBEDDED_PRESET["micro_batch_size"]
    assert entries["--micro-batch-size"].split("(default: ")[1].startswith(f"1; the embedded default run uses {preset_mbs}")
    assert entries["--expert-tensor-parallel-size"].endswith("(default: 1)")
    assert entries["--no-save-optim"].endswith("(default: off)")
    assert entries["--tp-comm-overlap"].endswith("Not supported yet. (default: off)")


def _entries(help_output: str) -> dict[str, str]:
    """First option string -> its help text, from argparse's two-column layout."""
    entries, current = {}, None
    for line in help_output.splitlines():
        if line.startswith("  -") and not line.startswith("   "):
            head, _, rest = line.strip().partition("  ")
            current = head.split()[0].rstrip(",")
            entries[current] = rest.strip()
        elif current and line.startswith(" " * 24):
            entries[current] = (entries[current] + " " + line.strip()).strip()
        else:
            current = None
    return entries


def test_stated_default_is_the_effective_default(runs):
    """Every flag a run leaves at an effective value shows that value, its derivation or its preset."""
    parser, _ = build_parser()
    actions = actions_by_dest(parser)
    helps = _help_texts()
    problems = []
    for name, cfg in runs.items():
        for dest, action in actions.items():
            if dest in cfg.explicit or dest not in cfg or action.default is argparse.SUPPRESS:
                continue
            text, value = helps[dest], cfg[dest]
            if "default: None" in text:
                problems.append(f"{name}: {action.option_strings[0]} is {value!r} but help says {text!r}")
                continue
            if same_value(value, parser.get_default(dest)):
                shown = f"default: {format_value(value, action)}"
                if dest in DERIVED_FROM and value is None:
                    continue  # shows the derivation, which left it unset in this run
                if shown not in text:
                    problems.append(f"{name}: {action.option_strings[0]} help lacks {shown!r}: {text!r}")
            elif dest in DERIVED_FROM:
                if DERIVED_FROM[dest] not in text:
                    problems.append(f"{name}: {action.option_strings[0]} is derived; help lacks how: {text!r}")
            elif name == "embedded":
                if "the embedded default run uses" not in text:
                    problems.append(f"{name}: {action.option_strings[0]} is {value!r} (preset); help: {text!r}")
            else:
                problems.append(f"{name}: {action.option_strings[0]} is {value!r}, not its default "
                                f"{parser.get_default(dest)!r}, and help does not say why: {text!r}")
    assert not problems, "\n".join(problems[:30])


def test_megatron_flags_say_what_they_do_or_that_they_are_not_built():
    parser, _ = build_parser()
    helps = _help_texts()
    megatron = parser._megatron_dests
    honoured = {d for d in megatron if d in IMPLEMENTED}
    assert {"lr", "micro_batch_size", "tensor_model_parallel_size", "no_save_optim"} <= honoured
    assert set(MEGATRON_HELP) == honoured  # a newly honoured Megatron flag needs its description
    for dest in megatron:
        text = helps[dest]
        if dest in honoured:
            assert "Not supported yet" not in text and not text.startswith("Megatron-LM flag"), dest
            assert text.startswith(MEGATRON_HELP[dest]), dest
        elif dest in NO_EFFECT_REASONS:  # accepted with a warning (relax.config.support_megatron)
            assert "no effect in Relax: " + NO_EFFECT_REASONS[dest] in text, dest
        else:
            assert "Not supported yet" in text, dest
    for dest in parser._relax_dests:
        if dest in NO_EFFECT_REASONS:
            assert "no effect in Relax: " + NO_EFFECT_REASONS[dest] in helps[dest], dest
        elif dest not in IMPLEMENTED and not is_sglang_server_flag(dest):
            assert "Not supported yet" in helps[dest], dest
        elif dest in IMPLEMENTED:
            assert "Not supported yet" not in helps[dest], dest


def test_every_derivation_is_described():
    parser, _ = build_parser()
    assert set(DERIVED_FROM) <= set(actions_by_dest(parser))
