"""Trace analysis: readers (Kineto/PyTorch JSON, rocprofv3 JSON, nsys SQLite), timeline
breakdown, kernel-to-op linking, categories, roofline, ranked findings and diffs."""

import importlib
from typing import Any

# Attribute -> submodule. Loaded on first use so that importing the result models (which the MCP
# server needs at start for its schemas) does not pull in numpy and the readers.
_LAZY = {
    "analyze_trace_file": "api",
    "analyze_trace_cached": "cache",
    "trace_content_hash": "cache",
    "scrub_trace": "scrub",
    "ANALYSIS_VERSION": "summary",
    **{
        name: "models"
        for name in (
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
        )
    },
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"loom_mcp.traces.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'loom_mcp.traces' has no attribute {name!r}")


__all__ = sorted(_LAZY)  # every lazily loaded name, and nothing else
