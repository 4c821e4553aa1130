"""The gate: every branch of the policy, every reason listed, reject dominating review."""

from __future__ import annotations

import typing
from collections.abc import Callable

import pytest

from loom_mcp.gate import decide, review_explanation
from loom_mcp.judge_models import (
    BenchmarkEvidence,
    CompileEvidence,
    Diagnostic,
    Finding,
    GateConfig,
    RatioCI,
    ReasonCode,
    SampleSummary,
    ShapeTiming,
    ValidationCase,
    ValidationEvidence,
    Verdict,
)

CFG = GateConfig()


def summary(median: float, n: int = 50) -> SampleSummary:
    return SampleSummary(
        n=n, median=median, mean=median, std=median * 0.01, stderr=median * 0.01 / n**0.5,
        iqr=median * 0.013, mad=median * 0.007, min=median * 0.97, max=median * 1.05,
    )  # fmt: skip


def ratio(est: float, low: float, high: float, level: float = 0.95) -> RatioCI:
    return RatioCI(
        estimate=est, ci_low=low, ci_high=high, level=level, resamples=5000,
        method="paired_bootstrap",
    )  # fmt: skip


def shape(name: str, est: float = 1.2, low: float = 1.15, high: float = 1.25, **kw) -> ShapeTiming:
    cand = kw.pop("cand_s", 1e-3)
    n = kw.pop("n", 50)
    return ShapeTiming(
        name=name,
        baseline=summary(cand * est, n),
        candidate=summary(cand, n),
        ratio=ratio(est, low, high),
        **kw,
    )


def good_compile() -> CompileEvidence:
    return CompileEvidence(ok=True, language="triton", artifact_id="a1")


def good_validation(shapes=("decode", "prefill"), seeds: int = 5) -> ValidationEvidence:
    cases = [
        ValidationCase(shape=s, seed=k, input_kind=kind, dtype="fp32", max_abs_err=1e-6,
                       max_rel_err=1e-6, atol=1e-4, rtol=1e-4, passed=True, norm_rel_err=2e-7,
                       norm_rel_bound=1e-4, ref_norm_rel_err=1e-7)
        for s in shapes
        for k in range(seeds)
        for kind in ("normal", "heavy_tailed")
    ]  # fmt: skip
    return ValidationEvidence(validation_id="v1", passed=True, cases=cases)


def good_benchmark(**kw) -> BenchmarkEvidence:
    data = dict(
        benchmark_id="b1",
        device="NVIDIA H200",
        timer="cuda_events",
        shapes=[shape("decode"), shape("prefill")],
        geomean=ratio(1.2, 1.16, 1.24),
        proof_of_execution=True,
        proof_note="add_kernel seen in trace",
    )
    data.update(kw)
    return BenchmarkEvidence(**data)


def judge(compile=None, validation="good", benchmark="good", config=CFG) -> Verdict:
    """Good evidence unless told otherwise; good validation covers the benchmark's shapes."""
    bench = good_benchmark() if benchmark == "good" else benchmark
    if validation == "good":
        names = tuple(s.name for s in bench.shapes) if bench is not None and bench.shapes else None
        validation = good_validation(names) if names else good_validation()
    return decide(compile or good_compile(), validation, bench, config)


# ---------------------------------------------------------------- accept


def test_accept_when_everything_holds():
    v = judge()
    assert v.verdict == "accept"
    assert v.reasons == [] and v.reason_codes == []
    assert v.speedup == 1.2 and (v.speedup_ci_low, v.speedup_ci_high) == (1.16, 1.24)
    assert v.ci_level == 0.95
    assert v.summary.startswith("Accepted")


def test_a_slower_but_not_clearly_slower_shape_is_tolerated():
    b = good_benchmark(shapes=[shape("decode", 1.3, 1.25, 1.35), shape("tail", 0.98, 0.97, 0.99)])
    v = judge(validation=good_validation(("decode", "tail")), benchmark=b)
    assert v.verdict == "accept"  # CI upper 0.99 is not < 0.98


def test_a_validated_shape_left_untimed_rejects():
    """The speedup must cover every validated shape, not just the easy ones."""
    b = good_benchmark(shapes=[shape("decode", 1.5, 1.45, 1.55)], geomean=ratio(1.5, 1.45, 1.55))
    v = judge(validation=good_validation(("decode", "prefill")), benchmark=b)
    assert v.verdict == "reject"
    assert "benchmark.shapes_missing" in v.reason_codes
    assert any("prefill" in r for r in v.reasons)


def test_timed_outputs_are_held_to_validations_bound_per_shape():
    """3x (validation's normwise bound + the reference's own error): 3.0e-4 here. An honest
    kernel differs from the baseline by both their rounding errors; validation's own numbers say
    how large those may be."""
    def verdict(deviation: float, samples: int = 3200, validation="good"):
        b = good_benchmark(shapes=[shape("decode", output_deviation=deviation, output_samples=samples),
                                   shape("prefill", output_deviation=1e-7, output_samples=3200)])
        return judge(benchmark=b, validation=validation)

    assert verdict(2.9e-4).verdict == "accept"
    drift = verdict(3.2e-4)
    assert drift.verdict == "reject" and drift.reason_codes == ["benchmark.output_drift"]
    assert "decode" in drift.reasons[0] and "prefill" not in drift.reasons[0]
    assert verdict(1e-2, samples=16).verdict == "accept"  # too few samples to say
    # A shape whose reference is all zeros has no normwise bound: nothing to hold it to.
    unbounded = good_validation(("decode", "prefill"))
    for case in unbounded.cases:
        if case.shape == "decode":
            case.norm_rel_bound = None
    assert verdict(1e-2, validation=unbounded).verdict == "accept"


def test_warnings_never_decide():
    val = good_validation()
    val.findings.append(
        Finding(check="static.precision_downgrade", severity="warning", message="Calls .half().",
                where="c.py:3", line=3)
    )  # fmt: skip
    comp = good_compile()
    comp.diagnostics.append(Diagnostic(severity="warning", message="unused", file="c.py", line=9))
    v = judge(compile=comp, validation=val)
    assert v.verdict == "accept"
    assert any("static.precision_downgrade at c.py:3" in w for w in v.warnings)
    assert any("c.py:9" in w for w in v.warnings)


# ---------------------------------------------------------------- every branch, one at a time

Mut = Callable[[], Verdict]


def _failed_case_validation() -> ValidationEvidence:
    v = good_validation()
    v.cases[3] = v.cases[3].model_copy(
        update={"passed": False, "max_abs_err": 0.5, "max_rel_err": 0.4}
    )
    return v  # `passed` still says True: the gate must not trust it


def _static_error_validation() -> ValidationEvidence:
    v = good_validation()
    v.findings.append(
        Finding(check="static.monkeypatch", severity="error", where="c.py:12", line=12,
                message="Assigns torch.cuda.Event.elapsed_time.")
    )  # fmt: skip
    return v


def _finding_validation(check: str, message: str) -> ValidationEvidence:
    """A failed validation carrying one error finding, as validate/runner.py records them."""
    v = good_validation().model_copy(update={"passed": False})
    v.findings.append(Finding(check=check, severity="error", message=message))
    return v


SCENARIOS: dict[str, tuple[Mut, str, ReasonCode]] = {
    "compile failed": (
        lambda: judge(
            compile=CompileEvidence(
                ok=False,
                diagnostics=[Diagnostic(severity="error", message="bad", file="c.py", line=7)],
            ),
            validation=None,
            benchmark=None,
        ),
        "reject",
        "compile.failed",
    ),
    "validation missing": (lambda: judge(validation=None), "reject", "validation.missing"),
    "validation failed": (
        lambda: judge(validation=good_validation().model_copy(update={"passed": False})),
        "reject",
        "validation.failed",
    ),
    "failed case under passed=True": (
        lambda: judge(validation=_failed_case_validation()),
        "reject",
        "validation.case_failed",
    ),
    "static error": (
        lambda: judge(validation=_static_error_validation()),
        "reject",
        "validation.static_error",
    ),
    "numeric mismatch": (
        lambda: judge(validation=_finding_validation(
            "validation.mismatch", "decode seed 1 (normal): max abs error 0.5 exceeds atol")),
        "reject",
        "validation.mismatch",
    ),
    "NaN parity": (
        lambda: judge(validation=_finding_validation(
            "validation.nan_inf", "decode seed 1 (normal): NaN where the reference has none")),
        "reject",
        "validation.nan_parity",
    ),
    "candidate raised": (
        lambda: judge(validation=_finding_validation(
            "validation.exception", "decode seed 1 (normal): RuntimeError: boom")),
        "reject",
        "validation.runtime_error",
    ),
    "misbehaved while validated": (
        lambda: judge(validation=_finding_validation(
            "validation.input_mutation", "decode seed 1 (normal): forward modified its inputs")),
        "reject",
        "validation.misbehaved",
    ),
    "task at fault": (
        lambda: judge(validation=_finding_validation(
            "task.nondeterministic_inputs", "decode seed 1: get_inputs is not reproducible")),
        "reject",
        "validation.task_error",
    ),
    "no cases": (
        lambda: judge(validation=ValidationEvidence(validation_id="v", passed=True)),
        "reject",
        "validation.no_cases",
    ),
    "too few seeds": (
        lambda: judge(validation=good_validation(seeds=3)),
        "reject",
        "validation.too_few_seeds",
    ),
    "benchmark missing": (lambda: judge(benchmark=None), "reject", "benchmark.missing"),
    "no shapes": (
        lambda: judge(benchmark=good_benchmark(shapes=[], geomean=None)),
        "reject",
        "benchmark.no_shapes",
    ),
    "too few samples": (
        lambda: judge(benchmark=good_benchmark(shapes=[shape("decode", n=3), shape("prefill")])),
        "reject",
        "benchmark.too_few_samples",
    ),
    "ci level too low": (
        lambda: judge(benchmark=good_benchmark(geomean=ratio(1.2, 1.16, 1.24, level=0.8))),
        "reject",
        "benchmark.ci_level",
    ),
    "speedup insufficient": (
        lambda: judge(benchmark=good_benchmark(geomean=ratio(1.03, 1.01, 1.05))),
        "reject",
        "speedup.insufficient",
    ),
    "shape regression": (
        lambda: judge(
            benchmark=good_benchmark(
                shapes=[shape("decode", 1.5, 1.45, 1.55), shape("tail", 0.9, 0.88, 0.92)]
            )
        ),
        "reject",
        "shape.regression",
    ),
    "candidate below floor": (
        lambda: judge(
            benchmark=good_benchmark(shapes=[shape("decode", floor_s=2e-3), shape("prefill")])
        ),
        "needs_review",
        "review.below_floor",
    ),
    "implausible speedup": (
        lambda: judge(
            benchmark=good_benchmark(
                shapes=[shape("a", 12.0, 11.0, 13.0), shape("b", 12.0, 11.0, 13.0)],
                geomean=ratio(12.0, 11.5, 12.5),
            )
        ),
        "needs_review",
        "review.implausible_speedup",
    ),
    "validated shape not timed": (
        lambda: judge(
            validation=good_validation(("decode", "prefill", "tail")),
            benchmark=good_benchmark(),
        ),
        "reject",
        "benchmark.shapes_missing",
    ),
    "less accurate while timed": (
        lambda: judge(
            benchmark=good_benchmark(
                shapes=[shape("decode", output_deviation=2.9e-3, output_samples=3200), shape("prefill")]
            )
        ),
        "reject",
        "benchmark.output_drift",
    ),
    "misbehaved while timed": (
        lambda: judge(
            benchmark=good_benchmark(
                findings=[
                    Finding(
                        check="benchmark.output_mismatch",
                        severity="error",
                        message="stale outputs while timed",
                    )
                ]
            )
        ),
        "reject",
        "benchmark.misbehaved",
    ),
    "proof failed": (
        lambda: judge(benchmark=good_benchmark(proof_of_execution=False)),
        "needs_review",
        "review.proof_failed",
    ),
    "proof unknown": (
        lambda: judge(benchmark=good_benchmark(proof_of_execution=None)),
        "needs_review",
        "review.proof_unknown",
    ),
    "wall clock": (
        lambda: judge(benchmark=good_benchmark(timer="wall_clock", proof_of_execution=None)),
        "needs_review",
        "review.wall_clock",
    ),
    "throttled": (
        lambda: judge(benchmark=good_benchmark(throttled_samples_dropped=300)),
        "needs_review",
        "review.throttled",
    ),
    "timing ambiguous": (
        lambda: judge(benchmark=good_benchmark(findings=[Finding(
            check="benchmark.timing_ambiguous", severity="warning",
            message="own clocks supported only with a dearer switch")])),
        "needs_review",
        "review.timing_ambiguous",
    ),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_branch(name: str):
    make, verdict, code = SCENARIOS[name]
    v = make()
    assert v.verdict == verdict
    assert code in v.reason_codes
    assert len(v.reasons) == len(v.reason_codes)
    assert all(r.strip() for r in v.reasons)


def test_scenarios_cover_every_reason_code():
    all_codes = set(typing.get_args(ReasonCode))
    assert {code for _, _, code in SCENARIOS.values()} == all_codes


def test_compile_failure_explains_missing_stages_without_extra_reasons():
    make, _, _ = SCENARIOS["compile failed"]
    v = make()
    assert v.reason_codes == ["compile.failed"]
    assert "c.py:7" in v.reasons[0]
    assert v.speedup is None


def test_failed_validation_does_not_also_blame_the_missing_benchmark():
    v = judge(validation=good_validation().model_copy(update={"passed": False}), benchmark=None)
    assert v.reason_codes == ["validation.failed"]


def test_speedup_bound_is_strict():
    at_bound = good_benchmark(geomean=ratio(1.05, 1.0 + CFG.min_gain, 1.08))
    assert judge(benchmark=at_bound).verdict == "reject"
    above = good_benchmark(geomean=ratio(1.05, 1.0 + CFG.min_gain + 1e-9, 1.08))
    assert judge(benchmark=above).verdict == "accept"


def test_many_failed_cases_are_listed_compactly():
    v = good_validation()
    v.cases = [c.model_copy(update={"passed": False, "message": "mismatch"}) for c in v.cases]
    verdict = judge(validation=v)
    case_reasons = [r for r, c in zip(verdict.reasons, verdict.reason_codes, strict=True)
                    if c == "validation.case_failed"]  # fmt: skip
    assert len(case_reasons) == 6
    assert case_reasons[-1].startswith(f"{len(v.cases) - 5} more of {len(v.cases)}")


def test_case_failure_messages_are_derived_when_missing():
    v = good_validation()
    v.cases[0] = v.cases[0].model_copy(update={"passed": False, "inputs_unchanged": False})
    v.cases[1] = v.cases[1].model_copy(update={"passed": False, "nan_inf_parity": False})
    reasons = " ".join(judge(validation=v).reasons)
    assert "modified its inputs" in reasons and "NaN/Inf" in reasons


# ---------------------------------------------------------------- review details


def test_floor_slack():
    near = good_benchmark(shapes=[shape("decode", floor_s=1.03e-3), shape("prefill")])
    assert judge(benchmark=near).verdict == "accept"  # 1 ms vs floor 1.03 ms: within 5 % slack
    strict = CFG.model_copy(update={"floor_slack": 0.0})
    assert judge(benchmark=near, config=strict).verdict == "needs_review"


def test_baseline_below_floor_voids_the_roofline():
    s = shape("decode", est=0.5, low=0.45, high=0.55, cand_s=4e-3, floor_s=3e-3)
    v = judge(benchmark=good_benchmark(shapes=[s, shape("prefill")]))
    assert "review.below_floor" in v.reason_codes
    assert any("baseline median" in r for r in v.reasons)


def test_roofline_fraction_without_floor():
    s = shape("decode", roofline_fraction=1.4)
    v = judge(benchmark=good_benchmark(shapes=[s, shape("prefill")]))
    assert v.verdict == "needs_review" and v.reason_codes == ["review.below_floor"]


def test_single_implausible_shape_needs_review():
    b = good_benchmark(
        shapes=[shape("a", 15.0, 14.0, 16.0), shape("b")], geomean=ratio(4, 3.8, 4.2)
    )
    v = judge(benchmark=b)
    assert v.verdict == "needs_review" and v.reason_codes == ["review.implausible_speedup"]
    assert "Shape a" in v.reasons[0]


def test_policy_switches():
    wall = good_benchmark(timer="wall_clock", proof_of_execution=None)
    assert judge(benchmark=wall, config=GateConfig(accept_wall_clock=True)).verdict == "accept"
    unknown = good_benchmark(proof_of_execution=None)
    relaxed = GateConfig(require_proof_of_execution=False)
    assert judge(benchmark=unknown, config=relaxed).verdict == "accept"
    hip = good_benchmark(timer="hip_events", proof_of_execution=None)
    assert judge(benchmark=hip).reason_codes == ["review.proof_unknown"]


def test_throttle_fraction_threshold():
    # 2 shapes x 2 arms x 50 = 200 kept samples
    assert judge(benchmark=good_benchmark(throttled_samples_dropped=150)).verdict == "accept"
    assert judge(benchmark=good_benchmark(throttled_samples_dropped=250)).verdict == "needs_review"


# ---------------------------------------------------------------- all reasons, precedence


def test_reject_lists_every_reason_and_keeps_review_concerns_last():
    comp = CompileEvidence(
        ok=False, diagnostics=[Diagnostic(severity="error", message="x", file="c.py", line=1)]
    )
    val = _static_error_validation().model_copy(update={"passed": False})
    bench = good_benchmark(
        shapes=[shape("a", 30.0, 29.0, 31.0), shape("b", 0.5, 0.45, 0.55, n=3)],
        geomean=ratio(1.01, 0.9, 1.1),
        proof_of_execution=False,
    )
    v = judge(compile=comp, validation=val, benchmark=bench)
    assert v.verdict == "reject"
    expected = {
        "compile.failed",
        "validation.failed",
        "validation.static_error",
        "benchmark.too_few_samples",
        "speedup.insufficient",
        "shape.regression",
        "benchmark.shapes_missing",
        "review.implausible_speedup",
        "review.proof_failed",
    }
    assert set(v.reason_codes) == expected
    first_review = next(i for i, c in enumerate(v.reason_codes) if c.startswith("review."))
    assert all(c.startswith("review.") for c in v.reason_codes[first_review:])
    assert all(not c.startswith("review.") for c in v.reason_codes[:first_review])
    assert "review concern" in v.summary


def test_review_never_accepts_and_reject_dominates_review():
    review_only = judge(benchmark=good_benchmark(proof_of_execution=False))
    assert review_only.verdict == "needs_review"
    both = judge(
        validation=good_validation().model_copy(update={"passed": False}),
        benchmark=good_benchmark(proof_of_execution=False),
    )
    assert both.verdict == "reject"
    assert both.reason_codes == ["validation.failed", "review.proof_failed"]


def test_decide_is_pure():
    comp, val, bench = good_compile(), _failed_case_validation(), good_benchmark()
    before = (comp.model_dump(), val.model_dump(), bench.model_dump())
    first = decide(comp, val, bench, CFG)
    second = decide(comp, val, bench, CFG)
    assert first == second
    assert (comp.model_dump(), val.model_dump(), bench.model_dump()) == before


def test_verdict_roundtrips_through_json():
    v = judge(benchmark=good_benchmark(proof_of_execution=None))
    assert Verdict.model_validate_json(v.model_dump_json()) == v


# ---------------------------------------------------------------- contracts


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(verdict="accept", reasons=["x"], reason_codes=["review.throttled"]),
        dict(verdict="reject", reasons=["x"], reason_codes=["review.throttled"]),
        dict(verdict="reject", reasons=[], reason_codes=[]),
        dict(verdict="needs_review", reasons=["x"], reason_codes=["compile.failed"]),
        dict(verdict="needs_review", reasons=[], reason_codes=[]),
        dict(verdict="reject", reasons=["x", "y"], reason_codes=["compile.failed"]),
    ],
)
def test_verdict_invariants(kwargs):
    with pytest.raises(ValueError):
        Verdict(summary="s", **kwargs)


def test_config_and_evidence_forbid_unknown_fields():
    with pytest.raises(ValueError):
        GateConfig(min_gain=0.02, typo=1)
    with pytest.raises(ValueError):
        GateConfig(min_time_s=20.0, max_time_s=10.0)
    with pytest.raises(ValueError):
        CompileEvidence(ok=True, verdict="accept")
    assert GateConfig().model_dump()["min_gain"] == 0.02


def test_ratio_ci_must_hold_its_estimate():
    with pytest.raises(ValueError):
        ratio(1.5, 1.0, 1.2)
    with pytest.raises(ValueError):
        ratio(1.1, 1.2, 1.3)
    with pytest.raises(ValueError):
        ratio(1.1, 1.0, 1.2, level=1.5)


def test_framework_only_candidate_needs_no_proof():
    """A candidate with no kernels of its own (torch ops only) has nothing to prove ran; the
    device timer measured it like any other, so the proof rule does not send it to review."""
    b = good_benchmark(proof_of_execution=None, proof_applicable=False,
                       proof_note="the candidate defines no kernels of its own; nothing to prove")
    v = judge(benchmark=b)
    assert v.verdict == "accept", v.reasons
    assert any("no kernels of its own" in w for w in v.warnings)
    unknown = judge(benchmark=good_benchmark(proof_of_execution=None))
    assert unknown.verdict == "needs_review" and "review.proof_unknown" in unknown.reason_codes


@pytest.mark.parametrize("check", ["validation.mismatch", "validation.nan_inf", "validation.shape",
                                   "validation.exception", "guard.ctypes"])
def test_only_static_checks_are_coded_static_error(check: str):
    v = judge(validation=_finding_validation(check, "what went wrong"))
    assert v.verdict == "reject"
    assert "validation.static_error" not in v.reason_codes, v.reason_codes


def test_wall_clock_only_review_names_the_setting_that_would_allow_it():
    v = judge(benchmark=good_benchmark(timer="wall_clock"))
    assert v.verdict == "needs_review" and v.reason_codes == ["review.wall_clock"]
    assert "accept_wall_clock" in v.reasons[0]
    text = review_explanation(v.reason_codes, "/h/loom.toml")
    assert "wall clock" in text and "`[gate] accept_wall_clock = true` in /h/loom.toml" in text
    assert "implausible" not in text and "unproven" not in text


def test_review_explanation_names_each_actual_reason():
    text = review_explanation(["review.implausible_speedup", "review.throttled"])
    assert "max_plausible_speedup" in text and "throttled" in text
    assert "accept_wall_clock" not in text and "wall clock" not in text


def test_benchmark_advice_is_the_gates_rule():
    """benchmark's next_step says submit_candidate only when the gate would accept."""
    from loom_mcp.judge import benchmark_advice

    assert benchmark_advice(good_benchmark(), CFG).startswith("submit_candidate")
    regressed = good_benchmark(shapes=[shape("decode", 1.5, 1.4, 1.6),
                                       shape("prefill", 0.9, 0.88, 0.92)],
                               geomean=ratio(1.16, 1.1, 1.22))
    advice = benchmark_advice(regressed, CFG)
    assert "submit_candidate" not in advice and "prefill" in advice and "0.980x" in advice
    short = benchmark_advice(good_benchmark(geomean=ratio(1.05, 1.0, 1.1)), CFG)
    assert "submit_candidate" not in short and "1.020x" in short
    review = benchmark_advice(good_benchmark(timer="wall_clock"), CFG)
    assert "needs_review" in review and "accept_wall_clock" in review
