"""Listening sockets: every accepted connection sends small writes at once (TCP_NODELAY).

Without it, a response written in two parts (headers, then body) waits for the client's delayed ACK: 40 ms on
Linux, on every such response. asyncio sets the option itself only on sockets created with proto IPPROTO_TCP,
which a plain socket.socket() is not, so the sockets bound for `--port 0` must carry it themselves.
"""

from __future__ import annotations

import socket

import pytest

from gateway import serving
from gateway.sim import launch as sim_cli


@pytest.mark.parametrize("bind", [serving.bind, sim_cli.bind], ids=["gateway", "sim"])
def test_accepted_connections_have_nodelay(bind) -> None:
    listener = bind("127.0.0.1", 0)
    try:
        assert listener.proto == socket.IPPROTO_TCP       # so asyncio's own _set_nodelay applies too
        listener.listen(1)
        with socket.create_connection(listener.getsockname()[:2]) as client:
            accepted, _ = listener.accept()
            with accepted:
                assert client.fileno() >= 0
                assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        listener.close()
