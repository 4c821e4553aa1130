"""Cut a full analysis down to the compact summary the agent reads (a few KB)."""

from __future__ import annotations

import math

from loom_mcp.traces.analysis import FullAnalysis
from loom_mcp.traces.models import (
    CategoryRow,
    DiffSummary,
    LinkingSummary,
    MetadataNote,
    OpRow,
    Roofline,
    TimelineSummary,
    TraceAnalysis,
)

# 2: names, devices and artifacts are scrubbed of secrets (entries of 1 may hold them).
# 3: a trace without GPU activity lists its host ops and findings (entries of 2 have none).
ANALYSIS_VERSION = "3"
SUMMARY_BUDGET_BYTES = 4000
MAX_FINDINGS = 6


def sig3(x: float | None) -> float | None:
    """Three significant digits: enough to act on, short to read."""
    if x is None or not math.isfinite(x):
        return None
    if x == 0:
        return 0.0
    return round(x, max(0, 2 - int(math.floor(math.log10(abs(x))))))


def _pct(x: float, total: float) -> float:
    return round(100.0 * x / total, 1) if total > 0 else 0.0


def timeline_summary(fa: FullAnalysis) -> TimelineSummary:
    t = fa.primary
    if t is None:  # no GPU activity: every figure is 0
        fields = TimelineSummary.model_fields.items()
        return TimelineSummary(device=fa.device_name, **{n: 0 for n, f in fields if f.is_required() and n != "device"})
    r = lambda x: round(x, 1)  # noqa: E731
    # Rounded parts are re-balanced so they still add up to the rounded total.
    parts = [r(t.computation_us), r(t.exposed_comm_us), r(t.exposed_memcpy_us), r(t.idle_short_us)]
    idle_long = round(r(t.total_us) - sum(parts), 1)
    return TimelineSummary(
        device=fa.device_name,
        total_us=r(t.total_us),
        computation_us=parts[0],
        exposed_comm_us=parts[1],
        exposed_memcpy_us=parts[2],
        busy_us=round(parts[0] + parts[1] + parts[2], 1),
        idle_us=round(parts[3] + idle_long, 1),
        idle_short_us=parts[3],
        idle_long_us=idle_long,
        short_gap_us=t.short_gap_threshold_us,
        host_bound_idle_us=r(t.host_bound_idle_us),
        busy_pct=_pct(t.busy_us, t.total_us),
        gpu_events=t.events,
        other_devices=len(fa.timelines) - 1,
    )


def linking_summary(fa: FullAnalysis) -> LinkingSummary:
    s = fa.links
    tot = s.gpu_time_us
    op_pct = _pct(s.with_op_time_us, tot)
    graph_pct = _pct(s.graph_time_us, tot)
    unlinked_pct = _pct(s.no_launch_time_us, tot)
    launch_pct = _pct(s.with_launch_time_us, tot)
    notes: list[str] = []
    if s.graph_events:
        notes.append(
            f"{graph_pct}% of GPU time ({s.graph_events} kernels) was replayed by "
            f"{s.graph_launches} graph launch(es); those kernels are listed by kernel name, "
            "since the launching op does not say what each computes"
        )
    if s.no_launch:
        why = ""
        if s.host_launches == 0:
            why = ": the trace has no host API records"
        elif s.no_launch_before_host == s.no_launch:
            why = ": launched before the profiling window opened"
        notes.append(f"{unlinked_pct}% of GPU time ({s.no_launch} activities) has no launch record{why}")
    direct = max(0.0, s.with_launch_time_us - s.with_op_time_us - s.graph_time_us)
    if direct > 0.01 * tot:
        notes.append(f"{_pct(direct, tot)}% of GPU time was launched outside any profiled op")
    if s.launches_without_gpu > max(50, s.host_launches // 10):
        cap = f" ({s.stream_capture_calls} stream-capture calls seen)" if s.stream_capture_calls else ""
        notes.append(
            f"{s.launches_without_gpu} kernel-launch calls have no GPU activity{cap}: captured "
            "into a graph or cut off by the window; that work is not in the timeline"
        )
    return LinkingSummary(
        gpu_events=s.gpu_events,
        op_pct=op_pct,
        launch_pct=launch_pct,
        graph_pct=graph_pct,
        graph_launches=s.graph_launches,
        unlinked_pct=unlinked_pct,
        launches_without_gpu=s.launches_without_gpu,
        # Linking concerns GPU activity: a trace with none has nothing left unattributed.
        partial=s.gpu_events > 0 and (op_pct < 95.0 or s.launches_without_gpu > max(50, s.host_launches // 10)),
        notes=notes,
    )


def metadata_note(fa: FullAnalysis) -> MetadataNote:
    blocks = fa.metadata_blocks
    if not blocks:
        return MetadataNote(found=False, note="no metadata or environment block in the trace")
    keys = sum(b[0] for b in blocks.values())
    secret = any(b[1] or b[2] for b in blocks.values())
    note = (
        f"{len(blocks)} block(s) outside the profiler schema with {keys} keys"
        + ("; some look like credentials" if secret else "")
        + "; values are never reported. Scrub the trace before sharing it."
    )
    return MetadataNote(found=True, blocks=sorted(blocks)[:5], keys=keys, secret_like=secret, note=note)


def op_rows(fa: FullAnalysis, top_k: int) -> list[OpRow]:
    tot = fa.op_time_us
    rows = []
    for g in fa.groups[: max(0, top_k)]:
        r = g.roof
        roof = None
        if r.tflops is not None or r.tbps is not None:
            roof = Roofline(
                tflops=sig3(r.tflops),
                tbps=sig3(r.tbps),
                pct=round(r.pct, 1) if r.pct is not None else None,
                bound=r.bound,  # type: ignore[arg-type]
            )
        rows.append(
            OpRow(
                name=g.name[:64],
                shapes=g.shapes or None,
                cat=g.category,
                via=g.via,  # type: ignore[arg-type]
                calls=g.calls,
                us=round(g.time_us, 1),
                pct=_pct(g.time_us, tot),
                roof=roof,
            )
        )
    return rows


def category_rows(fa: FullAnalysis) -> list[CategoryRow]:
    tot = fa.gpu_time_us
    return [
        CategoryRow(
            category=c.category,
            us=round(c.time_us, 1),
            pct=_pct(c.time_us, tot),
            n=c.count,
            top=(c.top[0] if c.top else "")[:48],
        )
        for c in fa.categories
    ]


def build_summary(
    fa: FullAnalysis,
    top_k: int,
    diff: DiffSummary | None = None,
    artifact_dir: str | None = None,
    artifacts: list[str] | None = None,
) -> TraceAnalysis:
    summary = TraceAnalysis(
        analysis_version=ANALYSIS_VERSION,
        source_format=fa.source_format,  # type: ignore[arg-type]
        trace=fa.trace,
        device=fa.device_name,
        peak_known=fa.peak is not None,
        timeline=timeline_summary(fa),
        categories=category_rows(fa),
        top_ops=op_rows(fa, top_k),
        linking=linking_summary(fa),
        findings=fa.findings[:MAX_FINDINGS],
        metadata=metadata_note(fa),
        diff=diff,
        notes=list(fa.notes),
        artifact_dir=artifact_dir,
        artifacts=list(artifacts or []),
    )
    return fit_budget(summary)


def fit_budget(s: TraceAnalysis, budget: int = SUMMARY_BUDGET_BYTES) -> TraceAnalysis:
    """Trim the least important rows until the serialized summary fits the budget."""

    def size() -> int:
        return len(s.model_dump_json())

    if size() <= budget:
        return s
    s.notes.append("summary trimmed to 4 KB; full tables are in the artifacts")
    steps = [
        lambda: len(s.top_ops) > 5 and s.top_ops.pop() is not None,
        lambda: len(s.findings) > 4 and s.findings.pop() is not None,
        lambda: s.diff is not None and len(s.diff.ops) > 4 and s.diff.ops.pop() is not None,
        lambda: len(s.categories) > 6 and s.categories.pop() is not None,
        lambda: len(s.top_ops) > 3 and s.top_ops.pop() is not None,
        lambda: len(s.linking.notes) > 1 and s.linking.notes.pop() is not None,
        lambda: len(s.notes) > 1 and s.notes.pop(0) is not None,  # keep the trim note
        lambda: len(s.findings) > 2 and s.findings.pop() is not None,
        lambda: s.diff is not None and len(s.diff.categories) > 4 and s.diff.categories.pop() is not None,
        lambda: len(s.top_ops) > 1 and s.top_ops.pop() is not None,
        lambda: s.diff is not None and len(s.diff.ops) > 2 and s.diff.ops.pop() is not None,
        lambda: len(s.findings) > 1 and s.findings.pop() is not None,
        lambda: len(s.categories) > 3 and s.categories.pop() is not None,
        lambda: len(s.linking.notes) > 0 and s.linking.notes.pop() is not None,
    ]
    for step in steps:
        while size() > budget and step():
            pass
    while size() > budget and len(s.notes) > 1:
        s.notes.pop(0)  # the trim note itself stays last
    return s
