"""Whether the candidate computed what the baseline did while both were timed: their outputs
sampled at secret positions, compared per call and over a whole shape."""

from __future__ import annotations

import math
import statistics

SAMPLE_RTOL = 2e-2  # see samples_disagreeing
SAMPLE_SCALE_TOL = 1e-2


def samples_disagreeing(candidate: list[float] | None, baseline: list[float] | None) -> int | None:
    """How many of the candidate's sampled outputs differ from the baseline's; None when the two
    cannot be compared at all (missing, or not the same positions).

    Both arms timed the same freshly perturbed inputs (every element scaled by U(0.9, 1.1), each
    tensor by a factor in [0.905, 1.105]),
    so an output computed from stale inputs or taken from a cache is off by a few percent at
    most positions. An honest kernel differs by rounding only: one bf16 step is 0.4-0.8 %, and
    validation has already held it to the task's tolerance. The bound here is loose for
    rounding and tight for stale data: 2 % of the value plus 1 % of the samples' median size
    (so near-zero outputs compare on the output's scale, not their own).
    """
    if candidate is None or baseline is None or len(candidate) != len(baseline):
        return None
    finite = [abs(y) for y in baseline if math.isfinite(y)]
    scale = statistics.median(finite) if finite else 0.0
    off = 0
    for x, y in zip(candidate, baseline, strict=True):
        if math.isnan(x) and math.isnan(y):
            continue
        if not (math.isfinite(x) and math.isfinite(y)):
            off += x != y
        elif abs(x - y) > SAMPLE_RTOL * abs(y) + SAMPLE_SCALE_TOL * scale + 1e-12:
            off += 1
    return off


def squared_deviation(candidate: list[float] | None, baseline: list[float] | None) -> tuple[float, float, int]:
    """(sum of (candidate - baseline)^2, sum of baseline^2, how many) over the sampled positions
    where both are finite: summed over a shape's calls, their ratio's square root is the
    normwise deviation the gate holds against validation's bound (gate._judge_output_drift).
    A candidate may differ from the baseline by its own rounding and the baseline's, both of
    which validation measured; a lower precision or stale data used only while timed shows
    here even where the loose per-sample rule above lets it pass."""
    if candidate is None or baseline is None or len(candidate) != len(baseline):
        return 0.0, 0.0, 0
    dev = ref = 0.0
    n = 0
    for x, y in zip(candidate, baseline, strict=True):
        if math.isfinite(x) and math.isfinite(y):
            dev += (x - y) ** 2
            ref += y * y
            n += 1
    return dev, ref, n


def call_agrees(off: int | None, probes: int) -> bool:
    """One call's samples agree unless more than a quarter of them differ, so one unlucky
    element cannot reject a kernel; `shape_disagrees` looks at all of a shape's calls."""
    return off is not None and off * 4 <= probes


def samples_agree(candidate: list[float] | None, baseline: list[float] | None) -> bool:
    return call_agrees(samples_disagreeing(candidate, baseline), len(baseline or []))


def shape_disagrees(off: int, total: int) -> bool:
    """Over every timed call of a shape: more than a tenth of the sampled outputs differ.

    A candidate that skips a tenth of its work only while timed stays under a quarter in most
    single calls, but not in the sum of hundreds. An honest kernel differing at a tenth of the
    positions would already fail some single calls over that many (the chance that 32 probes
    at 10 % show more than 8 is 0.4 % per call), so this flags nothing the per-call rule spares.
    """
    return total > 0 and off * 10 > total
