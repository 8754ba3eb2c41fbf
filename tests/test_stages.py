"""The driver side of the step's stages (relax.core.stages) without Ray: which role each stage calls, what
it returns, and that a stage whose role the run does not have calls nothing; and the layering rule that
relax.core does not import relax.training."""

import ast
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from relax.core.deadlines import RoleFailure
from relax.core.roles import AuxRoles
from relax.core.stages import Stages, run_group

ROOT = Path(__file__).resolve().parents[1]


class FakeGroup:
    def __init__(self, name, calls):
        self.name, self.calls, self.workers = name, calls, [f"{name}-rank0", f"{name}-rank1"]

    def compute(self, step):
        self.calls.append((self.name, "compute", step))
        return 0.5

    def train(self, step):
        self.calls.append((self.name, "train", step))
        return {"critic/value_loss": 1.0}


def _stages(calls, *, reference=True, critic=True, teacher=True, interval=None):
    config = SimpleNamespace(ref_update_interval=interval, reference_placement="role")
    aux = AuxRoles(config, FakeGroup("reference", calls) if reference else None,
                   critic=FakeGroup("critic", calls) if critic else None,
                   teacher=FakeGroup("teacher", calls) if teacher else None)

    def trainers(method, action, step, *args):
        calls.append(("trainers", method, step, *args))
        return [{f"perf/{method}": 1.0}, {"rank": 1}]

    def trainer0(method, action, step, *args):
        calls.append(("trainer0", method, step, *args))
        return {f"perf/{method}": 1.0}

    def bounded(role, action, step, fn):
        calls.append(("deadline", role, action, step))
        return fn()

    return Stages(config, aux, trainers=trainers, trainer0=trainer0, bounded=bounded)


def _one_step(stages, step):
    out = {}
    for name in ("reference_logprobs", "teacher_logprobs", "critic_values", "actor_forward", "advantages",
                 "actor_update", "reference_refresh", "critic_update"):
        out.update(getattr(stages, name)(step))
    return out


def test_each_stage_calls_its_role_within_a_deadline_and_returns_metrics_only():
    calls = []
    metrics = _one_step(_stages(calls, interval=2), 1)
    assert calls == [
        ("deadline", "reference", "reference log-probs", 1), ("reference", "compute", 1),
        ("deadline", "teacher", "teacher log-probs", 1), ("teacher", "compute", 1),
        ("deadline", "critic", "critic values", 1), ("critic", "compute", 1),
        ("trainers", "forward", 1, 1), ("trainer0", "advantages", 1, 1), ("trainers", "train", 1, 1),
        ("trainers", "refresh_reference", 1, 1, ["reference-rank0", "reference-rank1"]),
        ("deadline", "critic", "critic update", 1), ("critic", "train", 1)]
    assert metrics == {"perf/ref_logprob_time": 0.5, "perf/teacher_logprob_time": 0.5,
                       "perf/critic_value_time": 0.5, "perf/forward": 1.0, "perf/advantages": 1.0,
                       "perf/train": 1.0, "perf/refresh_reference": 1.0, "critic/value_loss": 1.0}


def test_stages_without_their_role_call_nothing():
    calls = []
    metrics = _one_step(_stages(calls, reference=False, critic=False, teacher=False, interval=1), 0)
    assert calls == [("trainers", "forward", 0, 0), ("trainer0", "advantages", 0, 0), ("trainers", "train", 0, 0)]
    assert set(metrics) == {"perf/forward", "perf/advantages", "perf/train"}
    calls.clear()
    _one_step(_stages(calls, critic=False, teacher=False, interval=3), 1)  # refreshed after steps 2, 5, ...
    assert not any(c[1] == "refresh_reference" for c in calls)


def test_core_does_not_import_training():
    for path in sorted((ROOT / "relax" / "core").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "relax.training" or n.startswith("relax.training.") for n in names), path.name


def test_plan_groups_the_passes_that_read_only_the_rollout():
    stages = _stages([])
    plan = [tuple(s.__name__ for s in group) for group in stages.plan()]
    assert plan == [("reference_logprobs", "teacher_logprobs", "critic_values", "actor_forward"), ("advantages",),
                    ("actor_update",), ("reference_refresh",), ("critic_update",)]
    lean = _stages([], reference=False, critic=False, teacher=False)
    assert [g[0].__name__ for g in lean.plan()][:2] == ["actor_forward", "advantages"]
    assert len(lean.plan()[0]) == 1
    # the in-trainer reference only starts its pass on the actor's ranks: alone, before the forward stage
    lean.aux.reference_in_trainer = True
    assert [tuple(s.__name__ for s in g) for g in lean.plan()][:2] == [("reference_logprobs",), ("actor_forward",)]


def test_run_group_runs_its_stages_at_the_same_time_and_merges_in_order():
    barrier = threading.Barrier(3, timeout=10)  # passes only when all three stages are inside at once

    def stage(name):
        def run(step):
            barrier.wait()
            return {f"{name}/step": float(step), "shared": name}
        run.__name__ = name
        return run

    out = run_group((stage("a"), stage("b"), stage("c")), 4)
    assert out == {"a/step": 4.0, "b/step": 4.0, "c/step": 4.0, "shared": "c"}


def test_run_group_waits_for_every_stage_then_raises_the_first_error_in_order():
    finished = []

    def slow_ok(step):
        time.sleep(0.3)
        finished.append("slow_ok")
        return {}

    def fails_first(step):
        raise ValueError("reference pass failed")

    def fails_last(step):
        raise KeyError("forward failed")

    with pytest.raises(RoleFailure, match="reference pass failed"):
        run_group((fails_first, slow_ok, fails_last), 0)
    assert finished == ["slow_ok"]
    with pytest.raises(KeyError, match="forward failed"):  # the caller's own stage raises as itself
        run_group((slow_ok, fails_last), 0)


def test_ahead_stages_are_the_frozen_models_passes_and_leave_the_plan():
    stages = _stages([])
    ahead = stages.ahead()
    assert [s.__name__ for s in ahead] == ["reference_logprobs", "teacher_logprobs"]
    assert [s.__name__ for s in stages.plan(without=ahead)[0]] == ["critic_values", "actor_forward"]
    # a reference refreshed from the actor must wait for the step before's refresh; the critic always does
    refreshed = _stages([], interval=2)
    assert [s.__name__ for s in refreshed.ahead()] == ["teacher_logprobs"]
    assert _stages([], reference=False, teacher=False).ahead() == ()
