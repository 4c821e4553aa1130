"""The trusted timer's brackets: their own cost, which pairs count, and the check of the arms'
own clocks against them."""

from __future__ import annotations

import statistics
from typing import Any

from loom_mcp.bench.stats import analyze_shapes
from loom_mcp.judge_models import Finding, GateConfig, RatioCI, ShapeSamples

EMPTY_CALLS = 2  # empty brackets per batch and arm: the timer's own cost
MIN_CORRECTED_S = 1e-8
# The most of a bracket that is put down to the harness (the arm's own events and the hand-over
# of its outputs, about a microsecond on an H200) rather than to the call. Measured on the
# baseline arm; capped so that no reading of it can excuse more than this of a candidate's time.
HARNESS_RESIDUAL_MAX_S = 5e-6


def subtract_overhead(times: list[float], overhead: float) -> list[float]:
    """Call times less the bracket's own cost, floored so a noisy short call stays positive."""
    return [max(t - overhead, MIN_CORRECTED_S) for t in times]


# How much dearer the context switch into the candidate's process may honestly be than into the
# baseline's: on an H200 one process's switch read 283 us and the other's 293 us for a whole
# benchmark (either process may land on either), and capping the candidate at the baseline's
# cost left those 10 us in every candidate bracket: an honest 8 us softmax read as a forged
# clock. A candidate can also slow only its empty calls (it knows which they are), so a check
# that clears only with this allowance sends the candidate to review; it never accepts it.
CONTEXT_SWITCH_SPREAD_S = 12e-6


def candidate_bracket_cost(
    baseline_cost: float, candidate_empties: list[float], spread: float = CONTEXT_SWITCH_SPREAD_S
) -> float:
    """What is subtracted from the candidate's brackets as the timer's own cost: its own empty
    calls' median (the context switch into one process costs microseconds more or less than
    into another), but never more than `spread` above the baseline's: an arm that slowed its
    empty calls must not get more taken off its real ones. spread=0 is the strict reading, the
    one whose brackets count as samples (CPU) and clear a candidate outright."""
    if not candidate_empties:
        return baseline_cost
    return min(statistics.median(candidate_empties), baseline_cost + spread)


def harness_residual(trusted_baseline: list[float], own_baseline: list[float]) -> float:
    """What the baseline's brackets (their context switches already subtracted) hold beyond the
    baseline's own events of the same calls: harness work inside the bracket that the arms'
    events leave out. Both arms run the same harness, so it is subtracted from both arms'
    brackets; left in, it compresses their ratio, which flagged an honest 3.7 us kernel at
    2.85x as a forged clock. Read from the baseline only (code the candidate does not run)."""
    if not trusted_baseline or not own_baseline:
        return 0.0
    gap = statistics.median(trusted_baseline) - statistics.median(own_baseline)
    return min(max(gap, 0.0), HARNESS_RESIDUAL_MAX_S)


# How far the arms' own timings may claim more speed than the trusted timer's brackets of the
# same calls allow (beyond the brackets' CI). The brackets carry a context switch each way; on
# the H200 they read identical arms up to 7 % apart in one benchmark, so less would reject
# honest work. A forged clock gains at most this much.
OWN_TIMING_ALLOWANCE = 0.10


# What the brackets cannot resolve, per call: after both subtractions an honest candidate's
# brackets still read up to about 3.5 us more than its own events on an H200 (the context switch
# into each process varies by microseconds), most of a 4 us kernel's time. The candidate's
# brackets are read this much shorter before they are compared; its own clock is not trusted
# more than this anyway (it is read through functions taken before candidate code loads).
BRACKET_RESOLUTION_S = 5e-6


def trusted_geomean_of(
    shape_meta: list[dict], samples: dict[str, dict[str, Any]], gate: GateConfig, key: str = "trusted_b"
) -> RatioCI | None:
    """The geomean speedup by the trusted timer's brackets alone, where the arms timed
    themselves as well (GPU), with the benefit of the brackets' resolution given to the
    candidate; None where the brackets are the samples already (CPU)."""
    trusted = [
        ShapeSamples(
            name=m["name"],
            baseline_s=samples[m["name"]]["trusted_a"],
            candidate_s=subtract_overhead(samples[m["name"]][key], BRACKET_RESOLUTION_S),
        )
        for m in shape_meta
        if samples[m["name"]].get("trusted_a") and samples[m["name"]].get(key)
    ]
    if not trusted:
        return None
    return analyze_shapes(trusted, gate).geomean


def trusted_pairs(
    baseline: list[float], candidate: list[float], baseline_late: list[bool], candidate_late: list[bool]
) -> list[tuple[float, float]]:
    """The bracket pairs the trusted side is computed from. A late bracket (the GPU was past the
    release before the arm had queued its work, so it may also have timed launch latency)
    drops its pair. An arm late on purpose (replying only once its work is done) must not empty the
    trusted side: when fewer than half the pairs are on time, every pair counts, and a late
    bracket only makes its own arm look slower."""
    both = list(zip(baseline, candidate, strict=True))
    late = [a or b for a, b in zip(baseline_late, candidate_late, strict=True)]
    kept = [pair for pair, was_late in zip(both, late, strict=True) if not was_late]
    return kept if len(kept) * 2 >= len(both) else both


def flag_disagreement(trusted: RatioCI, own: RatioCI, findings: list[Finding], lenient: RatioCI | None = None) -> None:
    """An error finding (the gate rejects) when the arms' own clocks claim a speedup the trusted
    timer's brackets cannot support: a clock rewritten inside the candidate's process. `trusted`
    is the strict reading of the brackets; `lenient` (if given) also grants the candidate's
    process a dearer context switch as its empty calls measured it. A claim only the lenient
    reading supports is a warning that sends the candidate to review: an honest process that
    switches slower and a candidate that slowed its empty calls look the same."""
    widest = lenient if lenient is not None and lenient.ci_high > trusted.ci_high else trusted
    if own.estimate > widest.ci_high * (1 + OWN_TIMING_ALLOWANCE):
        findings.append(
            Finding(
                check="benchmark.timing_disagreement",
                severity="error",
                message=f"the arms' own clocks give {own.estimate:.3f}x but the trusted timer's "
                f"brackets of the same calls give {widest.estimate:.3f}x "
                f"[{widest.ci_low:.3f}, {widest.ci_high:.3f}]: more than "
                f"{OWN_TIMING_ALLOWANCE:.0%} apart (a clock changed inside the candidate's "
                "process?)",
            )
        )
    elif own.estimate > trusted.ci_high * (1 + OWN_TIMING_ALLOWANCE):
        findings.append(
            Finding(
                check="benchmark.timing_ambiguous",
                severity="warning",
                message=f"the arms' own clocks give {own.estimate:.3f}x; the trusted timer's "
                f"brackets support that only if the switch into the candidate's process really "
                f"costs what its empty calls measured (up to {CONTEXT_SWITCH_SPREAD_S * 1e6:.0f} us "
                f"more than the baseline's): {widest.estimate:.3f}x with it, "
                f"{trusted.estimate:.3f}x [{trusted.ci_low:.3f}, {trusted.ci_high:.3f}] without. "
                "A human should look (rerun: the switch cost varies between processes)",
            )
        )
