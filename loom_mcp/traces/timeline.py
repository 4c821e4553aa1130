"""Where a device's time went: computation, exposed communication, exposed copies, idle.

Definitions (all interval unions over one device's GPU activities, in microseconds):
    computation     = |compute kernels|
    exposed_comm    = |compute U comm| - |compute|        (comm not hidden under compute)
    exposed_memcpy  = |all| - |compute U comm|            (copies hidden under neither)
    busy            = |all| = computation + exposed_comm + exposed_memcpy
    total           = last end - first start
    idle            = total - busy = idle_short + idle_long   (gaps below / above a threshold)
so computation + exposed_comm + exposed_memcpy + idle_short + idle_long == total.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom_mcp.traces.intervals import merge, union_length

SHORT_GAP_US = 10.0  # a gap this short is launch latency between queued kernels, not a stall
# A host-bound gap up to this long is per-launch overhead (Python + launch API between two
# kernels); a longer one is the host doing something else (scheduling, sync, data loading).
LAUNCH_GAP_MAX_US = 1000.0

BUCKET_COMPUTE = 0
BUCKET_COMM = 1
BUCKET_MEMCPY = 2


@dataclass
class DeviceTimeline:
    device: int
    start_us: float
    total_us: float
    computation_us: float
    exposed_comm_us: float
    exposed_memcpy_us: float
    busy_us: float
    idle_us: float
    idle_short_us: float
    idle_long_us: float
    gaps_short: int
    gaps_long: int
    largest_gap_us: float
    largest_gap_at_us: float  # offset of the largest gap from the device's first activity
    host_bound_idle_us: float  # idle in gaps the GPU spent waiting for the next launch call
    launch_gap_us: float  # of which in gaps up to LAUNCH_GAP_MAX_US (launch overhead)
    launch_gaps: int
    host_stall_us: float  # of which in longer gaps (the host busy elsewhere)
    host_stalls: int
    waiting_idle_us: float  # long gaps whose next launch was already issued, or unknown
    largest_stall_us: float
    largest_stall_at_us: float
    largest_wait_us: float
    largest_wait_at_us: float
    comm_total_us: float
    memcpy_total_us: float
    events: int
    short_gap_threshold_us: float = SHORT_GAP_US


def device_timeline(
    device: int,
    ts: np.ndarray,
    dur: np.ndarray,
    bucket: np.ndarray,
    launch_ts: np.ndarray,
    short_gap_us: float = SHORT_GAP_US,
) -> DeviceTimeline:
    """`launch_ts`: per event, when its launch call started (NaN when unknown)."""
    end = ts + dur
    ms, me, first = merge(ts, end)
    busy = float(np.sum(me - ms))
    start = float(ts.min())
    total = float(end.max() - start)
    comp = bucket == BUCKET_COMPUTE
    comm = bucket == BUCKET_COMM
    mem = bucket == BUCKET_MEMCPY
    computation = union_length(ts[comp], end[comp])
    comp_or_comm = comp | comm
    cc = union_length(ts[comp_or_comm], end[comp_or_comm])
    gaps = ms[1:] - me[:-1]
    short = gaps < short_gap_us
    idle_short = float(gaps[short].sum())
    idle_long = float(gaps[~short].sum())
    # A gap is host-bound when the launch that ended it was only issued after the GPU had
    # already run dry: the GPU was waiting for the CPU, not for a dependency.
    nxt = first[1:]
    lts = launch_ts[nxt]
    host_bound = np.isfinite(lts) & (lts > me[:-1])
    launch_gap = host_bound & (gaps <= LAUNCH_GAP_MAX_US)
    stall = host_bound & ~launch_gap
    waiting = ~host_bound & ~short

    def _largest(mask: np.ndarray) -> tuple[float, float]:
        if not mask.any():
            return 0.0, 0.0
        g = int(np.argmax(np.where(mask, gaps, -1.0)))
        return float(gaps[g]), float(me[g] - start)

    largest, largest_at = _largest(np.ones(len(gaps), dtype=bool))
    largest_stall, largest_stall_at = _largest(stall)
    largest_wait, largest_wait_at = _largest(waiting)
    # Float sums of the parts may disagree with `total` in the last ulp; the idle parts absorb
    # it so the breakdown adds up exactly.
    idle = total - busy
    drift = idle - (idle_short + idle_long)
    if idle_long > 0:
        idle_long += drift
    else:
        idle_short += drift
    return DeviceTimeline(
        device=device,
        start_us=start,
        total_us=total,
        computation_us=computation,
        exposed_comm_us=cc - computation,
        exposed_memcpy_us=busy - cc,
        busy_us=busy,
        idle_us=idle,
        idle_short_us=max(idle_short, 0.0),
        idle_long_us=max(idle_long, 0.0),
        gaps_short=int(short.sum()),
        gaps_long=int((~short).sum()),
        largest_gap_us=largest,
        largest_gap_at_us=largest_at,
        host_bound_idle_us=float(gaps[host_bound].sum()),
        launch_gap_us=float(gaps[launch_gap].sum()),
        launch_gaps=int(launch_gap.sum()),
        host_stall_us=float(gaps[stall].sum()),
        host_stalls=int(stall.sum()),
        waiting_idle_us=float(gaps[waiting].sum()),
        largest_stall_us=largest_stall,
        largest_stall_at_us=largest_stall_at,
        largest_wait_us=largest_wait,
        largest_wait_at_us=largest_wait_at,
        comm_total_us=union_length(ts[comm], end[comm]),
        memcpy_total_us=union_length(ts[mem], end[mem]),
        events=len(ts),
        short_gap_threshold_us=short_gap_us,
    )
