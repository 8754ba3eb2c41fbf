"""Nothing of a run outlives it: a server started behind the parent watchdog ends when the process that
started it is SIGKILLed, and also when the watchdog itself is SIGKILLed."""

import pytest
import os
import signal
import subprocess
import sys
import time

import psutil

from relax.wire.net import find_free_port, with_parent_watchdog

pytestmark = pytest.mark.e2e  # a whole run: Ray, trainer, engines (deselect with -m 'not e2e')


def _listening(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
               for c in psutil.net_connections("tcp"))


def _wait(cond, timeout=20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


SERVER = "import http.server, sys; http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), http.server.BaseHTTPRequestHandler).serve_forever()"


def _start_chain(port: int) -> subprocess.Popen:
    """driver -> watchdog -> server, as a Ray actor starts the router."""
    launcher = ("import subprocess, sys, time\n"
                "from relax.wire.net import with_parent_watchdog\n"
                f"p = subprocess.Popen(with_parent_watchdog([sys.executable, '-c', {SERVER!r}, '{port}']), start_new_session=True)\n"
                "print(p.pid, flush=True)\n"
                "time.sleep(600)\n")
    return subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)


def test_server_dies_when_its_starter_is_killed():
    port = find_free_port()
    driver = _start_chain(port)
    watchdog_pid = int(driver.stdout.readline())
    assert _wait(lambda: _listening(port)), "the server did not start"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert _wait(lambda: not _listening(port)), "the server outlived the process that started it"
    assert _wait(lambda: not psutil.pid_exists(watchdog_pid) or psutil.Process(watchdog_pid).status() == "zombie")


def test_server_dies_when_the_watchdog_is_killed():
    port = find_free_port()
    driver = _start_chain(port)
    try:
        watchdog_pid = int(driver.stdout.readline())
        assert _wait(lambda: _listening(port)), "the server did not start"
        os.kill(watchdog_pid, signal.SIGKILL)
        assert _wait(lambda: not _listening(port)), "the server outlived its killed watchdog"
    finally:
        driver.kill()
        driver.wait()
