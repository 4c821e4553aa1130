"""The Q4_K GEMV's launch policy (kernels/q4k_gemv/q4k_gemv_policy.py), from shapes alone: the
Triton kernel's tiles, the CUDA kernels' ring depth, prefetch, shared memory, K cut and grid, and
which kernel takes a batch. Plain Python: no torch, no GPU. Occupancy is modelled as on the H200
(228 KB of shared memory per SM, 1 KB reserved per CTA, 227 KB at most per CTA)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "kernels" / "q4k_gemv"
CUDA_SOURCE = (TASK_DIR / "q4k_gemv.cu").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def policy():
    pytest.importorskip("triton")  # next_power_of_2
    from kernels.q4k_gemv import q4k_gemv_policy

    return q4k_gemv_policy


def test_the_policy_needs_no_torch():
    code = "import sys, q4k_gemv_policy; assert 'torch' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=TASK_DIR, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_triton_tiles_follow_the_shape(policy):
    # one warp, x per weight row; 16 blocks a step where K is a multiple of 4096, else 8
    assert policy.pick_config(4096, 16, 1) == policy.GemvConfig(2, 16, 1, True)
    assert policy.pick_config(4096, 56, 1) == policy.GemvConfig(2, 8, 1, True)
    # below 4096 rows one row per program; a short K takes no wider step than it has blocks
    assert policy.pick_config(1024, 16, 8) == policy.GemvConfig(1, 16, 1, True)
    assert policy.pick_config(100, 3, 3) == policy.GemvConfig(1, 4, 1, True)
    assert policy.pick_config(9, 5, 1).block_kb == 8 and policy.pick_config(9, 1, 1).block_kb == 1
    assert all(policy.pick_config(n, b, 1).method == "fma" for n in (9, 4096) for b in (1, 16, 56))


def test_shared_memory_plan_fits_two_ctas_for_llama_shapes(policy):
    # H200 / H100: 227 KB per CTA at most, 228 KB per SM; two CTAs keep the ring full while
    # the other computes.
    for n_blocks in (16, 56):
        for after_small in (False, True):
            stages = policy.cuda_stages(n_blocks, after_small)
            assert 2 * (policy.cuda_shared_bytes(n_blocks, stages) + 1024) <= 228 * 1024
    # the long rows hold more x; even the deepest ring the probes try there (4) fits two CTAs
    assert policy.cuda_shared_bytes(56, 3) > policy.cuda_shared_bytes(16, 3)
    assert 2 * (policy.cuda_shared_bytes(56, 4) + 1024) <= 228 * 1024


def test_ring_depth_follows_the_shape_and_the_caller_unless_overridden(policy, monkeypatch):
    monkeypatch.delenv("LOOM_Q4K_STAGES", raising=False)
    # back to back with another heavy kernel (the task's timing): three slots everywhere
    assert [policy.ring_slots(n) for n in (5, 16, 32, 56, 64)] == [3] * 5
    # after a small kernel (the model's down projection after SwiGLU): four from K = 8192
    assert policy.ring_slots(56, True) == policy.cuda_stages(56, True) == 4
    assert policy.ring_slots(16, True) == policy.cuda_stages(16, True) == 3
    # a fourth slot only while two CTAs still fit an SM: K = 16384 yes, K = 18944 no
    assert policy.cuda_stages(64, True) == 4 and policy.cuda_stages(74, True) == 3
    for n_blocks in (16, 32, 56, 64, 72, 74):
        stages = policy.cuda_stages(n_blocks, True)
        assert 2 * (policy.cuda_shared_bytes(n_blocks, stages) + 1024) <= 228 * 1024, n_blocks
    # the variable overrides the caller's context too (A/B timing inside a whole program)
    monkeypatch.setenv("LOOM_Q4K_STAGES", "4")
    assert policy.ring_slots(56) == policy.ring_slots(16) == policy.ring_slots(16, True) == 4
    monkeypatch.setenv("LOOM_Q4K_STAGES", "16:5, 56:4")
    assert (policy.ring_slots(16), policy.ring_slots(56)) == (5, 4)
    assert policy.ring_slots(5) == policy.cuda_stages(5)  # a shape not named keeps its own
    assert policy.ring_slots(64, True) == policy.cuda_stages(64, True) == 4
    for bad in ("0", "9", "four", "-1", "16:9", "x:4", "16:4,56", "16:", "4,16:9"):
        monkeypatch.setenv("LOOM_Q4K_STAGES", bad)
        with pytest.raises(ValueError, match="LOOM_Q4K_STAGES"):
            policy.ring_slots(56)


def test_what_streams_before_the_kernel_ahead_ends(policy):
    # after a small kernel, the whole ring, whatever the work
    assert policy.items_before_wait(7, 4, follows_small_kernel=True) == 4
    assert policy.items_before_wait(8, 3, follows_small_kernel=True) == 3
    # back to back: the whole ring where the CTA's work fits it (4096², 1024x4096: two items)
    assert policy.items_before_wait(2, 3) == 3
    assert policy.items_before_wait(3, 3) == 3
    # one chunk where it outlasts the ring (the 33 MB shapes: seven and eight items)
    assert policy.items_before_wait(7, 3) == policy.items_before_wait(8, 3) == 1
    # the launch counts a CTA's items with the CUDA source's chunk width
    defined = re.search(r"#define CHUNK_BLOCKS (\d+)", CUDA_SOURCE)
    assert defined and int(defined.group(1)) == policy.CUDA_CHUNK_BLOCKS


def test_batches_go_to_the_cuda_kernel_only_where_it_was_faster(policy):
    path = policy.cuda_path
    # batch 1 everywhere on the batch-1 kernel
    assert path(1024, 1, 0) == "rows" and path(9, 1, 0) == "rows"
    # the batched kernel wherever two CTAs fit an SM (K = 4096 up to batch 5), from 1024 rows
    assert all(path(n, b, 2) == "batched" for n in (1024, 4096, 14336) for b in range(2, 9))
    # one CTA per SM: it lost at batch 2 (4096 x 14336) and won from batch 3
    assert path(4096, 2, 1) == "rows" and path(4096, 3, 1) == "batched" and path(4096, 4, 1) == "batched"
    assert path(1024, 8, 1) == "batched"
    # where it would not fit (no longer at Llama shapes: K is cut into parts, see below):
    # per-row launches from 4096 rows, else Triton
    assert path(4096, 8, 0) == "rows" and path(14336, 6, 0) == "rows"
    assert path(1024, 2, 0) is None and path(1024, 2, 1) is None
    # too few rows for either measured CUDA path, or more rows of x than a program takes
    assert path(512, 4, 2) is None
    assert path(4096, 9, 2) is None and path(14336, 16, 0) is None
    assert policy.cuda_takes_batch(1024, 8) and not policy.cuda_takes_batch(512, 2)
    assert not policy.cuda_takes_batch(4096, 9)


def test_persistent_grid_gives_every_cta_the_same_tiles(policy):
    # 132 SMs x 2 CTAs: 896 tiles (14336 rows) go to 224 CTAs, four each; 256 tiles to 256
    assert policy.balanced_grid(14336, 264) == 224
    assert policy.balanced_grid(4096, 264) == 256
    assert policy.balanced_grid(100, 264) == 7  # a tile each
    for rows in (1024, 4096, 4112, 14336, 28672):
        tiles, grid = -(-rows // 16), policy.balanced_grid(rows, 264)
        assert grid <= 264 and -(-tiles // grid) == -(-tiles // 264)


def test_batched_shared_memory_matches_what_was_measured(policy):
    # the rule above was measured with these fits on an H200 (228 KB per SM, 1 KB reserved per
    # CTA, 227 KB at most per CTA): K = 4096 holds two CTAs to batch 5, one to batch 8;
    # K = 14336 one CTA to batch 5, none beyond
    def per_sm(n_blocks, batch):
        shared = policy.cuda_batched_shared_bytes(n_blocks, batch, 3)
        return 0 if shared > 227 * 1024 else min(2, 228 * 1024 // (shared + 1024))

    assert [per_sm(16, b) for b in range(2, 9)] == [2, 2, 2, 2, 1, 1, 1]
    assert [per_sm(56, b) for b in range(2, 9)] == [1, 1, 1, 1, 0, 0, 0]


def test_batched_kernel_cuts_k_where_x_crowds_out_a_second_cta(policy, monkeypatch):
    """Where x of every row leaves room for one CTA per SM or none, the batched kernel cuts K
    into runs of whole chunks, each CTA holding x of its run only: the fewest equal runs that
    let two CTAs onto an SM. Occupancy modelled as on the H200 (228 KB per SM, 1 KB reserved
    per CTA, 227 KB at most per CTA)."""
    monkeypatch.delenv("LOOM_Q4K_K_PARTS", raising=False)

    def plan(n_blocks, batch, n_rows=4096):
        def per_sm(parts):
            shared = policy.cuda_batched_shared_bytes(n_blocks, batch, 3, parts)
            return 0 if shared > 227 * 1024 else min(2, 228 * 1024 // (shared + 1024))

        parts = policy.batched_k_parts(n_blocks, batch, per_sm, n_rows, 132)
        return parts, per_sm(parts)

    # K = 4096 (two chunks), 4096 rows: whole at batches 2 and 3, two parts of one chunk from
    # batch 4 (from batch 6 two CTAs per SM need them)
    assert [plan(16, b) for b in range(2, 9)] == [(1, 2)] * 2 + [(2, 2)] * 5
    # 1024 rows are 64 tiles: whole K would keep 64 of the 264 resident CTAs busy
    assert plan(16, 2, 1024) == (2, 2) and plan(16, 3, 14336) == (1, 2)
    # K = 14336 (seven chunks): seven parts of one chunk at every batch (2 or 3 parts would be
    # uneven, and 4 chunks of x for 8 rows still leave one CTA per SM)
    assert [plan(56, b) for b in range(2, 9)] == [(7, 2)] * 7
    assert plan(56, 2, 100) == (7, 2)  # no more parts than there are chunks
    # without a row count, no filling: the fewest parts that fit two CTAs (and two from batch 4)
    assert policy.batched_k_parts(16, 2, lambda parts: 2) == 1
    assert policy.batched_k_parts(16, 4, lambda parts: 2) == 2
    # a run is whole chunks; the last part may be short (K = 11008: 43 blocks, 6 chunks)
    assert policy.part_blocks(43, 1) == 43 and policy.part_blocks(43, 2) == 24
    assert policy.part_blocks(43, 6) == 8 and policy.part_blocks(56, 7) == 8
    assert policy.cuda_batched_shared_bytes(56, 8, 3, 7) == policy.cuda_batched_shared_bytes(8, 8, 3)
    # no part is ever empty: 6 chunks asked into 4 parts are 3 parts of 2, 7 into 5 are 4
    assert [policy.whole_parts(43, k) for k in range(1, 9)] == [1, 2, 3, 3, 3, 6, 6, 6]
    assert policy.whole_parts(56, 5) == 4 and policy.whole_parts(56, 7) == 7
    # the timing override, bounded by the chunks there are
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "3")
    assert policy.batched_k_parts(56, 8, lambda parts: 2) == 3
    assert policy.batched_k_parts(16, 8, lambda parts: 2) == 2
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "4")
    assert policy.batched_k_parts(43, 8, lambda parts: 2) == 3
    monkeypatch.setenv("LOOM_Q4K_K_PARTS", "two")
    with pytest.raises(ValueError, match="LOOM_Q4K_K_PARTS"):
        policy.batched_k_parts(56, 8, lambda parts: 2)
