"""The CPU meters the benches divide by: user time and system (kernel) time, apart."""

from __future__ import annotations

import os
import time

from bench.loadgen import CpuMeter, UserSystemMeter


def test_user_and_system_time_are_told_apart() -> None:
    total, split = CpuMeter(os.getpid()), UserSystemMeter(os.getpid())
    began = time.process_time()
    while time.process_time() - began < 0.3:     # user time: a loop
        sum(range(1000))
    began = time.process_time()
    while time.process_time() - began < 0.3:     # system time: tiny reads, each a syscall
        with open("/proc/self/stat", "rb") as f:
            f.read()
    user, system = split.seconds()
    assert user >= 0.2 and system >= 0.05
    assert abs(total.seconds() - (user + system)) < 0.1      # ticks of 10 ms against nanoseconds
