"""What the host did while a benchmark's phase ran, for telling a slow run's cause apart: the calling
thread's CPU time and context switches, the whole process's CPU time, and the CPU the thread was last
on with that CPU's hyperthread siblings (Linux; other systems: what `resource` gives).

    with HostUsage() as host:
        ...                      # the phase
    row.update(host.figures("decode"))
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any


def _last_cpu() -> int | None:
    """The CPU this thread last ran on (field 39 of /proc/thread-self/stat: index 36 after the command
    name, which starts at field 3), or None."""
    try:
        stat = Path("/proc/thread-self/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])


def _siblings(cpu: int | None) -> str | None:
    if cpu is None:
        return None
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None


class HostUsage:
    def __enter__(self) -> "HostUsage":
        self.wall = time.perf_counter()
        self.proc = resource.getrusage(resource.RUSAGE_SELF)
        self.thread = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        proc = resource.getrusage(resource.RUSAGE_SELF)
        thread = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        self.proc_cpu = proc.ru_utime + proc.ru_stime - self.proc.ru_utime - self.proc.ru_stime
        self.thread_cpu = thread.ru_utime + thread.ru_stime - self.thread.ru_utime - self.thread.ru_stime
        self.switches = (thread.ru_nvcsw - self.thread.ru_nvcsw, thread.ru_nivcsw - self.thread.ru_nivcsw)
        self.cpu = _last_cpu()
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cpus = len(affinity) if affinity is not None else os.cpu_count()  # the phase's, as it ended

    def figures(self, phase: str) -> dict[str, Any]:
        """{phase}_host: the phase's wall and CPU seconds, the thread's voluntary / involuntary context
        switches, its last CPU and that CPU's siblings, and how many CPUs this thread may use."""
        return {f"{phase}_host": {
            "wall_s": round(self.wall, 4), "main_thread_cpu_s": round(self.thread_cpu, 4),
            "process_cpu_s": round(self.proc_cpu, 4), "voluntary_switches": self.switches[0],
            "involuntary_switches": self.switches[1], "last_cpu": self.cpu, "cpu_siblings": _siblings(self.cpu),
            "cpus": self.cpus}}
