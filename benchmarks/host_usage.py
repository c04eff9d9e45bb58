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
import shutil
import statistics
import subprocess
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


def _thread_times() -> dict[int, tuple[str, float, int]]:
    """{thread id: (name, CPU seconds so far, CPU last run on)} of this process's threads (Linux /proc;
    empty elsewhere). Fields after the name: utime 14, stime 15, processor 39 (indices 11, 12, 36)."""
    out: dict[int, tuple[str, float, int]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for task in Path("/proc/self/task").glob("*") if Path("/proc/self/task").exists() else []:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        rest = stat.rsplit(")", 1)[1].split()
        out[int(task.name)] = (name, (int(rest[11]) + int(rest[12])) / tick, int(rest[36]))
    return out


def _busy_threads(before: dict[int, tuple[str, float, int]], after: dict[int, tuple[str, float, int]],
                  wall: float, top: int = 6) -> list[dict[str, Any]]:
    """The threads that used the most CPU over the phase (at least 5% of its wall time): name, CPU
    seconds, the CPU each last ran on."""
    rows = [(cpu - before.get(tid, (name, 0.0, last))[1], tid, name, last) for tid, (name, cpu, last) in after.items()]
    rows = sorted((r for r in rows if r[0] >= 0.05 * wall), reverse=True)[:top]
    return [{"tid": tid, "name": name, "cpu_s": round(used, 3), "last_cpu": last} for used, tid, name, last in rows]


def probe_us(reps: int = 7) -> float:
    """Microseconds of a fixed pure-Python workload on this thread (median of `reps`): the host's
    speed for the interpreter's own work, to tell a slow host clock from other causes."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        acc = 0
        for i in range(20000):
            acc += i * i % 7
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def gpu_clocks() -> str | None:
    """nvidia-smi's SM and memory clocks (MHz), power (W), temperature (C) and active throttle reasons
    of the first GPU, now; None without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = "clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
    try:
        out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].strip() if out.strip() else None


def _siblings(cpu: int | None) -> str | None:
    if cpu is None:
        return None
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return None


class HostUsage:
    def __enter__(self) -> "HostUsage":
        self.probe_before = probe_us()  # before the phase's clocks start
        self.wall = time.perf_counter()
        self.proc = resource.getrusage(resource.RUSAGE_SELF)
        self.thread = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        self.threads = _thread_times()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.wall
        proc = resource.getrusage(resource.RUSAGE_SELF)
        thread = resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF))
        self.proc_cpu = proc.ru_utime + proc.ru_stime - self.proc.ru_utime - self.proc.ru_stime
        self.thread_cpu = thread.ru_utime + thread.ru_stime - self.thread.ru_utime - self.thread.ru_stime
        self.switches = (thread.ru_nvcsw - self.thread.ru_nvcsw, thread.ru_nivcsw - self.thread.ru_nivcsw)
        self.cpu = _last_cpu()
        self.busy = _busy_threads(self.threads, _thread_times(), self.wall)
        self.gpu = gpu_clocks()  # right as the phase ends, while the clocks are still the phase's
        self.probe_after = probe_us()
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        self.cpus = len(affinity) if affinity is not None else os.cpu_count()  # the phase's, as it ended

    def figures(self, phase: str) -> dict[str, Any]:
        """{phase}_host: the phase's wall and CPU seconds, the thread's voluntary / involuntary context
        switches, its last CPU and that CPU's siblings, how many CPUs this thread may use, and the process's
        busiest threads over the phase (another thread spinning on the main thread's core shows there),
        a fixed Python workload's microseconds before and after it (`probe_us`), and the GPU's clocks
        as it ended (`gpu_clocks`, nvidia-smi's line)."""
        return {f"{phase}_host": {
            "wall_s": round(self.wall, 4), "main_thread_cpu_s": round(self.thread_cpu, 4),
            "process_cpu_s": round(self.proc_cpu, 4), "voluntary_switches": self.switches[0],
            "involuntary_switches": self.switches[1], "last_cpu": self.cpu, "cpu_siblings": _siblings(self.cpu),
            "cpus": self.cpus, "busy_threads": self.busy, "probe_us": [self.probe_before, self.probe_after],
            "gpu_clocks": self.gpu}}
