"""Statistics of the benchmark: from every shape's raw samples to its timings and the geomean.

Pure numpy/scipy, no device code, so it runs in the trusted server and is tested on CPU. The
parts: summary.py (summaries, stopping rule), filtering.py, bootstrap.py, block_ci.py; their
names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from loom_mcp.bench.block_ci import block_cis, block_log_ratios, block_t_ci, relative_half_width
from loom_mcp.bench.bootstrap import geomean, geomean_ci, joint_cis, ratio_ci
from loom_mcp.bench.filtering import FilteredSamples, filter_pairs, filter_samples, iqr_keep_mask
from loom_mcp.bench.summary import (
    paired_stop_reason,
    relative_median_stderr,
    stop_reason,
    summarize,
)
from loom_mcp.judge_models import GateConfig, RatioCI, ShapeSamples, ShapeTiming

# What the rest of the tree imports from here, wherever it is defined.
__all__ = [
    "BenchmarkStats",
    "analyze_shapes",
    "block_log_ratios",
    "block_t_ci",
    "filter_pairs",
    "filter_samples",
    "geomean",
    "geomean_ci",
    "iqr_keep_mask",
    "more_blocks_needed",
    "paired_stop_reason",
    "physical_floor",
    "ratio_ci",
    "relative_half_width",
    "relative_median_stderr",
    "roofline_fraction",
    "stop_reason",
    "summarize",
]


def more_blocks_needed(blocks_done: int, shapes: Sequence[ShapeSamples], config: GateConfig) -> bool:
    """The stopping rule across blocks: always `wall_clock_blocks`, at most
    `wall_clock_max_blocks`, in between until the geomean CI is narrower than
    `wall_clock_ci_target` (its width only, not where it lies: see bench/block_ci.py)."""
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
    whose pairs carry block labels get CIs across blocks (bench/block_ci.py), the others a joint
    bootstrap (bench/bootstrap.py).
    """
    config = config or GateConfig()
    if not shapes:
        raise ValueError("no shapes to analyze")
    kept: list[FilteredSamples] = []
    for shape in shapes:
        f = filter_pairs(shape.baseline_s, shape.candidate_s, shape.throttled, config.outlier_iqr_k, shape.blocks)
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
        _, per_shape, combined = joint_cis(
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
                output_deviation=shape.output_deviation,
                output_samples=shape.output_samples,
                fresh_inputs=shape.fresh_inputs,
            )
        )
    return BenchmarkStats(
        shapes=timings,
        geomean=combined,
        throttled_samples_dropped=sum(f.throttled_dropped for f in kept),
        outliers_dropped=sum(f.outliers_dropped for f in kept),
        block_geomeans=blocked.geomeans if blocked is not None else None,
    )
