"""The gate: evidence in, verdict out. A pure function; it measures nothing and trusts no claim.

Policy (loom.toml [gate]; docs/architecture.md, "The promise"):

* accept iff compile ok, validation passed, the geomean speedup CI lower bound > 1 + min_gain,
  and no shape is clearly slower (its CI upper bound < 1 - max_regression);
* reject lists *every* failing reason, not the first one found, so one round trip tells the
  agent all it has to fix;
* needs_review (never auto-accepted) when the numbers are too good to be believed or not
  established: a median below the physical floor, a speedup above max_plausible_speedup, no
  proof that the candidate's own kernels ran under a GPU timer, wall-clock timing, or a device
  that throttled through most of the run.

Precedence: reject dominates needs_review. A rejected candidate gains nothing from review, so
any rejecting reason makes the verdict reject; the review concerns are still listed after the
rejecting reasons (codes 'review.*') because they help explain suspicious numbers.

Missing evidence: a stage that did not run because an earlier stage failed adds no reason of its
own (the earlier failure already explains it); a stage missing for no such cause is a reject.
Evidence that is present is always judged, whatever happened before it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from loom_mcp.judge_models import (
    GPU_TIMERS,
    BenchmarkEvidence,
    CompileEvidence,
    GateConfig,
    RatioCI,
    ReasonCode,
    ShapeTiming,
    ValidationCase,
    ValidationEvidence,
    Verdict,
    is_review_code,
)

# Failed validation cases named one by one in the verdict; the rest are counted, so a broken
# candidate over a large sweep still gets a compact answer.
_MAX_CASES_LISTED = 5

# While timed, a candidate may differ from the baseline by at most its own allowed error plus
# the baseline's (both measured by validation), times this for the noise of a sampled estimate.
# A red-team candidate that switched an fp32 GEMM to bf16 only while timed read 29x validation's
# bound; one serving RMSNorm from a cache of row scales read 10x.
OUTPUT_DRIFT_FACTOR = 3.0
_MIN_DRIFT_SAMPLES = 32


@dataclass
class _Reasons:
    items: list[tuple[ReasonCode, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, code: ReasonCode, message: str) -> None:
        self.items.append((code, message))

    @property
    def blocking(self) -> bool:
        return any(not is_review_code(code) for code, _ in self.items)

    @property
    def review(self) -> bool:
        return any(is_review_code(code) for code, _ in self.items)

    def ordered(self) -> list[tuple[ReasonCode, str]]:
        # Stable within each group: rejecting reasons in the order checked, then review reasons.
        return [i for i in self.items if not is_review_code(i[0])] + [i for i in self.items if is_review_code(i[0])]


def _fmt_ratio(x: float) -> str:
    return f"{x:.3f}x"


def _judge_compile(compile: CompileEvidence, out: _Reasons) -> None:
    if compile.ok:
        for d in compile.diagnostics:
            if d.severity == "warning":
                loc = f"{d.file}:{d.line}: " if d.file and d.line else ""
                out.warnings.append(f"compiler warning: {loc}{d.message}")
        return
    errors = [d for d in compile.diagnostics if d.severity == "error"]
    if errors:
        first = errors[0]
        loc = f"{first.file}:{first.line}: " if first.file and first.line else ""
        more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
        out.add("compile.failed", f"The candidate did not compile: {loc}{first.message}{more}.")
    else:
        out.add("compile.failed", "The candidate did not compile.")


def _judge_validation(
    validation: ValidationEvidence | None, compile_ok: bool, config: GateConfig, out: _Reasons
) -> bool:
    """Returns whether validation counts as passed."""
    if validation is None:
        if compile_ok:
            out.add("validation.missing", "No validation evidence: correctness was never checked.")
        return False
    ok = True
    if not validation.passed:
        out.add("validation.failed", f"Validation {validation.validation_id} did not pass.")
        ok = False
    # The gate re-derives the outcome from the parts instead of trusting `passed` alone, so an
    # inconsistent record can never let a failing case or a static error through.
    for f in validation.findings:
        if f.severity == "error":
            where = f" at {f.where}" if f.where else ""
            out.add(finding_reason_code(f.check), f"{f.check}{where}: {f.message}")
            ok = False
        else:
            where = f" at {f.where}" if f.where else ""
            out.warnings.append(f"{f.check}{where}: {f.message}")
    failed = [c for c in validation.cases if not c.passed]
    for case in failed[:_MAX_CASES_LISTED]:
        why = case.message or _case_failure(case)
        out.add(
            "validation.case_failed",
            f"Shape {case.shape}, seed {case.seed}, {case.input_kind} inputs: {why}",
        )
    if len(failed) > _MAX_CASES_LISTED:
        out.add(
            "validation.case_failed",
            f"{len(failed) - _MAX_CASES_LISTED} more of {len(validation.cases)} cases failed.",
        )
    if failed:
        ok = False
    if not validation.cases:
        out.add("validation.no_cases", "Validation compared no cases, so it proves nothing.")
        ok = False
    else:
        seeds: dict[str, set[int]] = defaultdict(set)
        for case in validation.cases:
            seeds[case.shape].add(case.seed)
        short = sorted(s for s, v in seeds.items() if len(v) < config.seeds)
        if short:
            out.add(
                "validation.too_few_seeds",
                f"Shapes {', '.join(short)} were checked with fewer than {config.seeds} seeds.",
            )
            ok = False
    return ok


# Validation finding checks (validate/runner.py, validate/static_checks/, the sandbox guard) by the
# reason code that says what went wrong; a check not named here is a rule broken while running.
_FINDING_CODES: dict[str, ReasonCode] = {
    "validation.mismatch": "validation.mismatch",
    "validation.shape": "validation.mismatch",
    "validation.dtype": "validation.mismatch",
    "validation.nan_inf": "validation.nan_parity",
    "validation.crash": "validation.runtime_error",
    "validation.import": "validation.runtime_error",
    "validation.exception": "validation.runtime_error",
    "validation.outputs": "validation.mismatch",  # mostly: a different number of outputs
    "validation.output_type": "validation.misbehaved",
}


def finding_reason_code(check: str) -> ReasonCode:
    """The reason code of an error-severity validation finding, by its check name."""
    if check in _FINDING_CODES:
        return _FINDING_CODES[check]
    if check.startswith("static."):
        return "validation.static_error"
    if check.startswith("task."):
        return "validation.task_error"
    return "validation.misbehaved"


def _case_failure(case: ValidationCase) -> str:
    if not case.output_type_ok:
        return "the output is not a plain torch.Tensor of its own (a subclass or an alias of an input)."
    if not case.shape_match:
        return "the output shape differs from the reference."
    if not case.nan_inf_parity:
        return "NaN/Inf positions differ from the reference."
    if case.inputs_unchanged is False:
        return "the candidate modified its inputs."
    if case.deterministic is False:
        return "a second run on the same inputs gave different bits."
    if case.max_abs_err is not None:
        return (
            f"max abs error {case.max_abs_err:.3g} (rel {case.max_rel_err or 0:.3g}) exceeds "
            f"atol {case.atol:g} / rtol {case.rtol:g}."
        )
    return "the output does not match the reference."


def _below_floor(shape: ShapeTiming, slack: float) -> str | None:
    if shape.floor_s is not None and shape.floor_s > 0:
        limit = shape.floor_s * (1.0 - slack)
        if shape.candidate.median < limit:
            return (
                f"Shape {shape.name}: candidate median {shape.candidate.median:.3g} s is below the "
                f"physical floor {shape.floor_s:.3g} s (bytes / peak bandwidth, FLOPs / peak rate); "
                "the timing cannot be real."
            )
        if shape.baseline.median < limit:
            return (
                f"Shape {shape.name}: baseline median {shape.baseline.median:.3g} s is below the "
                f"physical floor {shape.floor_s:.3g} s; the task's flops/bytes_moved or the device "
                "peaks are wrong, so the roofline check is void."
            )
        return None
    if shape.roofline_fraction is not None and shape.roofline_fraction > 1.0 / (1.0 - slack):
        return (
            f"Shape {shape.name}: the candidate reaches {shape.roofline_fraction:.0%} of the "
            "roofline, above what the hardware can do."
        )
    return None


def _judge_benchmark(benchmark: BenchmarkEvidence, config: GateConfig, out: _Reasons) -> None:
    # Misbehaviour while timed rejects whatever validation said: it is the timed code that counts.
    for f in benchmark.findings:
        if f.severity == "error":
            out.add("benchmark.misbehaved", f"{f.check}: {f.message}")
        elif f.check == "benchmark.timing_ambiguous":
            out.add("review.timing_ambiguous", f"{f.check}: {f.message}")
        else:
            out.warnings.append(f"{f.check}: {f.message}")
    if not benchmark.shapes or benchmark.geomean is None:
        out.add("benchmark.no_shapes", f"Benchmark {benchmark.benchmark_id} timed no shapes.")
        return
    # A CI at a lower level than configured is narrower than the policy allows: not evidence.
    levels = {benchmark.geomean.level} | {s.ratio.level for s in benchmark.shapes}
    if min(levels) < config.ci_level - 1e-9:
        out.add(
            "benchmark.ci_level",
            f"Benchmark CIs are at {min(levels):.0%}, below the configured {config.ci_level:.0%}.",
        )
    for s in benchmark.shapes:
        n = min(s.baseline.n, s.candidate.n)
        if n < config.min_pairs:
            out.add(
                "benchmark.too_few_samples",
                f"Shape {s.name} has only {n} timed samples per arm (need {config.min_pairs}).",
            )
    g = benchmark.geomean
    target = 1.0 + config.min_gain
    if not g.ci_low > target:
        out.add(
            "speedup.insufficient",
            f"Geomean speedup {_fmt_ratio(g.estimate)} has a {g.level:.0%} CI of "
            f"[{_fmt_ratio(g.ci_low)}, {_fmt_ratio(g.ci_high)}]; its lower bound must exceed "
            f"{_fmt_ratio(target)}.",
        )
    slow = 1.0 - config.max_regression
    for s in benchmark.shapes:
        if s.ratio.ci_high < slow:
            out.add(
                "shape.regression",
                f"Shape {s.name} is slower: speedup {_fmt_ratio(s.ratio.estimate)}, CI "
                f"[{_fmt_ratio(s.ratio.ci_low)}, {_fmt_ratio(s.ratio.ci_high)}] lies below "
                f"{_fmt_ratio(slow)}.",
            )

    # Review concerns: numbers that are too good, or not established.
    for s in benchmark.shapes:
        msg = _below_floor(s, config.floor_slack)
        if msg:
            out.add("review.below_floor", msg)
    if g.estimate > config.max_plausible_speedup:
        out.add(
            "review.implausible_speedup",
            f"Geomean speedup {_fmt_ratio(g.estimate)} exceeds the plausible "
            f"{_fmt_ratio(config.max_plausible_speedup)}; a human should confirm it.",
        )
    for s in benchmark.shapes:
        if s.ratio.estimate > config.max_plausible_speedup:
            out.add(
                "review.implausible_speedup",
                f"Shape {s.name} speedup {_fmt_ratio(s.ratio.estimate)} exceeds the plausible "
                f"{_fmt_ratio(config.max_plausible_speedup)}.",
            )
    if benchmark.timer in GPU_TIMERS:
        if not benchmark.proof_applicable:
            out.warnings.append(
                "The candidate defines no kernels of its own; its speed is framework code's, "
                "measured by the same device timer."
            )
        elif config.require_proof_of_execution:
            note = f" ({benchmark.proof_note})" if benchmark.proof_note else ""
            if benchmark.proof_of_execution is False:
                out.add(
                    "review.proof_failed",
                    f"The candidate's own kernels were not seen in the profiler trace{note}.",
                )
            elif benchmark.proof_of_execution is None:
                out.add(
                    "review.proof_unknown",
                    f"It was not established that the candidate's own kernels ran{note}.",
                )
    elif not config.accept_wall_clock:
        out.add(
            "review.wall_clock",
            "Timed by host wall clock, not device events, and the policy requires device timing "
            "([gate] accept_wall_clock = false); a human should confirm on a GPU.",
        )
    timed = sum(s.baseline.n + s.candidate.n for s in benchmark.shapes)
    dropped = benchmark.throttled_samples_dropped
    if dropped and dropped / (timed + dropped) > config.max_throttled_fraction:
        out.add(
            "review.throttled",
            f"{dropped} of {timed + dropped} samples were taken while throttled; the device was "
            "not stable enough to trust the rest.",
        )


def _judge_coverage(validation: ValidationEvidence, benchmark: BenchmarkEvidence, out: _Reasons) -> None:
    """A speedup speaks for the shapes it timed: every validated shape must have been timed,
    or a candidate slow on its hardest shape could be benchmarked on the easy ones only."""
    timed = {s.name for s in benchmark.shapes}
    untimed = sorted({c.shape for c in validation.cases} - timed)
    if untimed and benchmark.shapes:
        out.add(
            "benchmark.shapes_missing",
            f"Benchmark {benchmark.benchmark_id} did not time validated shape(s) "
            f"{', '.join(untimed[:5])}{' ...' if len(untimed) > 5 else ''}.",
        )


def _judge_output_drift(validation: ValidationEvidence, benchmark: BenchmarkEvidence, out: _Reasons) -> None:
    """What the candidate computed while timed must be as accurate as what validation passed:
    per shape, its sampled deviation from the baseline within OUTPUT_DRIFT_FACTOR x (validation's
    normwise bound + the reference's own normwise error) for that shape. Validation and the
    benchmark run in different processes, and a candidate can tell them apart in many ways; this
    holds the timed calls to validation's standard whatever the candidate does there."""
    allowed: dict[str, float] = {}
    for case in validation.cases:
        if case.norm_rel_bound is not None:
            own = case.norm_rel_bound + (case.ref_norm_rel_err or 0.0)
            allowed[case.shape] = max(allowed.get(case.shape, 0.0), own)
    for s in benchmark.shapes:
        if s.output_deviation is None or s.output_samples < _MIN_DRIFT_SAMPLES or s.name not in allowed:
            continue
        limit = OUTPUT_DRIFT_FACTOR * allowed[s.name]
        if s.output_deviation > limit:
            out.add(
                "benchmark.output_drift",
                f"Shape {s.name}: while timed, the candidate's outputs differ from the baseline's by "
                f"{s.output_deviation:.3g} (normwise, over {s.output_samples} sampled values), more than "
                f"{limit:.3g}, {OUTPUT_DRIFT_FACTOR:g}x what validation allowed it plus the reference's own "
                "error: it computes less accurately while timed than it did for validation.",
            )


def benchmark_reasons(
    benchmark: BenchmarkEvidence, config: GateConfig, validation: ValidationEvidence | None = None
) -> list[tuple[ReasonCode, str]]:
    """What the gate would hold against this benchmark: the same rules `decide` applies, with
    the ones that read validation too where one is given; rejecting reasons first, then review
    concerns. Empty: it would clear the bar."""
    out = _Reasons()
    _judge_benchmark(benchmark, config, out)
    if validation is not None:
        _judge_output_drift(validation, benchmark, out)
    return out.ordered()


_REVIEW_PHRASES: dict[str, str] = {
    "review.below_floor": "a time below the physical floor (bytes / peak bandwidth or FLOPs / peak rate)",
    "review.implausible_speedup": "a speedup above max_plausible_speedup",
    "review.timing_ambiguous": "own clocks the trusted timer supports only if the candidate's process switches slower",
    "review.proof_failed": "the candidate's own kernels were not seen in the profiler trace",
    "review.proof_unknown": "it was not established that the candidate's own kernels ran",
    "review.wall_clock": "timed by host wall clock, not device events",
    "review.throttled": "the device throttled through most of the run",
}


def review_explanation(reason_codes: list[str], config_file: str = "loom.toml") -> str:
    """Why a result needs review, in words naming the actual reasons. When wall-clock timing is
    the only one, also how the policy could allow it: a human's decision in loom.toml."""
    review = list(dict.fromkeys(c for c in reason_codes if is_review_code(c)))
    if review == ["review.wall_clock"]:
        return (
            "a human must look at this result: it was timed by host wall clock, not device "
            "events, and the policy requires device timing. Confirm it on a GPU; or a human may "
            f"allow wall-clock accepts with `[gate] accept_wall_clock = true` in {config_file} "
            "(their decision, not the agent's)"
        )
    phrases = [_REVIEW_PHRASES.get(c, c) for c in review] or ["a review concern"]
    return f"a human must look at this result: {'; '.join(phrases)}"


def decide(
    compile: CompileEvidence,
    validation: ValidationEvidence | None,
    benchmark: BenchmarkEvidence | None,
    config: GateConfig,
) -> Verdict:
    """Judge the evidence of one submission. Pure: same evidence and config, same verdict."""
    out = _Reasons()
    _judge_compile(compile, out)
    validated = _judge_validation(validation, compile.ok, config, out)
    if benchmark is None:
        if compile.ok and validated:
            out.add("benchmark.missing", "No benchmark evidence: the speedup was never measured.")
    else:
        _judge_benchmark(benchmark, config, out)
        if validation is not None:
            _judge_coverage(validation, benchmark, out)
            _judge_output_drift(validation, benchmark, out)

    verdict: Literal["accept", "reject", "needs_review"]
    if out.blocking:
        verdict = "reject"
    elif out.review:
        verdict = "needs_review"
    else:
        verdict = "accept"
    ordered = out.ordered()
    g = benchmark.geomean if benchmark is not None else None
    return Verdict(
        verdict=verdict,
        reasons=[m for _, m in ordered],
        reason_codes=[c for c, _ in ordered],
        warnings=out.warnings,
        speedup=g.estimate if g else None,
        speedup_ci_low=g.ci_low if g else None,
        speedup_ci_high=g.ci_high if g else None,
        ci_level=g.level if g else None,
        summary=_summary(verdict, ordered, g),
    )


def _summary(verdict: str, ordered: list[tuple[ReasonCode, str]], g: RatioCI | None) -> str:
    speed = (
        f"geomean {_fmt_ratio(g.estimate)} [{_fmt_ratio(g.ci_low)}, {_fmt_ratio(g.ci_high)}]"
        if g
        else "no speedup measured"
    )
    if verdict == "accept":
        return f"Accepted: correct, and faster with {speed}."
    blocking = sum(1 for c, _ in ordered if not is_review_code(c))
    review = len(ordered) - blocking
    if verdict == "reject":
        extra = f" and {review} review concern(s)" if review else ""
        return f"Rejected for {blocking} reason(s){extra}; {speed}."
    return f"Needs human review for {review} reason(s); {speed}. Not accepted automatically."
