"""SGLang server and router flags: `--sglang-<name>` (dest `sglang_<name>`).

With SGLang importable, every `ServerArgs` flag is offered, typed by SGLang itself, except the ones
Relax sets per engine (model path, tensor-parallel size, host, port, ...). Without SGLang (CPU
machines), a built-in table types the common flags; any other `--sglang-*` flag is kept as given and
checked against `ServerArgs` when a real SGLang engine launches.

Router flags come from the installed sglang-router's `RouterArgs` (`--router-X` becomes
`--sglang-router-X`), plus `--sglang-router-ip` / `--sglang-router-port` to attach to a router
that is already running.
"""

from __future__ import annotations

import argparse
from typing import Any

from relax.config.megatron_table import str2bool
from relax.config.facts import driver_has_gpu

PREFIX = "--sglang-"
ROUTER_PREFIX = "--sglang-router-"

# ServerArgs fields Relax decides per engine; the flag that controls each instead.
OWNED_BY_RELAX = {
    "model_path": "--hf-checkpoint",
    "tokenizer_path": "--hf-checkpoint",
    "tp_size": "--rollout-num-gpus-per-engine",
    "host": "(chosen per engine by Relax)",
    "port": "(chosen per engine by Relax)",
    "nnodes": "(derived from --rollout-num-gpus-per-engine and --num-gpus-per-node)",
    "node_rank": "(derived per engine by Relax)",
    "dist_init_addr": "(chosen per engine by Relax)",
    "base_gpu_id": "(derived from the placement group)",
    "nccl_port": "(chosen per engine by Relax)",
}

# Types of common ServerArgs fields, used when SGLang is not importable.
BUILTIN_TYPES: dict[str, Any] = {
    "mem_fraction_static": float,
    "context_length": int,
    "max_running_requests": int,
    "max_total_tokens": int,
    "max_prefill_tokens": int,
    "chunked_prefill_size": int,
    "dtype": str,
    "kv_cache_dtype": str,
    "quantization": str,
    "attention_backend": str,
    "sampling_backend": str,
    "schedule_policy": str,
    "random_seed": int,
    "log_level": str,
    "dp_size": int,
    "ep_size": int,
    "pp_size": int,
    "cuda_graph_max_bs": int,
    "cuda_graph_bs": "int_list",
    "speculative_algorithm": str,
    "speculative_num_steps": int,
    "speculative_eagle_topk": int,
    "speculative_num_draft_tokens": int,
    "device": str,
    "load_format": str,
    "trust_remote_code": bool,
    "skip_tokenizer_init": bool,
    "disable_radix_cache": bool,
    "disable_cuda_graph": bool,
    "enable_memory_saver": bool,
    "enable_dp_attention": bool,
    "enable_metrics": bool,
    "enable_deterministic_inference": bool,
    "enable_torch_compile": bool,
    "disable_custom_all_reduce": bool,
    "enable_ep_moe": bool,
    "enable_weights_cpu_backup": bool,
    "watchdog_timeout": float,
    "moe_a2a_backend": str,
    "moe_runner_backend": str,
    "chat_template": str,
    "reasoning_parser": str,
    "tool_call_parser": str,
}


def sglang_available() -> bool:
    try:  # an optional dependency (the separate SGLang environment)
        from sglang.srt.server_args import ServerArgs  # noqa: F401
    except Exception:
        return False
    return True


def resolve_backend(requested: str) -> str:
    """`auto` picks real SGLang when a GPU and SGLang are present, else the embedded engine. Called once, by
    config validation on the driver: an actor without a GPU of its own would always see none."""
    if requested != "auto":
        return requested
    if not sglang_available():
        return "embedded"
    return "sglang" if driver_has_gpu() else "embedded"


def add_sglang_flags(parser: argparse.ArgumentParser, use_sglang_parser: bool | None = None) -> str:
    """Add `--sglang-*` flags; returns "sglang" or "builtin" (which source typed them)."""
    group = parser.add_argument_group("SGLang engine (--sglang-<ServerArgs flag>)")
    if use_sglang_parser is None:
        use_sglang_parser = sglang_available()
    if use_sglang_parser:
        from sglang.srt.server_args import ServerArgs

        source = argparse.ArgumentParser(add_help=False)
        ServerArgs.add_cli_args(source)
        for action in source._actions:
            if not action.option_strings or action.dest in OWNED_BY_RELAX:
                continue
            _copy_action(group, action)
        return "sglang"
    for name, typ in BUILTIN_TYPES.items():
        flag = PREFIX + name.replace("_", "-")
        if typ is bool:
            group.add_argument(flag, dest="sglang_" + name, type=str2bool, nargs="?", const=True,
                               default=None, help="SGLang server flag (boolean)." + EMBEDDED_NOTE.get(name, ""))
        else:
            many = typ == "int_list"
            group.add_argument(flag, dest="sglang_" + name, type=int if many else typ, nargs="+" if many else None,
                               default=None, help=f"SGLang server flag ({'int list' if many else typ.__name__}).")
    return "builtin"


# What the SGLang server flags the embedded engine honours (relax.config.support.EMBEDDED_SGLANG_FLAGS) do there.
EMBEDDED_NOTE: dict[str, str] = {
    "disable_radix_cache": " With the embedded engine too: every copy of a prompt (the n samples of a group) is "
                           "then prefilled on its own instead of once per prompt.",
}


def _copy_action(group, action: argparse.Action) -> None:
    opts = [PREFIX + o[2:] for o in action.option_strings if o.startswith("--")]
    kwargs: dict[str, Any] = {"dest": "sglang_" + action.dest, "default": action.default,
                              "help": "SGLang server flag." + EMBEDDED_NOTE.get(action.dest, "")}
    if isinstance(action, argparse.BooleanOptionalAction):
        kwargs["action"] = argparse.BooleanOptionalAction
        opts = [o for o in opts if not o.startswith(PREFIX + "no-")]
    elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        kwargs["action"] = "store_true" if isinstance(action, argparse._StoreTrueAction) else "store_false"
    else:
        kwargs.update(type=action.type, nargs=action.nargs, choices=_stable(action.choices))
    group.add_argument(*opts, **kwargs)


def _stable(choices):
    """Some upstream choice lists are built from sets (order changes per process): sort them."""
    if choices is not None and all(isinstance(c, str) for c in choices):
        return sorted(choices)
    return choices


def add_router_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sglang-router (--sglang-router-<RouterArgs flag>)")
    group.add_argument("--sglang-router-ip", type=str, default=None,
                       help="Address of an already running router to use (default: Relax launches one).")
    group.add_argument("--sglang-router-port", type=int, default=None, help="Port of the router.")
    try:
        from sglang_router.router_args import RouterArgs
    except Exception:
        group.add_argument("--sglang-router-policy", type=str, default="round_robin", help="Routing policy.")
        return
    source = argparse.ArgumentParser(add_help=False)
    RouterArgs.add_cli_args(source, use_router_prefix=True, exclude_host_port=True)
    for action in source._actions:
        opts = [o for o in action.option_strings if o.startswith("--router-")]
        if not opts:
            continue
        kwargs: dict[str, Any] = {"dest": "sglang_" + action.dest, "default": action.default,
                                  "help": "sglang-router flag."}
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            kwargs["action"] = "store_true" if isinstance(action, argparse._StoreTrueAction) else "store_false"
        else:
            kwargs.update(type=action.type, nargs=action.nargs, choices=_stable(action.choices))
        group.add_argument(*["--sglang-" + o[2:] for o in opts], **kwargs)


def take_passthrough(unknown: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Split leftover argv into untyped `--sglang-*` values and truly unknown arguments.

    `--sglang-foo-bar 3` → {"sglang_foo_bar": "3"}; `--sglang-flag` alone → True; several values → a list;
    `--sglang-x=v` → "v". Flags Relax owns are rejected by the validator, not kept here.
    """
    values: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(unknown):
        token = unknown[i]
        if token.startswith(PREFIX) and len(token) > len(PREFIX):
            name, eq, inline = token[2:].partition("=")
            dest = name.replace("-", "_")
            if eq:
                values[dest] = inline
            else:
                given = []
                while i + 1 < len(unknown) and not unknown[i + 1].startswith("--"):
                    given.append(unknown[i + 1])
                    i += 1
                values[dest] = True if not given else given[0] if len(given) == 1 else given
        else:
            rest.append(token)
        i += 1
    return values, rest


def owned_flag_error(dest: str) -> str | None:
    """Message when a `--sglang-*` flag names a field Relax sets itself."""
    field = dest[len("sglang_"):]
    if field in OWNED_BY_RELAX:
        return (f"--sglang-{field.replace('_', '-')} is set by Relax per engine; "
                f"use {OWNED_BY_RELAX[field]} instead")
    return None
