"""Contracts of the judge: the evidence the gate consumes and the verdict it returns.

The validation and benchmark workers fill these models; `loom_mcp.gate.decide` reads them and
nothing else. Every model forbids unknown fields so a worker that drifts from the contract fails
loudly instead of being silently half-read. Times are seconds; ratios are baseline/candidate, so
a ratio above 1 means the candidate is faster.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from loom_mcp.fields import empty_list, optional
from loom_mcp.models import CompileDiagnostic


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- tolerances


class Tolerance(_Model):
    """Elementwise closeness: |out - ref| <= atol + rtol * |ref|, compared in float64.

    The validation worker also scales it to the reference (loom_mcp.worker.reference): atol is
    capped at the reference's RMS times the relative tolerance, and ||out - ref|| / ||ref|| must
    stay within that tolerance or a few times the reference's own error in its dtype."""

    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)


# Keyed by the canonical dtype name of the reference output (see taskfile.canonical_dtype).
# fp32 follows KernelBench's 1e-4 (v0 used 1e-2, which let fp16/TF32 substitutions through);
# bf16/fp16 follow KernelBench's 1e-2; fp8 follows KernelBench-Hard's 0.1 because e4m3 carries
# three mantissa bits (one ulp is 6-12 % relative). Integer and bool outputs must match exactly.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(atol=1e-7, rtol=1e-7),
    "fp32": Tolerance(atol=1e-4, rtol=1e-4),
    "bf16": Tolerance(atol=1e-2, rtol=1e-2),
    "fp16": Tolerance(atol=1e-2, rtol=1e-2),
    "fp8": Tolerance(atol=1e-1, rtol=1e-1),
    "int": Tolerance(atol=0.0, rtol=0.0),
    "bool": Tolerance(atol=0.0, rtol=0.0),
}


# ---------------------------------------------------------------- gate configuration


class GateConfig(_Model):
    """The gate's policy. The human sets it (loom.toml); no tool argument can change it.

    Field names are a superset of `config.GateThresholds`, so a `[gate]` table validates as either.
    """

    min_gain: float = Field(
        default=0.02,
        ge=0,
        description="Accept only if the geomean speedup CI lower bound > 1 + min_gain",
    )
    max_regression: float = Field(
        default=0.02,
        ge=0,
        lt=1,
        description="Reject if any shape's ratio CI upper bound < 1 - max_regression (clearly slower)",
    )
    max_plausible_speedup: float = Field(
        default=10.0,
        gt=1,
        description="A geomean or per-shape speedup above this needs human review",
    )
    ci_level: float = Field(default=0.95, gt=0.5, lt=1, description="Confidence level of every CI")
    stderr_target: float = Field(
        default=0.005,
        gt=0,
        description="Benchmark stopping rule: stop once the standard error of each arm's median, "
        "relative to that median, is below this",
    )
    min_samples: int = Field(default=10, ge=2, description="Stopping rule: never stop before this many samples per arm")
    min_time_s: float = Field(
        default=0.5, ge=0, description="Stopping rule: never stop before this much time per shape"
    )
    max_time_s: float = Field(
        default=10.0, gt=0, description="Stopping rule: stop at this time per shape, precise or not"
    )
    min_pairs: int = Field(
        default=5,
        ge=2,
        description="Fewer kept A/B pairs than this on a shape and its CI is not evidence: reject",
    )
    bootstrap_resamples: int = Field(default=5000, ge=200, description="Bootstrap replicates for ratio and geomean CIs")
    bootstrap_seed: int = Field(
        default=0, description="Seed of the bootstrap RNG, so the same samples give the same CI"
    )
    outlier_iqr_k: float | None = Field(
        default=None,
        gt=0,
        description="Drop A/B pairs with an arm outside k*IQR of its quartiles (None: keep all; "
        "medians are already robust and dropping slow samples flatters both arms)",
    )
    floor_slack: float = Field(
        default=0.05,
        ge=0,
        lt=1,
        description="A median below floor_s * (1 - floor_slack) is physically implausible: review. "
        "The slack absorbs timer granularity and datasheet rounding",
    )
    max_throttled_fraction: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="More than this fraction of samples dropped for throttling: review (device unstable)",
    )
    require_proof_of_execution: bool = Field(
        default=True,
        description="On a GPU timer, the candidate's own kernels must be seen in a profiler trace; "
        "if that failed or was not established: review",
    )
    accept_wall_clock: bool = Field(
        default=False,
        description="Allow accept on host wall-clock timing (CPU fallback). Off: such runs need review",
    )
    wall_clock_blocks: int = Field(
        default=4,
        ge=2,
        description="Wall clock (CPU): blocks always timed. A block is a fresh timer and pair of "
        "arm processes; a process keeps its few-percent bias for life, so the CI is a t-interval "
        "across blocks' ratios, not across samples",
    )
    wall_clock_max_blocks: int = Field(
        default=8,
        ge=2,
        description="Wall clock (CPU): blocks at most; more run while the geomean CI is wider "
        "than wall_clock_ci_target",
    )
    wall_clock_ci_target: float = Field(
        default=0.015,
        gt=0,
        description="Wall clock (CPU): stop adding blocks once the geomean CI's half-width, "
        "relative to the estimate, is below this",
    )
    wall_clock_block_time_s: float = Field(
        default=0.5,
        gt=0,
        description="Wall clock (CPU): sampling time per shape in one block (replaces max_time_s "
        "there; min_time_s still applies up to it)",
    )
    seeds: int = Field(default=5, ge=1, description="Validation seeds each shape must cover")
    tolerances: dict[str, Tolerance] = Field(
        default_factory=lambda: dict(DEFAULT_TOLERANCES),
        description="Default per-dtype tolerances; a task's TOLERANCE overrides them",
    )

    @model_validator(mode="after")
    def _time_window(self) -> GateConfig:
        if self.min_time_s > self.max_time_s:
            raise ValueError("min_time_s must not exceed max_time_s")
        if self.wall_clock_blocks > self.wall_clock_max_blocks:
            raise ValueError("wall_clock_blocks must not exceed wall_clock_max_blocks")
        return self


# ---------------------------------------------------------------- compile


class Diagnostic(CompileDiagnostic):
    # A compiler's diagnostic as the gate's evidence keeps it: compile_kernel's, and the column.
    column: int | None = None


class CompileEvidence(_Model):
    ok: bool
    language: Literal["triton", "cuda", "hip", "python"] | None = None
    artifact_id: str | None = None
    diagnostics: list[Diagnostic] = Field(default_factory=list)
    duration_s: float | None = None


# ---------------------------------------------------------------- validation


class Finding(_Model):
    """One problem a check found, in one plain sentence the agent can act on."""

    check: str = Field(description="Stable check name, e.g. 'static.monkeypatch'")
    severity: Literal["error", "warning"]
    message: str
    where: str | None = optional("'file:line' when the check has a location")
    line: int | None = None


class ValidationCase(_Model):
    """One shape x seed x input kind, compared in float64 against the reference."""

    shape: str
    seed: int
    input_kind: str = Field(
        default="normal",
        description="'normal', 'uniform', 'heavy_tailed', 'scaled_1e-3', 'scaled_64', 'boundary', ...",
    )
    dtype: str | None = optional("Canonical dtype of the reference output")
    max_abs_err: float | None = optional("None when outputs could not be compared")
    max_rel_err: float | None = None
    mismatched: int | None = optional("Elements outside tolerance")
    atol: float = Field(ge=0)
    rtol: float = Field(ge=0)
    atol_effective: float | None = optional(
        "The atol applied: the larger of atol capped at the reference's scale (its "
        "RMS times the dtype's relative tolerance) and 4x ref_max_abs_err"
    )
    norm_rel_err: float | None = optional("||out - ref||_2 / ||ref||_2 over finite elements, in float64")
    norm_rel_bound: float | None = optional(
        "Largest norm_rel_err allowed: max(the dtype's relative tolerance, 4x "
        "ref_norm_rel_err); None when the reference has no nonzero finite value"
    )
    ref_norm_rel_err: float | None = optional(
        "The same normwise error for the reference itself run in the task's dtype on "
        "this device, against its float64 run (None without a float64 run)"
    )
    ref_max_abs_err: float | None = optional(
        "Largest elementwise error of the reference itself run in the task's dtype on "
        "this device, against its float64 run (None without a float64 run)"
    )
    ref_rms: float | None = optional("RMS of the reference's finite values")
    passed: bool
    shape_match: bool = True
    nan_inf_parity: bool = Field(default=True, description="NaN/Inf positions match the reference")
    output_type_ok: bool = Field(default=True, description="Outputs are plain torch.Tensor, not aliases")
    inputs_unchanged: bool | None = optional("Input hashes equal after the call")
    deterministic: bool | None = optional("A rerun was bitwise identical")
    message: str | None = optional("Why the case failed, in one sentence")


class ValidationEvidence(_Model):
    validation_id: str
    passed: bool
    cases: list[ValidationCase] = Field(default_factory=list)
    findings: list[Finding] = Field(default_factory=list)
    nondeterminism_declared: bool = False


# ---------------------------------------------------------------- benchmark


TimerKind = Literal["cuda_events", "hip_events", "wall_clock"]
GPU_TIMERS: frozenset[str] = frozenset({"cuda_events", "hip_events"})


class SampleSummary(_Model):
    """Robust and classic summaries of one arm's samples (seconds)."""

    n: int = Field(ge=0)
    median: float
    mean: float
    std: float = Field(description="Sample standard deviation (n-1)")
    stderr: float = Field(description="std / sqrt(n)")
    iqr: float
    mad: float = Field(description="Median absolute deviation (unscaled)")
    min: float
    max: float


class RatioCI(_Model):
    """A speedup (baseline/candidate) with its bootstrap confidence interval."""

    estimate: float = Field(gt=0)
    ci_low: float = Field(gt=0)
    ci_high: float = Field(gt=0)
    level: float = Field(gt=0, lt=1)
    resamples: int = Field(ge=0)
    method: Literal["paired_bootstrap", "independent_bootstrap", "block_t", "degenerate"] = Field(
        description="block_t: a Student t interval of the mean log ratio across blocks (fresh "
        "processes each, CPU wall clock); resamples is 0 there"
    )

    @model_validator(mode="after")
    def _ordered(self) -> RatioCI:
        # The gate reads bounds at face value, so an interval that does not hold its own
        # estimate is refused at the door rather than judged.
        slack = 1 + 1e-9  # float rounding only
        if self.ci_low > self.estimate * slack or self.estimate > self.ci_high * slack:
            raise ValueError("a CI must satisfy ci_low <= estimate <= ci_high")
        return self


FRESH_INPUTS_HELP = (
    "Every batch drew its input sets afresh from the task's get_inputs (False: the prepared sets, "
    "only perturbed, since a draw took longer than the timer allows)"
)
OUTPUT_DEVIATION_HELP = (
    "While timed: ||candidate - baseline|| / ||baseline|| over the outputs sampled at secret "
    "positions of every call; held to validation's normwise bound (benchmark.output_drift)"
)


class ShapeSamples(_Model):
    """Raw interleaved A/B samples of one shape, as the benchmark worker measured them.

    Element i of each list comes from the i-th ABAB pair, so they must have equal length when
    paired; `throttled[i]` marks a pair taken while clocks were below their floor.
    """

    name: str
    baseline_s: list[float]
    candidate_s: list[float]
    throttled: list[bool] | None = None
    flops: float | None = Field(default=None, ge=0)
    bytes_moved: float | None = Field(default=None, ge=0)
    stop_reason: Literal["precise", "time_cap"] | None = None
    sampling_s: float | None = Field(default=None, ge=0)
    blocks: list[int] | None = optional(
        "The block (fresh pair of arm processes) each A/B pair was timed in; given, the CI is taken across blocks"
    )
    output_deviation: float | None = Field(default=None, ge=0, description=OUTPUT_DEVIATION_HELP)
    output_samples: int = Field(default=0, ge=0, description="Sampled outputs output_deviation is taken over")
    fresh_inputs: bool | None = optional(FRESH_INPUTS_HELP)

    @model_validator(mode="after")
    def _lengths(self) -> ShapeSamples:
        if self.throttled is not None and not (len(self.throttled) == len(self.baseline_s) == len(self.candidate_s)):
            raise ValueError("throttled flags need one entry per A/B pair")
        if self.blocks is not None and not (len(self.blocks) == len(self.baseline_s) == len(self.candidate_s)):
            raise ValueError("block labels need one entry per A/B pair")
        return self


class ShapeTiming(_Model):
    name: str
    baseline: SampleSummary
    candidate: SampleSummary
    ratio: RatioCI
    floor_s: float | None = optional("Physical floor: max(bytes/peak bandwidth, flops/peak rate)")
    roofline_fraction: float | None = optional("floor_s / candidate median; above 1 is impossible")
    throttled_dropped: int = Field(default=0, ge=0, description="Samples, both arms counted")
    outliers_dropped: int = Field(default=0, ge=0, description="Samples, both arms counted")
    stop_reason: Literal["precise", "time_cap"] | None = optional(
        "Why sampling stopped: both medians precise (stderr_target), or max_time_s"
    )
    sampling_s: float | None = Field(default=None, ge=0, description="Seconds spent sampling")
    block_ratios: list[float] | None = optional(
        "Speedup (ratio of medians) in each block, in block order: their spread is the CI's width"
    )
    output_deviation: float | None = Field(default=None, ge=0, description=OUTPUT_DEVIATION_HELP)
    output_samples: int = Field(default=0, ge=0, description="Sampled outputs output_deviation is taken over")
    fresh_inputs: bool | None = optional(FRESH_INPUTS_HELP)


class BenchmarkEvidence(_Model):
    benchmark_id: str
    device: str
    timer: TimerKind
    shapes: list[ShapeTiming]
    geomean: RatioCI | None = optional("None when there are no shapes")
    throttled_samples_dropped: int = Field(
        default=0, ge=0, description="Samples (both arms counted) dropped for throttled clocks"
    )
    outliers_dropped: int = Field(default=0, ge=0, description="Samples dropped as outliers")
    l2_flushed: bool | None = None
    graph_replay: bool | None = None
    bracket_overhead_s: dict[str, float] | None = optional(
        "Per shape: the trusted timer's own cost per call (median of empty calls), already subtracted from every sample"
    )
    trusted_geomean: RatioCI | None = optional(
        "GPU: the geomean speedup by the trusted timer's brackets alone, which the "
        "arms' own event timings (the samples above) must agree with"
    )
    proof_of_execution: bool | None = optional(
        "True: the candidate's own kernels appear in a profiler trace; False: they did not; None: not established"
    )
    proof_note: str | None = None
    proof_applicable: bool = Field(
        default=True,
        description="False when the candidate defines no kernels of its own (framework code "
        "only): there is nothing of its own to prove ran, and the same timer measured it",
    )
    findings: list[Finding] = empty_list(
        "What the candidate did while timed (stale outputs, replaced timers); an "
        "error here rejects whatever validation said"
    )
    blocks: int | None = Field(
        default=None,
        ge=1,
        description="Wall clock: blocks timed, each a fresh timer and pair of arm processes",
    )
    block_geomeans: list[float] | None = optional(
        "Wall clock: the geomean speedup within each block, in block order; the geomean CI is a t-interval across them"
    )


# ---------------------------------------------------------------- verdict


ReasonCode = Literal[
    # reject
    "compile.failed",
    "validation.missing",
    "validation.failed",
    "validation.case_failed",
    "validation.static_error",  # the source itself breaks a rule (static.* checks)
    "validation.mismatch",  # outputs differ from the reference: values, shape or dtype
    "validation.nan_parity",  # NaN/Inf where the reference has none, or the other way round
    "validation.runtime_error",  # the candidate crashed, failed to import or raised
    "validation.misbehaved",  # ran, but broke a rule while running (aliasing, mutation, ...)
    "validation.task_error",  # the task itself is at fault (inputs not reproducible)
    "validation.no_cases",
    "validation.too_few_seeds",
    "benchmark.missing",
    "benchmark.no_shapes",
    "benchmark.too_few_samples",
    "benchmark.shapes_missing",
    "benchmark.misbehaved",
    "benchmark.output_drift",
    "benchmark.ci_level",
    "speedup.insufficient",
    "shape.regression",
    # needs_review
    "review.below_floor",
    "review.implausible_speedup",
    "review.proof_failed",
    "review.proof_unknown",
    "review.wall_clock",
    "review.throttled",
    "review.timing_ambiguous",  # own clocks agree with the brackets only granting a dearer switch
]


def is_review_code(code: str) -> bool:
    return code.startswith("review.")


class Verdict(_Model):
    """The gate's decision. Reject reasons come first, then review reasons; each has a code."""

    verdict: Literal["accept", "reject", "needs_review"]
    reasons: list[str] = empty_list("Plain sentences, one per problem")
    reason_codes: list[ReasonCode] = empty_list("Aligned with reasons")
    warnings: list[str] = empty_list("Did not affect the verdict")
    speedup: float | None = optional("Geomean baseline/candidate")
    speedup_ci_low: float | None = None
    speedup_ci_high: float | None = None
    ci_level: float | None = None
    summary: str

    @model_validator(mode="after")
    def _consistent(self) -> Verdict:
        if len(self.reasons) != len(self.reason_codes):
            raise ValueError("every reason needs exactly one reason code")
        blocking = [c for c in self.reason_codes if not is_review_code(c)]
        review = [c for c in self.reason_codes if is_review_code(c)]
        if self.verdict == "accept" and self.reason_codes:
            raise ValueError("an accept carries no reasons against it")
        if self.verdict == "reject" and not blocking:
            raise ValueError("a reject needs at least one rejecting reason")
        if self.verdict == "needs_review" and (blocking or not review):
            raise ValueError("needs_review carries review reasons only")
        return self
