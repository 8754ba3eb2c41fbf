"""Products of the flags that more than one part of Relax reads, each defined once.

Pure functions over a mapping of flag values (a dict during validation, or a `Config`). Validation stores
their results as derived facts (relax.config.validate.DERIVED_FACTS), and the roles read the stored value
(`config.samples_per_step`, `config.reference_placement`); the rules that run before the facts exist (presets,
batch arithmetic) call these functions on the values they have.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

# Where the reference model's log-probs are computed (`reference_placement`):
NO_REFERENCE = "none"  # no KL loss and no KL reward: no reference model at all
REFERENCE_ROLE = "role"  # a reference role of its own (its own Ray actors and devices)
REFERENCE_IN_RANK = "in_rank"  # inside each actor rank's process, in the ranks' model-parallel groups
REFERENCE_CHILD = "child_process"  # a child process of the one actor rank, its pass beside the rank's forward pass
REFERENCE_STREAMED = "streamed"  # that child process also streams the later updates' old-policy rows
REFERENCE_PLACEMENTS = (NO_REFERENCE, REFERENCE_ROLE, REFERENCE_IN_RANK, REFERENCE_CHILD, REFERENCE_STREAMED)
IN_ACTOR_RANKS = (REFERENCE_IN_RANK, REFERENCE_CHILD, REFERENCE_STREAMED)  # no reference role is launched
REFERENCE_WHERE = {  # each placement as --dry-run states it
    REFERENCE_ROLE: "a reference role of its own (its own actors; on GPU its own devices)",
    REFERENCE_IN_RANK: "inside each actor rank, in the ranks' model-parallel groups",
    REFERENCE_CHILD: "a child process of the actor rank, its pass beside the actor's forward pass",
    REFERENCE_STREAMED: "a child process of the actor rank, streaming each update's reference and old-policy rows "
                        "while the rank trains",
}


def driver_has_gpu() -> bool:
    """The one GPU test of validation: whether this process (the driver, where the flags are validated) sees a
    CUDA device. The rollout backend's "auto" and the reference's placement follow it; an actor without a GPU of
    its own would always see none. A torch built for CPUs only sees none on any machine: that is read from its
    version file, without importing torch (~2 s of CPU before Ray can start)."""
    if torch_built_for_cpu_only():
        return False
    import torch  # only when a fact depends on it: importing torch takes seconds

    return torch.cuda.is_available()


def torch_built_for_cpu_only() -> bool:
    """Whether the installed torch is a CPU-only build: its `torch/version.py` sets both `cuda` and `hip` to None
    (then `torch.cuda.is_available()` is False). False when torch is imported already (it is asked then) or its
    version file cannot be read as such."""
    import ast
    import importlib.util
    import sys
    from pathlib import Path

    if "torch" in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec("torch")
        folders = list(spec.submodule_search_locations or []) if spec is not None else []
        tree = ast.parse((Path(folders[0]) / "version.py").read_text())
    except (ImportError, IndexError, OSError, SyntaxError, ValueError):
        return False
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            values[node.target.id] = node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
    return all(isinstance(values.get(name), ast.Constant) and values[name].value is None for name in ("cuda", "hip"))


def samples_per_step(v: Mapping[str, Any]) -> int:
    """Samples one rollout step produces: --rollout-batch-size prompts x --n-samples-per-prompt (0 before the
    batch size is known)."""
    return (v["rollout_batch_size"] or 0) * v["n_samples_per_prompt"]


def data_queue_samples(v: Mapping[str, Any]) -> int:
    """Samples the data plane holds at most: the steps the rollout may run ahead (--max-staleness) and the one
    training."""
    return samples_per_step(v) * (v["max_staleness"] + 1)


def model_parallel_size(v: Mapping[str, Any]) -> int:
    """Ranks that hold one copy of the model: tensor x pipeline x context parallel."""
    return v["tensor_model_parallel_size"] * v["pipeline_model_parallel_size"] * v["context_parallel_size"]


def role_workers(v: Mapping[str, Any], role: str) -> int:
    """Workers of a role under --resource: replicas x GPUs (devices) each."""
    replicas, gpus = v["resource"].get(role, [1, 1])
    return replicas * gpus


def data_parallel_size(v: Mapping[str, Any]) -> int:
    """Copies of the model the actor's ranks train: actor ranks / model-parallel size (at least one)."""
    return max(1, role_workers(v, "actor") // model_parallel_size(v))


def needs_reference(v: Mapping[str, Any]) -> bool:
    """A reference model is needed for the KL loss term or KL reward shaping."""
    return bool(v["use_kl_loss"]) or bool(v["kl_coef"])


def streams_old_logprobs(v: Mapping[str, Any]) -> bool:
    """Whether the old-policy rows of a one-rank actor whose reference runs in a child process come from that
    process: a step makes several optimizer steps (`--global-batch-size` below the samples of a rollout), the rows
    are recomputed under the weights of the rollout, the current ones (no --keep-old-actor, not the engine's),
    nothing else of the step reads them before the update (no --kl-coef shaping, OPD, --true-on-policy-mode check
    or entropy from the pass), the tokens are those the rollout stored (no
    --custom-convert-samples-to-train-data-path) and no MoE routing is replayed (the child records no routes)."""
    if not v["global_batch_size"] or samples_per_step(v) // v["global_batch_size"] < 2:
        return False
    return not (v["keep_old_actor"] or v["kl_coef"] or v["use_opd"] or v["true_on_policy_mode"]
                or v["use_rollout_entropy"] or v["use_rollout_logprobs"]
                or v["custom_convert_samples_to_train_data_path"]
                or v["use_routing_replay"] or v["use_rollout_routing_replay"])


SHARE_IDLE_CORES_ENV = "RELAX_SHARE_IDLE_CORES"
# The narrowest model whose trainer gains from the idle cores. A second OpenMP thread pays only for large matrix
# products: measured (benchmarks/async_bench.py, 2 cores, async S=1 against sync) SmolLM2-135M (width 576) went
# from 1.24x with fixed thread counts to 1.64x (1.71x in a second run) taking the idle core, while the embedded
# default (width 64) went from 0.96x to 0.73x, its small kernels losing more to the threads' synchronisation than
# they gain.
IDLE_CORES_MIN_WIDTH = 256


def read_hf_config(path: Any) -> Optional[dict]:
    """`<path>/config.json` as read from the file (no transformers import: ~2 s before Ray), None when it is
    missing or cannot be read."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return None


def model_width(v: Mapping[str, Any]) -> Optional[int]:
    """The trained model's hidden size: its --hf-checkpoint's config.json (the embedded default's built-in
    architecture before its folder is written), else --hidden-size; None when unknown."""
    path = v.get("hf_checkpoint")
    if path:
        if (Path(path) / "config.json").is_file():
            hf = read_hf_config(path)
            if hf is None:
                return None
            hf = hf.get("text_config") or hf  # multimodal configs hold the language model's sizes there
            width = hf.get("hidden_size") or hf.get("d_model") or hf.get("n_embd")
            return int(width) if width else None
        from relax.config.rules_arch import is_embedded_model  # which reads this module's facts through presets

        if is_embedded_model(v):
            from relax.models.embedded import EMBEDDED_ARCH

            return EMBEDDED_ARCH.hidden_size
        return None
    return v.get("hidden_size")


def shares_idle_cores(v: Mapping[str, Any]) -> bool:
    """Whether the trainer takes the cores its neighbours leave idle (relax.wire.core_share): a fully-async run
    with --max-staleness >= 1 (0 is the synchronous schedule, kept bit for bit) on CPU, with both the rollout
    and the trainer, of a model at least IDLE_CORES_MIN_WIDTH wide. RELAX_SHARE_IDLE_CORES=0 turns it off and
    =1 on at any width."""
    if not v["fully_async"] or v["max_staleness"] < 1 or v["debug_rollout_only"] or v["debug_train_only"]:
        return False
    forced = os.environ.get(SHARE_IDLE_CORES_ENV, "")
    if forced == "0" or driver_has_gpu():
        return False
    return forced == "1" or (model_width(v) or 0) >= IDLE_CORES_MIN_WIDTH


def reference_placement(v: Mapping[str, Any], actor_world_size: int, takes_idle_cores: bool) -> str:
    """Where the reference runs (one of `REFERENCE_PLACEMENTS`), decided once, in validation. `takes_idle_cores`:
    the run's `shares_idle_cores` fact.

    Inside the actor's ranks on CPU when its reference is never refreshed from the actor (--ref-update-interval)
    and the actor is resident (no --colocate / --offload-train). Why: on CPU the reference model is a second copy
    beside the actor's in host memory either way; a role of its own costs a Ray actor to place and start, a Ray
    call and a data-plane read of the step per step, where in the trainer the step's samples read for the
    reference are the ones the actor's forward stage reads next. A one-rank actor runs it in a child process
    (relax.roles.reference_process: its pass beside the actor's on the other core); with more ranks it shares the
    ranks' model-parallel groups and runs in the rank's own process. On GPU a separate reference keeps its own
    devices, so it stays a role there.

    Fully-async runs (`fully_async_reference_in_child`) keep the child process of a one-rank actor, whose pass
    (and the later updates' old-policy rows) runs beside the step's own update; otherwise the reference is a
    role, whose pass of a later step runs beside an update (`Stages.ahead`), since a reference in the ranks'
    own processes would run on the update's critical path."""
    if not needs_reference(v) or v["debug_rollout_only"]:
        return NO_REFERENCE
    if v["ref_update_interval"] or v["colocate"] or v["offload_train"] or driver_has_gpu():
        return REFERENCE_ROLE
    if v["fully_async"] and not (actor_world_size == 1 and fully_async_reference_in_child(v, takes_idle_cores)):
        return REFERENCE_ROLE
    if actor_world_size > 1:
        return REFERENCE_IN_RANK
    return REFERENCE_STREAMED if streams_old_logprobs(v) else REFERENCE_CHILD


def fully_async_reference_in_child(v: Mapping[str, Any], takes_idle_cores: bool) -> bool:
    """Whether a fully-async run's one-rank actor keeps its reference in a child process (as a synchronous run
    does) rather than a reference role of its own.

    The child computes the step's reference rows (and, with several updates per rollout, the later updates'
    old-policy rows) on the other core while the step's first update trains; the role computes the next step's
    reference rows while this step trains, and leaves the old-policy pass of every sample on the trainer before
    its first update. Measured on the embedded default (benchmarks/async_bench.py, async S=1, 2 cores, alternated
    twice): 0.593 and 0.673 s a step with the role, 0.528 and 0.657 with the child.

    Not when the trainer takes idle cores (`takes_idle_cores`, the `shares_idle_cores` fact): the child does not
    mark the cores it computes on on the core board (relax.wire.core_share), so the trainer would take its core.
    Not with streamed chunks (--num-iters-per-train-update > 1), whose reference rows are the role's per chunk
    (relax.core.streaming)."""
    return v["num_iters_per_train_update"] <= 1 and not takes_idle_cores
