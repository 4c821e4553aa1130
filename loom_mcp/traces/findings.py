"""Ranked opportunities: what each problem costs and what fixing it could win (Amdahl).

Every finding carries a ceiling on the saving (time that would disappear if the problem were
fixed to a realistic target), a plain sentence, and the loom tool to call next. Savings of
different findings overlap, so they are ranked, not summed.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loom_mcp.traces.aggregate import CAT_INDEX, OpGroup
from loom_mcp.traces.categories import (
    ATTENTION,
    ELEMENTWISE,
    GEMM,
    MEMCPY,
    NORM,
    REDUCTION,
    short_name,
)
from loom_mcp.traces.events import KIND_KERNEL, TraceData
from loom_mcp.traces.linking import Links
from loom_mcp.traces.models import Finding
from loom_mcp.traces.timeline import LAUNCH_GAP_MAX_US, DeviceTimeline

ACHIEVABLE = 0.8  # fraction of the roofline a tuned kernel is expected to reach
LOW_ROOFLINE_PCT = 50.0
MIN_SHARE = 0.01  # findings below 1 % of the span are noise
CHAIN_GAP_US = 50.0
CHAIN_MIN = 3
MIN_KERNEL_US = 2.0  # launch-to-finish floor of any kernel


@dataclass
class Chains:
    count: int
    saving_us: float
    kernels: int
    pattern: str  # op (or kernel) names of the most costly recurring chain
    pattern_count: int


def _ms(us: float) -> str:
    return f"{us / 1000:.2f} ms" if us >= 1000 else f"{us:.0f} µs"


def _n(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _pct(x: float, total: float) -> float:
    return round(100.0 * x / total, 1) if total > 0 else 0.0


def _add_finding(
    out: list[Finding], total: float, kind: str, message: str, saving: float, tool: str, target: str | None = None
) -> None:
    """Adds the finding to `out` when the time fixing it could save is worth naming (MIN_SHARE of `total`)."""
    if saving >= MIN_SHARE * total and saving > 0:
        out.append(
            Finding(
                kind=kind,
                message=message,
                saving_us=round(saving, 1),
                saving_pct=_pct(saving, total),
                next_tool=tool,  # type: ignore[arg-type]
                target=target,
            )
        )


def elementwise_chains(
    td: TraceData, links: Links, cat: np.ndarray, device: int, label: Callable[[int], str]
) -> Chains:
    """Runs of >= 3 back-to-back elementwise kernels on one stream: each reads and writes its
    tensors from memory, where one fused kernel would do it once."""
    dev = td.np("g_dev")
    sel = np.flatnonzero((dev == device) & (td.np("g_kind") == KIND_KERNEL))
    if len(sel) < CHAIN_MIN:
        return Chains(0, 0.0, 0, "", 0)
    stream = td.np("g_stream")[sel]
    ts = td.np("g_ts")[sel]
    order = np.lexsort((ts, stream))
    sel = sel[order]
    stream, ts = stream[order], ts[order]
    dur = td.np("g_dur")[sel]
    ew = cat[sel] == CAT_INDEX[ELEMENTWISE]
    gap = np.empty(len(sel))
    gap[0] = np.inf
    gap[1:] = ts[1:] - (ts[:-1] + dur[:-1])
    joined = np.zeros(len(sel), dtype=bool)  # event i continues the run of event i-1
    joined[1:] = ew[1:] & ew[:-1] & (stream[1:] == stream[:-1]) & (gap[1:] < CHAIN_GAP_US)
    starts = np.flatnonzero(ew & ~joined)
    if len(starts) == 0:
        return Chains(0, 0.0, 0, "", 0)
    count = 0
    saving = 0.0
    kernels = 0
    patterns: Counter[str] = Counter()
    pattern_saving: dict[str, float] = {}
    ends = np.append(starts[1:], len(sel))
    for s, e_lim in zip(starts.tolist(), ends.tolist(), strict=True):
        e = s + 1
        while e < e_lim and joined[e]:
            e += 1
        n = e - s
        if n < CHAIN_MIN:
            continue
        d = dur[s:e]
        # A fused kernel still moves at least what the largest member moves; the launch gaps
        # between members are already counted by the launch findings.
        win = float(d.sum() - d.max())
        count += 1
        kernels += n
        saving += win
        key = " → ".join(label(i) for i in sel[s:e].tolist()[:4]) + (" → …" if n > 4 else "")
        patterns[key] += 1
        pattern_saving[key] = pattern_saving.get(key, 0.0) + win
    if not count:
        return Chains(0, 0.0, 0, "", 0)
    top = max(pattern_saving, key=lambda k: pattern_saving[k])
    return Chains(count, saving, kernels, top, patterns[top])


def host_call_during(td: TraceData, start: float, end: float) -> tuple[str, float] | None:
    """The host API call that covered most of [start, end) (a sync, a blocking copy...), with
    the time it covered; None when no recorded call overlaps the window."""
    if len(td.l_ts) == 0 or end <= start:
        return None
    ls = td.np("l_ts")
    le = ls + td.np("l_dur")
    overlap = np.clip(np.minimum(le, end) - np.maximum(ls, start), 0.0, None)
    hit = overlap > 0
    if not hit.any():
        return None
    per_name = np.bincount(td.np("l_name")[hit], weights=overlap[hit])
    top = int(np.argmax(per_name))
    return td.names[top], float(per_name[top])


def event_label(td: TraceData, links: Links) -> Callable[[int], str]:
    """GPU event index -> the launching op's name, else the short kernel name."""
    o_sig = td.np("o_sig")
    shorts: dict[int, str] = {}

    def label(i: int) -> str:
        op = int(links.op[i])
        if op >= 0 and not links.graph[i]:
            return td.sigs[int(o_sig[op])].name
        nm = td.g_name[i]
        if nm not in shorts:
            shorts[nm] = short_name(td.names[nm], 40)
        return shorts[nm]

    return label


def find(
    tl: DeviceTimeline,
    groups: list[OpGroup],
    kernel_durations: np.ndarray,
    chains: Chains | None,
    device_name: str | None,
    peak_known: bool,
    memcpy_names: list[str],
    has_launches: bool = True,
    stall_call: tuple[str, float] | None = None,
) -> list[Finding]:
    total = tl.total_us
    out: list[Finding] = []

    add = functools.partial(_add_finding, out, total)

    n_k = len(kernel_durations)
    median = float(np.median(kernel_durations)) if n_k else 0.0
    lg = tl.launch_gap_us
    if lg > 0:
        if median < 20.0 and n_k >= 20:
            add(
                "launch_bound",
                f"Launch-bound: {n_k} kernels (median {median:.1f} µs); the GPU waited "
                f"{_ms(lg)} in {_n(tl.launch_gaps, 'gap')} for the next launch. CUDA/HIP graphs "
                "or fewer, fused kernels remove that wait.",
                lg,
                "benchmark",
            )
        else:
            add(
                "launch_overhead",
                f"The GPU waited {_ms(lg)} in {_n(tl.launch_gaps, 'gap')} under 1 ms for the host "
                "to issue the next kernel (per-op Python and launch overhead).",
                lg,
                "benchmark",
            )
    if tl.host_stall_us > 0:
        if stall_call and stall_call[1] >= 0.2 * tl.largest_stall_us:
            during = f"mostly in {stall_call[0]} ({_ms(stall_call[1])})"
        else:
            during = "no runtime call in flight: Python, scheduling or data loading"
        add(
            "host_stall",
            f"The GPU sat idle {_ms(tl.host_stall_us)} in {_n(tl.host_stalls, 'gap')} over "
            f"{LAUNCH_GAP_MAX_US / 1000:.0f} ms waiting for the host; the largest, "
            f"{_ms(tl.largest_stall_us)} at +{_ms(tl.largest_stall_at_us)}, was spent {during}. "
            "Profile with CPU stacks.",
            tl.host_stall_us,
            "profile",
        )
    if tl.waiting_idle_us > 0:
        why = (
            "no host records, so a host stall cannot be told from a wait"
            if not has_launches
            else "work was already issued: waits on events, syncs or other devices"
        )
        add(
            "idle_gpu",
            f"GPU idle {_ms(tl.waiting_idle_us)} in gaps over "
            f"{tl.short_gap_threshold_us:.0f} µs ({why}); largest {_ms(tl.largest_wait_us)} at "
            f"+{_ms(tl.largest_wait_at_us)}.",
            tl.waiting_idle_us,
            "profile",
        )
    if tl.exposed_memcpy_us > 0:
        names = ", ".join(memcpy_names[:2])
        add(
            "exposed_memcpy",
            f"Copies/memsets not overlapped with compute: {_ms(tl.exposed_memcpy_us)}"
            f"{', e.g. ' + names if names else ''}. "
            "Overlap them (side stream, pinned memory) or avoid them.",
            tl.exposed_memcpy_us,
            "profile",
        )
    if tl.exposed_comm_us > 0:
        add(
            "exposed_comm",
            f"Communication not hidden under compute: {_ms(tl.exposed_comm_us)} of "
            f"{_ms(tl.comm_total_us)}. Overlap "
            "collectives with compute (async, bucketing) or shrink them.",
            tl.exposed_comm_us,
            "profile",
        )
    if chains and chains.count:
        add(
            "unfused_elementwise",
            f"{_n(chains.count, 'chain')} of back-to-back elementwise kernels ({chains.kernels} "
            f"kernels); the costliest pattern (target) occurs x{chains.pattern_count}. One fused "
            "kernel per chain saves the memory round-trips.",
            chains.saving_us,
            "compile_kernel",
            chains.pattern[:80],
        )
    if peak_known:
        for g in groups[:50]:
            r = g.roof
            if r.pct is None or r.floor_us is None or r.pct >= LOW_ROOFLINE_PCT:
                continue
            # A kernel cannot beat its launch latency, however little work it does.
            target_us = max(r.floor_us / ACHIEVABLE, g.kernels * MIN_KERNEL_US)
            saving = g.time_us - target_us
            if saving <= 0:
                continue
            label = f"{g.name} {g.shapes}".strip()
            if g.category in (GEMM, ATTENTION):
                kind = "gemm_below_roofline" if g.category == GEMM else "attention_below_roofline"
                tool = "compile_kernel"
            else:
                kind, tool = "memory_bound_below_bandwidth", "compile_kernel"
            rate = (
                f"{r.tflops:.0f} TFLOP/s"
                if r.bound == "compute" and r.tflops
                else f"{r.tbps:.2f} TB/s"
                if r.tbps
                else "?"
            )
            add(
                kind,
                f"{_n(g.calls, 'call')}, {_ms(g.time_us)} at {r.pct:.0f}% of roofline "
                f"({r.bound}-bound, {rate}); at {ACHIEVABLE:.0%} of peak: {_ms(target_us)}.",
                saving,
                tool,
                label[:80],
            )
    out.sort(key=lambda f: -f.saving_us)
    return out


def memcpy_labels(groups: list[OpGroup]) -> list[str]:
    return [g.name for g in groups if g.category == MEMCPY][:3]


HOST_HOTSPOT_SHARE = 0.10  # a host op worth naming on its own in a CPU trace
HOST_HOTSPOTS = 2  # the rest are in top_ops
_FUSABLE = (ELEMENTWISE, REDUCTION, NORM)


def host_findings(groups: list[OpGroup], total_us: float) -> list[Finding]:
    """Findings of a trace without GPU activity, from its top-level host ops: the ops that take
    most of the time, and chains of separate elementwise/reduction ops that one fused kernel
    would do in a single pass. Times are host (CPU) times: they rank the work, they say nothing
    of GPU speed."""
    out: list[Finding] = []
    if total_us <= 0:
        return out

    add = functools.partial(_add_finding, out, total_us)

    for g in groups[:HOST_HOTSPOTS]:
        if g.time_us < HOST_HOTSPOT_SHARE * total_us:
            break
        label = f"{g.name} {g.shapes}".strip()
        add(
            "host_hotspot",
            f"{label[:80]}: {_pct(g.time_us, total_us):.0f}% of host op time "
            f"({_n(g.calls, 'call')}, {_ms(g.time_us)}): a target for a kernel of your own.",
            g.time_us,
            "compile_kernel",
            g.name[:80],
        )
    fusable = [g for g in groups if g.category in _FUSABLE and g.name.startswith("aten::")]
    if len(fusable) >= CHAIN_MIN:
        spent = sum(g.time_us for g in fusable)
        names = ", ".join(dict.fromkeys(g.name for g in fusable[:5]))
        # One fused pass still costs about what the largest of them does.
        saving = spent - max(g.time_us for g in fusable)
        add(
            "unfused_elementwise",
            f"{len(fusable)} separate elementwise/reduction ops ({names}) take {_ms(spent)}, "
            f"{_pct(spent, total_us):.0f}% of host op time; each makes its own pass over memory "
            "where one fused kernel would make one.",
            saving,
            "compile_kernel",
            names[:80],
        )
    out.sort(key=lambda f: -f.saving_us)
    return out
