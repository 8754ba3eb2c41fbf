"""The run's local Ray head (relax.core.ray_cluster.lean_head): no dashboard API server and no autoscaler monitor
while ray.init starts the head, Ray's own methods back afterwards, all of it kept with RELAX_RAY_FULL_HEAD=1."""

from __future__ import annotations

from ray._private import node

from relax.core.ray_cluster import lean_head

METHODS = ("start_api_server", "start_monitor")


def test_the_head_skips_the_dashboard_server_and_the_monitor_and_restores_them(monkeypatch):
    monkeypatch.delenv("RELAX_RAY_FULL_HEAD", raising=False)
    before = {n: vars(node.Node)[n] for n in METHODS}
    with lean_head():
        for n in METHODS:
            assert vars(node.Node)[n] is not before[n]
            assert getattr(node.Node, n)(object(), include_dashboard=False, raise_on_failure=False) is None
    assert {n: vars(node.Node)[n] for n in METHODS} == before


def test_the_full_head_on_request(monkeypatch):
    monkeypatch.setenv("RELAX_RAY_FULL_HEAD", "1")
    before = {n: vars(node.Node)[n] for n in METHODS}
    with lean_head():
        assert {n: vars(node.Node)[n] for n in METHODS} == before


def test_the_methods_come_back_when_ray_init_fails(monkeypatch):
    monkeypatch.delenv("RELAX_RAY_FULL_HEAD", raising=False)
    before = {n: vars(node.Node)[n] for n in METHODS}
    try:
        with lean_head():
            raise RuntimeError("ray.init failed")
    except RuntimeError:
        pass
    assert {n: vars(node.Node)[n] for n in METHODS} == before


# ---------------------------------------------------------------------------------------------
# The workers' environment without runtime envs (relax.core.ray_cluster.start_local_head,
# relax.config.env.role_runtime_env)

def test_a_role_gets_only_the_variables_its_workers_do_not_inherit(monkeypatch):
    from relax.config import env

    monkeypatch.delenv(env.HEAD_ENV_VAR, raising=False)
    monkeypatch.setattr(env, "_started_head_env", None)
    assert env.role_runtime_env({"A": "1"}) == {"env_vars": {"A": "1"}}  # a cluster started elsewhere: all of it
    env.note_local_head({"A": "1", "B": "2"})  # the driver that started the head
    assert env.role_runtime_env({"A": "1", "B": "2"}) is None
    assert env.role_runtime_env({"A": "1", "B": "3", "C": 4}) == {"env_vars": {"B": "3", "C": "4"}}
    env.note_local_head(None)  # connected elsewhere afterwards
    assert env.role_runtime_env({"A": "1"}) == {"env_vars": {"A": "1"}}


def test_a_worker_counts_on_the_heads_variables_only_where_it_has_them(monkeypatch):
    import json

    from relax.config import env

    monkeypatch.setattr(env, "_started_head_env", None)
    monkeypatch.setenv(env.HEAD_ENV_VAR, json.dumps({"A": "1", "B": "2"}))
    monkeypatch.setenv("A", "1")
    monkeypatch.setenv("B", "2")
    assert env.role_runtime_env({"A": "1"}) is None  # a worker of the head: it has them, as its children will
    monkeypatch.setenv("B", "9")  # its own runtime env changed one, or the head is another (a stale variable)
    assert env.role_runtime_env({"A": "1"}) == {"env_vars": {"A": "1"}}


def test_workers_of_the_local_head_inherit_the_environment_and_run_the_set_up_hook(ray_session):
    """The tests' shared cluster is started as a run's (start_local_head): an actor created without a runtime env
    has the workers' variables and the run's key, and ran Relax's set-up hook (its records' console handler);
    the driver's own environment is as it was, and a role's variables need no runtime env."""
    import os

    import ray

    from relax.config.env import HEAD_ENV_VAR, role_runtime_env, worker_env
    from relax.wire.auth import ENGINE_API_KEY_ENV, engine_api_key

    wanted = {**worker_env(), ENGINE_API_KEY_ENV: engine_api_key()}
    assert role_runtime_env(wanted) is None
    assert HEAD_ENV_VAR not in os.environ

    @ray.remote(num_cpus=0)
    class Probe:
        def report(self, names):
            import logging

            return ({n: os.environ.get(n) for n in names},
                    any(getattr(h, "_relax_worker", False) for h in logging.getLogger("relax").handlers),
                    role_runtime_env(wanted))

    probe = Probe.options(runtime_env=role_runtime_env(wanted)).remote()
    try:
        seen, hooked, nested = ray.get(probe.report.remote(sorted(wanted)), timeout=120)
    finally:
        ray.kill(probe)
    assert seen == wanted
    assert hooked  # relax.core.worker_setup ran in the worker
    assert nested is None  # and what it creates inherits the same
