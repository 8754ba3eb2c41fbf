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


def test_ray_registers_its_pydantic_and_arrow_serializers_when_the_packages_are_imported():
    """relax.core.ray_serializers in a fresh interpreter: Ray's serialization context no longer imports pydantic,
    starlette or pyarrow, and each package's serializers are registered at its first import all the same."""
    import subprocess
    import sys

    code = """
import sys
import ray.cloudpickle as cloudpickle
from ray.util import serialization_addons
from relax.core.ray_serializers import defer_ray_serializers

class Context:  # what Ray's registration functions call on a serialization context
    def _register_cloudpickle_serializer(self, cls, custom_serializer, custom_deserializer):
        cloudpickle.CloudPickler.dispatch[cls] = custom_serializer
    def _register_cloudpickle_reducer(self, cls, reducer):
        cloudpickle.CloudPickler.dispatch[cls] = reducer

defer_ray_serializers()
defer_ray_serializers()  # once per process
serialization_addons.apply(Context())
print(sorted(m for m in ("pydantic", "pyarrow", "starlette") if m in sys.modules))
import pyarrow, pydantic.v1.fields, starlette.datastructures
print(pyarrow.Table in cloudpickle.CloudPickler.dispatch, pydantic.v1.fields.ModelField in cloudpickle.CloudPickler.dispatch,
      starlette.datastructures.State in cloudpickle.CloudPickler.dispatch)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["[]", "True True True"], out.stdout


def test_a_worker_imports_neither_pydantic_nor_pyarrow_for_ray(ray_session):
    """A worker of the local head (whose set-up hook defers Ray's serializers) answers its first tasks without
    importing pydantic or pyarrow; once it imports pyarrow, Ray's Arrow table reducer is registered."""
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def loaded(self):
            import sys

            return [m for m in ("pydantic", "pyarrow") if m in sys.modules]

        def arrow(self):
            import pyarrow
            import ray.cloudpickle as cloudpickle

            return pyarrow.Table in cloudpickle.CloudPickler.dispatch

    probe = Probe.remote()
    try:
        assert ray.get(probe.loaded.remote(), timeout=120) == []
        assert ray.get(probe.loaded.remote(), timeout=60) == []  # its context made by the first task's answer
        assert ray.get(probe.arrow.remote(), timeout=60)
    finally:
        ray.kill(probe)


def test_a_ray_whose_serialization_addons_register_more_keeps_its_own(monkeypatch):
    from ray.util import serialization_addons

    from relax.core import ray_serializers

    def apply(context):  # a later Ray's, registering one more package
        serialization_addons.register_starlette_serializer(context)
        serialization_addons.register_polars_serializer(context)

    monkeypatch.setattr(serialization_addons, "apply", apply)
    ray_serializers.defer_ray_serializers()
    assert serialization_addons.apply is apply
