"""Row softmax in Triton: one program per row, fp32 maths, one rounding on the way out.

Two regimes, picked by the row width:

- Rows up to `MAX_ONE_PASS_COLS` (4096-wide attention rows, say) fit in one program's
  registers: read once, max, exp, sum, normalise, write once.
- Wider rows (a 128256-token vocabulary) are walked in `CHUNK`-wide blocks twice. The first walk
  keeps a running max and a running sum per lane (the online-softmax rescaling: when a lane's
  max grows, its sum is multiplied by exp(old_max - new_max)), so one read of the row gives both
  statistics; the second walk writes exp(x - max) / sum. The second read of a 256 KB bf16 row
  mostly hits L2.

-inf logits (masked tokens) are allowed: a lane that has seen only -inf keeps a zero sum
instead of producing exp(-inf - -inf) = NaN.

Where it runs: on a GPU tensor (CUDA or ROCm) the Triton kernel always runs. On a CPU tensor the
kernel runs only under the interpreter (`TRITON_INTERPRET=1`, set before this file is imported);
without it, `forward` uses `torch.softmax` in fp32, so the model still works anywhere.

- A few wide rows (batch-1 to batch-32 sampling over a vocabulary) would leave most SMs idle
  with one program per row; on the H200 that was slower than PyTorch (0.79-0.92x at 1-8 rows of
  128256). There each row is split into chunks over many programs: one kernel writes every
  chunk's max and sum of exp, a second combines a row's chunk statistics (a few dozen numbers)
  and writes its chunk.

Self-check: `TRITON_INTERPRET=1 python candidate.py` (kernel), or on a GPU `python candidate.py`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ONE_PASS_COLS = 8192  # 8192 fp32 in registers at 16 warps: 16 per thread, no spills
CHUNK = 4096  # block width of the two-pass walk over wider rows
SPLIT_BELOW_ROWS = 64  # fewer wide rows than this: split each row over many programs
TARGET_PROGRAMS = 264  # two per H200 SM; only sets the split chunk width


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 to `dtype` to nearest even, as PyTorch's casts do.

    GPUs round fp32 -> bf16 to nearest even, but Triton's CPU interpreter truncates; rounding
    by hand on the bit pattern gives the same bits on every device.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def softmax_row_kernel(
    x_ptr,
    out_ptr,
    x_row_stride,
    out_row_stride,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
    ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * x_row_stride
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    out_dtype = out_ptr.dtype.element_ty
    lanes = tl.arange(0, BLOCK_SIZE)

    if ONE_PASS:
        in_row = lanes < n_cols
        x = tl.load(x_row + lanes, mask=in_row, other=-float("inf")).to(tl.float32)
        shifted = tl.exp(x - tl.max(x, axis=0))
        tl.store(
            out_row + lanes, round_to(shifted / tl.sum(shifted, axis=0), out_dtype), mask=in_row
        )
    else:
        lane_max = tl.full([BLOCK_SIZE], -float("inf"), tl.float32)
        lane_sum = tl.zeros([BLOCK_SIZE], tl.float32)
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + lanes
            x = tl.load(x_row + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            new_max = tl.maximum(lane_max, x)
            # Both terms are 0 while a lane has only seen -inf (avoids -inf - -inf = NaN).
            rescale = tl.where(new_max == -float("inf"), 0.0, tl.exp(lane_max - new_max))
            fresh = tl.where(x == -float("inf"), 0.0, tl.exp(x - new_max))
            lane_sum = lane_sum * rescale + fresh
            lane_max = new_max
        row_max = tl.max(lane_max, axis=0)
        lane_weight = tl.where(lane_max == -float("inf"), 0.0, tl.exp(lane_max - row_max))
        row_sum = tl.sum(lane_sum * lane_weight, axis=0)
        for start in range(0, n_cols, BLOCK_SIZE):
            cols = start + lanes
            in_row = cols < n_cols
            x = tl.load(x_row + cols, mask=in_row, other=-float("inf")).to(tl.float32)
            probabilities = tl.exp(x - row_max) / row_sum
            tl.store(out_row + cols, round_to(probabilities, out_dtype), mask=in_row)


@triton.jit
def softmax_chunk_stats_kernel(
    x_ptr, max_ptr, sum_ptr, x_row_stride, n_cols, n_chunks, CHUNK_COLS: tl.constexpr
):
    """Per (row, chunk): the chunk's max and sum of exp(x - max); 0 for an all -inf chunk."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    cols = chunk * CHUNK_COLS + tl.arange(0, CHUNK_COLS)
    x = tl.load(
        x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=cols < n_cols, other=-float("inf")
    )
    x = x.to(tl.float32)
    chunk_max = tl.max(x, axis=0)
    chunk_sum = tl.sum(tl.where(x == -float("inf"), 0.0, tl.exp(x - chunk_max)), axis=0)
    tl.store(max_ptr + row * n_chunks + chunk, chunk_max)
    tl.store(sum_ptr + row * n_chunks + chunk, chunk_sum)


@triton.jit
def softmax_chunk_write_kernel(
    x_ptr,
    out_ptr,
    max_ptr,
    sum_ptr,
    x_row_stride,
    out_row_stride,
    n_cols,
    n_chunks,
    CHUNK_COLS: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,
):
    """Combine the row's chunk statistics, then write this chunk's probabilities."""
    row, chunk = tl.program_id(0), tl.program_id(1)
    chunk_ids = tl.arange(0, MAX_CHUNKS)
    have = chunk_ids < n_chunks
    maxes = tl.load(max_ptr + row * n_chunks + chunk_ids, mask=have, other=-float("inf"))
    sums = tl.load(sum_ptr + row * n_chunks + chunk_ids, mask=have, other=0.0)
    row_max = tl.max(maxes, axis=0)
    row_sum = tl.sum(tl.where(maxes == -float("inf"), 0.0, sums * tl.exp(maxes - row_max)), axis=0)
    cols = chunk * CHUNK_COLS + tl.arange(0, CHUNK_COLS)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * x_row_stride + cols, mask=in_row, other=-float("inf"))
    probabilities = tl.exp(x.to(tl.float32) - row_max) / row_sum
    out_row = out_ptr + row.to(tl.int64) * out_row_stride
    tl.store(out_row + cols, round_to(probabilities, out_ptr.dtype.element_ty), mask=in_row)


def _split_chunk(n_rows: int, n_cols: int) -> int:
    """Chunk width giving about TARGET_PROGRAMS programs, within [1024, 8192]."""
    wanted = triton.cdiv(n_rows * n_cols, TARGET_PROGRAMS)
    return min(max(triton.next_power_of_2(wanted), 1024), 8192)


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dimension of x, computed in fp32, returned in x's dtype."""
    if not _runs_triton(x):
        return torch.softmax(x.float(), dim=-1).to(x.dtype)

    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out.reshape(x.shape)
    one_pass = n_cols <= MAX_ONE_PASS_COLS
    if not one_pass and rows.shape[0] < SPLIT_BELOW_ROWS:
        chunk = _split_chunk(rows.shape[0], n_cols)
        n_chunks = triton.cdiv(n_cols, chunk)
        maxes = torch.empty((rows.shape[0], n_chunks), dtype=torch.float32, device=x.device)
        sums = torch.empty_like(maxes)
        grid = (rows.shape[0], n_chunks)
        warps = min(max(chunk // 512, 1), 16)
        softmax_chunk_stats_kernel[grid](
            rows, maxes, sums, rows.stride(0), n_cols, n_chunks, CHUNK_COLS=chunk, num_warps=warps
        )
        softmax_chunk_write_kernel[grid](
            rows,
            out,
            maxes,
            sums,
            rows.stride(0),
            out.stride(0),
            n_cols,
            n_chunks,
            CHUNK_COLS=chunk,
            MAX_CHUNKS=triton.next_power_of_2(n_chunks),
            num_warps=warps,
        )
        return out.reshape(x.shape)
    block_size = triton.next_power_of_2(n_cols) if one_pass else CHUNK
    softmax_row_kernel[(rows.shape[0],)](
        rows,
        out,
        rows.stride(0),
        out.stride(0),
        n_cols,
        BLOCK_SIZE=block_size,
        ONE_PASS=one_pass,
        num_warps=min(max(block_size // 512, 1), 16),
    )
    return out.reshape(x.shape)


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return softmax(x)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    for rows, cols, dtype in [
        (1, 512, torch.bfloat16),
        (3, 1000, torch.float16),
        (2, 9000, torch.float32),  # wider than MAX_ONE_PASS_COLS, few rows: split rows
        (65, 9000, torch.bfloat16),  # many wide rows: the two-pass walk, one program per row
    ]:
        x = (4 * torch.randn(rows, cols, device=device)).to(dtype)
        x[0, :7] = -float("inf")  # masked logits
        xd = x.double()
        expected = torch.exp(xd - xd.amax(-1, keepdim=True))
        expected = expected / expected.sum(-1, keepdim=True)
        tol = (1e-8, 1e-4) if dtype == torch.float32 else (1e-6, 1e-2)
        torch.testing.assert_close(ModelNew()(x).double(), expected, atol=tol[0], rtol=tol[1])
    print(f"softmax candidate ({path} path on {device}): ok")
