"""Command lines for real SGLang / sglang-router, and process hygiene of ManagedProcess (no GPU, no
SGLang needed)."""

import os
import sys
import time

import pytest

from relax.backends.embedded.launcher import build_embedded_command
from relax.wire.net import ManagedProcess, find_free_port, wait_http_ok
from relax.backends.sglang.router import build_router_command
from relax.backends.sglang.server import SGLangServerProcess, build_sglang_command, server_args_to_cli


def test_server_args_to_cli():
    cli = server_args_to_cli(
        {
            "mem_fraction_static": 0.7,
            "disable_radix_cache": True,
            "enable_metrics": False,
            "chunked_prefill_size": None,
            "cuda_graph_bs": [1, 2, 4],
            "json_model_override_args": {"rope_scaling": {"type": "yarn"}},
            "dtype": "bfloat16",
            "empty_list": [],
        }
    )
    assert cli == [
        "--mem-fraction-static", "0.7",
        "--disable-radix-cache",
        "--cuda-graph-bs", "1", "2", "4",
        "--json-model-override-args", '{"rope_scaling": {"type": "yarn"}}',
        "--dtype", "bfloat16",
    ]
    with pytest.raises(ValueError, match="tp_size"):
        server_args_to_cli({"tp_size": 2})


def test_build_sglang_command():
    cmd = build_sglang_command("/m", "0.0.0.0", 30001, 4, {"device": "cpu", "skip_server_warmup": True},
                               python="/usr/bin/python3")
    assert cmd[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert cmd[3:11] == ["--model-path", "/m", "--host", "0.0.0.0", "--port", "30001", "--tp-size", "4"]
    assert cmd[11:] == ["--device", "cpu", "--skip-server-warmup"]
    p = SGLangServerProcess("/m", port=31234, tp_size=2, server_args={"random_seed": 3})
    assert p.url == "http://127.0.0.1:31234" and "--random-seed" in p.cmd and not p.is_alive()


def test_sglang_process_failure_is_reported_with_log(tmp_path):
    # Without SGLang installed (as here) the server exits at once; wait_healthy must say so quickly.
    p = SGLangServerProcess("/nonexistent", server_args={"device": "cpu"}, log_path=str(tmp_path / "s.log"))
    p.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="exited|log tail"):
            p.wait_healthy(timeout_s=60)
        assert time.monotonic() - t0 < 30
    finally:
        p.stop()


def test_build_router_and_embedded_commands():
    cmd = build_router_command("127.0.0.1", 8000, "cache_aware", {"health_check_interval_secs": 5, "dp_aware": True})
    assert cmd[1:3] == ["-m", "sglang_router.launch_router"]
    assert cmd[cmd.index("--policy") + 1] == "cache_aware"
    assert cmd[cmd.index("--log-level") + 1] == "warn"
    assert "--prometheus-port" in cmd and cmd[-3:] == ["--health-check-interval-secs", "5", "--dp-aware"]
    cmd = build_router_command("127.0.0.1", 8000, extra_args=["--log-level", "info", "--prometheus-port", "1"])
    assert cmd.count("--log-level") == 1 and cmd.count("--prometheus-port") == 1
    emb = build_embedded_command("/m", "127.0.0.1", 9, {"random_seed": 1, "update_waits_for_requests": True,
                                                        "offload_weights_on_release": False})
    assert emb[1:3] == ["-m", "relax.backends.embedded.server"]
    assert emb[emb.index("--random-seed") + 1] == "1" and "--update-waits-for-requests" in emb
    assert "--offload-weights-on-release" not in emb and emb[-1] == "--exit-with-parent"


def test_managed_process_stop_kills_grandchildren(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
        "time.sleep(300)\n"
    )
    p = ManagedProcess([sys.executable, "-c", code], name="tree").start()
    try:
        deadline = time.monotonic() + 20
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child = int(pidfile.read_text())
        os.kill(child, 0)  # alive
    finally:
        p.stop(timeout_s=5)
    assert not p.is_alive()
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a killed grandchild is reparented and reaped by init; give it a moment
        assert time.monotonic() < deadline, "grandchild survived stop()"
        time.sleep(0.05)


def test_wait_http_ok_errors():
    port = find_free_port()
    with pytest.raises(TimeoutError):
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=0.5, interval_s=0.1)
    with pytest.raises(RuntimeError, match="exited"):
        wait_http_ok(f"http://127.0.0.1:{port}/health", timeout_s=5, alive=lambda: False)


def test_router_on_a_port_taken_since_it_was_picked_starts_on_another():
    """A port Relax picked itself can be taken by another process before the router binds it (a busy host): the
    router is started again on fresh ports, not the run failed with "Address already in use"."""
    import socket

    from relax.backends.sglang.router import RouterProcess

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        busy = taken.getsockname()[1]
        router = RouterProcess()
        router.port = busy  # as if another process bound the picked port after the probe
        router.cmd = router._wrapped(router._command())
        try:
            router.start(timeout_s=30)
            assert router.port != busy and router.is_alive()
            assert "Address already in use" in router.log_tail()  # the first attempt met the clash
        finally:
            router.stop()
    explicit = RouterProcess(port=busy)  # a port the user chose is never changed behind their back
    assert not explicit._ports_chosen
