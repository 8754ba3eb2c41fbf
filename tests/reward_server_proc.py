"""A reward server for the tests of the reward server's watch (tests/test_reward_server_health*.py): a process of its
own, so that a test (or Relax's test-only fault injection) can SIGSTOP or SIGKILL it.

`python reward_server_proc.py PORT_FILE HITS_FILE`: listens on 127.0.0.1 (a free port, written to PORT_FILE once it
serves); POST /score answers {"reward": 1.0} when the response ends with the label, else {"reward": 0.25} (never
0.0, the score of a failed reward), and appends one line per answered request to HITS_FILE; GET /health answers 200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

OK, OTHER = 1.0, 0.25


class _Handler(BaseHTTPRequestHandler):
    hits_path = ""

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply(200 if self.path == "/health" else 404, {"ok": self.path == "/health"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        label = str(body.get("label", "")).strip()
        reward = OK if label and str(body.get("response", "")).strip().endswith(label) else OTHER
        with open(self.hits_path, "a") as f:
            f.write(json.dumps({"t": time.time(), "reward": reward}) + "\n")
        self._reply(200, {"reward": reward})


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # requests sent while it is stopped wait in the kernel's queue, none refused
    daemon_threads = True

    def handle_error(self, request, client_address):  # a reply to a client that gave up (a held request): quiet
        pass


def start(folder: Path) -> tuple[subprocess.Popen, str, Path]:
    """Start the server in a process of its own; (process, its /score URL, its hits file)."""
    port_file, hits = folder / "reward_port", folder / "reward_hits.jsonl"
    proc = subprocess.Popen([sys.executable, __file__, str(port_file), str(hits)])
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the test reward server did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text().strip()}/score", hits


def main() -> None:
    port_file, hits = sys.argv[1], sys.argv[2]
    _Handler.hits_path = hits
    server = _Server(("127.0.0.1", 0), _Handler)
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(tmp, port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
