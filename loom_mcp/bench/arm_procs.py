"""The arms' processes as the server sees them from /proc: CPU the idle candidate burns while
the baseline is timed, and the arms' interpreters pinned to one CPU."""

from __future__ import annotations

import os

from loom_mcp.judge_models import Finding
from loom_mcp.sandbox import procs


class IdleWatch:
    """CPU time the candidate's processes burn while the baseline is being timed.

    An idle arm blocks on its socket. One that keeps processes busy meanwhile (a red-team
    candidate's DataLoader workers, forked by torch so the audit hook let them be) slows the
    baseline down and reached a CI low above 1.05 with no faster code. Read from /proc, outside
    the arm: user + system time of its launcher's tree, reaped children included."""

    BUSY_FRACTION = 0.25  # of the baseline's pass time
    BUSY_MIN_S = 0.05  # a few clock ticks: /proc counts in 10 ms steps
    RESCAN_EVERY = 10  # passes between scans for new processes

    def __init__(self, root: int) -> None:
        self.root = root
        self.pids: list[int] = []
        self.passes = 0
        self.cpu = 0.0
        self.wall = 0.0

    def cpu_s(self) -> float:
        if self.passes % self.RESCAN_EVERY == 0:
            self.pids = [self.root, *procs.descendants(self.root)]
        return sum(procs.cpu_seconds(pid) for pid in self.pids)

    def add(self, cpu: float, wall: float) -> None:
        self.passes += 1
        self.cpu += max(cpu, 0.0)
        self.wall += wall

    def busy(self) -> bool:
        return self.exceeds(self.cpu, self.wall)

    @classmethod
    def exceeds(cls, cpu: float, wall: float) -> bool:
        return cpu > max(cls.BUSY_MIN_S, cls.BUSY_FRACTION * wall)


def busy_finding(shape: str, cpu: float, wall: float) -> Finding:
    return Finding(
        check="benchmark.busy_while_idle",
        severity="error",
        message=f"{shape}: the candidate's processes used {cpu:.2f} s of CPU while "
        f"the baseline was timed ({wall:.2f} s of its passes): work aimed "
        "at the other arm",
    )


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def arm_interpreter(root: int) -> int | None:
    """The arm's own interpreter under its sandbox launcher: the topmost process running the
    bench worker. What it forks shares its command line, and what it spawns has another: both
    are left out."""
    worker = b"loom_mcp.worker.bench"
    for pid in [root, *procs.descendants(root)]:
        if worker in _cmdline(pid):
            parent = procs.parent_pid(pid)
            if parent is None or worker not in _cmdline(parent):
                return pid
    return None


def pin_to_cpu(roots: list[int], cpu: int) -> int:
    """Pins every thread of the arms' interpreters to one CPU; returns how many were pinned.
    The arms never run at once, so sharing a core costs no time, and they meet the same
    neighbours: on a busy machine an arm placed beside another job's process read 2-4x slower
    for its whole life. The candidate's other processes stay unpinned, so a helper busy while
    the baseline runs does not get the baseline's core as well. Best effort: a thread that
    ended or refuses is left as it is."""
    pinned = 0
    for root in roots:
        pid = arm_interpreter(root)
        try:
            threads = os.listdir(f"/proc/{pid}/task") if pid else []
        except OSError:
            continue
        for tid in threads:
            try:
                os.sched_setaffinity(int(tid), {cpu})
                pinned += 1
            except (OSError, ValueError):
                pass
    return pinned
