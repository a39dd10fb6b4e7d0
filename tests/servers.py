"""Real server processes for tests (see gateway/processes.py)."""

from gateway.processes import Server, free_port, start, stop_process

__all__ = ["Server", "free_port", "start", "stop_process"]
