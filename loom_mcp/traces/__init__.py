"""Trace analysis: readers (Kineto/PyTorch JSON, rocprofv3 JSON, nsys SQLite), timeline
breakdown, kernel-to-op linking, categories, roofline, ranked findings and diffs."""

from loom_mcp.traces.api import analyze_trace_file
from loom_mcp.traces.cache import analyze_trace_cached, trace_content_hash
from loom_mcp.traces.models import (
    CategoryRow,
    DiffRow,
    DiffSummary,
    Finding,
    LinkingSummary,
    MetadataNote,
    OpRow,
    Roofline,
    ScrubReport,
    TimelineSummary,
    TraceAnalysis,
)
from loom_mcp.traces.scrub import scrub_trace
from loom_mcp.traces.summary import ANALYSIS_VERSION

__all__ = [
    "ANALYSIS_VERSION",
    "CategoryRow",
    "DiffRow",
    "DiffSummary",
    "Finding",
    "LinkingSummary",
    "MetadataNote",
    "OpRow",
    "Roofline",
    "ScrubReport",
    "TimelineSummary",
    "TraceAnalysis",
    "analyze_trace_cached",
    "analyze_trace_file",
    "scrub_trace",
    "trace_content_hash",
]
