"""--use-health-check watches the actors that send no heartbeats of their own by probing them
(relax.core.health.ActorProbe): a TransferQueue storage unit that is SIGSTOPped (hung) is named, with its
process state, within --heartbeat-timeout, and one that answers again is no longer silent."""

import os
import signal
import time

import pytest
from conftest import shared_ray

from relax.config import parse_config
from relax.core.deadlines import Call, RoleFailure
from relax.core.health import HealthManager
from relax.core.health_restart import attempt_config
from relax.data.plane import DataPlane


@pytest.fixture
def plane():
    shared_ray()
    dp = DataPlane.start(num_storage_units=1, capacity_samples=16)
    try:
        yield dp
    finally:
        dp.shutdown()


def test_a_stopped_storage_unit_is_named_within_the_timeout(plane, tmp_path):
    config = attempt_config(parse_config(["--output-dir", str(tmp_path), "--use-health-check",
                                          "--heartbeat-interval", "0.2", "--heartbeat-timeout", "2"]), 0, None)
    manager = HealthManager(config)
    try:
        actors = plane.actors()
        assert set(actors) == {"data plane controller", "data plane storage unit 0"}
        manager.watch_actors(actors)
        unit = manager.probes[1]
        deadline = time.monotonic() + 30
        while unit.pid is None and time.monotonic() < deadline:  # its pid, from its first answer
            time.sleep(0.1)
        time.sleep(1.0)
        assert manager.silent() == []  # both answer
        os.kill(unit.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while not manager.silent() and time.monotonic() - stopped < 20:
                time.sleep(0.1)
            detected = time.monotonic() - stopped
            assert 2.0 <= detected < 5.0, detected  # after --heartbeat-timeout, within a few probe periods
            with pytest.raises(RoleFailure) as failure:
                manager.watch([Call("rollout", "generate", step=3)])
            text = str(failure.value)
            assert "data plane storage unit 0" in text and f"process {unit.pid} is stopped (hung)" in text, text
            assert [e["role"] for e in manager.silent()] == ["data plane storage unit 0"]  # the controller answers
        finally:
            os.kill(unit.pid, signal.SIGCONT)
        resumed = time.monotonic()
        while manager.silent() and time.monotonic() - resumed < 10:
            time.sleep(0.1)
        assert manager.silent() == []  # answering again: no longer silent
    finally:
        manager.close()
