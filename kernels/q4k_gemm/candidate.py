"""Q4_K prefill GEMM: one Triton pass dequantizes W to bf16, then cuBLAS multiplies.

The kernel is q4k_gemm.py beside this file (declared below, so the judge's jobs see it), whose
`dequantize_to` the model program (kernels/llama_q4k) uses for prefill.
"""

from __future__ import annotations

import torch
from q4k_gemm import q4k_gemm

SOURCES = ["q4k_gemm.py"]


class ModelNew(torch.nn.Module):
    def forward(self, x: torch.Tensor, weight_q4k: torch.Tensor) -> torch.Tensor:
        return q4k_gemm(x, weight_q4k)
