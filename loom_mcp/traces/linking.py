"""Link each GPU activity to the host call that launched it and to the op that made that call.

Chain: GPU event --correlation--> launch (runtime/driver API call) --External id--> op.
When a launch carries no External id (graph launches in some ROCm traces, nsys exports) the
op is the innermost op open on the launching thread at launch time. Graph launches fan out to
every kernel sharing their correlation id; those kernels are marked, because the op that
launched the graph says nothing about what each of its kernels computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loom_mcp.traces.events import TraceData


@dataclass
class LinkStats:
    gpu_events: int
    gpu_time_us: float
    with_launch: int
    with_launch_time_us: float
    with_op: int
    with_op_time_us: float
    graph_events: int
    graph_time_us: float
    graph_launches: int
    no_launch: int
    no_launch_time_us: float
    no_launch_before_host: int  # of which: launched before the profiling window opened
    launches_without_gpu: int  # kernel-launch calls whose work never shows up on the GPU
    host_launches: int
    stream_capture_calls: int


@dataclass
class Links:
    launch: np.ndarray  # per GPU event: index into the launch columns, -1 if none
    op: np.ndarray  # per GPU event: index into the op columns, -1 if none
    graph: np.ndarray  # per GPU event: launched by a graph launch (or a call that fanned out)
    stats: LinkStats


def _lookup(keys: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index in `table` of each key's first occurrence (file order), -1 when absent."""
    out = np.full(len(keys), -1, dtype=np.int64)
    if len(table) == 0 or len(keys) == 0:
        return out
    order = np.argsort(table, kind="stable")
    st = table[order]
    pos = np.searchsorted(st, keys)
    pos = np.minimum(pos, len(st) - 1)
    hit = (st[pos] == keys) & (keys >= 0)
    out[hit] = order[pos[hit]]
    return out


def _fill_from_flows(td: TraceData, g_corr: np.ndarray) -> np.ndarray:
    """GPU events without a correlation arg get the id of the ac2g flow ending on them."""
    missing = np.flatnonzero(g_corr < 0)
    if len(missing) == 0 or len(td.f_id) == 0:
        return g_corr
    flows = {(d, s, round(t, 3)): i for d, s, t, i in zip(td.f_dev, td.f_stream, td.f_ts, td.f_id, strict=True)}
    g_corr = g_corr.copy()
    for i in missing.tolist():
        fid = flows.get((td.g_dev[i], td.g_stream[i], round(td.g_ts[i], 3)))
        if fid is not None:
            g_corr[i] = fid
    return g_corr


def enclosing_ops(td: TraceData, launch_idx: np.ndarray) -> np.ndarray:
    """For each launch index, the innermost op open on its thread when it was called."""
    out = np.full(len(launch_idx), -1, dtype=np.int64)
    if len(launch_idx) == 0 or len(td.o_ts) == 0:
        return out
    o_thread = td.np("o_thread")
    o_ts = td.np("o_ts")
    o_end = o_ts + td.np("o_dur")
    l_thread = td.np("l_thread")[launch_idx]
    l_ts = td.np("l_ts")[launch_idx]
    for thread in np.unique(l_thread).tolist():
        ops = np.flatnonzero(o_thread == thread)
        if len(ops) == 0:
            continue
        # Outer ops first when two start together, so the stack stays a nesting chain.
        ops = ops[np.lexsort((-(o_end[ops] - o_ts[ops]), o_ts[ops]))]
        q = np.flatnonzero(l_thread == thread)
        q = q[np.argsort(l_ts[q], kind="stable")]
        starts = o_ts[ops].tolist()
        ends = o_end[ops].tolist()
        ids = ops.tolist()
        stack: list[int] = []
        j = 0
        n = len(starts)
        for qi in q.tolist():
            t = l_ts[qi]
            while j < n and starts[j] <= t:
                while stack and ends[stack[-1]] <= starts[j]:
                    stack.pop()
                stack.append(j)
                j += 1
            while stack and ends[stack[-1]] < t:
                stack.pop()
            if stack:
                out[qi] = ids[stack[-1]]
    return out


def _is_launch_api(name: str) -> bool:
    return "Launch" in name and "HostFunc" not in name


def link(td: TraceData) -> Links:
    n = td.n_gpu
    g_dur = td.np("g_dur")
    g_corr = _fill_from_flows(td, td.np("g_corr"))
    launch = _lookup(g_corr, td.np("l_corr"))
    has_launch = launch >= 0

    l_ext = td.np("l_ext")
    ext = np.full(n, -1, dtype=np.int64)
    ext[has_launch] = l_ext[launch[has_launch]]
    g_ext = td.np("g_ext")
    ext = np.where(ext >= 0, ext, g_ext)

    o_ext = td.np("o_ext")
    op = _lookup(ext, o_ext) if len(o_ext) else np.full(n, -1, dtype=np.int64)

    # Launches with no op by id: fall back to time nesting on the launching thread.
    need = has_launch & (op < 0)
    if need.any() and len(td.o_ts):
        uniq, inv = np.unique(launch[need], return_inverse=True)
        op[need] = enclosing_ops(td, uniq)[inv]

    # Graph fan-out: a graph-launch API, or several GPU activities behind one call.
    graph = np.zeros(n, dtype=bool)
    graph_launches = 0
    if has_launch.any():
        names = td.names
        l_name = td.np("l_name")
        graph_name_ids = np.array([i for i, s in enumerate(names.values) if "GraphLaunch" in s], dtype=np.int64)
        per_launch = np.bincount(launch[has_launch], minlength=len(td.l_ts))
        fan = per_launch > 1
        if len(graph_name_ids):
            fan |= np.isin(l_name, graph_name_ids) & (per_launch > 0)
        graph[has_launch] = fan[launch[has_launch]]
        graph_launches = int(np.count_nonzero(fan))

    no_launch = ~has_launch
    g_ts = td.np("g_ts")
    if len(td.l_ts):
        # Correlation ids grow monotonically: a smaller id than any recorded call means the
        # launch happened before the profiling window opened.
        early = (g_ts < float(np.min(td.np("l_ts")))) | ((g_corr >= 0) & (g_corr < int(np.min(td.np("l_corr")))))
    else:
        early = np.zeros(n, dtype=bool)
    launch_ids = [i for i, s in enumerate(td.names.values) if _is_launch_api(s)]
    if len(td.l_ts) and launch_ids:
        is_launch = np.isin(td.np("l_name"), np.array(launch_ids, dtype=np.int64))
        unseen = ~np.isin(td.np("l_corr")[is_launch], g_corr)
        launches_without_gpu = int(np.count_nonzero(unseen))
    else:
        launches_without_gpu = 0

    stats = LinkStats(
        gpu_events=n,
        gpu_time_us=float(g_dur.sum()),
        with_launch=int(has_launch.sum()),
        with_launch_time_us=float(g_dur[has_launch].sum()),
        with_op=int((op >= 0).sum()),
        with_op_time_us=float(g_dur[op >= 0].sum()),
        graph_events=int(graph.sum()),
        graph_time_us=float(g_dur[graph].sum()),
        graph_launches=graph_launches,
        no_launch=int(no_launch.sum()),
        no_launch_time_us=float(g_dur[no_launch].sum()),
        no_launch_before_host=int(np.count_nonzero(no_launch & early)),
        launches_without_gpu=launches_without_gpu,
        host_launches=len(td.l_ts),
        stream_capture_calls=td.stream_capture_calls,
    )
    return Links(launch=launch, op=op, graph=graph, stats=stats)
