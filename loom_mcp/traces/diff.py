"""What got faster or slower between a baseline trace and a new one."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from loom_mcp.traces.analysis import FullAnalysis
from loom_mcp.traces.models import DiffRow, DiffSummary


@dataclass
class FullDiff:
    summary: DiffSummary
    categories: list[DiffRow]
    ops: list[DiffRow]
    kernels: list[DiffRow]
    totals: list[DiffRow]


def _rows(base: dict[str, float], new: dict[str, float]) -> list[DiffRow]:
    rows = []
    for k in set(base) | set(new):
        b, n = base.get(k, 0.0), new.get(k, 0.0)
        rows.append(
            DiffRow(
                name=k[:64],
                base_us=round(b, 1),
                new_us=round(n, 1),
                delta_us=round(n - b, 1),
                delta_pct=round(100.0 * (n - b) / b, 1) if b > 0 else None,
            )
        )
    rows.sort(key=lambda r: -abs(r.delta_us))
    return rows


def _by(items: list, key: str, attr: str = "time_us") -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for it in items:
        out[getattr(it, key)] += getattr(it, attr)
    return out


def diff(base: FullAnalysis, new: FullAnalysis, top: int = 6) -> FullDiff:
    cats = _rows(_by(base.categories, "category"), _by(new.categories, "category"))
    # Ops are matched by name (op name, or short kernel name for graph/unlinked kernels):
    # shapes and kernel choices may legitimately change between the two runs.
    ops = _rows(_by(base.groups, "name"), _by(new.groups, "name"))
    kernels = _rows(_by(base.kernels, "name"), _by(new.kernels, "name"))
    bt, nt = base.primary, new.primary
    fields = (
        "total_us",
        "busy_us",
        "computation_us",
        "exposed_comm_us",
        "exposed_memcpy_us",
        "idle_us",
        "idle_short_us",
        "idle_long_us",
        "host_bound_idle_us",
    )
    totals = _rows(
        {f: getattr(bt, f) for f in fields} if bt else {},
        {f: getattr(nt, f) for f in fields} if nt else {},
    )
    b_total = bt.total_us if bt else 0.0
    n_total = nt.total_us if nt else 0.0
    summary = DiffSummary(
        baseline=base.trace,
        base_total_us=round(b_total, 1),
        new_total_us=round(n_total, 1),
        base_busy_us=round(bt.busy_us if bt else 0.0, 1),
        new_busy_us=round(nt.busy_us if nt else 0.0, 1),
        speedup=round(b_total / n_total, 3) if n_total > 0 and b_total > 0 else None,
        categories=[r for r in cats if r.delta_us != 0][:top],
        ops=[r for r in ops if r.delta_us != 0][:top],
    )
    return FullDiff(summary=summary, categories=cats, ops=ops, kernels=kernels, totals=totals)
