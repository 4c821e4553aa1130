"""Fused RoPE in Triton: q and k rotated in one launch, one read and one write of each head.

The kernel is rope.py beside this file (declared below, so the judge's jobs see it), which the
model program (kernels/llama_q4k) imports too.
"""

from __future__ import annotations

import torch
from rope import apply_rope, rope_inv_freq

SOURCES = ["rope.py"]


class ModelNew(torch.nn.Module):
    def __init__(self, head_dim: int = 128, rope_theta: float = 500000.0) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(positions, q, k, self.inv_freq)
