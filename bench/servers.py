"""The processes a benchmark runs on loopback: simulated engines, pd-gateway, the naive proxy, vllm-router, Redis.

All are started here, waited on (`/health`), and stopped by PID when the `Servers` context closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from gateway.processes import Server, answers, free_port, start, stop_process  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

START_TIMEOUT_S = float(os.environ.get("PDGW_BENCH_START_TIMEOUT_S", "120"))   # many processes import at once


class ProxyCpus:
    """CPU sets for the proxies under test (gateways, the naive proxy, vllm-router), handed out in start order:
    `per_proxy` CPUs each, every proxy its own while `cpus` last, then round robin (sharing, as few as can be)."""

    def __init__(self, cpus: list[int], per_proxy: int = 1) -> None:
        self.cpus, self.per_proxy = list(cpus), max(1, per_proxy)
        self.given: list[tuple[str, set[int]]] = []

    def take(self, name: str) -> set[int]:
        groups = max(1, len(self.cpus) // self.per_proxy)
        at = len(self.given) % groups * self.per_proxy
        cpus = set(self.cpus[at:at + self.per_proxy])
        self.given.append((name, cpus))
        return cpus

    def describe(self) -> str:
        return "; ".join(f"{name} on CPU {','.join(map(str, sorted(cpus)))}" for name, cpus in self.given)


class Servers(contextlib.ExitStack):
    """Starts processes and stops every one of them, by PID, on exit. `proxy_cpus`: where each proxy under test
    runs (each its own CPU set, bench/compare.py `--pin`); None leaves them where the caller runs."""

    proxy_cpus: ProxyCpus | None = None

    def _cpus(self, name: str) -> set[int] | None:
        return self.proxy_cpus.take(name) if self.proxy_cpus is not None else None

    def sim(self, role: str, engine_id: str, *flags: str) -> Server:
        server = start(["sim", "--role", role, "--engine-id", engine_id, *flags])
        self.callback(server.stop)
        return server

    def sims(self, specs: list[tuple[str, str, list[str]]], cpus: list[set[int]] | None = None) -> list[Server]:
        """Start several sims at once (their start-up is mostly imports: overlapping them saves wall time);
        `cpus`: each one's CPU set, in order."""
        where = cpus or [None] * len(specs)
        return self._wait([_Pending(["sim", "--role", role, "--engine-id", eid, *flags], cpus=c)
                           for (role, eid, flags), c in zip(specs, where, strict=True)])

    def _wait(self, procs: list[_Pending]) -> list[Server]:
        for proc in procs:            # stopped on exit even if another one fails to start
            self.callback(stop_process, proc.proc)
        return [p.wait() for p in procs]

    def gateway(self, prefill: list[Server], decode: list[Server], *flags: str) -> Server:
        return self.gateways([(prefill, decode, list(flags))])[0]

    def gateways(self, specs: list[tuple[list[Server], list[Server], list[str]]],
                 names: list[str] | None = None) -> list[Server]:
        """Start several gateways at once: (prefill engines, decode engines, flags) each. They read D's KV whenever
        continuity allows (`--reuse-policy always`, unless the flags say otherwise): the benches measure reuse
        itself, and on the zero-timing sims computing is free, so the cost plan would always recompute. The local
        path is off unless the flags turn it on (bench/local.py does): the other benches compare P-then-D work."""
        procs = []
        for i, (prefill, decode, flags) in enumerate(specs):
            procs.append(_Pending(["serve", "--log-level", "warning", "--reuse-policy", "always",
                                   "--local-prefill-max-tokens", "0", *flags,
                                   *engine_flags(prefill, decode)],
                                  cpus=self._cpus(f"gateway {names[i] if names else i}")))
        return self._wait(procs)

    def naive(self, prefill: list[Server], decode: list[Server]) -> Server:
        args = [sys.executable, str(ROOT / "bench" / "naive_proxy.py")]
        args += engine_flags(prefill, decode)
        server = _spawn(args, port_flag=True, cpus=self._cpus("naive proxy"))
        self.callback(server.stop)
        return server

    def router(self, prefill: list[Server], decode: list[Server]) -> Server:
        """vllm-router's PD mode (stateless PD) in front of `prefill` and `decode`."""
        return self._router(["--vllm-pd-disaggregation", "--policy", "round_robin",
                             *engine_flags(prefill, decode)])

    def router_workers(self, workers: list[Server], policy: str = "cache_aware") -> Server:
        """vllm-router in front of co-located engines, routing by `policy`."""
        return self._router(["--policy", policy, "--worker-urls", *(w.url for w in workers)])

    def _router(self, mode: list[str]) -> Server:
        exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        if exe is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        port = free_port()
        args = [exe, *mode, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                "--max-concurrent-requests", "4096", "--disable-retries", "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(free_port())]
        server = _spawn(args, port=port, cpus=self._cpus("vllm-router"), own_group=True)
        self.callback(_stop_group, server)
        return server

    def redis(self) -> RedisServer:
        return self.enter_context(RedisServer())


class _Pending:
    def __init__(self, args: list[str], cpus: set[int] | None = None) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="pdgw-bench-"))
        cmd = [sys.executable, "-m", "gateway", *args, "--host", "127.0.0.1", "--port", "0",
               "--port-file", str(self.tmp / "port")]
        self.log = open(self.tmp / "log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=_pin(cpus))

    def wait(self) -> Server:
        return _await(self.proc, self.tmp / "port", self.tmp / "log", self.args)


def _pin(cpus: set[int] | None):
    """A preexec_fn confining the child (and every thread it starts) to `cpus`."""
    return (lambda: os.sched_setaffinity(0, cpus)) if cpus else None


def _stop_group(server: Server) -> None:
    """Stop a server and what it started: vllm-router's workers outlived the router otherwise (parent 1)."""
    server.stop()
    try:
        os.killpg(server.proc.pid, signal.SIGKILL)      # the group the server leads (own_group)
    except ProcessLookupError:
        pass


def _spawn(args: list[str], *, port_flag: bool = False, port: int | None = None,
           cpus: set[int] | None = None, own_group: bool = False) -> Server:
    tmp = Path(tempfile.mkdtemp(prefix="pdgw-bench-"))
    if port_flag:
        args = [*args, "--port", "0", "--port-file", str(tmp / "port")]
    else:
        (tmp / "port").write_text(str(port))
    log = open(tmp / "log", "wb")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"},
                            preexec_fn=_pin(cpus), start_new_session=own_group)
    return _await(proc, tmp / "port", tmp / "log", args)


def _await(proc: subprocess.Popen, port_file: Path, log_path: Path, args: list[str]) -> Server:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{args[:2]} exited {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            server = Server(proc, int(text), log_path, args)
            if answers(server.url + "/health"):
                return server
        time.sleep(0.05)
    stop_process(proc, signal.SIGKILL)
    raise TimeoutError(f"{args[:2]} not healthy after {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def post(url: str) -> None:
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()


def metrics(url: str) -> dict[str, float]:
    """A Prometheus text page as {'name{labels}': value} (samples only)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def sample_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """The samples of `name` whose labels include `labels`, summed (a turn's families also carry its `model`)."""
    return sum(value for key, value in samples.items() if key.partition("{")[0] == name
               and all(f'{k}="{v}"' in key.partition("{")[2] for k, v in labels.items()))


@contextlib.contextmanager
def servers() -> Iterator[Servers]:
    with Servers() as stack:
        yield stack


def engine_flags(prefill: list[Server], decode: list[Server]) -> list[str]:
    """--prefill URL ... --decode URL ...: how every proxy under test is told about the engines."""
    return [a for p in prefill for a in ("--prefill", p.url)] + [a for d in decode for a in ("--decode", d.url)]
