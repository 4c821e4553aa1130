"""Statistics of the benchmark: summaries, the stopping rule, filtering, bootstrap CIs, floors.

Pure numpy/scipy, no device code, so it runs in the trusted server and is tested on CPU.

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

Blocks (CPU wall clock):

* On a CPU a process keeps a bias of a few percent for its whole life (core placement, memory
  layout, allocator state): an identical candidate read 0.952 [0.949, 0.955] in one run and
  1.043 [1.039, 1.046] in the next. Samples within one process pair are independent of nothing
  that matters, so any CI over samples is far too narrow. The unit of replication is a *block*:
  a fresh timer and pair of arm processes. Each block gives one log ratio of medians per shape.
* The CI is a Student t interval of the mean of the blocks' log ratios (per shape; for the
  geomean, of each block's mean over shapes). With 4-8 blocks a bootstrap over blocks is too
  narrow (a percentile bootstrap of 4 values covers far less than 95 %); the t interval is exact
  when the log ratios are normal.
* Blocks are added until the geomean CI's relative half-width is below
  `wall_clock_ci_target`, from `wall_clock_blocks` up to `wall_clock_max_blocks`. The rule looks
  at the width only, never at which side of the threshold the estimate lies, so it does not
  shop for a verdict.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike
from pydantic import BaseModel, ConfigDict

from loom_mcp.judge_models import GateConfig, RatioCI, SampleSummary, ShapeSamples, ShapeTiming

# Rows of the resample index matrix built at once: caps memory at ~16 MB of int64 per arm even
# for thousands of samples, while keeping numpy's vectorised median.
_MAX_CHUNK_ELEMENTS = 2_000_000


def _as_array(samples: ArrayLike, what: str = "samples") -> np.ndarray:
    arr = np.asarray(samples, dtype=np.float64).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{what} contain NaN or Inf")
    return arr


# ---------------------------------------------------------------- summaries


def summarize(samples: ArrayLike) -> SampleSummary:
    """Median, mean, std (n-1), stderr, IQR, MAD, min, max of one arm.

    A single sample has std and stderr 0.0; the stopping rule never trusts fewer than 2 samples.
    """
    x = _as_array(samples)
    n = int(x.size)
    if n == 0:
        raise ValueError("cannot summarize zero samples")
    median = float(np.median(x))
    std = float(np.std(x, ddof=1)) if n > 1 else 0.0
    q1, q3 = np.percentile(x, [25, 75])
    return SampleSummary(
        n=n,
        median=median,
        mean=float(np.mean(x)),
        std=std,
        stderr=std / float(np.sqrt(n)),
        iqr=float(q3 - q1),
        mad=float(np.median(np.abs(x - median))),
        min=float(np.min(x)),
        max=float(np.max(x)),
    )


def relative_median_stderr(samples: ArrayLike) -> float:
    """Standard error of the median / median, from a robust spread; +inf when not estimable.

    se(median) = sqrt(pi/2) * sigma / sqrt(n), with sigma = 1.4826 * MAD (the normal-consistent
    MAD; the IQR's when the MAD is zero on quantised timers). The benchmark reports medians, so
    this is the precision that matters: a few slow outliers (a preempted launch, a clock ramp)
    inflate the mean's standard error for ever but move the median by one rank.
    """
    x = _as_array(samples)
    if x.size < 2:
        return float("inf")
    median = float(np.median(x))
    if median <= 0:
        return float("inf")
    sigma = 1.4826 * float(np.median(np.abs(x - median)))
    if sigma == 0.0:
        q1, q3 = np.percentile(x, [25, 75])
        sigma = float(q3 - q1) / 1.349
    return float(np.sqrt(np.pi / 2) * sigma / np.sqrt(x.size) / median)


# ---------------------------------------------------------------- stopping rule

StopReason = Literal["precise", "time_cap"]


def stop_reason(
    samples: ArrayLike,
    stderr_target: float,
    min_samples: int,
    min_time_s: float,
    max_time_s: float,
    elapsed: float,
) -> StopReason | None:
    """Why sampling should stop now, or None to keep going.

    The time cap wins over everything (a slow kernel must not hold the device forever). Before
    min_samples and min_time_s nothing else counts: an early, lucky low variance is not precision.
    After that, stop once the median's relative standard error < stderr_target. (nvbench and
    gpu-mode use stderr/mean, which a few slow outliers keep high long after the medians we
    report are precise.)
    """
    if elapsed >= max_time_s:
        return "time_cap"
    if elapsed < min_time_s:  # checked first: this runs after every pair
        return None
    x = _as_array(samples)
    if x.size < max(min_samples, 2):
        return None
    if relative_median_stderr(x) < stderr_target:
        return "precise"
    return None


def paired_stop_reason(
    baseline: ArrayLike,
    candidate: ArrayLike,
    config: GateConfig,
    elapsed: float,
) -> StopReason | None:
    """The A/B loop stops when both arms are precise, or at the time cap."""
    args = (config.stderr_target, config.min_samples, config.min_time_s, config.max_time_s, elapsed)
    reasons = (stop_reason(baseline, *args), stop_reason(candidate, *args))
    if None in reasons:
        return None
    return "time_cap" if "time_cap" in reasons else "precise"


# ---------------------------------------------------------------- filtering


def iqr_keep_mask(samples: ArrayLike, k: float = 1.5) -> np.ndarray:
    """True for samples inside [Q1 - k*IQR, Q3 + k*IQR] (Tukey fences; TritonBench uses k=1.5)."""
    x = _as_array(samples)
    if x.size == 0:
        return np.zeros(0, dtype=bool)
    q1, q3 = np.percentile(x, [25, 75])
    spread = q3 - q1
    return (x >= q1 - k * spread) & (x <= q3 + k * spread)


@dataclass(frozen=True)
class FilteredSamples:
    baseline: np.ndarray
    candidate: np.ndarray
    throttled_dropped: int
    outliers_dropped: int
    blocks: np.ndarray | None = None  # each kept pair's block, when the pairs came in blocks

    @property
    def paired(self) -> bool:
        return self.baseline.size == self.candidate.size


def filter_samples(
    samples: ArrayLike, throttled: Sequence[bool] | None = None, iqr_k: float | None = None
) -> tuple[np.ndarray, int, int]:
    """One arm: drop throttled samples, then (optionally) Tukey outliers.

    Returns (kept, throttled_dropped, outliers_dropped). Throttle flags go first because a
    throttled sample is known-bad, while an outlier is only unusual.
    """
    x = _as_array(samples)
    keep = np.ones(x.size, dtype=bool)
    if throttled is not None:
        flags = np.asarray(throttled, dtype=bool)
        if flags.size != x.size:
            raise ValueError("need one throttle flag per sample")
        keep &= ~flags
    throttled_dropped = int(x.size - keep.sum())
    outliers_dropped = 0
    if iqr_k is not None and keep.sum() >= 4:
        inner = iqr_keep_mask(x[keep], iqr_k)
        outliers_dropped = int((~inner).sum())
        idx = np.flatnonzero(keep)
        keep[idx[~inner]] = False
    return x[keep], throttled_dropped, outliers_dropped


def filter_pairs(
    baseline: ArrayLike,
    candidate: ArrayLike,
    throttled: Sequence[bool] | None = None,
    iqr_k: float | None = None,
    blocks: Sequence[int] | None = None,
) -> FilteredSamples:
    """Paired arms: drop whole pairs, so the survivors stay paired.

    A pair goes if it was taken while throttled, or (with iqr_k) if either arm's sample is a
    Tukey outlier within its own arm. Counts are samples (a dropped pair counts 2), the unit
    BenchmarkEvidence reports. Arms of unequal length cannot be
    paired; they are filtered per arm (throttle flags and block labels then cannot apply).
    """
    b = _as_array(baseline, "baseline samples")
    c = _as_array(candidate, "candidate samples")
    labels = None if blocks is None else np.asarray(blocks, dtype=np.int64).ravel()
    if labels is not None and labels.size != b.size:
        raise ValueError("need one block label per pair")
    if b.size != c.size:
        if throttled is not None or labels is not None:
            raise ValueError("throttle flags and block labels need paired arms of equal length")
        bk, _, bo = filter_samples(b, None, iqr_k)
        ck, _, co = filter_samples(c, None, iqr_k)
        return FilteredSamples(bk, ck, 0, bo + co)
    keep = np.ones(b.size, dtype=bool)
    if throttled is not None:
        flags = np.asarray(throttled, dtype=bool)
        if flags.size != b.size:
            raise ValueError("need one throttle flag per pair")
        keep &= ~flags
    throttled_dropped = 2 * int(b.size - keep.sum())
    outliers_dropped = 0
    if iqr_k is not None and keep.sum() >= 4:
        idx = np.flatnonzero(keep)
        inner = iqr_keep_mask(b[idx], iqr_k) & iqr_keep_mask(c[idx], iqr_k)
        outliers_dropped = 2 * int((~inner).sum())
        keep[idx[~inner]] = False
    return FilteredSamples(b[keep], c[keep], throttled_dropped, outliers_dropped,
                           None if labels is None else labels[keep])


# ---------------------------------------------------------------- bootstrap


def _chunked_medians(x: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    n = x.size
    rows = max(1, _MAX_CHUNK_ELEMENTS // max(n, 1))
    out = np.empty(resamples)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = np.median(x[idx], axis=1)
    return out


def _paired_log_ratio_replicates(
    b: np.ndarray, c: np.ndarray, resamples: int, rng: np.random.Generator
) -> np.ndarray:
    n = b.size
    rows = max(1, _MAX_CHUNK_ELEMENTS // max(n, 1))
    out = np.empty(resamples)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        idx = rng.integers(0, n, size=(stop - start, n))  # same pairs for both arms
        out[start:stop] = np.log(np.median(b[idx], axis=1)) - np.log(np.median(c[idx], axis=1))
    return out


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
    b = _as_array(baseline, "baseline samples")
    c = _as_array(candidate, "candidate samples")
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
    b = _as_array(baseline, "baseline samples")
    c = _as_array(candidate, "candidate samples")
    if b.size == 0 or c.size == 0:
        raise ValueError("both arms need at least one sample")
    estimate = float(np.median(b) / np.median(c))
    if b.size < 2 or c.size < 2:
        return _degenerate(estimate, level)
    rng = np.random.default_rng(seed)
    reps, method = log_ratio_replicates(b, c, resamples=resamples, rng=rng, paired=paired)
    return _ci_from_log_replicates(estimate, reps, level, method)


def geomean(values: ArrayLike) -> float:
    v = _as_array(values, "ratios")
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
    _, _, combined = _joint(shapes, level=level, resamples=resamples, seed=seed, paired=paired)
    return combined


def _joint(
    shapes: Sequence[tuple[ArrayLike, ArrayLike]],
    *,
    level: float,
    resamples: int,
    seed: int,
    paired: bool | None,
) -> tuple[list[float], list[RatioCI], RatioCI]:
    if not shapes:
        raise ValueError("geomean needs at least one shape")
    estimates: list[float] = []
    per_shape: list[RatioCI] = []
    log_reps: list[np.ndarray] = []
    methods: set[str] = set()
    for i, (baseline, candidate) in enumerate(shapes):
        b = _as_array(baseline, "baseline samples")
        c = _as_array(candidate, "candidate samples")
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
        reps, method = log_ratio_replicates(
            b, c, resamples=resamples, rng=_shape_rng(seed, i), paired=paired
        )
        per_shape.append(_ci_from_log_replicates(est, reps, level, method))
        log_reps.append(reps)
        methods.add(method)
    joint = np.mean(np.vstack(log_reps), axis=0)
    combined_estimate = geomean(estimates)
    if methods == {"degenerate"}:
        combined = _degenerate(combined_estimate, level)
    else:
        method = (  # typed by log_ratio_replicates above
            "paired_bootstrap"
            if methods <= {"paired_bootstrap", "degenerate"}
            else "independent_bootstrap"
        )
        combined = _ci_from_log_replicates(combined_estimate, joint, level, method)
    return estimates, per_shape, combined


# ---------------------------------------------------------------- blocks (CPU wall clock)


def block_log_ratios(baseline: ArrayLike, candidate: ArrayLike, blocks: ArrayLike) -> dict[int, float]:
    """log(median(baseline) / median(candidate)) within each block, keyed by block, ascending."""
    b = _as_array(baseline, "baseline samples")
    c = _as_array(candidate, "candidate samples")
    labels = np.asarray(blocks, dtype=np.int64).ravel()
    if not b.size == c.size == labels.size:
        raise ValueError("block ratios need paired arms and one block label per pair")
    if np.any(b <= 0) or np.any(c <= 0):
        raise ValueError("times must be positive")
    return {int(k): float(np.log(np.median(b[labels == k])) - np.log(np.median(c[labels == k])))
            for k in np.unique(labels)}


@functools.lru_cache(maxsize=256)
def _t_quantile(level: float, dof: int) -> float:
    from scipy import stats as scipy_stats  # type: ignore[import-untyped]  # ~0.3 s: on first use

    return float(scipy_stats.t.ppf(0.5 + level / 2, dof))


def block_t_ci(log_ratios: ArrayLike, level: float = 0.95) -> RatioCI:
    """Speedup exp(mean) of per-block log ratios, with a Student t interval on k - 1 degrees of
    freedom: each block is one replicate, whatever its number of samples."""
    x = _as_array(log_ratios, "block log ratios")
    if x.size < 2:
        raise ValueError("a CI across blocks needs at least 2 blocks")
    mean = float(np.mean(x))
    half = _t_quantile(level, int(x.size) - 1) * float(np.std(x, ddof=1)) / float(np.sqrt(x.size))
    return RatioCI(estimate=float(np.exp(mean)), ci_low=float(np.exp(mean - half)),
                   ci_high=float(np.exp(mean + half)), level=level, resamples=0, method="block_t")


@dataclass(frozen=True)
class BlockCIs:
    per_shape: list[RatioCI]
    geomean: RatioCI
    shape_ratios: list[list[float]]  # per shape, the speedup in each of its blocks
    geomeans: list[float]  # per block with every shape timed, the geomean speedup


def block_cis(kept: Sequence[FilteredSamples], level: float) -> BlockCIs | None:
    """Per-shape and geomean CIs across blocks; None when a shape, or the blocks every shape was
    timed in, number fewer than 2 (then only the bootstrap over samples is left)."""
    if not kept or any(f.blocks is None for f in kept):
        return None
    per_block = [block_log_ratios(f.baseline, f.candidate, f.blocks) for f in kept]  # type: ignore[arg-type]
    complete = sorted(set.intersection(*(set(r) for r in per_block)))
    if len(complete) < 2 or any(len(r) < 2 for r in per_block):
        return None
    joint = [float(np.mean([r[k] for r in per_block])) for k in complete]
    return BlockCIs(
        per_shape=[block_t_ci(list(r.values()), level) for r in per_block],
        geomean=block_t_ci(joint, level),
        shape_ratios=[[float(np.exp(v)) for v in r.values()] for r in per_block],
        geomeans=[float(np.exp(v)) for v in joint],
    )


def relative_half_width(ci: RatioCI) -> float:
    """Half the CI's width on the log scale, as a fraction of the estimate."""
    return float(np.expm1((np.log(ci.ci_high) - np.log(ci.ci_low)) / 2))


def more_blocks_needed(blocks_done: int, shapes: Sequence[ShapeSamples], config: GateConfig) -> bool:
    """The stopping rule across blocks: always `wall_clock_blocks`, at most
    `wall_clock_max_blocks`, in between until the geomean CI is narrower than
    `wall_clock_ci_target` (its width only, not where it lies: see the module docstring)."""
    if blocks_done < config.wall_clock_blocks:
        return True
    if blocks_done >= config.wall_clock_max_blocks:
        return False
    geomean_ci = analyze_shapes(shapes, config).geomean
    return geomean_ci.method != "block_t" or relative_half_width(geomean_ci) > config.wall_clock_ci_target


# ---------------------------------------------------------------- physical floor


def physical_floor(
    bytes_moved: float | None,
    flops: float | None,
    peak_bandwidth: float | None,
    peak_flops: float | None,
) -> float | None:
    """Fastest time physics allows: max(bytes / peak bandwidth, flops / peak rate), in seconds.

    Only the terms with both a work count and a peak are used; None when no term is known
    (unknown is None, never invented).
    """
    terms: list[float] = []
    if bytes_moved is not None and peak_bandwidth:
        terms.append(float(bytes_moved) / float(peak_bandwidth))
    if flops is not None and peak_flops:
        terms.append(float(flops) / float(peak_flops))
    return max(terms) if terms else None


def roofline_fraction(time_s: float, floor_s: float | None) -> float | None:
    """floor / time: 1.0 is the roofline, above 1.0 is physically impossible."""
    if floor_s is None or time_s <= 0:
        return None
    return floor_s / time_s


# ---------------------------------------------------------------- whole benchmark


class BenchmarkStats(BaseModel):
    """What the statistics make of one benchmark's raw samples (the worker adds device facts)."""

    model_config = ConfigDict(extra="forbid")
    shapes: list[ShapeTiming]
    geomean: RatioCI
    throttled_samples_dropped: int
    outliers_dropped: int
    block_geomeans: list[float] | None = None


def analyze_shapes(
    shapes: Sequence[ShapeSamples],
    config: GateConfig | None = None,
    *,
    peak_bandwidth: float | None = None,
    peak_flops: float | None = None,
) -> BenchmarkStats:
    """Filter, summarize and bootstrap every shape, then the geomean, under the gate's settings.

    peak_flops should be the peak for the task's compute dtype; the floor is per shape. Shapes
    whose pairs carry block labels get CIs across blocks (see the module docstring).
    """
    config = config or GateConfig()
    if not shapes:
        raise ValueError("no shapes to analyze")
    kept: list[FilteredSamples] = []
    for shape in shapes:
        f = filter_pairs(shape.baseline_s, shape.candidate_s, shape.throttled, config.outlier_iqr_k,
                         shape.blocks)
        if f.baseline.size == 0 or f.candidate.size == 0:
            raise ValueError(
                f"shape {shape.name!r}: no samples left after dropping {f.throttled_dropped} "
                f"throttled and {f.outliers_dropped} outlier samples"
            )
        kept.append(f)
    blocked = block_cis(kept, config.ci_level)
    block_ratios: list[list[float] | None] = [None] * len(kept)
    if blocked is not None:
        per_shape, combined, block_ratios = blocked.per_shape, blocked.geomean, [*blocked.shape_ratios]
    else:
        _, per_shape, combined = _joint(
            [(f.baseline, f.candidate) for f in kept],
            level=config.ci_level,
            resamples=config.bootstrap_resamples,
            seed=config.bootstrap_seed,
            paired=None,
        )
    timings: list[ShapeTiming] = []
    for shape, f, ci, ratios in zip(shapes, kept, per_shape, block_ratios, strict=True):
        cand = summarize(f.candidate)
        floor = physical_floor(shape.bytes_moved, shape.flops, peak_bandwidth, peak_flops)
        timings.append(
            ShapeTiming(
                name=shape.name,
                baseline=summarize(f.baseline),
                candidate=cand,
                ratio=ci,
                floor_s=floor,
                roofline_fraction=roofline_fraction(cand.median, floor),
                throttled_dropped=f.throttled_dropped,
                outliers_dropped=f.outliers_dropped,
                stop_reason=shape.stop_reason,
                sampling_s=shape.sampling_s,
                block_ratios=ratios,
            )
        )
    return BenchmarkStats(
        shapes=timings,
        geomean=combined,
        throttled_samples_dropped=sum(f.throttled_dropped for f in kept),
        outliers_dropped=sum(f.outliers_dropped for f in kept),
        block_geomeans=blocked.geomeans if blocked is not None else None,
    )
