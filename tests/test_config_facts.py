"""Derived facts (relax.config.facts): each product of the flags defined once, stored by validation, shown by
--dry-run."""

from __future__ import annotations

import pytest

from relax.config import facts
from relax.config.explain import batch_arithmetic
from relax.config.parser import parse_config

KL = ["--use-kl-loss"]


def _config(tmp_path, *flags):
    return parse_config(["--output-dir", str(tmp_path), *flags])


def test_samples_per_step_and_the_data_queue_are_stored_once(tmp_path):
    c = _config(tmp_path, "--rollout-batch-size", "6", "--n-samples-per-prompt", "4", "--max-staleness", "2",
                "--fully-async")
    assert c.samples_per_step == 24 == facts.samples_per_step(c)
    assert c.data_queue_samples == 72  # the training step and the two the rollout may run ahead
    assert c.derived["samples_per_step"] == 24  # travels with the config to every role (pickled)


@pytest.mark.parametrize("flags, placement", [
    (KL + ["--debug-rollout-only"], facts.NO_REFERENCE),
    # fully-async, one rank: the child's pass and old-policy rows run beside the step's own update
    (KL + ["--fully-async", "--max-staleness", "1"], facts.REFERENCE_STREAMED),
    # ... with streamed chunks the reference role computes each chunk's rows
    (KL + ["--fully-async", "--num-iters-per-train-update", "2", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "2", "--global-batch-size", "8"], facts.REFERENCE_ROLE),
    # ... with two ranks a later step's reference pass runs beside an update, off the ranks' critical path
    (KL + ["--fully-async", "--resource", '{"actor": [1, 2], "rollout": [1, 1]}', "--micro-batch-size", "64"],
     facts.REFERENCE_ROLE),
    (KL + ["--ref-update-interval", "2"], facts.REFERENCE_ROLE),  # refreshed from the actor: a role of its own
    (KL + ["--offload-train"], facts.REFERENCE_ROLE),  # the actor is not resident
    (KL + ["--resource", '{"actor": [1, 2], "rollout": [1, 1]}', "--micro-batch-size", "64"],
     facts.REFERENCE_IN_RANK),
    # one rank, one optimizer step per rollout: a whole pass beside the forward stage
    (KL + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "8"],
     facts.REFERENCE_CHILD),
    # several optimizer steps per rollout: the later updates' old-policy rows stream from the child too
    (KL + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
     facts.REFERENCE_STREAMED),
    # ... unless the old-policy rows are the engine's
    (KL + ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
           "--use-rollout-logprobs"], facts.REFERENCE_CHILD),
])
def test_the_reference_placement_is_decided_once_in_validation(tmp_path, flags, placement):
    c = _config(tmp_path, *flags)
    assert c.reference_placement == placement
    lines = batch_arithmetic(c)
    said = [line for line in lines if line.startswith("reference log-probs:")]
    if placement == facts.NO_REFERENCE:
        assert not said
    else:
        assert said == [f"reference log-probs: {facts.REFERENCE_WHERE[placement]}"]


def test_a_fully_async_trainer_that_takes_idle_cores_keeps_the_reference_role(tmp_path, monkeypatch):
    """The child process does not mark its core busy on the core board (relax.wire.core_share): a trainer that
    takes idle cores would compute on it."""
    flags = [*KL, "--fully-async", "--max-staleness", "1"]
    monkeypatch.setenv(facts.SHARE_IDLE_CORES_ENV, "1")
    assert _config(tmp_path, *flags).reference_placement == facts.REFERENCE_ROLE
    monkeypatch.setenv(facts.SHARE_IDLE_CORES_ENV, "0")
    assert _config(tmp_path, *flags).reference_placement == facts.REFERENCE_STREAMED


def test_no_kl_term_needs_no_reference(tmp_path):
    values = {**_config(tmp_path, *KL), "use_kl_loss": False, "kl_coef": 0.0}
    assert facts.reference_placement(values, 1, False) == facts.NO_REFERENCE
    assert facts.reference_placement({**values, "kl_coef": 0.05}, 1, False) != facts.NO_REFERENCE  # a KL reward needs one


def test_a_gpu_makes_the_reference_a_role(tmp_path, monkeypatch):
    """The one GPU test (the driver's CUDA): on GPUs a separate reference keeps devices of its own."""
    monkeypatch.setattr(facts, "driver_has_gpu", lambda: True)
    assert _config(tmp_path, *KL).reference_placement == facts.REFERENCE_ROLE
    monkeypatch.setattr(facts, "driver_has_gpu", lambda: False)
    assert _config(tmp_path, *KL).reference_placement in facts.IN_ACTOR_RANKS


_CPU_BUILD_CHECK = """
import sys
from relax.config import facts
cpu_only = facts.torch_built_for_cpu_only()
imported = "torch" in sys.modules
import torch
print("CHECK", cpu_only, imported, torch.version.cuda is None and torch.version.hip is None, torch.cuda.is_available())
"""


def test_the_gpu_test_reads_a_cpu_only_torch_build_without_importing_torch():
    """Validation runs before Ray starts: with a CPU-only torch it answers from torch's version file, and that
    answer agrees with torch's own."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CPU_BUILD_CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("CHECK")][0]
    _, cpu_only, imported, torch_cpu_only, available = line.split()
    assert imported == "False" and cpu_only == torch_cpu_only
    if cpu_only == "True":
        assert available == "False"


@pytest.mark.parametrize("text, cpu_only", [
    ("cuda: Optional[str] = None\nhip: Optional[str] = None\n", True),
    ("cuda = None\nhip = None\n", True),
    ("cuda: Optional[str] = '12.4'\nhip: Optional[str] = None\n", False),
    ("cuda: Optional[str] = None\nhip: Optional[str] = '6.2.4'\n", False),
    ("cuda: Optional[str] = None\n", False),  # a file that does not say: torch is asked
    ("not python(", False),
])
def test_only_a_version_file_naming_neither_cuda_nor_rocm_is_a_cpu_build(tmp_path, monkeypatch, text, cpu_only):
    import importlib.machinery
    import importlib.util
    import sys

    (tmp_path / "version.py").write_text(text)
    spec = importlib.machinery.ModuleSpec("torch", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "torch" else None)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert facts.torch_built_for_cpu_only() is cpu_only
