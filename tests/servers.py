"""Real server processes for tests (see gateway/processes.py)."""

from gateway.processes import Server, free_port, start, stop_process

__all__ = ["Server", "free_port", "labelled_sum", "start", "stop_process"]


def labelled_sum(text: str, name: str, labels: dict[str, str]) -> float:
    """Of a /metrics page, the samples of `name` whose labels include `labels`, summed (a turn's families also
    carry its `model`)."""
    total = 0.0
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
