"""`ray job submit` of a Relax run onto a real two-node Ray cluster started on this machine.

Two `ray start` processes (a head and a second node that joins it with `--address`) each get their own temp
dir, ports and a custom resource naming the node, so they clash neither with the in-process cluster of the
test session (tests/conftest.py) nor with other Ray clusters on the machine. `ray stop` is never called: it
stops every Ray process of the machine. Both nodes run with `--block` instead, and stopping that process stops
its node (Ray's SIGTERM handler kills the node's processes); whatever still mentions our temp dir is killed
after that.

Placement is forced across the nodes by CPU: each node has fewer CPUs than the embedded default's roles need
together (trainer, reference, engine, rollout manager, TransferQueue controller and storage), so neither node
can hold them all, and the test checks where Ray put each role's actor (state API, node ids) and that both
nodes host one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import requests
from test_console import assert_console_clean, first_run_noise

# The cluster tests are whole runs (Ray, trainer, engines): marked e2e one by one (deselect with -m 'not e2e');
# the script's own argument handling below is a unit test.

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RAY = str(BIN / "ray")
SUBMIT = ROOT / "scripts" / "submit-job.sh"
# CPUs per node. The embedded default needs 5 (see ROLE_CLASSES, and TransferQueue's controller and storage unit;
# its reference runs inside the trainer's process on CPU); with 4 on each node neither node can hold every role,
# so Ray must use both. The test checks this premise from the actors' real resource requests.
NODE_CPUS = 4
ROLE_CLASSES = ("TrainerWorker", "EngineActor", "RolloutManager")
# Processes of a run that must not outlive it: Ray workers of Relax's roles and TransferQueue, the engine
# servers and the router.
RUN_PROCESS_MARKERS = ("ray::TrainerWorker", "ray::ReferenceWorker", "ray::EngineActor", "ray::RolloutManager",
                       "ray::TransferQueue", "ray::SimpleStorageUnit", "relax.backends.embedded.server",
                       "sglang_router", "sglang::router", "relax.entrypoints.train", "relax-train")


def _free_port() -> int:
    from relax.wire.net import find_free_port

    return find_free_port("127.0.0.1")


def _clean_env() -> dict[str, str]:
    """This interpreter's environment without the test session's Ray settings, with the venv first on PATH
    (the job's entrypoint `relax-train` is found there, as on a cluster node with Relax installed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    # Ray >= 2.5x turns token authentication on for new clusters; ours has its own token, given to its
    # nodes (hence to the job's driver and workers) and to every CLI call, as on a real cluster.
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return env


class TwoNodeCluster:
    """A head node and a second node on this host, each a `ray start --block` child with its own temp dir."""

    def __init__(self, node_cpus: int = NODE_CPUS):
        # Ray puts a Unix socket path under the temp dir; keep it short (107-byte limit).
        self.tmp = Path(tempfile.mkdtemp(prefix="rjs-", dir="/tmp"))
        self.node_cpus = node_cpus
        self.gcs_port = _free_port()
        self.dashboard_port = _free_port()
        self.procs: list[subprocess.Popen] = []
        self.env = _clean_env()

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def _node_ports(self) -> list[str]:
        ports = {"--node-manager-port": _free_port(), "--object-manager-port": _free_port(),
                 "--dashboard-agent-listen-port": _free_port(), "--dashboard-agent-grpc-port": _free_port(),
                 "--runtime-env-agent-port": _free_port(), "--metrics-export-port": _free_port()}
        return [f"{k}={v}" for k, v in ports.items()]

    def _start(self, name: str, args: list[str]) -> None:
        temp = self.tmp / name
        temp.mkdir()
        log = open(self.tmp / f"{name}.out", "wb")
        cmd = [RAY, "start", "--block", f"--temp-dir={temp}", f"--num-cpus={self.node_cpus}", "--num-gpus=0",
               "--disable-usage-stats", f"--object-store-memory={300 << 20}", f"--resources={json.dumps({name: 1})}",
               *self._node_ports(), *args]
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp,
                                           start_new_session=True))

    def start(self, timeout_s: float = 180.0) -> "TwoNodeCluster":
        self._start("head_node", ["--head", f"--port={self.gcs_port}", "--include-dashboard=true",
                                  "--dashboard-host=127.0.0.1", f"--dashboard-port={self.dashboard_port}",
                                  f"--ray-client-server-port={_free_port()}"])
        self._wait(lambda: len(self.nodes()) == 1, timeout_s, "the head node")
        # Join at the address the head registered (the host's own, as a second machine would).
        head_ip = self.state("nodes")[0]["node_ip"]
        self._start("second_node", [f"--address={head_ip}:{self.gcs_port}"])
        self._wait(lambda: len(self.nodes()) == 2, timeout_s, "the second node")
        return self

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"`ray start` exited with {proc.returncode}: {self.console()[-3000:]}")
            try:
                if ready():
                    return
            except Exception:  # the dashboard is not up yet
                pass
            time.sleep(1.0)
        raise AssertionError(f"{what} did not join within {timeout_s:.0f}s: {self.console()[-3000:]}")

    def console(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.tmp.glob("*.out")))

    def nodes(self) -> dict[str, str]:
        """Alive node id -> our node name (the custom resource each node was started with)."""
        rows = self.state("nodes", state="ALIVE")
        out = {}
        for row in rows:
            names = [r for r in (row.get("resources_total") or {}) if r in ("head_node", "second_node")]
            if names:
                out[row["node_id"]] = names[0]
        return out

    def state(self, kind: str, **filters: str) -> list[dict]:
        """Rows of Ray's state API (`ray list KIND --detail`), over HTTP with the cluster's token: quick enough
        to poll (the CLI takes seconds to import on a busy machine), and apart from this process's own Ray."""
        params: dict = {"limit": 10000, "detail": "true", "filter_keys": [], "filter_predicates": [],
                        "filter_values": []}
        for key, value in filters.items():
            params["filter_keys"].append(key)
            params["filter_predicates"].append("=")
            params["filter_values"].append(value)
        resp = requests.get(f"{self.dashboard}/api/v0/{kind}", params=params, timeout=30,
                            headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        resp.raise_for_status()
        return resp.json()["data"]["result"]["result"]

    def job(self, submission_id: str) -> dict:
        """The job's details (status, message, the driver's Ray job id)."""
        resp = requests.get(f"{self.dashboard}/api/jobs/{submission_id}", timeout=30,
                            headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        resp.raise_for_status()
        return resp.json()

    def processes(self) -> list[psutil.Process]:
        """Every process below our two `ray start` processes (Ray's own, the job drivers, roles, engines)."""
        found = []
        for proc in self.procs:
            try:
                found += psutil.Process(proc.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self) -> None:
        # The second node first, then the head; SIGTERM makes `ray start --block` kill its node's processes.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
        # Anything that still names our temp dir (a worker that missed its raylet's end) goes too.
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(self.tmp) in part for part in (p.info["cmdline"] or [])):
                    p.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    try:  # what `ray job submit` and the dashboard need beyond a plain `pip install ray`
        import ray.dashboard.optional_deps  # noqa: F401
    except ImportError as exc:
        pytest.fail(f"Ray's job server needs ray[default] ({exc}); install it with pip install 'ray[default]'")
    cl = TwoNodeCluster()
    try:
        yield cl.start()
    finally:
        cl.stop()


def _submit(cluster: TwoNodeCluster, job_id: str, out: Path, *flags: str, wait: bool) -> subprocess.CompletedProcess:
    env = {**cluster.env, "RAY_ADDRESS": cluster.dashboard, "RELAX_JOB_ID": job_id}
    if not wait:
        env["RELAX_NO_WAIT"] = "1"
    return subprocess.run(["bash", str(SUBMIT), "--output-dir", str(out), *flags], capture_output=True, text=True,
                          env=env, timeout=600, cwd=str(ROOT))


def _job_info(cluster: TwoNodeCluster, job_id: str) -> dict:
    return cluster.job(job_id)


def _job_logs(cluster: TwoNodeCluster, job_id: str) -> str:
    proc = subprocess.run([RAY, "job", "logs", f"--address={cluster.dashboard}", job_id], capture_output=True,
                          text=True, env=cluster.env, timeout=60)
    return proc.stdout + proc.stderr


def _cpus(required: dict) -> float:
    """CPUs an actor holds: plain `CPU`, or inside a placement group its bundle's `CPU_group_<index>_<pg>`."""
    if "CPU" in required:
        return float(required["CPU"])
    return sum(float(v) for k, v in required.items() if re.match(r"CPU_group_\d+_", k))


def _run_markers(p: psutil.Process) -> str | None:
    try:
        text = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    return next((m for m in RUN_PROCESS_MARKERS if m in text), None)


@pytest.mark.e2e
def test_submitted_run_spans_both_nodes_and_succeeds(cluster, tmp_path):
    out = tmp_path / "run"
    started = time.monotonic()
    proc = _submit(cluster, "relax-two-nodes", out, "--num-rollout", "1", wait=True)
    took = time.monotonic() - started
    info = _job_info(cluster, "relax-two-nodes")
    assert proc.returncode == 0 and info["status"] == "SUCCEEDED", (
        f"job {info['status']} ({info.get('message')}); submit said: {proc.stdout[-3000:]}{proc.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "step" in r] == [0]
    # The driver's console holds Relax's lines only, the libraries' output is in relax.log. The driver's console
    # is the job's log after the job supervisor's own lines (Ray's: runtime env set-up, the entrypoint it runs).
    logs = _job_logs(cluster, "relax-two-nodes")
    marker = "Running entrypoint for job relax-two-nodes: "
    assert marker in logs, logs[-3000:]
    driver_console = logs.split(marker, 1)[1].partition("\n")[2]
    assert_console_clean(driver_console, (out / "logs" / "relax.log").read_text())
    assert not first_run_noise(driver_console), driver_console[-3000:]  # no warning of its own making, no dict

    actors = cluster.state("actors", job_id=info["job_id"])
    nodes = cluster.nodes()
    placed: dict[str, set[str]] = {}
    cpus_asked = 0.0
    for actor in actors:
        placed.setdefault(actor["class_name"], set()).add(nodes.get(actor["node_id"], actor["node_id"]))
        cpus_asked += _cpus(actor.get("required_resources") or {})
    # The premise of the placement check: the run's actors together need more CPUs than one node has.
    asked = {a["class_name"]: a.get("required_resources") for a in actors}
    assert cpus_asked > NODE_CPUS, f"the run asked for {cpus_asked} CPUs; raise it above NODE_CPUS: {asked}"
    missing = [c for c in ROLE_CLASSES if c not in placed]
    assert not missing, f"no actor of {missing} in the job's actors {sorted(placed)}"
    used = set().union(*placed.values())
    assert used == {"head_node", "second_node"}, f"actors by node: {placed}"
    roles_by_node = {n: sorted(c for c in ROLE_CLASSES if n in placed[c]) for n in used}
    assert all(roles_by_node.values()), f"a node hosts no Relax role: {roles_by_node}"
    print(f"two-node submit of 1 step: {took:.1f}s; roles by node {roles_by_node}")


@pytest.mark.e2e
def test_ray_job_stop_ends_every_actor_and_engine(cluster, tmp_path):
    out = tmp_path / "run"
    job_id = "relax-stop"
    proc = _submit(cluster, job_id, out, "--num-rollout", "1000", wait=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        info = _job_info(cluster, job_id)
        assert info["status"] in ("PENDING", "RUNNING"), f"{info['status']}: {_job_logs(cluster, job_id)[-3000:]}"
        assert time.monotonic() < deadline, "no step within 300 s"
        time.sleep(1.0)
    running = {p.pid: (p, m) for p in cluster.processes() if (m := _run_markers(p))}
    kinds = {m for _, m in running.values()}
    assert {"relax-train", "ray::TrainerWorker", "ray::EngineActor", "relax.backends.embedded.server",
            "sglang_router"} <= kinds, kinds
    # Roles span nodes, so the engine listens on its node's address, not loopback (relax/roles/engine.py);
    # the step above went through it, so the router and the trainer's weight push reached it there.
    node_ips = {row["node_ip"] for row in cluster.state("nodes")}
    for p, marker in running.values():
        if marker == "relax.backends.embedded.server":
            cmd = p.cmdline()
            assert cmd[cmd.index("--host") + 1] in node_ips - {"127.0.0.1"}, (cmd, node_ips)

    stop_sent = time.monotonic()
    stopped = subprocess.run([RAY, "job", "stop", f"--address={cluster.dashboard}", job_id], capture_output=True,
                             text=True, env=cluster.env, timeout=120)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    deadline = time.monotonic() + 60
    while _job_info(cluster, job_id)["status"] != "STOPPED":
        assert time.monotonic() < deadline, _job_info(cluster, job_id)["status"]
        time.sleep(0.5)

    info = _job_info(cluster, job_id)
    deadline = time.monotonic() + 60
    while True:
        left = []
        for p, marker in running.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append((p.pid, marker))
            except psutil.NoSuchProcess:
                pass
        alive = [a["class_name"] for a in cluster.state("actors", job_id=info["job_id"], state="ALIVE")]
        if (not left and not alive) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert not left, f"processes of the stopped job still running: {left}"
    assert not alive, f"actors of the stopped job still alive: {alive}"
    # The driver had time to shut the run down itself (scripts/submit-job.sh sets RAY_JOB_STOP_WAIT_TIME_S):
    # Relax's SIGTERM handler ran, rather than Ray's SIGKILL after its default 3 s.
    log = (out / "logs" / "relax.log").read_text()
    assert "interrupted by SIGTERM; shutting down" in log, log[-2000:]
    print(f"ray job stop: everything gone {time.monotonic() - stop_sent:.1f}s after the stop")


def test_submit_script_builds_the_ray_job_submit_command(tmp_path):
    """The script's command line, printed one argument a line instead of run (RAY_BIN): relax-train's flags pass
    through as given, the job gets its id, working dir and stop grace period; a relative --output-dir, or none,
    is refused before Ray is asked anything."""
    fake_ray = tmp_path / "ray"
    fake_ray.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake_ray.chmod(0o755)
    env = {**_clean_env(), "RAY_BIN": str(fake_ray), "RAY_ADDRESS": "http://head:8265", "RELAX_JOB_ID": "j1",
           "RELAX_STOP_WAIT_S": "45"}
    proc = subprocess.run(["bash", str(SUBMIT), "--output-dir", "/shared/run", "--num-rollout", "2",
                           "--custom-config-path", "a b.yaml"], capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "job", "submit", "--address", "http://head:8265", "--submission-id", "j1", "--runtime-env-json",
        '{"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "45"}}', "--working-dir", str(ROOT), "--", "relax-train",
        "--output-dir", "/shared/run", "--num-rollout", "2", "--custom-config-path", "a b.yaml"]
    env.update(RELAX_WORKING_DIR="none", RELAX_NO_WAIT="1", RELAX_TRAIN="python -m relax.entrypoints.train")
    proc = subprocess.run(["bash", str(SUBMIT), "--output-dir=/shared/run"], capture_output=True, text=True,
                          env=env, timeout=30)
    assert proc.returncode == 0 and "--working-dir" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[-6:] == ["--no-wait", "--", "python", "-m", "relax.entrypoints.train",
                                             "--output-dir=/shared/run"]
    for bad in (["--output-dir", "runs/demo"], ["--num-rollout", "2"]):
        proc = subprocess.run(["bash", str(SUBMIT), *bad], capture_output=True, text=True, env=env, timeout=30)
        assert proc.returncode == 2 and "--output-dir" in proc.stderr and not proc.stdout, proc.stdout + proc.stderr
