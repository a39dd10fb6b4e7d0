"""Child server processes (for `pd-gateway demo` and the tests): start on port 0, read the bound port back,
wait on /health, stop by PID.

Every server command of this repo (`pd-gateway serve`, `pd-gateway sim`) accepts `--port 0 --port-file F`
and writes the port it bound to F once it listens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT_S = 60.0


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start(args: list[str], *, health: str = "/health", env: dict[str, str] | None = None,
          port: int = 0) -> Server:
    """Run `pd-gateway ARGS --host 127.0.0.1 --port PORT --port-file F` and wait until it answers `health`."""
    tmp = Path(tempfile.mkdtemp(prefix="pdgw-test-"))
    port_file, log_path = tmp / "port", tmp / "log"
    cmd = [sys.executable, "-m", "gateway", *args, "--host", "127.0.0.1", "--port", str(port),
           "--port-file", str(port_file)]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + START_TIMEOUT_S
    server = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {proc.returncode}:\n{log_path.read_text()}")
            if server is None and port_file.exists() and port_file.read_text().strip():
                server = Server(proc, int(port_file.read_text()), log_path, args)
            if server is not None and answers(server.url + health):
                return server
            time.sleep(0.05)
        raise TimeoutError(f"{args[0]} not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()}")
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def answers(url: str) -> bool:
    """True when `url` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return resp.status == 200
    except OSError:
        return False


def free_port() -> int:
    """For servers that cannot report a port-0 bind (redis-server): the small race is acceptable there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
