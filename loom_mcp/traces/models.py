"""Result contract of `analyze_trace`: a compact summary (a few KB) for the agent.

Full tables live in artifact files next to it. Times are microseconds; `pct` fields are
percentages (0-100) of the primary device's total span unless the description says otherwise.
Unknown values are null, never invented.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from loom_mcp.fields import empty_list, optional
from loom_mcp.traces.secrets import scrub_any

NextTool = Literal["benchmark", "compile_kernel", "profile", "run_validation", "analyze_trace"]


class ScrubbedModel(BaseModel):
    """Base of every model the trace tools return: on the way out (model_dump, JSON, the MCP
    result) every string in it, at any depth, passes the secret scrubber. The readers already
    scrub what they read; this is the backstop that a field added later cannot bypass."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _scrub_out(self, handler: SerializerFunctionWrapHandler):  # no return type: a typed
        # one would replace the JSON schema of every subclass with that type's
        return scrub_any(handler(self))


_M = ScrubbedModel


class TimelineSummary(_M):
    """computation + exposed_comm + exposed_memcpy + idle_short + idle_long == total."""

    device: str | None = Field(description="Device the timeline is for (the busiest one)")
    total_us: float = Field(description="First GPU activity start to last end")
    computation_us: float
    exposed_comm_us: float = Field(description="Communication not overlapped by computation")
    exposed_memcpy_us: float = Field(description="Copies/memsets overlapped by neither")
    busy_us: float
    idle_us: float
    idle_short_us: float = Field(description="Idle in gaps shorter than short_gap_us")
    idle_long_us: float
    short_gap_us: float
    host_bound_idle_us: float = Field(
        description="Idle in gaps where the GPU waited for the next launch call (CPU-bound)"
    )
    busy_pct: float
    gpu_events: int
    other_devices: int = Field(default=0, description="Further devices with activity in the trace")


class CategoryRow(_M):
    category: str
    us: float = Field(description="Summed kernel time")
    pct: float = Field(description="Share of summed GPU kernel time")
    n: int = Field(description="GPU activities")
    top: str = Field(description="Largest kernel of the category (short name)")


class Roofline(_M):
    tflops: float | None = optional("Achieved TFLOP/s")
    tbps: float | None = optional("Achieved TB/s (minimum traffic)")
    pct: float | None = optional("Percent of the device roofline")
    bound: Literal["compute", "memory"] | None = None


class OpRow(_M):
    name: str = Field(description="Launching op, or kernel name when there is no op to name")
    shapes: str | None = None
    cat: str
    via: Literal["op", "graph", "no-op", "unlinked"] = Field(
        description="op: kernels of this op; graph: kernels replayed by a graph launch; "
        "no-op: launched outside any op; unlinked: no launch record"
    )
    calls: int
    us: float = Field(description="Summed kernel time (a trace without GPU activity: top-level host op time)")
    pct: float = Field(description="Share of summed GPU kernel time (or of host op time)")
    roof: Roofline | None = optional("Null when shapes are not modelled")


class LinkingSummary(_M):
    gpu_events: int
    op_pct: float = Field(description="Share of GPU time attributed to an op")
    launch_pct: float = Field(description="Share of GPU time with a launch record")
    graph_pct: float = Field(description="Share of GPU time replayed by graph launches")
    graph_launches: int
    unlinked_pct: float = Field(description="Share of GPU time with no launch record")
    launches_without_gpu: int = Field(description="Kernel-launch calls whose work never ran")
    partial: bool
    notes: list[str] = Field(default_factory=list)


class Finding(_M):
    kind: str
    message: str
    saving_us: float = Field(description="Estimated ceiling of the saving (Amdahl), not additive")
    saving_pct: float = Field(description="saving_us as percent of the total span")
    next_tool: NextTool
    target: str | None = None


class MetadataNote(_M):
    found: bool
    blocks: list[str] = empty_list("Names of the blocks found")
    keys: int = 0
    secret_like: bool = False
    note: str


class DiffRow(_M):
    name: str
    base_us: float
    new_us: float
    delta_us: float
    delta_pct: float | None


class DiffSummary(_M):
    baseline: str
    base_total_us: float
    new_total_us: float
    base_busy_us: float
    new_busy_us: float
    speedup: float | None = Field(description="base total / new total")
    categories: list[DiffRow]
    ops: list[DiffRow] = Field(description="Largest movers by op (or kernel) name")


class TraceAnalysis(_M):
    analysis_version: str
    source_format: Literal["kineto", "rocprofv3", "nsys"]
    trace: str = Field(description="File name of the analysed trace")
    device: str | None
    peak_known: bool
    timeline: TimelineSummary
    categories: list[CategoryRow]
    top_ops: list[OpRow]
    linking: LinkingSummary
    findings: list[Finding]
    metadata: MetadataNote
    diff: DiffSummary | None = None
    notes: list[str] = Field(default_factory=list)
    artifact_dir: str | None = None
    artifacts: list[str] = Field(default_factory=list)


class ScrubReport(_M):
    src: str
    dst: str
    events: int
    removed_blocks: list[str] = Field(description="Top-level blocks dropped (names only)")
    removed_keys: int = Field(description="Keys inside the dropped blocks")
    redacted_values: int = Field(description="Secret-looking strings replaced in what was kept")
    bytes_in: int
    bytes_out: int
