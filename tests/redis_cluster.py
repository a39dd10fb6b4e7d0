"""A real Redis Cluster for tests and the chaos soak: cluster-enabled redis-servers (`RedisServer`, each in its
own folder, so a restarted node keeps its nodes.conf and rejoins), made one cluster by `redis-cli --cluster
create`, ready once every node sees every slot covered. `fail_over` crashes a master so its replica takes over.

    with RedisCluster(masters=3, replicas=1) as cluster:
        url = cluster.url           # redis+cluster://127.0.0.1:PORT (the first node: a seed)
        cluster.fail_over(cluster.nodes[0])       # its replica takes over
        cluster.rejoin(cluster.nodes[0])          # back, as a replica
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import redis

from tests.redis_server import RedisServer, redis_server_path
from tests.servers import free_port

NODE_TIMEOUT_MS = 1000        # a master silent this long is failed and its replica elected (Redis' default: 15 s)
READY_TIMEOUT_S = 30.0


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is a valid port too."""
    while (port := free_port()) > 55000:
        pass
    return port


class RedisCluster:
    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        self.masters, self.replicas = masters, replicas
        flags = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(node_timeout_ms))
        self.nodes = [RedisServer(cluster_port(), flags) for _ in range(masters * (1 + replicas))]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> RedisCluster:
        try:
            for node in self.nodes:
                node.start()
            # `create` makes the first `masters` nodes masters and gives each its replicas from the rest
            subprocess.run([str(Path(redis_server_path()).with_name("redis-cli")), "--cluster", "create",
                            *[f"127.0.0.1:{n.port}" for n in self.nodes], "--cluster-replicas", str(self.replicas),
                            "--cluster-yes"], check=True, capture_output=True, timeout=30)
            self.wait(lambda: all(self._settled(n) for n in self.nodes))
        except BaseException:
            self.stop()
            raise
        return self

    def fail_over(self, master: RedisServer) -> float:
        """Crash `master` (SIGKILL) and wait until its replica serves its slots, the cluster ok again on every node
        left. Returns the seconds that took (about twice the node timeout: failure detection, then election)."""
        began = time.monotonic()
        master.stop(signal.SIGKILL)
        alive = [n for n in self.nodes if n is not master]
        self.wait(lambda: all(_state(n)["cluster_state"] == "ok" for n in alive) and self._masters(alive) == self.masters)
        return time.monotonic() - began

    def rejoin(self, node: RedisServer) -> None:
        """Restart a crashed node on its port and folder: it rejoins (a failed-over master as a replica)."""
        node.start()
        self.wait(lambda: all(self._settled(n) for n in self.nodes))

    def master_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if _role(n) == "master"]

    def _masters(self, nodes: list[RedisServer]) -> int:
        return sum(_role(n) == "master" for n in nodes)

    def _settled(self, node: RedisServer) -> bool:
        """This node sees the cluster ok, every node known and every master's slots (gossip reaches nodes at
        different times)."""
        info = _state(node)
        return (info["cluster_state"] == "ok" and int(info["cluster_known_nodes"]) == len(self.nodes)
                and int(info["cluster_size"]) == self.masters)

    @staticmethod
    def wait(condition, timeout_s: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if condition():
                    return
            except redis.RedisError:
                pass                                    # a node still starting or just gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster not settled after {timeout_s}s")
            time.sleep(0.05)

    def stop(self) -> None:
        """Every node stopped by PID, its folder removed."""
        for node in self.nodes:
            node.__exit__()

    def __enter__(self) -> RedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _state(node: RedisServer) -> dict:
    with redis.Redis(port=node.port, socket_timeout=1) as client:
        return client.cluster("info")


def _role(node: RedisServer) -> str:
    with redis.Redis(port=node.port, socket_timeout=1) as client:
        return client.execute_command("ROLE")[0].decode()
