"""Fused Q4_K GEMV: y = x @ W.T with W dequantized in registers, never in memory.

The kernels are this directory's library, declared below so the judge's jobs see them:
q4k_gemv.py picks one (CUDA on Hopper, Triton elsewhere, torch on a plain CPU tensor),
q4k_gemv_policy.py holds the launch choices, q4k_gemv_triton.py the Triton kernels, and
q4k_gemv_cuda.py builds q4k_gemv.cu. The model program (kernels/llama_q4k) imports the same
modules.
"""

from __future__ import annotations

import torch
from q4k_gemv import q4k_gemv

SOURCES = ["q4k_gemv.py", "q4k_gemv_policy.py", "q4k_gemv_triton.py", "q4k_gemv_cuda.py", "q4k_gemv.cu"]


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        return q4k_gemv(x, weight_q4k)
