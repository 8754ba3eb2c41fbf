"""A flag set to its own default is never refused as "not supported yet" (issue 17, item 6).

Launch scripts copied from Megatron or SGLang recipes spell out defaults (`--moe-aux-loss-coeff 0`,
`--attention-backend auto`, `--cp-comm-type p2p`). Such a value is what Relax already runs with, so
validation must accept it, whatever the flag's type: a list holding one scalar, an enum, a float
written as an int.
"""

import argparse
import enum
import json

from conftest import relax_cli

from relax.config import parse_config
from relax.config.parser import actions_by_dest, build_parser
from relax.config.support import IMPLEMENTED, same_value, unsupported_flags


def _spell(value, action):
    """Command-line tokens that parse back to `value`, or None when the command line cannot say it."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, enum.Enum):
        value = value.name
    if isinstance(value, dict):  # only a JSON-typed flag takes a dict on the command line
        return [json.dumps(value)] if getattr(action.type, "__name__", "") == "json_object" else None
    if isinstance(value, (list, tuple)):
        if not value:
            return None
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            return [_token(v) for v in value]
        return ["(" + ",".join(_token(v) for v in value) + ")"]  # int-tuple / layer-pattern syntax
    return [_token(value)]


def _token(value):
    if isinstance(value, enum.Enum):
        return value.name
    return repr(value) if isinstance(value, float) else str(value)


def _unbuilt_flags_at_default():
    parser, _ = build_parser()
    argv, skipped = [], []
    for dest, action in sorted(actions_by_dest(parser).items()):
        if dest in IMPLEMENTED or action.default is argparse.SUPPRESS:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._AppendAction,
                               argparse._StoreConstAction)):
            skipped.append(dest)  # a switch at its default is spelt by leaving it out
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            if isinstance(action.default, bool):
                argv.append(action.option_strings[0] if action.default else "--no-" + action.option_strings[0][2:])
            continue
        tokens = _spell(parser.get_default(dest), action)
        if tokens is None:
            skipped.append(dest)
            continue
        argv += [action.option_strings[0], *tokens]
    return argv, skipped


def test_every_unbuilt_flag_at_its_default_is_accepted(tmp_path):
    argv, _ = _unbuilt_flags_at_default()
    assert "--rotary-scaling-factor" in argv and len(argv) > 200
    cfg = parse_config(argv + ["--output-dir", str(tmp_path), "--dry-run"])
    parser, _ = build_parser()
    given = {a.dest for a in actions_by_dest(parser).values() if a.option_strings[0] in argv}
    assert given <= cfg.explicit  # the user really set them
    assert unsupported_flags(cfg) == []


def test_moe_aux_loss_coeff_zero_is_supported(tmp_path):
    proc = relax_cli("--dry-run", "--moe-aux-loss-coeff", "0", "--output-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "every flag you set is supported" in proc.stdout


def test_non_default_values_are_still_refused(tmp_path):
    cfg = parse_config(["--muon-momentum", "0.8", "--output-dir", str(tmp_path)])
    assert unsupported_flags(cfg) == ["--muon-momentum"]
    cfg = parse_config(["--rampup-batch-size", "2", "2", "100", "--output-dir", str(tmp_path)])  # a list value
    assert unsupported_flags(cfg) == ["--rampup-batch-size"]


def test_same_value_compares_by_value():
    class Backend(enum.Enum):
        auto = 5

    assert same_value([0.0], 0.0) and same_value([0], 0.0) and same_value(0.1, [0.1])
    assert same_value(Backend.auto, "auto") and same_value(["aux_loss"], "aux_loss")
    assert same_value((1, 2), [1, 2]) and same_value(float("nan"), float("nan"))
    assert not same_value(None, 0) and not same_value(0.1, 0.10000001) and not same_value([0, 0], 0)
