"""Result contract of the command mode of benchmark (kept apart so the server can publish its
schema without importing numpy)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loom_mcp.fields import optional
from loom_mcp.judge_models import Finding, RatioCI, SampleSummary

Arm = Literal["baseline", "candidate"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MetricComparison(_Model):
    name: str
    higher_is_better: bool
    baseline: SampleSummary
    baseline_ci: list[float] = Field(
        description="[low, high]: bootstrap CI of the baseline median, at the ratio's level"
    )
    candidate: SampleSummary
    candidate_ci: list[float] = Field(description="[low, high]: the same for the candidate")
    ratio: RatioCI = Field(
        description="Improvement factor, > 1 = candidate better: candidate/baseline of the "
        "medians when higher is better, baseline/candidate when lower is better"
    )


class RunFailure(_Model):
    arm: Arm
    run: int = Field(description="1-based run index of that arm")
    reason: str


class CommandBenchmarkResult(_Model):
    benchmark_id: str | None = optional("The full record: loom://runs/{benchmark_id}")
    metrics: list[MetricComparison]
    runs_per_arm: int = Field(description="Complete A/B pairs the statistics use")
    runs_requested: int
    failed_runs: list[RunFailure] = Field(description="Runs that failed after the first; their pairs were dropped")
    parser_used: str = Field(description="'json', 'vllm' or 'sglang'; 'baseline=vllm candidate=sglang' if they differ")
    findings: list[Finding] = Field(default_factory=list)
    samples_file: str = Field(description="Every run's parsed values, exit status and wall time")
    revisions: dict[Arm, str] | None = optional("The commit each arm ran, when the arms were git revisions")
    seconds: float
    next_step: str
