"""Pydantic contracts of the tools: every input the server accepts and every result it returns.

Unknown values are `None`, never invented. Units are in the field names (`_bytes`, `_s`, `_mhz`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.fields import optional

Vendor = Literal["nvidia", "amd", "cpu"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- devices


class DevicePeak(_Model):
    """Datasheet ceilings of one accelerator model (dense, no sparsity)."""

    model: str = Field(description="Canonical model name, e.g. 'H200 SXM'")
    vendor: Vendor
    arch: str = Field(description="sm_90, gfx942, ...")
    memory_bandwidth_bytes_s: float
    memory_bytes: int | None = None
    flops: dict[str, float] = Field(
        description="Dense peak FLOP/s by dtype: 'fp64', 'fp32', 'tf32', 'bf16', 'fp16', 'fp8', 'int8'"
    )
    l2_bytes: int | None = None
    source: str = Field(description="Where the numbers come from (datasheet URL or document)")


class ThrottleState(_Model):
    active: bool
    reasons: list[str] = Field(default_factory=list)


class DeviceInfo(_Model):
    index: int
    vendor: Vendor
    name: str
    arch: str | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    memory_clock_mhz: int | None = None
    memory_clock_max_mhz: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None
    utilization_pct: float | None = None
    throttle: ThrottleState | None = None
    driver_version: str | None = None
    runtime_version: str | None = optional("CUDA driver API version (NVIDIA) or ROCm version (AMD)")
    compute_units: int | None = optional("SMs (NVIDIA), CUs (AMD), cores (CPU)")
    busy: bool | None = optional("A loom job holds this device's lease now")
    peak: DevicePeak | None = None
    measured: dict[str, float] | None = optional("Measured ceilings when a calibration ran (bytes/s, FLOP/s)")


class ToolStatus(_Model):
    name: str
    found: bool
    version: str | None = None
    path: str | None = None
    note: str | None = None


class Toolchain(_Model):
    python: str
    loom_mcp: str
    torch: str | None = None
    torch_cuda: str | None = None
    torch_hip: str | None = None
    triton: str | None = None
    torch_devices: list[str] = Field(default_factory=list)
    tools: list[ToolStatus] = Field(default_factory=list)
    probe_error: str | None = None


class ExecutorSlot(_Model):
    device: str = Field(description="Where one job at a time runs: 'nvidia:N', 'amd:N', 'cpu:N'")
    busy: bool


class ExecutorState(_Model):
    """Where jobs run: each slot takes one job at a time; calls queue, first come first served."""

    kind: Literal["local", "ray"]
    nodes: list[str]
    slots: list[ExecutorSlot]


class Placement(_Model):
    """Where one run ran, recorded with it (loom://runs/{id})."""

    executor: str
    node: str
    device: str = Field(description="The slot: 'nvidia:N', 'amd:N', 'cpu:N'")
    device_kind: str = Field(description="Model and driver: a campaign's jobs only go to devices of its kind")
    queued_s: float = Field(description="Waited for a free device")
    started_at: float = Field(description="Epoch seconds the device was taken")
    ended_at: float | None = None


class DeviceInfoResult(_Model):
    devices: list[DeviceInfo]
    toolchain: Toolchain
    backends: dict[str, str] = Field(
        description="Per vendor library: 'ok', or why it is unavailable (e.g. 'pynvml not installed')"
    )
    executor: ExecutorState
    next_step: str


# ---------------------------------------------------------------- campaigns


class Budgets(_Model):
    gpu_seconds: float = Field(default=3600.0, gt=0, description="Device seconds all jobs may use")
    candidates: int = Field(default=50, gt=0, description="submit_candidate calls allowed")
    wall_seconds: float = Field(default=8 * 3600.0, gt=0, description="Wall time from start")


class StartCampaignResult(_Model):
    campaign_id: str
    repo: str
    base_commit: str
    base_branch: str | None
    branch: str = Field(description="Branch accepted changes are committed to (created on first accept)")
    goal: str
    task: str | None
    task_globals: dict[str, Any] = Field(
        default_factory=dict, description="Module-level names of the task overridden in every run of this campaign"
    )
    budgets: Budgets
    config_fingerprint: str
    next_step: str


# ---------------------------------------------------------------- compile_kernel


class KernelResources(_Model):
    name: str = Field(description="Kernel (entry function) name, demangled where possible")
    registers: int | None = optional("Per thread (NVIDIA) / VGPRs (AMD)")
    sgprs: int | None = None
    spill_stores_bytes: int | None = None
    spill_loads_bytes: int | None = None
    stack_bytes: int | None = None
    shared_memory_bytes: int | None = optional("Static shared memory / LDS per block")
    num_warps: int | None = None
    num_stages: int | None = None
    occupancy: float | None = optional("Estimated resident warps / max warps per SM (CU), 0..1")
    occupancy_limiter: str | None = optional("registers | shared_memory | warps")


class CompileDiagnostic(_Model):
    severity: Literal["error", "warning", "note"]
    message: str
    file: str | None = None
    line: int | None = None


class CompileResult(_Model):
    ok: bool
    language: Literal["triton", "cuda", "hip"]
    target: str | None = Field(description="sm_90, gfx942, or 'interpreter' (CPU)")
    artifact_id: str | None = optional("Content hash of the compiled object")
    cached: bool = Field(description="True when this exact source/compiler/target/flags was compiled before")
    compiler: str | None = optional("Compiler and version used")
    kernels: list[KernelResources] = Field(default_factory=list)
    diagnostics: list[CompileDiagnostic] = Field(default_factory=list)
    seconds: float
    note: str | None = None
    next_step: str


# ---------------------------------------------------------------- run_validation / benchmark


class CheckFinding(_Model):
    check: str = Field(description="Stable check name, e.g. 'validation.mismatch', 'static.threads'")
    severity: Literal["error", "warning"]
    message: str
    where: str | None = None


class CaseSummary(_Model):
    shape: str
    seed: int
    input_kind: str
    passed: bool
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    ref_max_abs_err: float | None = optional("The same error of the task's Model itself in its dtype here")
    norm_rel_err: float | None = None
    ref_norm_rel_err: float | None = optional("The reference's own normwise error in its dtype here")
    message: str | None = None


class RunValidationResult(_Model):
    validation_id: str
    passed: bool
    device: str
    shapes: list[str]
    seeds_per_shape: int
    cases_total: int
    cases_failed: int
    failing_cases: list[CaseSummary] = Field(description="At most 8; the full table is at loom://runs/{id}")
    worst_case: CaseSummary | None = optional(
        "The worst failing case (largest relative error) when any fails; else the passing case with the largest relative error"
    )
    findings: list[CheckFinding]
    seconds: float
    next_step: str


class ShapeSpeed(_Model):
    name: str
    baseline_median_s: float
    candidate_median_s: float
    speedup: float = Field(description="baseline / candidate (above 1: candidate faster)")
    ci_low: float
    ci_high: float
    pairs: int = Field(description="Interleaved A/B sample pairs kept")
    candidate_cv: float = Field(description="Coefficient of variation of the candidate's samples")
    floor_s: float | None = None
    roofline_fraction: float | None = optional("floor / candidate median")
    stop_reason: Literal["precise", "time_cap"] | None = optional(
        "precise: both medians reached the gate's precision; time_cap: "
        "the gate's max_time_s ran out first and the CI is as wide as it came out"
    )
    block_speedups: list[float] | None = optional(
        "CPU wall clock: the speedup in each block (a fresh pair of arm "
        "processes); the CI is a t-interval across them, so their spread is its width"
    )
    output_deviation: float | None = optional(
        "Normwise distance of the timed calls' sampled outputs from the baseline's; the gate "
        "allows 3x validation's bound (benchmark.output_drift)"
    )


class BenchmarkResult(_Model):
    benchmark_id: str
    device: str
    timer: str
    timer_note: str | None = None
    shapes: list[ShapeSpeed]
    geomean_speedup: float | None
    geomean_ci_low: float | None
    geomean_ci_high: float | None
    ci_level: float
    l2_flushed: bool | None
    graph_replay: bool | None
    throttled_samples_dropped: int
    proof_of_execution: bool | None
    proof_note: str | None
    findings: list[CheckFinding]
    device_state: dict[str, float | str | None] | None = None
    blocks: int | None = optional(
        "CPU wall clock: blocks timed, each a fresh timer and pair of "
        "arm processes (a process keeps a few-percent bias for life)"
    )
    block_geomeans: list[float] | None = optional("CPU wall clock: the geomean speedup within each block")
    seconds: float
    baseline: str = Field(
        default="the task's Model",
        description="What the candidate was timed against: the baseline file given, the task's "
        "BASELINE file, or the task's Model",
    )
    next_step: str


# ---------------------------------------------------------------- profile / analyze_trace


class HeadlineOp(_Model):
    name: str
    us: float
    pct: float


class ProfileResult(_Model):
    trace_id: str = Field(description="Pass to analyze_trace(trace=...)")
    profiler: Literal["torch", "rocprofv3", "nsys"]
    device: str | None
    trace_bytes: int
    scrubbed: list[str] = Field(description="Metadata blocks removed before storing (names only)")
    gpu_busy_pct: float | None
    total_us: float | None
    top_ops: list[HeadlineOp]
    seconds: float
    next_step: str


# ---------------------------------------------------------------- submit_candidate


class SubmitResult(_Model):
    submission_id: str
    verdict: str = Field(description="accept | reject | needs_review")
    reasons: list[str]
    reason_codes: list[str]
    speedup: float | None = Field(description="Geomean baseline/candidate over the task's shapes")
    speedup_ci_low: float | None
    speedup_ci_high: float | None
    validation_id: str | None
    benchmark_id: str | None
    commit: str | None = Field(description="Commit on the campaign branch when accepted")
    branch: str
    change_digest: str
    budget_left: dict[str, float]
    next_step: str


class CampaignReportResult(_Model):
    campaign_id: str
    accepted: int
    attempts: int
    cumulative_speedup: float | None
    branch: str
    branch_tip: str | None
    outcome_rates: dict[str, float]
    budgets: dict[str, dict[str, float]]
    files: dict[str, str] = Field(description="report.json, report.md, plots, accepted.patch")
    next_step: str
