"""Fused Q4_K GEMV in Triton: y = x @ W.T with W dequantized in registers, never in memory.

Each program owns BLOCK_N output rows and walks K one 256-weight Q4_K block at a time. For each
block it loads, per row, the fp16 d and dmin, the 12 packed scale/min bytes (unpacked to eight
6-bit scales and mins), and the 128 code bytes as one contiguous [4, 32] tile; the low and high
nibbles are interleaved back into sub-block order with join/permute/reshape, giving a
[BLOCK_N, 8, 32] tile of weights w = (d * sc) * q - (dmin * m) in fp32. That tile is then
multiplied by each of the up-to-8 batch rows of x (decode) and reduced into fp32 accumulators,
so the weight bytes are read from memory once per launch whatever the batch. The output is
rounded to x's dtype once.

Weights are read once (0.5625 B each); x is re-read per row block but stays in L1/L2.

Where it runs: on a GPU tensor (CUDA or ROCm) the Triton kernel always runs. On a CPU tensor the
kernel runs only under the interpreter (`TRITON_INTERPRET=1`, set before this file is imported);
without it, `forward` dequantizes with torch and multiplies in fp32, so the model works anywhere.

Not tuned on a GPU: BLOCK_N, warps, the per-sub-block factorisation llama.cpp uses
(d sc sum(q x) - dmin m sum(x)) and split-K for the 4096 x 14336 shape are the next steps there.

Self-check: `TRITON_INTERPRET=1 python candidate.py` (kernel), or on a GPU `python candidate.py`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

QK_K = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # d (2) + dmin (2) + scales (12) + codes (128)
MAX_BATCH_PER_PROGRAM = 8  # decode batches; larger batches take more programs along grid axis 1
BLOCK_N = 16  # output rows per program


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
def q4k_gemv_kernel(
    x_ptr,
    w_bytes_ptr,
    w_halves_ptr,  # the same weight bytes viewed as fp16, to load d and dmin directly
    out_ptr,
    batch,
    n_rows,
    n_blocks,
    x_row_stride,
    out_row_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    first_batch = tl.program_id(1) * BLOCK_B
    batch_ids = first_batch + tl.arange(0, BLOCK_B)
    sub_blocks = tl.arange(0, 8)
    lanes = tl.arange(0, 32)
    row_start = rows.to(tl.int64) * (n_blocks * 144)  # byte offset of each row
    acc = tl.zeros([BLOCK_B, BLOCK_N], dtype=tl.float32)

    for kb in range(0, n_blocks):
        block = row_start + kb * 144  # [BLOCK_N] byte offset of this Q4_K block, always even
        d = tl.load(w_halves_ptr + block // 2, mask=row_ok, other=0.0).to(tl.float32)
        dmin = tl.load(w_halves_ptr + block // 2 + 1, mask=row_ok, other=0.0).to(tl.float32)

        # 6-bit scales and mins of sub-blocks j = 0..7 from the 12 bytes s[0..11] at block + 4:
        # j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: the low nibbles are in s[j+4], the
        # top two bits in s[j-4] (scale) and s[j] (min).
        scale_bytes = w_bytes_ptr + block[:, None] + 4
        s_j = tl.load(scale_bytes + sub_blocks[None, :], mask=row_ok[:, None], other=0)
        s_j4 = tl.load(scale_bytes + 4 + sub_blocks[None, :], mask=row_ok[:, None], other=0)
        s_low = tl.load(scale_bytes + (sub_blocks % 4)[None, :], mask=row_ok[:, None], other=0)
        high_half = (sub_blocks >= 4)[None, :]
        sc = tl.where(high_half, (s_j4 & 0x0F) | ((s_low >> 6) << 4), s_j & 63)
        m = tl.where(high_half, (s_j4 >> 4) | ((s_j >> 6) << 4), s_j4 & 63)
        step = d[:, None] * sc.to(tl.float32)  # [BLOCK_N, 8]
        offset = dmin[:, None] * m.to(tl.float32)

        # Codes: chunk c's 32 bytes hold sub-block 2c in the low nibbles and 2c+1 in the high.
        chunks = tl.arange(0, 4)
        code_ptrs = (
            w_bytes_ptr
            + block[:, None, None]
            + 16
            + chunks[None, :, None] * 32
            + lanes[None, None, :]
        )
        packed = tl.load(code_ptrs, mask=row_ok[:, None, None], other=0)  # [BLOCK_N, 4, 32]
        nibbles = tl.join(packed & 0x0F, packed >> 4)  # [BLOCK_N, 4, 32, 2]
        codes = tl.reshape(tl.permute(nibbles, (0, 1, 3, 2)), (BLOCK_N, 8, 32))
        weights = step[:, :, None] * codes.to(tl.float32) - offset[:, :, None]

        x_cols = kb * 256 + sub_blocks[:, None] * 32 + lanes[None, :]  # [8, 32]
        for b in tl.static_range(BLOCK_B):
            batch_row = first_batch + b
            in_batch = (x_cols * 0 + batch_row) < batch  # the mask as a tile, not a scalar
            x_row = x_ptr + batch_row.to(tl.int64) * x_row_stride
            x = tl.load(x_row + x_cols, mask=in_batch, other=0.0).to(tl.float32)
            partial = tl.sum(tl.sum(weights * x[None, :, :], axis=2), axis=1)  # [BLOCK_N]
            acc = tl.where(tl.arange(0, BLOCK_B)[:, None] == b, acc + partial[None, :], acc)

    out_ptrs = out_ptr + batch_ids.to(tl.int64)[:, None] * out_row_stride + rows[None, :]
    out_ok = (batch_ids < batch)[:, None] & row_ok[None, :]
    tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=out_ok)


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _dequantize_q4_k(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [..., n * 144] into float32 [..., n * 256] (the CPU path without Triton)."""
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    # Chunk c's low nibbles are sub-block 2c, its high nibbles 2c+1. (No tensor literal here:
    # copying one to the GPU inside forward would break CUDA-graph capture.)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    weights = (d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]
    return weights.reshape(*packed.shape[:-1], -1)


def q4k_gemv(x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
    """x [batch, K] @ dequantize(weight_q4k [N, K / 256 * 144]).T -> [batch, N] in x's dtype."""
    batch, k = x.shape
    n_rows = weight_q4k.shape[0]
    if (
        k % QK_K
        or weight_q4k.dtype != torch.uint8
        or weight_q4k.shape[1] != k // QK_K * BLOCK_BYTES
    ):
        raise ValueError(f"weight must be uint8 [N, {k // QK_K * BLOCK_BYTES}] Q4_K rows for K={k}")
    if not _runs_triton(x):
        return (x.float() @ _dequantize_q4_k(weight_q4k).T).to(x.dtype)

    weight_q4k = weight_q4k.contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((batch, n_rows), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_b = min(triton.next_power_of_2(batch), MAX_BATCH_PER_PROGRAM)
    grid = (triton.cdiv(n_rows, BLOCK_N), triton.cdiv(batch, block_b))
    q4k_gemv_kernel[grid](
        x,
        weight_q4k,
        weight_q4k.view(torch.float16),
        out,
        batch,
        n_rows,
        k // QK_K,
        x.stride(0),
        out.stride(0),
        BLOCK_N=BLOCK_N,
        BLOCK_B=block_b,
        num_warps=4,
    )
    return out


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        return q4k_gemv(x, weight_q4k)


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    for batch, n_rows, k, dtype in [(1, 32, 256, torch.bfloat16), (3, 20, 512, torch.float16)]:
        weight = torch.randint(0, 256, (n_rows, k // QK_K * BLOCK_BYTES), dtype=torch.uint8)
        halves = weight.view(torch.float16)  # d and dmin of every block: finite, Llama-sized
        halves[:, 0::72] = (1e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        halves[:, 1::72] = (7.5e-4 * (0.5 + torch.rand(n_rows, k // QK_K))).half()
        x = torch.randn(batch, k, dtype=dtype)
        expected = x.double() @ _dequantize_q4_k(weight).double().T
        out = ModelNew()(x.to(device), weight.to(device))
        torch.testing.assert_close(out.double().cpu(), expected, atol=1e-2, rtol=1e-2)
    print(f"q4k_gemv candidate ({path} path on {device}): ok")
