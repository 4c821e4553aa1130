"""Bootstrap CIs of speedups: the ratio of medians per shape, and their geomean.

Pure numpy, no device code, so it runs in the trusted server and is tested on CPU.

Bootstrap design (the decision and why):

* Samples arrive as interleaved A/B *pairs*: pair i is (baseline_i, candidate_i), measured back to
  back. Adjacent samples share the device's state at that moment (clocks, temperature, a
  neighbour's load), so part of the noise is common to both arms. Resampling *pairs* (the same
  indices for both arms) keeps that covariance, and the CI of the ratio of medians is as narrow as
  the data justifies. Resampling each arm independently throws the covariance away; it is never
  too narrow when noise is common-mode, only too wide, so it is the fallback when the arms cannot
  be paired (unequal lengths). Under independent noise both give the same answer.
* The statistic is median(baseline) / median(candidate): medians shrug off the long right tail of
  GPU timings (preemption, a late clock ramp) without dropping samples.
* Intervals are percentile intervals on the log ratio (speedups are multiplicative), widened if
  needed so they always contain the point estimate.
* The geomean CI is a joint bootstrap: replicate b resamples every shape (each from its own
  seeded stream, shapes being independent experiments), and its geomean is exp(mean of the log
  ratios of replicate b). Per-shape CIs come from the same replicates, so they agree.
* The RNG is seeded (`GateConfig.bootstrap_seed`): the same samples always give the same CI, so
  a verdict can be reproduced from its stored samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from loom_mcp.bench.summary import as_array
from loom_mcp.judge_models import RatioCI

# Rows of the resample index matrix built at once: caps memory at ~16 MB of int64 per arm even
# for thousands of samples, while keeping numpy's vectorised median.
_MAX_CHUNK_ELEMENTS = 2_000_000


def _replicates(
    n: int, resamples: int, rng: np.random.Generator, statistic: Callable[[np.ndarray], np.ndarray]
) -> np.ndarray:
    """`statistic` of `resamples` index resamples of n samples, drawn a chunk of rows at a time."""
    rows = max(1, _MAX_CHUNK_ELEMENTS // max(n, 1))
    out = np.empty(resamples)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        out[start:stop] = statistic(rng.integers(0, n, size=(stop - start, n)))
    return out


def _chunked_medians(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    return _replicates(x.size, resamples, rng, lambda idx: np.median(x[idx], axis=1))


def _paired_log_ratio_replicates(b: np.ndarray, c: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    def log_ratio(idx: np.ndarray) -> np.ndarray:  # same pairs for both arms
        return np.log(np.median(b[idx], axis=1)) - np.log(np.median(c[idx], axis=1))

    return _replicates(b.size, resamples, rng, log_ratio)


def log_ratio_replicates(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    resamples: int,
    rng: np.random.Generator,
    paired: bool | None = None,
) -> tuple[np.ndarray, Literal["paired_bootstrap", "independent_bootstrap"]]:
    """Bootstrap replicates of log(median(baseline) / median(candidate)).

    paired=None pairs the arms when they have equal length (ABAB output always does).
    """
    b = as_array(baseline, "baseline samples")
    c = as_array(candidate, "candidate samples")
    if b.size == 0 or c.size == 0:
        raise ValueError("both arms need at least one sample")
    if np.any(b <= 0) or np.any(c <= 0):
        raise ValueError("times must be positive")
    if paired is None:
        paired = b.size == c.size
    if paired:
        if b.size != c.size:
            raise ValueError("paired bootstrap needs arms of equal length")
        return _paired_log_ratio_replicates(b, c, resamples, rng), "paired_bootstrap"
    reps = np.log(_chunked_medians(b, resamples, rng)) - np.log(_chunked_medians(c, resamples, rng))
    return reps, "independent_bootstrap"


def _ci_from_log_replicates(
    estimate: float,
    reps: np.ndarray,
    level: float,
    method: Literal["paired_bootstrap", "independent_bootstrap", "degenerate"],
) -> RatioCI:
    alpha = 1.0 - level
    lo, hi = np.quantile(reps, [alpha / 2, 1 - alpha / 2])
    low = min(float(np.exp(lo)), estimate)
    high = max(float(np.exp(hi)), estimate)
    return RatioCI(
        estimate=estimate,
        ci_low=low,
        ci_high=high,
        level=level,
        resamples=int(reps.size),
        method=method,
    )


def _degenerate(estimate: float, level: float) -> RatioCI:
    return RatioCI(
        estimate=estimate,
        ci_low=estimate,
        ci_high=estimate,
        level=level,
        resamples=0,
        method="degenerate",
    )


def ratio_ci(
    baseline: ArrayLike,
    candidate: ArrayLike,
    *,
    level: float = 0.95,
    resamples: int = 5000,
    seed: int = 0,
    paired: bool | None = None,
) -> RatioCI:
    """Speedup median(baseline)/median(candidate) with a bootstrap CI at `level`.

    With fewer than 2 samples in an arm there is nothing to resample: the CI collapses to the
    estimate (method 'degenerate') and the gate's min_pairs rule rejects it.
    """
    b = as_array(baseline, "baseline samples")
    c = as_array(candidate, "candidate samples")
    if b.size == 0 or c.size == 0:
        raise ValueError("both arms need at least one sample")
    estimate = float(np.median(b) / np.median(c))
    if b.size < 2 or c.size < 2:
        return _degenerate(estimate, level)
    rng = np.random.default_rng(seed)
    reps, method = log_ratio_replicates(b, c, resamples=resamples, rng=rng, paired=paired)
    return _ci_from_log_replicates(estimate, reps, level, method)


def geomean(values: ArrayLike) -> float:
    v = as_array(values, "ratios")
    if v.size == 0 or np.any(v <= 0):
        raise ValueError("geomean needs positive values")
    return float(np.exp(np.mean(np.log(v))))


def _shape_rng(seed: int, index: int) -> np.random.Generator:
    # One independent, reproducible stream per shape: adding a shape does not move the others.
    return np.random.default_rng([seed, index])


def geomean_ci(
    shapes: Sequence[tuple[ArrayLike, ArrayLike]],
    *,
    level: float = 0.95,
    resamples: int = 5000,
    seed: int = 0,
    paired: bool | None = None,
) -> RatioCI:
    """Geometric mean of per-shape speedups with a joint bootstrap CI (see module docstring)."""
    _, _, combined = joint_cis(shapes, level=level, resamples=resamples, seed=seed, paired=paired)
    return combined


def joint_cis(
    shapes: Sequence[tuple[ArrayLike, ArrayLike]],
    *,
    level: float,
    resamples: int,
    seed: int,
    paired: bool | None,
) -> tuple[list[float], list[RatioCI], RatioCI]:
    """Per-shape estimates and CIs, and the geomean's CI, from the same joint replicates."""
    if not shapes:
        raise ValueError("geomean needs at least one shape")
    estimates: list[float] = []
    per_shape: list[RatioCI] = []
    log_reps: list[np.ndarray] = []
    methods: set[str] = set()
    for i, (baseline, candidate) in enumerate(shapes):
        b = as_array(baseline, "baseline samples")
        c = as_array(candidate, "candidate samples")
        if b.size == 0 or c.size == 0:
            raise ValueError(f"shape {i}: both arms need at least one sample")
        est = float(np.median(b) / np.median(c))
        estimates.append(est)
        if b.size < 2 or c.size < 2:
            # Nothing to resample: this shape contributes its point estimate to every replicate.
            per_shape.append(_degenerate(est, level))
            log_reps.append(np.full(resamples, np.log(est)))
            methods.add("degenerate")
            continue
        reps, method = log_ratio_replicates(b, c, resamples=resamples, rng=_shape_rng(seed, i), paired=paired)
        per_shape.append(_ci_from_log_replicates(est, reps, level, method))
        log_reps.append(reps)
        methods.add(method)
    joint = np.mean(np.vstack(log_reps), axis=0)
    combined_estimate = geomean(estimates)
    if methods == {"degenerate"}:
        combined = _degenerate(combined_estimate, level)
    else:
        method = (  # typed by log_ratio_replicates above
            "paired_bootstrap" if methods <= {"paired_bootstrap", "degenerate"} else "independent_bootstrap"
        )
        combined = _ci_from_log_replicates(combined_estimate, joint, level, method)
    return estimates, per_shape, combined
