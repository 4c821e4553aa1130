"""How the Q4_K GEMV is launched, from shapes alone: the Triton kernel's tiles, the CUDA kernels'
ring depth, prefetch, shared memory, K cut and grid, and which kernel takes a batch.

Plain Python without torch or a GPU (Triton only for next_power_of_2), so every choice can be
tested anywhere; the kernels that follow them are in q4k_gemv_triton.py and q4k_gemv_cuda.py.
The figures behind each rule: docs/kernels/q4k_gemv.md. LOOM_Q4K_STAGES and LOOM_Q4K_K_PARTS
override the ring depth and the K cut for timing.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import triton

QK_K = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # d (2) + dmin (2) + scales (12) + codes (128)
BLOCK_WORDS = BLOCK_BYTES // 4
MAX_BATCH_PER_PROGRAM = 8  # decode batches; larger batches take more programs along grid axis 1


class GemvConfig(NamedTuple):
    block_n: int  # output rows per program
    block_kb: int  # Q4_K blocks of each row per loop step
    num_warps: int
    x_per_row: bool = False  # load x per weight row (no layout shuffle) or once per tile
    method: str = "fma"  # "fma": CUDA-core dot products; "mma": TF32 tensor cores (q4k_gemv_triton.py)


def pick_config(n_rows: int, n_blocks: int, batch: int) -> GemvConfig:
    """Small tiles, one warp, x loaded per weight row: the fastest tiling at batch 1 on an H200
    (`kernels/tools/sweep_q4k.py`). K of 56 blocks (4096 x 14336) prefers 8 blocks per step, the
    others 16. Below 4096 rows, one row per program: two would leave the H200's 132 SMs with
    under 4 one-warp programs each (figures: docs/kernels/q4k_gemv.md)."""
    block_kb = 16 if n_blocks % 16 == 0 else 8
    block_kb = min(block_kb, triton.next_power_of_2(n_blocks))
    block_n = 2 if n_rows >= 4096 else 1
    return GemvConfig(block_n=block_n, block_kb=block_kb, num_warps=1, x_per_row=True)


CUDA_WARPS, CUDA_ROWS, CUDA_MIN_CTAS = 8, 16, 2
CUDA_CHUNK_BLOCKS = 8  # Q4_K blocks per row in a ring slot (CHUNK_BLOCKS: one per consumer warp)
HOPPER_SHARED_PER_SM = 228 * 1024


def cuda_stages(n_blocks: int, follows_small_kernel: bool = False) -> int:
    """Ring slots per CTA: three, and four from K = 8192 when the GEMV follows a small kernel.

    After a small kernel its CTAs fill their rings before that kernel ends, so a fourth slot
    holds more of a row when x arrives; back to back with another GEMV, three were faster. Four
    only while two CTAs still fit an SM (Hopper: 228 KB of shared memory, 1 KB of it reserved
    per CTA). Figures: docs/kernels/q4k_gemv.md."""
    if follows_small_kernel and n_blocks >= 32 and 2 * (cuda_shared_bytes(n_blocks, 4) + 1024) <= HOPPER_SHARED_PER_SM:
        return 4
    return 3


def ring_slots(n_blocks: int, follows_small_kernel: bool = False) -> int:
    """The ring slots a launch uses where the kernel object does not fix them: `cuda_stages`,
    or LOOM_Q4K_STAGES for timing other depths in a whole program, such as the model's decode:
    one depth for every shape ("4"), or depths by Q4_K blocks per row ("16:5,56:4"; shapes not
    named keep `cuda_stages`), each 1-8, whatever the caller says. A kernel object asks once
    per shape and caller context (`CudaGemvB1.stages_for`)."""
    override = os.environ.get("LOOM_Q4K_STAGES", "").strip()
    if not override:
        return cuda_stages(n_blocks, follows_small_kernel)
    by_blocks: dict[int, int] = {}  # key 0: every shape
    for item in override.split(","):
        blocks, _, depth = item.strip().rpartition(":")
        if not depth.isdigit() or not 1 <= int(depth) <= 8 or (blocks and not blocks.isdigit()):
            raise ValueError(
                "LOOM_Q4K_STAGES must be a depth from 1 to 8, or blocks:depth pairs such as "
                f"16:5,56:4, not {override!r}"
            )
        by_blocks[int(blocks or 0)] = int(depth)
    return by_blocks.get(n_blocks, by_blocks.get(0) or cuda_stages(n_blocks, follows_small_kernel))


def items_before_wait(items: int, stages: int, follows_small_kernel: bool = False) -> int:
    """Chunks a batch-1 CTA's producer streams, as a programmatic dependent, before the kernel
    ahead of it has ended; the rest of its `items` (tile, chunk) pairs stream after.

    After a small kernel, the whole ring: nothing else is streaming then. Back to back with
    another heavy kernel, a CTA whose work does not fit its ring starts with one chunk: what it
    streams early competes with the kernel ahead's last CTAs, whose end it waits for (figures:
    docs/kernels/q4k_gemv.md)."""
    if follows_small_kernel or items <= stages:
        return stages
    return 1


CUDA_BATCHED_STAGES = 3  # ring slots of the batched kernel


def _shared_bytes(n_blocks: int, stages: int, x_rows: int, sum_rows: int) -> int:
    """Dynamic shared memory of one CTA of either kernel: the ring of chunks (16 rows x 1152
    bytes, rows padded by 16); x as bytes (64 B) and its scale and sum (8 B) per sub-block and
    row of x; two sets of cross-warp partial sums for `sum_rows` rows of x; a line of zeros; the
    ring's full and empty barriers."""
    return (
        stages * CUDA_ROWS * (CUDA_CHUNK_BLOCKS * BLOCK_BYTES + 16)
        + n_blocks * 8 * x_rows * (64 + 8)
        + 2 * CUDA_WARPS * CUDA_ROWS * sum_rows * 4
        + 64
        + 2 * stages * 8
    )


def part_blocks(n_blocks: int, k_parts: int) -> int:
    """Q4_K blocks per row in the largest of `k_parts` runs of whole chunks that cut K."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    return min(-(-chunks // k_parts) * CUDA_CHUNK_BLOCKS, n_blocks)


def whole_parts(n_blocks: int, k_parts: int) -> int:
    """The parts K is really cut into when asked for `k_parts`: runs of the same whole number of
    chunks leave none empty (6 chunks in 4 parts are 3 parts of 2; an empty part would leave its
    sums unwritten)."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    per_part = -(-chunks // max(1, min(k_parts, chunks)))
    return -(-chunks // per_part)


def cuda_batched_shared_bytes(n_blocks: int, batch: int, stages: int, k_parts: int = 1) -> int:
    """The batched kernel's: x of its part of K for every row, partial sums laid out for 8 rows
    of x."""
    return _shared_bytes(part_blocks(n_blocks, k_parts), stages, batch, MAX_BATCH_PER_PROGRAM)


def batched_k_parts(n_blocks: int, batch: int, ctas_per_sm, n_rows: int = 0, sms: int = 0) -> int:
    """How many parts the batched kernel cuts K into.

    Always equal runs of whole chunks (a divisor of the chunks: none is empty or longer than
    the rest). First, room for two CTAs per SM: none (1) where x of every row leaves it; else
    the fewest parts that do (K = 14336, seven chunks: seven parts from batch 2; 1 where none
    does, as more parts only shrink a CTA). Then two equal parts from batch 4 where K is whole
    (less of x to make per CTA), and more equal parts while the tiles of `n_rows` would keep
    fewer than half of the `sms` x CTAs-per-SM resident CTAs busy (figures:
    docs/kernels/q4k_gemv.md).
    `ctas_per_sm(k_parts)`: CTAs per SM with that cut (0: none fits); 1 where nothing fits.
    LOOM_Q4K_K_PARTS sets it for timing (`whole_parts` of it)."""
    chunks = -(-n_blocks // CUDA_CHUNK_BLOCKS)
    forced = os.environ.get("LOOM_Q4K_K_PARTS", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"LOOM_Q4K_K_PARTS must be a whole number of parts, not {forced!r}")
        return whole_parts(n_blocks, int(forced))
    equal = [parts for parts in range(2, chunks + 1) if chunks % parts == 0 and ctas_per_sm(parts) >= 2]
    parts = 1 if ctas_per_sm(1) >= 2 or not equal else equal[0]
    if parts == 1 and batch >= 4 and 2 in equal:
        parts = 2
    tiles = -(-n_rows // CUDA_ROWS)
    for more in equal:
        if tiles and sms and more > parts and 2 * tiles * parts <= sms * ctas_per_sm(parts):
            parts = more
    return parts


def cuda_shared_bytes(n_blocks: int, stages: int) -> int:
    """The batch-1 kernel's."""
    return _shared_bytes(n_blocks, stages, 1, 1)


def balanced_grid(n_rows: int, resident: int) -> int:
    """CTAs of a persistent grid: at most `resident`, and no more than it takes to give each the
    same number of 16-row tiles (896 tiles on 264 resident CTAs would leave 104 of them a
    fourth tile to do alone at the end; 224 CTAs do four each)."""
    tiles = -(-n_rows // CUDA_ROWS)
    return -(-tiles // -(-tiles // resident))


# Batches the CUDA kernels take, from this many weight rows up: the batched kernel (measured
# from 1024 rows), and one batch-1 launch per row of x (measured from 4096 rows).
CUDA_BATCHED_FROM_N_ROWS = 1024
CUDA_ROWS_FROM_N_ROWS = 4096


def cuda_path(n_rows: int, batch: int, batched_ctas_per_sm: int) -> str | None:
    """Which CUDA kernel runs a batch: "batched" (one launch, the weight read once), "rows" (the
    batch-1 kernel once per row of x, the weight read per row), or None (the Triton kernel).
    `batched_ctas_per_sm`: how many CTAs of the batched kernel fit an SM at this K and batch
    (0: it does not fit).

    From 1024 weight rows, the batched kernel where two of its CTAs fit an SM (it cuts K so that
    they do, `batched_k_parts`), or one from batch 3; else per-row launches from 4096 rows, which
    beat the Triton kernel there but not at 1024 rows (figures: docs/kernels/q4k_gemv.md)."""
    if batch == 1:
        return "rows"
    if not 2 <= batch <= MAX_BATCH_PER_PROGRAM:
        return None
    if n_rows >= CUDA_BATCHED_FROM_N_ROWS and (batched_ctas_per_sm >= 2 or (batched_ctas_per_sm == 1 and batch >= 3)):
        return "batched"
    return "rows" if n_rows >= CUDA_ROWS_FROM_N_ROWS else None


def cuda_takes_batch(n_rows: int, batch: int) -> bool:
    """Whether a batch may run on a CUDA kernel at all, before the kernel is built to ask how
    the batched kernel fits: `cuda_path` with the best fit."""
    return cuda_path(n_rows, batch, batched_ctas_per_sm=2) is not None
