"""Q4_K prefill GEMM: one Triton pass dequantizes W to bf16, then cuBLAS multiplies.

From M of about 60 tokens the product is compute-bound, and the tensor cores need the weights
in bf16 (or fp16) in any case. The baseline gets there through a dozen PyTorch kernels and
float32 temporaries (~2.5 GB of traffic for a 14336 x 4096 matrix); this kernel gets there in
one kernel that reads the 33 MB of Q4_K blocks once and writes the 117 MB bf16 matrix once,
then calls the same torch.matmul. At M = 2048 the dequantization is a few percent of the
matmul; at M = 16 it is most of the time, which is where a fused kernel (dequantize in
registers, feed the tensor cores directly) is the next step.

The dequantization kernel: each program takes BLOCK_ROWS rows x BLOCK_KB Q4_K blocks. Per block
it loads d|dmin and the 12 scale bytes as four int32 words, and each 32-byte code chunk c once;
the chunk's low nibbles are sub-block 2c and its high nibbles sub-block 2c+1, each written as
32 contiguous bf16 values: w = (d * sc) * q - (dmin * m) in fp32, as gguf-py computes it, then
rounded once.

Where it runs: on a GPU tensor (CUDA or ROCm) the Triton kernel always runs. On a CPU tensor the
kernel runs only under the interpreter (`TRITON_INTERPRET=1`, set before this file is imported);
without it, the weights are dequantized with torch ops.

Self-check: `TRITON_INTERPRET=1 python q4k_gemm.py` (kernel), or on a GPU `python q4k_gemm.py`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

QK_K = 256  # weights per Q4_K block
BLOCK_BYTES = 144  # d (2) + dmin (2) + scales (12) + codes (128)


class DequantConfig(NamedTuple):
    block_rows: int
    block_kb: int
    num_warps: int


DEFAULT_CONFIG = DequantConfig(block_rows=4, block_kb=4, num_warps=4)


def sweep_configs(m: int) -> list[DequantConfig]:
    """The dequantization tilings `kernels/tools/sweep_q4k.py` tries (the matmul is cuBLAS's)."""
    return [
        DequantConfig(r, kb, w)
        for r, kb, w in [(1, 4, 2), (2, 4, 4), (4, 4, 4), (4, 8, 4), (8, 4, 8), (2, 8, 4)]
    ]


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 to `dtype` to nearest even, as PyTorch's casts do (the CPU interpreter
    truncates fp32 -> bf16; rounding by hand gives the same bits everywhere)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def scale_and_min(s1, s2, s3, j: tl.constexpr):
    """The 6-bit scale and min of sub-block j from the packed words s1, s2, s3 (bytes 0-11):
    j < 4: sc = s[j] & 63, m = s[j+4] & 63; j >= 4: low four bits from s[j+4], top two from
    s[j-4] (scale) and s[j] (min)."""
    if j < 4:
        sc = (s1 >> (8 * j)) & 63
        m = (s2 >> (8 * j)) & 63
    else:
        sc = ((s3 >> (8 * (j - 4))) & 0x0F) | (((s1 >> (8 * (j - 4) + 6)) & 3) << 4)
        m = ((s3 >> (8 * (j - 4) + 4)) & 0x0F) | (((s2 >> (8 * (j - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), m.to(tl.float32)


@triton.jit
def dequantize_q4k_kernel(
    w_ptr,  # uint8 [N, n_blocks * 144]
    w_words_ptr,  # the same bytes as int32
    out_ptr,  # [N, n_blocks * 256]
    n_rows,
    n_blocks,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_KB: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    blocks = tl.program_id(1) * BLOCK_KB + tl.arange(0, BLOCK_KB)
    ok = (rows < n_rows)[:, None] & (blocks < n_blocks)[None, :]  # [R, KB]
    block_index = rows.to(tl.int64)[:, None] * n_blocks + blocks[None, :]
    words = block_index * 36  # 36 int32 words per block
    head = tl.load(w_words_ptr + words, mask=ok, other=0).to(tl.uint32, bitcast=True)
    s1 = tl.load(w_words_ptr + words + 1, mask=ok, other=0).to(tl.uint32, bitcast=True)
    s2 = tl.load(w_words_ptr + words + 2, mask=ok, other=0).to(tl.uint32, bitcast=True)
    s3 = tl.load(w_words_ptr + words + 3, mask=ok, other=0).to(tl.uint32, bitcast=True)
    d = (head & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (head >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    lanes = tl.arange(0, 32)
    ok3 = ok[:, :, None]
    code_bytes = block_index * 144 + 16  # [R, KB]
    out_base = block_index * 256  # [R, KB]
    for c in tl.static_range(4):
        packed = tl.load(
            w_ptr + (code_bytes + 32 * c)[:, :, None] + lanes[None, None, :], mask=ok3, other=0
        )
        for n in tl.static_range(2):
            sc, m = scale_and_min(s1, s2, s3, 2 * c + n)
            q = ((packed >> (4 * n)) & 0x0F).to(tl.float32)
            w = (d * sc)[:, :, None] * q - (dmin * m)[:, :, None]
            dest = out_ptr + (out_base + 32 * (2 * c + n))[:, :, None] + lanes[None, None, :]
            tl.store(dest, round_to(w, out_ptr.dtype.element_ty), mask=ok3)


def _runs_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def _dequantize_torch(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [N, n * 144] into float32 [N, n * 256] with torch ops (CPU fallback)."""
    blocks = packed.reshape(-1, BLOCK_BYTES)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    dmin = blocks[:, 2:4].contiguous().view(torch.float16).float()
    s = blocks[:, 4:16]
    sc = torch.cat([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], dim=-1)
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    weights = (d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]
    return weights.reshape(packed.shape[0], -1)


def dequantize_to(
    weight_q4k: torch.Tensor, dtype: torch.dtype, config: DequantConfig | None = None
) -> torch.Tensor:
    """Q4_K bytes [N, K / 256 * 144] -> [N, K] in `dtype`, in one Triton pass where it can."""
    n_rows, row_bytes = weight_q4k.shape
    if weight_q4k.dtype != torch.uint8 or row_bytes % BLOCK_BYTES:
        raise ValueError(
            f"weight must be uint8 Q4_K rows of whole 144-byte blocks, got {weight_q4k.dtype} {tuple(weight_q4k.shape)}"
        )
    n_blocks = row_bytes // BLOCK_BYTES
    if not _runs_triton(weight_q4k):
        return _dequantize_torch(weight_q4k).to(dtype)
    weight_q4k = weight_q4k.contiguous()
    out = torch.empty((n_rows, n_blocks * QK_K), dtype=dtype, device=weight_q4k.device)
    if out.numel() == 0:
        return out
    config = config or DEFAULT_CONFIG
    grid = (triton.cdiv(n_rows, config.block_rows), triton.cdiv(n_blocks, config.block_kb))
    dequantize_q4k_kernel[grid](
        weight_q4k,
        weight_q4k.view(torch.int32),
        out,
        n_rows,
        n_blocks,
        BLOCK_ROWS=config.block_rows,
        BLOCK_KB=config.block_kb,
        num_warps=config.num_warps,
    )
    return out


def q4k_gemm(
    x: torch.Tensor, weight_q4k: torch.Tensor, config: DequantConfig | None = None
) -> torch.Tensor:
    """x [M, K] @ dequantize(weight_q4k [N, K / 256 * 144]).T -> [M, N] in x's dtype."""
    k = x.shape[-1]
    if k % QK_K or weight_q4k.shape[-1] != k // QK_K * BLOCK_BYTES:
        raise ValueError(f"weight must be [N, {k // QK_K * BLOCK_BYTES}] Q4_K rows for K={k}")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16, got {x.dtype}")
    return x @ dequantize_to(weight_q4k, x.dtype, config).T


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = "triton" if device == "cuda" or os.environ.get("TRITON_INTERPRET") == "1" else "torch"
    for rows, k in [(32, 256), (9, 1280)]:
        weight = torch.randint(0, 256, (rows, k // QK_K * BLOCK_BYTES), dtype=torch.uint8)
        halves = weight.view(torch.float16)  # finite, Llama-sized d and dmin
        halves[:, 0::72] = (1e-4 * (0.5 + torch.rand(rows, k // QK_K))).half()
        halves[:, 1::72] = (7.5e-4 * (0.5 + torch.rand(rows, k // QK_K))).half()
        want = _dequantize_torch(weight)
        for dtype in (torch.bfloat16, torch.float16):
            got = dequantize_to(weight.to(device), dtype).cpu()
            # Equal up to one rounding step: a GPU may fuse (d * sc) * q - dmin * m into an FMA.
            torch.testing.assert_close(got.float(), want.to(dtype).float(), atol=1e-6, rtol=2**-7)
        x = torch.randn(5, k, dtype=torch.bfloat16)
        out = q4k_gemm(x.to(device), weight.to(device)).double().cpu()
        expected = x.double() @ want.double().T
        torch.testing.assert_close(out, expected, atol=5e-2, rtol=2e-2)
    print(f"q4k_gemm ({path} path on {device}): ok")
