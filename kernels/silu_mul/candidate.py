"""Fused SiLU-and-multiply in Triton: out = silu(gate) * up in one read and one write.

The kernel is silu_mul.py beside this file (declared below, so the judge's jobs see it), which
the model program (kernels/llama_q4k) imports too, with its PDL launch helpers.
"""

from __future__ import annotations

import torch
from silu_mul import silu_mul

SOURCES = ["silu_mul.py"]


class ModelNew(torch.nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
