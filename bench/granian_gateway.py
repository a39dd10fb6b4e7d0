"""pd-gateway served by granian (a Rust HTTP server) instead of uvicorn, for `bench/asgi_servers.py` only.

    python bench/granian_gateway.py [pd-gateway serve flags] --port N --port-file F

Same settings, same app (`create_app`), same uvloop event loop; only the server differs. Granian's embedded
server (one process, the app on this process' asyncio loop, HTTP in granian's Rust runtime) keeps the gateway
one PID, so its CPU per turn is measured as uvicorn's is. granian binds its own socket: `--port` must be a
free port (no `--port 0`); the port file is written once the lifespan ran and the server listens.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import uvloop  # noqa: E402
from granian.constants import Interfaces  # noqa: E402
from granian.server.embed import Server  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.cli import parse_settings, settings_parser  # noqa: E402
from gateway.processes import answers  # noqa: E402
from gateway.telemetry import setup_logging  # noqa: E402


async def main(argv: list[str]) -> None:
    settings, args = parse_settings(argv, "granian_gateway", settings_parser("granian_gateway"))
    setup_logging(settings.log_level, settings.log_format)
    server = Server(create_app(settings), address=settings.host, port=settings.port, interface=Interfaces.ASGI,
                    log_access=False)
    serving = asyncio.create_task(server.serve())
    url = f"http://{settings.host}:{settings.port}/health"
    while not await asyncio.to_thread(answers, url):
        if serving.done():
            await serving                      # raises what stopped it
            return
        await asyncio.sleep(0.05)
    if args.port_file:
        Path(args.port_file).write_text(str(settings.port))
    await serving


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1:]))
