"""analyze_trace: resolve a trace id or path, analyze it (cached by content), index the result."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from loom_mcp.config import LoomConfig
from loom_mcp.errors import ErrorCode, LoomError
from loom_mcp.sandbox import safefs
from loom_mcp.store import ArtifactStore, Ledger
from loom_mcp.traces.models import ScrubbedModel, TraceAnalysis
from loom_mcp.traces.secrets import scrub_text


# Everything in it (next_step quotes a finding) leaves through the secret scrubber. (A comment,
# not a docstring: a docstring would become the published output schema's description.)
class AnalyzeTraceResult(ScrubbedModel):
    analysis_id: str = Field(
        description="Full tables, CSVs and the breakdown PNG: loom://traces/{analysis_id}/analysis"
    )
    analysis: TraceAnalysis
    next_step: str


def resolve_trace(config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, trace: str) -> Path:
    from loom_mcp.profiling.runner import MAX_TRACE_FILE_BYTES, artifact_path_with_suffix

    row = ledger.run(trace)
    if row is not None:
        if row["kind"] != "trace":
            raise LoomError(ErrorCode.BAD_INPUT, f"{trace} is a {row['kind']} record, not a trace")
        suffix = ".sqlite" if row["summary_json"].find('"nsys"') >= 0 else ".json"
        # The store is the server's own: resolved here, opened with no link followed after.
        return artifact_path_with_suffix(artifacts, row["record_sha"], suffix).resolve()
    path = config.check_allowed(Path(trace), "trace")  # resolved once, here
    try:
        # A regular file reached through no symlink now (what was checked is what is read),
        # within the trace size cap; trace readers open this resolved path.
        return safefs.check_resolved_file(path, MAX_TRACE_FILE_BYTES)
    except LoomError as exc:
        if exc.code == ErrorCode.NOT_FOUND:
            raise LoomError(ErrorCode.NOT_FOUND, f"no trace id or file {scrub_text(repr(trace))}") from None
        raise


def analyze(
    config: LoomConfig, ledger: Ledger, artifacts: ArtifactStore, trace: str, baseline: str | None, top_k: int
) -> AnalyzeTraceResult:
    from loom_mcp.traces.cache import analyze_trace_cached

    trace_path = resolve_trace(config, ledger, artifacts, trace)
    base_path = resolve_trace(config, ledger, artifacts, baseline) if baseline else None
    analysis = analyze_trace_cached(trace_path, baseline=base_path, top_k=top_k, cache_root=config.cache_dir / "traces")
    analysis_id = Path(analysis.artifact_dir).name if analysis.artifact_dir else "unknown"
    analysis.artifact_dir = None  # a server path means nothing to the agent; the resource does
    if analysis.findings:
        top = analysis.findings[0]
        of = "of the span" if analysis.timeline.gpu_events else "of host op time (a CPU trace)"
        next_step = f"biggest opportunity: {top.kind} (up to {top.saving_pct:.0f}% {of}); next: {top.next_tool}"
    else:
        next_step = "no ranked opportunity found; profile a larger or more representative workload"
    return AnalyzeTraceResult(analysis_id=analysis_id, analysis=analysis, next_step=next_step)


def analysis_file(config: LoomConfig, analysis_id: str, name: str) -> Path:
    if not analysis_id.isalnum():
        raise LoomError(ErrorCode.BAD_INPUT, "bad analysis id")
    path = config.cache_dir / "traces" / analysis_id / name
    if not path.is_file():
        raise LoomError(ErrorCode.NOT_FOUND, f"no {name} for analysis {analysis_id}")
    return path
