"""What a command benchmark reports: per metric the paired comparison, compact, then the
findings and the next step.

Per metric and arm: a SampleSummary (median, mean, std, ...; four significant digits) and the
bootstrap CI of the median (``baseline_ci`` / ``candidate_ci``) at the gate's CI level.

The ratio is an improvement factor, > 1 meaning the candidate is better: candidate/baseline of
the medians for a higher-is-better metric, baseline/candidate for a lower-is-better one. Both
come from `stats.ratio_ci` (median(first)/median(second), paired bootstrap over the same pair
indices), called as ``ratio_ci(candidate, baseline)`` for throughputs and ``ratio_ci(baseline,
candidate)`` for times: swapping the arms, not inverting the values, because the median of
reciprocals is not the reciprocal of the median for an even number of runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from loom_mcp.bench.command_models import Arm, MetricComparison
from loom_mcp.bench.command_runs import Run
from loom_mcp.bench.metrics import Kind
from loom_mcp.bench.stats import ratio_ci, summarize
from loom_mcp.judge_models import Finding, GateConfig, RatioCI, SampleSummary

# Four significant digits (0.1 %) are finer than any run-to-run noise a command shows, and keep
# ten metrics near 4 KB.
_SIG_DIGITS = 4


def _sig(x: float, digits: int = _SIG_DIGITS) -> float:
    return float(f"{x:.{digits}g}") if math.isfinite(x) and x != 0 else x


def _compact_summary(s: SampleSummary) -> SampleSummary:
    # Spreads below float rounding of the median (identical runs) are reported as exact zeros.
    tiny = 1e-9 * abs(s.median)
    update = {k: _sig(getattr(s, k)) for k in ("median", "mean", "min", "max")}
    for k in ("std", "stderr", "iqr", "mad"):
        value = getattr(s, k)
        update[k] = 0.0 if abs(value) <= tiny else _sig(value)
    return s.model_copy(update=update)


def median_ci(samples: Sequence[float], gate: GateConfig) -> list[float]:
    """Percentile bootstrap CI of one arm's median, widened to hold the median itself."""
    x = np.asarray(samples, dtype=np.float64)
    median = float(np.median(x))
    if x.size < 2:
        return [median, median]
    rng = np.random.default_rng([gate.bootstrap_seed, x.size])
    idx = rng.integers(0, x.size, size=(gate.bootstrap_resamples, x.size))
    alpha = 1.0 - gate.ci_level
    lo, hi = np.quantile(np.median(x[idx], axis=1), [alpha / 2, 1 - alpha / 2])
    return [_sig(min(float(lo), median)), _sig(max(float(hi), median))]


def _compact_ratio(r: RatioCI) -> RatioCI:
    return r.model_copy(update={k: _sig(getattr(r, k)) for k in ("estimate", "ci_low", "ci_high")})


def compare(name: str, higher: bool, pairs: list[dict[Arm, Run]], gate: GateConfig) -> MetricComparison:
    """One metric over the kept pairs: each arm's summary and median CI, and the ratio."""
    b = [p["baseline"].values[name] for p in pairs]
    c = [p["candidate"].values[name] for p in pairs]
    # ratio_ci returns median(first)/median(second): candidate first for throughputs, baseline
    # first for times, so the estimate is always "> 1 = candidate better".
    first, second = (c, b) if higher else (b, c)
    ci = ratio_ci(
        first,
        second,
        level=gate.ci_level,
        resamples=gate.bootstrap_resamples,
        seed=gate.bootstrap_seed,
    )
    return MetricComparison(
        name=name,
        higher_is_better=higher,
        baseline=_compact_summary(summarize(b)),
        baseline_ci=median_ci(b, gate),
        candidate=_compact_summary(summarize(c)),
        candidate_ci=median_ci(c, gate),
        ratio=_compact_ratio(ci),
    )


def command_findings(
    comparisons: list[MetricComparison], pairs: list[dict[Arm, Run]], kinds: dict[Arm, Kind]
) -> list[Finding]:
    """Warnings on how far the result can be trusted: few pairs, noise, unlike parsers."""
    findings: list[Finding] = []
    if len(pairs) < 5:
        findings.append(
            Finding(
                check="bench.command.few_runs",
                severity="warning",
                message=f"only {len(pairs)} pairs: the CIs are rough; 5 or more pairs are better",
            )
        )
    noisy = [
        m.name
        for m in comparisons
        if m.ratio.ci_low <= 1 <= m.ratio.ci_high
        and any(s.mean > 0 and s.std / s.mean > 0.05 for s in (m.baseline, m.candidate))
    ]
    if noisy:
        findings.append(
            Finding(
                check="bench.command.noisy",
                severity="warning",
                message="runs vary by more than 5 % and the CI spans 1 on "
                + ", ".join(noisy[:5])
                + ": add runs, lengthen each run, or quiet the machine",
            )
        )
    if kinds["baseline"] != kinds["candidate"]:
        findings.append(
            Finding(
                check="bench.command.parsers_differ",
                severity="warning",
                message=f"baseline output reads as {kinds['baseline']}, candidate as "
                f"{kinds['candidate']}: same-named metrics may not be defined alike",
            )
        )
    return findings


def next_step(comparisons: list[MetricComparison], pairs: int) -> str:
    def names(ms: list[MetricComparison]) -> str:
        shown = ", ".join(f"{m.name} x{m.ratio.estimate:.3g}" for m in ms[:4])
        return shown + (f" (+{len(ms) - 4} more)" if len(ms) > 4 else "")

    better = [m for m in comparisons if m.ratio.ci_low > 1]
    worse = [m for m in comparisons if m.ratio.ci_high < 1]
    unclear = [m for m in comparisons if m not in better and m not in worse]
    parts = []
    if better:
        parts.append(f"candidate better on {names(better)}")
    if worse:
        parts.append(f"worse on {names(worse)}")
    if unclear:
        parts.append(
            f"no clear difference on {names(unclear)} (CI spans 1; {pairs} pairs): add runs if a small change matters"
        )
    return "; ".join(parts) + ". Ratios are improvement factors (> 1 = candidate better)."
