"""Checks of the run's inputs on disk, before Ray or any role starts: a mistake in a path or a file costs
seconds and one message naming the flag, the file and the fix, not a start-up and an actor traceback.

Flag values alone are checked in `relax.config.validate`; what needs the files themselves (and the
readers that training uses, so that both agree on what a bad row is) is checked here:

- the model folder (`--hf-checkpoint`): exists, holds a parseable `config.json` and a tokenizer;
- prompt files (`--prompt-data`, the evaluation sets): are not empty, and their rows parse with the keys
  they are read with — every row when the file is small, the first `SCAN_ROWS` otherwise. Each row is also
  checked against the flags with the checks the rollout itself runs on it (`relax.formats.row_checks`, see
  `row_check`): its prompt against --apply-chat-template, its --multimodal-keys values, its reward type
  (--rm-type or metadata.rm_type) and its label against that reward; a mismatch names file:line, the flag
  and the fix (--skip-bad-lines does not skip it: training would fail on it). Rows without a
  label and fewer distinct prompts than `--rollout-batch-size` are reported as warnings (the embedded
  default's own task repeats its 10 prompts by design: one INFO line). (That the files
  exist is checked with the flags, in `relax.config.validate.check_data` and `relax.config.eval_sets`.);
- checkpoints (`--load`, `--ref-load`, `--critic-load`): a path that does not exist is an error (a typo),
  except `--load` equal to `--save`, the resume-or-start pattern of launch scripts, which starts fresh
  and says so. The iteration the marker names must be complete and its files intact (a truncated file
  is named with its iteration, and the newest complete iteration is offered); `--ckpt-step`'s iteration
  must be complete (else the complete ones are listed); `--pretrained-checkpoint`, read while `--load` holds no
  checkpoint, must be a Relax checkpoint or a Hugging Face model folder;
- a debug replay file (`--load-debug-rollout-data`) exists.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Callable, Optional

from relax.config.errors import ConfigError
from relax.formats.checkpoint_layout import (
    MARKER,
    checkpoint_problem,
    complete_iterations,
    is_saved,
    iter_dir,
    latest_iteration,
    missing_iteration_text,
    resolve_model_checkpoint,
    select_iteration,
)
from relax.config.eval_sets import eval_sets, reader_keys
from relax.formats.prompt_files import PromptDataError, PromptRecord, RowFlagError, scan_prompt_file
from relax.formats.row_checks import (RowProblem, multimodal_problem, prompt_problem, resolve_rm_type,
                                   reward_label_problem, rm_type_problem)
from relax.formats.replay_record import first_file

logger = logging.getLogger("relax")

SCAN_ROWS = 100_000  # rows read from a prompt file larger than FULL_SCAN_BYTES
FULL_SCAN_BYTES = 64 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def preflight(config: Any) -> list[str]:
    """Raise `ConfigError` for the first input that cannot work; return warnings worth a console line."""
    notes: list[str] = []
    check_model_folder(config.hf_checkpoint)
    if config.prompt_data:
        notes += check_prompt_file(config, "--prompt-data", config.prompt_data, config.rollout_batch_size,
                                   input_key=config.input_key, label_key=config.label_key,
                                   metadata_key=config.metadata_key, tool_key=config.tool_key,
                                   check=row_check(config, config.rm_type, config.custom_rm_path))
    eval_flag = "--eval-config" if config.eval_config else "--eval-prompt-data"
    for es in eval_sets(config):
        notes += check_prompt_file(config, f"{eval_flag} {es.name}", es.path, None, **reader_keys(es),
                                   check=row_check(config, es.rm_type, es.custom_rm_path))
    notes += check_load(config)
    notes += check_pretrained(config)
    for flag, path in (("--ref-load", config.ref_load), ("--critic-load", config.critic_load)):
        if path and path != config.load and not Path(path).exists():
            raise ConfigError(f"{flag}: {path} does not exist; check the path")
    if config.load_debug_rollout_data:
        check_debug_file(config.load_debug_rollout_data, config.start_rollout_id or 0)
    return notes


def check_model_folder(path: Optional[str]) -> None:
    if not path:
        raise ConfigError("--hf-checkpoint is required (the model folder: config.json, weights, tokenizer); "
                          "run without --prompt-data and --hf-checkpoint for the embedded default")
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--hf-checkpoint: {path} is not a folder (no model hub is used: give a local model "
                          "folder with config.json, weights and tokenizer)")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"--hf-checkpoint: {config_file} is missing; the folder is not a Hugging Face model")
    try:
        json.loads(config_file.read_text())
    except (ValueError, OSError) as exc:
        raise ConfigError(f"--hf-checkpoint: {config_file} is not valid JSON ({exc})") from None
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"--hf-checkpoint: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                          "copy the tokenizer files next to the weights")


def row_check(config: Any, rm_type: Optional[str],
              custom_rm_path: Optional[str]) -> Callable[[PromptRecord], Optional[RowProblem]]:
    """The rollout's own checks of a row against the flags (`relax.formats.row_checks`): the prompt as
    `relax.rollout.prompts` renders it, the --multimodal-keys values as `relax.rollout.multimodal` sends them, and,
    when the default rollout scores with a built-in reward (no custom reward or rollout function), the reward type
    as `relax.rollout.rewards.registry` resolves it and the label as `relax.rollout.rewards.builtin` reads it."""
    chat = bool(config.apply_chat_template)
    defaults = config.meta.get("defaults") or {}
    default_rollout = config.get("rollout_function_path") == defaults.get("rollout_function_path",
                                                                          config.get("rollout_function_path"))
    rollout = not (config.get("load_debug_rollout_data") or config.get("debug_train_only"))  # else none runs
    scored = rollout and default_rollout and not custom_rm_path

    def check(rec: PromptRecord) -> Optional[RowProblem]:
        if not rollout:
            return None
        problem = prompt_problem(rec.prompt, chat)
        for modality, value in (rec.multimodal or {}).items():
            problem = problem or multimodal_problem(modality, value)
        if scored and problem is None:
            problem = rm_type_problem(rm_type, rec.metadata) or \
                reward_label_problem(resolve_rm_type(rm_type, rec.metadata), rec.label)
        return problem

    return check


def check_prompt_file(config: Any, flag: str, path: str, rollout_batch_size: Optional[int], *, input_key: str,
                      label_key: Optional[str], metadata_key: Optional[str], tool_key: Optional[str],
                      check: Optional[Callable[[PromptRecord], Optional[RowProblem]]] = None) -> list[str]:
    """Rows of an existing prompt file, read as training or evaluation reads them (the keys given), each checked
    with `check` (`row_check`)."""
    size = Path(path).stat().st_size
    if size == 0:
        raise ConfigError(f"{flag}: {path} is empty")
    full = size <= FULL_SCAN_BYTES
    try:
        counts = scan_prompt_file(path, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
                                  tool_key=tool_key, skip_bad_lines=bool(config.skip_bad_lines),
                                  multimodal_keys=config.multimodal_keys, max_rows=None if full else SCAN_ROWS,
                                  check=check)
    except RowFlagError as exc:
        raise ConfigError(f"{flag}: {exc}") from None
    except PromptDataError as exc:
        raise ConfigError(f"{flag}: {exc} (fix the row, or add --skip-bad-lines to skip and count bad rows)") \
            from None
    read = "" if counts["complete"] else f" (first {counts['rows']} rows)"
    if counts["rows"] == 0:
        raise ConfigError(f"{flag}: {path} has no usable row{read}: {counts['bad_lines']} bad row(s)")
    notes = []
    if counts["bad_lines"]:
        notes.append(f"{flag}: {counts['bad_lines']} bad row(s) of {path} will be skipped (--skip-bad-lines){read}")
    if counts["missing_label"]:
        notes.append(f"{flag}: {counts['missing_label']} of {counts['rows']} rows{read} of {path} have no "
                     f"{label_key!r} key; rewards that compare with a label score them 0")
    if rollout_batch_size and counts["complete"] and counts["distinct_prompts"] < rollout_batch_size:
        if _embedded_task(config, path):  # the preset's own choice: a fact, not something to act on
            logger.info("embedded default: the task has %d distinct prompts, so each step's %d prompts repeat "
                        "them", counts["distinct_prompts"], rollout_batch_size)
        else:
            notes.append(f"{flag}: {path} has {counts['distinct_prompts']} distinct prompt(s), fewer than "
                         f"--rollout-batch-size {rollout_batch_size}: every step repeats prompts")
    return notes


def _embedded_task(config: Any, path: str) -> bool:
    """`path` is the embedded default's task file, written by the preset (`relax.config.presets`)."""
    return bool(config.meta.get("embedded_default")) and path == config.prompt_data


def check_load(config: Any) -> list[str]:
    load = config.load
    if not load:
        return []
    root = Path(load)
    resume_or_start = config.save is not None and root.resolve() == Path(config.save).resolve()
    pretrained = config.get("pretrained_checkpoint")
    if not root.exists():
        _step_without_checkpoint(config, root)
        if pretrained:
            return [f"--load {load} does not exist yet: starting from --pretrained-checkpoint {pretrained}"]
        if resume_or_start:
            return [f"--load {load} does not exist yet (it is also --save): starting from step 0"]
        raise ConfigError(f"--load: {load} does not exist (a typo?); to start fresh and save there, pass only "
                          f"--save {load}, or --load and --save with the same path")
    try:
        rollout_id = latest_iteration(root)
    except ValueError:
        raise ConfigError(f"--load: {root / MARKER} does not hold an iteration number") from None
    if rollout_id is None:
        _step_without_checkpoint(config, root)
        if (root / "config.json").is_file() or is_saved(root):  # resuming would ignore these weights
            raise ConfigError(f"--load: {load} holds model weights, not a run checkpoint ({MARKER} is missing); "
                              "--load resumes a run saved with --save. To start from these weights pass the folder "
                              "as --hf-checkpoint (a Hugging Face model), --pretrained-checkpoint (the actor starts "
                              "from these weights) or --ref-load (a Relax checkpoint: the actor starts from the "
                              "reference weights)")
        if pretrained:
            return [f"--load {load} holds no checkpoint yet: starting from --pretrained-checkpoint {pretrained}"]
        if resume_or_start:
            return [f"--load {load} holds no checkpoint yet (it is also --save): starting from step 0"]
        raise ConfigError(f"--load: {load} holds no checkpoint ({MARKER} is missing) and is not the --save folder")
    if config.get("ckpt_step") is not None:
        try:
            select_iteration(root, config.ckpt_step)
        except ValueError as exc:
            raise ConfigError(f"--ckpt-step {config.ckpt_step} with --load {load}: {exc}") from None
        return []
    problem = checkpoint_problem(iter_dir(root, rollout_id))
    if problem:
        older = [i for i in complete_iterations(root) if i < rollout_id]
        offer = (f"; the newest complete checkpoint is iteration {older[-1]} ({iter_dir(root, older[-1]).name}): "
                 f"write {older[-1]} into {root / MARKER} to resume from it") if older else \
            "; no earlier complete checkpoint exists"
        raise ConfigError(f"--load: iteration {rollout_id}: {problem}{offer}")
    return []


def _step_without_checkpoint(config: Any, root: Path) -> None:
    """--ckpt-step picks an iteration of --load, which holds no checkpoint: an error unless --pretrained-checkpoint
    is read instead (its iteration is then the one picked)."""
    if config.get("ckpt_step") is not None and not config.get("pretrained_checkpoint"):
        have = ", ".join(map(str, complete_iterations(root))) or "none"
        raise ConfigError(f"--ckpt-step {config.ckpt_step}: --load {root} holds no checkpoint ({MARKER} is missing); "
                          f"complete iterations there: {have}")


def check_pretrained(config: Any) -> list[str]:
    """--pretrained-checkpoint: the weights the actor starts from while --load holds no checkpoint (Megatron-LM's
    meaning); --ckpt-step then picks its iteration."""
    path = config.get("pretrained_checkpoint")
    if not path:
        return []
    if config.load and (Path(config.load) / MARKER).is_file():
        return [f"--pretrained-checkpoint {path} is not read: --load {config.load} holds a checkpoint, which the run "
                "resumes from"]
    if not Path(path).exists():
        raise ConfigError(f"--pretrained-checkpoint: {path} does not exist; check the path")
    step = config.get("ckpt_step")
    if step is not None:
        if not (Path(path) / MARKER).is_file():
            raise ConfigError(f"--ckpt-step {step} picks an iteration of a save root ({MARKER}), and "
                              f"--pretrained-checkpoint {path} is not one; drop --ckpt-step")
        if checkpoint_problem(iter_dir(path, step)) is not None:
            raise ConfigError(f"--ckpt-step {step} with --pretrained-checkpoint {path}: "
                              f"{missing_iteration_text(path, step)}")
    try:
        resolve_model_checkpoint(path, step)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--pretrained-checkpoint: {exc}") from None
    return []


def check_debug_file(template: str, rollout_id: int = 0) -> None:
    path = first_file(template, rollout_id)
    if not path.is_file():
        raise ConfigError(f"--load-debug-rollout-data: file not found: {path} (the first step to replay)")
