"""Every flag of the configuration reference is accepted with the reference's name and default."""

import argparse
import os
import re

import pytest

from conftest import SHARED
from relax.config.parser import actions_by_dest, build_parser

REFERENCE = SHARED / "reference" / "relax-configuration.md"
ROW = re.compile(r"^(--[\w-]+)\s+(json|flag|bool|int|float|str)(?:\s+\(list\))?\s+(\S+)", re.M)


def reference_rows():
    if not REFERENCE.is_file():
        if os.environ.get("CI"):
            raise AssertionError(f"the configuration reference is missing: {REFERENCE}")
        pytest.skip("shared/reference not present")
    return ROW.findall(REFERENCE.read_text())


def expected_default(kind: str, token: str):
    special = {"None": None, "False": False, "True": True, '""': "", "{}": {}, "Required": None,
               "512MB": 512 * 1024**2, "1GB": 1024**3}
    if token in special:
        return special[token]
    if token == "-":
        return False if kind == "flag" else "<megatron>"
    if kind == "int":
        return int(token)
    if kind == "float":
        return float(token)
    if kind == "str" and token.startswith("("):
        return "<skip>"
    return token


def test_reference_has_many_flags():
    assert len(reference_rows()) > 200


@pytest.mark.parametrize("use_megatron_parser", [False])
def test_every_reference_flag_with_its_default(use_megatron_parser):
    parser, _ = build_parser(use_megatron_parser)
    options = parser._option_string_actions
    problems = []
    for name, kind, token in reference_rows():
        action = options.get(name)
        if action is None:
            problems.append(f"{name}: missing")
            continue
        want = expected_default(kind, token)
        got = parser.get_default(action.dest)
        if name == "--profile-target":
            want = ["train_overall"]
        if want in ("<megatron>", "<skip>"):
            continue
        if got != want or type(got) is not type(want) and want is not None and not isinstance(want, float):
            problems.append(f"{name}: default {got!r}, reference says {token}")
        if kind == "flag" and not isinstance(action, argparse._StoreTrueAction):
            problems.append(f"{name}: should be a switch")
        if kind in ("int", "float") and action.type not in (int, float) and getattr(action.type, "__name__", "") != "byte_size":
            problems.append(f"{name}: type {action.type}")
    assert not problems, "\n".join(problems)


def test_help_lists_every_reference_flag(capsys):
    parser, _ = build_parser(False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    text = capsys.readouterr().out
    missing = [name for name, _, _ in reference_rows() if name not in text]
    assert not missing


def test_choices_from_reference():
    parser, _ = build_parser(False)
    acts = actions_by_dest(parser)
    assert set(acts["advantage_estimator"].choices) >= {"grpo", "gspo", "on_policy_distillation", "sapo"}
    assert set(acts["kl_loss_type"].choices) == {"k1", "k2", "k3", "low_var_kl"}
    assert set(acts["opd_type"].choices) == {"sglang", "megatron"}
    assert set(acts["scale_out_partial_success_policy"].choices) == {"rollback_all", "keep_partial"}
    assert acts["polling_mode"].default is True
