"""Fused RMSNorm in Triton: one program per row, one read of x, one write of y.

The kernel is rmsnorm.py beside this file (declared below, so the judge's jobs see it), which
the model program (kernels/llama_q4k) imports too.
"""

from __future__ import annotations

import torch
from rmsnorm import rmsnorm

SOURCES = ["rmsnorm.py"]


class ModelNew(torch.nn.Module):
    def __init__(self, hidden_size: int = 4096, eps: float = 1e-5) -> None:
        super().__init__()
        # Same construction order as the task's Model, so a seeded build gives the same weight.
        weight = (1.0 + 0.1 * torch.randn(hidden_size)).to(torch.bfloat16).float()
        self.weight = torch.nn.Parameter(weight)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)
