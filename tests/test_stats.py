"""Benchmark statistics: summaries, stopping rule, filtering, and the bootstrap's real behaviour."""

from __future__ import annotations

import numpy as np
import pytest

from loom_mcp.bench.stats import (
    analyze_shapes,
    filter_pairs,
    filter_samples,
    geomean,
    geomean_ci,
    iqr_keep_mask,
    paired_stop_reason,
    physical_floor,
    ratio_ci,
    relative_median_stderr,
    roofline_fraction,
    stop_reason,
    summarize,
)
from loom_mcp.judge_models import GateConfig, ShapeSamples

BASE_S = 1e-3  # a 1 ms kernel


def arms(
    rng: np.random.Generator,
    speedup: float,
    n: int = 50,
    cv: float = 0.01,
    common: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Lognormal A/B samples; `common` is noise shared by both samples of a pair (device state)."""
    shared = np.exp(rng.normal(0.0, common, n)) if common else np.ones(n)
    baseline = BASE_S * speedup * shared * np.exp(rng.normal(0.0, cv, n))
    candidate = BASE_S * shared * np.exp(rng.normal(0.0, cv, n))
    return baseline, candidate


# ---------------------------------------------------------------- summaries


def test_summarize_known_values():
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s.n == 5
    assert s.median == 3.0
    assert s.mean == pytest.approx(22.0)
    assert s.std == pytest.approx(np.std([1, 2, 3, 4, 100], ddof=1))
    assert s.stderr == pytest.approx(s.std / np.sqrt(5))
    assert s.iqr == pytest.approx(2.0)  # numpy linear percentiles: Q1=2, Q3=4
    assert s.mad == pytest.approx(1.0)
    assert (s.min, s.max) == (1.0, 100.0)


def test_summarize_edge_cases():
    one = summarize([0.5])
    assert one.n == 1 and one.median == 0.5 and one.std == 0.0 and one.stderr == 0.0
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError, match="NaN"):
        summarize([1.0, float("nan")])


def test_relative_median_stderr_matches_the_spread_of_medians():
    # Over many repeated experiments, the estimate should match the observed spread of the median.
    rng = np.random.default_rng(3)
    runs = 1.0 + rng.normal(0, 0.05, (2000, 400))
    observed = np.std(np.median(runs, axis=1))
    estimated = np.median([relative_median_stderr(r) for r in runs[:200]])
    assert estimated == pytest.approx(observed, rel=0.15)
    assert relative_median_stderr([1.0]) == float("inf")
    # Quantised timers: a zero MAD falls back to the IQR, and all-equal samples are exact.
    assert relative_median_stderr([1.0] * 8 + [2.0] * 4) > 0
    assert relative_median_stderr([2.0] * 5) == 0.0


def test_rare_slow_outliers_do_not_hold_the_stopping_rule():
    # 2 % of launches preempted at 20x: the mean's stderr stays ~10x the target, the median is
    # precise. The rule must stop on precision, not run to the time cap.
    rng = np.random.default_rng(4)
    x = 1.0 + rng.normal(0, 0.02, 1000)
    x[rng.random(1000) < 0.02] = 20.0
    assert np.std(x, ddof=1) / np.sqrt(x.size) / np.mean(x) > 0.01  # the mean's: 2x the target
    assert stop_reason(x, 0.005, 10, 0.5, 10.0, elapsed=1.0) == "precise"


# ---------------------------------------------------------------- stopping rule


def test_time_cap_wins_even_with_few_noisy_samples():
    assert stop_reason([1.0, 5.0], 0.005, 10, 0.5, 10.0, elapsed=10.0) == "time_cap"


def test_no_stop_before_min_samples_or_min_time():
    precise = [1.0] * 9 + [1.0001]
    assert stop_reason(precise[:9], 0.005, 10, 0.5, 10.0, elapsed=1.0) is None
    assert stop_reason(precise, 0.005, 10, 0.5, 10.0, elapsed=0.1) is None
    assert stop_reason(precise, 0.005, 10, 0.5, 10.0, elapsed=1.0) == "precise"


def test_noisy_samples_keep_going_until_precise():
    rng = np.random.default_rng(0)
    noisy = 1.0 + rng.normal(0, 0.1, 20)  # rel. stderr ~2 %
    assert stop_reason(noisy, 0.005, 10, 0.5, 10.0, elapsed=2.0) is None
    more = 1.0 + rng.normal(0, 0.1, 2000)  # rel. stderr ~0.2 %
    assert stop_reason(more, 0.005, 10, 0.5, 10.0, elapsed=2.0) == "precise"


def test_paired_stop_needs_both_arms():
    cfg = GateConfig(min_samples=10, min_time_s=0.0)
    steady = [1.0] * 20
    rng = np.random.default_rng(1)
    noisy = list(1.0 + rng.normal(0, 0.2, 20))
    assert paired_stop_reason(steady, steady, cfg, elapsed=1.0) == "precise"
    assert paired_stop_reason(steady, noisy, cfg, elapsed=1.0) is None
    assert paired_stop_reason(steady, noisy, cfg, elapsed=cfg.max_time_s) == "time_cap"


# ---------------------------------------------------------------- filtering


def test_iqr_mask_and_filter_samples():
    x = [1.0, 1.01, 0.99, 1.02, 0.98, 5.0]
    assert list(iqr_keep_mask(x)) == [True] * 5 + [False]
    kept, throttled, outliers = filter_samples(x, [False, True, False, False, False, False], 1.5)
    assert throttled == 1 and outliers == 1
    assert sorted(kept) == [0.98, 0.99, 1.0, 1.02]
    kept, throttled, outliers = filter_samples(x)
    assert len(kept) == 6 and throttled == outliers == 0


def test_filter_pairs_drops_whole_pairs_and_counts_samples():
    b = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    c = [2.0, 2.0, 9.0, 2.0, 2.0, 2.0]
    f = filter_pairs(b, c, throttled=[True, False, False, False, False, False], iqr_k=1.5)
    assert f.paired and f.baseline.size == f.candidate.size == 4
    assert f.throttled_dropped == 2 and f.outliers_dropped == 2
    assert 9.0 not in f.candidate


def test_filter_pairs_unequal_arms():
    f = filter_pairs([1.0, 1.0, 1.0], [2.0, 2.0])
    assert not f.paired
    with pytest.raises(ValueError):
        filter_pairs([1.0, 1.0, 1.0], [2.0, 2.0], throttled=[False, False, False])


# ---------------------------------------------------------------- ratio CI basics


def test_ratio_estimate_is_ratio_of_medians_and_inside_its_ci():
    rng = np.random.default_rng(2)
    b, c = arms(rng, 1.3)
    r = ratio_ci(b, c, resamples=1000)
    assert r.estimate == pytest.approx(np.median(b) / np.median(c))
    assert r.ci_low <= r.estimate <= r.ci_high
    assert r.method == "paired_bootstrap" and r.level == 0.95 and r.resamples == 1000


def test_ratio_ci_is_reproducible_from_its_seed():
    rng = np.random.default_rng(3)
    b, c = arms(rng, 1.1)
    assert ratio_ci(b, c, seed=7, resamples=500) == ratio_ci(b, c, seed=7, resamples=500)
    assert ratio_ci(b, c, seed=7, resamples=500) != ratio_ci(b, c, seed=8, resamples=500)


def test_ratio_ci_degenerate_and_constant_inputs():
    d = ratio_ci([2.0], [1.0])
    assert d.method == "degenerate" and d.ci_low == d.ci_high == d.estimate == 2.0
    flat = ratio_ci([2.0] * 10, [1.0] * 10, resamples=300)
    assert flat.ci_low == pytest.approx(2.0) and flat.ci_high == pytest.approx(2.0)


def test_ratio_ci_pairing_rules():
    assert ratio_ci([1.0, 1.1, 1.2], [1.0, 1.1], resamples=300).method == "independent_bootstrap"
    with pytest.raises(ValueError, match="equal length"):
        ratio_ci([1.0, 1.1, 1.2], [1.0, 1.1], resamples=300, paired=True)
    with pytest.raises(ValueError, match="positive"):
        ratio_ci([1.0, -1.0], [1.0, 1.0], resamples=300)


def test_higher_level_gives_wider_interval():
    rng = np.random.default_rng(4)
    b, c = arms(rng, 1.0)
    narrow = ratio_ci(b, c, level=0.8, resamples=2000)
    wide = ratio_ci(b, c, level=0.99, resamples=2000)
    assert wide.ci_low < narrow.ci_low and wide.ci_high > narrow.ci_high


# ---------------------------------------------------------------- statistical properties


def test_a_vs_a_is_not_called_faster():
    """200 A-vs-A runs with lognormal noise: CI lower bound > 1.02 in at most 1 % of them, and
    the CI excludes 1 at about the nominal 5 % rate (never much more)."""
    rng = np.random.default_rng(10)
    lows, excl = 0, 0
    for _ in range(200):
        b, c = arms(rng, 1.0, n=50, cv=0.01)
        r = ratio_ci(b, c, resamples=1000, seed=int(rng.integers(1 << 31)))
        lows += r.ci_low > 1.02
        excl += not (r.ci_low <= 1.0 <= r.ci_high)
    assert lows <= 2
    assert excl / 200 <= 0.10


def test_a_vs_a_with_heavy_noise_still_not_called_faster():
    rng = np.random.default_rng(11)
    lows = 0
    for _ in range(200):
        b, c = arms(rng, 1.0, n=30, cv=0.05)
        lows += ratio_ci(b, c, resamples=1000).ci_low > 1.02
    assert lows <= 2


def test_true_5_percent_speedup_is_detected():
    """CV 1 %, 50 samples per arm: the gate's criterion (CI lower bound > 1.02) holds in >= 95 %."""
    rng = np.random.default_rng(12)
    hits = 0
    for _ in range(200):
        b, c = arms(rng, 1.05, n=50, cv=0.01)
        hits += ratio_ci(b, c, resamples=1000).ci_low > 1.02
    assert hits / 200 >= 0.95


def test_ci_coverage_is_near_nominal():
    rng = np.random.default_rng(13)
    true = 1.05  # lognormal medians are exp(mu), so the true ratio of medians is exact
    covered = 0
    runs = 400
    for _ in range(runs):
        b, c = arms(rng, true, n=50, cv=0.02)
        r = ratio_ci(b, c, resamples=1000, seed=int(rng.integers(1 << 31)))
        covered += r.ci_low <= true <= r.ci_high
    assert 0.90 <= covered / runs <= 0.99


def test_pairing_uses_common_mode_noise():
    """Noise shared by a pair (clock drift) cancels under paired resampling: narrower CIs that
    still cover; independent resampling stays valid but wider."""
    rng = np.random.default_rng(14)
    true = 1.05
    widths_p, widths_i, cover_p = [], [], 0
    for _ in range(150):
        b, c = arms(rng, true, n=50, cv=0.005, common=0.05)
        p = ratio_ci(b, c, resamples=800, paired=True)
        i = ratio_ci(b, c, resamples=800, paired=False)
        widths_p.append(np.log(p.ci_high / p.ci_low))
        widths_i.append(np.log(i.ci_high / i.ci_low))
        cover_p += p.ci_low <= true <= p.ci_high
    assert np.mean(widths_p) < 0.8 * np.mean(widths_i)
    assert cover_p / 150 >= 0.9


# ---------------------------------------------------------------- geomean


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        geomean([])


def test_geomean_ci_point_and_reproducibility():
    rng = np.random.default_rng(20)
    shapes = [arms(rng, s) for s in (1.02, 1.05, 1.10)]
    g = geomean_ci(shapes, resamples=1000)
    per = [np.median(b) / np.median(c) for b, c in shapes]
    assert g.estimate == pytest.approx(geomean(per))
    assert g.ci_low <= g.estimate <= g.ci_high
    assert g == geomean_ci(shapes, resamples=1000)


def test_geomean_ci_coverage_and_a_vs_a():
    rng = np.random.default_rng(21)
    speedups = (1.02, 1.05, 1.10, 0.97)
    true = geomean(speedups)
    covered, false_accepts = 0, 0
    for _ in range(150):
        shapes = [arms(rng, s, n=40, cv=0.02) for s in speedups]
        g = geomean_ci(shapes, resamples=600, seed=int(rng.integers(1 << 31)))
        covered += g.ci_low <= true <= g.ci_high
        same = [arms(rng, 1.0, n=40, cv=0.02) for _ in speedups]
        false_accepts += geomean_ci(same, resamples=600).ci_low > 1.02
    assert covered / 150 >= 0.88
    assert false_accepts <= 1


def test_geomean_ci_is_tighter_than_single_shapes():
    rng = np.random.default_rng(22)
    shapes = [arms(rng, 1.05, n=30, cv=0.03) for _ in range(6)]
    g = geomean_ci(shapes, resamples=1000)
    singles = [ratio_ci(b, c, resamples=1000) for b, c in shapes]
    assert g.ci_high / g.ci_low < np.mean([s.ci_high / s.ci_low for s in singles])


# ---------------------------------------------------------------- floor


def test_physical_floor():
    # 1 GB at 4.8 TB/s vs 1 TFLOP at 989 TFLOP/s: memory bound
    assert physical_floor(1e9, 1e12, 4.8e12, 989e12) == pytest.approx(
        max(1e9 / 4.8e12, 1e12 / 989e12)
    )
    assert physical_floor(1e9, None, 4.8e12, None) == pytest.approx(1e9 / 4.8e12)
    assert physical_floor(None, 2e12, None, 1e15) == pytest.approx(2e-3)
    assert physical_floor(1e9, 1e12, None, None) is None
    assert physical_floor(None, None, 4.8e12, 1e15) is None
    assert roofline_fraction(2e-3, 1e-3) == pytest.approx(0.5)
    assert roofline_fraction(1e-3, None) is None


# ---------------------------------------------------------------- whole benchmark


def _shape(name: str, speedup: float, rng: np.random.Generator, **kw) -> ShapeSamples:
    b, c = arms(rng, speedup, n=40)
    return ShapeSamples(name=name, baseline_s=list(b), candidate_s=list(c), **kw)


def test_analyze_shapes_end_to_end():
    rng = np.random.default_rng(30)
    cfg = GateConfig(bootstrap_resamples=500)
    throttled = [i < 3 for i in range(40)]
    shapes = [
        _shape("decode", 1.2, rng, bytes_moved=1e6, flops=1e6),
        _shape("prefill", 1.1, rng, throttled=throttled),
    ]
    stats = analyze_shapes(shapes, cfg, peak_bandwidth=1e12, peak_flops=1e15)
    decode, prefill = stats.shapes
    assert decode.name == "decode" and decode.baseline.n == 40
    assert decode.floor_s == pytest.approx(1e-6)
    assert decode.roofline_fraction == pytest.approx(1e-6 / decode.candidate.median)
    assert prefill.floor_s is None and prefill.roofline_fraction is None
    assert prefill.candidate.n == 37 and prefill.throttled_dropped == 6
    assert stats.throttled_samples_dropped == 6
    assert stats.geomean.estimate == pytest.approx(
        geomean([decode.ratio.estimate, prefill.ratio.estimate])
    )
    assert decode.ratio.ci_low > 1.1 and prefill.ratio.ci_low > 1.0
    assert analyze_shapes(shapes, cfg, peak_bandwidth=1e12, peak_flops=1e15) == stats


def test_adding_a_shape_leaves_earlier_shape_cis_unchanged():
    rng = np.random.default_rng(31)
    cfg = GateConfig(bootstrap_resamples=400)
    a, b = _shape("a", 1.1, rng), _shape("b", 1.3, rng)
    one = analyze_shapes([a], cfg)
    two = analyze_shapes([a, b], cfg)
    assert one.shapes[0].ratio == two.shapes[0].ratio


def test_analyze_shapes_refuses_empty_input():
    with pytest.raises(ValueError):
        analyze_shapes([], GateConfig())
    dead = ShapeSamples(
        name="x", baseline_s=[1.0, 1.0], candidate_s=[1.0, 1.0], throttled=[True, True]
    )
    with pytest.raises(ValueError, match="no samples left"):
        analyze_shapes([dead], GateConfig())


def test_shape_samples_validates_throttle_length():
    with pytest.raises(ValueError):
        ShapeSamples(name="x", baseline_s=[1.0], candidate_s=[1.0], throttled=[True, False])
