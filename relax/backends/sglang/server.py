"""Launch a real SGLang server (`python -m sglang.launch_server`) as a child process.

`server_args` holds SGLang `ServerArgs` fields by their Python names (e.g. `{"mem_fraction_static":
0.7, "disable_radix_cache": True, "cuda_graph_bs": [1, 2, 4]}`); each becomes `--field-name`:
True -> bare flag, False/None -> omitted, list/tuple -> the flag followed by each item, dict ->
a JSON string, anything else -> `str(value)`. `model_path`, `host`, `port` and `tp_size` are
given separately and may not appear in `server_args`.

Which Python runs SGLang: the `python=` argument, else the environment variable
`RELAX_SGLANG_PYTHON` (e.g. `.venv-sglang/bin/python`, a separate venv holding real SGLang, see
docs/sglang-cpu.md), else this interpreter.

CPU: when `server_args["device"]` is "cpu", or no device is given and this process sees no CUDA
device, the server is started for CPU (`cpu_server_args`): `--device cpu`, `--dtype float32` (half
precision on CPU is slower and not exact), a bounded `--max-total-tokens` (SGLang's default reserves
gigabytes of KV cache), and the import stubs of `relax/backends/sglang/cpu_shims` on the child's
PYTHONPATH (stand-ins for triton, torchvision, vllm._custom_ops and IPython: imported by SGLang,
absent or unusable on a CPU install). Values given in `server_args` always win.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

from relax.wire.auth import ensure_engine_api_key
from relax.wire.net import ManagedProcess, find_free_port, url_host, wait_http_ok, with_parent_watchdog

_RESERVED = {"model_path", "host", "port", "tp_size", "tp", "api_key"}

SGLANG_PYTHON_ENV = "RELAX_SGLANG_PYTHON"
CPU_SHIMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_shims")
CPU_DEFAULTS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "max_total_tokens": 16384}
# SGLang's LoRA backend on CPU: the others (triton, csgmv, triton_v2, uno_cublas, ascend) launch GPU kernels
CPU_LORA_BACKEND = "torch_native"
NO_PIN_MEMORY_ENV = "RELAX_SGLANG_NO_PIN_MEMORY"
BIND_FAILED = "address already in use"  # uvicorn's error when the server's port is taken


def sglang_python(python: str | None = None) -> str:
    """The interpreter that runs SGLang: `python`, else $RELAX_SGLANG_PYTHON, else this one."""
    return python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def wants_cpu(server_args: Mapping[str, Any] | None) -> bool:
    """True when the server should run on CPU: `device` says so, or none is given and there is no CUDA."""
    device = (server_args or {}).get("device")
    if device is not None:
        return str(device) == "cpu"
    return not _cuda_available()


def cpu_server_args(server_args: Mapping[str, Any] | None) -> dict[str, Any]:
    """`server_args` with the CPU defaults filled in (given values win)."""
    out = dict(CPU_DEFAULTS)
    out.update(server_args or {})
    if out.get("enable_lora") and not out.get("lora_backend"):
        out["lora_backend"] = CPU_LORA_BACKEND
    return out


def cpu_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """`env` for a CPU SGLang child: the shims first on PYTHONPATH, SGLang's CPU-engine path off,
    one OpenMP thread unless OMP_NUM_THREADS is set.

    `SGLANG_USE_CPU_ENGINE=1` selects SGLang's sgl-kernel CPU engine, which a plain pip install
    lacks; with it off SGLang runs torch-native attention on the CPU device.
    """
    out = dict(env or {})
    path = out.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    parts = [p for p in path.split(os.pathsep) if p and p != CPU_SHIMS_DIR]
    out["PYTHONPATH"] = os.pathsep.join([CPU_SHIMS_DIR, *parts])
    out.setdefault("SGLANG_USE_CPU_ENGINE", "0")
    if "OMP_NUM_THREADS" not in out and "OMP_NUM_THREADS" not in os.environ:
        # One intra-op thread (as Ray gives a 1-CPU actor): on a small, shared machine more threads
        # spin against the trainer and the other engines (measured 154 vs 4700 tok/s, batch 64).
        out["OMP_NUM_THREADS"] = "1"
    return out


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
        self.on_cpu = wants_cpu(server_args)
        self.server_args = cpu_server_args(server_args) if self.on_cpu else dict(server_args or {})
        if self.on_cpu:
            env = cpu_env(env)
            if self.server_args.get("enable_lora"):  # cpu_shims/sitecustomize.py: SGLang's LoRA pins memory
                env.setdefault(NO_PIN_MEMORY_ENV, "1")
        self.python = sglang_python(python)
        cmd = build_sglang_command(self.model_path, host, self.port, self.tp_size, self.server_args, python=self.python)
        # SGLang takes its key only as --api-key; it then requires it on every endpoint but /health*.
        cmd += [f"--api-key={ensure_engine_api_key()}"]  # one token: safe whatever the key's first character
        super().__init__(
            with_parent_watchdog(cmd) if exit_with_parent else cmd,
            env=env,
            log_path=log_path,
            name=f"sglang-{self.port}",
        )
        self._log_start = 0  # where the output of the latest start begins in the log (`start`)

    @property
    def url(self) -> str:
        return f"http://{url_host(self.host)}:{self.port}"

    def start(self) -> "SGLangServerProcess":
        # Where this start's output begins in its log (appended to by every start of an engine): the bind error
        # of an earlier start must not count against this one.
        self._log_start = os.path.getsize(self.log_path) if self.log_path and os.path.exists(self.log_path) else 0
        super().start()
        return self

    def bind_failed(self) -> bool:
        """The port was taken between `find_free_port` and SGLang's bind (another process's socket, even an
        outgoing connection's, may get it): uvicorn logs `[Errno 98] ... address already in use`, and SGLang
        0.5.23 then hangs in its shutdown instead of exiting."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return BIND_FAILED in f.read().decode("utf-8", errors="replace").lower()

    def wait_healthy(self, timeout_s: float = 600.0) -> "SGLangServerProcess":
        """Wait for /health_generate (SGLang answers 200 once a generation went through). A failed bind ends the
        wait at once (naming it, so that the caller can start a server on another port)."""
        bind_failed = False

        def alive() -> bool:
            nonlocal bind_failed
            bind_failed = self.bind_failed()
            return self.is_alive() and not bind_failed

        try:
            wait_http_ok(self.url + "/health_generate", timeout_s, interval_s=1.0, alive=alive,
                         request_timeout_s=30.0)
        except (TimeoutError, RuntimeError) as exc:
            why = (f"SGLang could not bind port {self.port}: {BIND_FAILED} (it does not exit then)"
                   if bind_failed else str(exc))
            raise RuntimeError(f"{why}\n--- server log tail ---\n{self.log_tail()}") from None
        return self

    def stop(self, timeout_s: float = 30.0) -> int | None:
        return super().stop(timeout_s=timeout_s)
