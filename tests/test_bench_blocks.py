"""CPU wall-clock verdicts: the unit of replication is a block (a fresh timer and pair of arm
processes), and the CI is taken across blocks, so a bias a process keeps for life widens it.

The statistics are checked on synthetic blocks whose bias is known; the benchmark tool is checked
through the real MCP protocol, with real sandboxed processes, on CPU."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mcp import Client
from pydantic import ValidationError

from loom_mcp.bench.arm_procs import pin_to_cpu
from loom_mcp.bench.blocks import block_shapes, merge_block, unique_findings
from loom_mcp.bench.stats import (
    analyze_shapes,
    block_log_ratios,
    block_t_ci,
    filter_pairs,
    more_blocks_needed,
    relative_half_width,
)
from loom_mcp.config import load_config
from loom_mcp.judge_models import Finding, GateConfig, ShapeSamples
from loom_mcp.server import build_server

REDTEAM = Path(__file__).parent / "redteam"
BASE_S = 1e-3


def blocked_arms(rng: np.random.Generator, speedup: float, blocks: int, pairs: int,
                 bias: float, cv: float = 0.003,
                 process_bias: list[float] | None = None) -> ShapeSamples:
    """A/B samples in blocks: within a block the candidate keeps one lognormal bias (its
    process's: `process_bias[k]` where given, shared by every shape timed by that process,
    else drawn here), and samples scatter by `cv` around it."""
    base, cand, labels = [], [], []
    for k in range(blocks):
        process = math.exp(process_bias[k] if process_bias else rng.normal(0.0, bias))
        base += list(BASE_S * speedup * np.exp(rng.normal(0.0, cv, pairs)))
        cand += list(BASE_S * process * np.exp(rng.normal(0.0, cv, pairs)))
        labels += [k] * pairs
    return ShapeSamples(name="s", baseline_s=base, candidate_s=cand, blocks=labels)


def test_block_ratio_is_the_ratio_of_medians_within_each_block():
    ratios = block_log_ratios([2.0, 2.0, 9.0, 3.0, 3.0, 3.0], [1.0, 1.0, 1.0, 1.0, 2.0, 4.0],
                              [0, 0, 0, 1, 1, 1])
    assert ratios == pytest.approx({0: math.log(2.0), 1: math.log(1.5)})
    with pytest.raises(ValueError):
        block_log_ratios([1.0, 1.0], [1.0, 1.0], [0])


def test_block_t_interval_matches_the_textbook_formula():
    logs = [0.01, -0.02, 0.03, 0.0]
    ci = block_t_ci(logs, 0.95)
    half = 3.182446 * np.std(logs, ddof=1) / 2  # t(0.975, 3 df) * s / sqrt(4)
    assert ci.method == "block_t" and ci.resamples == 0
    assert ci.estimate == pytest.approx(math.exp(np.mean(logs)))
    assert (ci.ci_low, ci.ci_high) == pytest.approx((math.exp(np.mean(logs) - half),
                                                     math.exp(np.mean(logs) + half)), rel=1e-5)
    with pytest.raises(ValueError):
        block_t_ci([0.01], 0.95)


def test_a_process_bias_widens_the_interval_the_sample_bootstrap_ignores():
    """Identical arms, each block's candidate process 3 % off at random: the CI over samples
    (no block labels) misses 1.0 most of the time, the CI across blocks covers it."""
    rng = np.random.default_rng(7)
    config = GateConfig(bootstrap_resamples=200)
    covered_blocks = covered_samples = 0
    trials = 120
    for _ in range(trials):
        shape = blocked_arms(rng, 1.0, blocks=5, pairs=20, bias=0.03)
        blocked = analyze_shapes([shape], config).geomean
        pooled = analyze_shapes([shape.model_copy(update={"blocks": None})], config).geomean
        assert blocked.method == "block_t" and pooled.method == "paired_bootstrap"
        covered_blocks += blocked.ci_low <= 1.0 <= blocked.ci_high
        covered_samples += pooled.ci_low <= 1.0 <= pooled.ci_high
    assert covered_blocks / trials >= 0.9
    assert covered_samples / trials <= 0.5


def test_an_identical_candidate_clears_the_gain_threshold_at_most_once_in_twenty():
    """The gate accepts when the geomean CI's low end exceeds 1 + min_gain. Two shapes timed by
    the same processes (so sharing their bias, 2-10 %), the blocks' stopping rule included.
    The same samples without block labels clear it far more often."""
    rng = np.random.default_rng(11)
    config = GateConfig(bootstrap_resamples=200)
    accepted = accepted_unblocked = trials = 0
    for bias in (0.02, 0.05, 0.1):
        for _ in range(50):
            process = list(rng.normal(0.0, bias, config.wall_clock_max_blocks))
            shapes = [blocked_arms(rng, 1.0, blocks=config.wall_clock_max_blocks, pairs=10,
                                   bias=bias, process_bias=process) for _ in range(2)]
            done = config.wall_clock_blocks
            while more_blocks_needed(done, [cut(s, done) for s in shapes], config):
                done += 1
            geomean = analyze_shapes([cut(s, done) for s in shapes], config).geomean
            accepted += geomean.ci_low > 1 + config.min_gain
            unblocked = [cut(s, done).model_copy(update={"blocks": None}) for s in shapes]
            accepted_unblocked += analyze_shapes(unblocked, config).geomean.ci_low > 1 + config.min_gain
            trials += 1
    assert accepted / trials <= 1 / 20
    assert accepted_unblocked / trials > 2 * accepted / trials + 0.05


def cut(shape: ShapeSamples, blocks: int) -> ShapeSamples:
    """The first `blocks` blocks of a shape's samples."""
    assert shape.blocks is not None
    n = sum(1 for k in shape.blocks if k < blocks)
    return shape.model_copy(update={"baseline_s": shape.baseline_s[:n],
                                    "candidate_s": shape.candidate_s[:n],
                                    "blocks": shape.blocks[:n]})


def test_a_real_speedup_is_still_seen_across_blocks():
    rng = np.random.default_rng(3)
    stats = analyze_shapes([blocked_arms(rng, 1.3, blocks=5, pairs=20, bias=0.01)], GateConfig())
    assert stats.geomean.ci_low > 1.2 and stats.geomean.ci_high < 1.4
    ratios = stats.shapes[0].block_ratios
    assert ratios is not None and len(ratios) == 5 and stats.block_geomeans is not None
    assert stats.geomean.estimate == pytest.approx(math.exp(np.mean(np.log(ratios))))


def test_blocks_are_added_until_the_interval_is_narrow_enough():
    config = GateConfig(wall_clock_blocks=3, wall_clock_max_blocks=6, wall_clock_ci_target=0.02)
    rng = np.random.default_rng(5)
    tight = [blocked_arms(rng, 1.1, blocks=3, pairs=10, bias=0.001)]
    loose = [blocked_arms(rng, 1.1, blocks=3, pairs=10, bias=0.05)]
    assert more_blocks_needed(2, tight, config)  # never fewer than wall_clock_blocks
    assert relative_half_width(analyze_shapes(tight, config).geomean) < 0.02
    assert not more_blocks_needed(3, tight, config)
    assert relative_half_width(analyze_shapes(loose, config).geomean) > 0.02
    assert more_blocks_needed(3, loose, config)
    assert not more_blocks_needed(6, loose, config)  # wall_clock_max_blocks caps it
    with pytest.raises(ValidationError):
        GateConfig(wall_clock_blocks=5, wall_clock_max_blocks=4)
    with pytest.raises(ValidationError):
        GateConfig(wall_clock_blocks=1)


def test_one_block_left_falls_back_to_the_sample_bootstrap():
    rng = np.random.default_rng(1)
    shape = blocked_arms(rng, 1.0, blocks=1, pairs=20, bias=0.02)
    stats = analyze_shapes([shape], GateConfig(bootstrap_resamples=200))
    assert stats.geomean.method == "paired_bootstrap" and stats.block_geomeans is None
    with pytest.raises(ValidationError):
        ShapeSamples(name="s", baseline_s=[1.0, 1.0], candidate_s=[1.0, 1.0], blocks=[0])


def test_dropped_pairs_take_their_block_labels_with_them():
    kept = filter_pairs([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [False, True, False, False],
                        blocks=[0, 0, 1, 1])
    assert kept.blocks is not None and kept.blocks.tolist() == [0, 1, 1]
    assert kept.baseline.tolist() == [1.0, 3.0, 4.0]


def test_blocks_merge_into_labelled_pooled_samples():
    samples: dict = {}
    meta = [{"name": "s", "flops": None, "bytes_moved": None}]
    for block, (a, b, overhead, stop) in enumerate([
            ([1.0, 1.2], [2.0, 2.2], 1e-6, "precise"), ([1.4], [2.4], 9e-6, "time_cap"),
            ([1.0], [2.0], 2e-6, "precise")]):
        merge_block(samples, {"s": {"a": a, "b": b, "throttled": [False] * len(a),
                                    "overhead": overhead, "stop": stop, "seconds": 0.5}}, block)
    (shape,) = block_shapes(meta, samples)
    assert shape.baseline_s == [1.0, 1.2, 1.4, 1.0] and shape.candidate_s == [2.0, 2.2, 2.4, 2.0]
    assert shape.blocks == [0, 0, 1, 2]
    assert shape.stop_reason == "time_cap" and shape.sampling_s == pytest.approx(1.5)
    assert samples["s"]["overhead"] == 2e-6  # reported: the median of the blocks' own
    twice = [Finding(check="c", severity="warning", message="m")] * 2
    assert len(unique_findings(twice)) == 1


FORKS_AND_SLEEPS = """
import os, sys, time
if os.fork() == 0:
    time.sleep(30)
    os._exit(0)
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_only_the_arm_interpreter_is_pinned_not_what_it_forks():
    """A helper the candidate forks keeps its CPUs: pinned beside the baseline it would slow it
    down more than it could from another core."""
    everywhere = os.sched_getaffinity(0)
    arm = subprocess.Popen([sys.executable, "-c", FORKS_AND_SLEEPS, "loom_mcp.worker.bench"],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert arm.stdout is not None and arm.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 10
        while not (children := Path(f"/proc/{arm.pid}/task/{arm.pid}/children").read_text().split()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cpu = max(everywhere)
        assert pin_to_cpu([arm.pid], cpu) >= 1
        assert os.sched_getaffinity(arm.pid) == {cpu}
        assert os.sched_getaffinity(int(children[0])) == everywhere
    finally:
        for pid in Path(f"/proc/{arm.pid}/task/{arm.pid}/children").read_text().split():
            os.kill(int(pid), 9)
        arm.kill()
        arm.wait()


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_cpu_benchmark_reports_its_blocks(tmp_path):
    """Through the MCP tool: the blocks timed, each shape's ratio per block, and a CI that is
    the t-interval of those ratios."""
    shutil.copytree(REDTEAM, tmp_path / "redteam")
    home = tmp_path / "home"
    home.mkdir()
    (home / "loom.toml").write_text(
        "[gate]\nwall_clock_blocks = 2\nwall_clock_max_blocks = 2\n"
        "wall_clock_block_time_s = 0.2\nmin_time_s = 0.1\n")
    server = build_server(load_config(home, environ={"LOOM_ALLOWED_ROOTS": str(tmp_path)}))
    async with Client(server) as client:
        result = await client.call_tool("benchmark", {
            "task": str(tmp_path / "redteam" / "task_rmsnorm.py"),
            "candidate": str(tmp_path / "redteam" / "honest_torch.py"), "shapes": ["rows8_d64"]})
        assert result.is_error is False, result.content
        timed = result.structured_content
        record = await client.read_resource(f"loom://runs/{timed['benchmark_id']}")
    assert timed["timer"] == "wall_clock" and timed["blocks"] == 2
    assert "2 blocks" in timed["timer_note"]
    (shape,) = timed["shapes"]
    (kept,) = json.loads(record.contents[0].text)["evidence"]["shapes"]
    ratios = kept["block_ratios"]  # every digit: the tool's figures carry four significant ones
    assert len(ratios) == 2 and timed["block_geomeans"] == pytest.approx(ratios, rel=1e-3)
    assert shape["block_speedups"] == pytest.approx(ratios, rel=1e-3)
    assert shape["speedup"] == pytest.approx(math.exp(np.mean(np.log(ratios))), rel=1e-3)
    expected = block_t_ci(np.log(ratios), 0.95)
    assert (kept["ratio"]["ci_low"], kept["ratio"]["ci_high"]) == pytest.approx((expected.ci_low, expected.ci_high))
    assert (shape["ci_low"], shape["ci_high"]) == pytest.approx((expected.ci_low, expected.ci_high), rel=1e-3)
