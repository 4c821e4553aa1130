"""One trace, fully analysed: every table, before it is cut down to a summary."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loom_mcp.traces.aggregate import (
    CategoryStat,
    KernelStat,
    OpGroup,
    category_stats,
    event_categories,
    host_op_groups,
    kernel_stats,
    op_groups,
)
from loom_mcp.traces.categories import CATEGORIES, timeline_bucket
from loom_mcp.traces.events import KIND_KERNEL
from loom_mcp.traces.findings import (
    elementwise_chains,
    event_label,
    find,
    host_call_during,
    host_findings,
    memcpy_labels,
)
from loom_mcp.traces.linking import LinkStats, link
from loom_mcp.traces.models import Finding
from loom_mcp.traces.readers import read_trace
from loom_mcp.traces.roofline import find_peak
from loom_mcp.traces.secrets import scrub_text
from loom_mcp.traces.timeline import (
    BUCKET_COMM,
    BUCKET_COMPUTE,
    BUCKET_MEMCPY,
    DeviceTimeline,
    device_timeline,
)

_BUCKET_OF_CAT = np.array(
    [{"compute": BUCKET_COMPUTE, "comm": BUCKET_COMM, "memcpy": BUCKET_MEMCPY}[timeline_bucket(c)] for c in CATEGORIES],
    dtype=np.int64,
)


@dataclass
class FullAnalysis:
    trace: str
    source_format: str
    device_name: str | None
    devices: dict[int, str]
    peak: Any | None
    peak_note: str | None
    primary: DeviceTimeline | None
    timelines: list[DeviceTimeline]
    groups: list[OpGroup]
    kernels: list[KernelStat]
    categories: list[CategoryStat]
    links: LinkStats
    findings: list[Finding]
    metadata_blocks: dict[str, tuple[int, int, int]]
    notes: list[str] = field(default_factory=list)
    # Without GPU activity (a CPU run) the ops are host ops, timed by their top-level host time.
    host_time_us: float = 0.0

    @property
    def gpu_time_us(self) -> float:
        return sum(k.time_us for k in self.kernels)

    @property
    def op_time_us(self) -> float:
        """What the ops' shares are of: GPU kernel time, or host op time in a CPU trace."""
        return self.gpu_time_us if self.kernels else self.host_time_us


def _device_name(devices: dict[int, str], dev: int | None) -> str | None:
    if dev is not None and dev in devices:
        return devices[dev]
    names = set(devices.values())
    # Kineto on ROCm numbers GPU events by HIP device while deviceProperties starts at 0: a
    # single distinct name is still unambiguous.
    return names.pop() if len(names) == 1 else None


def analyze(path: Path) -> FullAnalysis:
    td = read_trace(path)
    notes = list(td.notes)
    links = link(td)
    cat = event_categories(td, links) if td.n_gpu else np.zeros(0, dtype=np.int64)

    timelines: list[DeviceTimeline] = []
    if td.n_gpu:
        dev = td.np("g_dev")
        ts = td.np("g_ts")
        dur = td.np("g_dur")
        bucket = _BUCKET_OF_CAT[cat]
        l_ts = td.np("l_ts")
        launch_ts = np.full(td.n_gpu, np.nan)
        has = links.launch >= 0
        launch_ts[has] = l_ts[links.launch[has]]
        for d in np.unique(dev).tolist():
            m = dev == d
            timelines.append(device_timeline(int(d), ts[m], dur[m], bucket[m], launch_ts[m]))
        timelines.sort(key=lambda t: -t.busy_us)
    primary = timelines[0] if timelines else None
    if primary is None:
        notes.append(
            "no GPU activity in the trace: ops ranked by top-level host time, which says nothing of GPU speed"
            if len(td.o_ts)
            else "no GPU activity in the trace"
        )
    elif len(timelines) > 1:
        notes.append(
            f"{len(timelines)} devices have GPU activity; the timeline is for the busiest "
            f"(device {primary.device}); categories and ops cover all of them"
        )
    device_name = _device_name(td.devices, primary.device if primary else None)
    peak, peak_note = find_peak(device_name)
    if peak_note:
        notes.append(peak_note)

    groups = op_groups(td, links, cat, peak)
    kernels = kernel_stats(td, links, cat)
    categories = category_stats(kernels)

    findings: list[Finding] = []
    host_time_us = 0.0
    if primary is None:
        # Every table below is built from GPU activity; a CPU trace has only host ops.
        groups = host_op_groups(td)
        host_time_us = sum(g.time_us for g in groups)
        findings = host_findings(groups, host_time_us)
    else:
        dev = td.np("g_dev")
        kmask = (dev == primary.device) & (td.np("g_kind") == KIND_KERNEL)
        chains = elementwise_chains(td, links, cat, primary.device, event_label(td, links))
        stall_start = primary.start_us + primary.largest_stall_at_us
        stall_call = host_call_during(td, stall_start, stall_start + primary.largest_stall_us)
        findings = find(
            primary,
            groups,
            td.np("g_dur")[kmask],
            chains,
            device_name,
            peak is not None,
            memcpy_labels(groups),
            has_launches=links.stats.with_launch > 0,
            stall_call=stall_call,
        )
    return FullAnalysis(
        trace=scrub_text(path.name),
        source_format=td.source_format,
        device_name=device_name,
        devices=dict(td.devices),
        peak=peak,
        peak_note=peak_note,
        primary=primary,
        timelines=timelines,
        groups=groups,
        kernels=kernels,
        categories=categories,
        links=links.stats,
        findings=findings,
        metadata_blocks=dict(td.metadata_blocks),
        notes=notes,
        host_time_us=host_time_us,
    )
