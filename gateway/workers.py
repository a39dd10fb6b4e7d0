"""`pd-gateway serve --workers N`: N gateway processes on one port, each with its own event loop, sharing the
conversation store (Redis).

One process relays what one core can (issue 40); the state a turn needs is already in the store, so more
processes on a host are more replicas. Each worker binds the ports with SO_REUSEPORT and the kernel spreads new
connections over them; this process holds the ports bound (not listening, so it is never given a connection)
while workers come and go, starts them fresh (spawn: no event loop, lock or thread crosses a fork), restarts one
that dies, forwards SIGHUP (each reloads) and stops them all on SIGTERM or Ctrl-C. Metrics are summed over the
workers by prometheus_client's multiprocess mode in a folder made here (telemetry.Metrics.render).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from prometheus_client.multiprocess import mark_process_dead

from gateway.serving import bind
from gateway.telemetry import MULTIPROCESS_DIR, WORKER_ENV

log = logging.getLogger("gateway.workers")

STOP_GRACE_S = 30.0             # turns in flight finish (uvicorn's graceful shutdown, then each model's stop)
RESTART_PAUSE_S = 1.0


@dataclass(frozen=True)
class Ports:
    api: int
    metrics: int | None


# target(argv, ports, ready): parse the same flags, build the app, serve on `ports` with SO_REUSEPORT, and send
# `ready` the port once the app serves (gateway/cli.py `serve_worker`); its index is in its environment (WORKER_ENV)
Target = Callable[[list[str], Ports, Connection], None]


def run(target: Target, argv: list[str], count: int, host: str, ports: Ports,
        started: Callable[[int], None] | None = None) -> None:
    """Serve with `count` workers until a stop signal; `started(port)` once every worker serves.
    Raises SystemExit with one line when a worker fails at start-up."""
    held = [bind(host, ports.api, reuse_port=True)]
    if ports.metrics:
        held.append(bind(host, ports.metrics, reuse_port=True))
    bound = Ports(held[0].getsockname()[1], held[1].getsockname()[1] if ports.metrics else None)
    with tempfile.TemporaryDirectory(prefix="pdgw-metrics-") as folder:
        os.environ[MULTIPROCESS_DIR] = folder          # inherited by the workers, read at their imports
        try:
            Supervisor(target, argv, count, bound, folder).run(started)
        finally:
            for sock in held:
                sock.close()


class Supervisor:
    def __init__(self, target: Target, argv: list[str], count: int, ports: Ports, folder: str) -> None:
        self._target, self._argv, self._ports, self._folder = target, argv, ports, folder
        self._context = multiprocessing.get_context("spawn")
        self._workers: list[BaseProcess | None] = [None] * count
        self._signals: list[int] = []

    def run(self, started: Callable[[int], None] | None) -> None:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            ready = [self._start(i) for i in range(len(self._workers))]
            self._await_ready(ready)
            if self._stopping():
                return
            log.warning("%d workers serve port %d", len(self._workers), self._ports.api)
            if started:
                started(self._ports.api)
            self._watch()
        finally:
            self._stop_all()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signals.append(signum)

    def _start(self, index: int) -> Connection:
        receive, send = self._context.Pipe(duplex=False)
        os.environ[WORKER_ENV] = str(index)
        process = self._context.Process(target=self._target, args=(self._argv, self._ports, send),
                                        name=f"pd-gateway worker {index}", daemon=False)
        process.start()
        send.close()
        self._workers[index] = process
        return receive

    def _await_ready(self, ready: list[Connection]) -> None:
        waiting = {conn: i for i, conn in enumerate(ready)}
        while waiting and not self._stopping():
            for conn in wait(list(waiting), timeout=0.5):
                index = waiting.pop(conn)           # the port, or end of file: the worker exited at start-up
                try:
                    conn.recv()
                except EOFError:
                    process = self._workers[index]
                    if process is not None:
                        process.join(5)             # its pipe closed as it died: its exit code follows
                    code = process.exitcode if process else None
                    raise SystemExit(f"pd-gateway serve: worker {index} failed at start-up (exit code {code}; "
                                     "its log is above)") from None

    def _watch(self) -> None:
        while not self._stopping():
            sentinels = {p.sentinel: i for i, p in enumerate(self._workers) if p is not None}
            for sentinel in wait(list(sentinels), timeout=0.5):
                self._replace(sentinels[sentinel])
            if signal.SIGHUP in self._signals:
                self._signals.remove(signal.SIGHUP)
                self._signal_all(signal.SIGHUP)

    def _replace(self, index: int) -> None:
        """A worker died outside a stop: its live gauges leave the sum, and a fresh one takes its place."""
        dead = self._workers[index]
        assert dead is not None
        dead.join()
        log.error("worker %d (pid %s) exited with code %s; starting another", index, dead.pid, dead.exitcode)
        mark_process_dead(dead.pid, self._folder)
        time.sleep(RESTART_PAUSE_S)
        if not self._stopping():
            self._start(index).close()     # it serves once its start-up is over; the others serve meanwhile

    def _stopping(self) -> bool:
        return any(s in (signal.SIGTERM, signal.SIGINT) for s in self._signals)

    def _signal_all(self, signum: int) -> None:
        for process in self._workers:
            if process is not None and process.is_alive() and process.pid is not None:
                os.kill(process.pid, signum)

    def _stop_all(self) -> None:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in (p for p in self._workers if p is not None):
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                log.error("worker %s did not stop in %.0f s: killed", process.name, STOP_GRACE_S)
                process.kill()
                process.join()

