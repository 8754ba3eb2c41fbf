"""Launch a real SGLang server (`python -m sglang.launch_server`) as a child process.

`server_args` holds SGLang `ServerArgs` fields by their Python names (e.g. `{"mem_fraction_static":
0.7, "disable_radix_cache": True, "cuda_graph_bs": [1, 2, 4]}`); each becomes `--field-name`:
True -> bare flag, False/None -> omitted, list/tuple -> the flag followed by each item, dict ->
a JSON string, anything else -> `str(value)`. `model_path`, `host`, `port` and `tp_size` are
given separately and may not appear in `server_args`.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Mapping

from relax.backends.net import ManagedProcess, find_free_port, url_host, wait_http_ok, with_parent_watchdog

_RESERVED = {"model_path", "host", "port", "tp_size", "tp"}


def server_args_to_cli(server_args: Mapping[str, Any]) -> list[str]:
    out: list[str] = []
    for key, val in server_args.items():
        if key in _RESERVED:
            raise ValueError(f"{key!r} is set by SGLangServerProcess itself; do not pass it in server_args")
        flag = "--" + key.replace("_", "-")
        if val is None or val is False:
            continue
        if val is True:
            out.append(flag)
        elif isinstance(val, (list, tuple)):
            if not val:
                continue
            out.append(flag)
            out.extend(json.dumps(v) if isinstance(v, dict) else str(v) for v in val)
        elif isinstance(val, dict):
            out += [flag, json.dumps(val)]
        else:
            out += [flag, str(val)]
    return out


def build_sglang_command(
    model_path: str,
    host: str,
    port: int,
    tp_size: int = 1,
    server_args: Mapping[str, Any] | None = None,
    *,
    python: str | None = None,
) -> list[str]:
    cmd = [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model_path),
        "--host", host,
        "--port", str(int(port)),
        "--tp-size", str(int(tp_size)),
    ]
    return cmd + server_args_to_cli(server_args or {})


class SGLangServerProcess(ManagedProcess):
    """A real SGLang server in its own process group (stopped with its scheduler children)."""

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int | None = None,
        tp_size: int = 1,
        server_args: Mapping[str, Any] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        log_path: str | None = None,
        python: str | None = None,
        exit_with_parent: bool = True,
    ):
        self.model_path = str(model_path)
        self.host = host
        self.port = int(port) if port else find_free_port(host)
        self.tp_size = int(tp_size)
        self.server_args = dict(server_args or {})
        cmd = build_sglang_command(self.model_path, host, self.port, self.tp_size, self.server_args, python=python)
        super().__init__(
            with_parent_watchdog(cmd) if exit_with_parent else cmd,
            env=env,
            log_path=log_path,
            name=f"sglang-{self.port}",
        )

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def wait_healthy(self, timeout_s: float = 600.0) -> "SGLangServerProcess":
        """Wait for /health_generate (SGLang answers 200 once a generation went through)."""
        try:
            wait_http_ok(self.url + "/health_generate", timeout_s, interval_s=1.0, alive=self.is_alive,
                         request_timeout_s=30.0)
        except (TimeoutError, RuntimeError) as exc:
            raise RuntimeError(f"{exc}\n--- server log tail ---\n{self.log_tail()}") from None
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return super().stop(timeout_s=timeout_s)
