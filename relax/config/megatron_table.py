"""How Megatron flags are described, mirrored and re-created in Relax's parser.

Megatron-LM's parser is used directly when `megatron.training.arguments` is importable. When it is
not (megatron-core 0.16 wheels on Python 3.11 ship only `megatron.core`), Relax re-creates the
mirrored groups from the generated table in `megatron_mirror.py`. Both paths produce the same
flag names, dests, defaults and value types; a test compares them.

One Megatron version. setup.py pins megatron-core to INSTALLED_MEGATRON_CORE: the newest release that
installs on Python 3.10/3.11 (0.17 and later require Python >= 3.12). That release ships no argument
parser (its wheel and sdist hold `megatron.core` only), so the table is generated from the nearest
parser PyPI offers, Megatron-LM 0.17.0's (`megatron_mirror.MEGATRON_VERSION`), and the flags whose
setting the installed megatron-core lacks are left out (ABSENT_FROM_INSTALLED): a flag is accepted
exactly when the installed Megatron has the setting behind it. tests/test_config_megatron_mirror.py
recomputes that list from the two packages' config dataclasses.
"""

from __future__ import annotations

import argparse
import ast
import enum
from pathlib import Path
from typing import Any

# Megatron parser groups that Relax mirrors whole: the model architecture, parallelism,
# optimization, precision, checkpointing and MoE flags that Megatron-based RL launch scripts use.
MIRRORED_GROUPS = frozenset(
    {
        "network size",
        "transformer configuration",
        "regularization",
        "training",
        "learning rate and weight decay",
        "checkpointing",
        "mixed precision",
        "distributed init",
        "moe",
        "mla",
        "RNG and initialization",
        "Transformer-Engine",
        "experimental",
    }
)
# Single flags from other groups that launch scripts commonly pass.
MIRRORED_EXTRA_FLAGS = frozenset(
    {
        "--seq-length",
        "--vocab-size",
        "--padded-vocab-size",
        "--tokenizer-type",
        "--tokenizer-model",
        "--trust-remote-code",
        "--spec",
        "--enable-experimental",
        "--log-interval",
        "--tensorboard-dir",
        "--log-throughput",
        "--no-create-attention-mask-in-dataloader",
    }
)

INSTALLED_MEGATRON_CORE = "0.16.1"

# Flags of the 0.17.0 parser whose megatron-core setting (a config dataclass field in 0.17.0) megatron-core
# 0.16.1 does not have. Not mirrored: the installed Megatron cannot do what they ask.
ABSENT_FROM_INSTALLED = frozenset({
    "--cpu-offloading-retain-pinned-cpu-buffers", "--mtp-use-repeated-layer", "--mtp-hybrid-override-pattern",
    "--use-mup", "--mup-width-mult", "--mup-base-hidden-size", "--mup-embedding-mult", "--mup-output-mult",
    "--mup-base-head-dim", "--mup-attn-scale-power", "--fused-residual-rmsnorm", "--moe-router-force-biased",
    "--inference-disable-triton-nvls-kernels", "--inference-grouped-gemm-backend",
    "--inference-moe-disable-fused-quant-kernels", "--muon-coefficient-type", "--muon-scalar-optimizer",
    "--lion-beta1", "--lion-beta2", "--optimizer-cuda-graph", "--mla-down-proj-fusion",
    "--megatron-fsdp-main-params-dtype", "--megatron-fsdp-main-grads-dtype", "--megatron-fsdp-grad-comm-dtype",
})

# Flags whose form changed between the two versions: the mirror accepts both. Megatron-LM 0.16 took
# `--lazy-mpu-init True` (type=bool); 0.17 has a plain switch.
BOTH_FORMS = frozenset({"--lazy-mpu-init"})


def dataclass_fields(package_dir) -> set[str]:
    """Names of every dataclass field under `package_dir` (read from source; nothing is imported)."""
    names: set[str] = set()
    for path in Path(package_dir).rglob("*.py"):
        try:
            tree = ast.parse(path.read_text(errors="ignore"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                names |= {s.target.id for s in node.body
                          if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return names


# Type names used in the table for Megatron's special argument types.
_PATTERN_TYPES = {"moe_freq_type", "no_rope_freq_type", "la_freq_type"}


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, tuple):
        return list(value)
    return value


def describe_action(action: argparse.Action) -> tuple:
    """Normalise an argparse action into a comparable, printable row."""
    if isinstance(action, argparse.BooleanOptionalAction):
        kind = "bool_optional"
    elif isinstance(action, argparse._StoreTrueAction):
        kind = "store_true"
    elif isinstance(action, argparse._StoreFalseAction):
        kind = "store_false"
    elif isinstance(action, argparse._StoreConstAction):
        kind = "store_const"
    elif isinstance(action, argparse._AppendAction):
        kind = "append"
    else:
        kind = "store"
    type_name = None
    if action.type is not None:
        type_name = getattr(action.type, "__name__", "callable")
        if type_name == "enum_type_handler":
            type_name = "enum"
        elif type_name == "<lambda>":
            type_name = "str_list"
        elif type_name in _PATTERN_TYPES:
            type_name = "layer_pattern"
        elif type_name == "tuple_type":
            type_name = "int_tuple"
    choices = [_plain(c) for c in action.choices] if action.choices is not None else None
    const = _plain(action.const) if kind == "store_const" else None
    return (
        tuple(action.option_strings),
        action.dest,
        kind,
        type_name,
        _plain(action.default),
        action.nargs,
        const,
        choices,
    )


def layer_pattern(value: Any) -> int | list[int]:
    """An int N, or a list expression such as "([1]*3+[0])*2" (evaluated without eval)."""
    if isinstance(value, (int, list)):
        return value
    text = str(value).strip()
    if "[" not in text:
        return int(text)
    allowed = set("0123456789[]()+*, ")
    if not set(text) <= allowed:
        raise argparse.ArgumentTypeError(f"invalid layer pattern {value!r}")
    try:
        result = _eval_list_expr(ast.parse(text, mode="eval").body)
    except (ValueError, SyntaxError) as exc:
        raise argparse.ArgumentTypeError(f"invalid layer pattern {value!r}: {exc}") from None
    if not isinstance(result, list):
        raise argparse.ArgumentTypeError(f"layer pattern {value!r} is not a list")
    return result


def _eval_list_expr(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval_list_expr(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _eval_list_expr(node.left), _eval_list_expr(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("only integers, lists, + and * are allowed")


def int_tuple(value: Any) -> tuple[int, ...]:
    if isinstance(value, tuple):
        return value
    text = str(value).strip().strip("()[]")
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like (a, b), got {value!r}") from None


def str_list(value: str) -> list[str]:
    return [v for v in str(value).replace(",", " ").split() if v]


def str2bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "y", "on"}:
        return True
    if text in {"0", "false", "no", "n", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


_TYPES = {
    None: None,
    "int": int,
    "float": float,
    "str": str,
    "bool": str2bool,
    "enum": str,
    "layer_pattern": layer_pattern,
    "int_tuple": int_tuple,
    "str_list": str_list,
}


def add_rows(parser: argparse.ArgumentParser, rows, skip_options: set[str]) -> list[str]:
    """Re-create mirrored Megatron flags in `parser`; returns the dests added.

    Flags whose option strings Relax already defines are skipped (Relax owns them).
    """
    groups: dict[str, argparse._ArgumentGroup] = {}
    added = []
    for group_title, opts, dest, kind, type_name, default, nargs, const, choices in rows:
        if any(o in skip_options or o in ABSENT_FROM_INSTALLED for o in opts):
            continue
        if opts[0] in BOTH_FORMS and kind == "store_true":  # `--flag` or `--flag true/false`
            kind, type_name, nargs, const = "store", "bool", "?", True
        group = groups.get(group_title)
        if group is None:
            group = groups[group_title] = parser.add_argument_group(f"Megatron: {group_title}")
        # The help is written by relax.config.help_text once the parser is complete: what the flag does
        # (or that it is not built yet) and its effective default, which Relax may override.
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": None}
        if kind == "store_true":
            kwargs["action"] = "store_true"
        elif kind == "store_false":
            kwargs["action"] = "store_false"
        elif kind == "store_const":
            kwargs["action"] = "store_const"
            kwargs["const"] = const
        elif kind == "bool_optional":
            kwargs["action"] = argparse.BooleanOptionalAction
            opts = tuple(o for o in opts if not o.startswith("--no-")) or opts
        else:
            kwargs["type"] = _TYPES.get(type_name, str)
            if nargs is not None:
                kwargs["nargs"] = nargs
            if nargs == "?":
                kwargs["const"] = const
            if choices is not None:
                kwargs["choices"] = choices
        group.add_argument(*opts, **kwargs)
        added.append(dest)
    return added
