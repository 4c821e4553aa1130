"""The trusted timer's brackets: their own cost, which pairs count, and the check of the arms'
own clocks against them."""

from __future__ import annotations

from typing import Any

from loom_mcp.bench.stats import analyze_shapes
from loom_mcp.judge_models import Finding, GateConfig, RatioCI, ShapeSamples

EMPTY_CALLS = 2  # empty brackets per batch, run by the baseline arm: the timer's own cost
MIN_CORRECTED_S = 1e-8


def subtract_overhead(times: list[float], overhead: float) -> list[float]:
    """Call times less the bracket's own cost, floored so a noisy short call stays positive."""
    return [max(t - overhead, MIN_CORRECTED_S) for t in times]


# How far the arms' own timings may claim more speed than the trusted timer's brackets of the
# same calls allow (beyond the brackets' CI). The brackets carry a context switch each way; on
# the H200 they read identical arms up to 7 % apart in one benchmark, so less would reject
# honest work. A forged clock gains at most this much.
OWN_TIMING_ALLOWANCE = 0.10


def trusted_geomean_of(shape_meta: list[dict], samples: dict[str, dict[str, Any]], gate: GateConfig) -> RatioCI | None:
    """The geomean speedup by the trusted timer's brackets alone, where the arms timed
    themselves as well (GPU); None where the brackets are the samples already (CPU)."""
    trusted = [
        ShapeSamples(
            name=m["name"], baseline_s=samples[m["name"]]["trusted_a"], candidate_s=samples[m["name"]]["trusted_b"]
        )
        for m in shape_meta
        if samples[m["name"]].get("trusted_a")
    ]
    if not trusted:
        return None
    return analyze_shapes(trusted, gate).geomean


def trusted_pairs(
    baseline: list[float], candidate: list[float], baseline_late: list[bool], candidate_late: list[bool]
) -> list[tuple[float, float]]:
    """The bracket pairs the trusted side is computed from. A late bracket (the arm's work was
    done before the timer queued its end event, so it also timed launch latency) drops its
    pair. An arm late on purpose (replying only once its work is done) must not empty the
    trusted side: when fewer than half the pairs are on time, every pair counts, and a late
    bracket only makes its own arm look slower."""
    both = list(zip(baseline, candidate, strict=True))
    late = [a or b for a, b in zip(baseline_late, candidate_late, strict=True)]
    kept = [pair for pair, was_late in zip(both, late, strict=True) if not was_late]
    return kept if len(kept) * 2 >= len(both) else both


def flag_disagreement(trusted: RatioCI, own: RatioCI, findings: list[Finding]) -> None:
    """An error finding (the gate rejects) when the arms' own clocks claim a speedup the trusted
    timer's brackets cannot support: a clock rewritten inside the candidate's process."""
    if own.estimate > trusted.ci_high * (1 + OWN_TIMING_ALLOWANCE):
        findings.append(
            Finding(
                check="benchmark.timing_disagreement",
                severity="error",
                message=f"the arms' own clocks give {own.estimate:.3f}x but the trusted timer's "
                f"brackets of the same calls give {trusted.estimate:.3f}x "
                f"[{trusted.ci_low:.3f}, {trusted.ci_high:.3f}]: more than "
                f"{OWN_TIMING_ALLOWANCE:.0%} apart (a clock changed inside the candidate's "
                "process?)",
            )
        )
