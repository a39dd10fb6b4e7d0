"""`pd-gateway` command: serve, demo, sim, migrate, check."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        from gateway.sim.cli import main as sim_main

        sim_main(argv[1:])
        return
    raise SystemExit("usage: pd-gateway {serve,demo,sim,migrate,check} ...")
