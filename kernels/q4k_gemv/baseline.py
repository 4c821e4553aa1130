"""The slow baseline for the Q4_K GEMV task: dequantize the whole matrix, then a dense GEMM.

Every call expands W from 0.5625 to 4 bytes per weight in memory (about a dozen elementwise
kernels), then runs a float32 matmul (cuBLAS SGEMM on a GPU; TF32 stays off by default), then
rounds to x's dtype. It reads and writes ~14x the bytes a fused kernel needs. The product is in
float32 rather than x's dtype because rounding dequantized weights to bf16 moves near-zero
outputs of the 14336-long rows past the task's atol.
"""

from __future__ import annotations

import torch

QK_K = 256
BLOCK_BYTES = 144


def dequantize_q4_k(packed: torch.Tensor) -> torch.Tensor:
    """Q4_K bytes [..., n * 144] into float32 [..., n * 256]; bit-identical to gguf-py."""
    lead = packed.shape[:-1]
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
    # (d * sc) * q - (dmin * m), in float32 and in this order, as gguf-py and llama.cpp do
    return ((d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]).reshape(
        *lead, -1
    )


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        weight = dequantize_q4_k(weight_q4k)
        return (x.float() @ weight.T).to(x.dtype)


if __name__ == "__main__":
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    packed = torch.randint(0, 256, (64, 2 * BLOCK_BYTES), dtype=torch.uint8)
    packed[:, 0:2] = packed[:, 144:146] = torch.tensor([0x00, 0x10], dtype=torch.uint8)  # d ~ 5e-4
    packed[:, 2:4] = packed[:, 146:148] = torch.tensor([0x00, 0x14], dtype=torch.uint8)  # ~1e-3
    ours = dequantize_q4_k(packed).numpy()
    reference = dequantize(packed.numpy(), GGMLQuantizationType.Q4_K)
    assert (ours.view("u4") == reference.view("u4")).all(), "dequantizer differs from gguf"
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    expected = x.double() @ torch.from_numpy(reference).double().T
    torch.testing.assert_close(ModelNew()(x, packed).double(), expected, atol=1e-2, rtol=1e-2)
    print("q4k_gemv baseline: ok (dequantizer bit-identical to gguf)")
