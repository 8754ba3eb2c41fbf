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
