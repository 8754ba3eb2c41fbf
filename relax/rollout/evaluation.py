"""Evaluation sets and `evaluate`: metrics under `eval/<name>/...`.

Sets come from `--eval-prompt-data NAME PATH [NAME PATH ...]` or from `--eval-config FILE` (YAML or
JSON, OmegaConf interpolation allowed)::

    eval:                       # optional top-level key
      defaults:                 # apply to every dataset (override the --eval-* flags)
        n_samples_per_eval_prompt: 4
        temperature: 0.6
      datasets:
        - name: aime
          path: /data/aime.jsonl
          rm_type: math
          max_response_len: 1024

Per-set keys (anything else is an error naming the file and key): see `EVAL_SET_KEYS`. Unset keys
fall back to the `--eval-*` flags (which fall back to the `--rollout-*` ones).

Generation: each sample goes through the default token-in/token-out call (or
`--custom-generate-function-path`), as in the default rollout function. `--eval-function-path` replaces
this for evaluation only: `fn(ctx, rollout_id, eval_set, groups) -> groups` (sync or async) receives
the set's prompt groups (`list[list[Sample]]`, `eval_set.n_samples_per_eval_prompt` each, responses
empty; `eval_set.sampling_params()` gives the set's sampling) and returns them generated; `ctx` is the
`RolloutContext` with a live session (`await ctx.engine_generate(...)`). Scoring and metrics stay
Relax's.

Metrics per set: `reward_mean`, `reward_std`, `response_len_mean`, `truncated_fraction`,
`num_samples`, `reward_errors`, `filtered_long_prompts`, and with `--log-passrate` `pass@k` for k =
1, 2, 4, ... up to the samples per prompt (unbiased estimator; a sample passes when its reward > 0).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Sequence

from relax.config.errors import ConfigError

# key -> flag dest it overrides (None: a set-only key)
EVAL_SET_KEYS = {
    "name": None, "path": None,
    "input_key": "eval_input_key", "label_key": "eval_label_key", "tool_key": "eval_tool_key",
    "metadata_key": "metadata_key", "rm_type": "rm_type", "custom_rm_path": "custom_rm_path",
    "reward_key": "eval_reward_key", "n_samples_per_eval_prompt": "n_samples_per_eval_prompt",
    "temperature": "eval_temperature", "top_p": "eval_top_p", "top_k": "eval_top_k",
    "max_response_len": "eval_max_response_len", "max_prompt_len": "eval_max_prompt_len",
    "min_new_tokens": "eval_min_new_tokens", "max_context_len": "eval_max_context_len",
    "stop": "rollout_stop", "stop_token_ids": "rollout_stop_token_ids",
}


@dataclass(frozen=True)
class EvalSet:
    name: str
    path: str
    input_key: Optional[str] = None
    label_key: Optional[str] = None
    tool_key: Optional[str] = None
    metadata_key: Optional[str] = None
    rm_type: Optional[str] = None
    custom_rm_path: Optional[str] = None
    reward_key: Optional[str] = None
    n_samples_per_eval_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_len: Optional[int] = None
    max_prompt_len: Optional[int] = None
    min_new_tokens: Optional[int] = None
    max_context_len: Optional[int] = None
    stop: Optional[tuple] = None
    stop_token_ids: Optional[tuple] = None
    extra: dict = field(default_factory=dict)

    def sampling_params(self, skip_special_tokens: bool = False) -> dict:
        params: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                                  "max_new_tokens": self.max_response_len or 256,
                                  "skip_special_tokens": skip_special_tokens}
        if self.stop:
            params["stop"] = list(self.stop)
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_new_tokens:
            params["min_new_tokens"] = int(self.min_new_tokens)
        return params


def _flag_defaults(values: Any) -> dict:
    get = values.get if isinstance(values, dict) else (lambda k, d=None: values[k] if k in values else d)
    out = {}
    for key, dest in EVAL_SET_KEYS.items():
        if dest is None:
            continue
        val = get(dest)
        if val is None and dest.startswith("eval_"):  # rules run before the config derives the fallbacks
            base = dest[len("eval_"):]
            val = get(base) if base in ("input_key", "label_key", "tool_key", "reward_key") else get("rollout_" + base)
        out[key] = tuple(val) if isinstance(val, list) else val
    if out.get("n_samples_per_eval_prompt") is None:
        out["n_samples_per_eval_prompt"] = 1
    for key, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1)):
        if out.get(key) is None:
            out[key] = default
    return out


def _check_set(where: str, entry: Any) -> dict:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: each dataset must be a mapping with name and path")
    unknown = sorted(set(entry) - set(EVAL_SET_KEYS))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(EVAL_SET_KEYS)}")
    for key in ("name", "path"):
        if not entry.get(key):
            raise ConfigError(f"{where}: missing {key}")
    if not Path(str(entry["path"])).is_file():
        raise ConfigError(f"{where}: eval data file not found: {entry['path']}")
    n = entry.get("n_samples_per_eval_prompt")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ConfigError(f"{where}: n_samples_per_eval_prompt must be an integer >= 1, got {n!r}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in entry.items()}


def load_eval_config(path: str) -> tuple[dict, list[dict]]:
    """(defaults, datasets) from an --eval-config file, checked; errors name the file and key."""
    from omegaconf import OmegaConf

    from relax.config.files import register_resolvers

    register_resolvers()  # the same interpolation resolvers as config files

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--eval-config: file not found: {path}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(p), resolve=True)
    except Exception as exc:
        raise ConfigError(f"--eval-config {path}: cannot read ({type(exc).__name__}: {exc})") from None
    if isinstance(raw, dict) and set(raw) == {"eval"}:
        raw = raw["eval"]
    if not isinstance(raw, dict) or not isinstance(raw.get("datasets"), list) or not raw["datasets"]:
        raise ConfigError(f"--eval-config {path}: expected a mapping with a non-empty 'datasets' list")
    extra = sorted(set(raw) - {"defaults", "datasets"})
    if extra:
        raise ConfigError(f"--eval-config {path}: unknown top-level key(s) {extra}; use defaults and datasets")
    defaults = raw.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"--eval-config {path}: defaults must be a mapping")
    bad = sorted(set(defaults) - set(EVAL_SET_KEYS) | ({"name", "path"} & set(defaults)))
    if bad:
        raise ConfigError(f"--eval-config {path}: defaults: key(s) not allowed {bad}; allowed: "
                          f"{sorted(set(EVAL_SET_KEYS) - {'name', 'path'})}")
    datasets = [_check_set(f"--eval-config {path}: datasets[{i}]", d) for i, d in enumerate(raw["datasets"])]
    names = [d["name"] for d in datasets]
    if len(set(names)) != len(names):
        raise ConfigError(f"--eval-config {path}: dataset names must be unique, got {names}")
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in defaults.items()}, datasets


def eval_sets(values: Any) -> list[EvalSet]:
    """The evaluation sets of a config (or a values dict), flag fallbacks applied."""
    get = values.get if isinstance(values, dict) else (lambda k, d=None: values[k] if k in values else d)
    base = _flag_defaults(values)
    if get("eval_config"):
        defaults, datasets = load_eval_config(get("eval_config"))
        entries = []
        for d in datasets:
            own = {**defaults, **d}
            if "rm_type" in own and "custom_rm_path" not in own:
                own["custom_rm_path"] = None  # a set's own reward type beats an inherited --custom-rm-path
            entries.append({**base, **own})
    else:
        pairs = list(get("eval_prompt_data") or [])
        entries = []
        for name, path in zip(pairs[0::2], pairs[1::2]):
            entries.append({**base, **_check_set(f"--eval-prompt-data {name}", {"name": name, "path": path})})
    known = {f.name for f in fields(EvalSet)}
    return [EvalSet(**{k: v for k, v in e.items() if k in known}) for e in entries]


# --------------------------------------------------------------------------- pass@k

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples of which c passed (Chen et al., 2021)."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def passrate_metrics(groups: Sequence[Sequence[Any]], prefix: str) -> dict[str, float]:
    """`{prefix}pass@k` averaged over prompt groups for k = 1, 2, 4, ... <= group size."""
    if not groups:
        return {}
    n = min(len(g) for g in groups)
    out = {}
    k = 1
    while k <= n:
        out[f"{prefix}pass@{k}"] = statistics.fmean(
            pass_at_k(len(g), sum(float(s.reward) > 0 for s in g), k) for g in groups)
        k *= 2
    return out


# --------------------------------------------------------------------------- running

def _records(es: EvalSet, args: Any):
    from relax.rollout.data_source import read_prompt_records

    return read_prompt_records(es.path, input_key=es.input_key or "input", label_key=es.label_key,
                               metadata_key=es.metadata_key or "metadata", tool_key=es.tool_key,
                               skip_bad_lines=bool(getattr(args, "skip_bad_lines", False)),
                               multimodal_keys=getattr(args, "multimodal_keys", None))[0]


async def aevaluate_set(ctx: Any, es: EvalSet, encoder: Any, rollout_id: int) -> tuple[dict, list]:
    """Generate and score one set; returns (metrics without prefix, groups)."""
    from relax.data.sample import STATUS_TRUNCATED, Sample
    from relax.rollout.context import load_hook
    from relax.rollout.multimodal import SAMPLE_KEY as MULTIMODAL
    from relax.rollout.rewards import RewardRunner
    from relax.rollout.sglang_rollout import generate_sample

    import aiohttp

    args = ctx.args
    custom = load_hook(getattr(args, "custom_generate_function_path", None), "--custom-generate-function-path")
    sampling = es.sampling_params(bool(getattr(args, "rollout_skip_special_tokens", False)))
    groups, filtered = [], 0
    for rec in _records(es, args):
        tokens = encoder.encode(rec)
        if es.max_prompt_len is not None and len(tokens) > es.max_prompt_len:
            filtered += 1
            continue
        groups.append([Sample(index=len(groups) * es.n_samples_per_eval_prompt + j, group_index=len(groups),
                              prompt=rec.prompt, prompt_tokens=list(tokens), label=rec.label,
                              metadata={**rec.metadata, "eval_set": es.name, "prompt_index": rec.index,
                                        **({MULTIMODAL: rec.multimodal} if rec.multimodal else {})},
                              rollout_step=rollout_id)
                       for j in range(es.n_samples_per_eval_prompt)])
    limit = asyncio.Semaphore(ctx.max_concurrency)

    async def one(s):
        async with limit:
            return await generate_sample(ctx, s, sampling, custom, max_context_len=es.max_context_len)

    eval_fn = load_hook(getattr(args, "eval_function_path", None), "--eval-function-path")
    runner = RewardRunner.from_args(args, rm_type=es.rm_type, custom_rm_path=es.custom_rm_path,
                                    reward_key=es.reward_key)
    try:
        async with aiohttp.ClientSession() as session:
            ctx.session = session
            try:
                if eval_fn is not None:
                    groups = await run_eval_function(eval_fn, ctx, rollout_id, es, groups)
                    flat = [s for g in groups for s in g]
                else:
                    flat = await asyncio.gather(*(one(s) for g in groups for s in g))
            finally:
                ctx.session = None
        if eval_fn is None:
            n = es.n_samples_per_eval_prompt
            groups = [list(flat[i:i + n]) for i in range(0, len(flat), n)]
        result = await runner.ascore(groups, assign=True) if groups else None
    finally:
        runner.close()
    rewards = [float(s.reward) for s in flat]
    lengths = [len(s.response_tokens) for s in flat]
    metrics = {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_fraction": (sum(s.status == STATUS_TRUNCATED for s in flat) / len(flat)) if flat else 0.0,
        "num_samples": float(len(flat)),
        "reward_errors": float(result.num_errors if result else 0),
        "filtered_long_prompts": float(filtered),
    }
    if getattr(args, "log_passrate", False):
        metrics.update(passrate_metrics(groups, ""))
    return metrics, groups


async def run_eval_function(fn: Any, ctx: Any, rollout_id: int, es: EvalSet, groups: list) -> list:
    """Call an `--eval-function-path` function (sync or async) and check its answer."""
    import inspect

    from relax.data.sample import Sample

    out = fn(ctx, rollout_id, es, groups)
    if inspect.isawaitable(out):
        out = await out
    out = groups if out is None else [g if isinstance(g, list) else [g] for g in out]
    for g in out:
        if not g or not all(isinstance(s, Sample) for s in g):
            raise TypeError(f"--eval-function-path: must return non-empty lists of Sample (eval set {es.name!r})")
        for s in g:
            s.validate()
    return out


def evaluate(ctx: Any, encoder: Any, rollout_id: int, sets: Sequence[EvalSet]) -> tuple[dict, dict]:
    """All sets: (`eval/<name>/<metric>` dict, {name: groups})."""
    metrics, data = {}, {}
    for es in sets:
        m, groups = asyncio.run(aevaluate_set(ctx, es, encoder, rollout_id))
        metrics.update({f"eval/{es.name}/{k}": v for k, v in m.items()})
        data[es.name] = groups
    return metrics, data
