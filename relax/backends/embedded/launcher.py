"""Start / stop the embedded engine server as a child process (same interface as
`relax.backends.sglang.server.SGLangServerProcess`)."""

from __future__ import annotations

from typing import Any, Mapping

from relax.wire.auth import ENGINE_API_KEY_ENV, ensure_engine_api_key
from relax.wire.net import ManagedProcess, find_free_port, python_executable, url_host, wait_http_ok


def build_embedded_command(
    model_path: str,
    host: str,
    port: int,
    server_args: Mapping[str, Any] | None = None,
    *,
    exit_with_parent: bool = True,
) -> list[str]:
    cmd = [
        python_executable(), "-m", "relax.backends.embedded.server",
        "--model-path", str(model_path), "--host", host, "--port", str(port),
    ]
    for key, val in (server_args or {}).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(val, bool):
            if val:
                cmd.append(flag)
        elif val is not None:
            cmd += [flag, str(val)]
    if exit_with_parent:
        cmd.append("--exit-with-parent")
    return cmd


class EmbeddedServerProcess(ManagedProcess):
    """`python -m relax.backends.embedded.server` in a child process.

    server_args: the server's CLI options as a dict, e.g. `{"random_seed": 0, "dtype": "float32",
    "max_running_requests": 64}` (True booleans become flags).
    """

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        server_args: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
    ):
        self.model_path = str(model_path)
        self.host = host
        self.port = int(port) if port else find_free_port(host)
        self.server_args = dict(server_args or {})
        env = dict(env or {})
        # The control endpoints' key travels in the environment, not on the command line (see relax.wire.auth).
        env.setdefault(ENGINE_API_KEY_ENV, ensure_engine_api_key())
        env.setdefault("OMP_NUM_THREADS", str(self.server_args.get("num_threads", 1)))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        super().__init__(
            build_embedded_command(self.model_path, host, self.port, self.server_args),
            env=env,
            log_path=log_path,
            name=f"embedded-{self.port}",
        )

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def wait_healthy(self, timeout_s: float = 120.0) -> "EmbeddedServerProcess":
        try:
            wait_http_ok(self.url + "/health", timeout_s, alive=self.is_alive)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n--- server log tail ---\n{self.log_tail()}") from None
        return self
