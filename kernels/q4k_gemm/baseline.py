"""The slow baseline for the Q4_K prefill GEMM: dequantize with PyTorch ops, then torch.matmul.

This is "dequantize to bf16 + torch.matmul" as a framework user writes it: about a dozen
elementwise kernels expand the packed weights through float32 temporaries into a bf16 matrix,
then cuBLAS multiplies. The matmul is the same one the candidate calls; what differs is the
cost of getting the weights into bf16.
"""

from __future__ import annotations

import torch

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
    qs = blocks[:, 16:].reshape(-1, 4, 32)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32).float()
    weights = (d * sc.float())[:, :, None] * codes - (dmin * m.float())[:, :, None]
    return weights.reshape(*lead, -1)


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        return x @ dequantize_q4_k(weight_q4k).to(x.dtype).T
