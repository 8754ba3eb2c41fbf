"""Small networking and process helpers shared by the engine backends.

- `find_free_port(host)`: a TCP port that is free right now (the usual bind-to-0 trick; a
  race with another process is possible, so callers that start servers should retry).
- `wait_http_ok(url, timeout_s)`: poll a URL until it answers 2xx.
- `ManagedProcess`: a child process started in its own session, with its output sent to a log
  file, stopped with SIGTERM then SIGKILL on its whole process group (no orphans), and stopped
  again at interpreter exit as a safety net.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import IO, TYPE_CHECKING, Callable, Mapping, Sequence

if TYPE_CHECKING:
    import requests

# requests and relax.config (redact_command) are imported where they are used: `python -m relax.wire.net
# --watch-parent` starts the router's process, and ~0.3-0.5 s of CPU importing them came before it

logger = logging.getLogger(__name__)


def find_free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on `host` that nobody listens on at the time of the call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def url_host(host: str) -> str:
    """`host` as it must appear in a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def wait_http_ok(
    url: str,
    timeout_s: float = 60.0,
    *,
    interval_s: float = 0.1,
    method: str = "GET",
    alive: Callable[[], bool] | None = None,
    request_timeout_s: float = 5.0,
) -> requests.Response:
    """Poll `url` until it answers with a 2xx status; return that response.

    `alive`, when given, is called between polls; if it returns False (e.g. the server process
    died) the wait stops at once with RuntimeError. Raises TimeoutError after `timeout_s`.
    """
    import requests

    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"gave up waiting for {url}: the process serving it has exited")
        try:
            resp = requests.request(method, url, timeout=min(request_timeout_s, max(0.5, timeout_s)))
            if 200 <= resp.status_code < 300:
                return resp
            last_error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except requests.RequestException as exc:
            last_error = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not answer 2xx within {timeout_s:.1f}s (last: {last_error})")
        time.sleep(interval_s)


_LIVE_PROCESSES: "weakref.WeakSet[ManagedProcess]" = weakref.WeakSet()
_ATEXIT_LOCK = threading.Lock()
_ATEXIT_REGISTERED = False


def _stop_all_at_exit() -> None:
    for proc in list(_LIVE_PROCESSES):
        try:
            proc.stop(timeout_s=5.0)
        except Exception:  # pragma: no cover - best effort at interpreter exit
            pass


class ManagedProcess:
    """A server child process: own process group, log file, clean stop.

    The child runs in a new session (`start_new_session=True`), so `stop()` can signal the
    whole group: any grandchildren a server starts go with it.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        cwd: str | None = None,
        name: str = "process",
    ):
        self.cmd = [str(c) for c in cmd]
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.name = name
        self.log_path = log_path
        self._log_file: IO[bytes] | None = None
        self.proc: subprocess.Popen | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "ManagedProcess":
        global _ATEXIT_REGISTERED
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} already running (pid {self.proc.pid})")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"relax-{self.name}-", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        from relax.config.redact import redact_command

        logger.info("starting %s: %s (log %s)", self.name, " ".join(redact_command(self.cmd)), self.log_path)
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
        )
        with _ATEXIT_LOCK:
            _LIVE_PROCESSES.add(self)
            if not _ATEXIT_REGISTERED:
                atexit.register(_stop_all_at_exit)
                _ATEXIT_REGISTERED = True
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def log_tail(self, max_bytes: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")

    def _signal_group(self, sig: int) -> None:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, sig)  # the child leads its own group (new session)
        except (ProcessLookupError, PermissionError):
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM (and SIGCONT) the process group, wait up to `timeout_s`, then SIGKILL. Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            # A stopped process (SIGSTOP, a debugger) holds SIGTERM pending until it runs again.
            self._signal_group(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %s) ignored SIGTERM; killing it", self.name, self.proc.pid)
                self._signal_group(signal.SIGKILL)
                self.proc.wait(timeout=10.0)
        # Grandchildren may outlive a leader that exited on its own: sweep the group once more.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        _LIVE_PROCESSES.discard(self)
        return self.proc.returncode

    def __enter__(self) -> "ManagedProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def python_executable() -> str:
    """The interpreter running Relax (servers are started with the same one)."""
    return sys.executable


def _die_with_parent() -> None:
    """In a child between fork and exec: ask Linux to send SIGTERM when the parent dies (PR_SET_PDEATHSIG)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)


def with_parent_watchdog(cmd: Sequence[str], parent_pid: int | None = None) -> list[str]:
    """Wrap `cmd` so that it is terminated if `parent_pid` (default: this process) dies.

    For servers that cannot watch their parent themselves (the Rust router, SGLang): if the
    process that started them is killed without running `stop()`, they do not linger.
    """
    ppid = os.getpid() if parent_pid is None else int(parent_pid)
    return [sys.executable, "-m", "relax.wire.net", "--watch-parent", str(ppid), "--", *map(str, cmd)]


def _watchdog_main(argv: Sequence[str]) -> int:
    if len(argv) < 4 or argv[0] != "--watch-parent" or argv[2] != "--":
        print("usage: python -m relax.wire.net --watch-parent PID -- CMD...", file=sys.stderr)
        return 2
    ppid, cmd = int(argv[1]), list(argv[3:])
    # The kernel ends the child if this watchdog itself is killed (SIGKILL leaves it no time to act).
    child = subprocess.Popen(cmd, preexec_fn=_die_with_parent)

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        parent_gone = os.getppid() != ppid
        if not parent_gone:
            try:
                os.kill(ppid, 0)
            except ProcessLookupError:
                parent_gone = True
        if parent_gone:
            child.terminate()
            try:
                return child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                return child.wait()


if __name__ == "__main__":
    sys.exit(_watchdog_main(sys.argv[1:]))
