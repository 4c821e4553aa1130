"""Per-op groups, per-kernel and per-category tables, built with numpy group-bys."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loom_mcp.traces.categories import CATEGORIES, classify, op_category, short_name
from loom_mcp.traces.events import KIND_KERNEL, OpSig, TraceData
from loom_mcp.traces.linking import Links
from loom_mcp.traces.perfmodels import Work, model, shapes_label
from loom_mcp.traces.roofline import NO_ROOF, Roof, place

CAT_INDEX = {c: i for i, c in enumerate(CATEGORIES)}


@dataclass
class OpGroup:
    name: str  # op name, or short kernel name for kernel groups
    full_name: str  # op name, or full kernel name
    shapes: str
    via: str  # "op" | "graph" | "no-op" | "unlinked"
    category: str
    calls: int
    kernels: int
    time_us: float
    device_bytes: int  # bytes moved by memcpy/memset activities (from the trace)
    sig: OpSig | None = None
    work: Work | None = None
    roof: Roof = NO_ROOF
    first_ts: float = 0.0


@dataclass
class KernelStat:
    name: str
    short: str
    category: str
    count: int
    time_us: float
    min_us: float
    max_us: float
    graph: int


@dataclass
class CategoryStat:
    category: str
    time_us: float
    count: int
    top: list[str] = field(default_factory=list)


def _sig_group(
    s: OpSig, category: str, calls: int, kernels: int, time_us: float, first_ts: float, device_bytes: int = 0
) -> OpGroup:
    """The group of op signature `s` (via "op"), with the work one call of it does."""
    return OpGroup(
        name=s.name,
        full_name=s.name,
        shapes=shapes_label(s),
        via="op",
        category=category,
        calls=calls,
        kernels=kernels,
        time_us=time_us,
        device_bytes=device_bytes,
        sig=s,
        work=model(s),
        first_ts=first_ts,
    )


def event_categories(td: TraceData, links: Links) -> np.ndarray:
    """Category index per GPU event; classified once per (kernel name, launching op name)."""
    n = td.n_gpu
    g_name = td.np("g_name")
    g_kind = td.np("g_kind")
    op = links.op
    o_sig = td.np("o_sig")
    op_name = np.full(n, -1, dtype=np.int64)
    has = op >= 0
    if has.any():
        op_name[has] = o_sig[op[has]]
    key = (g_name.astype(np.int64) * 4 + g_kind) * (len(td.sigs) + 1) + (op_name + 1)
    uniq, inv = np.unique(key, return_inverse=True)
    cats = np.empty(len(uniq), dtype=np.int64)
    for i, k in enumerate(uniq.tolist()):
        sig = k % (len(td.sigs) + 1) - 1
        rest = k // (len(td.sigs) + 1)
        kind, name_id = rest % 4, rest // 4
        opn = td.sigs[sig].name if sig >= 0 else None
        cats[i] = CAT_INDEX[classify(td.names[name_id], kind, opn)]
    return cats[inv]


def op_groups(td: TraceData, links: Links, cat: np.ndarray, peak: Any | None) -> list[OpGroup]:
    """Group GPU time by launching op signature; graph-replayed and unlinked kernels are
    grouped by kernel name instead, so nothing hides in a catch-all row."""
    n = td.n_gpu
    if n == 0:
        return []
    dur = td.np("g_dur")
    ts = td.np("g_ts")
    g_name = td.np("g_name").astype(np.int64)
    g_kind = td.np("g_kind")
    op = links.op
    n_sig = len(td.sigs)
    by_op = (op >= 0) & ~links.graph
    sig = np.full(n, -1, dtype=np.int64)
    if by_op.any():
        sig[by_op] = td.np("o_sig")[op[by_op]]
    via = np.where(by_op, 0, np.where(links.graph, 1, np.where(links.launch >= 0, 2, 3)))  # op, graph, no-op, unlinked
    key = np.where(by_op, sig, n_sig + g_name * 4 + via)
    uniq, inv = np.unique(key, return_inverse=True)
    g = len(uniq)
    time = np.bincount(inv, weights=dur, minlength=g)
    kernels = np.bincount(inv, minlength=g)
    nbytes = np.bincount(inv, weights=np.where(g_kind != KIND_KERNEL, td.np("g_bytes"), 0), minlength=g)
    first = np.full(g, np.inf)
    np.minimum.at(first, inv, ts)
    # Calls: distinct op instances for op groups, activities for the others.
    calls = kernels.copy()
    if by_op.any():
        pair = np.unique(inv[by_op] * (len(td.o_ts) + 1) + op[by_op])
        calls_op = np.bincount(pair // (len(td.o_ts) + 1), minlength=g)
        is_op_group = uniq < n_sig
        calls[is_op_group] = calls_op[is_op_group]
    ncat = len(CATEGORIES)
    cat_time = np.bincount(inv * ncat + cat, weights=dur + 1e-9, minlength=g * ncat).reshape(g, ncat)
    dominant = cat_time.argmax(axis=1)
    vias = ("op", "graph", "no-op", "unlinked")
    groups: list[OpGroup] = []
    for i, k in enumerate(uniq.tolist()):
        if k < n_sig:
            grp = _sig_group(
                td.sigs[k],
                CATEGORIES[dominant[i]],
                int(calls[i]),
                int(kernels[i]),
                float(time[i]),
                float(first[i]),
                int(nbytes[i]),
            )
            grp.roof = place(grp.work, grp.calls, grp.time_us, peak)
        else:
            rest = k - n_sig
            name_id, v = rest // 4, rest % 4
            full = td.names[name_id]
            grp = OpGroup(
                name=short_name(full),
                full_name=full,
                shapes="",
                via=vias[v],
                category=CATEGORIES[dominant[i]],
                calls=int(calls[i]),
                kernels=int(kernels[i]),
                time_us=float(time[i]),
                device_bytes=int(nbytes[i]),
                first_ts=float(first[i]),
            )
            if grp.device_bytes and grp.time_us > 0:
                tbps = grp.device_bytes / (grp.time_us * 1e-6) / 1e12
                grp.roof = Roof(None, tbps, None, None, None)
        groups.append(grp)
    groups.sort(key=lambda x: -x.time_us)
    return groups


def kernel_stats(td: TraceData, links: Links, cat: np.ndarray) -> list[KernelStat]:
    if td.n_gpu == 0:
        return []
    dur = td.np("g_dur")
    g_name = td.np("g_name").astype(np.int64)
    uniq, inv = np.unique(g_name, return_inverse=True)
    g = len(uniq)
    time = np.bincount(inv, weights=dur, minlength=g)
    count = np.bincount(inv, minlength=g)
    mn = np.full(g, np.inf)
    mx = np.zeros(g)
    np.minimum.at(mn, inv, dur)
    np.maximum.at(mx, inv, dur)
    graph = np.bincount(inv, weights=links.graph.astype(float), minlength=g)
    ncat = len(CATEGORIES)
    cat_time = np.bincount(inv * ncat + cat, weights=dur + 1e-9, minlength=g * ncat).reshape(g, ncat)
    dominant = cat_time.argmax(axis=1)
    out = [
        KernelStat(
            name=td.names[int(u)],
            short=short_name(td.names[int(u)]),
            category=CATEGORIES[int(dominant[i])],
            count=int(count[i]),
            time_us=float(time[i]),
            min_us=float(mn[i]),
            max_us=float(mx[i]),
            graph=int(graph[i]),
        )
        for i, u in enumerate(uniq.tolist())
    ]
    out.sort(key=lambda k: -k.time_us)
    return out


def category_stats(kernels: list[KernelStat]) -> list[CategoryStat]:
    stats: dict[str, CategoryStat] = {}
    for k in kernels:  # sorted by time, so the first names seen are the largest
        s = stats.setdefault(k.category, CategoryStat(k.category, 0.0, 0))
        s.time_us += k.time_us
        s.count += k.count
        if len(s.top) < 3:
            s.top.append(k.short)
    return sorted(stats.values(), key=lambda s: -s.time_us)


# The profiler's own per-step marker spans every op of its step: as a "top-level op" it would
# hide everything under it.
_STEP_MARKER = "ProfilerStep#"


def host_op_groups(td: TraceData) -> list[OpGroup]:
    """A trace without GPU activity (a CPU run): host ops grouped by signature, each op's own
    inclusive time counted only when no other op encloses it on its thread, so nested aten
    calls are not counted twice. Largest first; `via` is "op", `kernels` 0."""
    n = len(td.o_ts)
    if n == 0:
        return []
    sig = td.np("o_sig").astype(np.int64)
    ts = td.np("o_ts")
    dur = td.np("o_dur")
    thread = td.np("o_thread")
    marker = np.array([s.name.startswith(_STEP_MARKER) for s in td.sigs], dtype=bool)
    keep = ~marker[sig]
    top = np.zeros(n, dtype=bool)
    for t in np.unique(thread[keep]).tolist():
        idx = np.flatnonzero(keep & (thread == t))
        # Enclosing ops first when two start together.
        idx = idx[np.lexsort((-dur[idx], ts[idx]))]
        end = -np.inf
        for i in idx.tolist():
            if ts[i] >= end:
                top[i] = True
                end = ts[i] + dur[i]
    if not top.any():
        return []
    uniq, inv = np.unique(sig[top], return_inverse=True)
    time = np.bincount(inv, weights=dur[top], minlength=len(uniq))
    calls = np.bincount(inv, minlength=len(uniq))
    first = np.full(len(uniq), np.inf)
    np.minimum.at(first, inv, ts[top])
    # Host time includes dispatch and allocation: rates from it would say nothing of the op's
    # kernel, so host groups carry no roofline placement.
    groups = [
        _sig_group(s, op_category(s.name), int(calls[i]), 0, float(time[i]), float(first[i]))
        for i, s in enumerate(td.sigs[k] for k in uniq.tolist())
    ]
    groups.sort(key=lambda g: (-g.time_us, g.first_ts))
    return groups
