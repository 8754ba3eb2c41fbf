"""An engine whose port is taken before its server binds it is started again on another port."""

import socket

from conftest import shared_tiny_model

from relax.backends.embedded.launcher import EmbeddedServerProcess
from relax.roles.engine import start_with_port_retry


def test_a_taken_port_is_retried_with_another(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    ports = [taken.getsockname()[1], None]  # the first server gets a port somebody else holds
    made = []

    def make():
        proc = EmbeddedServerProcess(str(shared_tiny_model()), port=ports[len(made)],
                                     log_path=str(tmp_path / f"engine-{len(made)}.log"))
        made.append(proc)
        return proc

    try:
        proc = start_with_port_retry(make, timeout_s=120)
        try:
            assert len(made) == 2 and proc is made[1] and proc.port != ports[0]
            assert not made[0].is_alive()
            assert "address already in use" in (tmp_path / "engine-0.log").read_text()
        finally:
            proc.stop()
    finally:
        taken.close()
