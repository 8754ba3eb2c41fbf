"""GenRM settings checked before Ray (relax.config.rules_rollout.check_genrm) and read again at run time.

--genrm-sampling-config: a JSON object with `temperature` (default 0.1), `top_p` (1.0), `top_k` (-1: all) and
`max_response_len` (4096, the judge's new tokens); other keys are refused, naming the flag.

--genrm-engine-config: a JSON object of engine server options. The GenRM engines use the run's rollout backend:
with SGLang every key is an SGLang server option (`ServerArgs` field) passed to each GenRM server; with the
embedded engine (CPU) the keys it has (`EMBEDDED_KEYS`) apply and SGLang's sizing options (`SGLANG_SIZING_KEYS`,
e.g. dp_size, pp_size, max_total_tokens) are accepted with no effect. Options Relax sets per engine (model path,
tensor parallel size, host, port) are refused with the flag to use instead.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from relax.config.errors import ConfigError
from relax.config.sglang import BUILTIN_TYPES, OWNED_BY_RELAX, sglang_available

SAMPLING_FLAG = "--genrm-sampling-config"
ENGINE_FLAG = "--genrm-engine-config"
DEFAULT_SAMPLING: dict[str, Any] = {"temperature": 0.1, "top_p": 1.0, "top_k": -1, "max_response_len": 4096}

# The embedded engine's server options (relax.backends.embedded.server) a GenRM engine may set, with their types.
EMBEDDED_KEYS: dict[str, type] = {"max_running_requests": int, "context_length": int, "max_prefill_tokens": int,
                                  "dtype": str, "random_seed": int, "num_threads": int}
# SGLang options that only size an SGLang server: accepted with the embedded engine, where they have no effect.
SGLANG_SIZING_KEYS = frozenset({"dp_size", "pp_size", "ep_size", "max_total_tokens", "mem_fraction_static",
                                "chunked_prefill_size", "cuda_graph_max_bs", "cuda_graph_bs", "disable_cuda_graph",
                                "enable_torch_compile", "enable_memory_saver", "log_level", "kv_cache_dtype",
                                "attention_backend"})
_OWNED = {**OWNED_BY_RELAX, "model_path": "--genrm-model-path", "tokenizer_path": "--genrm-model-path",
          "tp_size": "--genrm-num-gpus-per-engine"}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(float(x))


def sampling_config(value: Optional[dict]) -> dict[str, Any]:
    """The judge's sampling: DEFAULT_SAMPLING updated with --genrm-sampling-config (errors name the flag)."""
    out = dict(DEFAULT_SAMPLING)
    if value is None:
        return out
    if not isinstance(value, dict):
        raise ConfigError(f"{SAMPLING_FLAG} must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - set(DEFAULT_SAMPLING))
    if unknown:
        raise ConfigError(f"{SAMPLING_FLAG}: unknown key(s) {unknown}; the keys are {sorted(DEFAULT_SAMPLING)}")
    t, p, k, n = (value.get(key, out[key]) for key in ("temperature", "top_p", "top_k", "max_response_len"))
    if not _is_number(t) or t < 0:
        raise ConfigError(f"{SAMPLING_FLAG}: temperature must be a number >= 0, got {t!r}")
    if not _is_number(p) or not 0 < p <= 1:
        raise ConfigError(f"{SAMPLING_FLAG}: top_p must be a number in (0, 1], got {p!r}")
    if not _is_int(k) or (k < 1 and k != -1):
        raise ConfigError(f"{SAMPLING_FLAG}: top_k must be an integer >= 1, or -1 for all tokens, got {k!r}")
    if not _is_int(n) or n < 1:
        raise ConfigError(f"{SAMPLING_FLAG}: max_response_len must be an integer >= 1, got {n!r}")
    out.update(temperature=float(t), top_p=float(p), top_k=int(k), max_response_len=int(n))
    return out


def request_sampling(config: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling_params of one judge request."""
    return {"temperature": config["temperature"], "top_p": config["top_p"], "top_k": config["top_k"],
            "max_new_tokens": config["max_response_len"]}


def _type_ok(value: Any, typ: Any) -> bool:
    if typ is bool:
        return isinstance(value, bool)
    if typ is int:
        return _is_int(value)
    if typ is float:
        return _is_number(value)
    if typ is str:
        return isinstance(value, str)
    if typ == "int_list":
        return isinstance(value, list) and all(_is_int(x) for x in value)
    return True


def engine_config(value: Optional[dict], backend: str) -> tuple[dict[str, Any], list[str]]:
    """(the server options to apply, the keys that have no effect with this backend) of --genrm-engine-config."""
    if value is None:
        return {}, []
    if not isinstance(value, dict):
        raise ConfigError(f"{ENGINE_FLAG} must be a JSON object, got {value!r}")
    apply, ignored = {}, []
    for key, val in value.items():
        if key in _OWNED:
            raise ConfigError(f"{ENGINE_FLAG}: {key!r} is set by Relax per GenRM engine; use {_OWNED[key]} instead")
        if backend == "embedded":
            if key in EMBEDDED_KEYS:
                typ = EMBEDDED_KEYS[key]
            elif key in SGLANG_SIZING_KEYS:
                typ = BUILTIN_TYPES.get(key)
                ignored.append(key)
            else:
                raise ConfigError(f"{ENGINE_FLAG}: unknown key {key!r} for the embedded engine; it takes "
                                  f"{sorted(EMBEDDED_KEYS)} (and SGLang's sizing options "
                                  f"{sorted(SGLANG_SIZING_KEYS)}, which have no effect on it)")
        else:
            typ = BUILTIN_TYPES.get(key)
            if typ is None and not sglang_available():
                raise ConfigError(f"{ENGINE_FLAG}: unknown SGLang server option {key!r}; known here: "
                                  f"{sorted(BUILTIN_TYPES)}")
            if typ is None:
                from sglang.srt.server_args import ServerArgs  # the optional SGLang environment

                if key not in getattr(ServerArgs, "__dataclass_fields__", {}):
                    raise ConfigError(f"{ENGINE_FLAG}: {key!r} is not an SGLang server option (ServerArgs field)")
        if typ is not None and not _type_ok(val, typ):
            name = typ if isinstance(typ, str) else typ.__name__
            raise ConfigError(f"{ENGINE_FLAG}: {key!r} must be of type {name}, got {val!r}")
        if key not in ignored:
            apply[key] = val
    return apply, ignored
