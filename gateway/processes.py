"""Child server processes (for `pd-gateway demo`, the tests and the benchmarks): start on port 0, read the bound
port back, wait on /health, stop by PID (`stop_process`, the one way this repo stops a child).

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
STOP_TIMEOUT_S = 10.0


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop one child by its PID: `sig` (SIGTERM: a clean shutdown), SIGKILL if it is still there after
    `timeout_s`, and reap it, so its port is free when this returns. A child already gone is left alone."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout_s)


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log_path: Path
    args: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_process(self.proc, sig)


def start(args: list[str], *, health: str = "/health", env: dict[str, str] | None = None,
          port: int = 0, log_dir: Path | None = None, name: str | None = None, own_session: bool = False,
          host: str = "127.0.0.1") -> Server:
    """Run `pd-gateway ARGS --host HOST --port PORT --port-file F` and wait until it answers `health` (HOST: another
    loopback address, 127.0.0.2 say, for engines that must share a port, as pods behind one DNS name do).
    Its output goes to `log_dir/NAME.log` (default: a fresh temporary folder, `log`). `own_session`: the child
    gets its own session, so a terminal's Ctrl-C (SIGINT to the foreground process group) reaches only this
    process, which then stops the child itself (`pd-gateway demo`)."""
    tmp = log_dir or Path(tempfile.mkdtemp(prefix="pdgw-test-"))
    port_file, log_path = (tmp / f"{name}.port", tmp / f"{name}.log") if name else (tmp / "port", tmp / "log")
    cmd = [sys.executable, "-m", "gateway", *args, "--host", host, "--port", str(port),
           "--port-file", str(port_file)]
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=own_session)
    deadline = time.monotonic() + START_TIMEOUT_S
    server = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{args[0]} exited {proc.returncode}:\n{log_path.read_text()}")
            if server is None and port_file.exists() and port_file.read_text().strip():
                server = Server(proc, int(port_file.read_text()), log_path, args, host)
            if server is not None and answers(server.url + health):
                return server
            time.sleep(0.05)
        raise TimeoutError(f"{args[0]} not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()}")
    except BaseException:
        stop_process(proc, signal.SIGKILL)
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
