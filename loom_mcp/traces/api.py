"""analyze_trace_file: read, analyse, optionally diff against a baseline, write artifacts."""

from __future__ import annotations

from pathlib import Path

from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.traces.analysis import analyze
from loom_mcp.traces.diff import diff
from loom_mcp.traces.models import TraceAnalysis
from loom_mcp.traces.render import write_artifacts
from loom_mcp.traces.summary import build_summary

SUMMARY_FILE = "summary.json"


def analyze_trace_file(
    trace: Path,
    *,
    baseline: Path | None = None,
    top_k: int = 10,
    out_dir: Path | None = None,
) -> TraceAnalysis:
    """Analyse one trace (Kineto JSON[.gz], rocprofv3 JSON, nsys SQLite).

    With `baseline`, the summary carries what got faster or slower. With `out_dir`, full tables
    (CSV, JSON), a PNG of the breakdown and the summary itself are written there.
    """
    if top_k < 0:
        raise LoomError(ErrorCode.BAD_INPUT, "top_k must be >= 0")
    trace = Path(trace)
    fa = analyze(trace)
    fd = diff(analyze(Path(baseline)), fa) if baseline is not None else None
    artifacts: list[str] = []
    if out_dir is not None:
        out_dir = Path(out_dir)
        artifacts = write_artifacts(fa, fd, out_dir) + [SUMMARY_FILE]
    summary = build_summary(
        fa,
        top_k,
        fd.summary if fd else None,
        str(out_dir) if out_dir is not None else None,
        artifacts,
    )
    if out_dir is not None:
        (out_dir / SUMMARY_FILE).write_text(summary.model_dump_json(indent=1))
    return summary
